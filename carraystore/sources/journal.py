"""The rollback journal of an in-place write (layer 2); docs/appends.md is its spec.
Before its first write, an append or metadata update saves the bytes it will overwrite and the old
length in ``.NAME.b2nd.journal`` (fsynced); it removes it after its last write. A complete ("hot")
journal means a write died: :func:`rollback` restores the old store byte for byte. ``CSJRNL03``
(FORMAT.md appendix C) holds the write's mark: a nonce and where :func:`begin_write` puts its marker
before any other change. A journal is applied only to a file holding that marker or still the old
store, else refused (:class:`~carraystore.base.errors.StaleJournalError`); an incomplete one is just
removed; ``CSJRNL02``/``01`` apply only while the old header is in place. Readers take no lock: one
that cannot roll back reads through :class:`JournalSource`."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from carraystore.base.errors import CorruptStoreError, StaleJournalError, WriteError
from carraystore.base.lock import WriterLock
from carraystore.format.frame import FRAME_LEN_AT
from carraystore.sources.local import LocalFileSource

__all__ = [
    "Journal",
    "journal_path",
    "load_journal",
    "write_journal",
    "begin_write",
    "rollback",
    "remove_journal",
    "JournalSource",
    "rollback_if_abandoned",
]

MAGIC = b"CSJRNL03"  # 03: the write's mark (nonce + marker offset) instead of 02's data-tail guard
_MAGIC_02 = b"CSJRNL02"
_MAGIC_01 = b"CSJRNL01"
_MAGICS = (MAGIC, _MAGIC_02, _MAGIC_01)
#: Bytes of the old data region, just before its end, whose CRC ties a CSJRNL02 journal to its file.
GUARD_BYTES = 65536
#: The marker a write puts at its mark offset before its first other change: magic, nonce, zeros.
MARK_MAGIC = b"CSWRITE1"
MARK_BYTES = 32
NONCE_BYTES = 16


def journal_path(path: Path) -> Path:
    """The journal of the store at ``path``: ``.NAME.b2nd.journal`` in the same folder."""
    return path.with_name(f".{path.name}.journal")


@dataclass(frozen=True)
class Journal:
    """What a write saved before it began: the old file length and the bytes it overwrites."""

    old_len: int
    regions: tuple[tuple[int, bytes], ...]
    #: CSJRNL02 only: (offset, length, crc32) of the last old data bytes
    guard: tuple[int, int, int] = (0, 0, 0)
    #: where the write puts its marker (the old end of the data chunks), and its nonce
    mark_at: int = 0
    nonce: bytes = b""
    #: the journal's version: 3 (this one), 2 or 1 (loaded from development builds)
    version: int = 3

    @classmethod
    def for_write(cls, old_len: int, regions: tuple[tuple[int, bytes], ...], mark_at: int | None) -> Journal:
        """The journal of a write overwriting ``regions`` of an ``old_len``-byte file, marker at ``mark_at``
        (``None``: no marker, for a store with no chunk whose frame cannot hold one)."""
        return cls(old_len, regions, mark_at=mark_at or 0, nonce=secrets.token_bytes(NONCE_BYTES))

    @property
    def marker(self) -> bytes:
        """The 32 bytes :func:`begin_write` puts at ``mark_at``."""
        return MARK_MAGIC + self.nonce + bytes(MARK_BYTES - len(MARK_MAGIC) - NONCE_BYTES)

    def encode(self) -> bytes:
        if len(self.nonce) != NONCE_BYTES:
            raise ValueError("a journal is written with its write's nonce (Journal.for_write)")
        parts = [
            MAGIC,
            struct.pack("<QI", self.old_len, len(self.regions)),
            struct.pack("<Q", self.mark_at),
            self.nonce,
        ]
        for offset, data in self.regions:
            parts.append(struct.pack("<QQ", offset, len(data)))
            parts.append(data)
        body = b"".join(parts)
        return body + struct.pack("<I", zlib.crc32(body) & 0xFFFFFFFF)

    @classmethod
    def decode(cls, raw: bytes) -> Journal | None:
        """The journal in ``raw``, or None when it is incomplete or damaged (never completed)."""
        magic = raw[: len(MAGIC)]
        if len(raw) < len(MAGIC) + 16 or magic not in _MAGICS:
            return None
        version = 3 - _MAGICS.index(magic)
        body, crc = raw[:-4], struct.unpack("<I", raw[-4:])[0]
        if zlib.crc32(body) & 0xFFFFFFFF != crc:
            return None
        pos = len(MAGIC)
        old_len, n = struct.unpack_from("<QI", body, pos)
        pos += 12
        guard = (0, 0, 0)
        mark_at, nonce = 0, b""
        if version == 3:
            if pos + 8 + NONCE_BYTES > len(body):
                return None
            (mark_at,) = struct.unpack_from("<Q", body, pos)
            nonce = bytes(body[pos + 8 : pos + 8 + NONCE_BYTES])
            pos += 8 + NONCE_BYTES
            if mark_at + MARK_BYTES > 2**63:
                return None
        elif version == 2:
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
        return cls(old_len, tuple(regions), guard, mark_at, nonce, version)


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


def begin_write(path: Path, fd: int, journal: Journal) -> int | None:
    """Write the journal durably, then the marker, before a write's first change to ``path`` (open as ``fd``).
    Returns where the write's data continues (after the marker), or None without a marker."""
    write_journal(path, journal)
    if not journal.mark_at:
        return None
    view, pos = memoryview(journal.marker), journal.mark_at
    while view:
        n = os.pwrite(fd, view, pos)
        view, pos = view[n:], pos + n
    os.fsync(fd)  # durable before any later change: a crash never leaves a changed file without it
    return journal.mark_at + MARK_BYTES


