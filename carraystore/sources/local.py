"""A store in a local file: ``os.pread``, a read-only memory map, ``posix_fadvise`` read-ahead (layer 2).
A :class:`~carraystore.format.frame.ByteSource`, not a ``ReadAheadSource`` (no link, nothing held)."""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Sequence
from pathlib import Path

from carraystore.base.errors import CorruptStoreError

__all__ = ["LocalFileSource"]


class LocalFileSource:
    """A local file read with ``os.pread`` (no lock, GIL released), or via :meth:`view` of a read-only memory map."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.location = str(self.path)
        self._fd: int | None = os.open(self.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        self._size = os.fstat(self._fd).st_size
        self._map: mmap.mmap | None = None
        self._map_lock = threading.Lock()

    def view(self, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset`` as a read-only view of the file's pages (no copy)."""
        if offset < 0 or offset + length > self._size:
            raise CorruptStoreError(
                f"{self.location}: bytes {offset}-{offset + length} lie outside the file of {self._size} bytes; "
                f"the file is truncated or damaged: run `carraystore verify {self.location}`"
            )
        m = self._map
        if m is None:
            with self._map_lock:
                if self._map is None:
                    if self._fd is None:
                        raise ValueError(f"{self.location}: the file was closed")
                    # the file may be shorter by now (a metadata update shrank its trailer): map what is there
                    n = min(self._size, os.fstat(self._fd).st_size)
                    self._map = mmap.mmap(self._fd, n, access=mmap.ACCESS_READ) if n else None
                m = self._map
        if m is None or offset + length > len(m):
            return memoryview(self.read(offset, length))  # beyond the map: read (or name the truncation)
        return memoryview(m)[offset : offset + length]

    def size(self) -> int:
        return self._size

    def read(self, offset: int, length: int) -> bytes:
        fd = self._fd
        if fd is None:
            raise ValueError(f"{self.location}: the file was closed")
        data = os.pread(fd, length, offset)
        if len(data) != length:
            raise CorruptStoreError(
                f"{self.location}: {len(data)} of {length} bytes readable at offset {offset}; the file is "
                f"truncated or damaged: run `carraystore verify {self.location}`"
            )
        return data

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        return [self.read(o, n) for o, n in ranges]

    def prefetch(self, ranges: Sequence[tuple[int, int]], again: bool = False) -> None:
        """Ask the kernel to read these ranges into the page cache (posix_fadvise WILLNEED)."""
        fd = self._fd
        if fd is None or not hasattr(os, "posix_fadvise"):
            return
        for offset, length in ranges:
            try:
                os.posix_fadvise(fd, int(offset), int(length), os.POSIX_FADV_WILLNEED)
            except OSError:
                return

    def fileno(self) -> int | None:
        return self._fd

    def close(self) -> None:
        m, self._map = self._map, None
        if m is not None:
            try:
                m.close()
            except BufferError:  # views of it are still alive: the map goes with the last one
                pass
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"<LocalFileSource {self.location!r}>"
