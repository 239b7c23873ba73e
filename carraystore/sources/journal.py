"""The rollback journal of an in-place write (layer 2); docs/appends.md is its spec.
Before its first write, an append or metadata update saves the bytes it will overwrite and the old
length in ``.NAME.b2nd.journal`` (fsynced); it removes it after its last write. A complete ("hot")
journal means a write died: :func:`rollback` restores the old store byte for byte. ``CSJRNL03``
(FORMAT.md appendix C) holds the write's mark: a nonce and where :func:`begin_write` puts its marker
before any other change. A journal is applied only to a file holding that marker or the saved bytes
(the old store, or one half rolled back: :func:`rollback` restores the marker's bytes last, so a
killed rollback is finished by the next), else refused
(:class:`~carraystore.base.errors.StaleJournalError`); an incomplete one is just removed; ``CSJRNL02``/``01`` apply only while the old header is in place. Readers take no lock: one
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

import numpy as np

from carraystore.base.atomic import write_error
from carraystore.base.errors import CorruptStoreError, NoSpaceError, StaleJournalError, WriteError
from carraystore.base.lock import WriterLock
from carraystore.format.frame import FRAME_LEN_AT
from carraystore.sources.local import LocalFileSource

__all__ = [
    "Journal",
    "journal_path",
    "load_journal",
    "write_journal",
    "begin_write",
    "write_marker",
    "rollback",
    "undo_write",
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
    """Write the journal of ``path`` and make it durable (file and folder fsynced). A failed write
    (a full disk, a file size limit) is a :class:`WriteError` naming the journal; none is left."""
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
        raise write_error(exc, jp, f"the rollback journal of {path.name} (the store is unchanged)") from exc
    try:
        view = memoryview(journal.encode())
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except BaseException as exc:  # a disk full, say: the store is untouched, no journal is left
        os.close(fd)
        with contextlib.suppress(OSError):
            jp.unlink()
        if isinstance(exc, OSError):
            raise write_error(exc, jp, f"the rollback journal of {path.name} (the store is unchanged)") from exc
        raise
    os.close(fd)
    _fsync_dir(path.parent)


def write_marker(fd: int, journal: Journal) -> int | None:
    """Put the write's marker at ``journal.mark_at`` of the store open as ``fd`` and fsync it; its journal
    must be durable first. Returns where the write's data continues (after the marker), or None without one."""
    if not journal.mark_at:
        return None
    _pwrite_all(fd, journal.marker, journal.mark_at)
    os.fsync(fd)  # durable before any later change: a crash never leaves a changed file without it
    return journal.mark_at + MARK_BYTES


