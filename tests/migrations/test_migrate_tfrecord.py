"""TFRecord files of ``tf.train.Example`` into stores, read without TensorFlow; hostile records.

The files under ``tests/data/tfrecord/`` were written by TensorFlow's ``TFRecordWriter``
(``make_tfrecords.py`` beside them); one test checks the hand parser against TensorFlow itself.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers import hide_module, image_bytes, pillow_pixels

import carraystore
from carraystore.cli.main import main
from carraystore.migrations import migrate
from carraystore.migrations import tfrecord as tfr
from carraystore.migrations.samples import (
    SourceChecksumError,
    SourceFormatError,
    SourceImageError,
    TruncatedSourceError,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "tfrecord"
EXPECTED = json.loads((DATA / "expected.json").read_text())
RECORDS = EXPECTED["records"]
FILES = ("photos.tfrecord", "photos.tfrecord.gz", "photos.tfrecord.zz")


# -- a small protobuf writer for records TensorFlow would not write (unpacked lists, hostile bytes) ---------


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes | int) -> bytes:
    tag = _varint(number << 3 | wire)
    if wire == 0:
        assert isinstance(payload, int)
        return tag + _varint(payload)
    assert isinstance(payload, bytes)
    return tag + (_varint(len(payload)) + payload if wire == 2 else payload)


def _feature(kind: str, values: list, packed: bool = True) -> bytes:
    if kind == "bytes":
        inner = b"".join(_field(1, 2, v) for v in values)
        return _field(1, 2, inner)
    if kind == "float":
        if packed:
            inner = _field(1, 2, struct.pack(f"<{len(values)}f", *values))
        else:
            inner = b"".join(_field(1, 5, struct.pack("<f", v)) for v in values)
        return _field(2, 2, inner)
    if packed:
        inner = _field(1, 2, b"".join(_varint(v) for v in values))
    else:
        inner = b"".join(_field(1, 0, v) for v in values)
    return _field(3, 2, inner)


def _example(features: dict[str, tuple[str, list]], packed: bool = True) -> bytes:
    entries = b"".join(
        _field(1, 2, _field(1, 2, name.encode()) + _field(2, 2, _feature(kind, values, packed)))
        for name, (kind, values) in features.items()
    )
    return _field(1, 2, entries)


def _frame(data: bytes) -> bytes:
    n = struct.pack("<Q", len(data))
    return n + struct.pack("<I", tfr.masked_crc32c(n)) + data + struct.pack("<I", tfr.masked_crc32c(data))


def _bomb_png(w: int = 30000, h: int = 30000) -> bytes:
    """A PNG whose header claims w x h pixels (far beyond Pillow's MAX_IMAGE_PIXELS), with no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def _records_file(path: Path, examples: list[bytes]) -> Path:
    path.write_bytes(b"".join(_frame(e) for e in examples))
    return path


def _photo_example(img: np.ndarray, label: int, fmt: str = "JPEG") -> bytes:
    return _example({"image/encoded": ("bytes", [image_bytes(img, fmt)]), "image/class/label": ("int", [label])})


# -- the files TensorFlow wrote ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", FILES)
def test_records_written_by_tensorflow_migrate_every_sample(name: str, tmp_path: Path) -> None:
    report = migrate(DATA / name, tmp_path / "o.b2nd", layout="encoded", progress=False)
    s = carraystore.open(tmp_path / "o.b2nd")
    assert len(s) == len(RECORDS) and s.item_shape == (32, 32, 3)
    for i, r in enumerate(RECORDS):
        jpeg = bytes.fromhex(r["jpeg_hex"])
        assert hashlib.sha256(s.entry(i)).hexdigest() == r["sha256"]  # the JPEG kept byte for byte
        assert np.array_equal(s[i], pillow_pixels(jpeg)), i
    assert list(s.labels) == [r["label"] for r in RECORDS]
    assert s.class_names == tuple(EXPECTED["classes"])  # from image/class/text
    assert list(s.keys) == [r["filename"] for r in RECORDS]  # from image/filename
    assert np.array_equal(s.columns["image/center"], np.array([r["center"] for r in RECORDS], np.float32))
    assert s.columns["image/center"].dtype == np.float32
    assert list(s.columns["image/height"]) == [32] * len(RECORDS) and s.columns["image/height"].ndim == 1
    assert list(s.columns["image/format"]) == ["jpeg"] * len(RECORDS)
    notes = "\n".join(report.notes)
    assert "not migrated: feature 'image/object/bbox/xmin' (lists whose length varies (0..2 values)" in notes
    assert "class names from feature 'image/class/text'" in notes
    assert f"{len(RECORDS)} of {len(RECORDS)} images kept as their source bytes (JPEG {len(RECORDS)})" in notes
    assert report.codec_before == {"photos.tfrecord": "TFRecord", "photos.tfrecord.gz": "TFRecord (gzip)"}.get(
        name, "TFRecord (zlib)"
    )


@pytest.mark.slow
def test_the_hand_parser_agrees_with_tensorflow(tmp_path: Path) -> None:
    tf = pytest.importorskip("tensorflow")
    with open(DATA / "photos.tfrecord", "rb") as f:
        records = list(tfr.read_records(f, "photos.tfrecord"))
    assert len(records) == len(RECORDS)
    rng = np.random.default_rng(1)
    extra = tf.train.Example(
        features=tf.train.Features(
            feature={
                "big": tf.train.Feature(int64_list=tf.train.Int64List(value=[-(2**63), 2**63 - 1, -1, 0, 300])),
                "f": tf.train.Feature(float_list=tf.train.FloatList(value=rng.standard_normal(50).tolist())),
                "several": tf.train.Feature(bytes_list=tf.train.BytesList(value=[b"a", b"", b"\xff"])),
                "empty": tf.train.Feature(),
            }
        )
    ).SerializeToString()
    for record in [*records, extra]:
        mine = tfr.parse_example(record, "r")
        theirs = tf.train.Example.FromString(record).features.feature
        assert set(mine) == set(theirs)
        for name, feat in theirs.items():
            kind = feat.WhichOneof("kind")
            if kind == "bytes_list":
                values = list(feat.bytes_list.value)
                assert mine[name] == values[0] if len(values) == 1 else mine[name].reason.startswith("a list of 3")
            elif kind == "float_list":
                assert np.array_equal(mine[name], np.array(feat.float_list.value, np.float32))
            elif kind == "int64_list":
                assert np.array_equal(mine[name], np.array(feat.int64_list.value, np.int64))
            else:
                assert mine[name].reason.startswith("an empty feature")
    # a file TensorFlow writes now migrates like the committed ones, and the CRCs agree with TensorFlow's
    with tf.io.TFRecordWriter(str(tmp_path / "now.tfrecord")) as w:
        for record in records:
            w.write(record)
    assert (tmp_path / "now.tfrecord").read_bytes() == (DATA / "photos.tfrecord").read_bytes()


def test_crc32c() -> None:
    assert tfr.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert tfr.crc32c_python(b"123456789") == 0xE3069283
    data = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8).tobytes()
    assert tfr.crc32c_python(data) == tfr.crc32c(data)
    with open(DATA / "photos.tfrecord", "rb") as f:  # TensorFlow's masked CRC of the first length
        head = f.read(12)
    assert tfr.masked_crc32c(head[:8]) == struct.unpack("<I", head[8:])[0]


