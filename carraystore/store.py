"""The store file: create, append, open, read whole chunks, verify.

A store is one blosc2 NDArray file (``.b2nd``) of shape (N, H, W, C). carraystore
compresses every chunk itself with the pinned codec (``blosc2.compress2``) and puts it
in place with ``update_chunk``, so the chunk headers carry exactly the recorded
parameters, whatever blosc2's defaults are. Blocks span whole images, so a
decompressed chunk is the chunk's images in row order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import secrets
import shutil
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import blosc2
import msgpack
import numpy as np

from carraystore import __version__
from carraystore.errors import (
    CarrayStoreError,
    ChecksumError,
    CodecMismatchError,
    CorruptStoreError,
    FormatError,
    InvalidInputError,
    NotAStoreError,
    StoreExistsError,
)
from carraystore.format import (
    COLOR_MODES,
    DTYPES,
    LAYOUTS,
    FORMAT_NAME,
    FORMAT_VERSION,
    META_KEY,
    Codec,
    StoreMeta,
    StringTable,
    check_codec_against_header,
    crc32,
    dtype_to_record,
    parse_chunk_header,
    validate_key,
)

__all__ = ["Store", "StoreWriter", "ChunkProblem", "create", "append", "open_store", "default_chunk_images"]

# Decompression in threads only runs in parallel when blosc2 releases the GIL.
blosc2.set_releasegil(True)

# blosc2's own decompression threads hang in a process forked from one that used them
# (Keras' use_multiprocessing, multiprocessing pools with fork): forked children
# decompress with a single blosc2 thread.
_FORKED_CHILD = False


def _mark_forked_child() -> None:
    global _FORKED_CHILD
    _FORKED_CHILD = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_mark_forked_child)

#: Target uncompressed size of one chunk when ``chunk_images`` is not given.
TARGET_CHUNK_BYTES = 4 * 1024 * 1024
MAX_DEFAULT_CHUNK_IMAGES = 4096
_PARTIAL = re.compile(r"^\.(?P<name>.+)\.partial-(?P<pid>\d+)-[0-9a-f]+$")


def default_chunk_images(image_nbytes: int, block_images: int = 1, layout: str = "NHWC") -> int:
    """Items per chunk: about 4 MiB uncompressed (at most 4096 images), a multiple of ``block_images``."""
    n = max(1, TARGET_CHUNK_BYTES // max(1, image_nbytes))
    if layout == "NHWC":
        n = min(MAX_DEFAULT_CHUNK_IMAGES, n)
    return max(block_images, n - n % block_images)


def _blosc2_cparams_for_frame(codec: Codec, dtype: np.dtype) -> dict[str, Any]:
    """Frame-level cparams: what plain blosc2 would use if someone wrote into the array."""
    cp: dict[str, Any] = {
        "codec": blosc2.Codec[codec.codec.upper()],
        "clevel": codec.clevel,
        "splitmode": blosc2.SplitMode[f"{codec.splitmode.upper()}_SPLIT"],
        "nthreads": 1,
    }
    if codec.typesize == dtype.itemsize and codec.filters:
        cp["filters"] = [blosc2.Filter[f.upper()] for f in codec.filters]
        cp["filters_meta"] = list(codec.filters_meta)
    else:  # explicit, never blosc2's default SHUFFLE (the frame's typesize is the dtype's itemsize)
        cp["filters"] = [blosc2.Filter.NOFILTER]
        cp["filters_meta"] = [0]
    return cp


def _crc_matches(data: bytes, want: int, chunk_nbytes: int) -> bool:
    """Whether a chunk read from the file matches its recorded CRC32.

    A chunk of one repeated value (e.g. all-black images) is a blosc2 "special" chunk: the
    frame keeps no bytes for it and ``get_chunk`` synthesises a 32-byte header, so there is
    nothing to checksum; such a chunk is accepted when its header is special and its size
    is the chunk's.
    """
    if crc32(data) == want:
        return True
    if len(data) != 32:
        return False
    try:
        header = parse_chunk_header(data)
    except FormatError:
        return False
    return header.special and header.nbytes == chunk_nbytes


def _records(a: np.ndarray) -> np.ndarray:
    """``a`` viewed as raw records, so that assignment copies every byte.

    numpy copies structured dtypes field by field and drops the padding bytes between
    fields; a store keeps the source's bytes exactly.
    """
    return a.view(np.dtype((np.void, a.dtype.itemsize))) if a.dtype.fields is not None else a


def _partial_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.partial-{os.getpid()}-{secrets.token_hex(4)}")


def _remove_stale_partials(path: Path) -> None:
    """Remove temporary files that earlier writers killed mid-write left next to ``path``."""
    with contextlib.suppress(OSError):
        for p in path.parent.iterdir():
            m = _PARTIAL.match(p.name)
            if not m or m.group("name") != path.name:
                continue
            pid = int(m.group("pid"))
            alive = True
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                alive = False
            except PermissionError:
                alive = True
            if not alive:
                with contextlib.suppress(OSError):
                    p.unlink()


def _fsync_path(path: Path, directory: bool = False) -> None:
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _read_vlmeta_from_trailer(path: Path) -> bytes | None:
    """The packed ``vlmeta[META_KEY]`` read straight from the frame trailer, or None.

    python-blosc2's ``SChunk.get_vlmeta`` (3.x to 4.14 at least) never frees the buffer
    that ``blosc2_vlmeta_get`` allocates, so every open through it would leak the size of
    the metadata (about 40 MB for a store of 1M keyed images). The trailer's layout is
    part of the Blosc2 contiguous-frame spec (README_CFRAME_FORMAT.rst): the frame length
    sits in the header, the trailer length 22 bytes before the frame's end, and the
    trailer is msgpack ``[version, [size, {name: offset}, [content, ...]], trailer_len,
    fingerprint]`` where each content is one compressed Blosc2 chunk. Anything unexpected
    returns None and the caller falls back to blosc2's own reader.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(24)
            if len(head) < 24 or head[2:10] != b"b2frame\x00" or head[0x0F] != 0xCF:
                return None
            frame_len = int.from_bytes(head[0x10:0x18], "big")
            f.seek(frame_len - 23)
            tail = f.read(7)
            if len(tail) != 7 or tail[0] != 0xCE or tail[5] != 0xD8:
                return None
            trailer_len = int.from_bytes(tail[1:5], "big")
            if not 0 < trailer_len <= frame_len:
                return None
            f.seek(frame_len - trailer_len)
            trailer = f.read(trailer_len)
        parts = msgpack.unpackb(trailer, raw=True, strict_map_key=False)
        _size, index, contents = parts[1]
        content = contents[list(index).index(META_KEY.encode())]
        if not isinstance(content, bytes) or blosc2.get_cbuffer_sizes(content)[1] != len(content):
            return None
        return blosc2.decompress(content)
    except Exception:
        return None


