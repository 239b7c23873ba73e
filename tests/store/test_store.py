"""The store file layer on real photographic pixels: round trips, indexing, portability, append, integrity."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blosc2
import numpy as np
import pytest

import carraystore
from carraystore.base.errors import (
    ChecksumError,
    CorruptStoreError,
    InvalidInputError,
    NotAStoreError,
    StoreExistsError,
)
from carraystore.format.codec import PRESETS, Codec, crc32, parse_chunk_header

CHUNK = 16  # images per chunk in the round-trip matrix
SIZE = (8, 8)  # pixels: small, so that the 10,000-image case stays fast
CLASSES = ("sky", "cat", "cup", "rocket", "other")


def _luminance(rgb: np.ndarray) -> np.ndarray:
    """ITU-R 601 luma as Pillow's convert('L') computes it, shape (..., 1)."""
    r, g, b = (rgb[..., i].astype(np.uint32) for i in range(3))
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).astype(np.uint8)[..., None]


def make_images(
    patches: Callable[..., np.ndarray], mode: str, n: int, size: tuple[int, int] = SIZE, seed: int = 0
) -> np.ndarray:
    """``n`` real-photo images in one of the colour modes / dtypes a store holds."""
    rgb = patches(n, size, seed)
    if mode == "rgb":
        return rgb
    if mode == "L":
        return _luminance(rgb)
    if mode == "rgba":  # alpha: the luminance of other patches, so it varies like a real matte
        return np.concatenate([rgb, _luminance(patches(n, size, seed + 1))], axis=-1)
    if mode == "uint16":  # 16 significant bits per pixel
        return (_luminance(rgb).astype(np.uint16) << 8) | _luminance(patches(n, size, seed + 1))
    if mode == "float32":
        return rgb.astype(np.float32) / np.float32(255)
    raise AssertionError(mode)


def write_store(
    path: Path, images: np.ndarray, *, pieces: int = 3, seed: int = 0, **kwargs: Any
) -> tuple[np.ndarray, list[str]]:
    """Write ``images`` with labels and keys in ``pieces`` uneven appends; return (labels, keys)."""
    n = len(images)
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(CLASSES), n)
    keys = [f"{CLASSES[lab]}/img_{i:05d}.jpg" for i, lab in enumerate(labels)]
    cuts = np.sort(rng.integers(0, n + 1, pieces - 1)) if n else np.zeros(0, dtype=int)
    kwargs.setdefault("class_names", CLASSES)
    with carraystore.create(path, images.shape[1:], dtype=images.dtype, **kwargs) as w:
        for a, b in zip([0, *cuts], [*cuts, n], strict=True):
            w.append(images[a:b], labels=labels[a:b], keys=keys[a:b])
    return labels, keys


def count_chunk_reads(store: carraystore.Store) -> list[int]:
    """Record the chunk index of every ``read_chunk`` call made on ``store`` from now on."""
    calls: list[int] = []
    original = store.read_chunk

    def counting(i: int, *args: Any, **kwargs: Any) -> np.ndarray:
        calls.append(int(i))
        return original(i, *args, **kwargs)

    store.read_chunk = counting  # type: ignore[method-assign]
    return calls


# -- round trips ---------------------------------------------------------------------------------


MODES = {
    "rgb": ((8, 8, 3), "uint8", "rgb"),
    "L": ((8, 8, 1), "uint8", "grayscale"),
    "rgba": ((8, 8, 4), "uint8", "rgba"),
    "uint16": ((8, 8, 1), "uint16", "grayscale"),
    "float32": ((8, 8, 3), "float32", "rgb"),
}


