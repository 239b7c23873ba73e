"""The preset for a disk: the storage rule, ``carraystore bench codecs`` measuring the disk it is given, and the
loader comparison's throttled disk and storage-speed matrix (tiny real-photo data, in this process)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import carraystore
from bench import loaders as L
from bench.loaders.matrix import build_matrix, matrix_markdown, parse_link
from bench.loaders.throttle import open_throttle
from carraystore.base.errors import InvalidInputError
from carraystore.cli.main import main
from carraystore.format.codec import preset_for_storage
from carraystore.ingest.sample_data import make_photo_folder

pytest.importorskip("skimage", reason="sample photos come from scikit-image (the test extra)")

#: (ratio, MB/s of pixels through the loader from the page cache), as the loader comparison measures them
RATES = {"fast": (1.1, 2000.0), "balanced": (1.85, 400.0), "small": (1.9, 300.0)}


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