def _chunk_offsets(fd: int, nchunks: int) -> tuple[np.ndarray, np.ndarray] | None:
    """File offsets and (upper-bound) lengths of every chunk, from the frame's offsets chunk.

    The Blosc2 contiguous frame (README_CFRAME_FORMAT.rst) keeps, right after the data
    chunks (at ``header_len + cbytes``, both in the frame header), one compressed chunk of
    int64 offsets relative to ``header_len``; negative values mark special chunks (zeros)
    that hold no data. Reading chunks with ``os.pread`` at these offsets releases the GIL
    during I/O, unlike ``SChunk.get_chunk``. Anything unexpected returns None and the
    reader falls back to ``get_chunk``.
    """
    try:
        head = os.pread(fd, 64, 0)
        if len(head) < 47 or head[2:10] != b"b2frame\x00" or head[10] != 0xD2 or head[38] != 0xD3:
            return None
        header_len = int.from_bytes(head[11:15], "big")
        cbytes = int.from_bytes(head[39:47], "big")
        start = header_len + cbytes
        first = os.pread(fd, 32, start)
        if len(first) < 32:
            return None
        osize = blosc2.get_cbuffer_sizes(first)[1]
        raw = os.pread(fd, osize, start)
        offsets = np.frombuffer(blosc2.decompress(raw), dtype="<i8")
        if len(offsets) < nchunks:
            return None
        offsets = offsets[:nchunks]
        real = offsets >= 0
        if np.any(offsets[real] >= cbytes):
            return None
        # a chunk ends where the next one (in file order) begins, or where the data ends
        ends = np.full(nchunks, cbytes, dtype=np.int64)
        order = np.argsort(np.where(real, offsets, cbytes), kind="stable")
        pos = np.where(real, offsets, cbytes)[order]
        ends[order[:-1]] = pos[1:]
        lengths = np.where(real, ends - offsets, 0)
        return np.where(real, offsets + header_len, -1), lengths
    except Exception:
        return None


def _read_meta(array: Any, path: Path) -> StoreMeta:
    if META_KEY not in array.schunk.meta:
        raise NotAStoreError(
            f"{path}: a blosc2 file, but not a carraystore store (no {META_KEY!r} meta layer); "
            "create stores with carraystore.create() or `carraystore ingest`"
        )
    raw = _read_vlmeta_from_trailer(path)
    if raw is None:
        try:
            raw = array.schunk.vlmeta.get_vlmeta(META_KEY)
        except Exception as exc:  # blosc2 raises KeyError/RuntimeError depending on version
            raise FormatError(f"{path}: the {META_KEY!r} variable-length metadata is missing ({exc})") from exc
    rec = StoreMeta.unpack_record(bytes(raw), str(path))
    del raw  # the packed bytes go before the record is checked: lower peak memory on open
    return StoreMeta.from_record(rec, str(path))


def _write_meta(array: Any, meta: StoreMeta) -> None:
    array.schunk.vlmeta[META_KEY] = meta.to_record()


# ---------------------------------------------------------------------------------------
# reading
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkProblem:
    """One problem ``Store.verify()`` found: the chunk index (or None for the file) and why."""

    chunk: int | None
    reason: str

    def __str__(self) -> str:
        where = "file" if self.chunk is None else f"chunk {self.chunk}"
        return f"{where}: {self.reason}"


