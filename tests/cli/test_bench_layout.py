"""`carraystore bench layout`: pixels or encoded for real photos, and the numbers it prints hold together."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

import carraystore as cs
from carraystore.cli.benchmarks.datasets import decode_images, list_image_folder
from carraystore.cli.benchmarks.layout import LayoutResult, break_even
from carraystore.cli.main import main
from carraystore.ingest.sample_data import make_photo_folder
from carraystore.store.writer import create

pytest.importorskip("skimage", reason="sample photos come from scikit-image (the test extra)")


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_photo_folder(tmp_path_factory.mktemp("layout") / "p", n=40, size=(64, 64), seed=4)


def _run(args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], str]:
    out_json = tmp_path / "layout.json"
    assert main(["bench", "layout", *args, "--repeats", "2", "-q", "--json", str(out_json)]) == 0
    return json.loads(out_json.read_text()), capsys.readouterr().out


def _n(x: float) -> str:
    return f"{x:,.0f}"


def test_layout_on_real_photos_prints_what_it_measured(
    photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    links = [50.0, 100000.0]
    r, out = _run(
        [str(photos), "--sample", "32", "--cores", "4", *(f"--link-mbit={x:g}" for x in links)], tmp_path, capsys
    )
    p, e = r["pixels"], r["encoded"]
    assert r["cores"] == 4 and r["image_shape"] == [64, 64, 3] and p["images"] == e["images"] == 32
    # the bytes a store of the sampled files holds, per image: the JPEGs kept as they are (encoded) ...
    files = list_image_folder(photos, limit=32, seed=0).files
    mean_file = sum(f.stat().st_size for f in files) / len(files)
    assert e["stored_as"] == "32 jpeg"
    with create(tmp_path / "e.b2nd", (64, 64, 3), chunk_images=32, layout="encoded") as w:
        w.append_encoded([f.read_bytes() for f in files])
    with create(tmp_path / "p.b2nd", (64, 64, 3), codec="balanced", chunk_images=32) as w:
        w.append(decode_images(files))
    for x, path in ((e, "e.b2nd"), (p, "p.b2nd")):
        with cs.open(tmp_path / path) as store:
            assert store.nchunks == 1
            assert x["bytes_per_image"] == len(store.read_chunk_bytes(0)) / 32
    # (lz4 finds the JPEG headers the files share: fewer bytes than the files, never more)
    assert e["bytes_per_image"] < mean_file < p["bytes_per_image"] < p["raw_bytes_per_image"] == 64 * 64 * 3
    assert p["decode_per_core"] > 0 and e["decode_per_core"] > 0
    assert "JPEG entries decoded by" in out and r["jpeg_decoder"] in out

    for x in (p, e):  # the table shows the measured numbers
        assert (
            f"| {x['layout']} | {x['stored_as']} | {_n(x['bytes_per_image'])} | "
            f"{100 * x['bytes_per_image'] / x['raw_bytes_per_image']:.1f}% | {_n(x['decode_per_core'])} | "
            f"{_n(4 * x['decode_per_core'])} |"
        ) in out
    for row, mbit in zip(r["links"], links, strict=True):  # images/s at each link: min(link / bytes, cores x rate)
        link = mbit * 1e6 / 8
        want = {x["layout"]: min(link / x["bytes_per_image"], 4 * x["decode_per_core"]) for x in (p, e)}
        assert row["link_mbit"] == mbit
        assert row["pixels"] == pytest.approx(want["pixels"]) and row["encoded"] == pytest.approx(want["encoded"])
        assert row["best"] == ("encoded" if want["encoded"] > want["pixels"] else "pixels")
        assert f"| {mbit:,g} | {_n(row['pixels'])} | {_n(row['encoded'])} | {row['best']} |" in out
        assert f"recommended for 4 cores at {mbit:,g} Mbit/s: {row['best']} (carraystore ingest SRC OUT.b2nd" in out
    # 50 Mbit/s: both wait for the link, and the JPEGs are the fewer bytes
    assert r["links"][0]["best"] == "encoded"
    # the break-even: where encoded's cores limit meets pixels' link limit, if pixels decode faster
    if 4 * e["decode_per_core"] < 4 * p["decode_per_core"]:
        mbit = 4 * e["decode_per_core"] * p["bytes_per_image"] * 8 / 1e6
        assert r["break_even_mbit"] == pytest.approx(mbit)
        assert (r["wins_below"], r["wins_above"]) == ("encoded", "pixels")
        at = mbit * 1e6 / 8
        assert min(at / p["bytes_per_image"], 4 * p["decode_per_core"]) == pytest.approx(
            min(at / e["bytes_per_image"], 4 * e["decode_per_core"])
        )
        m = re.search(r"break-even link rate: ([\d,]+) Mbit/s", out)
        assert m and m.group(1) == _n(mbit)
        assert r["links"][1]["best"] == "pixels"  # 100 Gbit/s: past the break-even
    else:
        assert r["break_even_mbit"] is None and r["wins_below"] == r["wins_above"] == "encoded"
        assert "break-even link rate: none; encoded" in out


def test_break_even_in_every_case() -> None:
    def res(layout: str, nbytes: float, rate: float) -> LayoutResult:
        return LayoutResult(layout, "", 10, 1000, nbytes, rate)

    # encoded smaller but slower to decode: pixels overtake it at 2 cores x 100 images/s x 800 bytes
    assert break_even(res("pixels", 800, 1000), res("encoded", 200, 100), 2) == (160_000, "encoded", "pixels")
    # encoded smaller and at least as fast: encoded everywhere
    assert break_even(res("pixels", 800, 100), res("encoded", 200, 100), 2) == (None, "encoded", "encoded")
    # encoded larger (noise stored raw) and slower: pixels everywhere
    assert break_even(res("pixels", 800, 1000), res("encoded", 1000, 100), 2) == (None, "pixels", "pixels")
    # encoded larger but faster to decode: encoded wins above 3 cores x 1000 x 1000 bytes
    assert break_even(res("pixels", 800, 1000), res("encoded", 1000, 2000), 3) == (3_000_000, "pixels", "encoded")
    # the same bytes: the faster decoder, at every rate
    assert break_even(res("pixels", 500, 1000), res("encoded", 500, 10), 1) == (None, "pixels", "pixels")
    for p, e, cores in [((800, 1000), (200, 100), 2), ((800, 1000), (1000, 2000), 3)]:
        bps, _, _ = break_even(res("pixels", *p), res("encoded", *e), cores)
        assert bps is not None
        a, b = res("pixels", *p), res("encoded", *e)
        assert a.images_per_s(cores, bps) == pytest.approx(b.images_per_s(cores, bps))


def test_layout_from_a_pixel_store_and_an_encoded_store(
    photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kw: dict[str, Any] = dict(workers=1, chunk_images=16, seed=2)
    cs.from_directory(photos, tmp_path / "p.b2nd", **kw)
    cs.from_directory(photos, tmp_path / "e.b2nd", layout="encoded", **kw)
    # a pixel store: its images encoded as the writer would (PNG by default, JPEG at --quality)
    r, _ = _run([str(tmp_path / "p.b2nd"), "--sample", "16", "--cores", "1"], tmp_path, capsys)
    assert r["encoded"]["stored_as"] == "16 png" and r["quality"] is None
    r, out = _run([str(tmp_path / "p.b2nd"), "--sample", "16", "--cores", "1", "--quality", "80"], tmp_path, capsys)
    assert r["encoded"]["stored_as"] == "16 jpeg"
    assert r["links"][0]["best"] == "encoded"  # 100 Mbit/s: the link is the limit, JPEGs the fewer bytes
    assert "at 100 Mbit/s: encoded (carraystore ingest SRC OUT.b2nd --layout encoded --quality 80)" in out
    # an encoded store: its own entries, byte for byte
    r, _ = _run([str(tmp_path / "e.b2nd"), "--sample", "16", "--cores", "1"], tmp_path, capsys)
    with cs.open(tmp_path / "e.b2nd") as store:
        chunk_bytes = {len(store.read_chunk_bytes(c)) / 16 for c in range(store.nchunks) if (c + 1) * 16 <= len(store)}
    assert r["encoded"]["stored_as"] == "16 jpeg"
    assert r["encoded"]["bytes_per_image"] in chunk_bytes  # one of the store's own chunks, as it is


def test_layout_refuses_bad_arguments(photos: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "layout", str(photos), "--cores", "0"]) == 2
    assert "--cores must be at least 1" in capsys.readouterr().err
    assert main(["bench", "layout", str(photos), "--link-mbit", "-5"]) == 2
    assert "link rates must be positive" in capsys.readouterr().err
    assert main(["bench", "layout", str(photos), "--preset", "tiny"]) == 2
    assert "unknown preset" in capsys.readouterr().err
    assert main(["bench", "layout", str(photos), "--sample", "8", "--decode-size", "30", "30", "-q"]) == 2
    assert "64x64, 32x32, 16x16, 8x8" in capsys.readouterr().err


def test_layout_decode_size_reports_both_rates(
    photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r, out = _run([str(photos), "--sample", "16", "--cores", "2", "--decode-size", "32", "32"], tmp_path, capsys)
    assert r["decode_size"] == [32, 32]
    for x in (r["pixels"], r["encoded"]):
        assert x["decode_per_core"] > 0 and x["reduced_decode_per_core"] > 0
        assert (
            f"| {_n(x['decode_per_core'])} | {_n(x['reduced_decode_per_core'])} | "
            f"{_n(2 * x['reduced_decode_per_core'])} |"
        ) in out
    assert "at 32x32 | images/s on 2 cores at 32x32 |" in out and "image_size=(32, 32)" in out
    for row in r["links"]:  # the cores' limit is the reduced size's rate
        assert row["encoded"] <= 2 * r["encoded"]["reduced_decode_per_core"] + 1e-6
