"""FORMAT.md is enough to read and write stores: a reader and a writer written from it alone.

``spec_reader.py`` (no carraystore import) must read every golden store and every store
carraystore writes exactly as carraystore does; ``spec_writer.py`` (no carraystore import,
the frame built by hand) must write stores carraystore opens, verifies and appends to,
and that plain blosc2 reads.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import blosc2
import msgpack
import numpy as np
import pytest
import spec_reader
import spec_writer
from helpers import image_bytes

import carraystore
from carraystore.format import codec as cdc
from carraystore.format import record as fmt

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden"
GOLDEN_STORES = sorted(GOLDEN.glob("*/*.b2nd"))


def _assert_same(spec: dict[str, Any], store: carraystore.Store) -> None:
    assert spec["items"].dtype == store.dtype and spec["items"].shape == store.shape
    assert spec["items"].tobytes() == store[:].tobytes()
    assert spec["layout"] == store.layout and spec["color_mode"] == store.color_mode
    assert spec["chunk_images"] == store.chunk_images
    assert cdc.Codec.from_config(spec["codec"]) == store.codec
    assert spec["crc32"] == [int(c) for c in store.meta.crc32]
    assert (None if spec["labels"] is None else spec["labels"].tolist()) == (
        None if store.labels is None else store.labels.tolist()
    )
    assert spec["keys"] == (None if store.keys is None else list(store.keys))
    assert spec["class_names"] == (None if store.class_names is None else list(store.class_names))
    assert spec["attrs"] == store.attrs and spec["provenance"] == store.provenance
    assert spec["skipped"] == [dict(s) for s in store.skipped]
    assert set(spec["columns"]) == set(store.columns)
    for name, col in spec["columns"].items():
        assert col.dtype == store.columns[name].dtype and col.tobytes() == store.columns[name].tobytes()


def test_the_spec_tables_are_the_codes_tables() -> None:
    assert spec_reader.CODEC_IDS == spec_writer.CODEC_IDS == cdc.CODECS
    assert spec_reader.CODEC_FORMATS == cdc._CODEC_FORMAT
    assert spec_reader.FILTER_IDS == spec_writer.FILTER_IDS == {k: v for k, v in cdc.FILTERS.items() if v}
    assert spec_writer.SPLITMODES == cdc.SPLITMODES
    for name, ident in cdc.CODECS.items():
        assert blosc2.Codec[name.upper()].value == ident
    for name, ident in cdc.FILTERS.items():
        assert blosc2.Filter[name.upper()].value == ident
    text = (Path(__file__).resolve().parents[2] / "FORMAT.md").read_text(encoding="utf-8")
    for name, ident in cdc.CODECS.items():
        assert f"| `{name}` | {ident} | {cdc._CODEC_FORMAT[name]}" in text
    for name, ident in cdc.FILTERS.items():
        if ident:
            assert f"| `{name}` | {ident} |" in text


@pytest.mark.parametrize("path", GOLDEN_STORES, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_spec_reader_reads_every_golden_store(path: Path) -> None:
    assert GOLDEN_STORES
    _assert_same(spec_reader.read_store(path), carraystore.open(path))


def _carraystore_store(tmp_path: Path) -> tuple[Path, np.ndarray]:
    rng = np.random.default_rng(3)
    images = rng.integers(0, 256, (21, 8, 8, 3), dtype=np.uint8)
    images[:4] = 0  # chunk 0 is a special zero chunk: the frame holds no bytes for it
    path = tmp_path / "cs.b2nd"
    with carraystore.create(
        path, (8, 8, 3), chunk_images=4, class_names=["a", "b", "c"], attrs={"nested": {"list": [1, 2.5, "ü"]}}
    ) as w:
        w.append(images[:13], labels=np.arange(13) % 3, keys=[f"x/{i}.png" for i in range(13)])
        w.add_skipped("x/bad.png", "truncated")
    with carraystore.append(path) as w:  # an append rewrites the partial last chunk and the record
        w.append(images[13:], labels=np.arange(13, 21) % 3, keys=[f"y/{i}.png" for i in range(13, 21)])
    return path, images


def test_spec_reader_reads_a_sealed_store_with_a_special_chunk_0(tmp_path: Path) -> None:
    path, images = _carraystore_store(tmp_path)
    store = carraystore.open(path)
    assert store._frame.chunk_special.tolist()[0] == 1
    spec = spec_reader.read_store(path)
    assert spec["sealed"] and np.array_equal(spec["items"], images)
    _assert_same(spec, store)


def test_spec_reader_refuses_what_carraystore_refuses(tmp_path: Path) -> None:
    path, _ = _carraystore_store(tmp_path)
    array = blosc2.open(str(path), mode="a")
    raw = bytes(array.schunk.vlmeta.get_vlmeta("carraystore"))
    at = raw.index(b"y/20.png")
    array.schunk.vlmeta.set_vlmeta("carraystore", raw[:at] + b"y/21" + raw[at + 4 :], typesize=1)
    del array
    with pytest.raises(spec_reader.SpecError, match="checksum"):
        spec_reader.read_store(path)
    with pytest.raises(carraystore.base.errors.MetadataChecksumError):
        carraystore.open(path)


CODECS = [
    {
        "codec": "zstd",
        "clevel": 1,
        "filters": ["shuffle", "bytedelta"],
        "filters_meta": [0, 3],
        "typesize": 3,
        "block_images": 2,
        "splitmode": "never",
    },
    {
        "codec": "lz4",
        "clevel": 1,
        "filters": [],
        "filters_meta": [],
        "typesize": 3,
        "block_images": 4,
        "splitmode": "never",
    },
    {
        "codec": "lz4hc",
        "clevel": 9,
        "filters": ["bitshuffle"],
        "filters_meta": [0],
        "typesize": 3,
        "block_images": 1,
        "splitmode": "always",
    },
    {
        "codec": "zlib",
        "clevel": 3,
        "filters": ["delta"],
        "filters_meta": [0],
        "typesize": 3,
        "block_images": 2,
        "splitmode": "never",
    },
    {
        "codec": "blosclz",
        "clevel": 5,
        "filters": ["shuffle"],
        "filters_meta": [0],
        "typesize": 3,
        "block_images": 4,
        "splitmode": "always",
    },
]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c['codec']}-{'+'.join(c['filters']) or 'nofilter'}")
def test_spec_writer_store_is_opened_verified_and_appended_to_by_carraystore(
    tmp_path: Path, codec: dict[str, Any]
) -> None:
    rng = np.random.default_rng(7)
    images = rng.integers(0, 64, (10, 8, 8, 3), dtype=np.uint8)
    images[:4] = 0  # special chunk 0: the chunk-0 header check must skip it
    path = tmp_path / "sw.b2nd"
    keys = [f"d/{i:02d}.png" for i in range(10)]
    spec_writer.write_store(
        path,
        images,
        chunk_images=4,
        codec=codec,
        labels=[i % 2 for i in range(10)],
        keys=keys,
        class_names=["p", "q"],
        attrs={"by": "spec"},
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    store = carraystore.open(path)
    assert store.verify() == []
    assert (
        np.array_equal(store[:], images)
        and list(store.keys) == keys
        and store.labels.tolist() == [i % 2 for i in range(10)]
    )
    assert store.class_names == ("p", "q") and store.attrs == {"by": "spec"}
    assert store.codec == cdc.Codec.from_config({"id": "blosc2", **codec})
    assert store._frame.chunk_special.tolist() == [1, 0, 0]
    plain = blosc2.open(str(path))  # c-blosc2 itself accepts the hand-built frame
    assert np.array_equal(plain[:], images)
    del plain
    more = rng.integers(0, 64, (5, 8, 8, 3), dtype=np.uint8)
    with carraystore.append(path) as w:
        w.append(more, labels=[1] * 5, keys=[f"e/{i}.png" for i in range(5)])
    grown = carraystore.open(path)
    assert grown.verify() == [] and np.array_equal(grown[:], np.concatenate([images, more]))
    _assert_same(spec_reader.read_store(path), grown)


@pytest.mark.parametrize(
    ("items", "codec", "layout"),
    [
        (
            np.arange(7 * 4 * 4, dtype="<u2").reshape(7, 4, 4, 1) * 300,
            {
                "codec": "zstd",
                "clevel": 1,
                "filters": ["shuffle", "bytedelta"],
                "filters_meta": [0, 2],
                "typesize": 2,
                "block_images": 3,
                "splitmode": "never",
            },
            "NHWC",
        ),
        (
            np.linspace(0, 1, 5 * 4 * 4 * 4, dtype="<f4").reshape(5, 4, 4, 4),
            {
                "codec": "zstd",
                "clevel": 1,
                "filters": ["shuffle"],
                "filters_meta": [0],
                "typesize": 16,
                "block_images": 2,
                "splitmode": "never",
            },
            "NHWC",
        ),
        (
            np.arange(9 * 3, dtype="<f8").reshape(9, 3) / 7,
            {
                "codec": "zstd",
                "clevel": 1,
                "filters": [],
                "filters_meta": [],
                "typesize": 8,
                "block_images": 4,
                "splitmode": "never",
            },
            "array",
        ),
    ],
    ids=["uint16-gray", "float32-rgba", "array-f8"],
)
def test_spec_writer_other_dtypes(tmp_path: Path, items: np.ndarray, codec: dict[str, Any], layout: str) -> None:
    path = tmp_path / "d.b2nd"
    spec_writer.write_store(path, items, chunk_images=codec["block_images"] * 2, codec=codec, layout=layout)
    store = carraystore.open(path)
    assert store.verify() == [] and store.layout == layout
    assert store.dtype == items.dtype and np.array_equal(store[:], items)
    _assert_same(spec_reader.read_store(path), store)


def test_spec_writer_seal_is_carraystores_seal() -> None:
    rec = {"format": "carraystore", "format_version": 1, "attrs": {"a": [1, 2]}, "labels": b"\x00" * 8}
    assert spec_writer.seal(rec) == fmt.seal_record(rec)
    assert msgpack.unpackb(fmt.seal_record(rec), raw=False)["meta_crc32"] == int.from_bytes(
        fmt.seal_record(rec)[-4:], "big"
    )


def test_spec_reader_leaves_golden_files_untouched(tmp_path: Path) -> None:
    for path in GOLDEN_STORES:
        before = path.read_bytes()
        spec_reader.read_store(path)
        assert path.read_bytes() == before
    copy = tmp_path / "g.b2nd"
    shutil.copy(GOLDEN_STORES[0], copy)
    assert spec_reader.read_store(copy)["sealed"] is False  # 0.1.0 stores carry no checksum


@pytest.mark.parametrize("splitmode", ["never", "always"])
@pytest.mark.parametrize("codec", ["blosclz", "lz4", "lz4hc", "zlib", "zstd"])
@pytest.mark.parametrize(
    "filters", [(), ("shuffle",), ("bitshuffle",), ("delta",), ("shuffle", "bytedelta"), ("delta", "shuffle")]
)
def test_the_canonical_zero_chunk_is_what_blosc2_produces(codec: str, filters: tuple[str, ...], splitmode: str) -> None:
    """FORMAT.md 5.2's table, byte for byte, against the compressor."""
    resolved = cdc.Codec(codec, 5, filters=filters, splitmode=splitmode).resolve(np.dtype(np.uint8), (4, 4, 3))
    blocksize = resolved.block_images * 48
    zeros = np.zeros((resolved.block_images * 2, 4, 4, 3), np.uint8)
    produced = blosc2.compress2(zeros, **resolved.cparams(blocksize))
    assert produced == cdc.zero_chunk(resolved, blocksize, zeros.nbytes)
    assert cdc.chunk_crc(produced, resolved, blocksize) == cdc.crc32(produced)
    spec = {
        "codec": codec,
        "filters": list(resolved.filters),
        "filters_meta": list(resolved.filters_meta),
        "typesize": 3,
    }
    assert spec_reader._zero_chunk(spec, blocksize, zeros.nbytes, splitmode == "never") == produced


