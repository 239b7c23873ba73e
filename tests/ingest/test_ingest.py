"""Ingest of real JPEG/PNG folders: Keras conventions, shuffled write, bad files, splits."""

from __future__ import annotations

import inspect
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import pillow_pixels
from PIL import Image

import carraystore
from carraystore.base.errors import IngestError, InvalidInputError
from carraystore.ingest.images import DECODE_OPTION_FIELDS, INTERPOLATIONS, DecodeKwargs, list_images
from carraystore.ingest.run import from_directory
from carraystore.ingest.sample_data import make_photo_folder
from carraystore.store.options import WRITE_OPTION_FIELDS

CLASSES = ["astronaut", "chelsea", "coffee", "rocket"]


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """84 real-photo JPEGs of 64x64 in four class folders."""
    return make_photo_folder(tmp_path_factory.mktemp("photos"), n=84, size=(64, 64), classes=CLASSES, seed=3)


def test_labels_keys_and_pixels_match_the_files(photos: Path, tmp_path: Path) -> None:
    out = tmp_path / "s.b2nd"
    res = from_directory(photos, out, workers=1)
    store = carraystore.open(out)
    files = sorted(p.relative_to(photos).as_posix() for p in photos.rglob("*.jpg"))
    assert res.nimages == len(files) == len(store)
    assert store.class_names == tuple(CLASSES)
    assert sorted(store.keys) == files  # every file exactly once
    for i, key in enumerate(store.keys):
        assert store.labels[i] == CLASSES.index(key.split("/")[0])
        np.testing.assert_array_equal(store[i], pillow_pixels(photos / key))
    assert store.image_shape == (64, 64, 3) and store.color_mode == "rgb"
    # keys are relative; no absolute path of the source anywhere in the file
    assert str(photos).encode() not in out.read_bytes()


def test_seeded_shuffled_write_mixes_classes_and_keep_order_does_not(photos: Path, tmp_path: Path) -> None:
    a = carraystore.open(from_directory(photos, tmp_path / "a.b2nd", workers=1, chunk_images=12).path)
    b = carraystore.open(from_directory(photos, tmp_path / "b.b2nd", workers=1, chunk_images=12).path)
    c = carraystore.open(from_directory(photos, tmp_path / "c.b2nd", workers=1, seed=7, chunk_images=12).path)
    k = carraystore.open(from_directory(photos, tmp_path / "k.b2nd", workers=1, keep_order=True, chunk_images=12).path)
    assert list(a.keys) == list(b.keys)  # same seed, same order
    assert list(a.keys) != list(c.keys)  # another seed, another order
    assert list(k.keys) == sorted(k.keys)  # file order
    np.testing.assert_array_equal(a[:], b[:])
    mixed = [len(set(a.labels[s:e].tolist())) for s, e in map(a.chunk_range, range(a.nchunks))]
    kept = [len(set(k.labels[s:e].tolist())) for s, e in map(k.chunk_range, range(k.nchunks))]
    assert min(mixed) >= 2, mixed  # every chunk of the shuffled store mixes classes
    assert min(kept) == 1  # sorted order keeps whole chunks of one class


def test_parallel_workers_give_the_same_store(photos: Path, tmp_path: Path) -> None:
    one = carraystore.open(from_directory(photos, tmp_path / "w1.b2nd", workers=1).path)
    two = carraystore.open(from_directory(photos, tmp_path / "w2.b2nd", workers=2).path)
    assert list(one.keys) == list(two.keys)
    np.testing.assert_array_equal(one.labels, two.labels)
    np.testing.assert_array_equal(one[:], two[:])


@pytest.mark.parametrize("interpolation", ["bilinear", "nearest", "bicubic", "area"])
def test_resize_and_color_modes_follow_pillow(photos: Path, tmp_path: Path, interpolation: str) -> None:
    out = tmp_path / "r.b2nd"
    from_directory(photos, out, workers=1, image_size=(32, 48), color_mode="grayscale", interpolation=interpolation)
    store = carraystore.open(out)
    assert store.image_shape == (32, 48, 1) and store.color_mode == "grayscale"
    resample = INTERPOLATIONS[interpolation]
    for i in (0, 5, len(store) - 1):
        with Image.open(photos / store.keys[i]) as img:
            want = np.asarray(img.convert("L").resize((48, 32), resample=resample))
        np.testing.assert_array_equal(store[i][..., 0], want)
    assert store.provenance["image_size"] == [32, 48]
    assert store.provenance["interpolation"] == interpolation


