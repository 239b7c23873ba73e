"""A store reader written from FORMAT.md alone (no carraystore import), to keep the spec honest.

It uses numpy, msgpack, zlib and ``blosc2.decompress`` for the bytes of single chunks, and
follows FORMAT.md's words: the frame of appendix A, the metadata record of section 4 (its
checksum, 4.3), the CRC rule and canonical zero chunk of 5.2, the chunk-header check of
5.3 and appendix B, and the encoded layout of section 10 (entries decoded with Pillow).
``read_store(path)`` returns everything a store holds as plain Python
and numpy values; ``tests/format/test_spec.py`` compares it with carraystore.
"""

from __future__ import annotations

import ast
import zlib
from pathlib import Path
from typing import Any

import blosc2
import msgpack
import numpy as np
from numpy.lib.format import descr_to_dtype

CODEC_IDS = {"blosclz": 0, "lz4": 1, "lz4hc": 2, "zlib": 4, "zstd": 5}  # FORMAT.md 5.1
CODEC_FORMATS = {"blosclz": 0, "lz4": 1, "lz4hc": 1, "zlib": 3, "zstd": 4}
FILTER_IDS = {"shuffle": 1, "bitshuffle": 2, "delta": 3, "bytedelta": 35}
SEAL = b"\xaa" + b"meta_crc32" + b"\xce"  # FORMAT.md 4.3


class SpecError(Exception):
    """The file breaks FORMAT.md."""


def _be(b: bytes) -> int:
    return int.from_bytes(b, "big")


def _le(b: bytes) -> int:
    return int.from_bytes(b, "little")


def _bin32_at(data: bytes, pos: int) -> bytes:
    if data[pos] != 0xC6:
        raise SpecError(f"no bin32 marker at {pos}")
    n = _be(data[pos + 1 : pos + 5])
    return data[pos + 5 : pos + 5 + n]


def _named_section(data: bytes, section: Any, base: int) -> dict[str, bytes]:
    """Metalayers (A.1 [13], A.3): names -> content, found through the offsets of the index map."""
    _size, index, _contents = section
    return {(k.decode() if isinstance(k, bytes) else k): _bin32_at(data, base + off) for k, off in index.items()}


