"""``image_size=``: batches decoded at the stored size divided by 2, 4 or 8.

JPEG entries of an encoded store are decoded by libjpeg's scaled IDCT: exactly the pixels
of Pillow's ``Image.draft`` (simplejpeg where the process's check found it identical, Pillow
otherwise); PNG and raw entries and pixel stores are reduced by a box average, exactly
Pillow's ``Image.reduce``. Real photos throughout, small so that the file runs in seconds.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import image_bytes
from PIL import Image

import carraystore as cs
import carraystore.format.encoded as E
from carraystore.base.errors import EncodedImageError, InvalidInputError
from carraystore.engine.decoder import direct_ok
from carraystore.format.encoded import (
    JPEG_DECODER_ENV,
    box_reduce,
    decode_chunk_inplace,
    decode_entry,
    jpeg_decoder,
    reduced_view,
)
from carraystore.ingest.sample_data import load_photo, make_photo_folder, make_video_folder, photo_crops

H, W = 48, 64
CLASSES = ("astronaut", "coffee")
MODES = {"rgb": "RGB", "grayscale": "L", "rgba": "RGBA"}


@pytest.fixture(scope="module")
def jpeg_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_photo_folder(tmp_path_factory.mktemp("jpegs"), n=12, size=(H, W), classes=CLASSES, seed=4)


def _store(folder: Path, out: Path, **kw: Any) -> cs.Store:
    return cs.open(cs.from_directory(folder, out, workers=1, chunk_images=5, seed=1, **kw).path)


@pytest.fixture(scope="module")
def encoded(jpeg_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, cs.Store]:
    root = tmp_path_factory.mktemp("encoded")
    return {m: _store(jpeg_folder, root / f"{m}.b2nd", layout="encoded", color_mode=m) for m in ("rgb", "grayscale")}


@pytest.fixture
def pillow_decoder(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(E, "_jpeg_decoder", None)
    monkeypatch.setenv(JPEG_DECODER_ENV, "pillow")
    yield
    E._jpeg_decoder = None


def _draft(path: Path, k: int, color_mode: str) -> np.ndarray:
    """The reference: Pillow's draft at 1/k of the file (its own mode), converted as a full decode is."""
    with Image.open(path) as img:
        img.draft(img.mode, (img.size[0] // k, img.size[1] // k))
        assert img.size == (W // k, H // k)
        arr = np.asarray(img.convert(MODES[color_mode]))
    return arr.reshape(H // k, W // k, -1)


def _reduce(images: np.ndarray, k: int) -> np.ndarray:
    """Pillow's Image.reduce(k) of each image (channel by channel: Pillow premultiplies RGBA)."""
    out = []
    for a in images:
        bands = [np.asarray(Image.fromarray(np.ascontiguousarray(a[..., c])).reduce(k)) for c in range(a.shape[-1])]
        out.append(np.stack(bands, -1))
    return np.stack(out)


def _all(store: cs.Store, k: int, batch: int = 4, **kw: Any) -> np.ndarray:
    size = (store.image_shape[0] // k, store.image_shape[1] // k)
    xs = [b[0] for b in store.batches(batch, shuffle=False, image_size=size, **kw)]
    for x in xs:
        assert x.shape[1:] == (*size, store.image_shape[2]) and x.dtype == np.uint8
    return np.concatenate(xs)


@pytest.mark.parametrize("decoder", ["simplejpeg", "pillow"])
def test_jpeg_entries_are_pillows_draft_pixels(
    encoded: dict[str, cs.Store], jpeg_folder: Path, decoder: str, request: pytest.FixtureRequest
) -> None:
    if decoder == "pillow":
        request.getfixturevalue("pillow_decoder")
        assert jpeg_decoder().name == "pillow"
    else:
        pytest.importorskip("simplejpeg")
        assert jpeg_decoder().name == "simplejpeg" and jpeg_decoder().scaled, jpeg_decoder().reason
    for mode, store in encoded.items():
        assert store.meta.encoding is not None and store.meta.encoding.formats == ("jpeg",)  # the files, kept
        files = [jpeg_folder / key for key in store.keys]
        for k in (2, 4, 8):
            want = np.stack([_draft(f, k, mode) for f in files])
            np.testing.assert_array_equal(_all(store, k), want, err_msg=f"{mode} 1/{k}")
    # the full size is untouched: image_size equal to the stored size is the default
    rgb = encoded["rgb"]
    np.testing.assert_array_equal(_all(rgb, 1), rgb[:])


def test_simplejpeg_does_the_scaled_decodes(encoded: dict[str, cs.Store], monkeypatch: pytest.MonkeyPatch) -> None:
    simplejpeg = pytest.importorskip("simplejpeg")
    assert jpeg_decoder().scaled
    seen: list[Any] = []
    real = simplejpeg.decode_jpeg

    def spy(data: Any, colorspace: str = "rgb", **kw: Any) -> Any:
        seen.append(kw.get("min_height"))
        return real(data, colorspace, **kw)

    monkeypatch.setattr(simplejpeg, "decode_jpeg", spy)
    _all(encoded["rgb"], 2, num_threads=1)
    assert seen == [H // 2] * len(encoded["rgb"])


def test_a_scaled_check_that_fails_means_pillow_for_reduced_sizes_only(
    encoded: dict[str, cs.Store], jpeg_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    simplejpeg = pytest.importorskip("simplejpeg")
    real = simplejpeg.decode_jpeg

    def off_when_scaled(data: Any, colorspace: str = "rgb", **kw: Any) -> Any:
        arr = real(data, colorspace, **kw)
        if kw.get("min_height"):
            arr[0, 0, 0] ^= 1
        return arr

    monkeypatch.setattr(simplejpeg, "decode_jpeg", off_when_scaled)
    monkeypatch.setattr(E, "_jpeg_decoder", None)
    monkeypatch.delenv(JPEG_DECODER_ENV, raising=False)
    try:
        dec = jpeg_decoder()
        assert dec.name == "simplejpeg" and not dec.scaled and "reduced sizes by Pillow" in dec.reason
        store = encoded["rgb"]
        want = np.stack([_draft(jpeg_folder / key, 2, "rgb") for key in store.keys])
        np.testing.assert_array_equal(_all(store, 2), want)
    finally:
        E._jpeg_decoder = None


def test_png_entries_and_pixel_stores_are_pillows_reduce(
    jpeg_folder: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("reduce")
    png_folder = make_photo_folder(root / "png", n=8, size=(H, W), classes=CLASSES, seed=5, fmt="png")
    png = _store(png_folder, root / "png.b2nd", layout="encoded")
    assert png.meta.encoding is not None and png.meta.encoding.formats == ("png",)
    for mode in ("rgb", "grayscale", "rgba"):
        pixels = _store(jpeg_folder, root / f"p-{mode}.b2nd", color_mode=mode, codec="balanced")
        full = pixels[:]
        for k in (2, 4, 8):
            np.testing.assert_array_equal(_all(pixels, k), _reduce(full, k), err_msg=f"{mode} 1/{k}")
            if mode != "rgba":  # Pillow's own reduce of the image, not band by band
                want = np.stack(
                    [np.asarray(Image.fromarray(a.squeeze(-1) if a.shape[-1] == 1 else a).reduce(k)) for a in full]
                )
                np.testing.assert_array_equal(_all(pixels, k).reshape(want.shape), want)
    for k in (2, 4, 8):
        np.testing.assert_array_equal(_all(png, k), _reduce(png[:], k))


def test_direct_mode_is_not_used_when_reducing(tmp_path: Path) -> None:
    """The ``fast`` preset on images over 64 KiB decompresses image by image into the batch;
    reduced images come from decoded chunks instead, the same pixels as ``balanced``."""
    folder = make_photo_folder(tmp_path / "big", n=6, size=(160, 160), classes=CLASSES, seed=2)
    fast = _store(folder, tmp_path / "fast.b2nd", codec="fast")
    balanced = _store(folder, tmp_path / "balanced.b2nd", codec="balanced")
    assert direct_ok(fast) and not direct_ok(balanced)
    want = _reduce(fast[:], 4)
    for store in (fast, balanced):
        np.testing.assert_array_equal(_all(store, 4, num_threads=2), want)
        with store.batches(3, shuffle=False, image_size=(40, 40)) as it:
            assert not it._s.decoder.direct
            assert it.memory.batch_bytes == 3 * 40 * 40 * 3  # the batch buffers are the reduced size
            assert it.memory.slot_bytes == store.chunk_images * 160 * 160 * 3  # the slots stay full size
            next(it)


def test_clips_shuffle_and_resume_keep_the_reduced_images(tmp_path: Path) -> None:
    video = make_video_folder(tmp_path / "video", clips=2, frames=12, size=(32, 32))
    store = cs.open(cs.from_directory(video, tmp_path / "v.b2nd", keep_order=True, chunk_images=5, workers=1).path)
    small = _reduce(store[:], 2)
    batches = list(store.batches(3, sequence_length=4, shuffle=False, image_size=(16, 16), clip_starts="fixed"))
    assert [x.shape[1:] for x, _ in batches] == [(4, 16, 16, 3)] * len(batches)
    clips = np.concatenate([x for x, _ in batches])
    starts = [0, 4, 8, 12, 16, 20]
    np.testing.assert_array_equal(clips, np.stack([small[s : s + 4] for s in starts]))
    # a shuffled epoch resumed in the middle: the same batches as the epoch's tail
    whole = [x for x, _ in cs.open(store.path).batches(2, seed=3, image_size=(8, 8))]
    tail = [x for x, _ in cs.open(store.path).batches(2, seed=3, image_size=(8, 8), start_batch=5)]
    assert len(whole) == 12 and len(tail) == 7
    for a, b in zip(whole[5:], tail, strict=True):
        np.testing.assert_array_equal(a, b)


def test_sizes_that_are_not_a_scale_are_refused(encoded: dict[str, cs.Store], tmp_path: Path) -> None:
    store = encoded["rgb"]
    for bad in [(30, 30), (H // 3, W // 3), (H // 2, W // 4), (H * 2, W * 2)]:
        with pytest.raises(InvalidInputError) as info:
            store.batches(4, image_size=bad)
        text = str(info.value)
        assert "(48, 64), (24, 32), (12, 16), (6, 8)" in text and "transform" in text, text
    for bad in [(0, 5), "24x32", (24,), (24.5, 32), None.__class__]:
        with pytest.raises(InvalidInputError, match="image_size must be"):
            store.batches(4, image_size=bad)
    # sizes a scale does not divide exactly are not offered
    odd = np.zeros((2, 36, 50, 3), np.uint8)
    with cs.create(tmp_path / "odd.b2nd", (36, 50, 3)) as w:
        w.append(odd)
    with pytest.raises(InvalidInputError, match=r"here \(36, 50\), \(18, 25\);"):
        cs.open(tmp_path / "odd.b2nd").batches(1, image_size=(9, 12))
    # uint16 images and non-image stores: named errors (the stored size is always fine)
    with cs.create(tmp_path / "deep.b2nd", (16, 16, 3), dtype="uint16") as w:
        w.append(np.zeros((2, 16, 16, 3), np.uint16))
    with pytest.raises(InvalidInputError, match="only uint8 images"):
        cs.open(tmp_path / "deep.b2nd").batches(1, image_size=(8, 8))
    assert next(iter(cs.open(tmp_path / "deep.b2nd").batches(1, image_size=(16, 16))))[0].shape == (1, 16, 16, 3)
    with cs.create(tmp_path / "arr.b2nd", (16, 16), dtype="float32", layout="array") as w:
        w.append(np.zeros((2, 16, 16), np.float32))
    with pytest.raises(InvalidInputError, match="applies to image stores"):
        cs.open(tmp_path / "arr.b2nd").batches(1, image_size=(8, 8))


_jpeg = partial(image_bytes, format="JPEG")
_png = partial(image_bytes, format="PNG")


@pytest.mark.parametrize("scale", [2, 4, 8])
def test_in_place_decoding_never_overwrites_an_entry_before_it_is_decoded(scale: int) -> None:
    """Entries of adversarial sizes in one chunk buffer: raw ones (a whole image's bytes, so the
    next entry starts exactly at its own slot), tiny JPEGs and PNGs right behind big ones, a
    big entry last, and empty slots after. Each reduced image must equal its entry decoded alone."""
    h, w = 40, 56
    rng = np.random.default_rng(scale)
    photos = photo_crops(load_photo("chelsea"), 6, (h, w), rng)
    noise = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    flat_grey = np.full((h, w, 3), 128, np.uint8)
    entries = [
        noise.tobytes(),  # raw: entry 1 starts exactly at slot 1
        _jpeg(flat_grey, quality=50),  # tiny
        noise[::-1].tobytes(),  # raw again, right behind a tiny one
        _png(flat_grey),  # tiny PNG
        _jpeg(photos[0], quality=100, subsampling=0),  # big JPEG
        _jpeg(photos[1], quality=30, progressive=True),
        _png(photos[2]),  # big PNG, last
    ]
    k = 9  # two empty slots after the entries
    nb = h * w * 3
    assert all(len(e) <= nb for e in entries)
    buf = np.zeros((k, h, w, 3), np.uint8)
    before = buf.__array_interface__["data"][0]
    sizes = np.array([len(e) for e in entries], dtype=np.int64)
    buf.reshape(-1)[: int(sizes.sum())] = np.frombuffer(b"".join(entries), np.uint8)
    formats = ("jpeg", "png", "raw")
    decode_chunk_inplace(buf, sizes, "rgb", formats, lambda j: f"image {j}", scale)
    assert buf.__array_interface__["data"][0] == before  # the same memory, nothing allocated for the chunk
    got = reduced_view(buf, scale)
    assert np.shares_memory(got, buf) and got.shape == (k, h // scale, w // scale, 3)
    for j, entry in enumerate(entries):
        want = np.empty((h // scale, w // scale, 3), np.uint8)
        decode_entry(entry, want, "rgb", formats, lambda: "alone", scale)
        np.testing.assert_array_equal(got[j], want, err_msg=f"entry {j}")
    assert not buf[len(entries) :].any()
    np.testing.assert_array_equal(got[0], box_reduce(noise, scale))


def test_the_header_size_check_stays_at_reduced_sizes() -> None:
    """An entry must state the store's full size (checked before decoding) however small the output."""
    photo = photo_crops(load_photo("rocket"), 1, (40, 56), np.random.default_rng(1))[0]
    out = np.empty((20, 28, 3), np.uint8)
    other = _jpeg(np.ascontiguousarray(photo[:, :28]))  # 40x28: a store of 40x56 refuses it
    for fmt, entry in (("jpeg", other), ("png", _png(np.ascontiguousarray(photo[:20])))):
        with pytest.raises(EncodedImageError, match="header says"):
            decode_entry(entry, out, "rgb", (fmt,), lambda: "image 3", 2)
    data = _jpeg(photo)
    sof = data.index(b"\xff\xc0")
    bomb = data[: sof + 5] + (65000).to_bytes(2, "big") * 2 + data[sof + 9 :]
    with pytest.raises(EncodedImageError, match="decompression bomb"):
        decode_entry(bomb, out, "rgb", ("jpeg",), lambda: "image 3", 2)
    with pytest.raises(EncodedImageError, match="does not decode"):
        decode_entry(data[:200], out, "rgb", ("jpeg",), lambda: "image 3", 2)


def test_tiny_images_and_box_reduce_match_pillow() -> None:
    """Below 8 pixels a side simplejpeg may pick another libjpeg scale: Pillow decodes those."""
    tiny = photo_crops(load_photo("coffee"), 1, (4, 6), np.random.default_rng(2))[0]
    data = _jpeg(tiny)
    out = np.empty((2, 3, 3), np.uint8)
    decode_entry(data, out, "rgb", ("jpeg",), lambda: "tiny", 2)
    with Image.open(io.BytesIO(data)) as img:
        img.draft("RGB", (3, 2))
        np.testing.assert_array_equal(out, np.asarray(img.convert("RGB")))
    photo = photo_crops(load_photo("astronaut"), 1, (64, 48), np.random.default_rng(3))[0]
    for k in (2, 4, 8):
        np.testing.assert_array_equal(box_reduce(photo, k), np.asarray(Image.fromarray(photo).reduce(k)))
    with pytest.raises(InvalidInputError):
        box_reduce(photo[:63], 2)
