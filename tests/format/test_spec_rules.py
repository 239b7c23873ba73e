"""FORMAT.md rules: keys with empty or '.' components, labels of
empty stores, the b2nd dtype text, and where N comes from for the metadata size limit. Each is
held by carraystore and by the clean-room reader (tests/spec_reader.py) alike."""

from __future__ import annotations

import ast
from pathlib import Path

import msgpack
import numpy as np
import pytest
import spec_reader
from helpers import rewrite_record

import carraystore
from carraystore.base.errors import FormatError, InvalidInputError
from carraystore.format.record import key_problem, validate_key

SHAPE = (4, 4, 1)
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
