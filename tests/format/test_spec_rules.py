"""FORMAT.md rules: keys with empty or '.' components, labels of
empty stores, the b2nd dtype text, where N comes from for the metadata size limit, and the
encoded layout's (format version 2 and its layout, the encoding map, padding, which entries a
writer stores), field names and class names without labels. Each is held by carraystore and by
the clean-room reader and writer (tests/spec_reader.py, tests/spec_writer.py) alike."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import spec_reader
import spec_writer
from helpers import image_bytes, pillow_pixels, raw_record, rewrite_record

import carraystore
from carraystore.base.errors import FormatError, FormatVersionError, InvalidInputError
from carraystore.format.encoded import ENCODING_KEYS, Encoding, source_entry
from carraystore.format.record import key_problem, validate_key

SHAPE = (4, 4, 1)
LZ4 = {"codec": "lz4", "clevel": 1, "filters": [], "filters_meta": [], "typesize": 1, "block_images": 1,
       "splitmode": "never"}  # fmt: skip
DOT_KEYS = [".", "x/", "a//b", "a/./b", "./a", "a/.", "a/b/"]


# -- keys: empty and '.' components (FORMAT.md 4.5) ----------------------------------------------


@pytest.mark.parametrize("key", DOT_KEYS)
def test_writers_refuse_keys_with_empty_or_dot_components(tmp_path: Path, key: str) -> None:
    assert key_problem(key) is not None
    with pytest.raises(InvalidInputError, match=r"empty or '\.' path component"):
        validate_key(key)
    with carraystore.create(tmp_path / "s.b2nd", SHAPE) as w, pytest.raises(InvalidInputError, match="component"):
        w.append(np.zeros((2, *SHAPE), np.uint8), keys=["ok/1", key])


def test_dots_and_slashes_inside_names_stay_valid() -> None:
    for key in [".x", "x.", "a/.b/c", "...", "a/..b", "back\\slash", "a\\\\b", "a\\.\\b"]:
        assert key_problem(key) is None, key


@pytest.mark.parametrize("key", DOT_KEYS)
def test_both_readers_refuse_such_keys_in_the_key_table(tmp_path: Path, key: str) -> None:
    path = tmp_path / "s.b2nd"
    keys = ["p/0", "p/1", "p/2"]
    with carraystore.create(path, SHAPE) as w:
        w.append(np.zeros((3, *SHAPE), np.uint8), keys=keys)
    keys[1] = key
    blob = "".join(keys).encode()
    offsets = np.cumsum([0] + [len(k.encode()) for k in keys]).astype("<u8").tobytes()
    rewrite_record(path, lambda rec: rec.__setitem__("keys", {"utf8": blob, "offsets": offsets}))
    with pytest.raises(FormatError, match=r"key 1 .*(empty|'\.') path component"):
        carraystore.open(path)
    with pytest.raises(spec_reader.SpecError, match="bad key"):
        spec_reader.read_store(path)


def test_no_golden_store_holds_such_keys() -> None:
    golden = Path(__file__).parents[1] / "data" / "golden"
    for path in sorted(golden.rglob("*.b2nd")):
        with carraystore.open(path) as store:  # open checks every key
            assert all(key_problem(k) is None for k in (store.keys or []))


# -- labels of empty stores (FORMAT.md 4.4) ------------------------------------------------------


def test_an_empty_store_with_class_names_is_labelled(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    carraystore.create(path, SHAPE, class_names=["a", "b"]).close()
    spec = spec_reader.read_store(path)
    assert spec["labels"] is not None and len(spec["labels"]) == 0  # an empty bin, not nil
    assert carraystore.open(path).labels is not None
    with carraystore.append(path) as w, pytest.raises(InvalidInputError, match="labelled"):
        w.append(np.zeros((1, *SHAPE), np.uint8))


def test_an_empty_store_that_holds_empty_labels_is_labelled(tmp_path: Path) -> None:
    """Labels written for zero items (an empty bin) make the store labelled, as class names do;
    the writer took it as undecided and then failed at close ("0 labels for 2 images")."""
    path = tmp_path / "s.b2nd"
    with carraystore.create(path, SHAPE) as w:
        w.append(np.zeros((0, *SHAPE), np.uint8), labels=np.zeros(0, int), keys=[])
    assert spec_reader.read_store(path)["labels"] is not None
    with carraystore.append(path) as w:
        with pytest.raises(InvalidInputError, match="labelled"):
            w.append(np.zeros((2, *SHAPE), np.uint8), keys=["a", "b"])
        with pytest.raises(InvalidInputError, match="has keys"):
            w.append(np.zeros((2, *SHAPE), np.uint8), labels=[0, 1])
        w.append(np.zeros((2, *SHAPE), np.uint8), labels=[0, 1], keys=["a", "b"])
    with carraystore.open(path) as store:
        assert list(store.labels) == [0, 1] and list(store.keys) == ["a", "b"]


@pytest.mark.parametrize("labelled", [True, False])
def test_an_empty_store_without_labels_or_class_names_is_undecided(tmp_path: Path, labelled: bool) -> None:
    path = tmp_path / "s.b2nd"
    carraystore.create(path, SHAPE).close()
    assert spec_reader.read_store(path)["labels"] is None
    with carraystore.append(path) as w:
        w.append(np.zeros((2, *SHAPE), np.uint8), labels=[1, 0] if labelled else None)
    with carraystore.open(path) as store:
        assert (store.labels is not None) == labelled


# -- the b2nd dtype text (FORMAT.md 4.2) ---------------------------------------------------------


@pytest.mark.parametrize(
    "dtype",
    [
        np.dtype([("a", "<i4"), ("b", "<f8")]),  # packed: python-blosc2 writes the list form
        np.dtype({"names": ["a", "b"], "formats": ["<i2", "<f4"], "offsets": [0, 4], "itemsize": 12}),
        np.dtype([("a", "u1"), ("b", "<f8")], align=True),  # aligned
    ],
    ids=["packed", "padded", "aligned"],
)
def test_the_b2nd_dtype_text_is_str_of_the_dtype_and_any_literal_form_reads(tmp_path: Path, dtype: np.dtype) -> None:
    path = tmp_path / "s.b2nd"
    with carraystore.create(path, (2,), dtype=dtype, layout="array") as w:
        w.append(np.zeros((3, 2), dtype))
    text = msgpack.unpackb(_b2nd(path), raw=False)[6]
    assert np.dtype(ast.literal_eval(text)) == dtype
    assert text == str(carraystore.open(path).dtype)  # what the writer writes: str(dtype)
    assert spec_reader.read_store(path)["dtype"] == dtype
    # python-blosc2 writing the aligned dtype itself writes the dict form with 'aligned': True;
    # readers must accept it too (any literal numpy reads as the record's dtype)
    if dtype.isalignedstruct:
        assert "'aligned': True" in str(dtype)
        assert np.dtype(ast.literal_eval(str(dtype))) == carraystore.open(path).dtype


def _b2nd(path: Path) -> bytes:
    data = path.read_bytes()
    header_len = int.from_bytes(data[11:15], "big")
    header = msgpack.unpackb(data[:header_len], raw=True, strict_map_key=False)
    return header[13][2][0]


# -- where N comes from for the metadata limit (FORMAT.md 8) ------------------------------------


def test_a_first_dimension_beyond_the_frames_chunks_is_refused_before_the_record(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    with carraystore.create(path, SHAPE, chunk_images=4) as w:
        w.append(np.zeros((6, *SHAPE), np.uint8))
    data = bytearray(path.read_bytes())
    at = data.index(b"\x94\xd3\x00\x00\x00\x00\x00\x00\x00\x06") + 2  # the b2nd shape's first dimension
    data[at : at + 8] = (2**40).to_bytes(8, "big")
    path.write_bytes(data)
    with pytest.raises(carraystore.base.errors.CorruptStoreError, match="does not fit its 2 chunks of 4"):
        carraystore.open(path)
    with pytest.raises(spec_reader.SpecError, match="first dimension"):
        spec_reader.read_store(path)


# -- format version 2 is the encoded layout only (FORMAT.md 3, 10) -------------------------------


def _as_version_2(path: Path) -> None:
    """Both version entries of a store set to 2 (the fixed metalayer's byte, and the record)."""
    data = bytearray(path.read_bytes())
    at = data.index(b"\xaeformat_version\x01") + 15
    data[at] = 2
    path.write_bytes(bytes(data))
    rewrite_record(path, lambda rec: rec.__setitem__("format_version", 2))


@pytest.mark.parametrize("layout", ["NHWC", "array"])
def test_a_version_2_store_of_another_layout_is_refused_as_what_it_is_not_as_newer(tmp_path: Path, layout: str) -> None:
    """carraystore said "format version 2 is newer than this carraystore reads" (FormatVersionError: upgrade)
    though it reads version 2: the problem is the layout, and upgrading would not help."""
    path = tmp_path / "s.b2nd"
    shape, dtype = (SHAPE, np.uint8) if layout == "NHWC" else ((3,), np.float32)
    with carraystore.create(path, shape, dtype=dtype, layout=layout) as w:
        w.append(np.ones((2, *shape), dtype))
    _as_version_2(path)
    with pytest.raises(FormatError) as info:
        carraystore.open(path)
    assert not isinstance(info.value, FormatVersionError)
    msg = str(info.value)
    assert "newer" not in msg and f"layout {layout!r}" in msg and "format version 1" in msg, msg
    with pytest.raises(spec_reader.SpecError, match="format version 2 is the encoded layout"):
        spec_reader.read_store(path)


def test_a_version_beyond_2_is_newer_whatever_the_layout(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    with carraystore.create(path, SHAPE) as w:
        w.append(np.ones((2, *SHAPE), np.uint8))
    rewrite_record(path, lambda rec: rec.update(format_version=3, layout="encoded"))
    with pytest.raises(FormatVersionError, match=r"version 3 is newer .*format versions 1 and 2"):
        carraystore.open(path)


# -- the encoding map (FORMAT.md 10.3) ------------------------------------------------------------

ENC_SHAPE = (16, 16, 3)


def _smooth(i: int) -> np.ndarray:
    y, x = np.mgrid[0:16, 0:16]
    return np.stack([x * 16, y * 16, np.full_like(x, 40 * i)], -1).astype(np.uint8)


@pytest.fixture
def encoded_store(tmp_path: Path) -> Path:
    path = tmp_path / "e.b2nd"
    with carraystore.create(path, ENC_SHAPE, layout="encoded", chunk_images=2) as w:
        w.append(np.stack([_smooth(i) for i in range(3)]), labels=[0, 1, 0])
    return path


def _drop(key: str) -> Any:
    return lambda e: e.pop(key)


ENCODING_EDITS = {
    **{f"no-{k}": _drop(k) for k in ENCODING_KEYS},
    "unknown-key": lambda e: e.update(lossless=True),
    "png-level": lambda e: e.update(png_compress_level=9),
    "png-level-float": lambda e: e.update(png_compress_level=6.0),
    "subsampling": lambda e: e.update(jpeg_subsampling="4:4:4"),
    "min-version-int": lambda e: e.update(decoder_min_version=10),
    "formats-twice": lambda e: e.update(formats=["png", "png"]),
    "formats-unknown": lambda e: e.update(formats=["png", "gif"]),
    "formats-not-list": lambda e: e.update(formats="png"),
    "reencode-gif": lambda e: e.update(reencode="gif"),
    "png-with-quality": lambda e: e.update(quality=90),
    "jpeg-without-quality": lambda e: e.update(reencode="jpeg"),
    "quality-range": lambda e: e.update(reencode="jpeg", quality=101),
    "quality-bool": lambda e: e.update(reencode="webp", quality=True),
    "decoder": lambda e: e.update(decoder="libjpeg"),
}


@pytest.mark.parametrize("edit", list(ENCODING_EDITS), ids=list(ENCODING_EDITS))
def test_an_encoding_map_that_breaks_10_3_is_refused_by_both_readers(encoded_store: Path, edit: str) -> None:
    """Every key required, none other, each value as its row says (missing keys took defaults, unknown keys,
    another PNG level or subsampling and a duplicated format were accepted)."""
    rewrite_record(encoded_store, lambda rec: ENCODING_EDITS[edit](rec["encoding"]))
    with pytest.raises(FormatError, match=r"'encoding'|decoder") as info:
        carraystore.open(encoded_store)
    if edit.startswith("no-"):
        assert f"lacks {edit.removeprefix('no-')!r}" in str(info.value)
    with pytest.raises(spec_reader.SpecError, match="encoding"):
        spec_reader.read_store(encoded_store)


@pytest.mark.parametrize("encoding", [{"reencode": "webp", "quality": None}, {"reencode": "webp", "quality": 80},
                                      {"reencode": "jpeg", "quality": 1}])  # fmt: skip
def test_an_encoding_map_within_10_3_reads(encoded_store: Path, encoding: dict[str, Any]) -> None:
    rewrite_record(encoded_store, lambda rec: rec["encoding"].update(encoding))
    spec = spec_reader.read_store(encoded_store)
    with carraystore.open(encoded_store) as store:
        assert store.meta.encoding is not None and store.meta.encoding.to_record() == {
            **Encoding().to_record(), "formats": ["png"], **encoding}  # fmt: skip
        assert np.array_equal(spec["items"], store[:])


def test_the_writers_encoding_map_is_exactly_the_keys_of_10_3(encoded_store: Path) -> None:
    text = (Path(__file__).parents[2] / "FORMAT.md").read_text(encoding="utf-8")
    section = text[text.index("### 10.3") : text.index("## Appendix A")]
    assert [line.split("`")[1] for line in section.splitlines() if line.startswith("| `")] == list(ENCODING_KEYS)
    assert set(spec_reader.ENCODING_KEYS) == set(ENCODING_KEYS)
    rec = msgpack.unpackb(raw_record(encoded_store), raw=False)
    assert list(rec["encoding"]) == list(ENCODING_KEYS)


# -- padding after the entries (FORMAT.md 10.1) ---------------------------------------------------


def test_the_padding_after_the_entries_is_ignored_by_readers(tmp_path: Path) -> None:
    """Writers write zeros there; readers neither read nor check it, so non-zero padding reads the same."""
    images: list[np.ndarray | bytes] = [_smooth(i) for i in range(5)]
    stores = {}
    for pad in (0, 0xA5):
        path = tmp_path / f"pad{pad}.b2nd"
        entries = spec_writer.write_encoded_store(path, images, ENC_SHAPE, chunk_images=2, codec=LZ4, pad_byte=pad)
        assert all(e.startswith(b"\x89PNG") for e in entries)
        stores[pad] = path
    raw = [carraystore.open(p).read_chunk_bytes(0) for p in stores.values()]
    assert raw[0] != raw[1]  # the chunks differ in their padding only
    for path in stores.values():
        with carraystore.open(path) as store:
            assert store.verify() == []
            assert np.array_equal(store[:], np.stack(images))
            assert np.array_equal(spec_reader.read_store(path)["items"], np.stack(images))


# -- entries: raw exactly at H*W*C bytes; which source files are kept (FORMAT.md 10.1-10.3) --------


def test_a_file_of_exactly_h_w_c_bytes_is_stored_as_its_pixels(tmp_path: Path) -> None:
    """The writer's duty of 10.1: an encoded file as long as the raw pixels would read back as raw bytes."""
    img = _smooth(1)
    png = image_bytes(img, "PNG")
    exact = png + bytes(img.nbytes - len(png))  # Pillow reads a PNG with bytes after IEND
    assert len(exact) == img.nbytes and np.array_equal(pillow_pixels(exact), img)
    longer = image_bytes(np.random.default_rng(1).integers(0, 256, ENC_SHAPE, np.uint8), "PNG")
    assert len(longer) > img.nbytes
    path = tmp_path / "s.b2nd"
    entries = spec_writer.write_encoded_store(path, [png, exact, longer], ENC_SHAPE, chunk_images=2, codec=LZ4)
    assert entries[0] == png and entries[1] == img.tobytes() and entries[2] == pillow_pixels(longer).tobytes()
    with carraystore.open(path) as store:
        assert store.verify() == [] and store.meta.encoding is not None
        assert store.meta.encoding.formats == ("png", "raw")
        assert np.array_equal(store[1], img) and np.array_equal(store[2], pillow_pixels(longer))
    # carraystore keeps a source file only when it is shorter than the raw pixels
    assert source_entry(png, img, "rgb") == png
    assert source_entry(exact, img, "rgb") is None and source_entry(longer, pillow_pixels(longer), "rgb") is None


def test_with_a_quality_no_source_file_is_kept(tmp_path: Path) -> None:
    """10.3: a non-nil quality encodes every image at it, even files that would be kept (spec writer and ingest)."""
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    files = [image_bytes(_smooth(i), "JPEG", quality=90) for i in range(3)]
    for i, data in enumerate(files):
        (src / f"{i}.jpg").write_bytes(data)
    for quality in (None, 50):
        out = tmp_path / f"q{quality}.b2nd"
        carraystore.from_directory(src.parent, out, layout="encoded", quality=quality, workers=1, keep_order=True)
        with carraystore.open(out) as store:
            kept = [store.entry(i) == files[int(store.keys[i][2])] for i in range(3)]
            assert kept == [quality is None] * 3
        entries = spec_writer.write_encoded_store(
            tmp_path / f"s{quality}.b2nd", list(files), ENC_SHAPE, chunk_images=2, codec=LZ4,
            reencode="png" if quality is None else "jpeg", quality=quality,
        )  # fmt: skip
        assert [e == f for e, f in zip(entries, files, strict=True)] == [quality is None] * 3


# -- fields and class names (FORMAT.md 4.4, 4.4a) -------------------------------------------------


def test_a_field_with_an_empty_name_is_refused_by_both_readers(tmp_path: Path) -> None:
    """Writers refuse an empty field name; carraystore's reader accepted one."""
    path = tmp_path / "s.b2nd"
    with carraystore.create(path, SHAPE) as w:
        w.append(np.zeros((2, *SHAPE), np.uint8), columns={"target": np.arange(2, dtype="<f4")})
    rewrite_record(path, lambda rec: rec.__setitem__("columns", {"": rec["columns"]["target"]}))
    with pytest.raises(FormatError, match="field name '' .*non-empty"):
        carraystore.open(path)
    with pytest.raises(spec_reader.SpecError, match="field name"):
        spec_reader.read_store(path)


def test_class_names_without_labels_are_refused_in_a_store_with_items(tmp_path: Path) -> None:
    """A store with class names is labelled (4.4): with items but no labels it is damaged (it was read as
    an unlabelled store with class names, which no append could extend)."""
    path = tmp_path / "s.b2nd"
    with carraystore.create(path, SHAPE, class_names=["a", "b"]) as w:
        w.append(np.zeros((2, *SHAPE), np.uint8), labels=[0, 1])
    rewrite_record(path, lambda rec: rec.__setitem__("labels", None))
    with pytest.raises(FormatError, match="class names but no labels for its 2 items"):
        carraystore.open(path)
    with pytest.raises(spec_reader.SpecError, match="class names without labels"):
        spec_reader.read_store(path)


def test_class_names_without_labels_in_an_empty_store_read_as_no_labels_yet(tmp_path: Path) -> None:
    """4.4: read like an empty bin: the store is labelled (its labels were None before)."""
    path = tmp_path / "s.b2nd"
    carraystore.create(path, SHAPE, class_names=["a", "b"]).close()
    rewrite_record(path, lambda rec: rec.__setitem__("labels", None))
    with carraystore.open(path) as store:
        assert store.labels is not None and len(store.labels) == 0
    spec = spec_reader.read_store(path)
    assert spec["labels"] is not None and len(spec["labels"]) == 0
    with carraystore.append(path) as w:
        with pytest.raises(InvalidInputError, match="labelled"):
            w.append(np.zeros((1, *SHAPE), np.uint8))
        w.append(np.zeros((1, *SHAPE), np.uint8), labels=[1])
    assert carraystore.open(path).labels.tolist() == [1]


# -- optional keys: absent or nil (FORMAT.md 4.1) -------------------------------------------------


def test_optional_keys_may_be_nil(tmp_path: Path) -> None:
    """A nil `layout`, `color_mode`, `writer_version`, `blosc2_version` means what their absence means
    (nil layout was read as a layout named 'None' and refused)."""
    path = tmp_path / "s.b2nd"
    with carraystore.create(path, SHAPE) as w:
        w.append(np.ones((2, *SHAPE), np.uint8))
    nil = ("layout", "writer_version", "blosc2_version")
    rewrite_record(path, lambda rec: rec.update(dict.fromkeys(nil)))
    with carraystore.open(path) as store:
        assert (
            store.layout == "NHWC"
            and store.meta.writer_version == ""
            and np.array_equal(store[:], np.ones((2, *SHAPE)))
        )
    assert spec_reader.read_store(path)["layout"] == "NHWC"
    array = tmp_path / "a.b2nd"
    with carraystore.create(array, (3,), dtype=np.float32, layout="array") as w:
        w.append(np.ones((2, 3), np.float32))
    rewrite_record(array, lambda rec: rec.update(color_mode=None))
    assert carraystore.open(array).color_mode == "" and spec_reader.read_store(array)["color_mode"] == ""
