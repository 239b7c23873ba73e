"""The preset for a disk: the storage rule, ``carraystore bench codecs`` measuring the disk it is given, and the
loader comparison's throttled disk and storage-speed matrix (tiny real-photo data, in this process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import carraystore
from bench import loaders as L
from bench.loaders.matrix import build_matrix, matrix_markdown, parse_link, rerender, rule_goals
from bench.loaders.throttle import open_throttle
from carraystore.base.errors import InvalidInputError
from carraystore.cli.benchmarks import codecs as C
from carraystore.cli.main import main
from carraystore.format.codec import choice_for_storage, preset_for_storage, storage_delivers
from carraystore.ingest.sample_data import make_photo_folder

pytest.importorskip("skimage", reason="sample photos come from scikit-image (the test extra)")

#: (ratio, MB/s of pixels through the loader from the page cache), as the loader comparison measures them
RATES = {"fast": (1.1, 2000.0), "balanced": (1.85, 400.0), "small": (1.9, 300.0)}
#: the rule's inputs the storage-speed matrix measured (3,000 photos of 256x256 on 2 cores): the encoded layout keeps
#: the JPEG files (12x fewer bytes than the pixels) and decodes them about as fast as ``balanced`` decompresses
MEASURED = {"fast": (1.11, 4315.0), "balanced": (1.84, 679.0), "encoded": (11.99, 732.0)}
RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_photo_folder(
        tmp_path_factory.mktemp("photos") / "p", n=24, size=(32, 32), classes=["astronaut", "coffee", "rocket"]
    )


def test_the_storage_rule_weighs_the_disk_against_the_loader() -> None:
    assert preset_for_storage(None, RATES) == "fast"  # page cache: the loader's rate alone
    assert preset_for_storage(5000, RATES) == "fast"  # a disk faster than any codec: the same
    # 1,000 MB/s: fast min(1100, 2000) = 1100 against balanced min(1850, 400) = 400
    assert preset_for_storage(1000, RATES) == "fast"
    # 200 MB/s: fast 220, balanced 370, small min(380, 300) = 300, held by its loader: balanced
    assert preset_for_storage(200, RATES) == "balanced"
    # 150 MB/s: fast 165, balanced 277.5, small 285: balanced and small tie, the fewer bytes (small) win
    assert preset_for_storage(150, RATES) == "small"
    assert preset_for_storage(150, {k: RATES[k] for k in ("fast", "balanced")}) == "balanced"
    # within the tie the higher ratio wins even when slightly slower
    assert preset_for_storage(None, {"a": (1.0, 1000.0), "b": (2.0, 950.0)}) == "b"
    assert preset_for_storage(None, {"a": (1.0, 1000.0), "b": (2.0, 850.0)}) == "a"
    for bad in ({}, {"fast": (0.0, 1.0)}, {"fast": (1.0, -1.0)}):
        with pytest.raises(InvalidInputError):
            preset_for_storage(100, bad)
    with pytest.raises(InvalidInputError):
        preset_for_storage(0, RATES)


def test_the_storage_rule_weighs_the_encoded_layout_beside_the_presets() -> None:
    assert storage_delivers(None, 11.99, 732.0) == 732.0 and storage_delivers(20, 11.99, 732.0) == 20 * 11.99
    assert choice_for_storage(None, MEASURED) == "fast"  # page cache: fast decompresses 5.9x faster
    assert choice_for_storage(1642, MEASURED) == "fast"  # the local NVMe: 1642 x 1.11 = 1,823 MB/s of pixels
    assert choice_for_storage(5000, MEASURED) == "fast"
    # 208 MB/s: fast 231, balanced 383, encoded min(2,494, 732) = 732: the disk holds every pixel store back
    assert choice_for_storage(208, MEASURED) == "encoded"
    assert choice_for_storage(46, MEASURED) == "encoded"  # the remote link: 552 against balanced's 85
    # the presets alone (exact pixels): balanced, as before
    presets = {k: v for k, v in MEASURED.items() if k != "encoded"}
    assert choice_for_storage(208, presets) == preset_for_storage(208, presets) == "balanced"
    # where it decodes slower than a preset delivers from that disk, the encoded layout loses
    slow_decode = {**MEASURED, "encoded": (11.99, 300.0)}
    assert choice_for_storage(208, slow_decode) == "balanced" and choice_for_storage(None, slow_decode) == "fast"
    # warm, balanced (679) and encoded (732) within 10%: the fewer bytes win; beyond the tie, the faster
    assert choice_for_storage(None, {k: MEASURED[k] for k in ("balanced", "encoded")}) == "encoded"
    assert choice_for_storage(None, {"balanced": (1.84, 900.0), "encoded": (11.99, 732.0)}) == "balanced"
    with pytest.raises(InvalidInputError):
        choice_for_storage(100, {"encoded": (0.0, 1.0)})


def test_the_committed_matrix_picks_the_layout_where_the_disk_is_slow() -> None:
    """The rule with the layout, on the committed loader comparison: the pick beats the best on-disk peer cold."""
    cmp = L.Comparison.from_json(json.loads((RESULTS / "loaders.json").read_text()))
    kept = json.loads((RESULTS / "storage_matrix.json").read_text())
    m = build_matrix(cmp, {**kept["info"]["remote"], "rows": kept["remote_rows"]})
    # the rule picks what measured fastest in every regime (docs/codecs.md says so of the committed run)
    assert {k: p["rule_picks"] for k, p in m["picks"].items()} == {
        k: p["measured_fastest"] for k, p in m["picks"].items()
    }
    assert m["picks"]["throttled"]["rule_picks"] == "encoded" and m["picks"]["throttled"]["rule_preset"] == "balanced"
    assert m["picks"]["remote"]["rule_picks"] == "encoded"
    throttled = m["picks"]["throttled"]
    assert throttled["best_on_disk_peer"] == "tfrecord" and throttled["rule_vs_best_peer"] >= 1.2
    assert throttled["default_vs_best_peer"] < 1.0  # the fixed default alone is below TFRecord there
    goals = rule_goals(m)
    assert goals["throttled_rule_beats_all"]["goal"] == 1.2 and goals["throttled_rule_beats_all"]["disk_bound"]
    assert goals["cold_rule_beats_all"]["goal"] == 1.0 and not goals["cold_rule_beats_all"]["disk_bound"]
    assert all(g["met"] for g in goals.values())
    text = matrix_markdown(m)
    row = next(line for line in text.splitlines() if line.startswith("| cold, disk at 200 MB/s |"))
    assert f"| encoded | encoded | {throttled['rule_vs_best_peer']:.2f}x (tfrecord) | balanced " in row, row
    assert f"`encoded` {throttled['rule_vs_best_peer']:.2f}x (goal 1.2x, met)" in text


def test_the_committed_matrix_is_what_the_code_renders(tmp_path: Path) -> None:
    for name in ("loaders.json", "storage_matrix.json"):
        (tmp_path / name).write_text((RESULTS / name).read_text())
    paths = rerender(tmp_path)
    assert paths["md"].read_text() == (RESULTS / "storage_matrix.md").read_text()
    assert json.loads(paths["json"].read_text()) == json.loads((RESULTS / "storage_matrix.json").read_text())


def _cells(out: str) -> dict[str, list[str]]:
    """The recommendation table's rows by name."""
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if cells and (cells[0] in carraystore.PRESETS or cells[0] == "encoded"):
            rows[cells[0]] = cells
    return rows


