"""HDF5 attributes of the file, of groups and of every migrated dataset come along (under their
HDF5 paths in ``store.attrs``) or a note names each one left out; notes name fields as the store does.

Real HDF5 files written by h5py, migrated through ``migrate`` and the CLI, read back through
``carraystore.open``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

import carraystore
from carraystore.cli.main import main
from carraystore.migrations import migrate

h5py = pytest.importorskip("h5py")

N = 12
REFERENCE = "it points into the HDF5 file, which the store does not hold"


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(29)
    return rng.integers(0, 256, (N, 8, 8, 3), dtype=np.uint8), rng.integers(0, 4, N)


def test_file_group_and_dataset_attributes_are_kept_or_named(data, tmp_path: Path) -> None:
    x, y = data
    h5 = tmp_path / "d.h5"
    with h5py.File(h5, "w") as f:
        images = f.create_dataset("train/images", data=x)
        images.attrs["source"] = "photos"
        images.attrs["range"] = np.array([np.nan, np.inf, 1.5])  # exact in a store: kept, not text
        f.attrs["title"] = "digits, cleaned"  # variable-length text
        f.attrs["author"] = np.bytes_("Ana Müller".encode())  # fixed-length UTF-8 bytes
        f.attrs["version"] = np.int64(3)
        f.attrs["mean"] = np.array([0.5, 0.25], dtype=np.float32)
        f.attrs["tags"] = np.array(["a", "bb"], dtype=h5py.string_dtype())
        f.attrs["grid"] = np.array([[b"a", b"b"], [b"c", b"d"]])
        f.attrs["clean"] = np.bool_(True)
        f.attrs["none"] = h5py.Empty("f4")
        f.attrs["origin"] = images.ref  # cannot be kept: a note says so
        f.attrs["phase"] = np.complex128(1 + 2j)  # kept as text, with a warning
        f["train"].attrs["split"] = "train"
        f["train"].attrs["count"] = np.uint16(N)
        f["train"].attrs["norm"] = np.array([[1.0, 2.0], [3.0, 4.0]])
        f["train"].attrs["window"] = images.regionref[0:2]
        f.create_dataset("train/labels", data=y).attrs["meaning"] = "digit classes"
        f.create_dataset("train/sample_id", data=np.arange(N)).attrs["unit"] = "row"
        f.create_group("config").attrs["lr"] = 0.01  # a group of attributes only: file metadata
        f.create_dataset("meta/version", data=np.arange(3))  # not migrated, and its group's attributes with it
        f["meta"].attrs["owner"] = "lab"
        f.create_group("meta/notes").attrs["by"] = "lab"
    report = migrate(h5, tmp_path / "o.b2nd", dataset="train/images", labels="train/labels", progress=False)
    s = carraystore.open(tmp_path / "o.b2nd")
    np.testing.assert_array_equal(s[:], x)
    np.testing.assert_array_equal(s.labels, y)
    assert s.attrs["source"] == "photos"
    assert math.isnan(s.attrs["range"][0]) and s.attrs["range"][1:] == [math.inf, 1.5]
    assert s.attrs["/"] == {
        "title": "digits, cleaned",
        "author": "Ana Müller",
        "version": 3,
        "mean": [0.5, 0.25],
        "tags": ["a", "bb"],
        "grid": [["a", "b"], ["c", "d"]],
        "clean": True,
        "none": None,
        "phase": "(1+2j)",
    }
    assert s.attrs["/train"] == {"split": "train", "count": N, "norm": [[1.0, 2.0], [3.0, 4.0]]}
    assert s.attrs["/train/labels"] == {"meaning": "digit classes"}
    assert s.attrs["/train/sample_id"] == {"unit": "row"}
    assert s.attrs["/config"] == {"lr": 0.01}
    assert not {"/meta", "/meta/version", "/meta/notes"} & set(s.attrs)
    notes = report.notes
    assert f"not migrated: HDF5 attribute 'origin' of / (an object reference: {REFERENCE})" in notes
    assert f"not migrated: HDF5 attribute 'window' of /train (a region reference: {REFERENCE})" in notes
    assert "not migrated: the attributes of /meta (a group none of whose datasets is migrated)" in notes
    assert (
        "not migrated: the attributes of /meta/notes (a group of attributes only, inside /meta: none of whose "
        "datasets is migrated)"
    ) in notes
    assert report.warnings == [
        "HDF5 attribute(s) kept as text, not as their exact values: 'phase' of / (complex numbers)"
    ]


def test_splits_keep_their_own_group_attributes_and_notes_name_fields_as_stored(data, tmp_path: Path, capsys) -> None:
    x, y = data
    h5 = tmp_path / "splits.h5"
    onehot = np.eye(4, dtype=np.float32)[y]
    with h5py.File(h5, "w") as f:
        f.attrs["dataset"] = "digits"
        for g, sl in (("train", slice(0, 8)), ("val", slice(8, N))):
            f[f"{g}/images"], f[f"{g}/labels"], f[f"{g}/sample_id"] = x[sl], onehot[sl], np.arange(N)[sl]
            f[g].attrs["split"] = g
            f[g].attrs["rows"] = np.int32(sl.stop - sl.start)
            f.create_group(f"{g}/augment").attrs["flip"] = g == "train"  # attributes only, of this split
    assert main(["migrate", str(h5), str(tmp_path / "stores")]) == 0
    out = capsys.readouterr().out
    for g, sl in (("train", slice(0, 8)), ("val", slice(8, N))):
        s = carraystore.open(tmp_path / "stores" / f"{g}.b2nd")
        np.testing.assert_array_equal(s[:], x[sl])
        np.testing.assert_array_equal(s.columns["labels"], onehot[sl])
        assert s.attrs == {
            "/": {"dataset": "digits"},
            f"/{g}": {"split": g, "rows": sl.stop - sl.start},
            f"/{g}/augment": {"flip": g == "train"},
        }
        assert f"kept as the target field 'labels' (from /{g}/labels)" in out
        assert (
            f"'{g}/sample_id' not taken as the labels (an id): kept as the field 'sample_id' (from /{g}/sample_id)"
        ) in out
    assert "target field 'train/labels'" not in out and "target field 'val/labels'" not in out


def test_attributes_that_cannot_be_kept_are_named(data, tmp_path: Path) -> None:
    x, y = data
    h5 = tmp_path / "d.h5"
    with h5py.File(h5, "w", libver="latest") as f:  # dense attribute storage: attributes over 64 KiB
        f.create_dataset("images", data=x).attrs["/"] = "a dataset attribute named like the file's path"
        f["labels"] = np.array([f"c{v}" for v in y], dtype="S")  # class names from the labels' text
        f["class_names"] = np.array(["a", "b", "c", "d"], dtype="S")
        f.attrs["owner"] = "lab"
        f.attrs["histogram"] = np.zeros(200_000)  # 1.6 MB: more than an attribute a store's metadata keeps
        nested = h5py.h5t.vlen_create(h5py.h5t.py_create(h5py.string_dtype()))  # lists of strings: h5py cannot read it
        h5py.h5a.create(f.id, b"aliases", nested, h5py.h5s.create(h5py.h5s.SCALAR))
    report = migrate(h5, tmp_path / "o.b2nd", labels="labels", progress=False)
    s = carraystore.open(tmp_path / "o.b2nd")
    assert s.attrs == {"/": "a dataset attribute named like the file's path"}
    names = sorted({f"c{v}" for v in y.tolist()})
    assert s.class_names == tuple(names)
    assert f"labels from 'labels': class names {names} from strings" in report.notes
    assert (
        "not migrated: HDF5 attribute 'histogram' of / (1600000 bytes, more than an attribute kept in a "
        "store's metadata (1048576))"
    ) in report.notes
    assert any(n.startswith("not migrated: HDF5 attribute 'aliases' of / (h5py cannot read it: ") for n in report.notes)
    assert "not migrated: the attributes of / (attrs['/'] is taken by an attribute of 'images')" in report.notes
    assert "not migrated: 'class_names' (class names; the store's come from the labels' text)" in report.notes