def test_crop_to_aspect_ratio_and_rgba(tmp_path: Path) -> None:
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 255, (40, 100, 3), dtype=np.uint8)
    Image.fromarray(arr).save(src / "wide.png")
    out = tmp_path / "c.b2nd"
    from_directory(
        tmp_path / "src",
        out,
        workers=1,
        image_size=(20, 20),
        crop_to_aspect_ratio=True,
        color_mode="rgba",
        interpolation="nearest",
    )
    store = carraystore.open(out)
    assert store.image_shape == (20, 20, 4)
    # the centred 40x40 window, then resized: the left and right 30 columns are dropped
    want = np.asarray(Image.fromarray(arr).convert("RGBA").resize((20, 20), Image.NEAREST, box=(30, 0, 70, 40)))
    np.testing.assert_array_equal(store[0], want)
    assert (store[0][..., 3] == 255).all()


def _bad_files(root: Path) -> dict[str, str]:
    """Write broken inputs into class folder 'bad'; returns name -> expected reason words."""
    bad = root / "bad"
    bad.mkdir()
    good = next(root.rglob("*.jpg")).read_bytes()
    (bad / "truncated.jpg").write_bytes(good[: len(good) // 3])
    (bad / "empty.jpg").write_bytes(b"")
    (bad / "notes.png").write_text("this is not an image\n")
    (bad / "garbage.jpg").write_bytes(os.urandom(2000))
    return {"truncated.jpg": "truncated", "empty.jpg": "empty", "notes.png": "cannot", "garbage.jpg": "cannot"}


def test_bad_files_fail_by_default_and_leave_nothing(photos: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(photos, src)
    _bad_files(src)
    out = tmp_path / "s.b2nd"
    with pytest.raises(IngestError) as exc:
        from_directory(src, out, workers=1)
    msg = str(exc.value)
    assert "bad/" in msg and "--on-error skip" in msg
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if "partial" in p.name]


def test_bad_files_are_skipped_and_listed(photos: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(photos, src)
    expected = _bad_files(src)
    (src / "README.txt").write_text("not an image, at the top level\n")
    out = tmp_path / "s.b2nd"
    res = from_directory(src, out, workers=2, on_error="skip", max_skipped=4)
    store = carraystore.open(out)
    n_good = len(list(photos.rglob("*.jpg")))
    assert len(store) == res.nimages == n_good
    skipped = {Path(p).name: r for p, r in res.skipped}
    assert set(skipped) == set(expected)
    for name, word in expected.items():
        assert word in skipped[name].lower(), (name, skipped[name])
    assert {Path(s["path"]).name for s in store.skipped} == set(expected)
    assert "README.txt" in res.ignored
    assert "bad" in store.class_names  # the folder is a class, even if all its files failed
    assert "skipped 4 file(s)" in res.summary()


def test_decompression_bomb_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    Image.new("1", (13000, 13000)).save(src / "bomb.png")  # 169 Mpx > Pillow's 89 Mpx limit
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(src / "ok.png")
    res = from_directory(tmp_path / "src", tmp_path / "s.b2nd", workers=1, on_error="skip", max_skipped=1)
    assert res.nimages == 1
    assert res.skipped[0][0] == "a/bomb.png" and "bomb" in res.skipped[0][1]


def test_mixed_sizes_need_image_size(photos: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    shutil.copytree(photos, src)
    Image.fromarray(np.zeros((50, 70, 3), np.uint8)).save(src / "rocket" / "odd.png")
    with pytest.raises(IngestError, match="--image-size"):
        from_directory(src, tmp_path / "s.b2nd", workers=1)
    res = from_directory(src, tmp_path / "r.b2nd", workers=1, image_size=(64, 64))
    assert res.nimages == len(list(photos.rglob("*.jpg"))) + 1


def test_split_dirs_share_class_names(tmp_path: Path) -> None:
    src = make_photo_folder(tmp_path / "src", n=40, size=(32, 32), classes=CLASSES, splits={"train": 0.75, "val": 0.25})
    shutil.rmtree(src / "val" / "chelsea")  # a class absent from one split
    res = from_directory(src, tmp_path / "out", split_dirs=True, workers=1)
    assert set(res) == {"train", "val"}
    train = carraystore.open(tmp_path / "out" / "train.b2nd")
    val = carraystore.open(tmp_path / "out" / "val.b2nd")
    assert train.class_names == val.class_names == tuple(CLASSES)
    for store in (train, val):
        for i, key in enumerate(store.keys):
            assert store.class_names[store.labels[i]] == key.split("/")[0]
    assert 1 not in set(val.labels.tolist())


def test_unlabelled_and_given_labels(photos: Path, tmp_path: Path) -> None:
    rels, _, _, _ = list_images(photos, labels=None)
    store = carraystore.open(from_directory(photos, tmp_path / "u.b2nd", labels=None, workers=1).path)
    assert store.labels is None and store.class_names is None and sorted(store.keys) == rels
    given = [i % 3 for i in range(len(rels))]
    store = carraystore.open(from_directory(photos, tmp_path / "g.b2nd", labels=given, workers=1, keep_order=True).path)
    np.testing.assert_array_equal(store.labels, given)
    with pytest.raises(IngestError, match="labels"):
        from_directory(photos, tmp_path / "x.b2nd", labels=given[:-1], workers=1)


def test_bad_options_are_clear(photos: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="gaussian"):
        from_directory(photos, tmp_path / "x.b2nd", image_size=(8, 8), interpolation="gaussian")
    with pytest.raises(InvalidInputError, match="color_mode"):
        from_directory(photos, tmp_path / "x.b2nd", color_mode="cmyk")
    with pytest.raises(IngestError, match="no image files"):
        (tmp_path / "empty" / "a").mkdir(parents=True)
        from_directory(tmp_path / "empty", tmp_path / "x.b2nd")
    from_directory(photos, tmp_path / "y.b2nd", workers=1)
    before = (tmp_path / "y.b2nd").read_bytes()
    with pytest.raises(carraystore.StoreExistsError):
        from_directory(photos, tmp_path / "y.b2nd", workers=1)
    assert (tmp_path / "y.b2nd").read_bytes() == before


def test_the_facade_is_the_ingest_itself() -> None:
    # carraystore.from_directory is the ingest function: its own parameters (client among them) and docstring
    from carraystore.ingest import run as ingest

    assert carraystore.from_directory is ingest.from_directory
    params = inspect.signature(carraystore.from_directory).parameters
    assert params["client"].kind is inspect.Parameter.KEYWORD_ONLY and params["client"].default is None
    assert {"labels", "validation_split", "append", "options"} <= set(params)
    # codec, chunk_images, ... and image_size, color_mode, ...: typed once, in WriteKwargs and DecodeKwargs
    assert params["kw"].annotation == "Unpack[IngestKwargs]"
    assert not set(params) & (set(WRITE_OPTION_FIELDS) | set(DECODE_OPTION_FIELDS))
    doc = carraystore.from_directory.__doc__ or ""
    assert doc.startswith("Ingest a folder of images into a store") and "``client``" in doc


def test_decode_kwargs_are_the_decode_options_fields() -> None:
    # the decode keywords of from_directory are DecodeOptions' fields; an ingest's keywords are write + decode
    from carraystore.ingest.run import IngestKwargs

    assert tuple(DecodeKwargs.__annotations__) == DECODE_OPTION_FIELDS and not DecodeKwargs.__required_keys__
    assert set(IngestKwargs.__annotations__) == set(WRITE_OPTION_FIELDS) | set(DECODE_OPTION_FIELDS)


def test_decode_keywords_reach_the_store_and_bad_ones_are_named(photos: Path, tmp_path: Path) -> None:
    out = tmp_path / "gray.b2nd"
    carraystore.from_directory(photos, out, image_size=[8, 12], color_mode="grayscale", dtype="uint16", workers=1)
    with carraystore.open(out) as s:
        assert s.shape[1:] == (8, 12, 1) and s.dtype == np.uint16
    with pytest.raises(carraystore.InvalidInputError, match="interpolation 'cubicle'"):
        carraystore.from_directory(photos, tmp_path / "x.b2nd", interpolation="cubicle")
    assert not (tmp_path / "x.b2nd").exists()


def test_a_runner_writes_each_planned_store(photos: Path, tmp_path: Path) -> None:
    # the hook the dask adapter uses: one StoreJob per store, the files already in write order
    from carraystore.ingest.run import IngestResult, StoreJob, run_locally

    jobs: list[StoreJob] = []

    def runner(job: StoreJob) -> IngestResult:
        jobs.append(job)
        return run_locally(job)

    out = tmp_path / "both"
    res = from_directory(photos, out, workers=1, validation_split=0.25, subset="both", seed=3, runner=runner)
    assert [j.plan.output for j in jobs] == [out / "training.b2nd", out / "validation.b2nd"]
    for job, part in zip(jobs, ("training", "validation"), strict=True):
        store = carraystore.open(job.plan.output)
        assert list(store.keys) == job.plan.rels and res[part].nimages == len(job.plan.rels)  # type: ignore[index]
    all_rels = list_images(photos)[0]
    train, val = jobs[0].plan.rels, jobs[1].plan.rels
    assert not set(train) & set(val) and sorted(train + val) == sorted(all_rels)
