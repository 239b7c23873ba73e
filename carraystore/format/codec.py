"""The codec in code (FORMAT.md 5): pinned blosc2 parameters, chunk headers, the CRC rule (layer 1).
:class:`Codec` and :data:`PRESETS` are the codec decision; ids are blosc2's own codes.
:func:`check_chunk_layout` walks an untrusted chunk before libblosc2 sees it; :func:`chunk_crc` /
:func:`chunk_crc_ok` are the CRC rule of FORMAT.md 5.2. Touches no file; imports no record code."""

from __future__ import annotations

import dataclasses
import math
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from carraystore.base.errors import (
    CodecMismatchError,
    CorruptStoreError,
    FormatError,
    InvalidInputError,
    UnknownCodecError,
)

try:  # the same CRC32 as zlib's, faster (ISA-L); zlib where no isal wheel exists
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # pragma: no cover - isal is a dependency
    _crc32 = zlib.crc32

__all__ = [
    "Codec",
    "PRESETS",
    "DEFAULT_PRESET",
    "preset_for_storage",
    "choice_for_storage",
    "storage_delivers",
    "is_preset",
    "CODECS",
    "FILTERS",
    "SPLITMODES",
    "BLOCK_TARGET_BYTES",
    "ChunkHeader",
    "parse_chunk_header",
    "check_chunk_layout",
    "check_codec_against_header",
    "crc32",
    "zero_chunk",
    "chunk_crc",
    "chunk_crc_ok",
    "TARGET_CHUNK_BYTES",
    "MAX_DEFAULT_CHUNK_IMAGES",
    "default_chunk_images",
]

#: Uncompressed size a blosc2 block aims at when ``Codec.block_images`` is None (auto).
BLOCK_TARGET_BYTES = 128 * 1024


# Blosc codec and filter codes are part of the blosc2 format itself and never change.
CODECS = {"blosclz": 0, "lz4": 1, "lz4hc": 2, "zlib": 4, "zstd": 5}
# Codec family written in the chunk header's flags byte (bits 5-7).
_CODEC_FORMAT = {"blosclz": 0, "lz4": 1, "lz4hc": 1, "zlib": 3, "zstd": 4}
FILTERS = {"nofilter": 0, "shuffle": 1, "bitshuffle": 2, "delta": 3, "bytedelta": 35}
SPLITMODES = {"always": 1, "never": 2, "auto": 3, "forward_compat": 4}
_FILTER_NAMES = {v: k for k, v in FILTERS.items()}


def _lookup(table: Mapping[str, int], name: Any, what: str) -> str:
    if not isinstance(name, str) or name.lower() not in table:
        raise UnknownCodecError(
            f"unknown {what} {name!r}: this version of carraystore knows {sorted(table)}; "
            "a newer carraystore may be needed to read this store"
        )
    return name.lower()