def _check_layout(chunk: bytes, max_nbytes: int) -> None:
    """Appendix B.3, before libblosc2 sees untrusted bytes."""
    if len(chunk) < 32:
        raise SpecError("chunk shorter than its header")
    flags, typesize = chunk[2], chunk[3]
    nbytes, blocksize, cbytes = _le(chunk[4:8]), _le(chunk[8:12]), _le(chunk[12:16])
    if cbytes != len(chunk) or nbytes > max_nbytes or chunk[31] & 1:
        raise SpecError("chunk sizes are wrong")
    special = (chunk[31] >> 4) & 7
    if special:
        if len(chunk) != 32 + (typesize if special == 3 else 0):
            raise SpecError("bad special chunk")
        return
    if flags & 0x02:
        if cbytes != 32 + nbytes:
            raise SpecError("bad memcpyed chunk")
        return
    if nbytes == 0:
        return
    nblocks = -(-nbytes // blocksize)
    table_end = 32 + 4 * nblocks
    if table_end > cbytes:
        raise SpecError("block-offset table does not fit")
    for j in range(nblocks):
        pos = _le(chunk[32 + 4 * j : 36 + 4 * j])
        if not table_end <= pos < cbytes:
            raise SpecError("block offset outside the chunk")
        full = j < nblocks - 1 or nbytes % blocksize == 0
        streams = typesize if (full and not flags & 0x10) else 1
        for _ in range(streams):
            if pos + 4 > cbytes:
                raise SpecError("stream outside the chunk")
            s = int.from_bytes(chunk[pos : pos + 4], "little", signed=True)
            pos += 4 + (1 if s < 0 else s)
            if pos > cbytes:
                raise SpecError("stream outside the chunk")


def _decompress(chunk: bytes, max_nbytes: int) -> bytes:
    _check_layout(chunk, max_nbytes)
    return bytes(blosc2.decompress(chunk))


def _refuse_ext(code: int, data: bytes) -> Any:
    raise SpecError(f"msgpack extension type {code}")


def _plain(obj: Any, depth: int = 1) -> None:
    """No timestamps (msgpack-python decodes that extension by itself), nesting <= 64 (section 8)."""
    if isinstance(obj, msgpack.Timestamp):
        raise SpecError("msgpack timestamp")
    if isinstance(obj, (dict, list)):
        if depth > 64:
            raise SpecError("nested too deeply")
        for v in obj.values() if isinstance(obj, dict) else obj:
            _plain(v, depth + 1)


def _dtype(rec: Any) -> np.dtype:
    """Section 4.2: a dtype.str, or a descr as nested lists (padding fields named '')."""
    if isinstance(rec, str):
        return np.dtype(rec)

    def fields(items: list[Any]) -> list[tuple[Any, ...]]:
        out = []
        for item in items:
            typ = item[1] if isinstance(item[1], str) else fields(item[1])
            out.append((item[0], typ, tuple(item[2])) if len(item) == 3 else (item[0], typ))
        return out

    return descr_to_dtype(fields(rec))


def _zero_chunk(codec: dict[str, Any], blocksize: int, nbytes: int, dont_split: bool) -> bytes:
    """The canonical zero chunk of FORMAT.md 5.2."""
    h = bytearray(32)
    h[0], h[1] = 5, 1
    h[2] = (
        0x05
        | (0x08 if "delta" in codec["filters"] else 0)
        | (0x10 if dont_split else 0)
        | (CODEC_FORMATS[codec["codec"]] << 5)
    )
    h[3] = codec["typesize"]
    h[4:8] = nbytes.to_bytes(4, "little")
    h[8:12] = blocksize.to_bytes(4, "little")
    h[12:16] = (32).to_bytes(4, "little")
    for slot, (f, m) in enumerate(zip(codec["filters"], codec["filters_meta"], strict=True)):
        h[16 + slot] = FILTER_IDS[f]
        h[24 + slot] = m
    h[22] = CODEC_IDS[codec["codec"]]
    h[31] = 0x10
    return bytes(h)


def _check_chunk_header(chunk: bytes, codec: dict[str, Any], blocksize: int) -> None:
    """Section 5.3 / 5.1: the pinned parameters in a real chunk's header."""
    flags = chunk[2]
    if chunk[3] != codec["typesize"] or _le(chunk[8:12]) != blocksize:
        raise SpecError("typesize or blocksize differ from the record")
    if flags & 0x02:  # memcpyed: codec, filters and split bit are not checked
        return
    if (flags >> 5) != CODEC_FORMATS[codec["codec"]]:
        raise SpecError("codec format differs")
    slots = [(f, m) for f, m in zip(chunk[16:22], chunk[24:30], strict=True) if f]
    if slots != [(FILTER_IDS[f], m) for f, m in zip(codec["filters"], codec["filters_meta"], strict=True)]:
        raise SpecError("filters differ")
    if codec["splitmode"] in ("never", "always") and bool(flags & 0x10) != (codec["splitmode"] == "never"):
        raise SpecError("split bit differs")


def read_store(path: str | Path) -> dict[str, Any]:
    """Everything in the store at ``path``, read by FORMAT.md's rules; raises SpecError."""
    data = Path(path).read_bytes()
    # -- A.1 header
    if data[0] != 0x9E or data[1:10] != b"\xa8b2frame\x00":
        raise SpecError("not a Blosc2 frame")
    header_len, frame_len = _be(data[11:15]), _be(data[16:24])
    if frame_len != len(data):
        raise SpecError("frame_len differs from the file size")
    codec_byte = data[27]
    nbytes, cbytes = _be(data[30:38]), _be(data[39:47])
    chunksize = _be(data[58:62])
    # raw strings: the flags element is a fixstr whose bytes need not be UTF-8 (appendix A.1)
    header = msgpack.unpackb(data[:header_len], raw=True, strict_map_key=False)
    assert len(header) == 14
    metalayers = _named_section(data, header[13], 0)
    # -- section 3: the fixed metalayer governs the version
    fixed = msgpack.unpackb(metalayers["carraystore"], raw=False, ext_hook=_refuse_ext)
    if fixed.get("format") != "carraystore" or not isinstance(fixed.get("format_version"), int):
        raise SpecError("not a carraystore store")
    if fixed["format_version"] not in (1, 2):
        raise SpecError(f"format version {fixed['format_version']} is not 1 or 2")
    # -- A.2 b2nd
    b2nd = msgpack.unpackb(metalayers["b2nd"], raw=False)
    _version, _ndim, shape, chunks, blocks, _fmt, b2nd_dtype = b2nd
    # -- A.3 trailer
    if data[-23] != 0xCE:
        raise SpecError("no trailer")
    trailer_len = _be(data[-22:-18])
    trailer_start = len(data) - trailer_len
    trailer = msgpack.unpackb(data[trailer_start:], raw=True, strict_map_key=False)
    vlmeta = _named_section(data, trailer[1], trailer_start)
    # -- section 8: cap the record before decompressing it; N (the b2nd shape's first dimension)
    # is bounded by the chunks the frame header counts first, so a damaged N cannot raise the cap
    if not 0 <= shape[0] <= (-(-nbytes // chunksize) if chunksize else 0) * chunks[0]:
        raise SpecError("the array's first dimension does not fit the frame's chunks")
    content = vlmeta["carraystore"]
    raw = _decompress(content, 64 * 2**20 + 16 * 2**10 * shape[0])
    # -- 4.3 the checksum
    sealed = raw[-16:-4] == SEAL
    if sealed and zlib.crc32(raw[:-4]) != _be(raw[-4:]):
        raise SpecError("metadata checksum fails")
    if not sealed and fixed.get("meta_crc32") is True:
        raise SpecError("metadata checksum lost")
    rec = msgpack.unpackb(raw, raw=False, ext_hook=_refuse_ext, timestamp=0)
    _plain(rec)
    rec.pop("meta_crc32", None)
    if rec["format"] != "carraystore" or rec["format_version"] != fixed["format_version"]:
        raise SpecError("record and fixed metalayer disagree")
    # -- section 4
    n = rec["nimages"]
    item_shape = tuple(rec["image_shape"])
    dtype = _dtype(rec["dtype"])
    codec = rec["codec"]
    k = rec["chunk_images"]
    item_bytes = int(np.prod(item_shape, dtype=np.int64)) * dtype.itemsize
    blocksize = codec["block_images"] * item_bytes
    if tuple(shape) != (n, *item_shape) or rec["blocksize"] != blocksize:
        raise SpecError("record and b2nd metalayer disagree")
    if isinstance(rec["dtype"], str) and b2nd_dtype != rec["dtype"]:
        raise SpecError("b2nd dtype differs")
    if isinstance(rec["dtype"], list) and np.dtype(ast.literal_eval(b2nd_dtype)) != dtype:
        raise SpecError("b2nd dtype differs")
    if n and (tuple(chunks) != (k, *item_shape) or tuple(blocks) != (codec["block_images"], *item_shape)):
        raise SpecError("chunk or block shape differs")
    if (codec_byte & 0x0F, codec_byte >> 4) != (CODEC_IDS[codec["codec"]], codec["clevel"]):
        raise SpecError("frame codec byte differs")
    labels = None if rec.get("labels") is None else np.frombuffer(rec["labels"], "<i8")
    class_names = rec.get("class_names")
    if class_names is not None and labels is None:  # 4.4: class names make a store labelled
        if n:
            raise SpecError("class names without labels")
        labels = np.zeros(0, "<i8")  # an empty store: read as an empty bin
    if labels is not None and len(labels):
        top = len(class_names) if class_names is not None else 2**31
        if labels.min() < 0 or labels.max() >= top:
            raise SpecError("labels out of range")
    keys = None
    if rec.get("keys") is not None:
        offs = np.frombuffer(rec["keys"]["offsets"], "<u8")
        blob = rec["keys"]["utf8"]
        keys = [blob[int(offs[i]) : int(offs[i + 1])].decode("utf-8") for i in range(n)]
        for key in keys:
            parts = key.replace("\\", "/").split("/")  # a backslash counts as a separator here (4.5)
            if not key or "\x00" in key or "\n" in key or key[0] in "/\\~" or key[1:2] == ":" or ".." in parts:
                raise SpecError(f"bad key {key!r}")
            if any(part in ("", ".") for part in key.split("/")):  # '/' alone separates here (4.5)
                raise SpecError(f"bad key {key!r}: an empty or '.' component")
    crc = np.frombuffer(rec["crc32"], "<u4")
    # -- A.4 offsets index and the chunks (5.2, 5.3)
    nchunks = -(-nbytes // chunksize) if chunksize else 0
    if nchunks != -(-n // k) or len(crc) != nchunks:
        raise SpecError("chunk count differs")
    items = np.zeros((nchunks * k, *item_shape), dtype=dtype)
    flat = items.view(np.uint8).reshape(-1) if items.size else np.zeros(0, np.uint8)
    if nchunks:
        index = data[header_len + cbytes : trailer_start]
        offsets = np.frombuffer(_decompress(index, 8 * nchunks), "<i8")[:nchunks]
        for i, entry in enumerate(offsets.tolist()):
            chunk_nbytes = k * item_bytes
            if entry < 0:  # bit 63: a special chunk without bytes
                special = ((entry & 0xFFFFFFFFFFFFFFFF) >> 56) & 0x7F
                splits = [codec["splitmode"] == "never"] if codec["splitmode"] in ("never", "always") else [False, True]
                wants = {zlib.crc32(_zero_chunk(codec, blocksize, chunk_nbytes, s)) for s in splits}
                if special != 1 or int(crc[i]) not in wants:
                    raise SpecError(f"special chunk {i} fails its check")
                continue  # zeros: items is zero-filled already
            start = header_len + entry
            size = _le(data[start + 12 : start + 16])
            chunk = data[start : start + size]
            if zlib.crc32(chunk) != int(crc[i]):
                raise SpecError(f"chunk {i} fails its CRC")
            _check_chunk_header(chunk, codec, blocksize)
            out = _decompress(chunk, chunk_nbytes)
            flat[i * chunk_nbytes : (i + 1) * chunk_nbytes] = np.frombuffer(out, np.uint8)
    # -- section 10: the encoded layout (format version 2): entries decoded with Pillow
    layout = "NHWC" if rec.get("layout") is None else rec["layout"]  # 4.1: absent or nil, the default
    color_mode = "" if rec.get("color_mode") is None else rec["color_mode"]
    encoded = layout == "encoded"
    if encoded != (rec["format_version"] == 2):
        raise SpecError("format version 2 is the encoded layout, and only it")
    entries: list[bytes] | None = None
    if encoded:
        sizes = np.frombuffer(rec["entry_sizes"], "<u4").astype(np.int64)
        formats = _encoding_formats(rec["encoding"])
        if len(sizes) != n or (n and (sizes.min() < 1 or sizes.max() > item_bytes)):
            raise SpecError("entry sizes out of range")
        entries = []
        for i in range(nchunks):
            payload = flat[i * k * item_bytes : (i + 1) * k * item_bytes].tobytes()
            pos = 0
            for size in sizes[i * k : (i + 1) * k].tolist():
                entries.append(payload[pos : pos + size])
                pos += size
        decoded = np.zeros((n, *item_shape), dtype=np.uint8)
        for j, entry in enumerate(entries):
            decoded[j] = _decode_entry(entry, item_shape, formats, color_mode)
        items = decoded
    columns = {}
    for name, col in (rec.get("columns") or {}).items():
        if not isinstance(name, str) or not name:  # 4.4a
            raise SpecError(f"field name {name!r} is not a non-empty string")
        columns[name] = np.frombuffer(col["data"], dtype=_dtype(col["dtype"])).reshape((n, *col["shape"]))
    group_names, groups = rec.get("group_names"), None  # 4.6: both or neither
    if (group_names is None) != (rec.get("groups") is None):
        raise SpecError("group_names and groups go together")
    if group_names is not None:
        groups = np.frombuffer(rec["groups"], "<i4")
        if len(groups) != n or len(set(group_names)) != len(group_names) or not all(group_names):
            raise SpecError("groups malformed")
        if n and (groups.min() < 0 or groups.max() >= len(group_names)):
            raise SpecError("group index out of range")
    return {
        "items": items[:n],
        "dtype": dtype,
        "layout": layout,
        "color_mode": color_mode,
        "chunk_images": k,
        "codec": codec,
        "crc32": crc.tolist(),
        "labels": labels,
        "keys": keys,
        "class_names": class_names,
        "attrs": rec.get("attrs") or {},
        "provenance": rec.get("provenance") or {},
        "skipped": rec.get("skipped") or [],
        "columns": columns,
        "group_names": group_names,
        "groups": groups,
        "format_version": rec["format_version"],
        "sealed": sealed,
        "entries": entries,
    }


ENCODING_KEYS = {"formats", "reencode", "quality", "png_compress_level", "jpeg_subsampling", "decoder",
                 "decoder_min_version"}  # fmt: skip


def _encoding_formats(enc: Any) -> list[str]:
    """Section 10.3: the seven keys, no other; each value as its row says. Returns ``formats``."""
    if not isinstance(enc, dict) or set(enc) != ENCODING_KEYS:
        raise SpecError("encoding: not exactly the keys of 10.3")
    formats, quality = enc["formats"], enc["quality"]
    if (
        not isinstance(formats, list)
        or len(set(formats)) != len(formats)
        or not set(formats) <= {"jpeg", "png", "webp", "raw"}
    ):
        raise SpecError(f"encoding: formats {formats!r}")
    if enc["reencode"] not in ("png", "jpeg", "webp"):
        raise SpecError(f"encoding: reencode {enc['reencode']!r}")
    if quality is not None and (type(quality) is not int or not 1 <= quality <= 100):
        raise SpecError(f"encoding: quality {quality!r}")
    if (enc["reencode"] == "jpeg" and quality is None) or (enc["reencode"] == "png" and quality is not None):
        raise SpecError("encoding: quality does not go with reencode")
    if (
        type(enc["png_compress_level"]) is not int
        or enc["png_compress_level"] != 6
        or enc["jpeg_subsampling"] != "4:2:0"
    ):
        raise SpecError("encoding: pinned encoder settings differ")
    if enc["decoder"] != "pillow" or not isinstance(enc["decoder_min_version"], str):
        raise SpecError("encoding: decoder")
    return formats


def _decode_entry(entry: bytes, item_shape: tuple[int, ...], formats: list[str], color_mode: str) -> np.ndarray:
    """Section 10.2: raw pixels (H*W*C bytes) or a JPEG/PNG/WebP of the store's size, converted to its mode."""
    import io

    from PIL import Image

    h, w, c = item_shape
    if len(entry) == h * w * c:
        if "raw" not in formats:
            raise SpecError("a raw entry in a store that lists no raw entries")
        return np.frombuffer(entry, np.uint8).reshape(item_shape)
    magic = {"jpeg": entry[:3] == b"\xff\xd8\xff", "png": entry[:8] == b"\x89PNG\r\n\x1a\n",
             "webp": entry[:4] == b"RIFF" and entry[8:12] == b"WEBP"}  # fmt: skip
    fmt = next((f for f, hit in magic.items() if hit), None)
    if fmt is None or fmt not in formats:
        raise SpecError(f"entry of format {fmt} not among {formats}")
    img = Image.open(io.BytesIO(entry), formats=[fmt.upper()])
    if img.size != (w, h):
        raise SpecError(f"entry of {img.size}, not {(w, h)}")
    img.load()
    if img.mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        img = Image.fromarray((np.asarray(img).astype(np.uint32) >> 8).clip(0, 255).astype(np.uint8), "L")
    mode = {"grayscale": "L", "rgb": "RGB", "rgba": "RGBA"}[color_mode]
    return np.asarray(img.convert(mode), dtype=np.uint8).reshape(item_shape)
