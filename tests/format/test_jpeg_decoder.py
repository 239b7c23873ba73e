"""JPEG entries of the encoded layout decoded by simplejpeg: Pillow's very pixels, or Pillow itself.

FORMAT.md 10.2 defines an entry's pixels as Pillow's; simplejpeg (libjpeg-turbo without the
GIL, about twice as fast) may decode a JPEG only where it gives exactly those pixels. These
tests compare the two on real photographs of every kind the fast path takes, and check that
a failed self-check, an odd JPEG or a broken file all end up in Pillow's hands.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import image_bytes, pillow_pixels
from PIL import Image

import carraystore as cs
import carraystore.format.encoded as E
from carraystore.base.errors import EncodedImageError
from carraystore.format.encoded import JPEG_DECODER_ENV, decode_entry, jpeg_decoder
from carraystore.ingest.sample_data import PHOTOS, load_photo, photo_crops

simplejpeg = pytest.importorskip("simplejpeg")

MODES = {"grayscale": "L", "rgb": "RGB", "rgba": "RGBA"}
CHANNELS = {"grayscale": 1, "rgb": 3, "rgba": 4}


_jpeg = partial(image_bytes, format="JPEG")


def _pillow(data: bytes, color_mode: str) -> np.ndarray:
    """What keras.utils.load_img(color_mode=...) gives for the file: Pillow, converted."""
    return pillow_pixels(data, MODES[color_mode])


def _photo_jpegs(size: tuple[int, int]) -> list[bytes]:
    """Real photographs (two random crops of each sample photo) as JPEGs of every kind the fast path
    takes: 4:4:4, 4:2:2, 4:2:0 and grayscale, baseline and progressive, several qualities."""
    rng = np.random.default_rng(5)
    out = []
    kinds = [(0, False, 95), (1, True, 80), (2, False, 90), (2, True, 60)]
    for p, name in enumerate(PHOTOS):
        for k, crop in enumerate(photo_crops(load_photo(name), 2, size, rng)):
            subsampling, progressive, quality = kinds[(p + k) % len(kinds)]
            img = Image.fromarray(crop)
            out.append(_jpeg(img, quality=quality, subsampling=subsampling, progressive=progressive))
            if k == 0:
                out.append(_jpeg(img.convert("L"), quality=quality, progressive=progressive))
    return out


@pytest.fixture
def fresh_decoder(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The process's decoder decided again on first use (and again after the test)."""
    monkeypatch.setattr(E, "_jpeg_decoder", None)
    monkeypatch.delenv(JPEG_DECODER_ENV, raising=False)
    yield
    E._jpeg_decoder = None


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every simplejpeg.decode_jpeg call (its target colour space), the real function still decoding."""
    seen: list[str] = []
    real = simplejpeg.decode_jpeg

    def spy(data: Any, colorspace: str = "rgb", **kw: Any) -> Any:
        seen.append(colorspace)
        return real(data, colorspace, **kw)

    monkeypatch.setattr(simplejpeg, "decode_jpeg", spy)
    return seen


@pytest.mark.parametrize("size", [(128, 128), (75, 113)])
@pytest.mark.parametrize("color_mode", ["rgb", "grayscale", "rgba"])
def test_simplejpeg_gives_pillows_pixels_on_real_photos(
    fresh_decoder: None, calls: list[str], size: tuple[int, int], color_mode: str
) -> None:
    assert jpeg_decoder().name == "simplejpeg", jpeg_decoder().reason
    calls.clear()  # (the self-check's own calls)
    jpegs = _photo_jpegs(size)
    kinds = {simplejpeg.decode_jpeg_header(d)[3] for d in jpegs}
    assert kinds == {"444", "422", "420", "Gray"}
    for i, data in enumerate(jpegs):
        out = np.full((*size, CHANNELS[color_mode]), 99, np.uint8)
        assert decode_entry(data, out, color_mode, ("jpeg",), lambda i=i: f"photo {i}") == "jpeg"
        np.testing.assert_array_equal(out, _pillow(data, color_mode), err_msg=f"photo {i}")
    assert len(calls) == len(jpegs)  # every one decoded by simplejpeg, none handed to Pillow


def test_an_encoded_store_of_real_photos_reads_as_its_pixel_store(
    fresh_decoder: None, calls: list[str], photo_folder: Path, tmp_path: Path
) -> None:
    """The contract end to end: ingest (Pillow) and the encoded store's reads (simplejpeg) agree."""
    kw: dict[str, Any] = dict(workers=1, chunk_images=8, seed=1)
    for color_mode in ("rgb", "grayscale"):
        e = cs.from_directory(
            photo_folder, tmp_path / f"e-{color_mode}.b2nd", layout="encoded", color_mode=color_mode, **kw
        )
        p = cs.from_directory(photo_folder, tmp_path / f"p-{color_mode}.b2nd", color_mode=color_mode, **kw)
        with cs.open(e.path) as es, cs.open(p.path) as ps:
            assert es.meta.encoding is not None and es.meta.encoding.formats == ("jpeg",)  # the files, kept
            calls.clear()
            np.testing.assert_array_equal(es[:], ps[:])
            assert len(calls) == len(es)


