"""Reading a store: open, describe, read and decompress whole chunks, index, verify (layer 3).

A :class:`StoreReader` reads through a byte source (:mod:`carraystore.sources.local`). Opening
parses the frame and metadata and checks the pinned codec, never reading the images. Blocks
span whole images, so a decompressed chunk is its images in row order.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar, overload

import blosc2
import numpy as np

from carraystore.base.errors import (
    CarrayStoreError,
    ChecksumError,
    CorruptStoreError,
    InvalidInputError,
    NotAStoreError,
    RemoteReadError,
)
from carraystore.base.forksafe import at_fork_in_child, in_forked_child
from carraystore.format.codec import (
    Codec,
    check_codec_against_header,
    chunk_crc_ok,
    crc32,
    parse_chunk_header,
)
from carraystore.format.encoded import chunk_entries, decode_chunk_inplace, reduce_images_inplace, reduced_view
from carraystore.format.frame import ByteSource, Frame, ReadAheadSource, read_frame, special_chunk_header
from carraystore.format.record import (
    StoreMeta,
    StringTable,
    as_records,
)
from carraystore.sources.journal import JournalSource, load_journal, rollback_if_abandoned
from carraystore.sources.local import LocalFileSource
from carraystore.store.checks import (
    check_frame_against_meta,
    file_state,
    header_problems,
    plain_blosc2_problem,
    read_meta,
)

#: Times a chunk fetched over a network that fails its CRC32 is fetched again before it is an error.
CRC_REFETCHES = 2
_log = logging.getLogger("carraystore.sources.remote")  # the refetches are the remote reader's business

__all__ = [
    "StoreReader",
    "ChunkProblem",
    "Verify",
    "check_verify",
    "forget_checked_chunks",
    "open_store",
    "open_source",
    "is_url",
    "open_unguarded",
]

# Decompression in threads only runs in parallel when blosc2 releases the GIL.
blosc2.set_releasegil(True)

#: ``verify=``: True (each chunk of a local file checked once per process while the file is unchanged),
#: ``"always"`` (every read) or False (never; remote reads are always checked)
Verify = bool | Literal["always"]


def check_verify(value: Any) -> Verify:
    """``verify=`` checked: ``"always"``, else its truth value (another string is InvalidInputError)."""
    if isinstance(value, str):
        if value != "always":
            raise InvalidInputError(f"verify must be True, False or 'always', got {value!r}")
        return "always"
    return bool(value)


# -- chunks this process checked (verify=True) ---------------------------------------------------
#: a file changed less than this long ago (its ctime) is checked on every read: a change within the
#: file system's timestamp granularity would leave (size, mtime, ctime) as they were
SETTLE_S = 0.05
#: the same for file systems whose timestamps are whole seconds (FAT keeps mtime to 2 s)
SETTLE_COARSE_S = 2.5

#: (st_dev, st_ino) -> (the file's state when checked, the chunks checked: (offset, length, crc))
_CHECKED: dict[tuple[int, ...], tuple[tuple[int, ...], set[tuple[int, int, int]]]] = {}
_CHECKED_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    global _CHECKED_LOCK
    _CHECKED_LOCK = threading.Lock()  # a parent's thread may have held it


at_fork_in_child(_after_fork_in_child)


def _state_of(fd: int) -> tuple[int, ...]:
    """What any change of the file's bytes through the file system changes: (st_dev, st_ino,
    st_size, st_mtime_ns, st_ctime_ns); the ctime cannot be set back by a writer, unlike the mtime."""
    st = os.fstat(fd)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def _settled(state: tuple[int, ...]) -> bool:
    """Whether the file last changed long enough ago that another change would change its state."""
    coarse = state[3] % 1_000_000_000 == 0 and state[4] % 1_000_000_000 == 0
    return time.time_ns() - state[4] > (SETTLE_COARSE_S if coarse else SETTLE_S) * 1e9


#: preadv's flag that fails with EAGAIN rather than wait for the disk (Linux); 0 where none
_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0) if hasattr(os, "preadv") else 0
#: a byte per this many bytes of a range is probed for :func:`_not_cached`
PROBE_STRIDE = 1 << 20


def _not_cached(fd: int | None, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ranges of a local file not in the page cache: a byte per :data:`PROBE_STRIDE` and the last
    one read without waiting for the disk (a probe that misses starts the kernel reading its page,
    as the hint would). Telling the kernel of cached ranges (``posix_fadvise``) costs about as much
    as reading them once more from the cache; a range whose probed pages are in while others were
    dropped is read from the disk when decoded, without read-ahead."""
    global _NOWAIT
    if fd is None or not _NOWAIT:
        return ranges
    buf = [bytearray(1)]
    out = []
    for offset, length in ranges:
        probes = [*range(offset, offset + length, PROBE_STRIDE), offset + length - 1]
        try:
            for at in probes:
                os.preadv(fd, buf, at, _NOWAIT)
        except BlockingIOError:  # not in the page cache
            out.append((offset, length))
        except OSError:  # not supported here (file system, kernel): tell the kernel of every range
            _NOWAIT = 0
            return ranges
    return out