def test_without_google_crc32c_the_python_table_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hide_module(monkeypatch, "google_crc32c")
    tfr._crc_impl.cache_clear()
    try:
        report = migrate(DATA / "photos.tfrecord", tmp_path / "o.b2nd", progress=False)
        assert any("CRC32C checked in Python" in n for n in report.notes)
        assert tfr._crc_impl()[1] == "python"
    finally:
        tfr._crc_impl.cache_clear()


def test_packed_and_unpacked_lists_parse_alike() -> None:
    feats = {"i": ("int", [-7, 0, 2**40]), "f": ("float", [0.5, -2.25]), "b": ("bytes", [b"x"])}
    packed = tfr.parse_example(_example(feats, packed=True), "p")
    unpacked = tfr.parse_example(_example(feats, packed=False), "u")
    for name in feats:
        assert np.array_equal(packed[name], unpacked[name])
    assert packed["i"].tolist() == [-7, 0, 2**40] and packed["f"].dtype == np.float32
    long = tfr.parse_example(_example({"f": ("float", [0.5] * 20000)}), "l")  # never a field: not parsed
    assert long["f"].reason.endswith("more than a field holds")
    many = _example({f"f{i}": ("int", [i]) for i in range(tfr.MAX_FEATURES + 1)})
    with pytest.raises(tfr.ExampleError, match="more than 10000 features"):
        tfr.parse_example(many, "m")


