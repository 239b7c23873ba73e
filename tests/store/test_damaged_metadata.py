"""Hostile or damaged metadata: every case ends in a named CarrayStoreError, never a crash,
a traceback, a silent rewrite of keys or labels, or gigabytes of memory.

The file-level fuzzing is in test_fuzz.py beside it; these are the named cases, one each.
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blosc2
import msgpack
import numpy as np
import pytest
from helpers import make_store, random_images, raw_record, rewrite_record, set_raw_record

import carraystore
from carraystore.base.errors import (
    ChecksumError,
    CorruptStoreError,
    FormatError,
    FormatVersionError,
    InvalidInputError,
    MetadataChecksumError,
    MetadataTooLargeError,
)
from carraystore.cli.main import main
from carraystore.format.codec import chunk_crc_ok, crc32, zero_chunk
from carraystore.format.frame import read_frame, special_chunk_header
from carraystore.format.record import META_KEY, seal_record
from carraystore.sources.local import LocalFileSource

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden" / "carraystore-0.1.0"


@pytest.fixture()
def store_path(tmp_path: Path) -> Path:
    images, keys = random_images(10, 5, shape=(8, 8, 3)), [f"k/{i}.png" for i in range(10)]
    kw: dict[str, Any] = {"chunk_images": 4, "class_names": ["a", "b"], "attrs": {"who": "tests"}}
    return make_store(tmp_path / "s.b2nd", images, np.arange(10) % 2, keys, **kw)


# -- the metadata checksum ---------------------------------------------------------------------


def test_new_records_are_sealed_and_a_changed_byte_is_refused(
    store_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = raw_record(store_path)
    assert raw[-16:-4] == b"\xaameta_crc32\xce" and int.from_bytes(raw[-4:], "big") == crc32(raw[:-4])
    array = blosc2.open(str(store_path))
    assert array.schunk.meta[META_KEY]["meta_crc32"] is True
    del array
    i = raw.index(b"k/3.png")
    damaged = raw[:i] + b"k/8" + raw[i + 3 :]  # one key silently renamed, same length: valid msgpack
    assert msgpack.unpackb(damaged, raw=False)["keys"]
    set_raw_record(store_path, damaged)
    with pytest.raises(MetadataChecksumError, match="s.b2nd.*checksum"):
        carraystore.open(store_path)
    assert main(["verify", str(store_path)]) != 0
    assert "checksum" in capsys.readouterr().out  # verify reports on stdout
    assert main(["info", str(store_path)]) != 0


def test_a_changed_label_is_refused(store_path: Path) -> None:
    raw = bytearray(raw_record(store_path))
    rec = msgpack.unpackb(bytes(raw), raw=False)
    at = bytes(raw).index(rec["labels"])
    raw[at] ^= 1  # label 0 -> 1: still a valid class
    set_raw_record(store_path, bytes(raw))
    with pytest.raises(MetadataChecksumError):
        carraystore.open(store_path)


def test_a_lost_checksum_is_refused_when_the_fixed_meta_promises_one(store_path: Path) -> None:
    rec = msgpack.unpackb(raw_record(store_path), raw=False)
    del rec["meta_crc32"]
    set_raw_record(store_path, msgpack.packb(rec, use_bin_type=True))
    with pytest.raises(MetadataChecksumError, match="lost its checksum"):
        carraystore.open(store_path)


def test_unsealed_golden_stores_still_open_and_an_append_seals_them(tmp_path: Path) -> None:
    src = GOLDEN / "appended.b2nd"
    assert raw_record(src)[-16:-4] != b"\xaameta_crc32\xce"  # 0.1.0 wrote no checksum
    copy = tmp_path / "appended.b2nd"
    shutil.copy(src, copy)
    before = carraystore.open(copy)
    with carraystore.append(copy) as w:
        w.append(np.zeros((2, *before.image_shape), np.uint8), labels=[0, 0], keys=["c/0", "c/1"])
    after = carraystore.open(copy)
    assert len(after) == len(before) + 2 and list(after.keys)[-2:] == ["c/0", "c/1"]
    assert raw_record(copy)[-16:-4] == b"\xaameta_crc32\xce" and after.verify() == []


# -- size, depth, types ---------------------------------------------------------------------------


def test_metadata_that_inflates_far_beyond_the_store_is_refused_before_it_is_decompressed(store_path: Path) -> None:
    rec = msgpack.unpackb(raw_record(store_path), raw=False)
    rec["attrs"] = {"pad": "a" * (80 * 2**20)}  # 80 MiB of metadata for 10 images
    set_raw_record(store_path, seal_record(rec))
    del rec
    assert store_path.stat().st_size < 2 * 2**20
    probe = (
        "import resource, sys, carraystore\n"
        "from carraystore.base.errors import MetadataTooLargeError\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n    carraystore.open(sys.argv[1])\nexcept MetadataTooLargeError as e:\n    print('refused', e)\n"
        "print('grew_mb', (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(store_path)], capture_output=True, text=True, check=True
    ).stdout
    assert "refused" in out and "s.b2nd" in out and "decompress to" in out, out
    assert float(out.split("grew_mb")[1]) < 40, out  # nothing near the 80 MiB (x3) was allocated


def test_writer_refuses_metadata_over_the_limit(tmp_path: Path) -> None:
    with (
        pytest.raises(InvalidInputError, match="FORMAT.md, Limits"),
        carraystore.create(tmp_path / "big.b2nd", (4, 4, 1), attrs={"pad": "a" * (70 * 2**20)}) as w,
    ):
        w.append(np.zeros((2, 4, 4, 1), np.uint8))
    assert not (tmp_path / "big.b2nd").exists()


def test_deeply_nested_attrs_are_a_named_error(store_path: Path, tmp_path: Path) -> None:
    deep: dict[str, Any] = {}
    cur = deep
    for _ in range(1000):
        cur["x"] = {}
        cur = cur["x"]
    rewrite_record(store_path, lambda rec: rec.__setitem__("attrs", deep))
    with pytest.raises(FormatError, match="nests deeper"):
        carraystore.open(store_path)
    with pytest.raises(FormatError, match="nests deeper"):  # and the writer never writes one
        carraystore.create(tmp_path / "deep.b2nd", (4, 4, 1), attrs=deep)


def test_msgpack_timestamps_are_refused(store_path: Path) -> None:
    rec = msgpack.unpackb(raw_record(store_path), raw=False)
    rec["attrs"] = {"when": datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)}
    del rec["meta_crc32"]
    raw = msgpack.packb(rec, use_bin_type=True, datetime=True)
    rec2 = msgpack.unpackb(raw, raw=False, timestamp=0)
    assert isinstance(rec2["attrs"]["when"], msgpack.Timestamp)
    set_raw_record(store_path, seal_record(rec2))  # sealed, so only the timestamp rule can refuse it
    with pytest.raises(FormatError, match="timestamp"):
        carraystore.open(store_path)


# -- keys and labels --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda u: b"\xff" + u[1:], "not valid UTF-8"),
        (lambda u: u.replace(b"k/1.png", b"k/\x00.png"), "NUL"),
        (lambda u: u.replace(b"k/1.png", b"../1.pn"), "'..' component"),
        (lambda u: u.replace(b"k/1.png", b"/k1.png"), "absolute"),
        (lambda u: u.replace(b"k/1.png", b"k\\..\\12"), "'..' component"),
        (lambda u: u.replace(b"k/1.png", b"\\k1.png"), "absolute"),
    ],
    ids=["utf8", "nul", "dotdot", "absolute", "dotdot-backslash", "absolute-backslash"],
)
def test_bad_keys_are_refused_on_open(store_path: Path, mutate: Callable[[bytes], bytes], why: str) -> None:
    rewrite_record(store_path, lambda rec: rec["keys"].__setitem__("utf8", mutate(rec["keys"]["utf8"])))
    with pytest.raises(FormatError, match=why):
        carraystore.open(store_path)


def test_keys_with_dots_that_are_not_components_are_fine(tmp_path: Path) -> None:
    path = tmp_path / "dots.b2nd"
    keys = ["a..b/c.png", "..x/y", "z/...", "v/w..", "back\\slash.jpg"]
    with carraystore.create(path, (4, 4, 1)) as w:
        w.append(np.zeros((5, 4, 4, 1), np.uint8), keys=keys)
    assert list(carraystore.open(path).keys) == keys


def test_labels_without_class_names_follow_the_range_rule(store_path: Path, tmp_path: Path) -> None:
    def out_of_range(rec: dict[str, Any]) -> None:
        rec["class_names"] = None
        rec["labels"] = np.array([0, 1, 2**31] + [0] * 7, "<i8").tobytes()

    rewrite_record(store_path, out_of_range)
    with pytest.raises(FormatError, match="labels span 0..2147483648"):
        carraystore.open(store_path)
    for bad in ([-1, 0], [0, 2**31]):
        with (
            pytest.raises(InvalidInputError, match="labels must lie in 0..2147483647"),
            carraystore.create(tmp_path / "l.b2nd", (4, 4, 1), overwrite=True) as w,
        ):
            w.append(np.zeros((2, 4, 4, 1), np.uint8), labels=bad)
    with carraystore.create(tmp_path / "ok.b2nd", (4, 4, 1)) as w:  # no class names: any label in range
        w.append(np.zeros((2, 4, 4, 1), np.uint8), labels=[7, 2**31 - 1])
    assert carraystore.open(tmp_path / "ok.b2nd").labels.tolist() == [7, 2**31 - 1]


def test_repeated_or_non_string_class_names_are_refused(store_path: Path) -> None:
    rewrite_record(store_path, lambda rec: rec.__setitem__("class_names", ["a", "a"]))
    with pytest.raises(FormatError, match="repeat"):
        carraystore.open(store_path)
    rewrite_record(store_path, lambda rec: rec.__setitem__("class_names", ["a", 3]))
    with pytest.raises(FormatError, match="strings"):
        carraystore.open(store_path)


# -- format versions ------------------------------------------------------------------------------------


def _patch_fixed_version(path: Path, version: int) -> None:
    data = bytearray(path.read_bytes())
    at = data.index(b"\xaeformat_version\x01")  # the fixed meta layer in the frame header
    data[at + 15] = version
    path.write_bytes(bytes(data))


def test_fixed_meta_format_version_governs(store_path: Path) -> None:
    _patch_fixed_version(store_path, 99)
    with pytest.raises(FormatVersionError, match="99"):
        carraystore.open(store_path)


def test_fixed_and_variable_format_versions_must_agree(store_path: Path) -> None:
    _patch_fixed_version(store_path, 0)
    with pytest.raises(FormatError, match="fixed meta layer says format version 0"):
        carraystore.open(store_path)


# -- the CRC rule of special chunks -----------------------------------------------------------------------


def test_special_zero_chunks_record_the_crc_of_the_canonical_zero_chunk(tmp_path: Path) -> None:
    path = tmp_path / "z.b2nd"
    images = np.zeros((8, 4, 4, 3), np.uint8)
    images[4:] = 9
    with carraystore.create(path, (4, 4, 3), chunk_images=4) as w:
        w.append(images)
    store = carraystore.open(path)
    assert store._frame.chunk_special.tolist() == [1, 0]  # chunk 0 holds no bytes in the frame
    canonical = zero_chunk(store.codec, store.meta.blocksize, store.chunk_nbytes)
    assert int(store.meta.crc32[0]) == crc32(canonical)
    assert blosc2.compress2(images[:4], **store.codec.cparams(store.meta.blocksize)) == canonical
    assert store.verify() == [] and np.array_equal(store[:], images)
    # the golden 0.1.0 store recorded the same rule
    golden = carraystore.open(GOLDEN / "black_frames.b2nd")
    assert int(golden.meta.crc32[0]) == crc32(zero_chunk(golden.codec, golden.meta.blocksize, golden.chunk_nbytes))
    # a chunk that claims another special value (NaNs, uninitialised) never passes
    want = int(store.meta.crc32[0])
    for special in (2, 4):
        stand_in = special_chunk_header(special, store.chunk_nbytes, store.meta.blocksize, 1)
        assert not chunk_crc_ok(stand_in, want, store.codec, store.meta.blocksize, store.chunk_nbytes)
    zeros = special_chunk_header(1, store.chunk_nbytes, store.meta.blocksize, 1)
    assert chunk_crc_ok(zeros, want, store.codec, store.meta.blocksize, store.chunk_nbytes)
    assert not chunk_crc_ok(zeros, want ^ 1, store.codec, store.meta.blocksize, store.chunk_nbytes)


def test_a_flipped_bit_in_the_metadata_chunk_offsets_is_a_named_error(store_path: Path) -> None:
    """Bits 16-23 of the first block offset: libblosc2 read far outside the chunk (a segfault)."""
    frame = read_frame(LocalFileSource(store_path))
    content = frame.vlmeta_raw[META_KEY]
    data = bytearray(store_path.read_bytes())
    at = bytes(data).rindex(content)
    for bit in (16, 20, 23):
        broken = bytearray(data)
        broken[at + 32 + bit // 8] ^= 1 << (bit % 8)
        store_path.write_bytes(bytes(broken))
        probe = "import sys, carraystore\ntry:\n    carraystore.open(sys.argv[1])\nexcept carraystore.CarrayStoreError as e:\n    print(type(e).__name__, e)\n"
        run = subprocess.run([sys.executable, "-c", probe, str(store_path)], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, f"bit {bit}: the process died ({run.returncode}): {run.stderr[-500:]}"
        assert run.stdout.startswith("CorruptStoreError") and "block offset" in run.stdout, run.stdout
    assert issubclass(MetadataChecksumError, ChecksumError) and issubclass(MetadataTooLargeError, CorruptStoreError)


def test_titled_dtypes_are_refused_when_written(tmp_path: Path) -> None:
    dt = np.dtype({"names": ["a", "b"], "formats": ["<i4", "<f8"], "titles": ["Alpha", "Beta"]})
    with pytest.raises(InvalidInputError, match="title"):
        carraystore.create(tmp_path / "t.b2nd", (), dtype=dt, layout="array")
    assert not list(tmp_path.iterdir())


def test_color_mode_must_match_the_channels(store_path: Path) -> None:
    rewrite_record(store_path, lambda rec: rec.__setitem__("color_mode", "grayscale"))
    with pytest.raises(FormatError, match="color_mode 'grayscale' does not match C = 3"):
        carraystore.open(store_path)


def test_damaged_dtype_strings_are_named_errors() -> None:
    from carraystore.format.record import dtype_from_record

    for rec in ("<i2,01", "((((((", "x" * 1000, [["a", 3]], [[1, "<i4"]]):
        with pytest.raises(FormatError):
            dtype_from_record(rec)


def test_sub_array_dtypes_are_refused_when_written(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="item shape"):
        carraystore.create(tmp_path / "s.b2nd", (), dtype=np.dtype(("<f4", (3,))), layout="array")


def test_an_offsets_index_that_marks_a_chunk_uninitialised_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "z.b2nd"
    images = np.zeros((8, 4, 4, 3), np.uint8)
    images[4:] = 5
    with carraystore.create(path, (4, 4, 3), chunk_images=4) as w:
        w.append(images)
    frame = read_frame(LocalFileSource(path))
    data = path.read_bytes()
    tail = frame.header_len + frame.cbytes
    trailer_len = int.from_bytes(data[-22:-18], "big")
    offsets = np.frombuffer(blosc2.decompress(data[tail : len(data) - trailer_len]), "<i8").copy()
    assert offsets[0] == np.int64(-(2**63) + (1 << 56))  # zeros
    offsets[0] = np.int64(-(2**63) + (4 << 56))  # uninitialised
    index = blosc2.compress2(offsets.tobytes(), typesize=8)
    rebuilt = bytearray(data[:tail] + index + data[len(data) - trailer_len :])
    rebuilt[16:24] = len(rebuilt).to_bytes(8, "big")  # frame_len (FORMAT.md A.1)
    path.write_bytes(bytes(rebuilt))
    with pytest.raises(CorruptStoreError, match="chunk 0 as special value 4"):
        carraystore.open(path)


def test_appending_after_a_special_partial_last_chunk(tmp_path: Path) -> None:
    path = tmp_path / "zz.b2nd"
    with carraystore.create(path, (4, 4, 3), chunk_images=4) as w:
        w.append(np.zeros((6, 4, 4, 3), np.uint8))
    assert carraystore.open(path)._frame.chunk_special.tolist() == [1, 1]
    with carraystore.append(path) as w:  # the writer checks the special last chunk's canonical CRC first
        w.append(np.ones((3, 4, 4, 3), np.uint8))
    store = carraystore.open(path)
    assert store.verify() == [] and store[:].reshape(9, -1).sum(axis=1).tolist() == [0] * 6 + [48] * 3