@pytest.fixture
def small_loader_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loader measurements on 1 MiB of pixels (a few seconds for all of bench codecs)."""
    monkeypatch.setattr(C, "LOADER_SAMPLE_BYTES", 1 << 20)


@pytest.mark.usefixtures("small_loader_sample")
def test_bench_codecs_weighs_the_encoded_layout_of_jpeg_files(
    photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "codecs", "--grid", "presets", "--sample", "12", "--repeats", "1", "-q", "--read-mbs", "0.05"]
    assert main([*argv[:2], str(photos), *argv[2:]]) == 0
    out = capsys.readouterr().out
    rows = _cells(out)
    assert set(rows) == {"fast", "balanced", "small", "encoded"}
    assert rows["encoded"][1] == "12 jpeg, the files as ingest --layout encoded keeps them"
    ratios = {k: float(v[2]) for k, v in rows.items()}
    assert ratios["encoded"] > 2 * max(ratios[p] for p in carraystore.PRESETS)  # the JPEG files, not their pixels
    # at 50 kB/s the bytes decide: the encoded layout, and among pixel presets the smallest
    smallest = max(carraystore.PRESETS, key=lambda p: ratios[p])
    advice = out.split("recommended for reading at 0.05 MB/s: ", 1)[1].split("\n", 1)[0]
    assert advice.startswith("--layout encoded (12 jpeg") and f"among pixel presets: {smallest} (" in advice
    assert "recommended for data in the page cache: " in out
    assert "its pixels are what the reading machine's JPEG decoder gives" in out
    assert "a pixel store gives the ingested pixels exactly" in out
    assert f"recommended preset for reading at 0.05 MB/s: {smallest}" in out  # the presets' line as before
    # an encoded store: its own entries are the candidate
    enc = tmp_path / "enc.b2nd"
    assert main(["ingest", str(photos), str(enc), "--layout", "encoded", "-q"]) == 0
    capsys.readouterr()
    assert main([*argv[:2], str(enc), *argv[2:]]) == 0
    out = capsys.readouterr().out
    assert _cells(out)["encoded"][1] == "12 jpeg, the store's entries"
    assert "recommended for reading at 0.05 MB/s: --layout encoded" in out


@pytest.mark.usefixtures("small_loader_sample")
def test_bench_codecs_on_pixels_says_the_encoded_layout_is_no_candidate(
    photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pix = tmp_path / "pix.b2nd"
    assert main(["ingest", str(photos), str(pix), "-q"]) == 0
    capsys.readouterr()
    argv = ["bench", "codecs", str(pix), "--grid", "presets", "--sample", "12", "--repeats", "1", "-q"]
    assert main([*argv, "--read-mbs", "0.05"]) == 0
    out = capsys.readouterr().out
    assert set(_cells(out)) == set(carraystore.PRESETS)
    lines = [ln for ln in out.splitlines() if "encoded" in ln]
    assert lines == [
        "encoded layout: not a candidate (pix.b2nd holds pixels, not JPEG/PNG files the encoded layout would keep)"
    ]
    assert "--layout encoded" not in out and "recommended preset for reading at 0.05 MB/s: " in out


@pytest.mark.usefixtures("small_loader_sample")
def test_bench_codecs_measures_the_disk_and_recommends_warm_and_cold(
    photos: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["bench", "codecs", str(photos), "--grid", "presets", "--sample", "12", "--repeats", "1", "-q"]
    assert main([*argv, "--probe-mb", "4"]) == 0
    out = capsys.readouterr().out
    measured = out.split("Your disk: ", 1)[1]
    mbs = float(measured.split(" MB/s", 1)[0].replace(",", ""))
    assert mbs > 0 and "a 4 MiB probe file written in" in measured and "cores" in measured.split("\n", 1)[0]
    assert not [p for p in photos.iterdir() if p.name.startswith(".carraystore-read-probe")]  # removed
    warm = out.split("recommended preset for data in the page cache: ", 1)[1].split()[0]
    cold = out.split("recommended preset for your disk, cold (", 1)[1].split(": ", 1)[1].split()[0]
    assert {warm, cold} <= set(carraystore.PRESETS)
    assert "| your disk |" in out
    # each preset's loader rate is its page-cache column, and no read speed gives more than the loader does
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if cells and cells[0] in carraystore.PRESETS:
            values = [float(c) for c in cells[4:]]
            assert max(values) == values[0] > 0, line
    # a given speed is used as it is, nothing measured
    assert main([*argv, "--read-mbs", "0.01"]) == 0
    out = capsys.readouterr().out
    assert "Your disk" not in out and "recommended preset for reading at 0.01 MB/s: " in out
    assert main([*argv, "--read-mbs", "0"]) == 2
    assert "--read-mbs must be a speed above 0" in capsys.readouterr().err


def test_throttle_says_why_it_cannot_and_the_comparison_skips_it(tmp_path: Path) -> None:
    why = open_throttle(tmp_path, 0)
    assert isinstance(why, str) and "not a speed" in why
    shm = Path("/dev/shm")
    if shm.is_dir():  # tmpfs: no block device to throttle
        assert "not a block device" in str(open_throttle(shm, 200)) or "blkio" in str(open_throttle(shm, 200))
    with pytest.raises(ValueError, match="RTT_MS:MBIT"):
        parse_link("fast")
    assert parse_link("20:400") == (20.0, 400.0) and parse_link("0:none") == (0.0, None)


def test_comparison_with_a_throttled_disk_fills_the_matrix(photos: Path, tmp_path: Path) -> None:
    """Where this machine can throttle (root, cgroup-v1 blkio) the throttled epoch runs, else the report says why."""
    cmp = L.run_comparison(
        photos,
        tmp_path / "w",
        batch_size=8,
        epochs=1,
        peers=["npy_files", "numpy_memory", "carraystore_fast_block", "carraystore_balanced_block"],
        fresh_process=False,
        throttle_mbs=200,
        probe_disk=True,
        probe_mb=8,
    )
    rows = {r.name: r for r in cmp.rows}
    assert all(r.status == "ok" and r.n_images == 24 for r in rows.values()), [(r.name, r.reason) for r in cmp.rows]
    throttle = cmp.info["throttle"]
    report = L.markdown_report(cmp)
    if "skipped" in throttle:
        assert throttle["skipped"] in report
        assert all(r.images_per_s_throttled is None for r in rows.values())
    else:
        assert not Path(throttle["cgroup"]).exists()  # removed after the run
        assert all(rows[n].images_per_s_throttled for n in ("npy_files", "carraystore_fast_block"))
        assert rows["numpy_memory"].images_per_s_throttled is None  # nothing on disk
        assert "images/s cold, 200 MB/s disk" in report and cmp.info["disk"]["throttled_read_mbs"] > 0
    assert cmp.info["disk"]["cold_read_mbs"] > 0
    data = json.loads(json.dumps(cmp.to_json()))  # the results file round-trips
    assert L.Comparison.from_json(data).row("npy_files").throttled_s == rows["npy_files"].throttled_s
    m = build_matrix(cmp, {"rtt_ms": 20, "mbit": 400, "skipped": "not in this test"})
    keys = [g["key"] for g in m["regimes"]]
    assert keys[:2] == ["warm", "cold"] and "remote" not in keys
    assert {r["name"] for r in m["rows"]} == set(rows)
    for key in keys:  # the rule's pick for every regime, from the presets' measured ratio and warm rate
        assert m["picks"][key]["rule_picks"] in ("fast", "balanced")
    text = matrix_markdown(m)
    assert "| carraystore fast, block shuffle |" in text and "remote link was not measured: not in this test" in text
