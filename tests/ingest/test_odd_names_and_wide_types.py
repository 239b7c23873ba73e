"""A NUL in a class name, the reason an odd file name is skipped,
and the stream count of a split chunk with a typesize over 16."""

from __future__ import annotations

from pathlib import Path

import blosc2
import numpy as np
import pytest

import carraystore
from carraystore.base.errors import CorruptStoreError, InvalidInputError
from carraystore.format.codec import check_chunk_layout
from carraystore.ingest.sample_data import make_photo_folder
from carraystore.store.export import export_images

# -- item 9: every stream of a split block is checked, whatever the typesize --------------


def _split_chunk(typesize: int) -> bytes:
    rng = np.random.default_rng(0)
    data = rng.integers(0, 4, 4 * 65536, dtype=np.uint8).tobytes()  # compressible, several blocks
    return blosc2.compress2(
        data,
        typesize=typesize,
        splitmode=blosc2.SplitMode.ALWAYS_SPLIT,
        codec=blosc2.Codec.LZ4,
        blocksize=65536,
    )


def _second_stream_size_field(chunk: bytes, typesize: int) -> int:
    """The offset of the size field of the second stream of the first block."""
    first_block = int.from_bytes(chunk[32:36], "little")
    first_size = int.from_bytes(chunk[first_block : first_block + 4], "little", signed=True)
    return first_block + 4 + max(first_size, 0) + (1 if first_size < 0 else 0)


@pytest.mark.parametrize("typesize", [8, 32, 100])
def test_a_genuine_split_chunk_passes_and_blosc2_reads_it(typesize: int) -> None:
    chunk = _split_chunk(typesize)
    header = check_chunk_layout(chunk, "chunk", 1 << 30)
    assert not header.dont_split and header.typesize == typesize
    assert len(blosc2.decompress2(chunk)) == 4 * 65536


@pytest.mark.parametrize("typesize", [32, 100])
def test_a_forged_second_stream_of_a_wide_type_is_refused(typesize: int) -> None:
    """c-blosc2 splits typesizes over 16 too (split mode "always"): the check used to walk
    only the first stream of such blocks, so a second stream claiming 1 MB went through."""
    chunk = bytearray(_split_chunk(typesize))
    pos = _second_stream_size_field(bytes(chunk), typesize)
    chunk[pos : pos + 4] = (1 << 20).to_bytes(4, "little", signed=True)
    with pytest.raises(CorruptStoreError, match="runs past its end"):
        check_chunk_layout(bytes(chunk), "chunk", 1 << 30)


# -- item 6: class names that cannot be printed or used as folder names -------------------


@pytest.mark.parametrize("bad", ["cat\x00dog", "line\nbreak", "tab\tname", "bell\x07"])
def test_class_names_with_control_characters_are_refused(tmp_path: Path, bad: str) -> None:
    with pytest.raises(InvalidInputError, match="control character"):
        carraystore.create(tmp_path / "s.b2nd", (4, 4, 3), class_names=["ok", bad])


def test_export_of_a_store_with_a_nul_class_name_is_a_named_error(tmp_path: Path) -> None:
    """A store written before the check (or by another writer) may hold such a name: export
    stops with a named error instead of ``ValueError: embedded null byte``."""
    path = tmp_path / "s.b2nd"
    with carraystore.create(path, (4, 4, 3), class_names=["a", "b"]) as w:
        w.append(np.zeros((2, 4, 4, 3), np.uint8), labels=[0, 1])
    raw = path.read_bytes()
    import dataclasses

    from carraystore.store.inplace import _write_meta

    with carraystore.open(path) as store:
        meta = store.meta
    arr = blosc2.open(str(path), mode="a")
    _write_meta(arr, dataclasses.replace(meta, class_names=("a", "b\x00")))
    del arr
    assert path.read_bytes() != raw
    out = tmp_path / "out"
    with pytest.raises(InvalidInputError, match="class name"):
        export_images(carraystore.open(path), out)


# -- item 8: the reason an odd but harmless file name is skipped ---------------------------


@pytest.mark.parametrize(
    "folder, reason",
    [
        ("C:drive", "drive letter"),
        ("~tilde", "'~'"),
        ("back\\..\\slash", "'..'"),
    ],
)
def test_a_skipped_file_name_is_skipped_for_its_real_reason(tmp_path: Path, folder: str, reason: str) -> None:
    src = tmp_path / "src"
    make_photo_folder(src, n=6, size=(16, 16), classes=["coffee", "rocket"])
    odd = src / folder  # a folder at the root: a class of its own, its files keys "FOLDER/NAME"
    odd.mkdir()
    first = next((src / "rocket").glob("*.jpg"))
    (odd / "y.jpg").write_bytes(first.read_bytes())
    res = carraystore.from_directory(src, tmp_path / "o.b2nd", on_error="skip", max_skipped=1.0)
    reasons = [r for _, r in res.skipped]
    assert reasons, "the odd name was skipped"
    assert all(reason in r for r in reasons), reasons
    assert not any("NUL or newline" in r for r in reasons)


def test_bytedelta_over_records_wider_than_a_signed_byte(tmp_path: Path) -> None:
    """Found by the property tests: bytedelta's meta is the typesize, which blosc2 keeps in a
    signed byte, so records of 128..255 bytes made blosc2 raise a bare OverflowError (the default
    codec on a 128-channel uint8 store could not be written). The automatic bytedelta now goes
    for such records (the store records the codec without it); an explicit meta over 127 is a
    named error."""
    codec = carraystore.Codec("blosclz", 0, filters=("bytedelta",), typesize=141, splitmode="always")
    assert codec.resolve(np.dtype("uint8"), (1, 47, 3)).filters == ()
    images = np.random.default_rng(0).integers(0, 4, (6, 2, 2, 128), dtype=np.uint8)
    with carraystore.create(tmp_path / "wide.b2nd", (2, 2, 128)) as w:  # the default codec, typesize 128
        w.append(images)
    with carraystore.open(tmp_path / "wide.b2nd") as s:
        assert np.array_equal(s[:], images) and "bytedelta" not in s.codec.filters and not s.verify()
    with pytest.raises(InvalidInputError, match="signed-byte filter meta"):
        carraystore.Codec("zstd", 1, filters=("bytedelta",), filters_meta=(200,), typesize=200).resolve(
            np.dtype("uint8"), (1, 1, 200)
        )
    ok = carraystore.Codec("zstd", 1, filters=("bytedelta",), typesize=127).resolve(np.dtype("uint8"), (1, 127, 1))
    assert ok.filters_meta == (127,)


def test_a_key_table_of_single_dots_is_refused_by_name_not_index_error() -> None:
    """Found by the property tests: keys ['.', '.'] sit end to end as '..' in the table's
    bytes, and the '..' scan read past the table (IndexError) instead of naming the '.' key."""
    from carraystore.base.errors import FormatError
    from carraystore.format.record import StringTable, _check_key_bytes

    table = StringTable.from_strings([".", "."])
    with pytest.raises(FormatError, match="key 0"):
        _check_key_bytes(table._blob, table._offsets, "keys")
    fine = StringTable.from_strings(["a.", ".b"])  # a '..' across two keys is no component
    _check_key_bytes(fine._blob, fine._offsets, "keys")
