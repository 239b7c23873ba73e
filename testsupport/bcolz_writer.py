"""A bcolz carray/ctable writer with real c-blosc 1.x chunks, for tests and benchmarks (bcolz itself no longer installs).

Writes what ``carraystore.migrations.bcolz`` reads; the chunks come from numcodecs' bundled c-blosc 1.x.
"""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.base.errors import InvalidInputError, MissingDependencyError
from carraystore.migrations.bcolz import BLP_HEADER

__all__ = ["write_carray", "write_ctable"]


_SHUFFLES = {0: 0, 1: 1, 2: 2}


def _blosc1_compress(data: np.ndarray, cname: str, clevel: int, shuffle: int) -> bytes:
    try:
        from numcodecs import blosc as nblosc
    except ImportError as exc:
        raise MissingDependencyError(
            "write_carray needs numcodecs (it bundles c-blosc 1.x, the library bcolz used) to write real Blosc1 chunks: "
            "pip install numcodecs"
        ) from exc
    return bytes(nblosc.compress(np.ascontiguousarray(data), cname.encode(), clevel, _SHUFFLES[shuffle]))


def _dtype_text(dt: np.dtype) -> str:
    """The dtype as bcolz writes it in meta/storage: ``str(dtype)``."""
    return str(dt)


def write_carray(
    rootdir: str | os.PathLike[str],
    array: np.ndarray | Iterator[np.ndarray],
    chunklen: int,
    cname: str = "lz4",
    clevel: int = 5,
    shuffle: int = 1,
    *,
    attrs: dict[str, Any] | None = None,
    shape: Sequence[int] | None = None,
    dtype: Any = None,
) -> Path:
    """Write a bcolz carray rootdir as bcolz (>= 0.7) does, with real c-blosc 1.x chunks.

    ``array`` is an array, or an iterator of row blocks (then give ``shape`` and ``dtype``)
    so that multi-GB carrays can be written with little memory; a 1-D object array is
    written as bcolz does, one pickled element per file. Uses numcodecs' bundled
    c-blosc 1.x. ``cname`` is one of blosclz, lz4, lz4hc, zlib, zstd (snappy: no longer
    buildable); ``shuffle`` 0/1/2 = none/byte/bit. Returns the rootdir.
    """
    root = Path(rootdir)
    if root.exists():
        raise InvalidInputError(f"{root} already exists; write_carray creates a new rootdir")
    if chunklen < 1:
        raise InvalidInputError(f"chunklen must be positive, got {chunklen}")
    if shuffle not in _SHUFFLES:
        raise InvalidInputError(f"shuffle must be 0, 1 or 2, got {shuffle}")
    if isinstance(array, np.ndarray):
        if array.ndim == 0:
            raise InvalidInputError("write_carray needs at least one dimension")
        if array.dtype.hasobject:
            return _write_object_carray(root, array, chunklen, cname, clevel, shuffle, attrs)
        full_shape = array.shape
        dt = array.dtype
        blocks: Iterator[np.ndarray] = iter([array])
    else:
        if shape is None or dtype is None:
            raise InvalidInputError("write_carray: give shape= and dtype= when array is an iterator of blocks")
        full_shape = tuple(int(x) for x in shape)
        dt = np.dtype(dtype)
        blocks = array
    item_shape = tuple(full_shape[1:])
    (root / "meta").mkdir(parents=True)
    (root / "data").mkdir()
    pending: list[np.ndarray] = []
    count = 0
    nchunk = 0
    rows = 0
    cbytes = 0

    def emit(chunk: np.ndarray) -> None:
        nonlocal nchunk, cbytes
        data = BLP_HEADER + _blosc1_compress(chunk, cname, clevel, shuffle)
        (root / "data" / f"__{nchunk}.blp").write_bytes(data)
        cbytes += len(data)
        nchunk += 1

    for block in blocks:
        block = np.asarray(block)
        if block.shape[1:] != item_shape or block.dtype != dt:
            raise InvalidInputError(f"block of {block.dtype}{block.shape} does not fit {dt}{full_shape}")
        pending.append(block)
        count += len(block)
        rows += len(block)
        while count >= chunklen:
            whole = pending[0] if len(pending) == 1 else np.concatenate(pending)
            emit(whole[:chunklen])
            rest = whole[chunklen:]
            pending, count = ([rest] if len(rest) else []), len(rest)
    if count:
        emit(pending[0] if len(pending) == 1 else np.concatenate(pending))
    if rows != full_shape[0]:
        raise InvalidInputError(f"write_carray: got {rows} rows, shape says {full_shape[0]}")
    storage = {
        "dtype": _dtype_text(dt),
        "cparams": {"clevel": clevel, "shuffle": shuffle, "cname": cname, "quantize": 0},
        "chunklen": chunklen,
        "expectedlen": full_shape[0],
        "dflt": 0 if dt.kind in "biufc" else "",
    }
    (root / "meta" / "storage").write_text(json.dumps(storage))
    nbytes = rows * int(np.prod(item_shape, dtype=np.int64)) * dt.itemsize
    (root / "meta" / "sizes").write_text(json.dumps({"shape": list(full_shape), "nbytes": nbytes, "cbytes": cbytes}))
    (root / "__attrs__").write_text(json.dumps(attrs or {}))
    return root


def _write_object_carray(
    root: Path, array: np.ndarray, chunklen: int, cname: str, clevel: int, shuffle: int, attrs: dict[str, Any] | None
) -> Path:
    """Object carrays as bcolz writes them: one pickled element (protocol 2) per ``.blp`` file."""
    if array.ndim != 1:
        raise InvalidInputError("object carrays must be one-dimensional")
    (root / "meta").mkdir(parents=True)
    (root / "data").mkdir()
    cbytes = 0
    for i, obj in enumerate(array):
        raw = np.frombuffer(pickle.dumps(obj, protocol=2), dtype=np.uint8)
        data = BLP_HEADER + _blosc1_compress(raw, cname, clevel, shuffle)
        (root / "data" / f"__{i}.blp").write_bytes(data)
        cbytes += len(data)
    storage = {
        "dtype": "object",
        "cparams": {"clevel": clevel, "shuffle": shuffle, "cname": cname, "quantize": 0},
        "chunklen": chunklen,
        "expectedlen": len(array),
        "dflt": 0,
    }
    (root / "meta" / "storage").write_text(json.dumps(storage))
    (root / "meta" / "sizes").write_text(json.dumps({"shape": [len(array)], "nbytes": 0, "cbytes": cbytes}))
    (root / "__attrs__").write_text(json.dumps(attrs or {}))
    return root


def write_ctable(rootdir: str | os.PathLike[str], columns: dict[str, np.ndarray], chunklen: int, **kwargs: Any) -> Path:
    """Write a bcolz ctable rootdir: ``__rootdirs__`` plus one carray per column."""
    root = Path(rootdir)
    attrs = kwargs.pop("attrs", None)
    root.mkdir(parents=True)
    for name, col in columns.items():
        write_carray(root / name, col, chunklen, **kwargs)
    (root / "__rootdirs__").write_text(json.dumps({"names": list(columns)}))
    (root / "__attrs__").write_text(json.dumps(attrs or {}))
    return root
