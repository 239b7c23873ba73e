"""A store writer written from FORMAT.md alone (no carraystore import), to keep the spec honest.

It follows section 6 step by step and builds the whole frame by hand from appendix A:
``blosc2.compress2`` produces the chunk bytes (the data chunks with the pinned
parameters, the offsets index and the metadata chunk); every other byte is written here.
``tests/format/test_spec.py`` opens the result with carraystore (and with plain blosc2).
"""

from __future__ import annotations

import math
import os
import zlib
from pathlib import Path
from typing import Any

import blosc2
import msgpack
import numpy as np

CODEC_IDS = {"blosclz": 0, "lz4": 1, "lz4hc": 2, "zlib": 4, "zstd": 5}  # FORMAT.md 5.1
FILTER_IDS = {"shuffle": 1, "bitshuffle": 2, "delta": 3, "bytedelta": 35}
SPLITMODES = {"always": 1, "never": 2, "auto": 3, "forward_compat": 4}


def _i(marker: int, value: int, width: int) -> bytes:
    """A msgpack integer of fixed width (appendix A: c-blosc2 reads fields at fixed offsets)."""
    return bytes([marker]) + value.to_bytes(width, "big", signed=marker in (0xD1, 0xD2, 0xD3))


def _fixstr(s: str) -> bytes:
    b = s.encode()
    assert len(b) < 32
    return bytes([0xA0 | len(b)]) + b


def _bin32(b: bytes) -> bytes:
    return b"\xc6" + len(b).to_bytes(4, "big") + b


def _fixarray(items: list[bytes]) -> bytes:
    assert len(items) < 16
    return bytes([0x90 | len(items)]) + b"".join(items)


def _b2nd(shape: tuple[int, ...], chunks: tuple[int, ...], blocks: tuple[int, ...], dtype: str) -> bytes:
    """Appendix A.2."""
    text = dtype.encode()
    return (
        b"\x97\x00"
        + bytes([len(shape)])
        + _fixarray([_i(0xD3, v, 8) for v in shape])
        + _fixarray([_i(0xD2, v, 4) for v in chunks])
        + _fixarray([_i(0xD2, v, 4) for v in blocks])
        + b"\x00"
        + b"\xdb"
        + len(text).to_bytes(4, "big")
        + text
    )


def seal(record: dict[str, Any]) -> bytes:
    """FORMAT.md 4.3: meta_crc32 last, as 0xce + 4 bytes = CRC-32 of everything before them."""
    body = dict(record)
    body["meta_crc32"] = 0xFFFFFFFF
    raw = bytearray(msgpack.packb(body, use_bin_type=True))
    raw[-4:] = zlib.crc32(bytes(raw[:-4])).to_bytes(4, "big")
    return bytes(raw)


