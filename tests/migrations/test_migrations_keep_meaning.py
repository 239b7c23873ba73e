"""Migrations keep meaning: labels and class names come along, and can be set later.

Real HDF5 files (h5py), real .npz files, real stores; the CLI through carraystore.cli.main.main.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import make_store

import carraystore
from carraystore.base.errors import MigrationError
from carraystore.cli.main import main
from carraystore.format.frame import read_frame
from carraystore.migrations import migrate
from carraystore.sources.journal import journal_path
from carraystore.sources.local import LocalFileSource
from carraystore.store.metadata import update_metadata

h5py = pytest.importorskip("h5py")

NAMES = ["astronaut", "chelsea", "coffee", "rocket"]


@pytest.fixture(scope="module")
def arrays(photo_arrays: tuple[np.ndarray, np.ndarray, list[str]]) -> tuple[np.ndarray, np.ndarray]:
    x, y, _ = photo_arrays
    return x, y


def test_hdf5_labels_and_class_names_beside_the_images_come_along(arrays, tmp_path: Path, capsys) -> None:
    x, y = arrays
    h5 = tmp_path / "cats.h5"
    with h5py.File(h5, "w") as f:
        f["train/images"] = x
        f["train/labels"] = y.astype(np.int32)
        f["train/class_names"] = np.array(NAMES, dtype="S")
        f["mean_pixel"] = np.array([0.5, 0.4, 0.3])  # not one per row: neither images nor labels
    out = tmp_path / "o.b2nd"
    assert main(["migrate", str(h5), str(out)]) == 0  # -q would print nothing
    summary = capsys.readouterr().out
    assert "labels inferred: 'train/labels'" in summary and "class names from dataset 'train/class_names'" in summary
    store = carraystore.open(out)
    np.testing.assert_array_equal(store[:], x)
    np.testing.assert_array_equal(store.labels, y)
    assert store.class_names == tuple(NAMES)
    # the loader delivers (images, labels) pairs, not (images, None)
    xb, yb = next(iter(store.batches(8, shuffle=False)))
    assert yb is not None and np.array_equal(yb, y[:8])


def test_hdf5_ambiguous_labels_stop_and_list_the_candidates(arrays, tmp_path: Path, capsys) -> None:
    x, y = arrays
    h5 = tmp_path / "two.h5"
    with h5py.File(h5, "w") as f:
        f["images"] = x
        f["label_a"] = y
        f["ids"] = np.arange(len(y))
    out = tmp_path / "o.b2nd"
    with pytest.raises(MigrationError) as exc:
        migrate(h5, out, progress=False)
    msg = str(exc.value)
    assert "label_a" in msg and "ids" in msg and "--labels NAME" in msg and "--no-labels" in msg
    assert not out.exists()
    assert main(["migrate", str(h5), str(out), "-q", "--labels", "label_a", "--class-names", ",".join(NAMES)]) == 0
    store = carraystore.open(out)
    assert np.array_equal(store.labels, y) and store.class_names == tuple(NAMES)
    assert main(["migrate", str(h5), str(tmp_path / "n.b2nd"), "-q", "--no-labels"]) == 0
    assert carraystore.open(tmp_path / "n.b2nd").labels is None
    # a name that says "labels" settles it
    with h5py.File(tmp_path / "named.h5", "w") as f:
        f["x"] = x
        f["labels"] = y
        f["ids"] = np.arange(len(y))
    report = migrate(tmp_path / "named.h5", tmp_path / "named.b2nd", progress=False)
    assert report.labels and np.array_equal(carraystore.open(tmp_path / "named.b2nd").labels, y)
    capsys.readouterr()


def test_class_names_on_migrate_are_checked(arrays, tmp_path: Path, capsys) -> None:
    x, y = arrays
    h5 = tmp_path / "d.h5"
    with h5py.File(h5, "w") as f:
        f["x"] = x
        f["y"] = y
    assert main(["migrate", str(h5), str(tmp_path / "a.b2nd"), "-q", "--class-names", "a,b"]) == 2
    assert "4 names are needed" in capsys.readouterr().err
    assert not (tmp_path / "a.b2nd").exists()
    with h5py.File(tmp_path / "nolab.h5", "w") as f:
        f["x"] = x
    assert main(["migrate", str(tmp_path / "nolab.h5"), str(tmp_path / "b.b2nd"), "-q", "--class-names", "a,b"]) == 2
    assert "no labels" in capsys.readouterr().err


def test_npz_class_names_member(arrays, tmp_path: Path) -> None:
    x, y = arrays
    npz = tmp_path / "d.npz"
    np.savez(npz, images=x, labels=y, classes=np.array(NAMES))
    report = migrate(npz, tmp_path / "o.b2nd", images="images", labels="labels", progress=False)
    store = carraystore.open(tmp_path / "o.b2nd")
    assert store.class_names == tuple(NAMES) and np.array_equal(store.labels, y)
    assert not store.columns  # the names are not kept as a per-item column
    assert not any("classes" in w for w in report.warnings)


def test_npz_images_and_labels_are_inferred_like_hdf5(arrays, tmp_path: Path, capsys) -> None:
    """An npz of images, labels and class names migrates with its labels (they were refused, or with
    --images kept as a column only, so training got no labels); ambiguous labels stop and list them."""
    x, y = arrays
    npz = tmp_path / "d.npz"
    np.savez(npz, images=x, labels=y, class_names=np.array(NAMES))
    assert main(["migrate", str(npz), str(tmp_path / "a.b2nd")]) == 0  # --quiet would print nothing
    assert "labels inferred: 'labels'" in capsys.readouterr().out
    for argv in ([], ["--images", "images"]):
        out = tmp_path / f"o{len(argv)}.b2nd"
        migrate(npz, out, images=argv[1] if argv else None, progress=False)
        store = carraystore.open(out)
        np.testing.assert_array_equal(store.labels, y)
        assert store.class_names == tuple(NAMES) and not store.columns
    migrate(npz, tmp_path / "n.b2nd", no_labels=True, progress=False)
    assert carraystore.open(tmp_path / "n.b2nd").labels is None
    two = tmp_path / "two.npz"
    np.savez(two, x=x, fold=y % 2, subject=y // 2)
    with pytest.raises(MigrationError, match=r"several .*'fold'.*'subject'.*--labels NAME.*--no-labels"):
        migrate(two, tmp_path / "t.b2nd", progress=False)
    assert not (tmp_path / "t.b2nd").exists()


def test_hdf5_before_size_is_the_migrated_datasets(arrays, tmp_path: Path) -> None:
    x, y = arrays
    h5 = tmp_path / "big.h5"
    with h5py.File(h5, "w") as f:
        d = f.create_dataset("images", data=x, chunks=(8, *x.shape[1:]), compression="gzip")
        lab = f.create_dataset("labels", data=y)
        f.create_dataset("other/features", data=np.random.default_rng(0).random((4000, 100)))  # 3.2 MB not migrated
        expected = d.id.get_storage_size() + lab.id.get_storage_size()
    report = migrate(h5, tmp_path / "o.b2nd", dataset="images", labels="labels", progress=False)
    assert report.bytes_before == expected
    assert report.bytes_before < h5.stat().st_size / 3


# -- carraystore meta --------------------------------------------------------------------------


def _chunks_kept(path: Path, start: int, chunks: bytes, writes: int) -> bool:
    """The data region is the old one byte for byte, then one 32-byte marker per in-place
    write (docs/appends.md, "The journal"): the pixels' bytes are untouched."""
    now_start, region = _chunk_region(path)
    markers = region[len(chunks) :]
    return (
        now_start == start
        and region[: len(chunks)] == chunks
        and len(markers) == 32 * writes
        and all(
            markers[i : i + 8] == b"CSWRITE1" and markers[i + 24 : i + 32] == bytes(8)
            for i in range(0, len(markers), 32)
        )
    )


