"""The Blosc2 contiguous-frame layout of a store file, parsed from a byte source (layer 1).
A frame (c-blosc2 README_CFRAME_FORMAT.rst; FORMAT.md): a msgpack header (sizes, codec flags, fixed
metalayers), the data chunks, a compressed chunk of int64 chunk offsets, and a msgpack trailer
(variable-length metadata). :func:`read_frame` opens with two reads and never touches a chunk."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import blosc2
import msgpack
import numpy as np

from carraystore.base.errors import CorruptStoreError, MetadataTooLargeError, NotAStoreError
from carraystore.format.codec import check_chunk_layout

__all__ = [
    "ByteSource",
    "ReadAheadSource",
    "LinkCounters",
    "Frame",
    "read_frame",
    "HEAD_READ_BYTES",
    "special_chunk_header",
    "header_problems",
]

#: Bytes read from the start of a file to get the frame header in one request (a store's is ~260).
HEAD_READ_BYTES = 4096
_MAGIC = b"b2frame\x00"
#: A frame header longer than this is refused.
MAX_HEADER_BYTES = 16 * 1024 * 1024
#: A frame may list at most max(MAX_CHUNKS, file size // 8) chunks (bounds the offsets index).
MAX_CHUNKS = 2**23
#: The tail (offsets index, trailer) is read at once when at most this much longer than the index can be.
_TAIL_READ_SLACK = 1024 * 1024
#: Offsets-index entries with bit 63 set are special chunks without data; bits 56-61: 1 zeros, 2 NaNs, 4 uninitialised.
_SPECIAL_BIT = 1 << 63


@runtime_checkable
class ByteSource(Protocol):
    """Random access to the bytes of one store file."""

    #: A path or URL, for error messages (and for re-opening in another process).
    location: str

    def size(self) -> int:
        """Total size in bytes."""

    def read(self, offset: int, length: int) -> bytes | memoryview:
        """Exactly ``length`` bytes at ``offset`` as bytes or a read-only memoryview (thread-safe); raise if short."""

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> Sequence[bytes | memoryview]:
        """The bytes of every (offset, length) range, in the order given, fetched concurrently."""

    def prefetch(self, ranges: Sequence[tuple[int, int]], again: bool = False) -> None:
        """A hint that these ranges will be read soon, in order (may do nothing); ``again``: read once more."""

    def close(self) -> None:
        """Release handles and connections."""


class LinkCounters(Protocol):
    """What a source that reads over a link counts: GETs, bytes received, retries, coalesced ranges."""

    requests: int
    bytes: int
    retries: int
    coalesced: int


@runtime_checkable
class ReadAheadSource(ByteSource, Protocol):
    """A :class:`ByteSource` that fetches hinted ranges ahead over a link (not a local file)."""

    @property
    def identity(self) -> str:
        """What names the object's current content (URL, size, ETag or modification time)."""

    @property
    def max_inflight(self) -> int:
        """GETs in flight at once (0: no link to share, e.g. a cache over a local file)."""

    @property
    def readahead_bytes(self) -> int:
        """Bytes fetched ahead and not yet read, at most."""

    @property
    def head_bytes(self) -> int:
        """Bytes at the start of the file held in memory since opening."""

    @property
    def stats(self) -> LinkCounters:
        """GETs, bytes, retries and coalesced ranges so far."""

    @property
    def retry_timeout(self) -> float:
        """Seconds a failing request is tried again before the read fails."""

    @retry_timeout.setter
    def retry_timeout(self, seconds: float) -> None: ...

    def hinted(self, ranges: Sequence[tuple[int, int]]) -> bool:
        """Whether every range is fetched ahead, or on its way, for a read to come."""

    def wait_prefetched(self, ranges: Sequence[tuple[int, int]], timeout: float | None = None) -> bool:
        """Wait until none of these ranges is still on its way; False after ``timeout`` seconds."""

    def discard(self, offset: int, length: int) -> None:
        """Forget held bytes of this range (they failed a check): the next read fetches them again."""


