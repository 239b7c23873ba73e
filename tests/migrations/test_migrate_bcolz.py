"""Migrating bcolz arrays written the way users wrote them (real c-blosc 1.x chunks from
``write_carray``, real photos): carrays of every shape, two carrays, ctables, object
arrays, odd metadata, damage, verification and atomic output."""

from __future__ import annotations

import json
import pickle
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import carraystore
from carraystore.base.errors import MigrationError, StoreExistsError
from carraystore.migrations import MigrationVerifyError, migrate
from carraystore.migrations.bcolz import CarrayReader
from carraystore.migrations.bcolz_sources import CarraySource
from testsupport.bcolz_writer import write_carray, write_ctable

pytest.importorskip("numcodecs", reason="write_carray uses numcodecs' c-blosc 1.x")
LOCAL = Path(__file__).resolve().parents[1] / "data" / "bcolz"


def _leftovers(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith(".")]


def _all(store: carraystore.Store) -> np.ndarray:
    """Every item as stored, in the store's dtype (np.concatenate would make it native-endian)."""
    out = np.empty(store.shape, dtype=store.dtype)
    for i in range(store.nchunks):
        a, b = store.chunk_range(i)
        out[a:b] = store.read_chunk(i)
    return out


# -- carrays -----------------------------------------------------------------------------


def test_fastai_uint8_images_become_an_image_store(photo_arrays, tmp_path: Path) -> None:
    x, y, _ = photo_arrays
    write_carray(tmp_path / "train.bc", x, chunklen=7, attrs={"mean": [0.5, 0.4, 0.3]})
    report = migrate(tmp_path / "train.bc", tmp_path / "train.b2nd", progress=False)
    s = carraystore.open(tmp_path / "train.b2nd")
    assert s.layout == "NHWC" and s.shape == x.shape and s.dtype == np.uint8
    assert np.array_equal(s[:], x)
    assert s.attrs == {"mean": [0.5, 0.4, 0.3]}
    assert report.rows == len(x) and report.codec_before == "lz4-5 shuffle" and report.verified
    assert "verified bit-exact" in report.summary() and "lz4-5 shuffle ->" in report.summary()


@pytest.mark.parametrize(
    "make,layout",
    [
        (lambda x: (x / 255.0).astype(np.float32), "NHWC"),  # fast.ai float32 NHWC
        (lambda x: np.ascontiguousarray((x / 255.0).astype(np.float32).transpose(0, 3, 1, 2)), "array"),  # Theano NCHW
        (lambda x: np.ascontiguousarray(x[..., 0]), "array"),  # (N, H, W): no channel axis is added
        (lambda x: (x.astype(np.float64) - 127.5).astype(">f8"), "array"),  # big-endian stays big-endian
        (lambda x: x.reshape(len(x), -1)[:, :10].astype(np.int16), "array"),  # 2-D features
        (lambda x: x[:, 0, 0, 0].astype(np.int64), "array"),  # 1-D
    ],
)
def test_carrays_keep_shape_and_dtype_exactly(photo_arrays, tmp_path: Path, make, layout: str) -> None:
    x = make(photo_arrays[0])
    write_carray(tmp_path / "a.bc", x, chunklen=5, cname="blosclz", shuffle=2)
    migrate(tmp_path / "a.bc", tmp_path / "a.b2nd", progress=False)
    s = carraystore.open(tmp_path / "a.b2nd")
    assert s.layout == layout and s.dtype == x.dtype and s.shape == x.shape
    got = _all(s)
    assert got.dtype == x.dtype and got.tobytes() == x.tobytes()


@pytest.mark.parametrize("content", [None, "", "\n", "  \n"])
def test_attrs_missing_empty_or_newline(photo_arrays, tmp_path: Path, content: str | None) -> None:
    write_carray(tmp_path / "a.bc", photo_arrays[0][:5], chunklen=2)
    attrs = tmp_path / "a.bc" / "__attrs__"
    if content is None:
        attrs.unlink()
    else:
        attrs.write_text(content)
    migrate(tmp_path / "a.bc", tmp_path / "a.b2nd", progress=False)
    assert carraystore.open(tmp_path / "a.b2nd").attrs == {}