class Store:
    """A read-only carraystore store. Get one with ``carraystore.open(path)``."""

    def __init__(self, path: Path, array: Any, meta: StoreMeta) -> None:
        self.path = path
        self._array = array
        self.meta = meta
        self._lock = threading.Lock()
        self._schunk = array.schunk
        self._fd: int | None = None
        self._offsets: tuple[np.ndarray, np.ndarray] | None = None
        try:
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError:
            pass
        else:
            self._offsets = _chunk_offsets(self._fd, meta.nchunks)
            self._fd_finalizer = weakref.finalize(self, os.close, self._fd)

    # -- description -------------------------------------------------------------------
    def __len__(self) -> int:
        return self.meta.nimages

    @property
    def shape(self) -> tuple[int, ...]:
        """(N, H, W, C)."""
        return (self.meta.nimages, *self.meta.image_shape)

    @property
    def image_shape(self) -> tuple[int, ...]:
        """(H, W, C)."""
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
    def nbytes(self) -> int:
        """Uncompressed size of the images."""
        return self.meta.nimages * self.meta.image_nbytes

    @property
    def cbytes(self) -> int:
        """Size of the file on disk."""
        return os.path.getsize(self.path)

    def chunk_range(self, i: int) -> tuple[int, int]:
        """The image indices [start, stop) held by chunk ``i``."""
        k = self.meta.chunk_images
        return i * k, min((i + 1) * k, self.meta.nimages)

    def __repr__(self) -> str:
        return (
            f"<carraystore.Store {str(self.path)!r} shape={self.shape} dtype={self.dtype} "
            f"codec={self.codec.describe()!r} chunks={self.nchunks}x{self.chunk_images}>"
        )

    # -- chunk I/O ------------------------------------------------------------------------
    def _check_chunk_index(self, i: int) -> int:
        n = self.nchunks
        i = int(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"{self.path}: chunk {i} out of range (store has {n} chunks)")
        return i

    def read_chunk_bytes(self, i: int) -> bytes:
        """The compressed bytes of chunk ``i`` (one sequential read; thread-safe, GIL released)."""
        i = self._check_chunk_index(i)
        if self._offsets is not None and self._fd is not None and self._offsets[0][i] >= 0:
            offset, length = int(self._offsets[0][i]), int(self._offsets[1][i])
            data = os.pread(self._fd, length, offset)
            if len(data) >= 16:
                cbytes = int.from_bytes(data[12:16], "little")
                if cbytes <= len(data):
                    return data[:cbytes] if cbytes < len(data) else data
            raise CorruptStoreError(
                f"{self.path}: chunk {i} is truncated ({len(data)} of {length} bytes readable at offset {offset}); "
                f"the file is damaged: run `carraystore verify {self.path}`"
            )
        try:
            with self._lock:
                return self._schunk.get_chunk(i)
        except Exception as exc:
            raise CorruptStoreError(
                f"{self.path}: chunk {i} cannot be read ({exc}); run `carraystore verify {self.path}`"
            ) from exc

    def advise_willneed(self, chunks: Sequence[int] | np.ndarray) -> None:
        """Hint the kernel to read these chunks into the page cache soon (no-op where unsupported)."""
        if self._offsets is None or self._fd is None or not hasattr(os, "posix_fadvise"):
            return
        offsets, lengths = self._offsets
        for c in np.asarray(chunks, dtype=np.int64).reshape(-1):
            if 0 <= c < len(offsets) and offsets[c] >= 0:
                try:
                    os.posix_fadvise(self._fd, int(offsets[c]), int(lengths[c]), os.POSIX_FADV_WILLNEED)
                except OSError:
                    return

    def decompress_chunk(self, i: int, data: bytes, out: np.ndarray | None = None, nthreads: int | None = None) -> np.ndarray:
        """Decompress chunk ``i``'s bytes into ``out`` (a full chunk buffer); return its images.

        ``nthreads`` is blosc2's own thread count for this chunk (default: blosc2's global
        setting); callers that decompress several chunks in parallel threads pass 1.
        """
        start, stop = self.chunk_range(i)
        if out is None:
            out = np.empty((self.meta.chunk_images, *self.image_shape), dtype=self.dtype)
        elif out.shape != (self.meta.chunk_images, *self.image_shape) or out.dtype != self.dtype or not out.flags.c_contiguous:
            raise InvalidInputError(
                f"out buffer must be C-contiguous {self.dtype} of shape {(self.meta.chunk_images, *self.image_shape)}"
            )
        try:
            if _FORKED_CHILD or nthreads is not None:
                blosc2.decompress2(data, dst=out, nthreads=1 if _FORKED_CHILD else nthreads)
            else:
                blosc2.decompress2(data, dst=out)
        except Exception as exc:
            raise CorruptStoreError(
                f"{self.path}: chunk {i} does not decompress ({exc}); run `carraystore verify {self.path}`"
            ) from exc
        return out[: stop - start]

    def check_chunk_bytes(self, i: int, data: bytes) -> None:
        """Raise ChecksumError unless ``data`` (chunk ``i`` as read) matches its recorded CRC32."""
        if not _crc_matches(data, int(self.meta.crc32[i]), self.meta.chunk_images * self.meta.image_nbytes):
            raise ChecksumError(f"{self.path}: chunk {i} fails its CRC32 check; the file is damaged")

    def read_chunk(self, i: int, out: np.ndarray | None = None, verify: bool = False) -> np.ndarray:
        """The images of chunk ``i`` as an array (a view of ``out`` when given)."""
        i = self._check_chunk_index(i)
        data = self.read_chunk_bytes(i)
        if verify:
            self.check_chunk_bytes(i, data)
        return self.decompress_chunk(i, data, out)

    def iter_chunks(self) -> Iterator[np.ndarray]:
        """Every chunk in file order (a fresh array each)."""
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
            return self.take(np.array([i]))[0]
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
                raise IndexError(f"image index {int(np.asarray(indices).reshape(-1)[np.argmax(bad)])} out of range for {n} images")
        out = np.empty((len(idx), *self.image_shape), dtype=self.dtype)
        if not idx.size:
            return out
        k = self.meta.chunk_images
        chunk_of = idx // k
        order = np.argsort(chunk_of, kind="stable")
        sorted_chunks = chunk_of[order]
        bounds = np.flatnonzero(np.diff(sorted_chunks)) + 1
        buf = np.empty((k, *self.image_shape), dtype=self.dtype)
        for group in np.split(order, bounds):
            c = int(chunk_of[group[0]])
            images = self.read_chunk(c, out=buf)
            # raw records: numpy (2.2 at least) may index structured items field by field, losing padding bytes
            _records(out)[group] = _records(images)[idx[group] - c * k]
        return out

    # -- integrity ----------------------------------------------------------------------
    def verify(self, progress: bool = False) -> list[ChunkProblem]:
        """Re-read every chunk: CRC32, header against the pinned codec, full decompression.

        Returns the problems found (an empty list means the store is sound).
        """
        problems: list[ChunkProblem] = []
        if self._schunk.nchunks != self.nchunks:
            problems.append(ChunkProblem(None, f"file holds {self._schunk.nchunks} chunks, metadata says {self.nchunks}"))
        buf = np.empty((self.meta.chunk_images, *self.image_shape), dtype=self.dtype)
        rng: Any = range(self.nchunks)
        if progress:
            from tqdm import tqdm

            rng = tqdm(rng, desc=f"verify {self.path.name}", unit="chunk")
        for i in rng:
            try:
                data = self.read_chunk_bytes(i)
            except CarrayStoreError as exc:
                problems.append(ChunkProblem(i, f"cannot be read: {exc.__cause__ or exc}"))
                continue
            want = int(self.meta.crc32[i])
            if not _crc_matches(data, want, self.meta.chunk_images * self.meta.image_nbytes):
                problems.append(ChunkProblem(i, f"CRC32 mismatch: recorded {want:08x}, file has {crc32(data):08x}"))
                continue
            try:
                check_codec_against_header(self.codec, self.meta.blocksize, parse_chunk_header(data), f"chunk {i}")
                self.decompress_chunk(i, data, buf)
            except CarrayStoreError as exc:
                problems.append(ChunkProblem(i, str(exc)))
        return problems

    # -- streaming (issue: loader) -----------------------------------------------------------
    def batches(self, batch_size: int, **kwargs: Any) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """Iterate (x, y) batches; see ``carraystore.loader.batches`` for the arguments."""
        from carraystore.loader import batches

        return batches(self, batch_size, **kwargs)

    # -- lifetime -----------------------------------------------------------------------
    def close(self) -> None:
        """Release the file handles (the Store must not be used afterwards)."""
        self._array = None
        self._schunk = None  # type: ignore[assignment]
        self._offsets = None
        finalizer = getattr(self, "_fd_finalizer", None)
        if finalizer is not None:
            finalizer()
        self._fd = None

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        # Loader worker processes re-open by path; the file handle does not travel.
        return {"path": str(self.path)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        other = open_store(state["path"])
        Store.__init__(self, other.path, other._array, other.meta)
        other.close()  # closes only the other object's own file descriptor


def _check_header_params(array: Any, meta: StoreMeta, path: Path) -> None:
    """Compare the file's real parameters with the record; raise CodecMismatchError naming both."""
    where = str(path)
    want_chunks = (meta.chunk_images, *meta.image_shape)
    want_blocks = (meta.codec.block_images, *meta.image_shape)
    problems = []
    if tuple(array.shape) != (meta.nimages, *meta.image_shape):
        raise CorruptStoreError(
            f"{where}: array shape {tuple(array.shape)} does not match the metadata ({meta.nimages}, "
            f"{', '.join(map(str, meta.image_shape))}); the file was damaged or written by another tool"
        )
    if np.dtype(array.dtype) != meta.np_dtype:
        problems.append(f"dtype {array.dtype} in the file, {meta.dtype} recorded")
    # An empty array's chunk and block shapes are not kept reliably by blosc2 < 4.1 (3.x reads
    # them as all ones, 4.0 as zeros) and no chunk depends on them, so they are checked only
    # once the store holds items.
    if meta.nimages and tuple(array.chunks) != want_chunks:
        problems.append(f"chunks {tuple(array.chunks)} in the file, {want_chunks} recorded")
    if meta.nimages and tuple(array.blocks) != want_blocks:
        problems.append(f"blocks {tuple(array.blocks)} in the file, {want_blocks} recorded")
    cp = array.schunk.cparams
    cp_codec = getattr(cp, "codec", None) if not isinstance(cp, dict) else cp.get("codec")
    cp_clevel = getattr(cp, "clevel", None) if not isinstance(cp, dict) else cp.get("clevel")
    if cp_codec is not None and int(getattr(cp_codec, "value", cp_codec)) != blosc2.Codec[meta.codec.codec.upper()].value:
        problems.append(f"codec {getattr(cp_codec, 'name', cp_codec)} in the file header, {meta.codec.codec!r} recorded")
    if cp_clevel is not None and int(cp_clevel) != meta.codec.clevel:
        problems.append(f"clevel {cp_clevel} in the file header, {meta.codec.clevel} recorded")
    if array.schunk.nchunks != meta.nchunks:
        raise CorruptStoreError(
            f"{where}: file holds {array.schunk.nchunks} chunks, metadata says {meta.nchunks}; the file is damaged"
        )
    if problems:
        raise CodecMismatchError(f"{where}: " + "; ".join(problems))
    if meta.nchunks:
        try:
            first = array.schunk.get_chunk(0)
        except Exception as exc:
            raise CorruptStoreError(f"{where}: chunk 0 cannot be read ({exc}); the file is damaged") from exc
        check_codec_against_header(meta.codec, meta.blocksize, parse_chunk_header(first), f"{where}, chunk 0")


def open_store(path: str | os.PathLike[str]) -> Store:
    """Open a store for reading. Checks the format version and the pinned codec against the file."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such store")
    if p.is_dir():
        raise NotAStoreError(f"{p} is a directory; a store is a single .b2nd file (use `carraystore migrate` for bcolz folders)")
    try:
        array = blosc2.open(str(p), mode="r")
    except Exception as exc:
        size = p.stat().st_size
        raise CorruptStoreError(
            f"{p}: cannot be opened as a blosc2 file by blosc2 {blosc2.__version__} ({type(exc).__name__}: {exc}); "
            f"{size} bytes on disk - the file is truncated, damaged or not a store (restore it from a copy or "
            "re-create it), or it needs a newer blosc2 (pip install -U blosc2)"
        ) from exc
    if not hasattr(array, "chunks") or not hasattr(array, "schunk"):
        raise NotAStoreError(f"{p}: a blosc2 file, but not an NDArray store")
    meta = _read_meta(array, p)
    _check_header_params(array, meta, p)
    return Store(p, array, meta)


# ---------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------


class StoreWriter:
    """Writes a store; returned by ``carraystore.create``. Use as a context manager.

    Until ``close()`` the data lives in a temporary file beside ``path``; ``close()``
    renames it into place atomically. On an exception inside ``with``, or ``abort()``,
    the temporary file is removed and ``path`` is untouched.
    """

    def __init__(self, path: Path, tmp: Path, array: Any, meta: StoreMeta, nthreads: int) -> None:
        self.path = path
        self._tmp = tmp
        self._array = array
        self._meta = meta
        self._nthreads = nthreads
        self._closed = False
        k = meta.chunk_images
        self._buf = np.zeros((k, *meta.image_shape), dtype=meta.np_dtype)
        self._cparams = meta.codec.cparams(meta.blocksize, nthreads)
        self._crc = list(int(c) for c in meta.crc32)
        self._labels: list[np.ndarray] = [meta.labels] if meta.labels is not None else []
        self._keys: list[StringTable] = [meta.keys] if meta.keys is not None else []
        self._has_labels: bool | None = None if meta.nimages == 0 and meta.class_names is None else meta.labels is not None
        if meta.class_names is not None:
            self._has_labels = True
        self._has_keys: bool | None = None if meta.nimages == 0 else meta.keys is not None
        self._skipped: list[dict[str, str]] = list(meta.skipped)
        self._columns: dict[str, list[np.ndarray]] = {name: [col] for name, col in meta.columns.items()}
        # Images [chunk_start, chunk_start + fill) sit in the pending buffer.
        self._chunk_start = (meta.nimages // k) * k
        self._fill = meta.nimages - self._chunk_start
        self._stored = meta.nimages  # images the array already holds
        if self._fill:
            data = array.schunk.get_chunk(self._chunk_start // k)
            if not _crc_matches(data, self._crc[self._chunk_start // k], k * meta.image_nbytes):
                raise CorruptStoreError(f"{path}: last chunk fails its CRC32 check; not appending to a damaged store")
            blosc2.decompress2(data, dst=self._buf)
            self._buf[self._fill :].view(np.uint8)[...] = 0

    # -- public --------------------------------------------------------------------------
    @property
    def nimages(self) -> int:
        """Images written so far (including any already in an appended-to store)."""
        return self._chunk_start + self._fill

    @property
    def meta(self) -> StoreMeta:
        return self._meta

    def append(
        self,
        images: np.ndarray,
        labels: Sequence[int] | np.ndarray | None = None,
        keys: Sequence[str] | None = None,
        columns: dict[str, np.ndarray] | None = None,
    ) -> None:
        """Append images of shape (n, H, W, C) (or one (H, W, C) image) with optional labels and keys.

        ``columns`` adds per-item metadata arrays (name -> array of n rows); a store that has
        columns needs the same names on every append.
        """
        self._check_open()
        meta = self._meta
        dt = meta.np_dtype
        images = np.asarray(images)
        if meta.layout == "NHWC":
            if images.shape == meta.image_shape:
                images = images[None]
            if images.ndim == 3 and meta.image_shape[2] == 1 and images.shape[1:] == meta.image_shape[:2]:
                images = images[..., None]
        if images.ndim == 0 or images.shape[1:] != meta.image_shape:
            raise InvalidInputError(
                f"{self.path}: items of shape {images.shape[1:]} do not fit a store of item shape {meta.image_shape}"
            )
        if images.dtype != dt:
            raise InvalidInputError(
                f"{self.path}: data is {images.dtype}, the store holds {dt}; convert it with .astype({str(dt)!r})"
            )
        n = len(images)
        lab = self._check_labels(labels, n)
        keytab = self._check_keys(keys, n)
        cols = self._check_columns(columns, n)
        # Only an append that passed every check fixes whether the store has labels and keys.
        if self._has_labels is None:
            self._has_labels = lab is not None
        if self._has_keys is None:
            self._has_keys = keytab is not None
        if lab is not None:
            self._labels.append(lab)
        if keytab is not None:
            self._keys.append(keytab)
        for name, col in cols.items():
            self._columns.setdefault(name, []).append(col)
        k = meta.chunk_images
        pos = 0
        while pos < n:
            take = min(k - self._fill, n - pos)
            _records(self._buf[self._fill : self._fill + take])[...] = _records(images[pos : pos + take])
            self._fill += take
            pos += take
            if self._fill == k:
                self._flush_chunk()

    def add_skipped(self, path: str, reason: str) -> None:
        """Record an input that was skipped (kept in the metadata; nothing is dropped silently)."""
        self._skipped.append({"path": path, "reason": reason})

    def close(self) -> Store | None:
        """Finish: write the last chunk and the metadata, fsync, rename into place."""
        if self._closed:
            return None
        try:
            if self._fill:
                self._flush_chunk()
            labels = np.concatenate(self._labels).astype("<i8") if self._labels else None
            if labels is None and self._has_labels:
                labels = np.zeros(0, dtype="<i8")
            keys = None
            if self._keys:
                keys = self._keys[0]
                for t in self._keys[1:]:
                    keys = keys.concat(t)
            meta = dataclasses.replace(
                self._meta,
                nimages=self.nimages,
                labels=labels,
                keys=keys,
                crc32=np.asarray(self._crc, dtype="<u4"),
                skipped=tuple(self._skipped),
                columns={name: np.concatenate(parts) for name, parts in self._columns.items()},
                writer_version=__version__,
                blosc2_version=blosc2.__version__,
            )
            meta.validate(str(self.path))
            _write_meta(self._array, meta)
            self._meta = meta
            self._array = None
            _fsync_path(self._tmp)
            os.replace(self._tmp, self.path)
            _fsync_path(self.path.parent, directory=True)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return None

    def abort(self) -> None:
        """Throw away everything written; ``path`` is left as it was."""
        self._closed = True
        self._array = None
        with contextlib.suppress(FileNotFoundError):
            self._tmp.unlink()

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.abort()

    # -- internals -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInputError(f"{self.path}: writer is closed")

    def _check_labels(self, labels: Any, n: int) -> np.ndarray | None:
        has = labels is not None
        if self._has_labels is not None and has != self._has_labels:
            if self._has_labels:
                raise InvalidInputError(f"{self.path}: this store is labelled; pass labels= for every append")
            raise InvalidInputError(f"{self.path}: this store has no labels; pass labels for every image from the first append")
        if not has:
            return None
        lab = np.asarray(labels)
        if lab.shape != (n,):
            raise InvalidInputError(f"{self.path}: {lab.shape} labels for {n} images; give one integer label per image")
        if n and lab.dtype.kind not in "iu":
            if lab.dtype.kind == "f" and np.all(lab == np.round(lab)):
                lab = lab.astype(np.int64)
            else:
                raise InvalidInputError(f"{self.path}: labels must be integers, got {lab.dtype}")
        lab = lab.astype("<i8")
        names = self._meta.class_names
        if n and names is not None and (lab.min() < 0 or lab.max() >= len(names)):
            raise InvalidInputError(
                f"{self.path}: labels span {lab.min()}..{lab.max()} but there are {len(names)} class names"
            )
        if n and lab.min() < 0:
            raise InvalidInputError(f"{self.path}: labels must be >= 0, got {lab.min()}")
        return lab

    def _check_columns(self, columns: dict[str, np.ndarray] | None, n: int) -> dict[str, np.ndarray]:
        columns = dict(columns or {})
        if self.nimages and set(columns) != set(self._columns):
            raise InvalidInputError(
                f"{self.path}: columns {sorted(columns)} given, the store has columns {sorted(self._columns)}; "
                "give the same columns on every append"
            )
        out = {}
        for name, col in columns.items():
            arr = np.asarray(col)
            if arr.ndim == 0 or len(arr) != n:
                raise InvalidInputError(f"{self.path}: column {name!r} has {arr.shape} rows for {n} items")
            dtype_to_record(arr.dtype)  # refuses object dtypes
            if name in self._columns and self._columns[name]:
                prev = self._columns[name][0]
                if prev.dtype != arr.dtype or prev.shape[1:] != arr.shape[1:]:
                    raise InvalidInputError(
                        f"{self.path}: column {name!r} is {arr.dtype}{arr.shape[1:]}, earlier rows are {prev.dtype}{prev.shape[1:]}"
                    )
            out[name] = arr
        return out

    def _check_keys(self, keys: Any, n: int) -> StringTable | None:
        has = keys is not None
        if self._has_keys is not None and has != self._has_keys:
            if self._has_keys:
                raise InvalidInputError(f"{self.path}: this store has keys; pass keys= for every append")
            raise InvalidInputError(f"{self.path}: this store has no keys; pass keys for every image from the first append")
        if not has:
            return None
        keys = list(keys)
        if len(keys) != n:
            raise InvalidInputError(f"{self.path}: {len(keys)} keys for {n} images; give one key per image")
        return StringTable.from_strings(validate_key(k) for k in keys)

    def _flush_chunk(self) -> None:
        k = self._meta.chunk_images
        ic = self._chunk_start // k
        if self._fill < k:
            self._buf[self._fill :].view(np.uint8)[...] = 0  # deterministic padding
        data = blosc2.compress2(self._buf, **self._cparams)
        total = self._chunk_start + self._fill
        if self._stored == 0:
            # blosc2 < 4.1 cannot grow an array from length 0 (3.x miscounts its chunks,
            # 4.0 crashes), so the first chunk re-creates the still empty file at length total.
            self._array = None
            self._array = _new_array(self._tmp, self._meta, total)
            self._stored = total
        elif total != self._stored:
            self._array.resize((total, *self._meta.image_shape))
            self._stored = total
        self._array.schunk.update_chunk(ic, data)
        c = crc32(data)
        if ic < len(self._crc):
            self._crc[ic] = c
        else:
            self._crc.append(c)
        if self._fill == k:
            self._chunk_start += k
            self._fill = 0


def create(
    path: str | os.PathLike[str],
    image_shape: Sequence[int] | None = None,
    dtype: str | np.dtype = "uint8",
    codec: Codec | str | None = None,
    chunk_images: int | None = None,
    class_names: Sequence[str] | None = None,
    attrs: dict[str, Any] | None = None,
    *,
    mode: str = "w",
    overwrite: bool = False,
    provenance: dict[str, Any] | None = None,
    nthreads: int | None = None,
    layout: str | None = None,
) -> StoreWriter:
    """Start writing a store at ``path``; returns a StoreWriter (a context manager).

    ``mode="w"`` creates a new store (``overwrite=True`` to replace an existing file at
    close); ``mode="a"`` appends to an existing store, keeping its pinned codec.
    ``codec`` is a Codec, a preset name, or None for the default (``balanced``).
    ``image_shape`` is the shape of one item: (H, W, C) for images (C = 1, 3 or 4; an
    (H, W) shape gets C = 1), or any shape with ``layout="array"`` (``()`` for scalars).
    ``layout=None`` picks "NHWC" for (H, W, C) pixel data and "array" otherwise.
    """
    p = Path(path)
    if p.suffix != ".b2nd":
        raise InvalidInputError(f"{p}: a store's file name must end in .b2nd")
    if nthreads is None:
        nthreads = max(1, min(8, os.cpu_count() or 1))
    _remove_stale_partials(p)
    if mode == "a":
        return _open_for_append(p, image_shape, dtype, nthreads, codec)
    if mode != "w":
        raise InvalidInputError(f"mode must be 'w' or 'a', got {mode!r}")
    if p.exists() and not overwrite:
        raise StoreExistsError(f"{p} already exists; pass overwrite=True (CLI: --overwrite) to replace it, or mode='a' to append")
    if not p.parent.is_dir():
        raise InvalidInputError(f"{p}: folder {p.parent} does not exist")
    if image_shape is None:
        raise InvalidInputError("create(): image_shape (H, W, C) is required for a new store")
    shape = tuple(int(x) for x in image_shape)
    dt = np.dtype(dtype)
    dtype_to_record(dt)  # refuses object dtypes with a clear message
    is_pixels = dt.name in DTYPES and dt.isnative
    if layout is None:
        layout = "NHWC" if is_pixels and (len(shape) == 2 or (len(shape) == 3 and shape[2] in COLOR_MODES)) else "array"
    if layout not in LAYOUTS:
        raise InvalidInputError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "NHWC":
        if len(shape) == 2:
            shape = (*shape, 1)
        if len(shape) != 3 or shape[2] not in COLOR_MODES or min(shape) < 1:
            raise InvalidInputError(f"image_shape {tuple(image_shape)} must be (H, W, C) with C = 1, 3 or 4")
        if not is_pixels:
            raise InvalidInputError(f"dtype {dt} is not an image dtype; use one of {DTYPES} or layout='array'")
    elif shape and min(shape) < 1:
        raise InvalidInputError(f"item shape {shape} has an empty dimension")
    if codec is None:
        codec = Codec.preset("balanced")
    elif isinstance(codec, str):
        codec = Codec.preset(codec)
    elif not isinstance(codec, Codec):
        raise InvalidInputError(f"codec must be a Codec, a preset name or None, got {type(codec).__name__}")
    auto_block = codec.block_images is None
    codec = codec.resolve(dt, shape, layout)
    image_nbytes = max(1, math.prod(shape)) * dt.itemsize
    if auto_block and chunk_images is not None:
        # the largest divisor of chunk_images not above the automatic block size
        want = min(int(chunk_images), codec.block_images)  # type: ignore[type-var]
        codec = dataclasses.replace(codec, block_images=max(d for d in range(1, want + 1) if chunk_images % d == 0))
    if (image_nbytes * codec.block_images) % codec.typesize:
        raise InvalidInputError(
            f"codec typesize {codec.typesize} does not divide a block of {codec.block_images} image(s) "
            f"({image_nbytes * codec.block_images} bytes)"
        )
    if chunk_images is None:
        chunk_images = default_chunk_images(image_nbytes, codec.block_images, layout)  # type: ignore[arg-type]
    chunk_images = int(chunk_images)
    if codec.block_images > chunk_images:  # type: ignore[operator]
        codec = dataclasses.replace(codec, block_images=chunk_images)
    if chunk_images < 1 or chunk_images % codec.block_images:
        raise InvalidInputError(
            f"chunk_images {chunk_images} must be a positive multiple of the codec's block_images {codec.block_images}"
        )
    if image_nbytes * codec.block_images >= 2**31 or image_nbytes * chunk_images >= 2**31:
        raise InvalidInputError(f"chunks of {chunk_images} images of {image_nbytes} bytes exceed blosc2's 2 GiB limit")
    names = tuple(str(c) for c in class_names) if class_names is not None else None
    meta = StoreMeta(
        image_shape=shape,
        dtype=dtype_to_record(dt),
        codec=codec,
        chunk_images=chunk_images,
        layout=layout,
        color_mode=COLOR_MODES[shape[2]] if layout == "NHWC" else "",
        class_names=names,
        provenance=dict(provenance or {}),
        attrs=dict(attrs or {}),
        writer_version=__version__,
        blosc2_version=blosc2.__version__,
    )
    meta.validate(str(p))
    tmp = _partial_name(p)
    try:
        array = _new_array(tmp, meta, 0)
    except Exception:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return StoreWriter(p, tmp, array, meta, nthreads)


def _new_array(tmp: Path, meta: StoreMeta, nimages: int) -> Any:
    """A fresh store file at ``tmp`` holding ``nimages`` unwritten items and ``meta``."""
    shape = meta.image_shape
    array = blosc2.empty(
        (nimages, *shape),
        dtype=meta.np_dtype,
        chunks=(meta.chunk_images, *shape),
        blocks=(meta.codec.block_images, *shape),
        urlpath=str(tmp),
        mode="w",
        meta={META_KEY: {"format": FORMAT_NAME, "format_version": FORMAT_VERSION}},
        cparams=_blosc2_cparams_for_frame(meta.codec, meta.np_dtype),
    )
    _write_meta(array, meta)
    return array


def _open_for_append(
    p: Path, image_shape: Sequence[int] | None, dtype: Any, nthreads: int, codec: Codec | str | None = None
) -> StoreWriter:
    existing = open_store(p)  # validates format, codec and header
    meta = existing.meta
    existing.close()
    if codec is not None:
        asked = Codec.preset(codec) if isinstance(codec, str) else codec
        pinned = meta.codec
        same = all(
            getattr(asked, f) is None or getattr(asked, f) == getattr(pinned, f)
            for f in ("codec", "clevel", "filters", "typesize", "block_images", "splitmode")
        )
        if not same:
            raise InvalidInputError(
                f"{p}: the store's codec is pinned ({pinned.describe()}); appending keeps it, so a different codec "
                f"({asked.describe()}) cannot be used. Leave codec out, or write a new store"
            )
    if image_shape is not None:
        shape = tuple(int(x) for x in image_shape)
        if len(shape) == 2 and meta.layout == "NHWC":
            shape = (*shape, 1)
        if shape != meta.image_shape:
            raise InvalidInputError(f"{p}: appending images of shape {shape} to a store of image_shape {meta.image_shape}")
        if dtype is not None and np.dtype(dtype) != meta.np_dtype:
            raise InvalidInputError(f"{p}: appending {np.dtype(dtype)} images to a store of {meta.dtype}")
    tmp = _partial_name(p)
    try:
        # Work on a copy so that a crash mid-append never touches the images already stored.
        shutil.copyfile(p, tmp)
        array = blosc2.open(str(tmp), mode="a")  # never pass cparams here
        return StoreWriter(p, tmp, array, meta, nthreads)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def append(path: str | os.PathLike[str], nthreads: int | None = None) -> StoreWriter:
    """Open an existing store to append images; same as ``create(path, mode="a")``."""
    return create(path, mode="a", dtype=None, nthreads=nthreads)  # type: ignore[arg-type]

