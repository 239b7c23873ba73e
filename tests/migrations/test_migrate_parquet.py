"""Parquet and Arrow image tables (written by pyarrow with Hugging Face ``datasets``' schema metadata) into stores."""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers import hide_module, image_bytes, pillow_pixels

import carraystore
from carraystore.base.errors import MigrationError, MissingDependencyError
from carraystore.cli.main import main
from carraystore.migrations import migrate
from carraystore.migrations.core import migrate_splits
from carraystore.migrations.samples import MixedTypesError, SourceImageError, TruncatedSourceError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

CLASSES = ["astronaut", "coffee", "rocket"]
IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def _hf_metadata(image: str = "image", label: str = "label") -> dict[bytes, bytes]:
    """The schema metadata ``datasets`` writes: the features under the ``huggingface`` key."""
    features = {
        image: {"decode": True, "id": None, "_type": "Image"},
        label: {"names": CLASSES, "id": None, "_type": "ClassLabel"},
        "score": {"dtype": "float32", "id": None, "_type": "Value"},
    }
    info = {"features": features, "description": "crops of scikit-image's photos", "license": "BSD-3-Clause"}
    return {b"huggingface": json.dumps({"info": info}).encode()}


def _table(photos: np.ndarray, start: int, labels: list[int] | None = None, fmt: str = "JPEG") -> pa.Table:
    n = len(photos)
    data = [image_bytes(p, fmt, **({"quality": 90} if fmt == "JPEG" else {})) for p in photos]
    t = pa.table(
        {
            "image": pa.array(
                [{"bytes": b, "path": f"/home/me/.cache/photos/{start + i:04d}.jpg"} for i, b in enumerate(data)],
                type=IMAGE,
            ),
            "label": pa.array(labels if labels is not None else [(start + i) % 3 for i in range(n)], pa.int64()),
            "score": pa.array(np.linspace(0, 1, n, dtype=np.float32) + start),
            "emb": pa.array([[float(start + i), -1.0] for i in range(n)], pa.list_(pa.float32(), 2)),
            "name": pa.array([f"photo {start + i}" for i in range(n)]),
            "tags": pa.array([["a"] * (i % 3) for i in range(n)], pa.list_(pa.string())),
        }
    )
    return t.replace_schema_metadata(_hf_metadata())


def _bomb_png(w: int = 30000, h: int = 30000) -> bytes:
    """A PNG whose header claims w x h pixels (far beyond Pillow's MAX_IMAGE_PIXELS), with no pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", w, h, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def _check(store: carraystore.Store, table: pa.Table) -> None:
    rows = table.to_pylist()
    assert len(store) == len(rows)
    for i, r in enumerate(rows):
        assert np.array_equal(store[i], pillow_pixels(r["image"]["bytes"])), i
    assert list(store.labels) == [r["label"] for r in rows]
    assert store.class_names == tuple(CLASSES)
    assert list(store.keys) == [Path(r["image"]["path"]).name for r in rows]  # relative to the common folder
    assert np.array_equal(store.columns["score"], np.array([r["score"] for r in rows], np.float32))
    assert np.array_equal(store.columns["emb"], np.array([r["emb"] for r in rows], np.float32))
    assert list(store.columns["name"]) == [r["name"] for r in rows]


@pytest.fixture(scope="module")
def hub(photo_patches, tmp_path_factory) -> tuple[Path, dict[str, pa.Table]]:
    """The Hub's layout: data/train-0000x-of-00002.parquet, data/test-00000-of-00001.parquet."""
    root = tmp_path_factory.mktemp("hub")
    (root / "data").mkdir()
    photos = photo_patches(12, size=(32, 32), seed=4)
    parts = [_table(photos[:5], 0), _table(photos[5:9], 5), _table(photos[9:], 9)]
    pq.write_table(parts[0], root / "data" / "train-00000-of-00002.parquet")
    pq.write_table(parts[1], root / "data" / "train-00001-of-00002.parquet", row_group_size=3)
    pq.write_table(parts[2], root / "data" / "test-00000-of-00001.parquet")
    return root, {"train": pa.concat_tables(parts[:2]), "test": parts[2]}