def test_bad_attrs_json_names_the_file(photo_arrays, tmp_path: Path) -> None:
    write_carray(tmp_path / "a.bc", photo_arrays[0][:5], chunklen=2)
    (tmp_path / "a.bc" / "__attrs__").write_text("{not json")
    with pytest.raises(MigrationError, match="__attrs__"):
        migrate(tmp_path / "a.bc", tmp_path / "a.b2nd", progress=False)


def test_empty_chunk_file_is_named_and_nothing_is_left(photo_arrays, tmp_path: Path) -> None:
    write_carray(tmp_path / "a.bc", photo_arrays[0], chunklen=5)
    (tmp_path / "a.bc" / "data" / "__6.blp").write_bytes(b"")
    with pytest.raises(MigrationError, match=r"__6\.blp.*empty"):
        migrate(tmp_path / "a.bc", tmp_path / "a.b2nd", progress=False)
    assert not (tmp_path / "a.b2nd").exists() and not _leftovers(tmp_path)


def test_never_flushed_carray_is_a_clear_error(photo_arrays, tmp_path: Path) -> None:
    write_carray(tmp_path / "a.bc", photo_arrays[0][:9], chunklen=4)
    (tmp_path / "a.bc" / "meta" / "sizes").unlink()
    with pytest.raises(MigrationError, match="never flushed"):
        migrate(tmp_path / "a.bc", tmp_path / "a.b2nd", progress=False)
    assert not (tmp_path / "a.b2nd").exists()


def test_failure_keeps_an_existing_output(photo_arrays, tmp_path: Path) -> None:
    x = photo_arrays[0]
    write_carray(tmp_path / "a.bc", x, chunklen=5)
    out = tmp_path / "a.b2nd"
    migrate(tmp_path / "a.bc", out, progress=False)
    before = out.read_bytes()
    last = tmp_path / "a.bc" / "data" / "__9.blp"
    last.write_bytes(last.read_bytes()[:40])  # truncated: found only when that chunk is read
    with pytest.raises(MigrationError, match=r"__9\.blp"):
        migrate(tmp_path / "a.bc", out, progress=False, overwrite=True)
    assert out.read_bytes() == before and not _leftovers(tmp_path)


def test_existing_output_needs_overwrite(photo_arrays, tmp_path: Path) -> None:
    write_carray(tmp_path / "a.bc", photo_arrays[0][:5], chunklen=2)
    out = tmp_path / "a.b2nd"
    out.write_bytes(b"keep me")
    with pytest.raises(StoreExistsError):
        migrate(tmp_path / "a.bc", out, progress=False)
    assert out.read_bytes() == b"keep me"
    migrate(tmp_path / "a.bc", out, progress=False, overwrite=True)
    assert len(carraystore.open(out)) == 5


def test_verification_catches_a_difference_and_keeps_nothing(photo_arrays, tmp_path: Path, monkeypatch) -> None:
    write_carray(tmp_path / "a.bc", photo_arrays[0], chunklen=5)
    real = CarraySource.blocks
    calls = {"n": 0}

    def second_pass_differs(self):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        for i, block in enumerate(real(self)):
            if calls["n"] == 2 and i == 3:
                block.data = block.data.copy()
                block.data[1, 5, 5, 0] ^= 1  # one bit
            yield block

    monkeypatch.setattr(CarraySource, "blocks", second_pass_differs)
    with pytest.raises(MigrationVerifyError, match="row 16 differs"):
        migrate(tmp_path / "a.bc", tmp_path / "a.b2nd", progress=False)
    assert not (tmp_path / "a.b2nd").exists() and not _leftovers(tmp_path)
    calls["n"] = 0
    report = migrate(tmp_path / "a.bc", tmp_path / "a.b2nd", progress=False, verify=False)
    assert calls["n"] == 1 and not report.verified and "NOT verified" in report.summary()


