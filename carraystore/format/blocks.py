"""Decompress one item range of a compressed chunk straight into a destination (layer 1).
c-blosc2's ``blosc2_getitem_ctx`` decompresses only the blocks holding the items asked for (one
image per block: straight into its batch slot). It is called via ``ctypes`` (GIL released) from the
wheel's ``libblosc2``; where that is missing, :func:`available` is False (whole chunks are decoded)."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from typing import Any

import blosc2
import numpy as np

__all__ = ["available", "BlockReader"]


class _DParams(ctypes.Structure):
    # blosc2_dparams of c-blosc2 2.x (blosc2.h): nthreads, schunk, postfilter, postparams, typesize
    _fields_ = [
        ("nthreads", ctypes.c_int16),
        ("schunk", ctypes.c_void_p),
        ("postfilter", ctypes.c_void_p),
        ("postparams", ctypes.c_void_p),
        ("typesize", ctypes.c_int32),
    ]


def _load() -> Any:
    path = os.path.join(os.path.dirname(blosc2.__file__), "lib", "libblosc2.so")
    if os.environ.get("CARRAYSTORE_NO_GETITEM") or not os.path.exists(path):
        return None
    try:
        lib = ctypes.CDLL(path)
        lib.blosc2_create_dctx.restype = ctypes.c_void_p
        lib.blosc2_create_dctx.argtypes = [_DParams]
        lib.blosc2_free_ctx.restype = None
        lib.blosc2_free_ctx.argtypes = [ctypes.c_void_p]
        lib.blosc2_getitem_ctx.restype = ctypes.c_int
        lib.blosc2_getitem_ctx.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int32,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int32,
        ]
        # prove it on a real chunk before trusting it
        ref = np.arange(4 * 300, dtype=np.uint8).reshape(4, 300) * 7
        chunk = blosc2.compress2(ref, typesize=3, blocksize=300, clevel=1, codec=blosc2.Codec.LZ4)
        reader = BlockReader(lib, typesize=3, item_nbytes=300)
        out = np.zeros(300, np.uint8)
        reader.get(chunk, len(chunk), 2, out.ctypes.data)
        return lib if np.array_equal(out, ref[2]) else None
    except Exception:
        return None


_LIB: Any = None
_LOADED = False
_LOCK = threading.Lock()


def library() -> Any:
    """The loaded libblosc2, or None."""
    global _LIB, _LOADED
    with _LOCK:
        if not _LOADED:
            _LOADED = True
            _LIB = _load()
    return _LIB


def available() -> bool:
    """Whether items can be decompressed one by one (libblosc2 found and working)."""
    return library() is not None


class BlockReader:
    """Per-thread decompression context for pulling single items out of chunks."""

    def __init__(self, lib: Any, typesize: int, item_nbytes: int) -> None:
        if item_nbytes % typesize:
            raise ValueError(f"item of {item_nbytes} bytes is not a whole number of {typesize}-byte units")
        self._lib = lib
        self._ctx = lib.blosc2_create_dctx(_DParams(1, None, None, None, typesize))
        if not self._ctx:
            raise MemoryError("blosc2_create_dctx failed")
        self.typesize = typesize
        self.item_nbytes = item_nbytes
        self._units = item_nbytes // typesize

    @property
    def units(self) -> int:
        """Units of ``typesize`` bytes in one item: an item's start is ``item * units``."""
        return self._units

    def get_many(
        self, chunks: Sequence[int], lengths: Sequence[int], starts: Sequence[int], dests: Sequence[int]
    ) -> None:
        """Decompress the item starting at unit ``starts[n]`` (``item * units``) of the chunk at address
        ``chunks[n]`` into ``dests[n]``, for every n."""
        fn, ctx, units, nbytes = self._lib.blosc2_getitem_ctx, self._ctx, self._units, self.item_nbytes
        for c, length, start, dest in zip(chunks, lengths, starts, dests, strict=True):
            rc = fn(ctx, c, length, start, units, dest, nbytes)
            if rc != nbytes:
                raise ValueError(f"blosc2_getitem_ctx returned {rc} for item {start // units} (wanted {nbytes} bytes)")

    def get(self, chunk: Any, chunk_len: int, item: int, dest: int) -> None:
        """Decompress item ``item`` of ``chunk`` (a buffer or address) into the address ``dest``."""
        rc = self._lib.blosc2_getitem_ctx(
            self._ctx, chunk, chunk_len, item * self._units, self._units, dest, self.item_nbytes
        )
        if rc != self.item_nbytes:
            raise ValueError(f"blosc2_getitem_ctx returned {rc} for item {item} (wanted {self.item_nbytes} bytes)")

    def __del__(self) -> None:
        ctx, self._ctx = getattr(self, "_ctx", None), None
        if ctx:
            try:
                self._lib.blosc2_free_ctx(ctx)
            except Exception:
                pass