def test_items_of_256_bytes_or_more_have_typesize_1(tmp_path: Path) -> None:
    """FORMAT.md 5.1: the one-byte header field cannot hold the itemsize; 1 is written and checked."""
    dt = np.dtype([("a", "<f8", (40,))])  # 320-byte records
    items = np.zeros(6, dtype=dt)
    items["a"] = np.arange(6 * 40).reshape(6, 40)
    path = tmp_path / "wide.b2nd"
    with carraystore.create(path, (), dtype=dt, layout="array", chunk_images=4) as w:
        w.append(items)
    store = carraystore.open(path)
    assert store.codec.typesize == 1 and store.codec.filters == ()
    assert cdc.parse_chunk_header(store.read_chunk_bytes(0)).typesize == 1
    assert store._frame.typesize == 320  # the frame header keeps the itemsize (int32)
    assert store.verify() == [] and store[:].tobytes() == items.tobytes()
    assert spec_reader.read_store(path)["items"].tobytes() == items.tobytes()


def test_spec_writer_empty_store_then_appended(tmp_path: Path) -> None:
    """N = 0: no chunks and no offsets index (FORMAT.md A.4); carraystore opens and grows it."""
    path = tmp_path / "empty.b2nd"
    codec = {
        "codec": "zstd",
        "clevel": 1,
        "filters": [],
        "filters_meta": [],
        "typesize": 3,
        "block_images": 2,
        "splitmode": "never",
    }
    spec_writer.write_store(path, np.zeros((0, 8, 8, 3), np.uint8), chunk_images=4, codec=codec)
    store = carraystore.open(path)
    assert len(store) == 0 and store.nchunks == 0 and store.verify() == []
    with carraystore.append(path) as w:
        w.append(np.full((5, 8, 8, 3), 7, np.uint8))
    grown = carraystore.open(path)
    assert grown.verify() == [] and np.array_equal(grown[:], np.full((5, 8, 8, 3), 7, np.uint8))
    _assert_same(spec_reader.read_store(path), grown)


