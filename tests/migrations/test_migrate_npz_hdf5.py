"""``.npz`` caches and HDF5 files (real files written by numpy and h5py, real photos)."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest
from helpers import hide_module

import carraystore
from carraystore.base.errors import MigrationError, MissingDependencyError
from carraystore.migrations import migrate
from carraystore.migrations.npz import relative_keys


def _cache(photo_arrays, root: str) -> dict[str, np.ndarray]:
    x, _, keys = photo_arrays
    return {f"{root}/{k}": img for k, img in zip(keys, x, strict=True)}


@pytest.mark.parametrize("compressed", [False, True])
def test_npz_cache_of_absolute_paths(photo_arrays, tmp_path: Path, compressed: bool) -> None:
    x, y, keys = photo_arrays
    cache = _cache(photo_arrays, "/home/student/fastai/data/train")
    (np.savez_compressed if compressed else np.savez)(tmp_path / "cache.npz", **cache)
    report = migrate(tmp_path / "cache.npz", tmp_path / "o.b2nd", progress=False)
    s = carraystore.open(tmp_path / "o.b2nd")
    assert list(s.keys) == keys  # relative to the common root: no absolute path in the store
    assert not any(k.startswith("/") or "student" in k for k in s.keys)
    assert np.array_equal(s[:], x)
    assert s.class_names == ("astronaut", "chelsea", "coffee", "rocket") and np.array_equal(s.labels, y)
    assert any("parent folder" in n for n in report.notes)
    assert ("deflate" in report.codec_before) == compressed


def test_npz_cache_windows_paths_and_no_class_folders(photo_arrays, tmp_path: Path) -> None:
    x = photo_arrays[0][:5]
    cache = {f"C:\\Users\\me\\imgs\\{i:03d}.png": img for i, img in enumerate(x)}
    np.savez(tmp_path / "c.npz", **cache)
    report = migrate(tmp_path / "c.npz", tmp_path / "o.b2nd", progress=False)
    s = carraystore.open(tmp_path / "o.b2nd")
    assert list(s.keys) == [f"{i:03d}.png" for i in range(5)] and s.labels is None
    assert any("no labels" in n for n in report.notes)


def test_relative_keys_rules() -> None:
    assert relative_keys(["/a/b/c.jpg", "/a/b/d/e.jpg"]) == (["c.jpg", "d/e.jpg"], "/a/b")
    assert relative_keys(["data/x/1.jpg", "data/y/2.jpg"]) == (["x/1.jpg", "y/2.jpg"], "data")
    assert relative_keys(["1.jpg", "2.jpg"])[0] == ["1.jpg", "2.jpg"]
    assert relative_keys(["~/d/cats/1.jpg", "~/d/dogs/2.jpg"])[0] == ["cats/1.jpg", "dogs/2.jpg"]
    with pytest.raises(MigrationError, match="mixes"):
        relative_keys(["/a/1.jpg", "b/2.jpg"])


def test_npz_cache_of_mixed_sizes_is_refused(photo_arrays, tmp_path: Path) -> None:
    x = photo_arrays[0]
    np.savez(tmp_path / "c.npz", **{"a/1.jpg": x[0], "a/2.jpg": x[1, :32]})
    with pytest.raises(MigrationError, match="'a/2.jpg'"):
        migrate(tmp_path / "c.npz", tmp_path / "o.b2nd", progress=False)
    assert not (tmp_path / "o.b2nd").exists()


def test_npz_arrays_stream_with_labels_and_columns(photo_arrays, tmp_path: Path) -> None:
    x, y, _ = photo_arrays
    w = np.linspace(0, 1, len(x)).astype(np.float32)
    np.savez(tmp_path / "d.npz", x=x, y=y, w=w)
    migrate(tmp_path / "d.npz", tmp_path / "o.b2nd", images="x", labels="y", progress=False)
    s = carraystore.open(tmp_path / "o.b2nd")
    assert np.array_equal(s[:], x) and np.array_equal(s.labels, y) and np.array_equal(s.columns["w"], w)
    # inferred: x is the only array of 3+ dimensions, y the only integer one per row
    report = migrate(tmp_path / "d.npz", tmp_path / "i.b2nd", progress=False)
    s = carraystore.open(tmp_path / "i.b2nd")
    assert np.array_equal(s[:], x) and np.array_equal(s.labels, y) and np.array_equal(s.columns["w"], w)
    assert any("labels inferred: 'y'" in n for n in report.notes)
    np.savez(tmp_path / "two.npz", a=x, b=x)
    with pytest.raises(MigrationError, match="--images"):
        migrate(tmp_path / "two.npz", tmp_path / "o2.b2nd", progress=False)


def test_npz_fortran_order_and_pickles(photo_arrays, tmp_path: Path) -> None:
    x = np.asfortranarray(photo_arrays[0][:6].astype(np.float32))
    np.savez(tmp_path / "f.npz", images=x)
    report = migrate(tmp_path / "f.npz", tmp_path / "o.b2nd", progress=False)
    assert np.array_equal(carraystore.open(tmp_path / "o.b2nd")[:], x)
    assert any("Fortran" in w for w in report.warnings)
    obj = np.empty(2, dtype=object)
    obj[:] = ["a", 1]
    np.savez(tmp_path / "p.npz", things=obj)
    with pytest.raises(MigrationError, match="Python objects"):
        migrate(tmp_path / "p.npz", tmp_path / "p.b2nd", progress=False)


def test_truncated_npz_is_a_clear_error(photo_arrays, tmp_path: Path) -> None:
    np.savez(tmp_path / "c.npz", **_cache(photo_arrays, "/d"))
    data = (tmp_path / "c.npz").read_bytes()
    (tmp_path / "t.npz").write_bytes(data[: len(data) // 2])
    with pytest.raises(MigrationError, match="t.npz"):
        migrate(tmp_path / "t.npz", tmp_path / "o.b2nd", progress=False)
    assert not (tmp_path / "o.b2nd").exists()
    assert zipfile.is_zipfile(tmp_path / "c.npz")


# -- HDF5 ------------------------------------------------------------------------------------

h5py = pytest.importorskip("h5py")


@pytest.mark.parametrize("chunks,compression", [((5, 64, 64, 3), "gzip"), (None, None), ((7, 64, 64, 3), "lzf")])
def test_hdf5_dataset_with_labels(photo_arrays, tmp_path: Path, chunks, compression) -> None:
    x, y, _ = photo_arrays
    with h5py.File(tmp_path / "d.h5", "w") as f:
        d = f.create_dataset(
            "train/images", data=x, chunks=chunks, compression=compression, shuffle=compression is not None
        )
        d.attrs["source"] = "photos"
        d.attrs["mean"] = np.array([0.5, 0.25])
        d.attrs["n"] = np.int32(48)
        f.create_dataset("train/labels", data=y.astype(np.int16))
        f.create_dataset("meta/version", data=np.arange(3))
    report = migrate(
        tmp_path / "d.h5", tmp_path / "o.b2nd", dataset="train/images", labels="train/labels", progress=False
    )
    s = carraystore.open(tmp_path / "o.b2nd")
    assert np.array_equal(s[:], x) and np.array_equal(s.labels, y)
    assert s.attrs == {"source": "photos", "mean": [0.5, 0.25], "n": 48}
    assert report.codec_before.startswith("hdf5 " + (compression or "uncompressed"))


def test_hdf5_infers_the_dataset_or_asks(photo_arrays, tmp_path: Path) -> None:
    x, y, _ = photo_arrays
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"] = x.astype(">f4")
        f["y"] = y
    report = migrate(tmp_path / "d.h5", tmp_path / "o.b2nd", progress=False)
    s = carraystore.open(tmp_path / "o.b2nd")
    assert s.dtype == np.dtype(">f4") and s[:].tobytes() == x.astype(">f4").tobytes()
    assert any("inferred" in n for n in report.notes)
    with h5py.File(tmp_path / "e.h5", "w") as f:
        f["a"] = x
        f["b"] = x
    with pytest.raises(MigrationError, match="--dataset"):
        migrate(tmp_path / "e.h5", tmp_path / "p.b2nd", progress=False)


def test_hdf5_variable_length_is_refused(tmp_path: Path) -> None:
    with h5py.File(tmp_path / "s.h5", "w") as f:
        f.create_dataset("names", data=["a", "bb"], dtype=h5py.string_dtype())
    with pytest.raises(MigrationError, match="variable-length"):
        migrate(tmp_path / "s.h5", tmp_path / "o.b2nd", dataset="names", progress=False)


def test_hdf5_without_h5py_says_what_to_install(photo_arrays, tmp_path: Path, monkeypatch) -> None:
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"] = photo_arrays[0][:3]
    hide_module(monkeypatch, "h5py")
    with pytest.raises(MissingDependencyError, match=r"carraystore\[migrate\]"):
        migrate(tmp_path / "d.h5", tmp_path / "o.b2nd", progress=False)
