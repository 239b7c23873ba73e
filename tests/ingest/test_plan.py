"""The plan of an ingest, checked without decoding a pixel: every image file here is a few
bytes that are not an image, so a plan that tried to decode one would fail."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import carraystore
from carraystore.base.errors import IngestError, InvalidInputError
from carraystore.ingest.append import plan_append
from carraystore.ingest.images import DecodeOptions
from carraystore.ingest.plan import plan_folder
from carraystore.store.options import WriteOptions


def _files(root: Path, *rels: str) -> Path:
    for rel in rels:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"not an image")
    return root


def test_class_folders_give_labels_class_names_and_a_seeded_order(tmp_path: Path) -> None:
    root = _files(tmp_path / "f", "cat/1.jpg", "cat/2.jpg", "dog/a.png", "dog/b.png", "dog/c.png", "notes.txt")
    plans = plan_folder(root, tmp_path / "o.b2nd", seed=3)
    assert list(plans) == [""]
    p = plans[""]
    assert p.class_names == ("cat", "dog") and p.output == tmp_path / "o.b2nd"
    assert sorted(p.rels) == ["cat/1.jpg", "cat/2.jpg", "dog/a.png", "dog/b.png", "dog/c.png"]
    assert p.rels != sorted(p.rels)  # shuffled
    assert [p.class_names[int(v)] for v in p.labels] == [r.split("/")[0] for r in p.rels]  # type: ignore[union-attr]
    assert p.rels == plan_folder(root, tmp_path / "o.b2nd", seed=3)[""].rels  # the same seed, the same order
    assert p.ignored == ["notes.txt"] and p.groups is None and p.fields is None
    assert p.provenance["source"] == "f" and p.provenance["labels"] == "inferred" and p.provenance["seed"] == 3
    given = plan_folder(root, tmp_path / "o.b2nd", class_names=["dog", "cat"], shuffle=False)[""]
    assert given.class_names == ("dog", "cat") and given.rels[:3] == ["dog/a.png", "dog/b.png", "dog/c.png"]
    assert given.labels.tolist() == [0, 0, 0, 1, 1]  # type: ignore[union-attr]


def test_frames_in_natural_order_with_groups(tmp_path: Path) -> None:
    rels = [f"walk/video_{v}/frame_{t}.png" for v in (2, 10) for t in (1, 2, 10)]
    root = _files(tmp_path / "v", *rels)
    p = plan_folder(root, tmp_path / "o.b2nd", shuffle=False)[""]
    assert p.rels == rels  # frame_2 before frame_10, video_2 before video_10
    assert p.groups == ["walk/video_2"] * 3 + ["walk/video_10"] * 3
    assert any("natural order" in n for n in p.notes)


def test_split_folders_share_class_names(tmp_path: Path) -> None:
    root = _files(tmp_path / "s", "train/cat/1.jpg", "train/dog/1.jpg", "val/dog/2.jpg")
    with pytest.raises(IngestError, match="look like dataset splits"):
        plan_folder(root, tmp_path / "o.b2nd")
    plans = plan_folder(root, tmp_path / "out", split_dirs=True)
    assert list(plans) == ["train", "val"]
    assert plans["val"].class_names == ("cat", "dog") and plans["val"].labels.tolist() == [1]  # type: ignore[union-attr]
    assert plans["train"].output == tmp_path / "out" / "train.b2nd" and plans["val"].root == root / "val"
    assert plans["val"].provenance["source"] == "s/val"
    url = plan_folder(root, "s3://bucket/data/", split_dirs=True)
    assert url["train"].output == "s3://bucket/data/train.b2nd"


def test_a_validation_split_keeps_groups_whole(tmp_path: Path) -> None:
    rels = [f"{c}/video_{v}/frame_{t}.png" for c in ("run", "walk") for v in range(4) for t in range(3)]
    root = _files(tmp_path / "v", *rels)
    plans = plan_folder(root, tmp_path / "out", validation_split=0.25, subset="both", seed=1)
    train, val = plans["training"], plans["validation"]
    assert train.output == tmp_path / "out" / "training.b2nd" and val.output == tmp_path / "out" / "validation.b2nd"
    assert sorted(train.rels + val.rels) == sorted(rels)
    assert not {g for g in train.groups or ()} & {g for g in val.groups or ()}
    assert val.provenance["split_by"] == "groups" and val.provenance["subset"] == "validation"
    only = plan_folder(root, tmp_path / "v.b2nd", validation_split=0.25, subset="validation", seed=1)
    assert list(only) == ["validation"] and sorted(only["validation"].rels) == sorted(val.rels)
    with pytest.raises(InvalidInputError, match="go together"):
        plan_folder(root, tmp_path / "o.b2nd", validation_split=0.25)


def test_a_manifest_gives_fields_and_groups(tmp_path: Path) -> None:
    root = _files(tmp_path / "m", "a.png", "b.png", "c.png")
    (tmp_path / "t.csv").write_text("file,angle,group\na.png,0.5,s1\nb.png,1.5,s1\nc.png,-2,s2\n")
    p = plan_folder(root, tmp_path / "o.b2nd", labels=None, targets=tmp_path / "t.csv", shuffle=False)[""]
    assert p.rels == ["a.png", "b.png", "c.png"] and p.labels is None
    assert p.groups == ["s1", "s1", "s2"] and p.provenance["targets"] == "t.csv"
    np.testing.assert_array_equal(p.columns_for(["c.png", "a.png"])["angle"], [-2.0, 0.5])  # type: ignore[index]
    floats = plan_folder(root, tmp_path / "o.b2nd", labels=[0.1, 0.2, 0.3], shuffle=False)[""]
    assert floats.labels is None and floats.provenance["labels"] == "given as field 'target'"
    np.testing.assert_allclose(floats.columns_for(["b.png"])["target"], [0.2])  # type: ignore[index]


def test_bad_names_are_dropped_or_refused_before_decoding(tmp_path: Path) -> None:
    root = _files(tmp_path / "n", "x/ok.png", "x/bad\nname.png")
    with pytest.raises(IngestError, match="cannot be a key"):
        plan_folder(root, tmp_path / "o.b2nd")
    p = plan_folder(root, tmp_path / "o.b2nd", on_error="skip", max_skipped=1)[""]
    assert p.rels == ["x/ok.png"] and len(p.skipped) == 1 and p.allowed == 1


def test_an_append_plan_comes_from_the_store(tmp_path: Path) -> None:
    store = tmp_path / "s.b2nd"
    with carraystore.create(store, (4, 4, 3), class_names=["cat"]) as w:
        w.append(np.zeros((1, 4, 4, 3), np.uint8), labels=[0], keys=["cat/1.jpg"])
    root = _files(tmp_path / "more", "cat/1.jpg", "cat/2.jpg", "dog/1.jpg")
    run = dict(labels="inferred", groups="inferred", shuffle=False, seed=0, follow_links=False, on_error="fail",
               targets=None, layout=None, quality=None)  # fmt: skip
    given = dict(image_size=None, color_mode=None, interpolation=None, crop_to_aspect_ratio=None, dtype=None)
    with pytest.raises(IngestError, match="already in the store"):
        plan_append(root, store, WriteOptions(), given, skip_existing=False, max_skipped=0, **run)  # type: ignore[arg-type]
    plan, writer, opts = plan_append(root, store, WriteOptions(), given, skip_existing=True, max_skipped=0, **run)  # type: ignore[arg-type]
    try:
        assert plan.rels == ["cat/2.jpg", "dog/1.jpg"] and plan.labels.tolist() == [0, 1]  # type: ignore[union-attr]
        assert plan.class_names == ("cat", "dog") and opts.image_size == (4, 4) and opts.color_mode == "rgb"
        assert any("new classes" in n for n in plan.notes) and any("skipped 1" in n for n in plan.notes)
    finally:
        writer.abort()
    with pytest.raises(InvalidInputError, match="color_mode='grayscale'"):
        plan_append(
            root,
            store,
            WriteOptions(),
            given | {"color_mode": "grayscale"},
            skip_existing=True,
            max_skipped=0,
            **run,  # type: ignore[arg-type]
        )
    assert carraystore.open(store).class_names == ("cat",)  # nothing written


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"color_mode": "cmyk"}, "color_mode"),
        ({"interpolation": "gaussian"}, "no Pillow equivalent"),
        ({"image_size": (0, 3)}, "image_size must be"),
        ({"dtype": "float32"}, "dtype must be"),
    ],
)
def test_decode_options_check_themselves(given: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        DecodeOptions(**given)  # type: ignore[arg-type]
    assert DecodeOptions(image_size=[8, 9]).image_size == (8, 9)  # type: ignore[arg-type]
