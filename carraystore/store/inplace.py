"""Changing a store file in place, under the rollback journal (layer 3).

Used by appends and :func:`carraystore.store.metadata.update_metadata`; steps: docs/appends.md.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import blosc2
import numpy as np

from carraystore.base.errors import CorruptStoreError, InvalidInputError
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
from carraystore.sources.journal import Journal, begin_write, remove_journal, rollback
from carraystore.store.reader import open_unguarded

__all__: list[str] = []  # internal to the writer: _InPlaceWrite, _write_meta


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
            end = begin_write(self.path, self._fd, self._journal)
            self._journaled = True
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
        array = blosc2.open(str(self.path), mode="a")  # never pass cparams here
        _write_meta(array, meta)  # blosc2 rewrites the trailer (and the header's frame length)
        del array
        frame_len = int.from_bytes(os.pread(self._fd, 8, FRAME_LEN_AT), "big")
        if os.fstat(self._fd).st_size > frame_len:  # a shorter trailer than the one before
            os.ftruncate(self._fd, frame_len)
        os.fsync(self._fd)
        check = open_unguarded(self.path)  # the journal goes only once the new store reads back whole
        try:
            got = (check.meta.nimages, check.nchunks, check.meta.class_names, json.dumps(check.meta.attrs))
            if got != (meta.nimages, len(self._offsets), meta.class_names, json.dumps(meta.attrs)):  # NaN == NaN
                raise CorruptStoreError(f"{self.path}: the changed store reads back wrong; the change was undone")
        finally:
            check.close()
        remove_journal(self.path)
        self.close()

    def abort(self) -> None:
        """Undo everything written (the store is again exactly as it was)."""
        self.close()
        if self._journaled:
            rollback(self.path)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