def test_spec_writer_header_matches_what_blosc2_writes(tmp_path: Path) -> None:
    """Appendix A.1 byte for byte: the hand-built header equals python-blosc2's but for the
    frame length (the metadata chunk compresses differently) and the decompression threads."""
    rng = np.random.default_rng(11)
    images = rng.integers(0, 256, (10, 8, 8, 3), dtype=np.uint8)
    codec = {
        "codec": "zstd",
        "clevel": 1,
        "filters": ["shuffle", "bytedelta"],
        "filters_meta": [0, 3],
        "typesize": 3,
        "block_images": 2,
        "splitmode": "never",
    }
    spec_writer.write_store(tmp_path / "s.b2nd", images, chunk_images=4, codec=codec)
    with carraystore.create(
        tmp_path / "c.b2nd",
        (8, 8, 3),
        chunk_images=4,
        nthreads=1,  # blocks in order
        codec=cdc.Codec.from_config({"id": "blosc2", **codec}),
    ) as w:
        w.append(images)
    ours, theirs = (tmp_path / "s.b2nd").read_bytes(), (tmp_path / "c.b2nd").read_bytes()
    header_len = int.from_bytes(ours[11:15], "big")
    assert header_len == int.from_bytes(theirs[11:15], "big")
    masked = [(16, 24), (66, 68)]  # frame_len, decompression threads
    a, b = bytearray(ours[:header_len]), bytearray(theirs[:header_len])
    for lo, hi in masked:
        a[lo:hi] = b[lo:hi] = bytes(hi - lo)
    assert a == b
    cbytes = int.from_bytes(ours[39:47], "big")
    assert ours[header_len : header_len + cbytes] == theirs[header_len : header_len + cbytes]  # the same chunks