@dataclass(frozen=True)
class Frame:
    """What a reader needs from a frame: geometry, codec flags, metalayers, chunk index, vlmeta."""

    location: str
    frame_len: int
    header_len: int
    #: bytes of all data chunks (they follow the header)
    cbytes: int
    nbytes: int
    typesize: int
    blocksize: int
    chunksize: int
    #: the codec id (blosc2.Codec value) and clevel in the frame header's codec flags
    codec_id: int
    clevel: int
    #: the fixed metalayers: name -> the msgpack bytes stored for it
    metalayers: dict[str, bytes]
    #: absolute file offset of every chunk (-1 for a special chunk that holds no bytes)
    chunk_offsets: np.ndarray
    #: bytes available for every chunk (an upper bound: up to the next chunk; 0 if special)
    chunk_lengths: np.ndarray
    #: the special value of each chunk (0: a real chunk; 1: zeros; 2: NaNs; 4: uninitialised)
    chunk_special: np.ndarray
    #: variable-length metadata: name -> its compressed content (one blosc2 chunk)
    vlmeta_raw: dict[str, bytes]
    #: the frame header's bytes (``header_len`` of them), for :func:`header_problems`
    header: bytes = b""

    @property
    def nchunks(self) -> int:
        return len(self.chunk_offsets)

    def b2nd(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(shape, chunks, blocks) from the ``b2nd`` metalayer."""
        raw = self.metalayers.get("b2nd")
        if raw is None:
            raise NotAStoreError(f"{self.location}: a blosc2 frame without the b2nd metalayer (not an NDArray)")
        try:
            rec = msgpack.unpackb(raw, raw=True, strict_map_key=False)
            _version, ndim, shape, chunks, blocks = rec[:5]
            out = tuple(tuple(int(x) for x in v) for v in (shape, chunks, blocks))
            if any(len(v) != ndim for v in out):
                raise ValueError("dimension counts differ")
        except Exception as exc:
            raise CorruptStoreError(
                f"{self.location}: the b2nd metalayer cannot be read ({exc}); the file is damaged"
            ) from exc
        return out  # type: ignore[return-value]

    def vlmeta(self, name: str, max_nbytes: int | None = None) -> bytes | None:
        """The decompressed variable-length metadata ``name``, or None when absent. The chunk is walked
        before libblosc2 sees it; ``max_nbytes`` refuses a larger one (MetadataTooLargeError) up front."""
        content = self.vlmeta_raw.get(name)
        if content is None:
            return None
        what = f"{self.location}: the {name!r} metadata"
        header = check_chunk_layout(content, what, 2**31 - 1)
        if max_nbytes is not None and header.nbytes > max_nbytes:
            raise MetadataTooLargeError(
                f"{what} would decompress to {header.nbytes} bytes, more than the {max_nbytes} a store of this size "
                "may hold (FORMAT.md, Limits); the file is damaged or hostile"
            )
        try:
            out = bytes(blosc2.decompress(content))
        except Exception as exc:
            raise CorruptStoreError(f"{what} cannot be decompressed ({exc}); the file is damaged") from exc
        if len(out) != header.nbytes:
            raise CorruptStoreError(
                f"{what} decompressed to {len(out)} bytes, its header says {header.nbytes}; the file is damaged"
            )
        return out


def _damaged(location: str, what: str) -> CorruptStoreError:
    return CorruptStoreError(
        f"{location}: {what}; the file is truncated, damaged or not a store (restore it from a copy or re-create it)"
    )


def _unpack_first(data: bytes | memoryview) -> Any:
    unpacker = msgpack.Unpacker(raw=True, strict_map_key=False, max_buffer_size=max(1, len(data)))
    unpacker.feed(data)
    return next(unpacker)


def _named_contents(section: Any, where: str, location: str) -> dict[str, bytes]:
    """A metalayer/vlmeta section ``[_, {name: offset}, [content, ...]]`` as name -> content."""
    try:
        _n, index, contents = section[:3]
        names = [k.decode() if isinstance(k, bytes) else str(k) for k in index]
        if len(names) != len(contents) or not all(isinstance(c, bytes) for c in contents):
            raise ValueError("names and contents do not pair up")
        return dict(zip(names, contents, strict=True))
    except Exception as exc:
        raise _damaged(location, f"the {where} cannot be parsed ({exc})") from exc


def read_frame(source: ByteSource) -> Frame:
    """Parse the frame of ``source`` with two reads (three when the header is unusually long)."""
    loc = source.location
    size = source.size()
    head = source.read(0, min(size, HEAD_READ_BYTES))
    if len(head) < 64 or head[2:10] != _MAGIC:
        raise _damaged(loc, f"not a blosc2 frame ({size} bytes)")
    if head[10] != 0xD2 or head[0x0F] != 0xCF or head[38] != 0xD3:
        raise _damaged(loc, "the frame header's layout is not the one this carraystore reads")
    header_len = int.from_bytes(head[11:15], "big")
    frame_len = int.from_bytes(head[16:24], "big")
    cbytes = int.from_bytes(head[39:47], "big")
    if frame_len != size:
        raise _damaged(loc, f"the frame header says {frame_len} bytes, the file has {size}")
    if not 64 <= header_len <= min(size, MAX_HEADER_BYTES) or cbytes < 0 or header_len + cbytes > size:
        raise _damaged(loc, f"frame header sizes out of range (header {header_len}, chunks {cbytes}, file {size})")
    if header_len > len(head):
        head = source.read(0, header_len)
    try:
        header = _unpack_first(head[:header_len])
        flags = header[3]
        nbytes, hcbytes, typesize, blocksize, chunksize = (int(v) for v in header[4:9])
        metalayers = _named_contents(header[13], "frame header's metalayers", loc)
    except CorruptStoreError:
        raise
    except Exception as exc:
        raise _damaged(loc, f"the frame header cannot be parsed ({exc})") from exc
    if hcbytes != cbytes:
        raise _damaged(loc, "the frame header's two compressed sizes disagree")
    if not (0 <= nbytes < 2**63 and 0 < typesize < 2**31 and 0 <= blocksize < 2**31 and 0 <= chunksize < 2**31):
        raise _damaged(
            loc,
            f"frame header fields out of range (nbytes {nbytes}, typesize {typesize}, "
            f"blocksize {blocksize}, chunksize {chunksize})",
        )
    nchunks = -(-nbytes // chunksize) if chunksize > 0 else 0
    if nchunks > max(MAX_CHUNKS, size // 8):
        raise _damaged(
            loc, f"the frame header's sizes make {nchunks} chunks, more than a file of {size} bytes can index"
        )
    # the tail (offsets index, trailer) is sized from cbytes, bounded first: a damaged one must not read the file
    tail_start = header_len + cbytes
    index_max = _index_max_bytes(nchunks)
    if size - tail_start > index_max + _TAIL_READ_SLACK:
        last = source.read(size - 23, 23) if size - tail_start >= 23 else b""
        trailer_len = int.from_bytes(last[1:5], "big") if len(last) == 23 and last[0] == 0xCE else 0
        if not 23 <= trailer_len <= size - tail_start or size - tail_start - trailer_len > index_max:
            raise _damaged(
                loc,
                f"{size - tail_start} bytes after the data chunks (compressed size {cbytes}), more than the offsets "
                f"index of {nchunks} chunks and the trailer take",
            )
    tail = source.read(tail_start, size - tail_start)
    if len(tail) < 23 or tail[-23] != 0xCE:
        raise _damaged(loc, "the frame trailer is missing")
    trailer_len = int.from_bytes(tail[-22:-18], "big")
    if not 23 <= trailer_len <= len(tail):
        raise _damaged(loc, f"trailer length {trailer_len} out of range")
    index_bytes = tail[: len(tail) - trailer_len]
    if len(index_bytes) > index_max:
        raise _damaged(loc, f"the offsets index takes {len(index_bytes)} bytes, more than {nchunks} chunks need")
    try:
        trailer = _unpack_first(tail[len(tail) - trailer_len :])
        vlmeta_raw = _named_contents(trailer[1], "frame trailer's metadata", loc)
    except CorruptStoreError:
        raise
    except Exception as exc:
        raise _damaged(loc, f"the frame trailer cannot be parsed ({exc})") from exc
    offsets = _parse_offsets(index_bytes, nbytes, chunksize, cbytes, loc)
    special = np.where(offsets < 0, (offsets.view(np.uint64) >> np.uint64(56)) & np.uint64(0x7F), 0).astype(np.int64)
    real = offsets >= 0
    # a chunk ends where the next one (in file order) begins, or where the data ends
    pos = np.where(real, offsets, cbytes)
    order = np.argsort(pos, kind="stable")
    ends = np.full(len(offsets), cbytes, dtype=np.int64)
    ends[order[:-1]] = pos[order][1:]
    lengths = np.where(real, ends - offsets, 0)
    return Frame(
        location=loc,
        frame_len=frame_len,
        header_len=header_len,
        cbytes=cbytes,
        nbytes=nbytes,
        typesize=typesize,
        blocksize=blocksize,
        chunksize=chunksize,
        codec_id=flags[2] & 0x0F if isinstance(flags, bytes) and len(flags) > 2 else -1,
        clevel=flags[2] >> 4 if isinstance(flags, bytes) and len(flags) > 2 else -1,
        metalayers=metalayers,
        chunk_offsets=np.where(real, offsets + header_len, -1),
        chunk_lengths=lengths,
        chunk_special=special,
        vlmeta_raw=vlmeta_raw,
        header=bytes(head[:header_len]),
    )


def _index_max_bytes(nchunks: int) -> int:
    """The most bytes an offsets index of ``nchunks`` entries takes (stored raw, plus blosc2's overhead)."""
    return 2 * 8 * nchunks + 16 * 1024


def _parse_offsets(index_bytes: bytes | memoryview, nbytes: int, chunksize: int, cbytes: int, loc: str) -> np.ndarray:
    nchunks = -(-nbytes // chunksize) if chunksize > 0 else 0
    if nchunks == 0:
        return np.zeros(0, dtype=np.int64)
    if len(index_bytes) < 32:
        raise _damaged(loc, "the chunk offsets index is missing")
    try:
        osize = blosc2.get_cbuffer_sizes(index_bytes[:32])[1]
        if osize > len(index_bytes):
            raise ValueError(f"it claims {osize} bytes, {len(index_bytes)} are there")
        check_chunk_layout(index_bytes[:osize], "the offsets index", 8 * nchunks + 8 * 1024)
        offsets = np.frombuffer(blosc2.decompress(index_bytes[:osize]), dtype="<i8").astype(np.int64)
    except Exception as exc:
        raise _damaged(loc, f"the chunk offsets index cannot be read ({exc})") from exc
    if len(offsets) < nchunks:
        raise _damaged(loc, f"the offsets index lists {len(offsets)} chunks, the frame holds {nchunks}")
    offsets = offsets[:nchunks]
    real = offsets >= 0
    if np.any(offsets[real] >= cbytes):
        raise _damaged(loc, "a chunk offset points past the data")
    return offsets


#: The frame header's fixed part (FORMAT.md appendix A.1): offset -> (the byte it must hold, what it is).
_HEADER_MARKERS = {
    0: (0x9E, "the header's array marker (14 elements)"),
    1: (0xA8, "the magic's string marker"),
    10: (0xD2, "header_len's int32 marker"),
    15: (0xCF, "frame_len's uint64 marker"),
    24: (0xA4, "the flags' string marker"),
    25: (0x12, "the general flags (frame format 2, 64-bit offsets)"),
    26: (0x00, "the frame type (0: contiguous)"),
    29: (0xD3, "nbytes' int64 marker"),
    38: (0xD3, "cbytes' int64 marker"),
    47: (0xD2, "typesize's int32 marker"),
    52: (0xD2, "blocksize's int32 marker"),
    57: (0xD2, "chunksize's int32 marker"),
    62: (0xD1, "the compression threads' int16 marker"),
    65: (0xD1, "the decompression threads' int16 marker"),
    68: (0xC3, "the has-variable-length-metadata flag (true)"),
    69: (0xD8, "the filter pipeline's fixext 16 marker"),
    70: (0x06, "the filter pipeline's extension type (6)"),
    87: (0x93, "the metalayers' array marker"),
    88: (0xCD, "the metalayer index size's uint16 marker"),
    91: (0xDE, "the metalayer map's marker"),
}
#: Where the 16 bytes of the frame's filter pipeline start (after ``d8 06``).
PIPELINE_AT = 71
#: Filter ids a store's frame pipeline may name (FORMAT.md 5.1); 0 is an unused slot.
_PIPELINE_FILTERS = (0, 1, 2, 3, 35)


def header_problems(frame: Frame) -> list[str]:
    """Every byte of the frame header against FORMAT.md appendix A.1/A.2; the problems found, [] if none.
    Beyond ``read_frame``'s needs (markers, flags, thread counts, pipeline, metalayers, b2nd layout);
    per-store values are :func:`carraystore.store.checks.header_problems`."""
    h = frame.header
    if len(h) != frame.header_len or len(h) < 94:
        return [f"the header holds {len(h)} bytes, {frame.header_len} expected"]
    out = [
        f"byte {pos} ({what}) is 0x{h[pos]:02x}, not 0x{want:02x}"
        for pos, (want, what) in _HEADER_MARKERS.items()
        if h[pos] != want
    ]
    if h[2:10] != _MAGIC:
        out.append("the magic is not b2frame")
    if h[28] > 3:
        out.append(f"byte 28 (the split mode flags) is {h[28]}, not 0-3")
    for pos, what in ((63, "compression"), (66, "decompression")):
        n = int.from_bytes(h[pos : pos + 2], "big", signed=True)
        if n < 1:
            out.append(f"the {what} thread count is {n}, not a positive number")
    # an empty array's chunk and block sizes are not kept by blosc2 < 4.1 (1 or 0): checked with data only
    if frame.nbytes and (frame.chunksize <= 0 or frame.nbytes % frame.chunksize):
        out.append(f"nbytes {frame.nbytes} is not a whole number of chunks of {frame.chunksize} bytes")
    if frame.nbytes and not 0 < frame.blocksize <= frame.chunksize:
        out.append(f"blocksize {frame.blocksize} does not fit a chunk of {frame.chunksize} bytes")
    pipe = h[PIPELINE_AT : PIPELINE_AT + 16]
    if any(f not in _PIPELINE_FILTERS for f in pipe[:6]) or pipe[7] or pipe[14:16] != bytes(2):
        out.append(f"the filter pipeline {pipe.hex()} names an unknown filter or sets reserved bytes")
    if pipe[6] != h[27] & 0x0F:
        out.append(f"the filter pipeline's codec id {pipe[6]} differs from the flags' {h[27] & 0x0F}")
    try:
        out += _metalayer_problems(h)
    except IndexError:
        out.append("the metalayers run past the header's end")
    b2nd = frame.metalayers.get("b2nd")
    if b2nd is not None:
        out += _b2nd_layout_problems(b2nd)
    return out


def _metalayer_problems(h: bytes) -> list[str]:
    """The metalayer section (A.1 [13]): index size, names, each offset at its content, the header's end."""
    out: list[str] = []
    size = int.from_bytes(h[89:91], "big")
    count = int.from_bytes(h[92:94], "big")
    pos = 94
    offsets = []
    for i in range(count):
        marker = h[pos]
        if marker & 0xE0 != 0xA0:
            return [*out, f"metalayer name {i} has the marker 0x{marker:02x}, not a short string"]
        pos += 1 + (marker & 0x1F)
        if h[pos] != 0xD2:
            return [*out, f"metalayer offset {i} has the marker 0x{h[pos]:02x}, not int32"]
        offsets.append(int.from_bytes(h[pos + 1 : pos + 5], "big", signed=True))
        pos += 5
    if pos - 87 != size:
        out.append(f"the metalayer index size is {size}, the index takes {pos - 87} bytes")
    if h[pos] != 0xDC or int.from_bytes(h[pos + 1 : pos + 3], "big") != count:
        return [*out, f"the metalayer contents do not follow the index of {count} names"]
    pos += 3
    for i, off in enumerate(offsets):
        if h[pos] != 0xC6:
            return [*out, f"metalayer content {i} has the marker 0x{h[pos]:02x}, not bin32"]
        if off != pos:
            out.append(f"metalayer {i}'s offset is {off}, its content starts at {pos}")
        pos += 5 + int.from_bytes(h[pos + 1 : pos + 5], "big")
    if pos != len(h):
        out.append(f"the metalayers end at byte {pos}, the header at {len(h)}")
    return out


def _b2nd_layout_problems(c: bytes) -> list[str]:
    """The b2nd metalayer (A.2): ``97 00 ndim``, three arrays of ndim ints (int64, int32, int32), ``00``, str32."""
    ndim = c[2] if len(c) > 2 else 0
    if len(c) < 3 or c[0] != 0x97 or c[1] != 0 or not 1 <= ndim <= 8:
        return [f"the b2nd metalayer does not start with 97 00 and a dimension count ({c[:3].hex()})"]
    pos = 3
    for marker, width, what in ((0xD3, 8, "shape"), (0xD2, 4, "chunk shape"), (0xD2, 4, "block shape")):
        if c[pos : pos + 1] != bytes([0x90 | ndim]):
            return [f"the b2nd {what} is not an array of {ndim}"]
        pos += 1
        for _ in range(ndim):
            if c[pos : pos + 1] != bytes([marker]):
                return [f"the b2nd {what} holds an integer not written as {8 * width} bits"]
            pos += 1 + width
    if c[pos : pos + 2] != b"\x00\xdb":
        return [f"the b2nd dtype format is {c[pos : pos + 1].hex()} (0: numpy) or its text marker is wrong"]
    n = int.from_bytes(c[pos + 2 : pos + 6], "big")
    if pos + 6 + n != len(c):
        return [f"the b2nd dtype text of {n} bytes does not end the metalayer"]
    return []


def special_chunk_header(special: int, nbytes: int, blocksize: int, typesize: int) -> bytes:
    """The 32-byte chunk that stands for a special chunk (what ``SChunk.get_chunk`` returns)."""
    head = bytearray(32)
    head[0] = 5  # Blosc2 chunk format version
    head[1] = 1
    head[2] = 0x05
    head[3] = typesize & 0xFF
    head[4:8] = int(nbytes).to_bytes(4, "little")
    head[8:12] = int(blocksize or nbytes).to_bytes(4, "little")
    head[12:16] = (32).to_bytes(4, "little")
    head[31] = (special & 0x7) << 4
    return bytes(head)


# -- writing in place (appends) ------------------------------------------------------------
#: Positions of the big-endian 64-bit header fields an append rewrites: frame length, nbytes, cbytes.
FRAME_LEN_AT = 16
NBYTES_AT = 30
CBYTES_AT = 39


def shape0_position(head: bytes, nitems: int, location: str) -> int:
    """Where the b2nd shape's first dimension (big-endian int64) lies in ``head``; checked to hold ``nitems``."""
    try:
        header = _unpack_first(head)
        index = {k.decode() if isinstance(k, bytes) else str(k): int(v) for k, v in header[13][1].items()}
        c = index["b2nd"]
        # bin32 (0xc6, 4-byte length), then fixarray(7), version, ndim, fixarray(ndim), int64 (0xd3)
        ndim = head[c + 7]
        ok = (
            head[c] == 0xC6
            and head[c + 5] == 0x97
            and head[c + 6] < 0x80
            and head[c + 8] == 0x90 | ndim
            and head[c + 9] == 0xD3
        )
        pos = c + 10
        if not ok or int.from_bytes(head[pos : pos + 8], "big", signed=True) != nitems:
            raise ValueError("the b2nd metalayer is not laid out as this carraystore writes it")
    except Exception as exc:
        raise _damaged(location, f"cannot update the frame header in place ({exc})") from exc
    return pos


def raw_offsets(frame: Frame) -> np.ndarray:
    """The offsets index entries as stored: data-relative offsets, special chunks flagged."""
    special = frame.chunk_special.astype(np.uint64)
    flagged = (np.uint64(_SPECIAL_BIT) | (special << np.uint64(56))).view(np.int64)
    return np.where(frame.chunk_special > 0, flagged, frame.chunk_offsets - frame.header_len).astype("<i8")


def encode_offsets(raw: np.ndarray) -> bytes:
    """An offsets index chunk for ``raw`` (int64 little-endian entries), as blosc2 writes one."""
    return bytes(
        blosc2.compress2(
            np.ascontiguousarray(raw, dtype="<i8"),
            typesize=8,
            codec=blosc2.Codec.BLOSCLZ,
            clevel=5,
            splitmode=blosc2.SplitMode.NEVER_SPLIT,
            nthreads=1,
        )
    )
