"""Migrations keep everything or say why: fields, one-hot labels, HDF5 splits, .npy,
pickles only with --allow-pickle, a quiet -q; and from_dask keeps the class names of labels().

Real HDF5 files (h5py) and .npy/.npz files written here; the CLI through carraystore.cli.main.main.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

import carraystore
from carraystore.cli.main import main
from carraystore.migrations import migrate
from carraystore.migrations.base import OneHotLabelsError, PickleNotAllowedError
from carraystore.migrations.core import migrate_splits

h5py = pytest.importorskip("h5py")

NAMES = [f"c{i}" for i in range(8)]
N = 40


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(18)
    return rng.integers(0, 256, (N, 16, 16, 3), dtype=np.uint8), rng.integers(0, 8, N)


def _onehot(y: np.ndarray) -> np.ndarray:
    return np.eye(8, dtype=np.float32)[y]


def _onehot_h5(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    with h5py.File(path, "w") as f:
        f["images"] = x
        f["labels"] = _onehot(y)
        f["class_names"] = np.array(NAMES, dtype="S")
        f["sample_id"] = np.arange(1000, 1000 + N, dtype=np.int64)
        f["mean_pixel"] = np.array([0.5, 0.4, 0.3])  # not one per row


def test_hdf5_onehot_labels_become_a_field_with_a_note(data, tmp_path: Path, capsys) -> None:
    x, y = data
    h5 = tmp_path / "onehot.h5"
    _onehot_h5(h5, x, y)
    assert main(["migrate", str(h5), str(tmp_path / "o.b2nd")]) == 0
    out = capsys.readouterr().out
    s = carraystore.open(tmp_path / "o.b2nd")
    np.testing.assert_array_equal(s[:], x)
    assert s.labels is None
    np.testing.assert_array_equal(s.columns["labels"], _onehot(y))  # the one-hot rows, exactly
    np.testing.assert_array_equal(s.columns["sample_id"], np.arange(1000, 1000 + N))
    assert s.attrs["class_names"] == NAMES
    assert "kept as the target field 'labels'" in out and "--onehot-to-class" in out
    assert "not migrated: 'mean_pixel' (not one row per item" in out
    assert "fields:  labels float32[8], sample_id int64" in out


def test_hdf5_onehot_to_class_keeps_class_names(data, tmp_path: Path) -> None:
    x, y = data
    h5 = tmp_path / "onehot.h5"
    _onehot_h5(h5, x, y)
    report = migrate(h5, tmp_path / "o.b2nd", onehot_to_class=True)
    s = carraystore.open(tmp_path / "o.b2nd")
    np.testing.assert_array_equal(s.labels, y)
    assert s.class_names == tuple(NAMES) and report.labels
    np.testing.assert_array_equal(s.columns["sample_id"], np.arange(1000, 1000 + N))
    assert "labels" not in s.columns
    bad = _onehot(y)
    bad[7] = 0.5  # not one-hot: refused by name, nothing written
    with h5py.File(tmp_path / "bad.h5", "w") as f:
        f["images"] = x
        f["labels"] = bad
    with pytest.raises(OneHotLabelsError, match="first row 7"):
        migrate(tmp_path / "bad.h5", tmp_path / "b.b2nd", onehot_to_class=True)
    assert not (tmp_path / "b.b2nd").exists()


def test_hdf5_float_target_is_a_field(data, tmp_path: Path) -> None:
    x, _ = data
    angle = np.linspace(-1, 1, N, dtype=np.float32)[:, None]
    with h5py.File(tmp_path / "drive.h5", "w") as f:
        f["images"] = x
        f["y"] = angle
        f["names"] = np.array([f"f{i}.jpg" for i in range(N)], dtype=object)  # variable-length text
        f["masks"] = np.zeros((N, 64, 128), np.uint8)  # one per row but too large for a field
    report = migrate(tmp_path / "drive.h5", tmp_path / "o.b2nd", dataset="images")
    s = carraystore.open(tmp_path / "o.b2nd")
    assert s.labels is None
    np.testing.assert_array_equal(s.columns["y"], angle)
    assert list(s.columns["names"]) == [f"f{i}.jpg" for i in range(N)]
    assert any("kept as the target field 'y'" in n for n in report.notes)
    assert any(n.startswith("not migrated: 'masks'") and "bytes per item" in n for n in report.notes)


def test_hdf5_groups_as_splits(data, tmp_path: Path, capsys) -> None:
    x, y = data
    h5 = tmp_path / "splits.h5"
    with h5py.File(h5, "w") as f:
        f["train/images"], f["train/labels"], f["train/sample_id"] = x[:30], y[:30], np.arange(30)
        f["val/images"], f["val/labels"], f["val/sample_id"] = x[30:], y[30:], np.arange(30, N)
        f["class_names"] = np.array(NAMES, dtype="S")
    assert main(["migrate", str(h5), str(tmp_path / "stores")]) == 0
    assert capsys.readouterr().out.count("migrated HDF5 dataset") == 2
    for name, sl in (("train", slice(0, 30)), ("val", slice(30, N))):
        s = carraystore.open(tmp_path / "stores" / f"{name}.b2nd")
        np.testing.assert_array_equal(s[:], x[sl])
        np.testing.assert_array_equal(s.labels, y[sl])
        np.testing.assert_array_equal(s.columns["sample_id"], np.arange(N)[sl])
        assert s.class_names == tuple(NAMES)
    reports = migrate_splits(h5, tmp_path / "d_{group}.b2nd")
    assert set(reports) == {"train", "val"} and len(carraystore.open(tmp_path / "d_val.b2nd")) == 10
    assert main(["migrate", str(h5), str(tmp_path / "t.b2nd"), "--group", "train", "-q"]) == 0
    np.testing.assert_array_equal(carraystore.open(tmp_path / "t.b2nd").labels, y[:30])
    assert main(["migrate", str(h5), str(tmp_path / "one.b2nd")]) == 2  # one .b2nd for two splits
    assert "--group NAME" in capsys.readouterr().err and not (tmp_path / "one.b2nd").exists()


def test_npy_and_npz_of_arrays(data, tmp_path: Path) -> None:
    x, y = data
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    migrate(tmp_path / "x.npy", tmp_path / "a.b2nd", labels=tmp_path / "y.npy")
    s = carraystore.open(tmp_path / "a.b2nd")
    np.testing.assert_array_equal(s[:], x)
    np.testing.assert_array_equal(s.labels, y)
    np.save(tmp_path / "f.npy", np.asfortranarray(x[:, :, :, 0]))
    migrate(tmp_path / "f.npy", tmp_path / "f.b2nd")
    np.testing.assert_array_equal(carraystore.open(tmp_path / "f.b2nd")[:], x[:, :, :, 0])
    np.savez(tmp_path / "d.npz", images=x, labels=_onehot(y), sample_id=np.arange(N), info=np.arange(3))
    report = migrate(tmp_path / "d.npz", tmp_path / "z.b2nd")
    s = carraystore.open(tmp_path / "z.b2nd")
    assert s.labels is None and s.columns["labels"].shape == (N, 8)
    assert any(n.startswith("not migrated: 'info'") for n in report.notes)
    migrate(tmp_path / "d.npz", tmp_path / "h.b2nd", onehot_to_class=True)
    np.testing.assert_array_equal(carraystore.open(tmp_path / "h.b2nd").labels, y)


def test_pickles_only_with_allow_pickle(data, tmp_path: Path, capsys) -> None:
    x, _ = data
    words = np.array([f"word{i}" for i in range(N)], dtype=object)
    np.save(tmp_path / "w.npy", words, allow_pickle=True)
    with (tmp_path / "x.pkl").open("wb") as f:
        pickle.dump(x, f)
    for src in ("w.npy", "x.pkl"):
        with pytest.raises(PickleNotAllowedError, match="runs code"):
            migrate(tmp_path / src, tmp_path / "p.b2nd")
        assert main(["migrate", str(tmp_path / src), str(tmp_path / "p.b2nd")]) == 2
        assert "--allow-pickle" in capsys.readouterr().err and not (tmp_path / "p.b2nd").exists()
    migrate(tmp_path / "w.npy", tmp_path / "w.b2nd", allow_pickle=True)
    assert list(carraystore.open(tmp_path / "w.b2nd")[:]) == list(words)
    migrate(tmp_path / "x.pkl", tmp_path / "x.b2nd", allow_pickle=True)
    np.testing.assert_array_equal(carraystore.open(tmp_path / "x.b2nd")[:], x)
    assert "unpickling runs code" in _help(capsys)


def _help(capsys) -> str:
    with pytest.raises(SystemExit):
        main(["migrate", "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_quiet_prints_nothing(data, tmp_path: Path, capsys) -> None:
    x, y = data
    np.savez(tmp_path / "d.npz", images=x, labels=y)
    assert main(["migrate", str(tmp_path / "d.npz"), str(tmp_path / "o.b2nd"), "-q"]) == 0
    got = capsys.readouterr()
    assert got.out == "" and got.err == ""
    assert main(["migrate", str(tmp_path / "d.npz"), str(tmp_path / "o.b2nd"), "-q"]) == 2  # exists: still said
    assert "already exists" in capsys.readouterr().err


def test_from_dask_keeps_the_class_names_of_labels(data, tmp_path: Path) -> None:
    cdask = pytest.importorskip("carraystore.dask")
    x, y = data
    with carraystore.create(tmp_path / "s.b2nd", x.shape[1:], class_names=NAMES) as w:
        w.append(x, labels=y)
    lab = cdask.labels(tmp_path / "s.b2nd")
    assert lab.class_names == tuple(NAMES) and type(lab == 3) is np.ndarray
    out = cdask.from_dask(cdask.to_dask(tmp_path / "s.b2nd"), tmp_path / "o.b2nd", labels=lab)
    assert out.class_names == tuple(NAMES)
    np.testing.assert_array_equal(out.labels, y)
    sub = cdask.from_dask(cdask.to_dask(tmp_path / "s.b2nd")[:10], tmp_path / "p.b2nd", labels=lab[:10])
    assert sub.class_names == tuple(NAMES)