def forget_checked_chunks() -> None:
    """Forget which chunks this process checked: each is checked again on its next read."""
    _CHECKED.clear()


def is_url(location: Any) -> bool:
    """Whether ``location`` is a URL (``scheme://...``) rather than a local path."""
    return isinstance(location, str) and "://" in location and not location.startswith("file://")


def check_local_store_path(location: str | os.PathLike[str]) -> Path:
    """``location`` as a Path when it is a regular file; a missing path, a folder or a FIFO is a named error."""
    p = Path(location)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such store")
    if p.is_dir():
        raise NotAStoreError(
            f"{p} is a directory; a store is a single .b2nd file (use `carraystore migrate` for bcolz folders)"
        )
    if not p.is_file():
        raise NotAStoreError(f"{p} is not a regular file (a FIFO or device?); a store is a single .b2nd file")
    return p


def open_source(
    location: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_size: int | str | None = None,
) -> ByteSource:
    """The byte source for a path or URL (``s3://``, ``gs://``, ``http(s)://``, ``file://``)."""
    if isinstance(location, str) and location.startswith("file://"):
        location = location[len("file://") :]
    if not is_url(location):
        if storage_options:
            raise InvalidInputError(f"{location}: storage_options apply to URLs only, not to local paths")
        return LocalFileSource(check_local_store_path(location))
    from carraystore.sources.remote import open_remote  # the layer below this one

    source: ByteSource = open_remote(str(location), storage_options)
    if cache_dir is not None:
        from carraystore.sources.cache import CachedSource

        source = CachedSource(source, cache_dir, cache_size)
    return source


@dataclass(frozen=True)
class ChunkProblem:
    """One problem ``Store.verify()`` found: the chunk index (or None for the file) and why."""

    chunk: int | None
    reason: str

    def __str__(self) -> str:
        where = "file" if self.chunk is None else f"chunk {self.chunk}"
        return f"{where}: {self.reason}"


_S = TypeVar("_S", bound="StoreReader")


