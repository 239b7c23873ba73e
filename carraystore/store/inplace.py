"""Changing a store file in place, under the rollback journal (layer 3).

Used by appends and :func:`carraystore.store.metadata.update_metadata`; steps: docs/appends.md.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import blosc2
import numpy as np

from carraystore.base.errors import CarrayStoreError, CorruptStoreError, InvalidInputError, StoreChangedError
from carraystore.format.frame import (
    CBYTES_AT,
    FRAME_LEN_AT,
    NBYTES_AT,
    Frame,
    encode_offsets,
    raw_offsets,
    shape0_position,
    special_chunk_header,
)
from carraystore.format.record import META_KEY, StoreMeta, metadata_limit
from carraystore.sources.journal import (
    Journal,
    remove_journal,
    rollback,
    undo_write,
    write_journal,
    write_marker,
)
from carraystore.store.reader import open_unguarded

__all__ = ["refuse_hard_links"]  # and, internal to the writer: _InPlaceWrite, _write_meta


def refuse_hard_links(path: Path, st: os.stat_result | None = None) -> None:
    """A store file with more than one name (a hard link) is never changed in place: the writer lock and
    the journal sit beside one name, so writers and readers through another would not see them."""
    try:
        st = st or os.stat(path)
    except OSError:
        return  # missing: named by whoever opens it
    if st.st_nlink > 1:
        raise InvalidInputError(
            f"{path}: the store file has {st.st_nlink} names (hard links, made by ln, cp -al or rsync --link-dest); "
            "it is not changed in place, since its writer lock and rollback journal sit beside one name only and "
            "the change would also appear, unguarded, under the others. Give this name a file of its own: "
            f"cp {path.name} {path.name}.copy && mv {path.name}.copy {path.name} (the other names keep the old file), "
            "then write again"
        )


def _write_meta(array: Any, meta: StoreMeta) -> None:
    """Store the sealed metadata record (FORMAT.md 4.3) as the vlmeta entry ``carraystore``."""
    raw = meta.to_bytes()
    limit = metadata_limit(meta.nimages)
    if len(raw) > limit:
        raise InvalidInputError(
            f"the metadata of {meta.nimages} items takes {len(raw)} bytes, more than the {limit} a store may hold "
            "(FORMAT.md, Limits): keep large per-item data in the images or a separate file, not in attrs or columns"
        )
    array.schunk.vlmeta.set_vlmeta(META_KEY, raw, typesize=1)


#: Special chunks (zeros, NaNs, uninitialised) that a frame keeps as an offsets-index flag.
_STORED_AS_FLAG = (1, 2, 4)


class _InPlaceWrite:
    """Changes a store file in place under a rollback journal (:mod:`carraystore.sources.journal`):
    appends chunks (``put_chunk``) and/or rewrites the metadata (``commit``).

    Data chunks go only after the existing ones, so earlier readers keep the old chunks;
    :meth:`commit` drops the journal once the result reads back whole.
    """

    def __init__(self, path: Path, frame: Frame, nitems: int) -> None:
        self.path = path
        try:
            self._fd: int | None = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except PermissionError as exc:
            raise InvalidInputError(
                f"{path}: the store is not writable ({exc}); it cannot be changed in place"
            ) from exc
        try:
            refuse_hard_links(path, os.fstat(self._fd))
        except BaseException:
            self.close()
            raise
        self._old_len = frame.frame_len
        self._h = frame.header_len
        self._head = bytearray(os.pread(self._fd, self._h, 0))
        self._shape0_at = shape0_position(bytes(self._head), nitems, str(path))
        tail_at = self._h + frame.cbytes
        tail = os.pread(self._fd, self._old_len - tail_at, tail_at)
        trailer_len = int.from_bytes(tail[-22:-18], "big")
        self._journal = Journal.for_write(
            self._old_len, ((0, bytes(self._head)), (tail_at, tail)), tail_at if frame.nchunks else None
        )
        self._trailer = tail[len(tail) - trailer_len :]
        self._offsets = list(raw_offsets(frame))
        self._chunk_nbytes = frame.chunksize
        self._end = tail_at  # where the next data chunk goes
        self._journaled = False
        self._committed = False
        self._grown = False  # chunks were written: the offsets index and the header's sizes change
        self._frame = frame

    def read_chunk(self, i: int) -> bytes:
        f = self._frame
        offset, length = int(f.chunk_offsets[i]), int(f.chunk_lengths[i])
        if offset < 0:
            return special_chunk_header(int(f.chunk_special[i]), f.chunksize, f.blocksize, f.typesize)
        assert self._fd is not None
        data = os.pread(self._fd, length, offset)
        return data[: int.from_bytes(data[12:16], "little")] if len(data) >= 16 else data

    def _begin(self) -> None:
        if not self._journaled:
            assert self._fd is not None  # journal durable, then the write's marker, before any other change
            write_journal(self.path, self._journal)
            self._journaled = True  # from here on abort() undoes: a marker write may fail half-way
            end = write_marker(self._fd, self._journal)
            if end is not None:  # the marker sits in the data region: the offsets index moves after it
                self._end, self._grown = end, True

    def _pwrite(self, data: bytes | memoryview, offset: int) -> None:
        assert self._fd is not None
        view = memoryview(data)
        while view:
            n = os.pwrite(self._fd, view, offset)
            view, offset = view[n:], offset + n

    def put_chunk(self, i: int, data: bytes) -> None:
        """Write chunk ``i`` (new, or the partial last one again) after all data so far."""
        self._begin()
        self._grown = True
        special = (data[31] >> 4) & 0x7 if len(data) >= 32 else 0
        if special in _STORED_AS_FLAG:  # as blosc2 does: a flag in the offsets index, no bytes
            entry = int(np.array([(1 << 63) | (special << 56)], dtype=np.uint64).view(np.int64)[0])
        else:
            self._pwrite(data, self._end)
            entry = self._end - self._h
            self._end += len(data)
        if i < len(self._offsets):
            self._offsets[i] = entry
        elif i == len(self._offsets):
            self._offsets.append(entry)
        else:
            raise InvalidInputError(f"{self.path}: chunk {i} written before chunk {len(self._offsets)}")

    def commit(self, meta: StoreMeta) -> None:
        """Write the offsets index and header sizes (if chunks were added), the trailer; fsync; check; drop the journal."""
        if not self._journaled and self._frame.vlmeta(META_KEY) == meta.to_bytes():
            self.close()  # nothing changes (an append of nothing): nothing is written
            return
        self._begin()
        assert self._fd is not None
        self._check_same_file()  # before the header changes: a replaced or linked file is left as it was
        if self._grown:
            index = encode_offsets(np.asarray(self._offsets, dtype="<i8"))
            self._pwrite(index, self._end)
            new_len = self._end + len(index) + len(self._trailer)
            self._pwrite(self._trailer, self._end + len(index))  # the old trailer, replaced below
            head = self._head
            head[FRAME_LEN_AT : FRAME_LEN_AT + 8] = new_len.to_bytes(8, "big")
            head[NBYTES_AT : NBYTES_AT + 8] = (len(self._offsets) * self._chunk_nbytes).to_bytes(8, "big", signed=True)
            head[CBYTES_AT : CBYTES_AT + 8] = (self._end - self._h).to_bytes(8, "big", signed=True)
            head[self._shape0_at : self._shape0_at + 8] = meta.nimages.to_bytes(8, "big", signed=True)
            self._pwrite(bytes(head), 0)
            os.ftruncate(self._fd, new_len)
        own = self._own_name()
        array = blosc2.open(own, mode="a")  # never pass cparams here
        _write_meta(array, meta)  # blosc2 rewrites the trailer (and the header's frame length)
        del array
        frame_len = int.from_bytes(os.pread(self._fd, 8, FRAME_LEN_AT), "big")
        if os.fstat(self._fd).st_size > frame_len:  # a shorter trailer than the one before
            os.ftruncate(self._fd, frame_len)
        os.fsync(self._fd)
        try:
            check = open_unguarded(own)  # the journal goes only once the new store reads back whole
        except CarrayStoreError as exc:
            why = str(exc).replace(own, str(self.path))
            raise CorruptStoreError(
                f"{self.path}: the changed store reads back wrong ({why}); the change is undone"
            ) from exc
        try:
            got = (check.meta.nimages, check.nchunks, check.meta.class_names, json.dumps(check.meta.attrs))
            if got != (meta.nimages, len(self._offsets), meta.class_names, json.dumps(meta.attrs)):  # NaN == NaN
                raise CorruptStoreError(f"{self.path}: the changed store reads back wrong; the change was undone")
        finally:
            check.close()
        self._check_same_file(replaced_only=True)
        remove_journal(self.path)
        self._committed = True
        self.close()

    def _check_same_file(self, replaced_only: bool = False) -> None:
        """The file at ``path`` must still be the one this write opened (and, unless ``replaced_only``, have no
        other name): else the write is undone (by :meth:`abort`) and named, the file now at ``path`` untouched."""
        assert self._fd is not None
        mine = os.fstat(self._fd)
        try:
            now: os.stat_result | None = os.stat(self.path)
        except OSError:
            now = None
        if now is None or not os.path.samestat(mine, now):
            what = "removed" if now is None else "replaced by another file (a rename or move onto its name)"
            raise StoreChangedError(
                f"{self.path} was {what} while this write was at work; the write is undone and not committed, "
                f"{'nothing is there' if now is None else 'the file now there is left as it is'}. "
                "Write again, to the store you mean"
            )
        if not replaced_only:
            refuse_hard_links(self.path, mine)

    def _own_name(self) -> str:
        """A name of the very file this write holds open, for blosc2 and the read-back check: the open
        descriptor's (``/proc/self/fd/N``) where the system has one, else the path, just checked."""
        assert self._fd is not None
        fd_name = f"/proc/self/fd/{self._fd}"
        try:
            if os.path.samestat(os.stat(fd_name), os.fstat(self._fd)):
                return fd_name
        except OSError:
            pass
        self._check_same_file(replaced_only=True)
        return str(self.path)

    def abort(self) -> None:
        """Undo everything written (the store is again exactly as it was). When the file system refuses the
        undo (a full disk), the journal stays, so the next open or write finishes it: that is a named
        :class:`~carraystore.base.errors.WriteError`, or, while another error is being handled (the one
        that made the write abort), a note added to that error, which is never masked."""
        if not self._journaled or self._committed:
            self.close()
            return
        pending = sys.exc_info()[1]  # the error being handled, if any: the reason for this abort
        try:
            if self._fd is not None:
                undo_write(self.path, self._fd, self._journal)  # through the file written, even if replaced
            else:
                rollback(self.path)
        except CarrayStoreError as failed:
            if pending is None:
                raise
            note = f"and undoing the write failed too: {failed}"
            add_note = getattr(pending, "add_note", None)  # Python 3.11+
            if add_note is not None:
                add_note(note)
            else:
                warnings.warn(note, RuntimeWarning, stacklevel=2)
        finally:
            self.close()

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
