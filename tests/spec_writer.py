"""A store writer written from FORMAT.md alone (no carraystore import), to keep the spec honest.

It follows section 6 step by step and builds the whole frame by hand from appendix A:
``blosc2.compress2`` produces the chunk bytes (the data chunks with the pinned
parameters, the offsets index and the metadata chunk); every other byte is written here.
``write_store`` writes pixel and array stores (format version 1), ``write_encoded_store``
stores of the encoded layout (format version 2, section 10: entries chosen by 10.1 and 10.3,
images encoded and decoded with Pillow). ``tests/format/test_spec.py`` opens the result with
carraystore (and with plain blosc2).
"""

from __future__ import annotations

import io
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
    item_bytes = math.prod(item_shape) * dt.itemsize
    raw = items.view(np.uint8).reshape(-1).tobytes() if n else b""
    chunksize = chunk_images * item_bytes
    payloads = [raw[i * chunksize : (i + 1) * chunksize] for i in range(-(-n // chunk_images))]
    color_mode = COLOR_MODES[item_shape[-1]] if layout == "NHWC" else ""
    record = _record(1, layout, n, item_shape, dt, color_mode, chunk_images, codec, labels, keys, class_names, attrs)
    _write_frame(path, payloads, record, dt, 1)


def write_encoded_store(
    path: str | Path,
    images: list[np.ndarray | bytes],
    image_shape: tuple[int, int, int],
    *,
    chunk_images: int,
    codec: dict[str, Any],
    reencode: str = "png",
    quality: int | None = None,
    labels: list[int] | None = None,
    keys: list[str] | None = None,
    class_names: list[str] | None = None,
    pad_byte: int = 0,
) -> list[bytes]:
    """Write a store of layout "encoded" (format version 2, section 10); return its entries.

    ``images`` are pixels ((H, W, C) uint8) or source files (JPEG/PNG/WebP bytes); each becomes an entry
    by 10.3's rules. ``pad_byte`` fills the chunks after their entries: 10.1 has writers write zeros,
    another value is a test of the readers' rule (they ignore the padding)."""
    h, w, c = image_shape
    hwc = h * w * c
    entries = [_entry(image, image_shape, reencode, quality) for image in images]
    assert all(1 <= len(e) <= hwc for e in entries)
    formats = {_format(e, hwc) for e in entries}
    payloads = [b"".join(entries[i : i + chunk_images]) for i in range(0, len(entries), chunk_images)]
    dt = np.dtype("|u1")
    record = _record(
        2,
        "encoded",
        len(entries),
        image_shape,
        dt,
        COLOR_MODES[c],
        chunk_images,
        codec,
        labels,
        keys,
        class_names,
        None,
    )
    record["encoding"] = {
        "formats": [f for f in ("jpeg", "png", "webp", "raw") if f in formats],
        "reencode": reencode,
        "quality": quality,
        "png_compress_level": 6,
        "jpeg_subsampling": "4:2:0",
        "decoder": "pillow",
        "decoder_min_version": "10.0",
    }
    record["entry_sizes"] = np.array([len(e) for e in entries], "<u4").tobytes()
    _write_frame(path, payloads, record, dt, 2, pad_byte)
    return entries


# -- section 10: entries ---------------------------------------------------------------------------
COLOR_MODES = {1: "grayscale", 3: "rgb", 4: "rgba"}
MAGIC = {"jpeg": b"\xff\xd8\xff", "png": b"\x89PNG\r\n\x1a\n"}


def _format(entry: bytes, hwc: int) -> str:
    """10.2: raw exactly when the entry is H*W*C bytes, else the file format its first bytes say."""
    if len(entry) == hwc:
        return "raw"
    if entry[:4] == b"RIFF" and entry[8:12] == b"WEBP":
        return "webp"
    return next(f for f, magic in MAGIC.items() if entry.startswith(magic))


def _pixels(file: bytes, image_shape: tuple[int, int, int]) -> np.ndarray | None:
    """10.2: the file's pixels as Pillow gives them in the store's mode, or None if not of the store's size."""
    from PIL import Image

    img = Image.open(io.BytesIO(file))
    if img.size != (image_shape[1], image_shape[0]):
        return None
    img.load()
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        img = Image.fromarray((np.asarray(img).astype(np.uint32) >> 8).clip(0, 255).astype(np.uint8), "L")
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[image_shape[2]]
    return np.asarray(img.convert(mode), np.uint8).reshape(image_shape)


def _entry(image: np.ndarray | bytes, image_shape: tuple[int, int, int], reencode: str, quality: int | None) -> bytes:
    """10.1 and 10.3: a source file kept as is when shorter than H*W*C bytes, of the store's size, and no
    quality is asked for; a file of exactly H*W*C bytes never (its pixels go in raw); anything else is
    encoded with ``reencode``, or stored raw when that is not shorter."""
    from PIL import Image

    hwc = math.prod(image_shape)
    if isinstance(image, bytes):
        pixels = _pixels(image, image_shape)
        assert pixels is not None, "a source file of another size needs resizing first"
        if len(image) < hwc and quality is None:
            return image
        if len(image) == hwc:
            return pixels.tobytes()  # the writer's duty of 10.1: never an encoded file of H*W*C bytes
    else:
        pixels = np.ascontiguousarray(image, np.uint8).reshape(image_shape)
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[image_shape[2]]
    img = Image.fromarray(pixels[..., 0] if image_shape[2] == 1 else pixels, mode)
    buf = io.BytesIO()
    if reencode == "png":
        img.save(buf, format="PNG", compress_level=6, optimize=False)
    elif reencode == "jpeg":
        img.save(buf, format="JPEG", quality=quality, subsampling="4:2:0", optimize=False)
    else:
        img.save(
            buf, format="WEBP", **({"lossless": True, "quality": 100} if quality is None else {"quality": quality})
        )
    enc = buf.getvalue()
    return enc if len(enc) < hwc else pixels.tobytes()


# -- sections 4 and 6 to appendix A: the record and the frame ----------------------------------------
def _record(
    version: int,
    layout: str,
    n: int,
    item_shape: tuple[int, ...],
    dt: np.dtype,
    color_mode: str,
    chunk_images: int,
    codec: dict[str, Any],
    labels: list[int] | None,
    keys: list[str] | None,
    class_names: list[str] | None,
    attrs: dict[str, Any] | None,
) -> dict[str, Any]:
    """Section 4.1's record; ``crc32`` is filled in when the chunks are compressed."""
    item_bytes = math.prod(item_shape) * dt.itemsize
    record: dict[str, Any] = {
        "format": "carraystore",
        "format_version": version,
        "writer_version": "spec_writer",
        "blosc2_version": blosc2.__version__,
        "layout": layout,
        "image_shape": list(item_shape),
        "dtype": dt.str,
        "color_mode": color_mode,
        "nimages": n,
        "chunk_images": chunk_images,
        "codec": {"id": "blosc2", **codec},
        "blocksize": codec["block_images"] * item_bytes,
        "chunks": [chunk_images, *item_shape],
        "blocks": [codec["block_images"], *item_shape],
        "class_names": class_names,
        "labels": None if labels is None else np.asarray(labels, "<i8").tobytes(),
        "keys": None,
        "crc32": b"",
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
    return record


def _write_frame(
    path: str | Path, payloads: list[bytes], record: dict[str, Any], dt: np.dtype, version: int, pad_byte: int = 0
) -> None:
    """Section 6, steps 1-5: ``payloads`` are the chunks' bytes before padding."""
    codec, chunk_images = record["codec"], record["chunk_images"]
    item_shape, n = tuple(record["image_shape"]), record["nimages"]
    # -- step 1: the resolved codec
    item_bytes = math.prod(item_shape) * dt.itemsize
    blocksize = codec["block_images"] * item_bytes
    chunksize = chunk_images * item_bytes
    assert chunk_images % codec["block_images"] == 0 and blocksize % codec["typesize"] == 0
    # -- step 2: compress every chunk ourselves, padded to full size; CRC of what we produced
    nchunks = len(payloads)
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
    chunks, crcs = [], []
    for part in payloads:
        c = blosc2.compress2(part + bytes([pad_byte]) * (chunksize - len(part)), **cparams)
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
    record["crc32"] = np.asarray(crcs, "<u4").tobytes()
    vl_chunk = blosc2.compress2(seal(record), typesize=1, codec=blosc2.Codec.ZSTD, clevel=5)
    # -- step 3: the header (A.1), metalayers b2nd then carraystore
    b2nd = _b2nd((n, *item_shape), (chunk_images, *item_shape), (codec["block_images"], *item_shape), dt.str)
    fixed = msgpack.packb({"format": "carraystore", "format_version": version, "meta_crc32": True})
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