def write_store(
    path: str | Path,
    items: np.ndarray,
    *,
    chunk_images: int,
    codec: dict[str, Any],
    layout: str = "NHWC",
    labels: list[int] | None = None,
    keys: list[str] | None = None,
    class_names: list[str] | None = None,
    attrs: dict[str, Any] | None = None,
) -> None:
    """Write ``items`` (N, *item_shape) as a store; ``codec`` is a resolved codec record (5.1)."""
    items = np.ascontiguousarray(items)
    n, item_shape, dt = len(items), tuple(items.shape[1:]), items.dtype
    assert dt.fields is None, "this small writer handles plain dtypes (the b2nd string is dtype.str)"
    # -- step 1: the resolved codec
    item_bytes = math.prod(item_shape) * dt.itemsize
    blocksize = codec["block_images"] * item_bytes
    chunksize = chunk_images * item_bytes
    assert chunk_images % codec["block_images"] == 0 and blocksize % codec["typesize"] == 0
    # -- step 2: compress every chunk ourselves, zero-padded to full size; CRC of what we produced
    nchunks = -(-n // chunk_images)
    cparams = {
        "codec": blosc2.Codec(CODEC_IDS[codec["codec"]]),
        "clevel": codec["clevel"],
        "typesize": codec["typesize"],
        "filters": [blosc2.Filter(FILTER_IDS[f]) for f in codec["filters"]] or [blosc2.Filter.NOFILTER],
        "filters_meta": list(codec["filters_meta"]) or [0],
        "blocksize": blocksize,
        "splitmode": blosc2.SplitMode(SPLITMODES[codec["splitmode"]]),
        "nthreads": 1,  # one thread: blocks in order, the same bytes every time
    }
    raw = items.view(np.uint8).reshape(-1).tobytes() if n else b""
    chunks, crcs = [], []
    for i in range(nchunks):
        part = raw[i * chunksize : (i + 1) * chunksize]
        part += bytes(chunksize - len(part))
        c = blosc2.compress2(part, **cparams)
        chunks.append(c)
        crcs.append(zlib.crc32(c))
    # -- step 4: place chunks after the header; special zero chunks take no bytes (A.4)
    data_section, offsets = bytearray(), []
    for c in chunks:
        if len(c) == 32 and (c[31] >> 4) & 7 == 1:
            offsets.append(-(2**63) + (1 << 56))  # bit 63 + special value 1 (zeros)
        else:
            offsets.append(len(data_section))
            data_section += c
    index = blosc2.compress2(np.array(offsets, "<i8").tobytes(), typesize=8) if nchunks else b""
    # -- the record (section 4), sealed (4.3)
    record: dict[str, Any] = {
        "format": "carraystore",
        "format_version": 1,
        "writer_version": "spec_writer",
        "blosc2_version": blosc2.__version__,
        "layout": layout,
        "image_shape": list(item_shape),
        "dtype": dt.str,
        "color_mode": {1: "grayscale", 3: "rgb", 4: "rgba"}[item_shape[-1]] if layout == "NHWC" else "",
        "nimages": n,
        "chunk_images": chunk_images,
        "codec": {"id": "blosc2", **codec},
        "blocksize": blocksize,
        "chunks": [chunk_images, *item_shape],
        "blocks": [codec["block_images"], *item_shape],
        "class_names": class_names,
        "labels": None if labels is None else np.asarray(labels, "<i8").tobytes(),
        "keys": None,
        "crc32": np.asarray(crcs, "<u4").tobytes(),
        "provenance": {"source": "spec_writer"},
        "attrs": attrs or {},
        "skipped": [],
        "columns": {},
    }
    if keys is not None:
        enc = [k.encode() for k in keys]
        record["keys"] = {
            "utf8": b"".join(enc),
            "offsets": np.cumsum([0, *map(len, enc)], dtype="<u8").astype("<u8").tobytes(),
        }
    vl_chunk = blosc2.compress2(seal(record), typesize=1, codec=blosc2.Codec.ZSTD, clevel=5)
    # -- step 3: the header (A.1), metalayers b2nd then carraystore
    b2nd = _b2nd((n, *item_shape), (chunk_images, *item_shape), (codec["block_images"], *item_shape), dt.str)
    fixed = msgpack.packb({"format": "carraystore", "format_version": 1, "meta_crc32": True})
    index_map_len = 3 + (len(_fixstr("b2nd")) + 5) + (len(_fixstr("carraystore")) + 5)
    section_start = 87
    first = section_start + 1 + 3 + index_map_len + 3  # past 93, cd+size, the map, dc+count
    second = first + 5 + len(b2nd)
    section = (
        b"\x93"
        + _i(0xCD, 1 + 3 + index_map_len, 2)
        + b"\xde"
        + (2).to_bytes(2, "big")
        + _fixstr("b2nd")
        + _i(0xD2, first, 4)
        + _fixstr("carraystore")
        + _i(0xD2, second, 4)
        + b"\xdc"
        + (2).to_bytes(2, "big")
        + _bin32(b2nd)
        + _bin32(fixed)
    )
    header_len = section_start + len(section)
    pipeline = bytearray(16)
    if codec["typesize"] == dt.itemsize:  # the frame's filters: the codec's only where typesizes agree
        for slot, (f, m) in enumerate(zip(codec["filters"], codec["filters_meta"], strict=True)):
            pipeline[slot] = FILTER_IDS[f]
            pipeline[8 + slot] = m
    pipeline[6] = CODEC_IDS[codec["codec"]]
    # -- A.3 trailer
    name = _fixstr("carraystore")
    map_len = 3 + len(name) + 5
    content_at = 2 + 1 + 3 + map_len + 3  # from the trailer start: 94 01, 93, cd+size, the map, dc+count
    vl_index = b"\xde" + (1).to_bytes(2, "big") + name + _i(0xD2, content_at, 4)
    vl_section = b"\x93" + _i(0xCD, 3 + map_len, 2) + vl_index + b"\xdc" + (1).to_bytes(2, "big") + _bin32(vl_chunk)
    trailer_len = 2 + len(vl_section) + 5 + 18
    trailer = b"\x94\x01" + vl_section + _i(0xCE, trailer_len, 4) + b"\xd8\x00" + bytes(16)
    assert len(trailer) == trailer_len
    frame_len = header_len + len(data_section) + len(index) + trailer_len
    head = (
        b"\x9e"
        + b"\xa8b2frame\x00"
        + _i(0xD2, header_len, 4)
        + _i(0xCF, frame_len, 8)
        + b"\xa4"
        + bytes([0x12, 0x00, CODEC_IDS[codec["codec"]] | (codec["clevel"] << 4), SPLITMODES[codec["splitmode"]] - 1])
        + _i(0xD3, nchunks * chunksize, 8)
        + _i(0xD3, len(data_section), 8)
        + _i(0xD2, dt.itemsize, 4)
        + _i(0xD2, blocksize, 4)
        + _i(0xD2, chunksize, 4)
        + _i(0xD1, 1, 2)
        + _i(0xD1, 1, 2)
        + b"\xc3"
        + b"\xd8\x06"
        + bytes(pipeline)
    )
    assert len(head) == section_start
    frame = head + section + bytes(data_section) + index + trailer
    assert len(frame) == frame_len
    # -- step 5: publish atomically
    target = Path(path)
    tmp = target.with_name(f".{target.name}.partial-{os.getpid()}-{os.urandom(4).hex()}")
    with open(tmp, "wb") as f:
        f.write(frame)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
