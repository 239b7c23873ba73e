"""The rollback journal of an in-place write (layer 3); docs/appends.md is its spec.

An append, or a metadata update (``carraystore meta``), writes into the store file
itself: new data chunks (an append) go after the existing ones, over the old offsets
index and trailer, then the offsets index, the trailer, and the header's sizes. Before
its first write it saves, in ``.NAME.b2nd.journal``, every byte it will overwrite (the
header, and everything after the data chunks) and the old file length, fsyncs the
journal and the folder; after its last write (and an fsync of the store) it removes the
journal. A journal that is present and complete ("hot") means a write died half-way:
:func:`rollback` puts the saved bytes back and truncates the file to its old length,
which is the store as it was before that write, byte for byte.

Journal file: ``b"CSJRNL02"``, old length (u64 LE), region count (u32 LE), the guard
(offset u64, length u64, CRC32 u32 of the last old data bytes, which the write never
changes: a file whose bytes there differ was replaced and is never rolled back), then per
region offset (u64 LE), length (u64 LE) and the bytes; last a CRC32 (u32 LE) of all that
precedes it. A journal that is short or fails its CRC was never completed, so the store
was not touched yet: it is removed, nothing is restored.

Readers do not take locks: a reader that finds a hot journal while a writer is still at
work (or cannot write to roll back) reads the old store through :class:`JournalSource`,
the file with the journal's saved bytes laid over it (the old data chunks are never
overwritten, so that view is the old store, complete).
"""

from __future__ import annotations

import contextlib
import errno
import os
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from carraystore.errors import CorruptStoreError, WriteError
from carraystore.lock import WriterLock
from carraystore.sources import LocalFileSource

__all__ = [
    "Journal",
    "journal_path",
    "load_journal",
    "write_journal",
    "rollback",
    "remove_journal",
    "JournalSource",
    "rollback_if_abandoned",
]

MAGIC = b"CSJRNL02"  # 02 adds the guard; a CSJRNL01 journal (no guard) is still rolled back
_MAGIC_01 = b"CSJRNL01"
#: Bytes of the old data region, just before its end, whose CRC ties a journal to its file.
GUARD_BYTES = 65536


def journal_path(path: Path) -> Path:
    """The journal of the store at ``path``: ``.NAME.b2nd.journal`` in the same folder."""
    return path.with_name(f".{path.name}.journal")