def begin_write(path: Path, fd: int, journal: Journal) -> int | None:
    """Write the journal durably, then the marker, before a write's first change to ``path`` (open as ``fd``).
    Returns where the write's data continues (after the marker), or None without a marker."""
    write_journal(path, journal)
    return write_marker(fd, journal)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _pread_path(path: Path, offset: int, length: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(length)


def _pieces(journal: Journal) -> list[tuple[int, bytes, bool]]:
    """The saved regions as (offset, bytes, is the marker's span) pieces: a region that holds the marker's
    32 bytes is cut around them, so that rollback can restore them last."""
    lo, hi = journal.mark_at, journal.mark_at + MARK_BYTES
    out: list[tuple[int, bytes, bool]] = []
    for offset, data in journal.regions:
        if not journal.mark_at or hi <= offset or offset + len(data) <= lo:
            out.append((offset, data, False))
            continue
        a, b = max(lo, offset) - offset, min(hi, offset + len(data)) - offset
        out += [(offset, data[:a], False), (offset + a, data[a:b], True), (offset + b, data[b:], False)]
    return [p for p in out if p[1]]


def _holds_saved(path: Path, journal: Journal) -> bool:
    """Whether the file holds, wherever the journal saved bytes, those bytes, except that in the marker's
    span each byte may still be the marker's: the store before the write, the same with the marker
    half-written (a write killed in the marker's ``pwrite``), or half rolled back (rollback restores the
    marker's span last, then truncates). Any such file is the journal's own; rolling back finishes it."""
    marker = journal.marker if journal.mark_at else b""
    for offset, data, at_marker in _pieces(journal):
        now = _pread_path(path, offset, len(data))
        if now == data:
            continue
        if not at_marker or len(now) != len(data):
            return False
        m = marker[offset - journal.mark_at : offset - journal.mark_at + len(data)]
        if any(c != d and c != k for c, d, k in zip(now, data, m, strict=True)):
            return False
    return True


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
            if _holds_saved(path, journal):
                return True  # not changed yet (or the marker half-written), or half rolled back
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


def _restore(fd: int, journal: Journal) -> None:
    """Put the saved bytes back and cut the file at the old length. Only bytes that differ are written
    (bytes a write never reached, past a file size limit say, are left alone), the marker's span last:
    until it is gone the marker says whose file this is, and after it every saved byte is in place
    (:func:`_holds_saved`), so a kill at any point leaves a file the journal still applies to."""
    pieces = _pieces(journal)
    for offset, data, at_marker in pieces:
        if not at_marker:
            _write_back(fd, offset, data)
    if journal.mark_at:
        os.fsync(fd)  # every other saved byte durable before the marker goes
        for offset, data, at_marker in pieces:
            if at_marker:
                _write_back(fd, offset, data)
    if os.fstat(fd).st_size != journal.old_len:
        os.ftruncate(fd, journal.old_len)
    os.fsync(fd)


def _write_back(fd: int, offset: int, data: bytes) -> None:
    """Write ``data`` at ``offset``, only the span from its first to its last byte that differs from the file's."""
    now = os.pread(fd, len(data), offset)
    if now == data:
        return
    n = len(now)
    diff = np.flatnonzero(np.frombuffer(now, np.uint8) != np.frombuffer(data, np.uint8)[:n])
    first = int(diff[0]) if len(diff) else n
    last = len(data) if n < len(data) else int(diff[-1]) + 1
    _pwrite_all(fd, memoryview(data)[first:last], offset + first)


def _rollback_failed(exc: OSError, path: Path) -> WriteError:
    """The named error of a rollback the file system refused: the journal stays, nothing is lost."""
    jp = journal_path(path)
    kept = (
        f"its journal {jp.name} is kept and the store reads as it was before that write; the next open or write of "
        f"{path.name} with room to write rolls it back"
    )
    error: WriteError
    if isinstance(exc, NoSpaceError) or exc.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        error = NoSpaceError(f"{path}: no space left to undo an unfinished write ({exc}); {kept}: free some space")
    else:
        error = WriteError(
            f"{path}: could not undo an unfinished write ({exc}); {kept}: check the file system's space, "
            "quota and file size limit"
        )
    error.errno = exc.errno or errno.EIO
    return error


def rollback(path: Path) -> bool:
    """Undo a half-done write from its journal (writer lock held); True if something was restored.
    Idempotent: killed at any point, the next rollback finishes it. A write the file system refuses
    is a :class:`WriteError` (the journal is kept)."""
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
        _restore(fd, journal)
    except OSError as exc:
        raise _rollback_failed(exc, path) from exc
    finally:
        os.close(fd)
    remove_journal(path)
    return True


def undo_write(path: Path, fd: int, journal: Journal) -> None:
    """For the writer that made ``journal``: undo its write to the file open as ``fd`` (the file it wrote,
    even if another one was put at ``path`` since), then remove the journal if it is still this one.
    A write the file system refuses is a :class:`WriteError` (the journal is kept)."""
    try:
        _restore(fd, journal)
    except OSError as exc:
        raise _rollback_failed(exc, path) from exc
    with contextlib.suppress(OSError):
        if journal_path(path).read_bytes() != journal.encode():
            return  # not ours (we hold the lock: never the case but for a journal removed and written again)
    remove_journal(path)


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