def test_memory_stays_at_a_few_chunks(tmp_path: Path) -> None:
    """A 48 MB carray migrates (with verification) while numpy holds at most a few chunks."""
    from carraystore.ingest.sample_data import load_photo

    photo = load_photo("astronaut")[:256, :256]
    n, chunklen = 256, 8
    blocks = (np.roll(np.broadcast_to(photo, (16, 256, 256, 3)), i, axis=2) for i in range(n // 16))
    write_carray(tmp_path / "big.bc", blocks, chunklen, shape=(n, 256, 256, 3), dtype=np.uint8)
    nbytes = n * photo.nbytes
    tracemalloc.start()
    try:
        migrate(tmp_path / "big.bc", tmp_path / "big.b2nd", progress=False)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < nbytes / 2, f"peak {peak / 1e6:.1f} MB for a {nbytes / 1e6:.1f} MB array"
    assert peak < 24e6
    assert carraystore.open(tmp_path / "big.b2nd").verify() == []


# -- two carrays ---------------------------------------------------------------------------


def test_two_carrays_images_and_labels(photo_arrays, tmp_path: Path) -> None:
    x, y, _ = photo_arrays
    write_carray(tmp_path / "x.bc", x, chunklen=16)
    write_carray(tmp_path / "y.bc", y.astype(np.uint8), chunklen=4096)
    report = migrate(None, tmp_path / "o.b2nd", images=tmp_path / "x.bc", labels=tmp_path / "y.bc", progress=False)
    s = carraystore.open(tmp_path / "o.b2nd")
    assert np.array_equal(s[:], x) and np.array_equal(s.labels, y) and report.labels
    assert s.provenance["migrated_from"]["labels"]["dtype"] == "uint8"


def test_two_carrays_one_hot_labels(photo_arrays, tmp_path: Path) -> None:
    x, y, _ = photo_arrays
    write_carray(tmp_path / "x.bc", x, chunklen=16)
    write_carray(tmp_path / "y.bc", np.eye(4, dtype=np.float32)[y], chunklen=64)
    report = migrate(tmp_path / "x.bc", tmp_path / "o.b2nd", labels=tmp_path / "y.bc", progress=False)
    assert np.array_equal(carraystore.open(tmp_path / "o.b2nd").labels, y)
    assert any("one-hot" in n for n in report.notes)


def test_two_carrays_length_mismatch(photo_arrays, tmp_path: Path) -> None:
    x, y, _ = photo_arrays
    write_carray(tmp_path / "x.bc", x, chunklen=16)
    write_carray(tmp_path / "y.bc", y[:-1], chunklen=64)
    with pytest.raises(MigrationError, match="labels for"):
        migrate(None, tmp_path / "o.b2nd", images=tmp_path / "x.bc", labels=tmp_path / "y.bc", progress=False)


# -- ctables -------------------------------------------------------------------------------


def test_ctable_images_labels_inferred_other_columns_kept(photo_arrays, tmp_path: Path) -> None:
    x, y, keys = photo_arrays
    w = np.linspace(0, 1, len(x))
    write_ctable(
        tmp_path / "t.bc", {"id": np.arange(len(x)), "image": x, "label": y, "weight": w}, chunklen=10, attrs={"k": "v"}
    )
    report = migrate(tmp_path / "t.bc", tmp_path / "t.b2nd", progress=False)
    s = carraystore.open(tmp_path / "t.b2nd")
    assert np.array_equal(s[:], x) and np.array_equal(s.labels, y)
    assert set(s.columns) == {"id", "weight"} and np.array_equal(s.columns["weight"], w)
    assert s.attrs == {"k": "v"}
    assert any("inferred" in n for n in report.notes)


def test_ctable_explicit_columns_and_string_labels(photo_arrays, tmp_path: Path) -> None:
    x, y, keys = photo_arrays
    names = np.array([k.split("/")[0] for k in keys], dtype="S10")
    write_ctable(tmp_path / "t.bc", {"a": x, "b": x[:, ::2, ::2], "cls": names}, chunklen=9)
    with pytest.raises(MigrationError, match="--images"):
        migrate(tmp_path / "t.bc", tmp_path / "t.b2nd", progress=False)
    migrate(tmp_path / "t.bc", tmp_path / "t.b2nd", images="b", labels="cls", progress=False)
    s = carraystore.open(tmp_path / "t.b2nd")
    assert np.array_equal(s[:], x[:, ::2, ::2])
    assert [s.class_names[i] for i in s.labels] == [k.split("/")[0] for k in keys]
    assert set(s.columns) == {"a"} and np.array_equal(s.columns["a"], x)
    with pytest.raises(MigrationError, match="no column 'nope'"):
        migrate(tmp_path / "t.bc", tmp_path / "u.b2nd", images="nope", progress=False)


def test_ctable_columns_of_different_chunklen_stay_aligned(tmp_path: Path) -> None:
    root = tmp_path / "t.bc"
    root.mkdir()
    a = np.arange(1000, dtype=np.int32)
    b = np.sqrt(np.arange(1000.0))
    write_carray(root / "a", a, chunklen=7)
    write_carray(root / "b", b, chunklen=300, cname="zstd")
    (root / "__rootdirs__").write_text(json.dumps({"names": ["b", "a"]}))
    migrate(root, tmp_path / "t.b2nd", progress=False)
    got = _all(carraystore.open(tmp_path / "t.b2nd"))
    assert got.dtype.names == ("b", "a") and np.array_equal(got["a"], a) and got["b"].tobytes() == b.tobytes()


# -- object carrays ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "values,dtype",
    [
        (["cat", "dög", "a"], "<U3"),
        ([b"x", b"yz"], "S2"),
        ([1, 2**40, -3], "<i8"),
        ([1, 2.5, 3], "<f8"),
        ([True, False], "bool"),
        ([np.arange(3.0), np.ones(3)], "<f8"),
    ],
)
def test_object_carrays_become_fixed_size(tmp_path: Path, values: list, dtype: str) -> None:
    arr = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        arr[i] = v
    write_carray(tmp_path / "o.bc", arr, chunklen=2048)
    migrate(tmp_path / "o.bc", tmp_path / "o.b2nd", progress=False, allow_pickle=True)
    got = _all(carraystore.open(tmp_path / "o.b2nd"))
    assert got.dtype == np.dtype(dtype)
    assert [np.asarray(g).tolist() for g in got] == [np.asarray(v).tolist() for v in values]


def test_object_carrays_are_never_unpickled_without_permission(tmp_path: Path, monkeypatch) -> None:
    arr = np.empty(2, dtype=object)
    arr[:] = ["a", "b"]
    write_carray(tmp_path / "o.bc", arr, chunklen=10)
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("unpickled without allow_pickle"))
    with pytest.raises(MigrationError, match="--allow-pickle"):
        migrate(tmp_path / "o.bc", tmp_path / "o.b2nd", progress=False)
    with pytest.raises(MigrationError, match="allow-pickle"):
        CarrayReader.open(tmp_path / "o.bc")


def test_reader_reports_unflushed_and_stale_rows(tmp_path: Path) -> None:
    src = tmp_path / "a"
    shutil.copytree(LOCAL / "broken" / "append_a_noflush", src)
    r = CarrayReader.open(src)
    assert r.nrows == 10 and r.read().tolist() == list(range(10))
    assert r.warnings and "2 row(s)" in r.warnings[0]
    src2 = tmp_path / "b"
    shutil.copytree(LOCAL / "broken" / "trim_stale", src2)
    r2 = CarrayReader.open(src2)
    assert r2.warnings == [] and "__2.blp" in r2.notes[0]