def test_spec_writer_encoded_store_is_opened_verified_and_appended_to_by_carraystore(tmp_path: Path) -> None:
    """Format version 2 by hand (section 10): kept files, re-encoded pixels, raw noise; then a carraystore append."""
    rng = np.random.default_rng(5)
    y, x = np.mgrid[0:16, 0:16]
    smooth = [np.stack([x * 16, y * 16, np.full_like(x, 50 * i)], -1).astype(np.uint8) for i in range(4)]
    noise = rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)
    jpeg = image_bytes(smooth[3], "JPEG", quality=90)
    images: list[np.ndarray | bytes] = [smooth[0], jpeg, noise, smooth[1], image_bytes(smooth[2], "PNG")]
    path = tmp_path / "enc.b2nd"
    codec = {"codec": "lz4", "clevel": 1, "filters": [], "filters_meta": [], "typesize": 1, "block_images": 1,
             "splitmode": "never"}  # fmt: skip
    entries = spec_writer.write_encoded_store(
        path, images, (16, 16, 3), chunk_images=2, codec=codec, labels=[0, 1, 0, 1, 0], class_names=["a", "b"],
        keys=[f"k/{i}" for i in range(5)],
    )  # fmt: skip
    assert entries[1] == jpeg and entries[2] == noise.tobytes() and entries[4] == images[4]
    store = carraystore.open(path)
    assert store.verify() == [] and store.layout == "encoded" and store.meta.format_version == 2
    assert store.meta.encoding is not None and store.meta.encoding.formats == ("jpeg", "png", "raw")
    assert [store.entry(i) for i in range(5)] == entries
    _assert_same(spec_reader.read_store(path), store)
    with carraystore.append(path) as w:
        w.append(np.stack([smooth[2], noise]), labels=[1, 1], keys=["k/5", "k/6"])
    grown = carraystore.open(path)
    assert grown.verify() == [] and len(grown) == 7 and np.array_equal(grown[6], noise)
    spec = spec_reader.read_store(path)
    _assert_same(spec, grown)
    assert spec["entries"][:5] == entries