def _chunk_region(path: Path) -> tuple[int, bytes]:
    src = LocalFileSource(path)
    try:
        frame = read_frame(src)
        return frame.header_len, src.read(frame.header_len, frame.cbytes)
    finally:
        src.close()


@pytest.fixture()
def store_path(arrays, tmp_path: Path) -> Path:
    x, y = arrays
    return make_store(tmp_path / "s.b2nd", x, y, chunk_images=8)


def test_meta_sets_class_names_and_attrs_in_place(store_path: Path, arrays, capsys) -> None:
    x, y = arrays
    before = store_path.stat()
    start, chunks = _chunk_region(store_path)
    big = os.urandom(150_000).hex()  # an incompressible attr, larger than a chunk
    assert (
        main(
            [
                "meta",
                str(store_path),
                "--class-names",
                ",".join(NAMES),
                "--attr",
                "epochs=3",
                "--attr",
                "note=hello world",
                "--attr",
                f"blob={big}",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "astronaut (" in out and '"epochs": 3' in out
    after = store_path.stat()
    assert after.st_ino == before.st_ino  # updated in place, not replaced by a copy
    assert _chunks_kept(store_path, start, chunks, 1)  # the pixels' bytes are untouched
    assert 150_000 < after.st_size - before.st_size < 400_000  # grew by the metadata only
    assert not journal_path(store_path).exists()
    store = carraystore.open(store_path)
    assert store.class_names == tuple(NAMES)
    assert store.attrs == {"epochs": 3, "note": "hello world", "blob": big}
    np.testing.assert_array_equal(store[:], x)
    np.testing.assert_array_equal(store.labels, y)
    assert store.verify() == []
    # remove an attr; the file shrinks back
    assert main(["meta", str(store_path), "--remove-attr", "blob", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["attrs"] == {"epochs": 3, "note": "hello world"} and shown["class_names"] == NAMES
    assert store_path.stat().st_size < before.st_size + 10_000
    assert _chunks_kept(store_path, start, chunks, 2)
    # printing alone changes nothing
    mtime = store_path.stat().st_mtime_ns
    assert main(["meta", str(store_path)]) == 0
    assert "class_names  astronaut, chelsea, coffee, rocket" in capsys.readouterr().out
    assert store_path.stat().st_mtime_ns == mtime


def test_meta_refuses_too_few_class_names(store_path: Path, capsys) -> None:
    data = store_path.read_bytes()
    assert main(["meta", str(store_path), "--class-names", "a,b"]) == 2
    assert "4 class names are needed" in capsys.readouterr().err
    assert store_path.read_bytes() == data


_CRASH = r"""
import os, signal, sys
import carraystore.store.inplace as ip
import carraystore.store.metadata as w
real = ip._write_meta
def torn(array, meta):
    real(array, meta)
    del array
    # the new trailer is half on disk when the process is killed
    size = os.path.getsize(sys.argv[1])
    with open(sys.argv[1], "r+b") as f:
        f.seek(size - 40)
        f.write(os.urandom(40))
        f.truncate(size - 7)
    os.kill(os.getpid(), signal.SIGKILL)
ip._write_meta = torn
w.update_metadata(sys.argv[1], class_names=["a", "b", "c", "d"], attrs={"x": os.urandom(3000).hex()})
"""


def test_meta_interrupted_mid_write_is_rolled_back_by_the_next_reader(store_path: Path, capsys) -> None:
    original = store_path.read_bytes()
    start, chunks = _chunk_region(store_path)
    proc = subprocess.run([sys.executable, "-c", _CRASH, str(store_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    # the same rollback journal as an append's; the trailer on disk is torn
    assert journal_path(store_path).exists()
    assert store_path.read_bytes() != original
    assert store_path.read_bytes()[start : start + len(chunks)] == chunks  # the pixels' bytes were never touched
    assert main(["info", str(store_path)]) == 0  # a reader rolls it back before it reads
    capsys.readouterr()
    assert store_path.read_bytes() == original  # exactly as before the interrupted update
    assert not journal_path(store_path).exists()
    with carraystore.open(store_path) as store:
        assert store.class_names is None and store.attrs == {} and store.verify() == []
    # an incomplete journal (the update died before its first write to the store) is removed, nothing restored
    journal_path(store_path).write_bytes(b"CSJRNL01" + b"\0" * 10)
    update_metadata(store_path, class_names=NAMES)
    assert not journal_path(store_path).exists()
    assert carraystore.open(store_path).class_names == tuple(NAMES)
    assert _chunks_kept(store_path, start, chunks, 1)


def test_meta_attrs_are_stored_as_json_reads_them_back(store_path: Path, capsys) -> None:
    """A tuple is stored (and read back) as a list; values msgpack or JSON cannot hold are named errors."""
    data = store_path.read_bytes()
    update_metadata(store_path, attrs={"image_size": (224, 224)})  # raised "reads back wrong" before
    assert carraystore.open(store_path).attrs == {"image_size": [224, 224]}
    assert main(["meta", str(store_path), "--attr", "n=NaN", "--attr", "i=-Infinity"]) == 0  # "reads back wrong" before
    attrs = carraystore.open(store_path).attrs
    assert np.isnan(attrs["n"]) and attrs["i"] == -np.inf
    capsys.readouterr()
    data = store_path.read_bytes()
    for bad in ["big=123456789012345678901234567890", "small=-9223372036854775809"]:
        assert (
            main(["meta", str(store_path), "--attr", bad]) == 2
        )  # an OverflowError traceback / a false "reads back wrong"
        err = capsys.readouterr().err
        assert f"attrs[{bad.split('=')[0]!r}]" in err and "Traceback" not in err
        assert store_path.read_bytes() == data


def test_create_stores_attrs_with_the_keys_json_gives_them(tmp_path: Path) -> None:
    """An int key was packed as is and the store could not be opened ("the file may be damaged")."""
    with carraystore.create(tmp_path / "k.b2nd", (4, 4, 3), attrs={1: "x", "n": {2: "y"}}) as w:
        w.append(np.zeros((2, 4, 4, 3), np.uint8))
    assert carraystore.open(tmp_path / "k.b2nd").attrs == {"1": "x", "n": {"2": "y"}}


def test_create_refuses_attrs_msgpack_cannot_hold(tmp_path: Path) -> None:
    from carraystore.base.errors import InvalidInputError

    for attrs in ({"big": 10**30}, {"n": [1, {"deep": -(2**63) - 1}]}, {"o": object()}):
        with pytest.raises(InvalidInputError, match="attrs"):
            carraystore.create(tmp_path / "c.b2nd", (4, 4, 3), attrs=attrs)
        assert list(tmp_path.iterdir()) == [] or all(p.name.endswith(".lock") for p in tmp_path.iterdir())