def test_hub_parquet_splits_migrate_every_sample(hub, tmp_path: Path, capsys) -> None:
    root, tables = hub
    assert main(["migrate", str(root), str(tmp_path / "stores")]) == 0
    printed = capsys.readouterr().out
    assert "split 'train'" in printed and "split 'test'" in printed
    for split, table in tables.items():
        s = carraystore.open(tmp_path / "stores" / f"{split}.b2nd")
        _check(s, table)
        assert s.attrs == {"description": "crops of scikit-image's photos", "license": "BSD-3-Clause"}
    assert "not migrated: column 'tags' (a list of string values" in printed
    assert "class names from the source's metadata: ['astronaut', 'coffee', 'rocket']" in printed
    assert main(["migrate", str(root), str(tmp_path / "one.b2nd")]) == 2  # two splits, one .b2nd
    assert "--group NAME" in capsys.readouterr().err
    report = migrate(root, tmp_path / "test.b2nd", group="test", progress=False)
    _check(carraystore.open(tmp_path / "test.b2nd"), tables["test"])
    assert report.kind == "Parquet" and report.rows == 3


def test_encoded_layout_keeps_the_image_bytes(hub, tmp_path: Path) -> None:
    root, tables = hub
    train = root / "data" / "train-00000-of-00002.parquet"
    report = migrate(train, tmp_path / "e.b2nd", layout="encoded", progress=False)
    s = carraystore.open(tmp_path / "e.b2nd")
    rows = pq.read_table(train).to_pylist()
    assert [s.entry(i) for i in range(len(s))] == [r["image"]["bytes"] for r in rows]
    _check(s, pq.read_table(train))
    assert any("5 of 5 images kept as their source bytes (JPEG 5)" in n for n in report.notes)


def _arrow_stream(path: Path, table: pa.Table) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table, max_chunksize=2)


def test_save_to_disk_folders(photo_patches, tmp_path: Path) -> None:
    """``DatasetDict.save_to_disk``: dataset_dict.json, one folder per split of Arrow streams and state.json."""
    root = tmp_path / "saved"
    photos = photo_patches(7, size=(24, 24), seed=6)
    tables = {"train": _table(photos[:4], 0, fmt="PNG"), "validation": _table(photos[4:], 4, fmt="PNG")}
    root.mkdir()
    (root / "dataset_dict.json").write_text(json.dumps({"splits": list(tables)}))
    for split, t in tables.items():
        (root / split).mkdir()
        _arrow_stream(root / split / "data-00000-of-00001.arrow", t)
        (root / split / "state.json").write_text(
            json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]})
        )
        (root / split / "dataset_info.json").write_text("{}")
    reports = migrate_splits(root, tmp_path / "out", layout="encoded", progress=False)
    assert sorted(reports) == ["train", "validation"]
    for split, t in tables.items():
        s = carraystore.open(tmp_path / "out" / f"{split}.b2nd")
        _check(s, t)
        assert [s.entry(i) for i in range(len(s))] == [r["image"]["bytes"] for r in t.to_pylist()]
        assert reports[split].kind == "Arrow"
    migrate(root / "validation", tmp_path / "v.b2nd", progress=False)  # one split's folder alone
    _check(carraystore.open(tmp_path / "v.b2nd"), tables["validation"])


def test_a_plain_binary_column_without_metadata(photo_patches, tmp_path: Path) -> None:
    photos = photo_patches(4, size=(16, 16), seed=1)
    data = [image_bytes(p, "PNG") for p in photos]
    t = pa.table({"img": pa.array(data, pa.binary()), "label": [2, 0, 1, 2], "video": ["a", "a", "b", "b"]})
    pq.write_table(t, tmp_path / "t.parquet")
    report = migrate(tmp_path / "t.parquet", tmp_path / "o.b2nd", groups="video", progress=False)
    s = carraystore.open(tmp_path / "o.b2nd")
    assert np.array_equal(s[:], photos) and list(s.labels) == [2, 0, 1, 2] and s.class_names is None
    assert [s.group_names[g] for g in s.groups] == ["a", "a", "b", "b"] and s.keys is None
    assert "images from column 'img' (PNG 4)" in report.notes