def _pread_path(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _is_old_state(path: Path, journal: Journal) -> bool:
    """Whether the file is still, byte for byte where the journal saved it, the store before the write."""
    if os.path.getsize(path) != journal.old_len:
        return False
    return all(_pread_path(path, offset, len(data)) == data for offset, data in journal.regions)


#: Header bytes blosc2 rewrites on a metadata update: the frame length and the two thread counts.
_THREADS_AT, _THREADS_END = 62, 68


def _masked(head: bytes) -> bytes:
    return head[:FRAME_LEN_AT] + head[FRAME_LEN_AT + 8 : _THREADS_AT] + head[_THREADS_END:]


def _belongs(path: Path, journal: Journal) -> bool:
    """Whether ``journal`` was made for the file now at ``path`` (so rolling it back is right)."""
    try:
        if journal.version == 3 and journal.mark_at:
            if _pread_path(path, journal.mark_at, MARK_BYTES) == journal.marker:
                return True  # the write reached its marker: this is the file it changed
            if _is_old_state(path, journal):
                return True  # it died before (or is about to write it): nothing changed yet
            # a live writer may have put its marker between the two reads (old -> marked, never back)
            return _pread_path(path, journal.mark_at, MARK_BYTES) == journal.marker
        if journal.version == 3:  # no marker (a store with no chunk): its header, but for what blosc2 rewrites
            head = next((d for o, d in journal.regions if o == 0), b"")
            now = _pread_path(path, 0, len(head))
            return len(now) == len(head) > _THREADS_END and _masked(now) == _masked(head)
        # development builds' journals: only while the old header is still in place
        old_head = next((d for o, d in journal.regions if o == 0), None)
        if old_head is None or _pread_path(path, 0, len(old_head)) != old_head:
            return False
        if journal.version == 2 and journal.guard[1]:
            start, length, crc = journal.guard
            return zlib.crc32(_pread_path(path, start, length)) & 0xFFFFFFFF == crc
        return True
    except OSError:
        return False


def load_journal(path: Path) -> Journal | None:
    """The hot journal of ``path`` (present and complete), or None. StaleJournalError (a CorruptStoreError)
    when it was not made for the file now there (replaced after the write died): it is never applied."""
    try:
        raw = journal_path(path).read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError:
        return None
    journal = Journal.decode(raw)
    if journal is not None and not _belongs(path, journal):
        raise StaleJournalError(
            f"{path}: its journal {journal_path(path).name} was left by an interrupted write to another file "
            "(this one was replaced since, e.g. a newer or older copy restored over it); it is not applied, "
            f"rolling it back would damage this file or lose its newer items. If {path.name} is the store you want, "
            f"delete {journal_path(path)} (then run `carraystore verify {path.name}`)"
        )
    return journal


def remove_journal(path: Path) -> None:
    """Remove the journal (the write it guarded is now complete, or undone) durably."""
    with contextlib.suppress(FileNotFoundError):
        journal_path(path).unlink()
        _fsync_dir(path.parent)


def rollback(path: Path) -> bool:
    """Undo a half-done write from its journal (writer lock held); True if something was restored."""
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
    """For readers: roll back a journal whose writer is gone, when this process may. False when there is
    none or it cannot be done now (lock held, read-only): then read via JournalSource (hot) or the file."""
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
    """The store before the write that ``journal`` guards: the file with the saved regions laid
    over it, cut at the old length (bytes past a shorter file's end come from the journal)."""

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
