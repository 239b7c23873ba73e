"""Receive buffers for remote reads, used again and again (layer 2; docs/remote.md, "Receive buffers")."""

from __future__ import annotations

import sys
import threading

import numpy as np

__all__ = ["BufferPool", "BUFFER_STEP"]

#: Receive buffers are made in multiples of this (a store's chunks differ in length).
BUFFER_STEP = 1 << 20


class BufferPool:
    """Receive buffers used again and again, so a body lands in already mapped memory (not fresh pages).
    A buffer is handed out again only when nothing refers to it (no view or array over it), so held
    bytes are never overwritten; free buffers beyond ``keep_bytes`` are let go."""

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = int(keep_bytes)
        #: buffers made so far (a reused buffer is not counted again)
        self.allocated = 0
        self._lock = threading.Lock()
        self._bufs: list[np.ndarray] = [np.empty(0, np.uint8)]
        # what "held by this pool alone" reads as, measured the way take() measures it
        self._free_refs = sys.getrefcount(self._bufs[0])
        self._bufs.clear()

    def take(self, n: int) -> np.ndarray:
        """A uint8 buffer of at least ``n`` bytes that no one else holds."""
        with self._lock:
            bufs = self._bufs
            for i in range(len(bufs)):
                if len(bufs[i]) >= n and sys.getrefcount(bufs[i]) == self._free_refs:
                    return bufs[i]
            size = -(-max(n, 1) // BUFFER_STEP) * BUFFER_STEP
            held = sum(len(b) for b in bufs)
            for i in reversed(range(len(bufs))):  # over the budget: let free buffers go
                if held + size <= self.keep_bytes:
                    break
                if sys.getrefcount(bufs[i]) == self._free_refs:
                    held -= len(bufs[i])
                    del bufs[i]
            bufs.append(np.empty(size, np.uint8))
            self.allocated += 1
            return bufs[-1]

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers the pool holds (free or in use)."""
        with self._lock:
            return sum(len(b) for b in self._bufs)

    def clear(self) -> None:
        """Forget every buffer (those still in use live on with their users)."""
        with self._lock:
            self._bufs = []