@dataclass(frozen=True)
class Journal:
    """What a write saved before it began: the old file length and the bytes it overwrites."""

    old_len: int
    regions: tuple[tuple[int, bytes], ...]
    #: (offset, length, crc32) of bytes the write never changes (the end of the old data
    #: chunks): a file whose bytes there differ is not the one this journal was made for
    guard: tuple[int, int, int] = (0, 0, 0)

    @staticmethod
    def guard_of(fd: int, data_start: int, data_end: int) -> tuple[int, int, int]:
        """The guard of a file whose data chunks lie in [data_start, data_end)."""
        start = max(data_start, data_end - GUARD_BYTES)
        return start, data_end - start, zlib.crc32(os.pread(fd, data_end - start, start)) & 0xFFFFFFFF

    def encode(self) -> bytes:
        parts = [MAGIC, struct.pack("<QI", self.old_len, len(self.regions)), struct.pack("<QQI", *self.guard)]
        for offset, data in self.regions:
            parts.append(struct.pack("<QQ", offset, len(data)))
            parts.append(data)
        body = b"".join(parts)
        return body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)

    @classmethod
    def decode(cls, raw: bytes) -> Journal | None:
        """The journal in ``raw``, or None when it is incomplete or damaged (never completed)."""
        if len(raw) < len(MAGIC) + 16 or raw[: len(MAGIC)] not in (MAGIC, _MAGIC_01):
            return None
        body, crc = raw[:-4], struct.unpack("<I", raw[-4:])[0]
        if zlib.crc32(body) & 0xFFFFFFFF != crc:
            return None
        pos = len(MAGIC)
        old_len, n = struct.unpack_from("<QI", body, pos)
        pos += 12
        guard = (0, 0, 0)
        if raw[: len(MAGIC)] == MAGIC:
            if pos + 20 > len(body):
                return None
            guard = struct.unpack_from("<QQI", body, pos)
            pos += 20
        regions = []
        for _ in range(n):
            if pos + 16 > len(body):
                return None
            offset, length = struct.unpack_from("<QQ", body, pos)
            pos += 16
            if pos + length > len(body) or offset + length > old_len:
                return None
            regions.append((offset, bytes(body[pos : pos + length])))
            pos += length
        if pos != len(body):
            return None
        return cls(old_len, tuple(regions), guard)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_journal(path: Path, journal: Journal) -> None:
    """Write the journal of ``path`` and make it durable (file and folder fsynced)."""
    jp = journal_path(path)
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:  # never through a link planted at this predictable name: it would overwrite its target
        fd = os.open(jp, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise WriteError(
                f"{jp} is a symbolic link; a writer never follows one at its journal's name (it would overwrite "
                "the file it points to): remove the link, then write again"
            ) from exc
        raise
    try:
        view = memoryview(journal.encode())
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException:  # a disk full, say: the store is untouched, no journal is left
        os.close(fd)
        with contextlib.suppress(OSError):
            jp.unlink()
        raise
    os.close(fd)
    _fsync_dir(path.parent)


def load_journal(path: Path) -> Journal | None:
    """The hot journal of ``path`` (present and complete), or None.

    Raises CorruptStoreError when the journal's guard bytes differ from the file's: the
    file was replaced (a copy restored over it) after the write died, and rolling this
    journal back would write another file's header and trailer into it.
    """
    try:
        raw = journal_path(path).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return None
    journal = Journal.decode(raw)
    if journal is not None and journal.guard[1]:
        start, length, crc = journal.guard
        try:
            with open(path, "rb") as f:
                f.seek(start)
                same = zlib.crc32(f.read(length)) & 0xFFFFFFFF == crc
        except OSError:
            same = False
        if not same:
            raise CorruptStoreError(
                f"{path}: its journal {journal_path(path).name} was left by an interrupted write to another file "
                f"(this one was replaced since, e.g. restored from a copy); rolling it back would damage this file. "
                f"If {path.name} is the store you want, delete {journal_path(path)}"
            )
    return journal


def remove_journal(path: Path) -> None:
    """Remove the journal (the write it guarded is now complete, or undone) durably."""
    with contextlib.suppress(FileNotFoundError):
        journal_path(path).unlink()
        _fsync_dir(path.parent)


def rollback(path: Path) -> bool:
    """Undo a half-done write (append or metadata update) from its journal. Call with the writer lock held.

    Returns True when something was restored; an incomplete journal is only removed.
    """
    journal = load_journal(path)
    if journal is None:
        remove_journal(path)
        return False
    try:
        fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CorruptStoreError(
            f"{path}: a write (append or metadata update) was interrupted and its journal {journal_path(path).name} "
            "must be rolled back, "
            f"but the store cannot be opened for writing ({exc}); open it once with write permission"
        ) from exc
    try:
        for offset, data in journal.regions:
            view = memoryview(data)
            pos = offset
            while view:
                n = os.pwrite(fd, view, pos)
                view, pos = view[n:], pos + n
        os.ftruncate(fd, journal.old_len)
        os.fsync(fd)
    finally:
        os.close(fd)
    remove_journal(path)
    return True


def rollback_if_abandoned(path: Path) -> bool:
    """For readers: roll back a journal whose writer is gone, when this process may.

    A hot journal is rolled back, an incomplete one removed. Returns False when there is
    no journal or it cannot be done now (a writer holds the lock, or the store or its
    folder is read-only): then read through JournalSource (hot) or the file (incomplete).
    """
    if not journal_path(path).exists() or not os.access(path, os.W_OK):
        return False
    lock = WriterLock(path, purpose="rollback of an interrupted write")
    if not lock.acquire(blocking=False):
        return False
    try:
        rollback(path)
        return True
    finally:
        lock.release()


class JournalSource(LocalFileSource):
    """The store as it was before the write that ``journal`` guards: the file's bytes with
    the journal's saved regions laid over them, cut at the old length. The file may be
    shorter than that (a metadata update that shrank the trailer): the bytes past its end
    all come from the journal."""

    def __init__(self, path: str | os.PathLike[str], journal: Journal) -> None:
        super().__init__(path)
        self._regions: Sequence[tuple[int, bytes]] = journal.regions
        if self._size < journal.old_len and not self._covered(self._size, journal.old_len):
            self.close()
            raise CorruptStoreError(
                f"{path}: shorter ({self._size} bytes) than its journal's old length {journal.old_len}"
            )
        self._size = journal.old_len
        self.location = str(self.path)

    def _covered(self, start: int, stop: int) -> bool:
        """Whether the saved regions cover every byte of [start, stop)."""
        for o, d in sorted(self._regions):
            if o <= start < o + len(d):
                start = o + len(d)
        return start >= stop

    def _overlay(self, offset: int, length: int) -> list[tuple[int, bytes]]:
        return [(o, d) for o, d in self._regions if o < offset + length and offset < o + len(d)]

    def read(self, offset: int, length: int) -> bytes:
        if offset < 0 or offset + length > self._size:
            raise CorruptStoreError(
                f"{self.location}: bytes {offset}-{offset + length} lie outside the store of {self._size} bytes"
            )
        hits = self._overlay(offset, length)
        if not hits:
            return super().read(offset, length)
        out = bytearray(length)
        # file bytes where no saved region covers them
        covered = sorted((max(o, offset), min(o + len(d), offset + length)) for o, d in hits)
        pos = offset
        for start, stop in [*covered, (offset + length, offset + length)]:
            if start > pos:
                out[pos - offset : start - offset] = super().read(pos, start - pos)
            pos = max(pos, stop)
        for o, d in hits:
            start, stop = max(o, offset), min(o + len(d), offset + length)
            out[start - offset : stop - offset] = d[start - o : stop - o]
        return bytes(out)

    def view(self, offset: int, length: int) -> memoryview:
        if self._overlay(offset, length):
            return memoryview(self.read(offset, length))
        return super().view(offset, length)

    def __repr__(self) -> str:
        return f"<JournalSource {self.location!r} (the store before an unfinished write)>"
