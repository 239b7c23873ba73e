"""The format rules (FORMAT.md) in code: pinned codec record, header checks, versions, safe metadata."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blosc2
import msgpack
import numpy as np
import pytest
from helpers import make_store, raw_record, rewrite_record

import carraystore
from carraystore.base.errors import (
    CodecMismatchError,
    FormatError,
    FormatVersionError,
    InvalidInputError,
    UnknownCodecError,
)
from carraystore.format.codec import PRESETS, Codec, parse_chunk_header
from carraystore.format.record import (
    FORMAT_VERSION,
    MAX_FORMAT_VERSION,
    META_KEY,
    StoreMeta,
    StringTable,
    dtype_from_record,
    dtype_to_record,
    validate_key,
)

# -- Codec: a small frozen value type with a JSON round trip ------------------------------------------

ODD_CODECS = [
    Codec(),
    Codec("lz4hc", 9, filters=("bitshuffle",), typesize=2),
    Codec("zlib", 0),
    Codec("blosclz", 5, filters=("delta", "shuffle"), filters_meta=(0, 0), splitmode="always"),
    Codec(
        "zstd", 9, filters=("shuffle", "bytedelta"), filters_meta=(0, 3), typesize=3, block_images=7, splitmode="auto"
    ),
    Codec("ZSTD", 2, filters=("NOFILTER", "Shuffle")),  # names are case-insensitive, nofilter dropped
    Codec("lz4", 1, typesize=255, block_images=1, splitmode="forward_compat"),
]


@pytest.mark.parametrize("codec", [*PRESETS.values(), *ODD_CODECS], ids=lambda c: c.describe())
def test_codec_config_json_round_trip(codec: Codec) -> None:
    config = json.loads(json.dumps(codec.to_config()))
    again = Codec.from_config(config)
    assert again == codec and hash(again) == hash(codec) and again.to_config() == codec.to_config()
    assert set(config) == {"id"} | {f.name for f in dataclasses.fields(Codec)}
    with pytest.raises(dataclasses.FrozenInstanceError):
        codec.clevel = 3  # type: ignore[misc]


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize(
    "dtype,shape,layout",
    [
        ("uint8", (32, 32, 3), "NHWC"),
        ("uint8", (32, 32, 1), "NHWC"),
        ("uint16", (16, 16, 4), "NHWC"),
        ("float32", (8, 8, 3), "NHWC"),
        ("<i8", (), "array"),
        ("<f8", (5, 3), "array"),
    ],
)
def test_resolved_presets_are_fully_pinned_and_round_trip(
    name: str, dtype: str, shape: tuple[int, ...], layout: str
) -> None:
    codec = Codec.preset(name).resolve(np.dtype(dtype), shape, layout)
    assert codec.typesize is not None and codec.block_images is not None
    assert Codec.from_config(json.loads(json.dumps(codec.to_config()))) == codec
    if codec.typesize == 1:  # blosc2 drops BYTEDELTA and SHUFFLE is the identity on 1-byte items
        assert "bytedelta" not in codec.filters and "shuffle" not in codec.filters
    if "bytedelta" in codec.filters:
        assert codec.filters_meta[codec.filters.index("bytedelta")] == codec.typesize


def test_the_default_codec_is_the_balanced_preset(tmp_path: Path) -> None:
    assert Codec() == PRESETS["balanced"] and (Codec().codec, Codec().clevel) == ("zstd", 1)
    gray = Codec().resolve(np.dtype("uint8"), (64, 64, 1))
    assert "shuffle" not in gray.filters and "bytedelta" not in gray.filters  # never on 1-byte items
    with carraystore.create(tmp_path / "d.b2nd", (8, 8, 3)) as w:
        w.append(np.zeros((1, 8, 8, 3), np.uint8))
    used = carraystore.open(tmp_path / "d.b2nd").codec
    want = PRESETS["balanced"].resolve(np.dtype("uint8"), (8, 8, 3))
    assert (used.codec, used.clevel, used.filters, used.filters_meta, used.typesize) == (
        want.codec,
        want.clevel,
        want.filters,
        want.filters_meta,
        want.typesize,
    )


@pytest.mark.parametrize(
    "make,names",
    [
        (lambda: Codec("snappy"), ["snappy"]),
        (lambda: Codec(filters=("shuffle", "fancyfilter")), ["fancyfilter"]),
        (lambda: Codec(splitmode="sometimes"), ["sometimes"]),
        (lambda: Codec.from_config({"id": "blosc2", "codec": "brotli"}), ["brotli"]),
        (lambda: Codec.from_config({"id": "gzip"}), ["gzip"]),
        (lambda: Codec.from_config({"codec": "zstd", "filters": ["trunc"]}), ["trunc"]),
    ],
)
def test_unknown_codec_names_are_named(make: Callable[[], Codec], names: list[str]) -> None:
    with pytest.raises(UnknownCodecError) as info:
        make()
    for name in names:
        assert repr(name) in str(info.value)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(clevel=10), "clevel"),
        (dict(clevel=1.5), "clevel"),
        (dict(filters=("shuffle", "delta"), filters_meta=(0,)), "filters_meta"),
        (dict(filters=("shuffle",) * 7), "at most 6"),
        (dict(typesize=0), "typesize"),
        (dict(typesize=256), "typesize"),
        (dict(block_images=0), "block_images"),
    ],
)
def test_invalid_codec_parameters(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(InvalidInputError, match=match):
        Codec(**kwargs)


def test_codec_config_errors() -> None:
    with pytest.raises(FormatError, match="unknown keys"):
        Codec.from_config({"codec": "zstd", "level": 3})
    with pytest.raises(FormatError, match="mapping"):
        Codec.from_config(["zstd", 1])  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="preset"):
        Codec.preset("smallest")
    with pytest.raises(InvalidInputError, match="resolve"):
        Codec().cparams(1024)


def test_parse_chunk_header_reads_what_blosc2_wrote(photo_patches: Callable[..., np.ndarray]) -> None:
    pixels = photo_patches(20, (16, 16))
    codec = Codec("zstd", 3, filters=("shuffle", "bytedelta")).resolve(pixels.dtype, pixels.shape[1:])
    data = blosc2.compress2(pixels, **codec.cparams(blocksize=4 * pixels[0].nbytes))
    h = parse_chunk_header(data)
    assert (h.nbytes, h.blocksize, h.cbytes, h.typesize) == (pixels.nbytes, 4 * pixels[0].nbytes, len(data), 3)
    assert (h.filters, h.filters_meta, h.dont_split, h.memcpyed) == (("shuffle", "bytedelta"), (0, 3), True, False)
    lz4 = parse_chunk_header(
        blosc2.compress2(pixels, **Codec("lz4", 1, filters=()).resolve(pixels.dtype, pixels.shape[1:]).cparams(3072))
    )
    assert lz4.codec_format != h.codec_format and lz4.filters == ()
    with pytest.raises(FormatError, match="too short"):
        parse_chunk_header(data[:20])


# -- keys, string tables and dtype records --------------------------------------------------------------


def test_validate_key() -> None:
    assert validate_key("cat/001.jpg") == "cat/001.jpg"
    # a backslash is part of a name on POSIX, a separator on Windows
    assert validate_key("cat\\001.jpg") == ("cat/001.jpg" if os.sep == "\\" else "cat\\001.jpg")
    assert validate_key("id-123") == "id-123"
    assert validate_key("a/..b/c..") == "a/..b/c.."  # dots inside names are fine
    for bad in [
        "/abs.jpg",
        "C:\\x.jpg",
        "d:/x",
        "~user/x",
        "..",
        "a/../../b",
        "",
        "a\nb",
        "a\x00b",
        "..\\x",
        "a\\..\\..\\b",
        "\\\\server\\share",
        "bad\udcff.jpg",
    ]:
        with pytest.raises(InvalidInputError, match="key"):
            validate_key(bad)


def test_string_table_round_trip_and_validation() -> None:
    words = ["cat/001.jpg", "", "日本/ü.png", "x" * 300]
    table = StringTable.from_strings(words)
    assert list(table) == words and len(table) == 4 and table[-1] == words[-1] and table[1:3] == words[1:3]
    with pytest.raises(IndexError):
        table[4]
    rec = table.to_record()
    again = StringTable.from_record(msgpack.unpackb(msgpack.packb(rec, use_bin_type=True)), 4, "keys")
    assert again == table and again == words
    both = table.concat(StringTable.from_strings(["z"]))
    assert list(both) == [*words, "z"]
    offsets = np.frombuffer(rec["offsets"], dtype="<u8")
    for bad in (offsets[::-1].copy(), offsets + 1, offsets[:-1]):
        with pytest.raises(FormatError, match="offsets"):
            StringTable.from_record({"utf8": rec["utf8"], "offsets": bad.astype("<u8").tobytes()}, 4, "keys")
    with pytest.raises(FormatError):
        StringTable.from_record({"utf8": rec["utf8"]}, 4, "keys")


DTYPES = [
    np.dtype("uint8"),
    np.dtype(">i4"),
    np.dtype("<M8[ns]"),
    np.dtype("<m8[s]"),
    np.dtype("S7"),
    np.dtype("<U3"),
    np.dtype("<c16"),
    np.dtype("V12"),
    np.dtype([("a", "<i2"), ("b", ">f8", (2, 3)), ("c", [("x", "u1"), ("y", "S2")])]),
    np.dtype({"names": ["a", "b"], "formats": ["<i2", "<f4"], "offsets": [0, 8], "itemsize": 16}),
]


@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_dtype_records_are_exact_and_json(dt: np.dtype) -> None:
    rec = json.loads(json.dumps(dtype_to_record(dt)))
    again = dtype_from_record(rec)
    assert again == dt and again.itemsize == dt.itemsize
    if dt.fields:
        assert {k: v[1] for k, v in again.fields.items()} == {k: v[1] for k, v in dt.fields.items()}  # offsets


def test_dtype_records_refuse_objects() -> None:
    with pytest.raises(InvalidInputError, match="objects"):
        dtype_to_record(np.dtype([("a", "O")]))
    with pytest.raises(FormatError):
        dtype_from_record("|O")
    with pytest.raises(FormatError):
        dtype_from_record([["a", "|O"]])
    with pytest.raises(FormatError):
        dtype_from_record([["a"]])
    with pytest.raises(FormatError):
        dtype_from_record("not-a-dtype")


# -- the record inside a file ------------------------------------------------------------------------------


@pytest.fixture()
def store_path(tmp_path: Path, photo_patches: Callable[..., np.ndarray]) -> Path:
    images, keys = photo_patches(40, (16, 16)), [f"a/{i}.jpg" for i in range(40)]
    kw: dict[str, Any] = {"codec": "small", "chunk_images": 16, "class_names": ["a", "b"], "attrs": {"who": "tests"}}
    return make_store(tmp_path / "s.b2nd", images, np.arange(40) % 2, keys, **kw)


def test_every_codec_parameter_is_recorded(store_path: Path) -> None:
    rec = msgpack.unpackb(raw_record(store_path), raw=False)  # read with plain blosc2 + msgpack
    store = carraystore.open(store_path)
    assert rec["format"] == "carraystore" and rec["format_version"] == FORMAT_VERSION
    assert rec["writer_version"] == carraystore.__version__ and rec["blosc2_version"] == blosc2.__version__
    codec = rec["codec"]
    assert set(codec) == {"id", "codec", "clevel", "filters", "filters_meta", "typesize", "block_images", "splitmode"}
    assert Codec.from_config(codec) == store.codec
    assert codec == {
        "id": "blosc2",
        "codec": "zstd",
        "clevel": 5,
        "filters": ["shuffle", "bytedelta"],
        "filters_meta": [0, 3],
        "typesize": 3,
        "block_images": store.codec.block_images,
        "splitmode": "never",
    }
    assert rec["chunks"] == [16, 16, 16, 3] and rec["blocks"] == [store.codec.block_images, 16, 16, 3]
    assert rec["blocksize"] == store.codec.block_images * 16 * 16 * 3
    array = blosc2.open(str(store_path), mode="r")  # and the file's own geometry agrees
    assert tuple(array.chunks) == (16, 16, 16, 3) and tuple(array.blocks) == tuple(rec["blocks"])
    assert array.schunk.meta[META_KEY] == {
        "format": "carraystore",
        "format_version": FORMAT_VERSION,
        "meta_crc32": True,
    }
    for i in range(store.nchunks):
        h = parse_chunk_header(store.read_chunk_bytes(i))
        assert (h.typesize, h.blocksize, h.filters, h.filters_meta) == (
            3,
            rec["blocksize"],
            ("shuffle", "bytedelta"),
            (0, 3),
        )
    crc = np.frombuffer(rec["crc32"], dtype="<u4")
    assert len(crc) == store.nchunks and np.array_equal(crc, store.meta.crc32)
    json.dumps(rec["attrs"]) and json.dumps(rec["provenance"])  # noqa: B015 - JSON-able


def test_a_chunk_written_with_other_parameters_is_a_codec_mismatch(store_path: Path, tmp_path: Path) -> None:
    store = carraystore.open(store_path)
    pixels = store.read_chunk(0)
    other = Codec("lz4", 1, filters=()).resolve(np.dtype("uint8"), (16, 16, 3))
    data = blosc2.compress2(
        np.ascontiguousarray(pixels), **dataclasses.replace(other, typesize=1).cparams(store.meta.blocksize)
    )
    bad = tmp_path / "bad.b2nd"
    shutil.copy(store_path, bad)
    array = blosc2.open(str(bad), mode="a")
    array.schunk.update_chunk(0, data)
    del array
    with pytest.raises(CodecMismatchError) as info:
        carraystore.open(bad)
    msg = str(info.value)
    assert "bad.b2nd" in msg and "chunk 0" in msg
    assert "'lz4/lz4hc'" in msg and "'zstd' recorded" in msg
    assert "typesize 1 in the file, 3 recorded" in msg
    assert "filters [] meta [] in the file, ['shuffle', 'bytedelta'] meta [0, 3] recorded" in msg


def test_a_later_chunk_with_other_parameters_is_reported_by_verify(store_path: Path, tmp_path: Path) -> None:
    """Another writer put chunk 1 with other parameters and updated the checksum: verify names it."""
    store = carraystore.open(store_path)
    pixels = np.ascontiguousarray(store.read_chunk(1))
    data = blosc2.compress2(
        pixels, **dataclasses.replace(store.codec, clevel=1, filters=(), filters_meta=()).cparams(store.meta.blocksize)
    )
    bad = tmp_path / "bad.b2nd"
    shutil.copy(store_path, bad)
    array = blosc2.open(str(bad), mode="a")
    array.schunk.update_chunk(1, data)
    del array

    def fix_crc(rec: dict[str, Any]) -> None:
        crc = np.frombuffer(rec["crc32"], dtype="<u4").copy()
        crc[1] = carraystore.format.codec.crc32(data)
        rec["crc32"] = crc.tobytes()

    fixed = rewrite_record(bad, fix_crc, tmp_path / "fixed.b2nd")
    problems = carraystore.open(fixed).verify()
    assert [p.chunk for p in problems] == [1]
    assert "filters [] meta [] in the file, ['shuffle', 'bytedelta'] meta [0, 3] recorded" in problems[0].reason


@pytest.mark.parametrize(
    "mutate,error,needles",
    [
        (lambda r: r["codec"].update(codec="lz4"), CodecMismatchError, ["ZSTD", "'lz4' recorded"]),
        (lambda r: r["codec"].update(clevel=9), CodecMismatchError, ["clevel 5 in the file header, 9 recorded"]),
        (
            lambda r: r["codec"].update(filters=["bitshuffle"], filters_meta=[0]),
            CodecMismatchError,
            ["['bitshuffle'] meta [0] recorded"],
        ),
        (
            lambda r: r["codec"].update(typesize=1, filters=[], filters_meta=[]),
            CodecMismatchError,
            ["typesize 3 in the file, 1 recorded"],
        ),
        (lambda r: r["codec"].update(codec="snappy"), UnknownCodecError, ["'snappy'"]),
        (lambda r: r["codec"].update(filters=["shuffle", "zfp"]), UnknownCodecError, ["'zfp'"]),
        (
            lambda r: r.update(format_version=MAX_FORMAT_VERSION + 1),
            FormatVersionError,
            [
                f"version {MAX_FORMAT_VERSION + 1} is newer",
                f"(format versions {FORMAT_VERSION} and {MAX_FORMAT_VERSION})",
            ],
        ),
        (lambda r: r.update(format_version=0), FormatVersionError, ["version 0 is older", "carraystore migrate"]),
        (lambda r: r.update(format_version="1"), FormatError, ["format_version"]),
        (lambda r: r.update(format="zarr"), FormatError, ["not a carraystore record"]),
        (lambda r: r.update(nimages=41), Exception, ["41"]),
        (lambda r: r.update(labels=np.zeros(39, "<i8").tobytes()), FormatError, ["39 labels for 40"]),
        (lambda r: r.update(labels=(np.arange(40) % 3).astype("<i8").tobytes()), FormatError, ["class names"]),
        (lambda r: r.update(crc32=b"\x00" * 8), FormatError, ["2 checksums recorded for 3 chunks"]),
        (lambda r: r.update(dtype="|O"), FormatError, ["'|O'"]),
        (lambda r: r.pop("chunk_images"), FormatError, ["chunk_images"]),
        (lambda r: r.update(blocksize=12), FormatError, ["blocksize 12"]),
        (lambda r: r["attrs"].update(evil=msgpack.ExtType(1, b"cos\nsystem\n")), FormatError, ["extension type 1"]),
    ],
    ids=[
        "codec",
        "clevel",
        "filters",
        "typesize",
        "unknown-codec",
        "unknown-filter",
        "newer-version",
        "older-version",
        "version-type",
        "not-carraystore",
        "nimages",
        "labels-count",
        "labels-range",
        "crc-count",
        "object-dtype",
        "missing-field",
        "blocksize",
        "ext-type",
    ],
)
def test_an_edited_record_is_refused_with_a_clear_error(
    mutate: Callable[[dict[str, Any]], Any],
    error: type[Exception],
    needles: list[str],
    store_path: Path,
    tmp_path: Path,
) -> None:
    bad = rewrite_record(store_path, mutate, tmp_path / "edited.b2nd")
    with pytest.raises(error) as info:
        carraystore.open(bad)
    assert isinstance(info.value, carraystore.CarrayStoreError)
    msg = str(info.value)
    assert "edited.b2nd" in msg
    for needle in needles:
        assert needle in msg, msg
    assert carraystore.open(store_path).verify() == []  # the original is untouched


def test_metadata_bytes_are_plain_msgpack_only() -> None:
    meta = StoreMeta(
        image_shape=(2, 2, 3),
        dtype="|u1",
        codec=Codec(block_images=2).resolve(np.dtype("u1"), (2, 2, 3)),
        chunk_images=4,
        color_mode="rgb",
    )
    again = StoreMeta.from_bytes(meta.to_bytes(), "x")
    assert again.to_record() == meta.to_record()
    rec = meta.to_record()
    rec["provenance"] = {"x": msgpack.ExtType(42, b"\x80\x04payload")}
    with pytest.raises(FormatError, match="extension type 42"):
        StoreMeta.from_bytes(msgpack.packb(rec, use_bin_type=True), "x")
    with pytest.raises(FormatError, match="not valid msgpack"):
        StoreMeta.from_bytes(b"\xc1\xc1", "x")
    with pytest.raises(FormatError, match="not a carraystore record"):
        StoreMeta.from_bytes(msgpack.packb([1, 2]), "x")
    with pytest.raises(FormatVersionError, match=r"version 7 is newer.*format versions 1 and 2"):
        rec = meta.to_record()
        rec["format_version"] = 7
        StoreMeta.from_bytes(msgpack.packb(rec, use_bin_type=True), "x")