@pytest.mark.parametrize("n", [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 10_000])
@pytest.mark.parametrize("mode", list(MODES))
def test_round_trip_is_bit_exact(mode: str, n: int, tmp_path: Path, photo_patches: Callable[..., np.ndarray]) -> None:
    images = make_images(photo_patches, mode, n, seed=n)
    path = tmp_path / f"{mode}.b2nd"
    attrs = {"source": "sample photos", "n": n, "nested": {"list": [1, 2.5, "x"], "none": None}}
    labels, keys = write_store(path, images, chunk_images=CHUNK, attrs=attrs, seed=n)
    store = carraystore.open(path)
    image_shape, dtype, color_mode = MODES[mode]

    assert len(store) == n and store.shape == (n, *image_shape) and store.image_shape == image_shape
    assert store.dtype == np.dtype(dtype) and store.layout == "NHWC" and store.color_mode == color_mode
    assert store.chunk_images == CHUNK and store.nchunks == -(-n // CHUNK)
    assert store.class_names == CLASSES and store.attrs == attrs
    np.testing.assert_array_equal(store.labels, labels)
    assert store.labels.dtype == np.int64
    if n:
        assert list(store.keys) == keys
    else:
        assert store.keys is None or len(store.keys) == 0

    everything = store[:]
    assert everything.dtype == images.dtype and everything.shape == images.shape
    assert np.array_equal(everything, images)  # bit-exact (float32 too: no NaNs in photos)
    assert np.array_equal(blosc2.open(str(path), mode="r")[:], images)  # plain blosc2 reads the same pixels
    assert store.verify() == []
    if not n:
        assert store[0:0].shape == (0, *image_shape)
        with pytest.raises(IndexError):
            store[0]
        return

    for i in {0, n - 1, n // 2, -1, -n}:
        assert np.array_equal(store[i], images[i])
    for sl in [slice(0, 1), slice(n // 3, n - n // 4), slice(None, None, 3), slice(n - 1, None, -2), slice(-5, None)]:
        assert np.array_equal(store[sl], images[sl])
    for i in range(store.nchunks):
        a, b = store.chunk_range(i)
        assert np.array_equal(store.read_chunk(i), images[a:b])
    assert np.array_equal(np.concatenate(list(store.iter_chunks())), images)
    if n <= 2 * CHUNK:
        assert np.array_equal(np.stack(list(store)), images)  # iteration, image by image

    # fancy indexing: any order, repeats, negatives; every needed chunk read exactly once
    rng = np.random.default_rng(1)
    idx = rng.integers(-n, n, size=min(n, 300) + 3)
    calls = count_chunk_reads(store)
    got = store[idx]
    assert np.array_equal(got, images[idx])
    needed = sorted({int(i) % n // CHUNK for i in idx})
    assert sorted(calls) == needed, "each needed chunk is read once, others not at all"
    mask = rng.random(n) < 0.3
    assert np.array_equal(store[mask], images[mask])


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("mode", ["rgb", "L", "rgba", "uint16"])
def test_every_preset_round_trips_with_several_blocks_per_chunk(
    preset: str, mode: str, tmp_path: Path, photo_patches: Callable[..., np.ndarray]
) -> None:
    images = make_images(photo_patches, mode, 3 * 12 + 5, size=(12, 10))
    path = tmp_path / "s.b2nd"
    codec = PRESETS[preset]
    codec = Codec.from_config({**codec.to_config(), "block_images": 3})
    write_store(path, images, codec=codec, chunk_images=12)
    store = carraystore.open(path)
    assert store.codec.block_images == 3 and store.codec.codec == PRESETS[preset].codec
    assert np.array_equal(store[:], images)
    assert np.array_equal(blosc2.open(str(path), mode="r")[:], images)
    header = parse_chunk_header(store.read_chunk_bytes(0))
    assert header.blocksize == 3 * images[0].nbytes and header.typesize == store.codec.typesize
    assert store.verify() == []


def test_a_store_of_photos_from_jpeg_files(
    photo_arrays: tuple[np.ndarray, np.ndarray, list[str]], tmp_path: Path
) -> None:
    """Decoded JPEG files (64x64 RGB), their labels and relative paths survive a round trip."""
    images, labels, keys = photo_arrays
    with carraystore.create(
        tmp_path / "p.b2nd", images.shape[1:], chunk_images=10, class_names=["a", "b", "c", "d"]
    ) as w:
        w.append(images, labels=labels, keys=keys)
    store = carraystore.open(tmp_path / "p.b2nd")
    assert np.array_equal(store[:], images) and np.array_equal(store.labels, labels) and list(store.keys) == keys


# -- generic arrays and columns ---------------------------------------------------------------------


def test_array_layout_one_dimensional_ints(tmp_path: Path, photo_patches: Callable[..., np.ndarray]) -> None:
    values = photo_patches(1000, (8, 8)).reshape(1000, -1).astype(np.int64).sum(axis=1) * -3  # negatives too
    with carraystore.create(tmp_path / "ints.b2nd", (), dtype="int64", chunk_images=64) as w:
        w.append(values[:500])
        w.append(values[500:])
    store = carraystore.open(tmp_path / "ints.b2nd")
    assert store.layout == "array" and store.shape == (1000,) and store.image_shape == () and store.color_mode == ""
    assert np.array_equal(store[:], values) and store[:].dtype == np.int64
    assert store[7] == values[7] and np.array_equal(store[[999, 0, 64, 63]], values[[999, 0, 64, 63]])
    assert np.array_equal(blosc2.open(str(tmp_path / "ints.b2nd"), mode="r")[:], values)
    assert store.verify() == []


def _records(photo_patches: Callable[..., np.ndarray], n: int) -> np.ndarray:
    """Per-image records built from real patches: a structured dtype with padding, sub-arrays,
    a big-endian field, datetimes, fixed bytes and unicode strings, and a nested record."""
    dt = np.dtype(
        {
            "names": ["label", "key", "mean", "when", "checksum", "name", "box"],
            "formats": ["<i2", "S20", ("<f4", (3,)), "<M8[ms]", ">u4", "<U6", np.dtype([("y", "<u2"), ("x", "<u2")])],
            "offsets": [0, 4, 24, 40, 48, 52, 80],
            "itemsize": 88,
        }
    )
    patches = photo_patches(n, (8, 8), 5)
    rec = np.zeros(n, dtype=dt)
    rec["label"] = np.arange(n) % 7 - 3
    rec["key"] = [f"photos/{i:06d}.jpg".encode() for i in range(n)]
    rec["mean"] = patches.reshape(n, -1, 3).mean(axis=1)
    rec["when"] = np.datetime64("2024-05-01T12:00:00.000") + np.arange(n) * np.timedelta64(1537, "ms")
    rec["checksum"] = [crc32(p.tobytes()) for p in patches]
    rec["name"] = [("äbc", "cat", "日本")[i % 3] for i in range(n)]
    rec["box"]["y"] = patches[:, 0, 0, 0]
    rec["box"]["x"] = patches[:, 0, 0, 1]
    return rec


def test_array_layout_structured_records(tmp_path: Path, photo_patches: Callable[..., np.ndarray]) -> None:
    rec = _records(photo_patches, 203)
    path = tmp_path / "rec.b2nd"
    with carraystore.create(path, (), dtype=rec.dtype, chunk_images=50) as w:
        w.append(rec[:120])
        w.append(rec[120:])
    store = carraystore.open(path)
    assert store.layout == "array" and store.dtype == rec.dtype  # offsets and itemsize (padding) kept
    assert store.dtype.itemsize == 88 and store.dtype.fields["checksum"][0].byteorder == ">"
    got = store[:]
    assert got.tobytes() == rec.tobytes()  # bit-exact, padding bytes included
    assert np.array_equal(store[[202, 5, 5]], rec[[202, 5, 5]]) and store[-1] == rec[-1]
    assert np.array_equal(blosc2.open(str(path), mode="r")[:], rec)
    assert store.verify() == []


def test_array_layout_float64_nd_and_kept_shape(tmp_path: Path, photo_patches: Callable[..., np.ndarray]) -> None:
    p = photo_patches(300, (8, 8), 9).astype(np.float64) / 255
    stats = np.stack(
        [p.mean(axis=(1, 2)), p.std(axis=(1, 2)), p.min(axis=(1, 2)), p.max(axis=(1, 2)), np.median(p, axis=(1, 2))],
        axis=1,
    )
    assert stats.shape == (300, 5, 3)
    with carraystore.create(tmp_path / "f.b2nd", (5, 3), dtype="float64", chunk_images=32) as w:
        w.append(stats)
    store = carraystore.open(tmp_path / "f.b2nd")
    assert store.layout == "array" and store.shape == (300, 5, 3) and store[:].tobytes() == stats.tobytes()

    gray = _luminance(photo_patches(40, (6, 9)))[..., 0].astype(np.uint16) * 257  # (40, 6, 9) uint16
    with carraystore.create(tmp_path / "g.b2nd", (6, 9), dtype="uint16", layout="array", chunk_images=8) as w:
        w.append(gray)
    kept = carraystore.open(tmp_path / "g.b2nd")
    assert kept.layout == "array" and kept.shape == (40, 6, 9) and np.array_equal(kept[:], gray)
    with carraystore.create(tmp_path / "h.b2nd", (6, 9), dtype="uint16", chunk_images=8) as w:
        w.append(gray)
    assert carraystore.open(tmp_path / "h.b2nd").shape == (40, 6, 9, 1)  # image layout adds C = 1


def test_object_dtypes_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="object"):
        carraystore.create(tmp_path / "o.b2nd", (), dtype=object)
    assert not list(tmp_path.iterdir())


def test_columns_round_trip_and_must_stay_consistent(tmp_path: Path, photo_patches: Callable[..., np.ndarray]) -> None:
    images = make_images(photo_patches, "rgb", 45)
    mean = images.reshape(45, -1, 3).mean(axis=1).astype(np.float32)
    source = np.array([f"clip{i // 10:02d}".encode() for i in range(45)], dtype="S8")
    frame = (np.arange(45) % 10).astype(np.int32)
    path = tmp_path / "c.b2nd"
    with carraystore.create(path, images.shape[1:], chunk_images=CHUNK) as w:
        w.append(images[:20], columns={"mean": mean[:20], "source": source[:20], "frame": frame[:20]})
        with pytest.raises(InvalidInputError, match="columns"):
            w.append(images[20:25], columns={"mean": mean[20:25]})
        with pytest.raises(InvalidInputError, match="'mean'"):
            w.append(
                images[20:25],
                columns={"mean": mean[20:25].astype(np.float64), "source": source[20:25], "frame": frame[20:25]},
            )
        with pytest.raises(InvalidInputError, match="'frame'"):
            w.append(images[20:25], columns={"mean": mean[20:25], "source": source[20:25], "frame": frame[20:24]})
        w.append(images[20:], columns={"mean": mean[20:], "source": source[20:], "frame": frame[20:]})
    store = carraystore.open(path)
    assert np.array_equal(store[:], images)
    assert set(store.columns) == {"mean", "source", "frame"}
    for name, col in {"mean": mean, "source": source, "frame": frame}.items():
        assert store.columns[name].dtype == col.dtype and np.array_equal(store.columns[name], col)
    more = make_images(photo_patches, "rgb", 3, seed=4)
    with pytest.raises(InvalidInputError, match="columns"), carraystore.append(path) as w:
        w.append(more)
    with carraystore.append(path) as w:
        w.append(more, columns={"mean": mean[:3], "source": source[:3], "frame": frame[:3]})
    store = carraystore.open(path)
    assert len(store) == 48 and np.array_equal(store.columns["frame"], np.concatenate([frame, frame[:3]]))


# -- portability ---------------------------------------------------------------------------------------


def test_a_copied_or_moved_store_opens_identically_and_holds_no_absolute_path(
    tmp_path: Path, photo_arrays: tuple[np.ndarray, np.ndarray, list[str]]
) -> None:
    images, labels, keys = photo_arrays
    made = tmp_path / "made_here" / "deep"
    made.mkdir(parents=True)
    path = made / "train.b2nd"
    with carraystore.create(
        path, images.shape[1:], chunk_images=8, class_names=["a", "b", "c", "d"], provenance={"source": "photos"}
    ) as w:
        w.append(images, labels=labels, keys=keys)
    raw = path.read_bytes()
    for needle in (str(tmp_path), str(made), "made_here", ".partial"):
        assert needle.encode() not in raw, f"{needle!r} found inside the store file"

    copied = tmp_path / "elsewhere" / "copy.b2nd"
    copied.parent.mkdir()
    shutil.copy(path, copied)
    moved_dir = tmp_path / "other"
    moved_dir.mkdir()
    moved = moved_dir / "moved.b2nd"
    os.rename(path, moved)  # the original path is gone
    for p in (copied, moved):
        store = carraystore.open(p)
        assert np.array_equal(store[:], images) and np.array_equal(store.labels, labels) and list(store.keys) == keys
        assert store.verify() == []


@pytest.mark.parametrize(
    "bad_key",
    [
        "/home/me/photos/cat/1.jpg",
        "C:\\data\\cat\\1.jpg",
        "c:/data/1.jpg",
        "~/photos/1.jpg",
        "../cat/1.jpg",
        "cat/../../1.jpg",
        "cat\\..\\..\\1.jpg",
        "",
        "a\x00b",
    ],
)
def test_absolute_and_climbing_keys_are_refused(
    bad_key: str, tmp_path: Path, photo_patches: Callable[..., np.ndarray]
) -> None:
    images = make_images(photo_patches, "rgb", 3)
    path = tmp_path / "k.b2nd"
    with pytest.raises(InvalidInputError) as info, carraystore.create(path, images.shape[1:]) as w:
        w.append(images, keys=["cat/0.jpg", bad_key, "cat/2.jpg"])
    assert repr(bad_key) in str(info.value)
    assert not path.exists() and list(tmp_path.iterdir()) == []  # nothing half-written


def test_backslashes_separate_folders_only_on_windows(tmp_path: Path, photo_patches: Callable[..., np.ndarray]) -> None:
    images = make_images(photo_patches, "L", 2)
    with carraystore.create(tmp_path / "w.b2nd", images.shape[1:]) as w:
        w.append(images, keys=["cat\\a.jpg", "dog/b.jpg"])
    # on POSIX `cat\a.jpg` is one file name; on Windows it is cat/a.jpg
    first = "cat/a.jpg" if os.sep == "\\" else "cat\\a.jpg"
    assert list(carraystore.open(tmp_path / "w.b2nd").keys) == [first, "dog/b.jpg"]


# -- writer behaviour ------------------------------------------------------------------------------


def test_nothing_at_the_path_until_close(tmp_path: Path, photo_patches: Callable[..., np.ndarray]) -> None:
    images = make_images(photo_patches, "rgb", 40)
    path = tmp_path / "s.b2nd"
    w = carraystore.create(path, images.shape[1:], chunk_images=CHUNK)
    w.append(images)
    assert not path.exists()
    partials = sorted(p.name for p in tmp_path.iterdir())
    # the writer's lock file, and the temporary file the store is written into
    assert len(partials) == 2 and partials[0] == ".s.b2nd.lock" and partials[1].startswith(".s.b2nd.partial-")
    w.close()
    assert [p.name for p in tmp_path.iterdir()] == ["s.b2nd"]
    assert np.array_equal(carraystore.open(path)[:], images)


def test_an_error_inside_with_leaves_the_old_store(tmp_path: Path, photo_patches: Callable[..., np.ndarray]) -> None:
    images = make_images(photo_patches, "rgb", 20)
    path = tmp_path / "s.b2nd"
    write_store(path, images, chunk_images=CHUNK)
    before = path.read_bytes()
    with pytest.raises(StoreExistsError):
        carraystore.create(path, images.shape[1:])
    with pytest.raises(RuntimeError, match="boom"), carraystore.create(path, images.shape[1:], overwrite=True) as w:
        w.append(images[::-1])
        raise RuntimeError("boom")
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["s.b2nd"]


def test_bad_arguments_get_clear_errors(tmp_path: Path, photo_patches: Callable[..., np.ndarray]) -> None:
    images = make_images(photo_patches, "rgb", 5)
    with pytest.raises(InvalidInputError, match=r"\.b2nd"):
        carraystore.create(tmp_path / "s.h5", (8, 8, 3))
    with pytest.raises(InvalidInputError, match="does not exist"):
        carraystore.create(tmp_path / "nope" / "s.b2nd", (8, 8, 3))
    with pytest.raises(InvalidInputError, match="C = 1, 3 or 4"):
        carraystore.create(tmp_path / "s.b2nd", (8, 8, 2), layout="NHWC")
    with pytest.raises(InvalidInputError, match="not an image dtype"):
        carraystore.create(tmp_path / "s.b2nd", (8, 8, 3), dtype="int32", layout="NHWC")
    with pytest.raises(InvalidInputError, match="multiple"):
        carraystore.create(tmp_path / "s.b2nd", (8, 8, 3), codec=Codec(block_images=3), chunk_images=10)
    with carraystore.create(tmp_path / "s.b2nd", (8, 8, 3), class_names=["a", "b"]) as w:
        with pytest.raises(InvalidInputError, match="shape"):
            w.append(images[:, :4])
        with pytest.raises(InvalidInputError, match="astype"):
            w.append(images.astype(np.uint16), labels=[0] * 5)
        with pytest.raises(InvalidInputError, match="class names"):
            w.append(images, labels=[0, 1, 2, 0, 1])
        with pytest.raises(InvalidInputError, match="labels"):
            w.append(images)  # a store with class names is labelled
        with pytest.raises(InvalidInputError, match="labels"):
            w.append(images, labels=[0, 1])
        with pytest.raises(InvalidInputError, match="keys"):
            w.append(images, labels=[0] * 5, keys=["a"])
        w.append(images, labels=[0, 1, 1, 0, 1])
    assert len(carraystore.open(tmp_path / "s.b2nd")) == 5


# -- appending ---------------------------------------------------------------------------------------------


def _chunk_bytes(store: carraystore.Store) -> list[bytes]:
    return [store.read_chunk_bytes(i) for i in range(store.nchunks)]


@pytest.mark.parametrize("how", ["append", "mode_a"])
@pytest.mark.parametrize("preset", ["balanced", "small"])
def test_append_keeps_the_pinned_codec_and_extends_checksums(
    how: str, preset: str, tmp_path: Path, photo_patches: Callable[..., np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    images = make_images(photo_patches, "rgb", 3 * CHUNK + 5, seed=1)
    more = make_images(photo_patches, "rgb", 2 * CHUNK + 7, seed=2)
    path = tmp_path / "s.b2nd"
    labels, keys = write_store(path, images, chunk_images=CHUNK, codec=None if preset == "balanced" else preset)
    first = carraystore.open(path)
    pinned, old_chunks = first.codec, _chunk_bytes(first)
    first.close()
    # Later versions may change presets and blosc2 defaults: appends must not notice.
    monkeypatch.setitem(PRESETS, "balanced", Codec("lz4", 9, filters=("bitshuffle",)))
    monkeypatch.setitem(PRESETS, "small", Codec("zlib", 3))
    more_labels = np.arange(len(more)) % len(CLASSES)
    more_keys = [f"more/{i}.png" for i in range(len(more))]
    writer = carraystore.append(path) if how == "append" else carraystore.create(path, mode="a")
    with writer as w:
        w.append(more[:10], labels=more_labels[:10], keys=more_keys[:10])
        w.append(more[10:], labels=more_labels[10:], keys=more_keys[10:])
    store = carraystore.open(path)
    both = np.concatenate([images, more])
    assert store.codec == pinned and len(store) == len(both) and store.nchunks == -(-len(both) // CHUNK)
    assert np.array_equal(store[:], both) and np.array_equal(blosc2.open(str(path), mode="r")[:], both)
    assert np.array_equal(store.labels, np.concatenate([labels, more_labels])) and list(store.keys) == keys + more_keys
    assert store.class_names == CLASSES
    chunks = _chunk_bytes(store)
    assert chunks[:3] == old_chunks[:3]  # full chunks untouched
    assert chunks[3] != old_chunks[3]  # the partly filled chunk was refilled
    assert [int(c) for c in store.meta.crc32] == [crc32(c) for c in chunks]
    for c in chunks:  # every chunk, old and new, carries the pinned parameters
        h = parse_chunk_header(c)
        assert (h.typesize, h.filters, h.blocksize) == (pinned.typesize, pinned.filters, store.meta.blocksize)
    assert store.verify() == []


def test_append_to_an_empty_store_and_an_exact_chunk_boundary(
    tmp_path: Path, photo_patches: Callable[..., np.ndarray]
) -> None:
    images = make_images(photo_patches, "uint16", 2 * CHUNK)
    path = tmp_path / "e.b2nd"
    with carraystore.create(path, images.shape[1:], dtype="uint16", chunk_images=CHUNK):
        pass
    assert len(carraystore.open(path)) == 0
    with carraystore.append(path) as w:
        w.append(images[:CHUNK])
    with carraystore.append(path) as w:
        w.append(images[CHUNK:])
    store = carraystore.open(path)
    assert store.nchunks == 2 and np.array_equal(store[:], images) and store.labels is None and store.keys is None


def test_append_enforces_labels_keys_and_shape(tmp_path: Path, photo_patches: Callable[..., np.ndarray]) -> None:
    images = make_images(photo_patches, "rgb", 20)
    path = tmp_path / "s.b2nd"
    write_store(path, images, chunk_images=CHUNK)
    before = path.read_bytes()
    cases = [
        (dict(), "labels"),
        (dict(labels=[0, 1]), "keys"),
        (dict(labels=[0, 9], keys=["a", "b"]), "class names"),
    ]
    for kwargs, match in cases:
        with pytest.raises(InvalidInputError, match=match), carraystore.append(path) as w:
            w.append(images[:2], **kwargs)
    with pytest.raises(InvalidInputError, match="shape"):
        carraystore.create(path, (8, 9, 3), mode="a")
    with pytest.raises(InvalidInputError, match="uint16"):
        carraystore.create(path, (8, 8, 3), dtype="uint16", mode="a")
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["s.b2nd"]
    unlabelled = tmp_path / "u.b2nd"
    with carraystore.create(unlabelled, images.shape[1:]) as w:
        w.append(images)
    with pytest.raises(InvalidInputError, match="no labels"), carraystore.append(unlabelled) as w:
        w.append(images[:1], labels=[0])
    with pytest.raises(InvalidInputError, match="no keys"), carraystore.append(unlabelled) as w:
        w.append(images[:1], keys=["x.jpg"])


APPEND_FOREVER = """
import sys, numpy as np, carraystore
images = np.load(sys.argv[2])
with carraystore.append(sys.argv[1]) as w:
    announced = False
    while True:
        w.append(images, labels=np.zeros(len(images), dtype=np.int64), keys=["x/%d.jpg" % i for i in range(len(images))])
        if not announced:
            print("appending", flush=True)
            announced = True
"""


def test_sigkill_during_append_keeps_the_stored_images(
    tmp_path: Path, photo_patches: Callable[..., np.ndarray]
) -> None:
    images = make_images(photo_patches, "rgb", 3 * CHUNK + 3)
    path = tmp_path / "s.b2nd"
    labels, keys = write_store(path, images, chunk_images=CHUNK)
    before = path.read_bytes()
    np.save(tmp_path / "more.npy", make_images(photo_patches, "rgb", 50, seed=3))
    proc = subprocess.Popen(
        [sys.executable, "-c", APPEND_FOREVER, str(path), str(tmp_path / "more.npy")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.strip() == "appending", proc.stderr.read() if proc.stderr else ""
        time.sleep(0.2)  # let it write more chunks into the store, in place
        assert (tmp_path / ".s.b2nd.journal").exists() and path.stat().st_size > len(before)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    store = carraystore.open(path)  # rolls the dead append back from its journal
    assert path.read_bytes() == before  # byte for byte the store before the append
    assert np.array_equal(store[:], images) and np.array_equal(store.labels, labels) and list(store.keys) == keys
    # the next writer removes the dead writer's temporary file and appends normally
    with carraystore.append(path) as w:
        w.append(images[:2], labels=labels[:2], keys=keys[:2])
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert len(carraystore.open(path)) == len(images) + 2


# -- integrity -------------------------------------------------------------------------------------------


@pytest.fixture()
def photo_store(tmp_path: Path, photo_patches: Callable[..., np.ndarray]) -> tuple[Path, np.ndarray]:
    images = make_images(photo_patches, "rgb", 5 * CHUNK - 3, size=(24, 24))
    path = tmp_path / "good.b2nd"
    write_store(path, images, chunk_images=CHUNK)
    return path, images


def _flip_byte_in_chunk(path: Path, out: Path, k: int, where: float = 0.5) -> None:
    """Copy ``path`` to ``out`` with one byte inside chunk ``k``'s compressed data inverted."""
    data = bytearray(path.read_bytes())
    with carraystore.open(path) as store:
        chunk = store.read_chunk_bytes(k)
    assert bytes(data).count(chunk) == 1
    pos = bytes(data).find(chunk) + 32 + int((len(chunk) - 33) * where)  # past the 32-byte chunk header
    data[pos] ^= 0xFF
    out.write_bytes(bytes(data))


@pytest.mark.parametrize("k", [0, 2, 4])
def test_verify_names_the_chunk_whose_byte_was_flipped(
    k: int, photo_store: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    path, images = photo_store
    bad = tmp_path / "bad.b2nd"
    _flip_byte_in_chunk(path, bad, k)
    store = carraystore.open(bad)
    problems = store.verify()
    assert [p.chunk for p in problems] == [k] and "CRC32" in problems[0].reason
    assert f"chunk {k}" in str(problems[0])
    with pytest.raises(ChecksumError, match=f"chunk {k} "):
        store.read_chunk(k, verify=True)
    for i in range(store.nchunks):  # the other chunks still read correctly
        if i != k:
            a, b = store.chunk_range(i)
            assert np.array_equal(store.read_chunk(i, verify=True), images[a:b])
    assert carraystore.open(path).verify() == []  # the original is fine


@pytest.mark.parametrize("keep", [0.0, 0.02, 0.5, 0.9, 0.999])
def test_a_truncated_file_is_reported(keep: float, photo_store: tuple[Path, np.ndarray], tmp_path: Path) -> None:
    path, _ = photo_store
    data = path.read_bytes()
    cut = tmp_path / "cut.b2nd"
    cut.write_bytes(data[: int(len(data) * keep)])
    try:
        store = carraystore.open(cut)
    except CorruptStoreError as exc:
        assert str(cut) in str(exc)
    else:  # if it opened at all, verify must report damage
        assert store.verify() != []


def test_files_that_are_not_stores(tmp_path: Path, photo_folder: Path) -> None:
    jpeg = next(photo_folder.rglob("*.jpg"))
    fake = tmp_path / "photo.b2nd"
    shutil.copy(jpeg, fake)
    with pytest.raises(CorruptStoreError, match="photo.b2nd"):
        carraystore.open(fake)
    plain = tmp_path / "plain.b2nd"
    blosc2.asarray(np.zeros((4, 8, 8, 3), np.uint8), urlpath=str(plain), mode="w")
    with pytest.raises(NotAStoreError, match="not a carraystore store"):
        carraystore.open(plain)
    with pytest.raises(FileNotFoundError):
        carraystore.open(tmp_path / "missing.b2nd")
    with pytest.raises(NotAStoreError, match="directory"):
        carraystore.open(photo_folder)


def test_reopening_does_not_leak_the_metadata(tmp_path: Path) -> None:
    """Opening a store many times keeps memory flat (python-blosc2's get_vlmeta leaks its buffer)."""
    n = 200_000  # about 8 MB of labels and keys
    images = np.zeros((n, 1, 1, 1), np.uint8)
    path = tmp_path / "many.b2nd"
    with carraystore.create(path, (1, 1, 1), chunk_images=65536) as w:
        w.append(images, keys=[f"train/img_{i:07d}.png" for i in range(n)])
    script = textwrap.dedent(
        """
        import sys, carraystore
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096
        carraystore.open(sys.argv[1]).close()
        r0 = rss()
        for _ in range(20):
            carraystore.open(sys.argv[1]).close()
        print(rss() - r0)
        """
    )
    if not Path("/proc/self/statm").exists():
        pytest.skip("needs /proc to measure memory")
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, check=True)
    grown = int(out.stdout.strip())
    assert grown < 40e6, f"20 opens of a store with 8 MB of metadata grew memory by {grown / 1e6:.0f} MB"


def test_append_refuses_a_different_codec(tmp_path: Path) -> None:
    """Appending keeps the pinned codec: asking for another one is an error, the same one is fine."""
    path = tmp_path / "a.b2nd"
    rng = np.random.default_rng(1)
    imgs = rng.integers(0, 255, (6, 8, 8, 3), dtype=np.uint8)
    with carraystore.create(path, (8, 8, 3), codec="balanced") as w:
        w.append(imgs[:3])
    before = path.read_bytes()
    with pytest.raises(carraystore.InvalidInputError, match="pinned"):
        carraystore.create(path, mode="a", codec="fast")
    assert path.read_bytes() == before
    with carraystore.create(path, mode="a", codec="balanced") as w:
        w.append(imgs[3:])
    np.testing.assert_array_equal(carraystore.open(path)[:], imgs)