def test_named_features_groups_and_the_cli(photo_patches, tmp_path: Path) -> None:
    imgs = photo_patches(6, size=(24, 24), seed=5)
    examples = [
        _example(
            {
                "img": ("bytes", [image_bytes(im, "PNG")]),
                "y": ("int", [i % 2]),
                "session": ("bytes", [f"s{i // 3}".encode()]),
                "id": ("bytes", [f"x/{i}".encode()]),
            }
        )
        for i, im in enumerate(imgs)
    ]
    src = _records_file(tmp_path / "a.tfrecord", examples)
    out = tmp_path / "o.b2nd"
    argv = ["migrate", str(src), str(out), "--labels", "y", "--keys", "id", "--groups", "session", "-q"]
    assert main(argv) == 0
    s = carraystore.open(out)
    assert np.array_equal(s[:], imgs) and list(s.labels) == [0, 1, 0, 1, 0, 1]
    assert list(s.keys) == [f"x/{i}" for i in range(6)] and s.columns == {}
    assert [s.group_names[g] for g in s.groups] == ["s0"] * 3 + ["s1"] * 3


def test_tfds_folder_splits_and_class_names_file(photo_patches, tmp_path: Path) -> None:
    from carraystore.migrations.core import migrate_splits

    src = tmp_path / "mnistlike" / "1.0.0"
    src.mkdir(parents=True)
    imgs = photo_patches(5, size=(16, 16), seed=2)
    _records_file(
        src / "ds-train.tfrecord-00000-of-00001",
        [
            _example({"image": ("bytes", [image_bytes(im, "PNG")]), "label": ("int", [i % 2])})
            for i, im in enumerate(imgs[:3])
        ],
    )
    _records_file(
        src / "ds-test.tfrecord-00000-of-00001",
        [_example({"image": ("bytes", [image_bytes(im, "PNG")]), "label": ("int", [1])}) for im in imgs[3:]],
    )
    (src / "label.labels.txt").write_text("cat\ndog\n")
    reports = migrate_splits(src, tmp_path / "out", progress=False)
    assert sorted(reports) == ["test", "train"]
    train, test = carraystore.open(tmp_path / "out" / "train.b2nd"), carraystore.open(tmp_path / "out" / "test.b2nd")
    assert np.array_equal(train[:], imgs[:3]) and np.array_equal(test[:], imgs[3:])
    assert train.class_names == test.class_names == ("cat", "dog")
    with pytest.raises(carraystore.base.errors.MigrationError, match="holds the splits"):
        migrate(src, tmp_path / "one.b2nd", progress=False)


# -- hostile records -------------------------------------------------------------------------------


@pytest.fixture
def good(photo_patches) -> bytes:
    imgs = photo_patches(3, size=(16, 16), seed=9)
    return b"".join(_frame(_photo_example(im, i)) for i, im in enumerate(imgs))


