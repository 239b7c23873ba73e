"""A local store's read-ahead hints go only to chunks not already in the page cache.

``posix_fadvise(WILLNEED)`` of a cached chunk costs about as much as reading it from the cache
once more, so the reader probes a byte per MiB of each announced chunk and its last byte with
``preadv(RWF_NOWAIT)`` (which fails rather than wait for the disk) and hints only the rest.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import carraystore
from carraystore.store import reader as reader_module


def _pages(path: Path) -> list[bool]:
    """Which pages of the file are in the page cache (``mincore``, which reads nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    size = path.stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        n = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * n)()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(n * mmap.PAGESIZE), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return [bool(v & 1) for v in vec]


def _resident(path: Path) -> bool:
    """Whether any page of the file is in the page cache."""
    return any(_pages(path))


def _evict(path: Path) -> bool:
    """Drop the file's pages from the page cache; whether the kernel did (not on tmpfs, say)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        gone = 0
        for _ in range(100):  # a page still being read in shows as not resident: out twice, 50 ms apart
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            gone = gone + 1 if not _resident(path) else 0
            if gone == 2:
                return True
            time.sleep(0.05)
        return False
    finally:
        os.close(fd)


@pytest.fixture
def store(tmp_path: Path, photo_patches: Callable[..., np.ndarray], monkeypatch: pytest.MonkeyPatch) -> Any:
    if not reader_module._NOWAIT or not hasattr(os, "posix_fadvise"):
        pytest.skip("preadv(RWF_NOWAIT) or posix_fadvise is not available here")
    images = photo_patches(48, size=(256, 256), seed=5)  # chunks of about 3 MB
    path = tmp_path / "s.b2nd"
    with carraystore.create(path, images.shape[1:], codec="fast", chunk_images=16) as w:
        w.append(images, labels=np.zeros(len(images), dtype=np.int64))
    s = carraystore.open(path)
    s.hinted = []
    monkeypatch.setattr(s.source, "prefetch", lambda ranges, again=False: s.hinted.append(list(ranges)))
    return s


def test_chunks_in_the_page_cache_are_not_hinted(store: Any) -> None:
    expected = store[:]  # every chunk read: in the page cache
    store.prefetch_chunks(range(store.nchunks))
    assert store.hinted == []
    assert np.array_equal(store[:], expected)


def test_chunks_not_in_the_page_cache_are_hinted(store: Any) -> None:
    if not _evict(store.path):
        pytest.skip("the page cache keeps this file's pages (tmpfs?)")
    store.prefetch_chunks(range(store.nchunks))
    ranges = [store.chunk_byte_range(c) for c in range(store.nchunks)]
    assert len(store.hinted) == 1 and ranges[0] in store.hinted[0], store.hinted
    # a probe that misses may start the kernel's own read-ahead, which can bring a later chunk's
    # probed pages in before they are probed: such a chunk is in the cache, and only then unhinted
    pages, stride = _pages(store.path), reader_module.PROBE_STRIDE
    for offset, length in ranges:
        if (offset, length) not in store.hinted[0]:
            probed = [*range(offset, offset + length, stride), offset + length - 1]
            assert all(pages[p // mmap.PAGESIZE] for p in probed), (offset, length, store.hinted)


def test_a_chunk_with_any_probed_page_out_of_the_cache_is_hinted(store: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Which pages are cached, made exact: a probe fails at the offsets listed."""
    ranges = [store.chunk_byte_range(c) for c in range(store.nchunks)]
    out: set[int] = set()
    probed: list[int] = []

    def preadv(fd: int, buffers: list[bytearray], offset: int, flags: int = 0) -> int:
        assert flags == reader_module._NOWAIT
        probed.append(offset)
        if offset in out:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return 1

    monkeypatch.setattr(os, "preadv", preadv)
    (o0, n0), (o1, n1), (o2, _) = ranges
    stride = reader_module.PROBE_STRIDE
    for missing, hinted in (
        (set(), []),
        ({o0 + stride}, [ranges[0]]),  # a page in the middle of chunk 0
        ({o1 + n1 - 1, o2}, [ranges[1], ranges[2]]),  # chunk 1's last byte, chunk 2's first
    ):
        out.clear()
        out.update(missing)
        probed.clear()
        store.hinted.clear()
        store.prefetch_chunks(range(store.nchunks))
        assert store.hinted == ([hinted] if hinted else [])
        if not missing:  # a byte per MiB and the last one
            assert [p for p in probed if o0 <= p < o0 + n0] == [*range(o0, o0 + n0, stride), o0 + n0 - 1]

    def unsupported(fd: int, buffers: list[bytearray], offset: int, flags: int = 0) -> int:
        raise OSError(95, "Operation not supported")

    monkeypatch.setattr(os, "preadv", unsupported)
    monkeypatch.setattr(reader_module, "_NOWAIT", reader_module._NOWAIT)  # restored after the test
    store.hinted.clear()
    store.prefetch_chunks(range(store.nchunks))
    assert store.hinted == [ranges]  # no probing where it is not supported: every chunk hinted
    assert reader_module._NOWAIT == 0
