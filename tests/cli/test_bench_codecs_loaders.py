"""`carraystore bench codecs` and the loader comparison (`python -m bench.loaders`) on tiny real-photo data, and the
benchmark peers' correctness."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import carraystore
from bench import loaders as L
from bench.benchdata import evict_from_page_cache
from bench.loaders.command import main as loaders_main
from carraystore.cli.benchmarks import codecs as C
from carraystore.cli.benchmarks.datasets import decode_images, list_image_folder
from carraystore.cli.main import main
from carraystore.ingest.sample_data import make_photo_folder

pytest.importorskip("skimage", reason="sample photos come from scikit-image (the test extra)")


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_photo_folder(
        tmp_path_factory.mktemp("photos") / "p", n=48, size=(32, 32), classes=["astronaut", "coffee", "rocket"]
    )


# -- bench codecs ------------------------------------------------------------------------


def test_codecs_presets_on_folder_recommends(photos: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "codecs", str(photos), "--grid", "presets", "--sample", "16", "--repeats", "1", "-q"]) == 0
    out = capsys.readouterr().out
    for name in ("fast", "balanced", "small"):
        assert f"| {name} |" in out
    rec = out.split("recommended preset for data in the page cache")[1].split(":", 1)[1].split()[0]
    assert rec in carraystore.PRESETS


def test_codecs_slow_storage_recommends_the_smallest(photos: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(
            [
                "bench",
                "codecs",
                str(photos),
                "--grid",
                "presets",
                "--sample",
                "16",
                "--repeats",
                "1",
                "-q",
                "--read-mbs",
                "0.01",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    ratios = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 4 and cells[1] in carraystore.PRESETS:
            ratios[cells[1]] = float(cells[3])
    # at 10 kB/s reading dominates (decompressing 16 images, even on a loaded machine, does not):
    # the preset storing the fewest bytes must win
    assert f"reading at 0.01 MB/s: {max(ratios, key=ratios.get)}" in out


def test_codecs_quick_grid_on_store_writes_table_and_plot(
    photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = tmp_path / "s.b2nd"
    folder = list_image_folder(photos)
    images = decode_images(folder.files)
    with carraystore.create(store, images.shape[1:]) as w:
        w.append(images, labels=folder.labels)
    out_dir = tmp_path / "res"
    assert (
        main(
            [
                "bench",
                "codecs",
                str(store),
                "--grid",
                "quick",
                "--sample",
                "24",
                "--repeats",
                "1",
                "-q",
                "--out",
                str(out_dir),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "Pareto front" in out and "recommended preset" in out
    data = json.loads((out_dir / "codecs.json").read_text())
    rows = data["results"]
    assert {r["dataset"] for r in rows} == {"yours"}
    assert {r["codec"] for r in rows if r["clevel"] > 0} == {"lz4", "zstd"}
    assert all(r["nbytes"] == 24 * images[0].nbytes for r in rows)  # the sample: 24 images, no padding counted
    assert (out_dir / "codecs.png").read_bytes()[:4] == b"\x89PNG"
    assert "| yours | zstd |" in (out_dir / "codecs.md").read_text()
    # multi-image blocks are in the quick grid, each row with its single-image random-access cost
    assert {r["block_images"] for r in rows} == {1, 4, 16}
    assert all(r["random_image_us"] > 0 and r["random_image_via"] in ("block", "chunk") for r in rows)
    table = out.split("Images per block")[1].split("Presets on your data")[0]
    assert "b1: 1 image µs" in table and "b16: chunk MB/s" in table
    assert "| zstd-1 shuffle+bytedelta ts3 |" in table  # the default preset's codec is always compared


def test_random_image_cost_reads_one_block_where_getitem_can(photos: Path) -> None:
    from carraystore.format import blocks

    images = decode_images(list_image_folder(photos, limit=32).files)
    plain = [
        C.measure_codec(images, carraystore.Codec("zstd", 1, filters=(), block_images=b), repeats=1) for b in (1, 16)
    ]
    assert [r.block_images for r in plain] == [1, 16]
    assert all(r.random_image_us > 0 for r in plain)
    assert {r.random_image_via for r in plain} == {"block" if blocks.available() else "chunk"}
    # libblosc2's getitem fails on bytedelta chunks: one image then costs its whole chunk, as Store.take reads it
    delta = C.measure_codec(images, carraystore.Codec("zstd", 1, filters=("shuffle", "bytedelta")), repeats=1)
    assert delta.random_image_via == "chunk" and delta.random_image_us > 0
    # rows saved before the measure existed still load
    old = {k: v for k, v in plain[0].to_dict().items() if not k.startswith("random_image")}
    assert np.isnan(C.CodecResult.from_dict(old).random_image_us)


def test_codecs_bad_paths_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "codecs", str(tmp_path / "missing")]) == 2
    assert "give a folder of images or a .b2nd store" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["bench", "codecs", str(empty)]) == 2
    assert "no image files" in capsys.readouterr().err


def test_codecs_mixed_sizes_need_image_size(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = make_photo_folder(tmp_path / "a", n=6, size=(32, 32), classes=["coffee"])
    make_photo_folder(tmp_path / "a", n=2, size=(40, 24), classes=["rocket"])
    assert main(["bench", "codecs", str(src), "--grid", "presets", "--repeats", "1", "-q"]) == 2
    err = capsys.readouterr().err
    assert "--image-size" in err and ".jpg" in err
    assert (
        main(["bench", "codecs", str(src), "--grid", "presets", "--repeats", "1", "-q", "--image-size", "32", "32"])
        == 0
    )


# -- the loader comparison --------------------------------------------------------------------


def test_loaders_subset_writes_all_outputs(photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "res"
    argv = [
        str(photos),
        "--limit",
        "40",
        "--batch-size",
        "8",
        "--epochs",
        "1",
        "-q",
        "--peers",
        "numpy_memory,npy_files,carraystore_balanced_block",
        "--out",
        str(out_dir),
        "--work",
        str(tmp_path / "w"),
    ]
    assert loaders_main(argv) == 0
    out = capsys.readouterr().out
    assert "| one .npy per image |" in out and "| carraystore balanced, block shuffle |" in out
    data = json.loads((out_dir / "loaders.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert set(rows) == {"numpy_memory", "npy_files", "carraystore_balanced_block"}
    for r in rows.values():
        assert r["status"] == "ok" and r["n_images"] == 40 and r["images_per_s_warm"] > 0
        assert len(r["cold_s"]) == (0 if r["name"] == "numpy_memory" else 1)
    assert rows["npy_files"]["bytes_on_disk"] > 40 * 32 * 32 * 3  # raw pixels plus headers
    assert len(carraystore.open(tmp_path / "w" / "carraystore_balanced" / "data.b2nd")) == 40
    assert (out_dir / "loaders.png").read_bytes()[:4] == b"\x89PNG"


def test_loaders_list_and_bad_peer(photos: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert loaders_main(["--list"]) == 0
    out = capsys.readouterr().out
    for name in ("keras_load_img", "tfrecord", "hdf5", "zarr", "bcolz", "carraystore_fast_block"):
        assert name in out
    assert loaders_main([str(photos), "--peers", "nosuch"]) == 2
    assert "unknown loaders ['nosuch']" in capsys.readouterr().err
    assert loaders_main([]) == 2
    assert "give DIR" in capsys.readouterr().err


def test_missing_library_peer_is_skipped_with_reason(
    photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(L.Hdf5, "requires", ("h5py_not_installed_here",))
    cmp = L.run_comparison(
        photos, tmp_path / "w", limit=16, batch_size=8, epochs=1, cold=False, peers=["hdf5", "numpy_memory"]
    )
    hdf5 = cmp.row("hdf5")
    assert hdf5 is not None and hdf5.status == "skipped" and "h5py_not_installed_here is not installed" in hdf5.reason
    assert "not installed" in L.markdown_report(cmp)
    assert cmp.row("numpy_memory").status == "ok"  # type: ignore[union-attr]


# -- the peers deliver the right pixels ------------------------------------------------------


ARRAY_PEERS = [
    "npy_files",
    "npz_cache",
    "hdf5",
    "zarr",
    "bcolz",
    "numpy_memory",
    "carraystore_small_block",
    "carraystore_fast_global",
]


@pytest.mark.parametrize("name", ARRAY_PEERS + ["pillow_threads", "keras_load_img", "tfdata_jpeg", "tfrecord"])
def test_peer_epoch_yields_every_image_once(name: str, photos: Path, tmp_path: Path) -> None:
    peer = L.PEER_BY_NAME[name]
    why = peer.missing()
    if why:
        pytest.skip(f"{name}: {why}")
    ctx = L.Context(str(photos), None, None, 8, 0)
    dest, _ = L.build_artifact(peer, ctx, tmp_path)
    read = peer.reader(ctx, dest)
    xs, ys = [], []
    for x, y in read(1):
        xs.append(np.asarray(x))
        ys.append(np.asarray(y))
    x, y = np.concatenate(xs), np.concatenate(ys)
    images, labels = ctx.images, ctx.folder.labels
    assert x.shape == images.shape and sorted(y.tolist()) == sorted(labels.tolist())
    # match every delivered image to its source image (by nearest pixels: JPEG decoders differ slightly)
    src = images.reshape(len(images), -1).astype(np.float32)
    got = x.reshape(len(x), -1).astype(np.float32)
    dist = np.abs(got[:, None, :] - src[None, :, :]).mean(axis=2)
    match = dist.argmin(axis=1)
    assert sorted(match.tolist()) == list(range(len(images)))  # a permutation: each image exactly once
    assert dist.min(axis=1).max() < (2.0 if name in ("tfdata_jpeg", "tfrecord") else 1e-6)
    assert np.array_equal(labels[match], y)
    assert not np.array_equal(match, np.arange(len(images)))  # every loader shuffles


def test_chunk_shuffle_covers_everything_and_mixes() -> None:
    labels = np.arange(100)
    got = [y for _, y in L.chunk_shuffle(100, 32, 16, 0, 3, lambda a, b: labels[a:b, None], labels)]
    flat = np.concatenate(got)
    assert sorted(flat.tolist()) == list(range(100)) and [len(g) for g in got] == [16] * 6 + [4]
    assert not np.array_equal(flat, labels)


def test_evict_then_read_back_unchanged(tmp_path: Path) -> None:
    p = tmp_path / "f.bin"
    data = np.random.default_rng(0).integers(0, 255, 1 << 20, dtype=np.uint8).tobytes()
    p.write_bytes(data)
    assert evict_from_page_cache([tmp_path]) == 1
    assert p.read_bytes() == data


# -- codec-suite logic ---------------------------------------------------------------------


def _row(name: str, ratio: float, dmbs: float, clevel: int = 1, cmbs: float = 500.0) -> C.CodecResult:
    return C.CodecResult(name, "zstd", clevel, "none", 3, 1, 16, int(1e6 * ratio), int(1e6), cmbs, dmbs, dmbs)


def test_pareto_front_and_recommendation_follow_the_model() -> None:
    rows = [
        _row("none", 1.0, 20000, clevel=0),
        _row("fast", 1.1, 8000),
        _row("balanced", 1.5, 1500),
        _row("small", 2.0, 700),
        _row("bad", 1.2, 900),
    ]
    front = C.pareto_front(rows)
    assert [r.dataset for r in front] == ["none", "fast", "balanced", "small"]  # "bad" is beaten by "balanced"
    best_warm, table = C.recommend_preset([r for r in rows if r.dataset != "bad"], cores=2)
    assert best_warm == "fast"
    best_slow, _ = C.recommend_preset([r for r in rows if r.dataset != "bad"], read_mbs=50, cores=2)
    assert best_slow == "small"
    assert table["small"]["disk/network 50 MB/s"] == pytest.approx(1 / (1 / 100 + 1 / 1400))


def test_measure_codec_round_trips_real_photos(photos: Path) -> None:
    images = decode_images(list_image_folder(photos, limit=16).files)
    r = C.measure_codec(images, carraystore.Codec("zstd", 1, filters=("shuffle", "bytedelta")), repeats=1)
    assert r.typesize == 3 and r.nbytes == images.nbytes and 1.0 < r.ratio < 10
    raw = C.measure_codec(images, carraystore.Codec("zstd", 0), repeats=1)
    assert raw.ratio <= 1.0  # clevel 0 stores the bytes as they are (plus headers)
    # SHUFFLE on 1-byte items is measured when asked for explicitly (resolve() would drop it):
    # it is the identity, so it compresses to exactly the bytes of no filter
    ts1 = C.measure_codec(images, carraystore.Codec("zstd", 1, filters=("shuffle",), typesize=1), repeats=1)
    none = C.measure_codec(images, carraystore.Codec("zstd", 1, filters=(), typesize=1), repeats=1)
    assert (ts1.filters, ts1.typesize, none.filters) == ("shuffle", 1, "none")
    assert ts1.cbytes == none.cbytes


def test_cached_artifacts_are_rebuilt_when_their_inputs_change(
    photos: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    npy = L.PEER_BY_NAME["npy_files"]
    dest, _ = L.build_artifact(npy, L.Context(str(photos), 16, None, 8, 0), tmp_path)
    assert len(list(dest.glob("0*.npy"))) == 16
    mtime = (dest / "labels.npy").stat().st_mtime_ns
    L.build_artifact(npy, L.Context(str(photos), 16, None, 8, 0), tmp_path)  # same inputs: reused
    assert (dest / "labels.npy").stat().st_mtime_ns == mtime
    L.build_artifact(npy, L.Context(str(photos), 12, None, 8, 0), tmp_path)  # another subset: rebuilt
    assert len(list(dest.glob("0*.npy"))) == 12
    cs = L.PEER_BY_NAME["carraystore_fast_block"]
    ctx = L.Context(str(photos), 16, None, 8, 0)
    dest, _ = L.build_artifact(cs, ctx, tmp_path)
    assert carraystore.open(dest / "data.b2nd").codec.codec == "lz4"
    monkeypatch.setitem(carraystore.PRESETS, "fast", carraystore.Codec("zlib", 1, filters=()))
    dest, _ = L.build_artifact(cs, ctx, tmp_path)  # the preset changed: rebuilt with the new codec
    assert carraystore.open(dest / "data.b2nd").codec.codec == "zlib"


def test_grayscale_rows_never_pretend_to_filter(photos: Path) -> None:
    rgb = decode_images(list_image_folder(photos, limit=8).files)
    gray = (rgb.astype(np.float32) @ np.array([0.299, 0.587, 0.114], np.float32)).astype(np.uint8)[..., None]
    rows = C.run_suite(
        {"gray": gray}, C.codec_grid(("zstd",), (1,), ("none", "shuffle+bytedelta"), (1,), True), repeats=1
    )
    # 1-byte pixels: resolve() drops shuffle+bytedelta, so only "none" and the explicit typesize-1 shuffle are measured
    assert [(r.filters, r.typesize) for r in rows] == [("none", 1), ("shuffle-ts1", 1)]
    assert rows[0].cbytes == rows[1].cbytes  # SHUFFLE of 1-byte items is the identity