def test_minus_one_labels_are_kept_as_a_field(photo_patches, tmp_path: Path) -> None:
    t = _table(photo_patches(3, size=(16, 16), seed=2), 0, labels=[-1, -1, -1])
    pq.write_table(t, tmp_path / "test.parquet")
    report = migrate(tmp_path / "test.parquet", tmp_path / "o.b2nd", progress=False)
    assert not report.labels and report.fields["label"] == "int64"
    assert any("-1 means 'no label' in Hugging Face datasets" in n for n in report.notes)
    assert list(carraystore.open(tmp_path / "o.b2nd").columns["label"]) == [-1, -1, -1]


# -- hostile tables ---------------------------------------------------------------------------------


def test_a_column_of_mixed_types_is_named(photo_patches, tmp_path: Path) -> None:
    photos = photo_patches(4, size=(16, 16), seed=3)
    (tmp_path / "mixed").mkdir()
    a = _table(photos[:2], 0)
    b = _table(photos[2:], 2).set_column(2, "score", pa.array(["high", "low"]))
    pq.write_table(a, tmp_path / "mixed" / "part-0.parquet")
    pq.write_table(b, tmp_path / "mixed" / "part-1.parquet")
    with pytest.raises(MixedTypesError, match=r"column 'score' is string in part-1.parquet but float in part-0"):
        migrate(tmp_path / "mixed", tmp_path / "o.b2nd", progress=False)
    union = pa.UnionArray.from_dense(
        pa.array([0, 1], pa.int8()), pa.array([0, 0], pa.int32()), [pa.array([1]), pa.array(["x"])]
    )
    t = pa.table({"image": a.column("image"), "value": union})
    with pa.OSFile(str(tmp_path / "u.arrow"), "wb") as sink, pa.ipc.new_file(sink, t.schema) as w:
        w.write_table(t)
    with pytest.raises(MixedTypesError, match="union"):
        migrate(tmp_path / "u.arrow", tmp_path / "o.b2nd", progress=False)
    assert not (tmp_path / "o.b2nd").exists()


def test_truncated_and_hostile_tables(photo_patches, tmp_path: Path) -> None:
    photos = photo_patches(3, size=(16, 16), seed=5)
    pq.write_table(_table(photos, 0), tmp_path / "t.parquet")
    whole = (tmp_path / "t.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(TruncatedSourceError, match="cut short"):
        migrate(tmp_path / "cut.parquet", tmp_path / "o.b2nd", progress=False)

    def with_images(images: list[dict]) -> Path:
        t = pa.table({"image": pa.array(images, type=IMAGE), "label": [0] * len(images)})
        pq.write_table(t.replace_schema_metadata(_hf_metadata()), tmp_path / "h.parquet")
        return tmp_path / "h.parquet"

    ok = {"bytes": image_bytes(photos[0], "PNG"), "path": None}
    with pytest.raises(SourceImageError, match="not embedded.*'photos/2.jpg'"):
        migrate(with_images([ok, {"bytes": None, "path": "photos/2.jpg"}]), tmp_path / "o.b2nd", progress=False)
    with pytest.raises(SourceImageError, match="row 1, column 'image': not an image"):
        migrate(with_images([ok, {"bytes": b"not an image at all", "path": None}]), tmp_path / "o.b2nd", progress=False)
    with pytest.raises(SourceImageError, match="decompression bomb"):
        migrate(with_images([ok, {"bytes": _bomb_png(), "path": None}]), tmp_path / "o.b2nd", progress=False)
    other = {"bytes": image_bytes(photo_patches(1, size=(8, 8))[0], "PNG"), "path": None}
    with pytest.raises(MigrationError, match="8x8 pixels.*--image-size"):
        migrate(with_images([ok, other]), tmp_path / "o.b2nd", progress=False)
    assert not (tmp_path / "o.b2nd").exists()


def test_without_pyarrow_the_error_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pq.write_table(pa.table({"x": [1]}), tmp_path / "t.parquet")
    hide_module(monkeypatch, "pyarrow")
    with pytest.raises(MissingDependencyError, match=r"carraystore\[migrate\]"):
        migrate(tmp_path / "t.parquet", tmp_path / "o.b2nd", progress=False)