def test_a_failed_self_check_means_pillow_everywhere(
    fresh_decoder: None, monkeypatch: pytest.MonkeyPatch, calls: list[str]
) -> None:
    """A simplejpeg that differs from Pillow by one level on one pixel is never used."""
    real = simplejpeg.decode_jpeg

    def off_by_one(data: Any, colorspace: str = "rgb", **kw: Any) -> Any:
        arr = real(data, colorspace, **kw)
        arr[0, 0, 0] ^= 1
        return arr

    monkeypatch.setattr(simplejpeg, "decode_jpeg", off_by_one)
    dec = jpeg_decoder()
    assert dec.name == "pillow" and "does not give Pillow" in dec.reason
    monkeypatch.setattr(simplejpeg, "decode_jpeg", lambda *a, **k: pytest.fail("simplejpeg used after a failed check"))
    for data in _photo_jpegs((64, 64))[:4]:
        out = np.empty((64, 64, 3), np.uint8)
        decode_entry(data, out, "rgb", ("jpeg",), lambda: "photo")
        np.testing.assert_array_equal(out, _pillow(data, "rgb"))


def test_a_broken_simplejpeg_or_the_variable_means_pillow(fresh_decoder: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(simplejpeg, "decode_jpeg_header", lambda *a, **k: (_ for _ in ()).throw(OSError("no lib")))
    assert jpeg_decoder().name == "pillow"
    monkeypatch.undo()
    monkeypatch.setattr(E, "_jpeg_decoder", None)
    monkeypatch.setenv(JPEG_DECODER_ENV, "pillow")
    dec = jpeg_decoder()
    assert (dec.name, dec.reason) == ("pillow", f"{JPEG_DECODER_ENV}=pillow")


def test_jpegs_the_fast_path_does_not_take_go_to_pillow(fresh_decoder: None, calls: list[str]) -> None:
    """CMYK (Pillow inverts Adobe CMYK and converts), and any file simplejpeg warns about: Pillow's pixels."""
    assert jpeg_decoder().name == "simplejpeg"
    calls.clear()
    photo = photo_crops(load_photo("coffee"), 1, (48, 64), np.random.default_rng(0))[0]
    cmyk = _jpeg(Image.fromarray(photo).convert("CMYK"), quality=90)
    assert simplejpeg.decode_jpeg_header(cmyk)[2] == "CMYK"
    for color_mode in ("rgb", "grayscale"):
        out = np.empty((48, 64, CHANNELS[color_mode]), np.uint8)
        decode_entry(cmyk, out, color_mode, ("jpeg",), lambda: "cmyk")
        np.testing.assert_array_equal(out, _pillow(cmyk, color_mode))
    assert calls == []
    # a stray restart marker mid-scan: libjpeg warns, simplejpeg (strict) refuses, Pillow decodes it as it always did
    good = _jpeg(Image.fromarray(photo), quality=90)
    odd = good[: len(good) // 2] + b"\xff\xd0" + good[len(good) // 2 :]
    with pytest.raises(ValueError, match="Corrupt JPEG data"):
        simplejpeg.decode_jpeg(odd, "RGB", strict=True)
    calls.clear()
    out = np.empty((48, 64, 3), np.uint8)
    decode_entry(odd, out, "rgb", ("jpeg",), lambda: "odd")
    np.testing.assert_array_equal(out, _pillow(odd, "rgb"))
    assert calls == ["RGB"]  # tried, refused, handed to Pillow


def test_a_truncated_jpeg_is_still_a_named_error(fresh_decoder: None) -> None:
    photo = photo_crops(load_photo("rocket"), 1, (64, 64), np.random.default_rng(0))[0]
    data = _jpeg(Image.fromarray(photo), quality=90)
    out = np.empty((64, 64, 3), np.uint8)
    with pytest.raises(EncodedImageError, match="image 3: the JPEG entry does not decode"):
        decode_entry(data[: len(data) // 2], out, "rgb", ("jpeg",), lambda: "image 3")
    # a header of another size: refused by the size check, before any decoding, by either decoder
    with pytest.raises(EncodedImageError, match="header says 64x64 pixels, the store's images are 32x64"):
        decode_entry(data, np.empty((64, 32, 3), np.uint8), "rgb", ("jpeg",), lambda: "image 3")
