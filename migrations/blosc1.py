"""Decode Blosc1 chunks (as written by c-blosc 1.x, e.g. inside bcolz) with blosc2 or cramjam.

c-blosc2 reads Blosc1 chunks except:

* c-blosc < 1.11 (bcolz <= 1.1.0) wrote no "don't split" flag (0x10) and split a block into
  ``typesize`` streams only when ``typesize <= 16`` and ``blocksize // typesize >= 128``;
  setting the flag where that rule says "not split" makes c-blosc2 decode them exactly.
* Snappy (codec format 2) is in no c-blosc2 or pip blosc build: its streams are raw snappy
  blocks, decoded with ``cramjam.snappy.decompress_raw``, the shuffle undone here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import blosc2
import numpy as np

from carraystore.base.errors import MigrationError, MissingDependencyError

__all__ = [
    "Blosc1Header",
    "parse_header",
    "fix_split_flag",
    "decompress",
    "decompress_into",
    "CODEC_NAMES",
]

#: Codec family in bits 5-7 of the flags byte.
CODEC_NAMES = {0: "blosclz", 1: "lz4", 2: "snappy", 3: "zlib", 4: "zstd"}
_SHUFFLE, _MEMCPYED, _BITSHUFFLE, _DONT_SPLIT = 0x01, 0x02, 0x04, 0x10
_MAX_SPLITS, _MIN_BUFFERSIZE = 16, 128
HEADER_SIZE = 16


@dataclass(frozen=True)
class Blosc1Header:
    """The 16-byte header of a Blosc1 chunk."""

    version: int
    versionlz: int
    flags: int
    typesize: int
    nbytes: int
    blocksize: int
    cbytes: int

    @property
    def codec(self) -> str:
        return CODEC_NAMES.get(self.flags >> 5, f"codec{self.flags >> 5}")

    @property
    def shuffle(self) -> str:
        if self.flags & _MEMCPYED:
            return "noshuffle"
        if self.flags & _BITSHUFFLE:
            return "bitshuffle"
        return "shuffle" if self.flags & _SHUFFLE else "noshuffle"

    @property
    def memcpyed(self) -> bool:
        return bool(self.flags & _MEMCPYED)


def parse_header(chunk: bytes | memoryview, where: str = "chunk", complete: bool = True) -> Blosc1Header:
    """Parse and check a Blosc1 chunk header (``complete``: all its ``cbytes`` present); MigrationError if bad."""
    if len(chunk) < HEADER_SIZE:
        raise MigrationError(
            f"{where}: {len(chunk)} bytes, too short for a Blosc chunk header (16 bytes); the file is truncated or empty"
        )
    b = bytes(chunk[:HEADER_SIZE])
    h = Blosc1Header(
        version=b[0],
        versionlz=b[1],
        flags=b[2],
        typesize=b[3],
        nbytes=int.from_bytes(b[4:8], "little"),
        blocksize=int.from_bytes(b[8:12], "little"),
        cbytes=int.from_bytes(b[12:16], "little"),
    )
    if not 1 <= h.version <= 4 or h.cbytes < HEADER_SIZE or h.typesize == 0:
        raise MigrationError(
            f"{where}: not a Blosc1 chunk (version {h.version}, typesize {h.typesize}, cbytes {h.cbytes}); "
            "the file is damaged or not written by bcolz"
        )
    if h.nbytes and h.blocksize == 0 and not h.memcpyed:
        raise MigrationError(
            f"{where}: inconsistent Blosc header (nbytes {h.nbytes}, blocksize 0); the file is damaged"
        )
    if complete and len(chunk) < h.cbytes:
        raise MigrationError(
            f"{where}: truncated: the Blosc header says {h.cbytes} compressed bytes but only {len(chunk)} are there; "
            "restore this file from a backup (the other chunks are intact)"
        )
    return h


def _old_rule_splits(h: Blosc1Header) -> bool:
    """Whether c-blosc < 1.11 split the (non-leftover) blocks of this chunk into streams."""
    return h.typesize <= _MAX_SPLITS and h.blocksize // h.typesize >= _MIN_BUFFERSIZE


def fix_split_flag(chunk: bytes | memoryview) -> bytes:
    """The chunk with the "don't split" flag set where the pre-1.11 rule says not split (safe for every 1.x)."""
    h = parse_header(chunk)
    data = bytes(chunk[: h.cbytes])
    if h.memcpyed or h.flags & _DONT_SPLIT or _old_rule_splits(h):
        return data
    return data[:2] + bytes([h.flags | _DONT_SPLIT]) + data[3:]


def decompress(chunk: bytes | memoryview, where: str = "chunk") -> bytes:
    """Decompress one Blosc1 chunk exactly (any c-blosc 1.x, snappy included)."""
    h = parse_header(chunk, where)
    out = np.empty(h.nbytes, dtype=np.uint8)
    decompress_into(chunk, out, where, header=h)
    return out.tobytes()


def decompress_into(
    chunk: bytes | memoryview, out: np.ndarray, where: str = "chunk", header: Blosc1Header | None = None
) -> int:
    """Decompress a Blosc1 chunk into C-contiguous ``out``; the bytes written. MigrationError on damage."""
    h = header or parse_header(chunk, where)
    dst = out.reshape(-1).view(np.uint8) if out.dtype != np.uint8 or out.ndim != 1 else out
    if dst.nbytes < h.nbytes:
        raise MigrationError(f"{where}: holds {h.nbytes} bytes, more than the {dst.nbytes} expected")
    if h.nbytes == 0:
        return 0
    if h.memcpyed:
        if h.cbytes < HEADER_SIZE + h.nbytes:
            raise MigrationError(
                f"{where}: truncated: a stored (uncompressed) chunk of {h.nbytes} bytes has only {h.cbytes - HEADER_SIZE}"
            )
        dst[: h.nbytes] = np.frombuffer(chunk, dtype=np.uint8, count=h.nbytes, offset=HEADER_SIZE)
        return h.nbytes
    if h.codec == "snappy":
        snappy = _snappy_decompress_raw()
        _decompress_streams(chunk, h, dst[: h.nbytes], where, lambda data, n: snappy(data))
        return h.nbytes
    if h.codec not in CODEC_NAMES.values():
        raise MigrationError(f"{where}: unknown Blosc codec {h.codec!r} (flags {h.flags:#04x}); the file is damaged")
    try:
        n = blosc2.decompress2(fix_split_flag(chunk), dst=dst[: h.nbytes])
    except Exception as exc:  # blosc2 raises RuntimeError/ValueError with little detail
        raise MigrationError(
            f"{where}: the {h.codec} chunk does not decompress ({exc}); the file is damaged or truncated"
        ) from exc
    if n is not None and isinstance(n, int) and n != h.nbytes:
        raise MigrationError(f"{where}: decompressed {n} bytes, the header says {h.nbytes}")
    return h.nbytes


# -- snappy ---------------------------------------------------------------------------------


def _snappy_decompress_raw() -> Callable[[bytes], Any]:
    try:
        import cramjam
    except ImportError as exc:
        raise MissingDependencyError(
            "this bcolz array is compressed with snappy, which blosc2 cannot decode; install cramjam to read it: "
            "pip install 'carraystore[migrate]'  (or: pip install cramjam)"
        ) from exc
    return cramjam.snappy.decompress_raw


def _decompress_streams(
    chunk: bytes | memoryview,
    h: Blosc1Header,
    dst: np.ndarray,
    where: str,
    decode: Callable[[bytes, int], Any],
) -> None:
    """Decode a Blosc1 chunk block by block in Python: ``decode(stream, nbytes)`` decodes one
    compressed stream (raw snappy for snappy chunks); shuffles are undone with numpy."""
    codec = h.codec
    buf = memoryview(chunk)[: h.cbytes]
    ts = h.typesize
    nblocks = -(-h.nbytes // h.blocksize)
    leftover = h.nbytes % h.blocksize
    bstarts_end = HEADER_SIZE + 4 * nblocks
    if h.cbytes < bstarts_end:
        raise MigrationError(f"{where}: truncated: no room for {nblocks} block offsets")
    bstarts = np.frombuffer(buf, dtype="<i4", count=nblocks, offset=HEADER_SIZE)
    split_flag_ok = not (h.flags & _DONT_SPLIT) and _old_rule_splits(h)
    tmp = np.empty(h.blocksize, dtype=np.uint8)
    for j in range(nblocks):
        is_leftover = bool(leftover) and j == nblocks - 1
        bsize = leftover if is_leftover else h.blocksize
        nstreams = ts if (split_flag_ok and not is_leftover) else 1
        neblock = bsize // nstreams
        pos = int(bstarts[j])
        block = tmp[:bsize]
        for s in range(nstreams):
            if pos < bstarts_end or pos + 4 > h.cbytes:
                raise MigrationError(f"{where}: block {j} starts outside the chunk; the file is damaged")
            csize = int.from_bytes(buf[pos : pos + 4], "little", signed=True)
            pos += 4
            if csize <= 0 or pos + csize > h.cbytes:
                raise MigrationError(
                    f"{where}: block {j} stream {s} has a bad size {csize}; the file is damaged or truncated"
                )
            part = block[s * neblock : (s + 1) * neblock]
            if csize == neblock:  # stored uncompressed
                part[:] = np.frombuffer(buf, dtype=np.uint8, count=csize, offset=pos)
            else:
                try:
                    raw = bytes(decode(bytes(buf[pos : pos + csize]), neblock))
                except Exception as exc:
                    raise MigrationError(f"{where}: {codec} stream {s} of block {j} does not decode ({exc})") from exc
                if len(raw) != neblock:
                    raise MigrationError(
                        f"{where}: {codec} stream {s} of block {j} gave {len(raw)} bytes, expected {neblock}"
                    )
                part[:] = np.frombuffer(raw, dtype=np.uint8)
            pos += csize
        out = dst[j * h.blocksize : j * h.blocksize + bsize]
        if h.flags & _BITSHUFFLE and bsize >= ts:
            _bitunshuffle(block, out, ts, h.version)
        elif h.flags & _SHUFFLE and ts > 1:
            _unshuffle(block, out, ts)
        else:
            out[:] = block


def _unshuffle(src: np.ndarray, dst: np.ndarray, ts: int) -> None:
    """Undo Blosc's byte shuffle of one block (trailing bytes that fill no element stay put)."""
    n = src.size // ts
    dst[: n * ts] = src[: n * ts].reshape(ts, n).T.reshape(-1)
    dst[n * ts :] = src[n * ts :]


def _bitunshuffle(src: np.ndarray, dst: np.ndarray, ts: int, version: int) -> None:
    """Undo bitshuffle of one block.

    Format version 2 (c-blosc < 1.17) left blocks whose element count is not a multiple
    of 8 untouched; later versions bitshuffle the first multiple of 8 and copy the rest.
    """
    n = src.size // ts
    if version <= 2 and n % 8:
        dst[:] = src
        return
    m = n - n % 8
    if m:
        bits = np.unpackbits(src[: m * ts].reshape(ts, 8, m // 8), axis=-1, bitorder="little")  # (ts, 8, m)
        dst[: m * ts] = np.packbits(bits.transpose(2, 0, 1), axis=-1, bitorder="little").reshape(-1)
    dst[m * ts :] = src[m * ts :]