def _migrate_bytes(tmp_path: Path, data: bytes, name: str = "bad.tfrecord") -> None:
    (tmp_path / name).write_bytes(data)
    migrate(tmp_path / name, tmp_path / "o.b2nd", progress=False)


def test_bad_crcs_are_named(good: bytes, tmp_path: Path) -> None:
    broken = bytearray(good)
    broken[40] ^= 0x01  # inside the first record's data
    with pytest.raises(SourceChecksumError, match="record 0: the data's CRC32C"):
        _migrate_bytes(tmp_path, bytes(broken))
    first = struct.unpack("<Q", good[:8])[0] + 16
    broken = bytearray(good)
    broken[first] ^= 0x01  # the second record's length
    with pytest.raises(SourceChecksumError, match="record 1: the length's CRC32C"):
        _migrate_bytes(tmp_path, bytes(broken))
    assert not (tmp_path / "o.b2nd").exists()


def test_truncated_records_are_named(good: bytes, tmp_path: Path) -> None:
    with pytest.raises(TruncatedSourceError, match="record 2: ends inside its data"):
        _migrate_bytes(tmp_path, good[:-30])
    with pytest.raises(TruncatedSourceError, match="ends inside a record's header"):
        _migrate_bytes(tmp_path, good + good[:5])
    with pytest.raises(TruncatedSourceError, match="cut short"):
        _migrate_bytes(tmp_path, gzip.compress(good)[:-20], "bad.tfrecord.gz")
    with pytest.raises(TruncatedSourceError, match="ZLIB stream is cut short"):
        _migrate_bytes(tmp_path, zlib.compress(good)[:-20], "bad.tfrecord.zz")


def test_a_record_claiming_a_huge_length_is_refused_unread(good: bytes, tmp_path: Path) -> None:
    n = struct.pack("<Q", 1 << 40)
    with pytest.raises(SourceFormatError, match="refused unread"):
        _migrate_bytes(tmp_path, good + n + struct.pack("<I", tfr.masked_crc32c(n)) + b"\0" * 64)


def test_records_that_are_not_examples(good: bytes, tmp_path: Path) -> None:
    seq = _field(2, 2, b"")  # a SequenceExample's feature_lists field
    with pytest.raises(tfr.ExampleError, match="not a tf.train.Example"):
        _migrate_bytes(tmp_path, good + _frame(seq))
    with pytest.raises(tfr.ExampleError, match="varint"):
        _migrate_bytes(tmp_path, good + _frame(b"\x0a" + b"\xff" * 11))
    with pytest.raises(tfr.ExampleError, match="runs past the end"):
        _migrate_bytes(tmp_path, good + _frame(b"\x0a\x40abc"))


def test_images_that_are_not_images_and_bombs(good: bytes, tmp_path: Path) -> None:
    bad = _example({"image/encoded": ("bytes", [b"GIF89a but not really"]), "image/class/label": ("int", [0])})
    with pytest.raises(SourceImageError, match="record 3"):
        _migrate_bytes(tmp_path, good + _frame(bad))
    bomb = _example({"image/encoded": ("bytes", [_bomb_png()]), "image/class/label": ("int", [0])})
    with pytest.raises(SourceImageError, match="decompression bomb"):
        _migrate_bytes(tmp_path, good + _frame(bomb))
    negative = _example(
        {
            "image/encoded": ("bytes", [image_bytes(np.zeros((16, 16, 3), np.uint8), "PNG")]),
            "image/class/label": ("int", [-1]),
        }
    )
    report_src = tmp_path / "neg.tfrecord"
    report_src.write_bytes(good + _frame(negative))
    report = migrate(report_src, tmp_path / "n.b2nd", progress=False)  # a -1 label: kept as a field, said
    assert not report.labels and report.fields == {"image/class/label": "int64"}
    assert any("1 of 4 samples have no class label" in n for n in report.notes)
    assert os.path.exists(tmp_path / "n.b2nd")