@dataclass(frozen=True)
class Codec:
    """Pinned blosc2 compression parameters of a store, all recorded in the file. ``typesize=None`` means
    one pixel (channels x itemsize; the itemsize for non-image arrays), ``block_images=None`` ~128 KiB per
    block, a ``bytedelta`` meta of 0 the typesize: :meth:`resolve` pins them. The defaults are the
    ``balanced`` preset (docs/codecs.md); ``filters=()`` means no filter."""

    codec: str = "zstd"
    clevel: int = 1
    filters: tuple[str, ...] = ("shuffle", "bytedelta")
    filters_meta: tuple[int, ...] = ()
    typesize: int | None = None
    block_images: int | None = None
    splitmode: str = "never"

    def __post_init__(self) -> None:
        object.__setattr__(self, "codec", _lookup(CODECS, self.codec, "codec"))
        object.__setattr__(self, "splitmode", _lookup(SPLITMODES, self.splitmode, "split mode"))
        filters = tuple(_lookup(FILTERS, f, "filter") for f in self.filters)
        filters = tuple(f for f in filters if f != "nofilter")
        meta = tuple(int(m) for m in self.filters_meta) if self.filters_meta else (0,) * len(filters)
        if len(meta) != len(filters):
            raise InvalidInputError(
                f"Codec: {len(filters)} filters {filters} but {len(meta)} filters_meta {meta}; give one meta per filter"
            )
        if len(filters) > 6:
            raise InvalidInputError("Codec: blosc2 takes at most 6 filters")
        object.__setattr__(self, "filters", filters)
        object.__setattr__(self, "filters_meta", meta)
        if not isinstance(self.clevel, int) or not 0 <= self.clevel <= 9:
            raise InvalidInputError(f"Codec: clevel must be an integer 0..9, got {self.clevel!r}")
        if self.typesize is not None and (not isinstance(self.typesize, int) or not 1 <= self.typesize <= 255):
            raise InvalidInputError(f"Codec: typesize must be 1..255 or None, got {self.typesize!r}")
        if self.block_images is not None and (not isinstance(self.block_images, int) or self.block_images < 1):
            raise InvalidInputError(
                f"Codec: block_images must be a positive integer or None, got {self.block_images!r}"
            )

    # -- JSON round trip ---------------------------------------------------------------
    def to_config(self) -> dict[str, Any]:
        """A JSON-able dict that ``from_config`` turns back into an equal Codec."""
        return {
            "id": "blosc2",
            "codec": self.codec,
            "clevel": self.clevel,
            "filters": list(self.filters),
            "filters_meta": list(self.filters_meta),
            "typesize": self.typesize,
            "block_images": self.block_images,
            "splitmode": self.splitmode,
        }

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Codec:
        """Build a Codec from ``to_config()``'s dict (unknown names raise UnknownCodecError)."""
        if not isinstance(config, Mapping):
            raise FormatError(f"codec config must be a mapping, got {type(config).__name__}")
        config = dict(config)
        ident = config.pop("id", "blosc2")
        if ident != "blosc2":
            raise UnknownCodecError(f"unknown codec id {ident!r}; this version of carraystore knows only 'blosc2'")
        known = {f.name for f in dataclasses.fields(cls)}
        extra = set(config) - known
        if extra:
            raise FormatError(f"codec config has unknown keys {sorted(extra)}; known keys are {sorted(known)}")
        if "filters" in config:
            config["filters"] = tuple(config["filters"])
        if "filters_meta" in config:
            config["filters_meta"] = tuple(config["filters_meta"])
        return cls(**config)

    @classmethod
    def preset(cls, name: str) -> Codec:
        """A named preset: ``fast``, ``balanced`` (the default) or ``small`` (see docs/codecs.md)."""
        try:
            return PRESETS[name]
        except KeyError:
            raise InvalidInputError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None

    # -- resolution against a store's pixel layout --------------------------------------
    def resolve(self, dtype: np.dtype, item_shape: Sequence[int], layout: str = "NHWC") -> Codec:
        """The fully explicit codec for items of ``item_shape`` and ``dtype``."""
        dt = np.dtype(dtype)
        item_nbytes = max(1, int(math.prod(item_shape)) * dt.itemsize)
        if self.typesize is not None:
            typesize = self.typesize
        elif layout == "NHWC":
            typesize = dt.itemsize * int(item_shape[-1])
        else:
            typesize = dt.itemsize
        if typesize > 255:
            typesize = 1  # blosc2's limit; only matters for shuffle filters
        block_images = self.block_images or max(1, BLOCK_TARGET_BYTES // item_nbytes)
        pairs = list(zip(self.filters, self.filters_meta, strict=True))
        if typesize == 1:
            # blosc2 drops BYTEDELTA with 1-byte items and SHUFFLE is the identity: record what the headers hold
            pairs = [(f, m) for f, m in pairs if f not in ("bytedelta", "shuffle")]
        filters = tuple(f for f, _ in pairs)
        if typesize > 127:
            # blosc2 keeps bytedelta's meta (the typesize) in a signed byte: drop the automatic one over 127
            pairs = [(f, m) for f, m in pairs if not (f == "bytedelta" and m == 0)]
            filters = tuple(f for f, _ in pairs)
        meta = tuple((typesize if (f == "bytedelta" and m == 0) else m) for f, m in pairs)
        wide = [(f, m) for f, m in zip(filters, meta, strict=True) if not -128 <= m <= 127]
        if wide:
            # a meta outside a signed byte cannot be written (blosc2 raises a bare OverflowError)
            raise InvalidInputError(
                f"Codec: filter {wide[0][0]} with meta {wide[0][1]} (records of {typesize} bytes) does not fit blosc2's "
                "signed-byte filter meta (-128..127); give a typesize of at most 127 or another filter chain"
            )
        return dataclasses.replace(
            self, typesize=typesize, filters=filters, filters_meta=meta, block_images=block_images
        )

    def cparams(self, blocksize: int, nthreads: int = 1) -> dict[str, Any]:
        """Keyword arguments for ``blosc2.compress2`` (a resolved codec only)."""
        import blosc2

        if self.typesize is None:
            raise InvalidInputError("Codec.cparams needs a resolved codec (call resolve() first)")
        return {
            "codec": blosc2.Codec(CODECS[self.codec]),
            "clevel": self.clevel,
            "typesize": self.typesize,
            "filters": [blosc2.Filter(FILTERS[f]) for f in self.filters] or [blosc2.Filter.NOFILTER],
            "filters_meta": list(self.filters_meta) or [0],
            "blocksize": blocksize,
            "splitmode": blosc2.SplitMode(SPLITMODES[self.splitmode]),
            "nthreads": nthreads,
        }

    def describe(self) -> str:
        """A short human-readable description, e.g. ``zstd-1 shuffle+bytedelta ts3``."""
        filt = "+".join(self.filters) or "nofilter"
        ts = f" ts{self.typesize}" if self.typesize is not None else ""
        blocks = f" b{self.block_images}" if self.block_images is not None else ""
        return f"{self.codec}-{self.clevel} {filt}{ts}{blocks}"


#: Named presets (docs/codecs.md): ``fast`` (decompression near memory speed), ``balanced`` (= ``Codec()``,
#: :data:`DEFAULT_PRESET`) and ``small`` (fewest bytes at a practical speed). Blocks are automatic (~128 KiB).
PRESETS: dict[str, Codec] = {
    "fast": Codec("lz4", 1, filters=()),
    "balanced": Codec("zstd", 1, filters=("shuffle", "bytedelta")),
    "small": Codec("zstd", 5, filters=("shuffle", "bytedelta")),
}


#: The preset of a new store when none is given (``Codec()``, ``codec=None``): docs/codecs.md, "Which preset by
#: default, and why", gives the storage-speed matrix it was chosen from.
DEFAULT_PRESET = "balanced"
#: Modelled rates within this share of the best count as a tie, which the candidate storing fewer bytes wins.
STORAGE_TIE = 0.10


def storage_delivers(read_mbs: float | None, ratio: float, warm_mbs: float) -> float:
    """MB/s of pixels a candidate delivers from storage read at ``read_mbs`` MB/s (None: the page cache).

    Reads and decoding overlap (the loader reads ahead while its threads decode), so it is
    ``min(read_mbs x ratio, warm_mbs)``: ``ratio`` is pixel bytes per stored byte, ``warm_mbs``
    the MB/s of pixels the loader delivers from the page cache on these cores.
    """
    return warm_mbs if read_mbs is None else min(read_mbs * ratio, warm_mbs)


def choice_for_storage(
    read_mbs: float | None, candidates: Mapping[str, tuple[float, float]], tie: float = STORAGE_TIE
) -> str:
    """The candidate that feeds the most images from storage read at ``read_mbs`` MB/s (None: the page cache).

    ``candidates`` maps each name (a preset, or ``"encoded"`` for the encoded layout, FORMAT.md
    10) to (ratio of pixel bytes to stored bytes, MB/s of pixels the loader delivers from the
    page cache on these cores). Each delivers :func:`storage_delivers`; among those within
    ``tie`` of the best, the one with the highest ratio wins: where the speeds are alike, the
    bytes decide.
    """
    if not candidates:
        raise InvalidInputError("the storage rule needs at least one candidate's (ratio, MB/s)")
    bad = [name for name, (ratio, mbs) in candidates.items() if not (ratio > 0 and mbs > 0)]
    if bad or (read_mbs is not None and not read_mbs > 0):
        raise InvalidInputError(
            f"the storage rule: ratios, rates and read_mbs must be positive (bad: {bad or read_mbs})"
        )
    delivered = {n: storage_delivers(read_mbs, *candidates[n]) for n in candidates}
    best = max(delivered.values())
    near = [n for n in candidates if delivered[n] >= (1 - tie) * best]
    return max(near, key=lambda n: (candidates[n][0], delivered[n]))


def preset_for_storage(
    read_mbs: float | None, rates: Mapping[str, tuple[float, float]], tie: float = STORAGE_TIE
) -> str:
    """The preset that feeds the most images from storage read at ``read_mbs`` MB/s (None: the page cache).

    ``rates`` maps each candidate preset to (compression ratio, MB/s of pixels the loader
    delivers from the page cache on these cores): :func:`choice_for_storage` among presets.
    """
    return choice_for_storage(read_mbs, rates, tie)


def is_preset(codec: Codec, dtype: np.dtype, item_shape: Sequence[int], layout: str = "NHWC") -> bool:
    """Whether the resolved ``codec`` is one of :data:`PRESETS` as resolved for these items (any block size)."""
    return any(
        dataclasses.replace(p.resolve(dtype, item_shape, layout), block_images=codec.block_images) == codec
        for p in PRESETS.values()
    )


# -- chunk headers ---------------------------------------------------------------------
@dataclass(frozen=True)
class ChunkHeader:
    """The fields of a Blosc2 chunk header that carraystore pins."""

    nbytes: int
    blocksize: int
    cbytes: int
    typesize: int
    codec_format: int
    dont_split: bool
    filters: tuple[str, ...]
    filters_meta: tuple[int, ...]
    memcpyed: bool
    #: a special-value chunk (zeros, NaNs, a repeated value, uninitialised): no data, a default header
    special: bool = False


def parse_chunk_header(chunk: bytes | memoryview) -> ChunkHeader:
    """Read the header of one compressed Blosc2 chunk (see the c-blosc2 chunk format)."""
    if len(chunk) < 32:
        raise FormatError(f"chunk of {len(chunk)} bytes is too short for a Blosc2 header (32 bytes)")
    b = bytes(chunk[:32])
    flags = b[2]
    nbytes = int.from_bytes(b[4:8], "little")
    blocksize = int.from_bytes(b[8:12], "little")
    cbytes = int.from_bytes(b[12:16], "little")
    extended = (flags & 0x05) == 0x05
    filters: list[str] = []
    meta: list[int] = []
    if extended:
        for code, m in zip(b[16:22], b[24:30], strict=True):
            if code == 0:
                continue
            filters.append(_FILTER_NAMES.get(code, f"filter{code}"))
            meta.append(m)
    else:
        if flags & 0x01:
            filters.append("shuffle")
            meta.append(0)
        if flags & 0x04:
            filters.append("bitshuffle")
            meta.append(0)
    return ChunkHeader(
        nbytes=nbytes,
        blocksize=blocksize,
        cbytes=cbytes,
        typesize=b[3],
        codec_format=(flags >> 5) & 0x07,
        dont_split=bool(flags & 0x10),
        filters=tuple(filters),
        filters_meta=tuple(meta),
        memcpyed=bool(flags & 0x02),
        special=bool((b[31] >> 4) & 0x07) if extended else False,
    )


def check_chunk_layout(chunk: bytes | memoryview, what: str, max_nbytes: int) -> ChunkHeader:
    """Check that a Blosc2 chunk's sizes and block offsets lie inside it, before libblosc2 (which trusts them:
    bad ones can crash the process) sees it (FORMAT.md appendix B). CorruptStoreError names ``what``."""
    n = len(chunk)
    if n < 32:
        raise CorruptStoreError(f"{what}: a blosc2 chunk of {n} bytes is shorter than its 32-byte header")
    b = bytes(chunk[:32])
    header = parse_chunk_header(b)
    flags = b[2]
    problems = []
    if (flags & 0x05) != 0x05 and not header.memcpyed:
        problems.append(f"flags {flags:#04x} are not a Blosc2 extended header")
    if header.cbytes != n:
        problems.append(f"header says {header.cbytes} compressed bytes, {n} are there")
    if not 0 <= header.nbytes <= max_nbytes:
        problems.append(f"it decompresses to {header.nbytes} bytes, more than the {max_nbytes} allowed")
    if header.typesize < 1:
        problems.append("typesize 0")
    if header.nbytes and not header.blocksize > 0:
        problems.append(f"blocksize {header.blocksize}")
    if b[31] & 0x01:
        problems.append("it uses a dictionary, which stores never do")
    if problems:
        raise CorruptStoreError(f"{what}: the blosc2 chunk is damaged ({'; '.join(problems)})")
    special = (b[31] >> 4) & 0x07 if (flags & 0x05) == 0x05 else 0
    if special:
        want = 32 + (header.typesize if special == 3 else 0)
        if special not in (1, 2, 3, 4) or n != want:
            raise CorruptStoreError(f"{what}: the blosc2 chunk is damaged (special value {special} in {n} bytes)")
        return header
    if header.memcpyed:
        if n != 32 + header.nbytes:
            raise CorruptStoreError(
                f"{what}: the blosc2 chunk is damaged (a copied chunk of {header.nbytes} bytes in {n})"
            )
        return header
    if header.nbytes == 0:
        if n != 32:
            raise CorruptStoreError(f"{what}: the blosc2 chunk is damaged (empty but {n} bytes)")
        return header
    bsize = header.blocksize
    nblocks = -(-header.nbytes // bsize)
    table_end = 32 + 4 * nblocks
    if table_end > n:
        raise CorruptStoreError(
            f"{what}: the blosc2 chunk is damaged (its block-offset table of {nblocks} entries does not fit)"
        )
    starts = np.frombuffer(bytes(chunk[32:table_end]), dtype="<i4")
    if np.any(starts < table_end) or np.any(starts >= n):
        raise CorruptStoreError(f"{what}: the blosc2 chunk is damaged (a block offset points outside it)")
    typesize = header.typesize
    for j, start in enumerate(starts.tolist()):
        size = bsize if j < nblocks - 1 or header.nbytes % bsize == 0 else header.nbytes % bsize
        split = not header.dont_split and size == bsize  # a shorter last block is one stream
        # c-blosc2 writes one stream per type byte whenever the split flag is set, whatever the typesize
        nstreams = typesize if split else 1
        pos = start
        for _ in range(nstreams):
            if pos + 4 > n:
                raise CorruptStoreError(f"{what}: the blosc2 chunk is damaged (block {j} runs past its end)")
            csize = int.from_bytes(bytes(chunk[pos : pos + 4]), "little", signed=True)
            pos += 4
            if csize < 0:
                pos += 1  # a run of one byte value: a token byte follows, no data
            elif pos + csize > n:
                raise CorruptStoreError(f"{what}: the blosc2 chunk is damaged (block {j} runs past its end)")
            else:
                pos += csize
    return header


def check_codec_against_header(codec: Codec, blocksize: int, header: ChunkHeader, where: str) -> None:
    """Raise CodecMismatchError naming both sides when a chunk header disagrees with the record."""
    if header.special:
        return  # no compressed data: the header's parameters are blosc2's, not the writer's
    problems = []
    if header.typesize != codec.typesize:
        problems.append(f"typesize {header.typesize} in the file, {codec.typesize} recorded")
    if header.blocksize != blocksize:
        problems.append(f"blocksize {header.blocksize} in the file, {blocksize} recorded")
    if not header.memcpyed and header.codec_format != _CODEC_FORMAT[codec.codec]:
        family = "/".join(n for n, f in _CODEC_FORMAT.items() if f == header.codec_format) or "unknown"
        problems.append(f"codec {family!r} (format {header.codec_format}) in the file, {codec.codec!r} recorded")
    if not header.memcpyed and (header.filters, header.filters_meta) != (codec.filters, codec.filters_meta):
        problems.append(
            f"filters {list(header.filters)} meta {list(header.filters_meta)} in the file, "
            f"{list(codec.filters)} meta {list(codec.filters_meta)} recorded"
        )
    want_dont_split = codec.splitmode == "never"
    if codec.splitmode in ("never", "always") and not header.memcpyed and header.dont_split != want_dont_split:
        problems.append(
            f"split flag {'never' if header.dont_split else 'always'} in the file, {codec.splitmode!r} recorded"
        )
    if problems:
        raise CodecMismatchError(f"{where}: codec parameters do not match the store's record: " + "; ".join(problems))


def crc32(data: bytes | memoryview) -> int:
    """CRC32 of a compressed chunk, as recorded in the metadata (zlib's CRC32, computed with ISA-L)."""
    return _crc32(data) & 0xFFFFFFFF


# -- chunk sizes and checks (shared by the reader and the writer) ------------------------
#: Target uncompressed size of one chunk when ``chunk_images`` is not given.
TARGET_CHUNK_BYTES = 4 * 1024 * 1024
#: At most this many images per chunk by default.
MAX_DEFAULT_CHUNK_IMAGES = 4096


def default_chunk_images(image_nbytes: int, block_images: int = 1, layout: str = "NHWC") -> int:
    """Items per chunk: about 4 MiB uncompressed (at most 4096 images), a multiple of ``block_images``."""
    n = max(1, TARGET_CHUNK_BYTES // max(1, image_nbytes))
    if layout == "NHWC":
        n = min(MAX_DEFAULT_CHUNK_IMAGES, n)
    return max(block_images, n - n % block_images)


def zero_chunk(codec: Codec, blocksize: int, nbytes: int, dont_split: bool | None = None) -> bytes:
    """The canonical 32-byte chunk of ``nbytes`` zeros for a resolved codec (FORMAT.md 5.2): what blosc2 makes of
    all zeros, whose CRC-32 is recorded for special-zeros chunks. ``dont_split`` defaults to the split mode's."""
    if codec.typesize is None:
        raise InvalidInputError("zero_chunk needs a resolved codec (call resolve() first)")
    if dont_split is None:
        dont_split = codec.splitmode == "never"
    head = bytearray(32)
    head[0] = 5  # Blosc2 chunk format version
    head[1] = 1  # codec format version
    head[2] = (
        0x05
        | (0x08 if "delta" in codec.filters else 0)
        | (0x10 if dont_split else 0)
        | (_CODEC_FORMAT[codec.codec] << 5)
    )
    head[3] = codec.typesize
    head[4:8] = int(nbytes).to_bytes(4, "little")
    head[8:12] = int(blocksize).to_bytes(4, "little")
    head[12:16] = (32).to_bytes(4, "little")
    for slot, (f, m) in enumerate(zip(codec.filters, codec.filters_meta, strict=True)):
        head[16 + slot] = FILTERS[f]
        head[24 + slot] = m
    head[22] = CODECS[codec.codec]
    head[31] = 0x10  # special value 1: all zeros
    return bytes(head)


def chunk_crc(data: bytes | memoryview, codec: Codec, blocksize: int) -> int:
    """The CRC-32 a writer records for a compressed chunk (FORMAT.md 5.2); a :func:`zero_chunk` for special zeros."""
    if len(data) == 32:
        header = parse_chunk_header(data)
        if header.special and (bytes(data[31:32])[0] >> 4) & 0x07 == 1:
            return crc32(zero_chunk(codec, blocksize, header.nbytes, header.dont_split))
    return crc32(data)


def chunk_crc_ok(data: bytes | memoryview, want: int, codec: Codec, blocksize: int, chunk_nbytes: int) -> bool:
    """Whether chunk bytes as read match their recorded CRC-32 (FORMAT.md 5.2). A special-zeros chunk
    reads as a 32-byte stand-in and must match a full chunk's :func:`zero_chunk`; other special values fail."""
    if crc32(data) == want:
        return True
    if len(data) != 32:
        return False
    try:
        header = parse_chunk_header(data)
    except FormatError:
        return False
    if not header.special or (bytes(data[31:32])[0] >> 4) & 0x07 != 1 or header.nbytes != chunk_nbytes:
        return False
    # auto/forward_compat split modes leave the split bit to blosc2's choice: accept either
    splits = (codec.splitmode == "never",) if codec.splitmode in ("never", "always") else (False, True)
    return any(crc32(zero_chunk(codec, blocksize, chunk_nbytes, s)) == want for s in splits)
