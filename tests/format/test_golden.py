"""Golden stores written once by earlier versions (tests/data/golden/) must read back exactly, forever.

Never regenerate these files; a new version adds its own folder with its make_golden.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import blosc2
import numpy as np
import pytest

import carraystore
from carraystore.format.codec import Codec
from carraystore.format.record import dtype_from_record

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
FOLDERS = sorted(d for d in GOLDEN.iterdir() if (d / "MANIFEST.json").is_file())
CASES = [(d, p.stem) for d in FOLDERS for p in sorted(d.glob("*.b2nd"))]


def _ids(case: tuple[Path, str]) -> str:
    return f"{case[0].name}/{case[1]}"


def test_there_are_golden_stores() -> None:
    assert FOLDERS, f"no golden folders under {GOLDEN}"
    assert any(d.name == "carraystore-0.1.0" for d in FOLDERS)
    assert any(d.name == "carraystore-0.1.0+encoded" for d in FOLDERS)  # format version 2, FORMAT.md 10
    names = {name for _, name in CASES}
    assert {"rgb_uint8", "gray_uint8", "rgba_uint8", "uint16_gray", "small_preset_rgb", "array_records"} <= names


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda d: d.name)
def test_golden_files_are_unchanged(folder: Path) -> None:
    """Every file is exactly the one committed (the manifest holds their SHA-256); none added or lost."""
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    present = {p.name for p in folder.iterdir()} - {"MANIFEST.json"}
    assert present == set(manifest["files"])
    for name, digest in manifest["files"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest, f"{folder.name}/{name} was modified"


def test_golden_folder_is_small() -> None:
    total = sum(p.stat().st_size for p in GOLDEN.rglob("*") if p.is_file())
    assert total < 1_000_000, f"tests/data/golden holds {total} bytes; keep golden stores small"


def _expected(folder: Path, name: str) -> tuple[np.ndarray, dict[str, Any]]:
    items = np.load(folder / f"{name}.npy", allow_pickle=False)
    meta = json.loads((folder / f"{name}.json").read_text(encoding="utf-8"))
    return items, meta


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_golden_store_reads_back_exactly(case: tuple[Path, str]) -> None:
    folder, name = case
    items, exp = _expected(folder, name)
    path = folder / f"{name}.b2nd"
    store = carraystore.open(path)

    assert store.meta.format_version == exp["format_version"]
    assert store.meta.writer_version == exp["writer_version"] and store.meta.blosc2_version == exp["blosc2_version"]
    assert store.layout == exp["layout"] and store.color_mode == exp["color_mode"]
    assert list(store.shape) == exp["shape"] and list(store.image_shape) == exp["image_shape"]
    assert store.dtype == dtype_from_record(exp["dtype"]) == items.dtype
    assert store.chunk_images == exp["chunk_images"] and store.nchunks == exp["nchunks"]
    assert store.codec == Codec.from_config(exp["codec"])
    assert [int(c) for c in store.meta.crc32] == exp["crc32"]
    assert (None if store.labels is None else store.labels.tolist()) == exp["labels"]
    assert (None if store.keys is None else list(store.keys)) == exp["keys"]
    assert (None if store.class_names is None else list(store.class_names)) == exp["class_names"]
    assert store.attrs == exp["attrs"] and store.provenance == exp["provenance"]
    assert [dict(s) for s in store.skipped] == exp["skipped"]
    assert set(store.columns) == set(exp["columns"])
    for col, file in exp["columns"].items():
        want = np.load(folder / file, allow_pickle=False)
        assert store.columns[col].dtype == want.dtype and store.columns[col].tobytes() == want.tobytes()

    got = store[:]
    assert got.dtype == items.dtype and got.shape == items.shape
    assert got.tobytes() == items.tobytes()  # bit-exact, padding bytes of records included
    for i in range(store.nchunks):
        a, b = store.chunk_range(i)
        assert store.read_chunk(i).tobytes() == items[a:b].tobytes()
    if len(items):
        idx = np.random.default_rng(0).integers(0, len(items), 2 * len(items))
        assert store[idx].tobytes() == items[idx].tobytes()
        assert store[len(items) - 1].tobytes() == items[-1].tobytes()
    assert store.verify() == []
    array = blosc2.open(str(path), mode="r")  # plain blosc2 reads the same data
    if store.layout != "encoded":
        assert array.shape == items.shape and array[...].tobytes() == items.tobytes()
        return
    # the encoded layout (FORMAT.md 10): plain blosc2 sees each chunk's entries, one after the other
    assert array.shape == items.shape and store.meta.encoding.to_record() == exp["encoding"]
    entries = [store.entry(i) for i in range(len(store))]
    assert [hashlib.sha256(e).hexdigest() for e in entries] == exp["entries"]
    k, nb, flat = store.chunk_images, store.meta.image_nbytes, array[...].tobytes()
    for c in range(store.nchunks):
        joined = b"".join(entries[c * k : (c + 1) * k])
        part = flat[c * k * nb : (c + 1) * k * nb]  # the array ends at N items: the last chunk's padding is cut
        assert part[: len(joined)] == joined and not part[len(joined) :].strip(b"\x00")


@pytest.mark.parametrize("case", [c for c in CASES if c[1] != "empty"], ids=_ids)
def test_appending_to_a_golden_store_keeps_its_codec(case: tuple[Path, str], tmp_path: Path) -> None:
    """This version appends to stores of earlier versions with their pinned parameters."""
    folder, name = case
    items, exp = _expected(folder, name)
    path = tmp_path / f"{name}.b2nd"
    shutil.copy(folder / f"{name}.b2nd", path)
    more = items[::-1][:5]
    kwargs: dict[str, Any] = {}
    if exp["labels"] is not None:
        kwargs["labels"] = exp["labels"][:5][::-1]
    if exp["keys"] is not None:
        kwargs["keys"] = [f"new/{i}" for i in range(len(more))]
    if exp["columns"]:
        kwargs["columns"] = {c: np.load(folder / f, allow_pickle=False)[:5] for c, f in exp["columns"].items()}
    with carraystore.append(path) as w:
        w.append(more, **kwargs)
    store = carraystore.open(path)
    assert store.codec == Codec.from_config(exp["codec"]) and store.meta.writer_version == carraystore.__version__
    # bytes, not np.concatenate: numpy packs structured dtypes (drops padding, byte order) when concatenating
    assert store.dtype == items.dtype and store[:].tobytes() == items.tobytes() + more.tobytes()
    full = len(items) // store.chunk_images  # chunks that were full keep their checksums
    assert [int(c) for c in store.meta.crc32[:full]] == exp["crc32"][:full]
    assert store.verify() == []