class StoreReader:
    """A read-only store: metadata, random access (``store[i]``, ``take``), chunks, ``verify``.
    ``carraystore.open`` gives a :class:`carraystore.Store`: this plus the loaders as methods."""

    def __init__(
        self,
        source: ByteSource,
        frame: Frame,
        meta: StoreMeta,
        storage_options: Mapping[str, Any] | None = None,
        open_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self._source = source
        self._frame = frame
        self.meta = meta
        self.location = source.location
        #: a Path for a local store, the URL string for a remote one
        self.path: Any = Path(source.location) if isinstance(source, LocalFileSource) else source.location
        self.storage_options = dict(storage_options or {})
        self._open_kwargs = dict(open_kwargs or {})
        #: every chunk read is checked against its CRC32 (always so for remote stores)
        self.check_reads = not isinstance(source, LocalFileSource)
        #: the source, when it fetches ahead over a link (hints, waits, discards)
        self._link: ReadAheadSource | None = source if isinstance(source, ReadAheadSource) else None
        self._lock = threading.Lock()

    # -- description -------------------------------------------------------------------
    def __len__(self) -> int:
        return self.meta.nimages

    @property
    def source(self) -> ByteSource:
        """Where the bytes come from (see carraystore.sources.local)."""
        return self._source

    @property
    def shape(self) -> tuple[int, ...]:
        """(N, *item_shape): (N, H, W, C) for images."""
        return (self.meta.nimages, *self.meta.image_shape)

    @property
    def image_shape(self) -> tuple[int, ...]:
        """The shape of one item: (H, W, C) for images."""
        return self.meta.image_shape

    @property
    def item_shape(self) -> tuple[int, ...]:
        """The shape of one item (the same as ``image_shape``; the name fits non-image arrays)."""
        return self.meta.image_shape

    @property
    def dtype(self) -> np.dtype:
        return self.meta.np_dtype

    @property
    def layout(self) -> str:
        """``"NHWC"`` for images, ``"array"`` for any other item shape or dtype."""
        return self.meta.layout

    @property
    def columns(self) -> dict[str, np.ndarray]:
        """Per-item metadata columns (for example the other columns of a migrated ctable)."""
        return self.meta.columns

    @property
    def codec(self) -> Codec:
        return self.meta.codec

    @property
    def labels(self) -> np.ndarray | None:
        """Integer labels (int64), one per image, or None for an unlabelled store."""
        return self.meta.labels

    @property
    def keys(self) -> StringTable | None:
        """Relative paths or ids, one per image, or None."""
        return self.meta.keys

    @property
    def class_names(self) -> tuple[str, ...] | None:
        return self.meta.class_names

    @property
    def groups(self) -> np.ndarray | None:
        """Each item's group (video, session, patient) as an index into :attr:`group_names` (int32), or None."""
        return self.meta.groups

    @property
    def group_names(self) -> tuple[str, ...] | None:
        """The names of the groups (``action/video_0001`` for an ingested folder), or None for a store without groups."""
        return self.meta.group_names

    @property
    def attrs(self) -> dict[str, Any]:
        return self.meta.attrs

    @property
    def provenance(self) -> dict[str, Any]:
        return self.meta.provenance

    @property
    def skipped(self) -> tuple[dict[str, str], ...]:
        return self.meta.skipped

    @property
    def color_mode(self) -> str:
        return self.meta.color_mode

    @property
    def nchunks(self) -> int:
        return self.meta.nchunks

    @property
    def chunk_images(self) -> int:
        return self.meta.chunk_images

    @property
    def chunk_nbytes(self) -> int:
        """Uncompressed size of one (full) chunk."""
        return self.meta.chunk_images * self.meta.image_nbytes

    @property
    def nbytes(self) -> int:
        """Uncompressed size of the images."""
        return self.meta.nimages * self.meta.image_nbytes

    @property
    def cbytes(self) -> int:
        """Size of the file."""
        return self._source.size()

    def chunk_range(self, i: int) -> tuple[int, int]:
        """The image indices [start, stop) held by chunk ``i``."""
        k = self.meta.chunk_images
        return i * k, min((i + 1) * k, self.meta.nimages)

    def chunk_byte_range(self, i: int) -> tuple[int, int]:
        """(offset, length) of chunk ``i``'s bytes in the file; length 0 for a special chunk."""
        i = self._check_chunk_index(i)
        return int(self._frame.chunk_offsets[i]), int(self._frame.chunk_lengths[i])

    def __repr__(self) -> str:
        return (
            f"<carraystore.Store {self.location!r} shape={self.shape} dtype={self.dtype} "
            f"codec={self.codec.describe()!r} chunks={self.nchunks}x{self.chunk_images}>"
        )

    # -- chunk I/O ------------------------------------------------------------------------
    def _check_chunk_index(self, i: int) -> int:
        n = self.nchunks
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"{self.location}: chunk {i} out of range (store has {n} chunks)")
        return i

    def read_chunk_bytes(self, i: int) -> bytes:
        """Chunk ``i``'s compressed bytes (thread-safe, GIL released; a special chunk's 32-byte stand-in)."""
        return bytes(self.chunk_buffer(i, copy=True))

    def chunk_buffer(self, i: int, copy: bool = False, items: bool = False) -> bytes | memoryview:
        """Chunk ``i``'s compressed bytes, a read-only view of a local mapped file unless ``copy``;
        ``items=True``: a special chunk's stand-in gets the codec's typesize (for item ranges)."""
        i = self._check_chunk_index(i)
        f = self._frame
        special = int(f.chunk_special[i])
        if special:
            typesize = int(self.codec.typesize or 1) if items else f.typesize
            return special_chunk_header(special, self.chunk_nbytes, f.blocksize, typesize)
        offset, length = int(f.chunk_offsets[i]), int(f.chunk_lengths[i])
        data = self._fetch_chunk(i, offset, length, copy)
        if self.check_reads:
            # a source that can forget a range (remote, cached) fetches again before "damaged"
            link = self._link
            for attempt in range(CRC_REFETCHES + 1):
                try:
                    self.check_chunk_bytes(i, data)
                    break
                except ChecksumError as exc:
                    if link is None or attempt == CRC_REFETCHES:
                        if attempt:
                            raise ChecksumError(f"{exc} (fetched {attempt + 1} times)") from exc
                        raise
                    _log.warning(
                        "%s: chunk %d (bytes %d-%d) failed its CRC32 check as fetched; fetching it again (%d of %d)",
                        self.location, i, offset, offset + length, attempt + 1, CRC_REFETCHES,
                    )  # fmt: skip
                    del data
                    link.discard(offset, length)
                    data = self._fetch_chunk(i, offset, length, copy)
        return data

    def _fetch_chunk(self, i: int, offset: int, length: int, copy: bool) -> bytes | memoryview:
        """Chunk ``i``'s bytes as read (trimmed to its compressed size), unchecked."""
        try:
            if not copy and isinstance(self._source, LocalFileSource):
                data: bytes | memoryview = self._source.view(offset, length)
            else:
                data = self._source.read(offset, length)
        except RemoteReadError as exc:
            raise RemoteReadError(
                f"{exc} (chunk {i})", url=exc.url, offset=exc.offset, length=exc.length, attempts=exc.attempts
            ) from exc
        except CarrayStoreError:
            raise
        except Exception as exc:
            raise CorruptStoreError(
                f"{self.location}: chunk {i} cannot be read at bytes {offset}-{offset + length} ({exc})"
            ) from exc
        if len(data) >= 16:
            cbytes = int.from_bytes(bytes(data[12:16]), "little")
            if cbytes <= len(data):
                return data[:cbytes] if cbytes < len(data) else data
        raise CorruptStoreError(
            f"{self.location}: chunk {i} is truncated ({len(data)} of {length} bytes readable at offset {offset}); "
            f"the file is damaged: run `carraystore verify {self.location}`"
        )

    def prefetch_chunks(self, chunks: Sequence[int] | np.ndarray, again: bool = False) -> None:
        """Hint that these chunks will be read soon, in this order; ``again``: once more than hinted.
        A local file is told only of the chunks not already in the page cache (:func:`_not_cached`)."""
        ranges = self._ranges_of(chunks)
        if ranges and type(self._source) is LocalFileSource:
            ranges = _not_cached(self._source.fileno(), ranges)
        if ranges:
            self._source.prefetch(ranges, again=again)

    def _ranges_of(self, chunks: Sequence[int] | np.ndarray) -> list[tuple[int, int]]:
        """The byte ranges of these chunks in the file (all-zero chunks have none)."""
        f = self._frame
        return [
            (int(f.chunk_offsets[c]), int(f.chunk_lengths[c]))
            for c in np.asarray(chunks, dtype=np.int64).reshape(-1)
            if 0 <= c < len(f.chunk_offsets) and f.chunk_offsets[c] >= 0
        ]

    def chunks_hinted(self, chunks: Sequence[int] | np.ndarray) -> bool:
        """Whether every one of these hinted, unread chunks is fetched or on its way (False locally)."""
        return self._link is not None and self._link.hinted(self._ranges_of(chunks))

    def wait_chunks_fetched(self, chunks: Sequence[int] | np.ndarray, timeout: float | None = None) -> bool:
        """Wait until these hinted chunks arrived or failed: True, or False on ``timeout``
        (unhinted, read or local chunks count as arrived)."""
        if self._link is None:
            return True
        ranges = self._ranges_of(chunks)
        return self._link.wait_prefetched(ranges, timeout) if ranges else True

    def decompress_chunk(
        self,
        i: int,
        data: bytes | memoryview,
        out: np.ndarray | None = None,
        nthreads: int | None = None,
        scale: int = 1,
    ) -> np.ndarray:
        """Decompress chunk ``i``'s bytes into ``out`` (a full chunk buffer); return its images.

        ``nthreads``: blosc2 threads (default its global setting; pass 1 from parallel threads).
        ``scale`` (2, 4 or 8; uint8 images): images reduced by ``scale`` in the first bytes of
        each slot of ``out``, returned as a strided view (JPEG entries decoded at that size,
        others by :func:`carraystore.format.encoded.box_reduce`).
        """
        start, stop = self.chunk_range(i)
        shape = (self.meta.chunk_images, *self.image_shape)
        if out is None:
            out = np.empty(shape, dtype=self.dtype)
        elif out.shape != shape or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise InvalidInputError(f"out buffer must be C-contiguous {self.dtype} of shape {shape}")
        if scale != 1 and (self.dtype != np.uint8 or len(self.image_shape) != 3):
            raise InvalidInputError(f"{self.location}: only uint8 (H, W, C) images are decoded at a smaller size")
        try:
            if in_forked_child() or nthreads is not None:
                blosc2.decompress2(data, dst=out, nthreads=1 if in_forked_child() else nthreads)
            else:
                blosc2.decompress2(data, dst=out)
        except Exception as exc:
            raise CorruptStoreError(
                f"{self.location}: chunk {i} does not decompress ({exc}); run `carraystore verify {self.location}`"
            ) from exc
        if self.meta.layout == "encoded":  # the chunk's entries, decoded in place (FORMAT.md 10)
            self._decode_entries(i, out, scale)
        elif scale != 1:
            reduce_images_inplace(out, scale, stop - start)
        if scale != 1:
            return reduced_view(out, scale)[: stop - start]
        return out[: stop - start]

    # -- the encoded layout (FORMAT.md 10) -----------------------------------------------------
    def _decode_entries(self, i: int, buf: np.ndarray, scale: int = 1) -> None:
        start, stop = self.chunk_range(i)
        meta = self.meta
        assert meta.entry_sizes is not None and meta.encoding is not None
        decode_chunk_inplace(
            buf,
            meta.entry_sizes[start:stop],
            meta.color_mode,
            meta.encoding.formats,
            lambda j: f"{self.location}: image {start + j} (chunk {i})",
            scale,
        )

    def chunk_entries(self, i: int, verify: Verify = True) -> list[bytes]:
        """The stored entries of chunk ``i`` of an encoded store: each image's file bytes (or raw pixels)."""
        if self.meta.layout != "encoded":
            raise InvalidInputError(f"{self.location}: entries exist in stores of layout 'encoded' only")
        i = self._check_chunk_index(i)
        data = self.chunk_buffer(i)
        self.check_chunk_read(i, data, check_verify(verify))
        buf = np.empty((self.meta.chunk_images, *self.image_shape), dtype=np.uint8)
        try:
            blosc2.decompress2(data, dst=buf)
        except Exception as exc:
            raise CorruptStoreError(f"{self.location}: chunk {i} does not decompress ({exc})") from exc
        start, stop = self.chunk_range(i)
        assert self.meta.entry_sizes is not None
        return [bytes(e) for e in chunk_entries(buf, self.meta.entry_sizes[start:stop])]

    def entry(self, index: int) -> bytes:
        """Image ``index``'s stored entry (encoded store): the source file's bytes when kept as they were."""
        n = len(self)
        i = int(index) + (n if int(index) < 0 else 0)
        if not 0 <= i < n:
            raise IndexError(f"image index {index} out of range for a store of {n} images")
        c = i // self.meta.chunk_images
        return self.chunk_entries(c)[i - c * self.meta.chunk_images]

    def check_chunk_read(self, i: int, data: bytes | memoryview, verify: Verify = True) -> None:
        """The check ``verify=`` asks for of chunk ``i`` as read (ChecksumError on a mismatch).

        ``"always"``: :meth:`check_chunk_bytes`. True: the same, except that a chunk of a local
        file this process already checked is not checked again while the file's state
        (:func:`_state_of`: device, inode, size, mtime, ctime) is what it was at that check, and
        the file had been unchanged for :data:`SETTLE_S` then (docs/loading.md, "Checksums").
        Remote stores check every read in :meth:`chunk_buffer` whatever ``verify`` says.
        """
        if not verify or self.check_reads:
            return
        fd = self._source.fileno() if verify is True and type(self._source) is LocalFileSource else None
        if fd is None:
            self.check_chunk_bytes(i, data)
            return
        f = self._frame
        key = (int(f.chunk_offsets[i]), int(f.chunk_lengths[i]), int(self.meta.crc32[i]))
        state = _state_of(fd)
        known = _CHECKED.get(state[:2])
        if known is not None and known[0] == state and key in known[1]:
            return
        self.check_chunk_bytes(i, data)
        if _settled(state) and _state_of(fd) == state:  # unchanged while it was checked
            with _CHECKED_LOCK:
                known = _CHECKED.get(state[:2])
                if known is None or known[0] != state:
                    known = _CHECKED[state[:2]] = (state, set())
                known[1].add(key)

    def check_chunk_bytes(self, i: int, data: bytes | memoryview) -> None:
        """Raise ChecksumError unless ``data`` (chunk ``i`` as read) matches its recorded CRC32."""
        if not chunk_crc_ok(data, int(self.meta.crc32[i]), self.codec, self.meta.blocksize, self.chunk_nbytes):
            offset, length = self.chunk_byte_range(i)
            raise ChecksumError(
                f"{self.location}: chunk {i} (bytes {offset}-{offset + length}) fails its CRC32 check; "
                "the file is damaged (or changed while read): run `carraystore verify` on it"
            )

    def read_chunk(self, i: int, out: np.ndarray | None = None, verify: Verify = True, scale: int = 1) -> np.ndarray:
        """Chunk ``i``'s images (``out``); ``verify``: CRC32 first (ChecksumError; :meth:`check_chunk_read`);
        ``scale``: as decompress_chunk."""
        i = self._check_chunk_index(i)
        data = self.chunk_buffer(i)
        self.check_chunk_read(i, data, check_verify(verify))
        return self.decompress_chunk(i, data, out, scale=scale)

    def iter_chunks(self) -> Iterator[np.ndarray]:
        """Every chunk in file order (a fresh array each)."""
        if not isinstance(self._source, LocalFileSource):
            self.prefetch_chunks(range(self.nchunks))
        for i in range(self.nchunks):
            yield self.read_chunk(i)

    # -- indexing -------------------------------------------------------------------------
    def __getitem__(self, index: Any) -> np.ndarray:
        n = self.meta.nimages
        if isinstance(index, (int, np.integer)):
            i = int(index)
            if i < 0:
                i += n
            if not 0 <= i < n:
                raise IndexError(f"image index {int(index)} out of range for a store of {n} images")
            image: np.ndarray = self.take(np.array([i]))[0]
            return image
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            return self.take(np.arange(start, stop, step))
        idx = np.asarray(index)
        if idx.dtype == bool:
            if idx.shape != (n,):
                raise IndexError(f"boolean index of shape {idx.shape} does not match a store of {n} images")
            idx = np.flatnonzero(idx)
        if idx.dtype.kind not in "iu":
            raise IndexError(f"store index must be an int, slice, or integer/boolean array, got {idx.dtype}")
        return self.take(idx)

    def take(self, indices: np.ndarray) -> np.ndarray:
        """Images at ``indices`` (any order, repeats allowed), reading each needed chunk once."""
        n = self.meta.nimages
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size:
            idx = np.where(idx < 0, idx + n, idx)
            bad = (idx < 0) | (idx >= n)
            if bad.any():
                raise IndexError(
                    f"image index {int(np.asarray(indices).reshape(-1)[np.argmax(bad)])} out of range for {n} images"
                )
        out = np.empty((len(idx), *self.image_shape), dtype=self.dtype)
        if not idx.size:
            return out
        k = self.meta.chunk_images
        chunk_of = idx // k
        order = np.argsort(chunk_of, kind="stable")
        sorted_chunks = chunk_of[order]
        bounds = np.flatnonzero(np.diff(sorted_chunks)) + 1
        groups = np.split(order, bounds)
        self.prefetch_chunks([int(chunk_of[g[0]]) for g in groups])
        buf = np.empty((k, *self.image_shape), dtype=self.dtype)
        for group in groups:
            c = int(chunk_of[group[0]])
            images = self.read_chunk(c, out=buf)
            # raw records: numpy (2.2 at least) may index structured items field by field, losing padding bytes
            as_records(out)[group] = as_records(images)[idx[group] - c * k]
        return out

    # -- integrity ----------------------------------------------------------------------
    def verify(self, progress: bool = False) -> list[ChunkProblem]:
        """Re-read every chunk (CRC32, header vs pinned codec, decompression); the problems, [] if sound."""
        problems: list[ChunkProblem] = []
        if self._frame.nchunks != self.nchunks:
            problems.append(
                ChunkProblem(None, f"file holds {self._frame.nchunks} chunks, metadata says {self.nchunks}")
            )
        buf = np.empty((self.meta.chunk_images, *self.image_shape), dtype=self.dtype)
        rng: Any = range(self.nchunks)
        if progress:
            from tqdm import tqdm

            rng = tqdm(rng, desc=f"verify {Path(str(self.location)).name}", unit="chunk")
        check_reads, self.check_reads = self.check_reads, False  # mismatches are reported below
        if not isinstance(self._source, LocalFileSource):
            self.prefetch_chunks(range(self.nchunks))  # a remote source fetches ahead (bounded), many at once
        try:
            for i in rng:
                try:
                    data = self.read_chunk_bytes(i)
                except CarrayStoreError as exc:
                    problems.append(ChunkProblem(i, f"cannot be read: {exc.__cause__ or exc}"))
                    continue
                want = int(self.meta.crc32[i])
                if not chunk_crc_ok(data, want, self.codec, self.meta.blocksize, self.chunk_nbytes):
                    problems.append(ChunkProblem(i, f"CRC32 mismatch: recorded {want:08x}, file has {crc32(data):08x}"))
                    continue
                try:
                    check_codec_against_header(self.codec, self.meta.blocksize, parse_chunk_header(data), f"chunk {i}")
                    self.decompress_chunk(i, data, buf)
                except CarrayStoreError as exc:
                    problems.append(ChunkProblem(i, str(exc)))
        finally:
            self.check_reads = check_reads
        # the frame header, then plain blosc2 (the README promises `blosc2.open` reads a store)
        problems += [ChunkProblem(None, p) for p in header_problems(self._frame, self.meta)]
        if not problems and type(self._source) is LocalFileSource:  # not a JournalSource: the file itself
            bad = plain_blosc2_problem(self.path, self._frame, self.meta, quiet_if_changed=True)
            if bad is not None:
                problems.append(ChunkProblem(None, bad))
        return problems

    # -- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Release the file handle or connections (the Store must not be used afterwards)."""
        self._source.close()

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Another process re-opens by location; handles and data never travel.
        return {"location": self.location, "storage_options": self.storage_options, "open_kwargs": self._open_kwargs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        location = state.get("location", state.get("path"))
        if location is None:
            raise InvalidInputError("a pickled store without a location cannot be re-opened; pickle the store again")
        other = open_store(location, state.get("storage_options") or None, **state.get("open_kwargs", {}))
        self.__dict__.update(other.__dict__)


@overload
def open_store(
    location: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_size: int | str | None = None,
    cls: None = None,
) -> StoreReader: ...


@overload
def open_store(
    location: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_size: int | str | None = None,
    cls: type[_S],
) -> _S: ...


def open_store(
    location: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_size: int | str | None = None,
    cls: type[StoreReader] | None = None,
) -> StoreReader:
    """Open a store from a path or URL, checking the format and the pinned codec.

    ``cls``: the class returned (``carraystore.open`` passes :class:`carraystore.Store`).
    ``storage_options`` (URLs only): fsspec-style options; ``cache_dir``/``cache_size``
    (bytes or ``"200GB"``) keep fetched chunks on local disk (docs/remote.md).
    """
    open_kwargs = {k: v for k, v in (("cache_dir", cache_dir), ("cache_size", cache_size)) if v is not None}
    source = open_source(location, storage_options, **open_kwargs)  # type: ignore[arg-type]
    kind = cls or StoreReader
    if isinstance(source, LocalFileSource):
        return _open_local(source, storage_options, open_kwargs, kind)
    return _open(source, storage_options, open_kwargs, cls=kind)


def _open_local(
    source: LocalFileSource, storage_options: Any, open_kwargs: dict[str, Any], cls: type[StoreReader]
) -> StoreReader:
    """Open a local store without ever seeing an append half-way (docs/appends.md): a hot
    journal is rolled back if its writer is gone and we may write, else read around
    (JournalSource); without one, retry if the file changed while we read."""
    path = source.path
    source.close()  # opened again below, after the file's state is taken: its size must not be older
    real = Path(os.path.realpath(path))  # the journal sits beside the real file
    error: BaseException | None = None
    for attempt in range(200):
        if attempt:
            time.sleep(min(0.05, 0.001 * attempt))
        before = file_state(real)
        if before[1] is not None and rollback_if_abandoned(real):
            continue
        journal = load_journal(real)
        if journal is not None:  # a writer at work, or we may not roll back: the store before it
            return _open(JournalSource(path, journal), storage_options, open_kwargs, cls=cls)
        source = LocalFileSource(path)
        store: StoreReader | None = None
        try:
            store = _open(source, storage_options, open_kwargs, close_on_error=False, cls=cls)
        except CarrayStoreError as exc:
            error = exc
        if file_state(real) == before:
            if store is not None:
                return store
            source.close()
            assert error is not None
            raise error
        source.close()  # an append began or ended while we read: read again
    if error is None:
        error = CorruptStoreError(f"{path}: the store kept changing while it was opened (200 tries); try again")
    raise error


def open_unguarded(path: str | os.PathLike[str]) -> StoreReader:
    """The local store file as it is now, journal or not: for the writer that holds its lock."""
    return _open(LocalFileSource(path), None, {})


def _open(
    source: ByteSource,
    storage_options: Any,
    open_kwargs: dict[str, Any],
    close_on_error: bool = True,
    cls: type[StoreReader] | None = None,
) -> StoreReader:
    try:
        frame = read_frame(source)
        meta = read_meta(frame, source.location)
        check_frame_against_meta(frame, meta, source.location)
        store = (cls or StoreReader)(source, frame, meta, storage_options, open_kwargs)
        if meta.nchunks:
            # chunk 0's header (32 bytes, not the chunk) against the pinned codec
            offset, _ = store.chunk_byte_range(0)
            first = store.read_chunk_bytes(0) if offset < 0 else source.read(offset, 32)
            check_codec_against_header(
                meta.codec, meta.blocksize, parse_chunk_header(first), f"{source.location}, chunk 0"
            )
        return store
    except BaseException:
        if close_on_error:
            source.close()
        raise
