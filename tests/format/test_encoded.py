"""The encoded layout (FORMAT.md 10): images kept as their files, decoded in the loader."""

from __future__ import annotations

import filecmp
import subprocess
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from helpers import CLI, image_bytes, pillow_pixels

import carraystore as cs
from carraystore.base.errors import CorruptStoreError, EncodedImageError, FormatError, InvalidInputError, LoaderError
from carraystore.format.encoded import Encoding, decode_entry
from carraystore.ingest.images import DecodeOptions, decode_image
from carraystore.store.export import export_images
from carraystore.store.writer import create

H, W = 24, 32


def _photo(i: int, h: int = H, w: int = W) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([(x * 7 + i * 5) % 256, (y * 9 + i * 3) % 256, ((x + y) * 3 + i) % 256], -1)
    noise = np.random.default_rng(i).integers(0, 24, a.shape)
    return (a + noise).clip(0, 255).astype(np.uint8)


_jpeg = partial(image_bytes, format="JPEG", quality=90)
_png = partial(image_bytes, format="PNG")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Two classes of JPEGs (and a few PNGs) of one size, plus one of another size (resized at ingest)."""
    src = tmp_path / "src"
    for c, cls in enumerate(("cats", "dogs")):
        (src / cls).mkdir(parents=True)
        for i in range(23):
            a = _photo(c * 100 + i)
            if i % 6 == 0:
                (src / cls / f"{i:03d}.png").write_bytes(_png(a))
            else:
                (src / cls / f"{i:03d}.jpg").write_bytes(_jpeg(a))
    (src / "dogs" / "big.jpg").write_bytes(_jpeg(_photo(7, 2 * H, 2 * W)))
    return src


@pytest.fixture
def stores(folder: Path, tmp_path: Path) -> tuple[cs.Store, cs.Store]:
    kw = dict(image_size=(H, W), workers=1, chunk_images=8, seed=3)
    cs.from_directory(folder, tmp_path / "e.b2nd", layout="encoded", **kw)
    cs.from_directory(folder, tmp_path / "p.b2nd", **kw)
    return cs.open(tmp_path / "e.b2nd"), cs.open(tmp_path / "p.b2nd")


def test_source_files_decode_to_exactly_pillow_and_decode_image(stores, folder: Path) -> None:
    e, p = stores
    assert e.layout == "encoded" and e.meta.format_version == 2 and p.meta.format_version == 1
    assert e.shape == p.shape and e.dtype == np.uint8
    assert e.meta.encoding is not None and set(e.meta.encoding.formats) == {"jpeg", "png"}
    opts = DecodeOptions("rgb", (H, W))
    everything = e[:]
    for i, key in enumerate(e.keys):
        data = (folder / key).read_bytes()
        assert np.array_equal(everything[i], decode_image(folder / key, opts)), key
        if key != "dogs/big.jpg":
            assert e.entry(i) == data  # kept byte for byte
            assert np.array_equal(everything[i], pillow_pixels(data))
        else:
            assert e.entry(i)[:8] == b"\x89PNG\r\n\x1a\n"  # resized: encoded once, losslessly
    assert np.array_equal(everything, p[:])  # the pixel layout's very pixels
    assert e.verify() == []
    big = list(e.keys).index("dogs/big.jpg")
    assert np.array_equal(e[big], p[big]) and np.array_equal(e.take([big, 0, big]), p.take([big, 0, big]))


def test_batches_and_keras_match_the_pixel_store(stores) -> None:
    e, p = stores
    for kw in (dict(shuffle="block", seed=5, epoch=1, window=2), dict(shuffle=False), dict(shuffle="global")):
        got = list(e.batches(7, num_threads=2, **kw))
        want = list(p.batches(7, num_threads=2, **kw))
        assert len(got) == len(want)
        for (x1, y1), (x2, y2) in zip(got, want, strict=True):
            assert np.array_equal(x1, x2) and np.array_equal(y1, y2)
    resumed = list(e.batches(7, shuffle="block", seed=5, start_batch=3))
    assert np.array_equal(resumed[0][0], list(p.batches(7, shuffle="block", seed=5))[3][0])
    from carraystore.keras import StoreDataset

    de, dp = StoreDataset(e, 8, seed=2), StoreDataset(p, 8, seed=2)
    assert len(de) == len(dp)
    for i in (0, len(de) - 1, 1):
        assert np.array_equal(de[i][0], dp[i][0]) and np.array_equal(de[i][1], dp[i][1])


def test_export_gives_back_the_original_bytes(stores, folder: Path, tmp_path: Path) -> None:
    e, _ = stores
    n = export_images(e, tmp_path / "out")
    assert n == len(e)
    for key in e.keys:
        if key != "dogs/big.jpg":
            assert filecmp.cmp(folder / key, tmp_path / "out" / key, shallow=False), key
    assert (tmp_path / "out" / "dogs" / "big.png").exists()  # re-encoded at ingest: a PNG now
    # asking for a format decodes and writes pixels, as for a pixel store
    export_images(e, tmp_path / "png", fmt="png", original=False)
    assert len(list((tmp_path / "png").rglob("*.png"))) == len(e)


def test_append_and_raw_fallback(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    imgs = [_photo(i) for i in range(11)]
    noise = np.random.default_rng(0).integers(0, 256, (H, W, 3), dtype=np.uint8)  # PNG of noise: longer than pixels
    with create(path, (H, W, 3), layout="encoded", chunk_images=4) as w:
        w.append_encoded([_jpeg(a) for a in imgs[:5]], labels=[0] * 5)
    with cs.append(path) as w:
        w.append_encoded([_jpeg(a) for a in imgs[5:]], labels=[1] * 6)
    with cs.append(path) as w:
        w.append(noise[None], labels=[1])  # pixels: encoded with the store's pinned PNG, or kept raw
    s = cs.open(path)
    assert len(s) == 12 and list(s.labels) == [0] * 5 + [1] * 7
    want = np.stack([pillow_pixels(_jpeg(a)) for a in imgs] + [noise])
    assert np.array_equal(s[:], want)
    assert len(s.entry(11)) == H * W * 3 and s.meta.encoding.formats == ("jpeg", "raw")
    assert s.verify() == []


def test_convert_both_ways_is_verified_and_atomic(stores, tmp_path: Path) -> None:
    e, p = stores
    cli = [*CLI, "convert"]
    r = subprocess.run(
        [*cli, str(p.path), str(tmp_path / "pe.b2nd"), "--layout", "encoded"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    pe = cs.open(tmp_path / "pe.b2nd")
    assert pe.layout == "encoded" and pe.meta.encoding.reencode == "png"
    assert np.array_equal(pe[:], p[:]) and list(pe.keys) == list(p.keys) and np.array_equal(pe.labels, p.labels)
    r = subprocess.run(
        [*cli, str(e.path), str(tmp_path / "ep.b2nd"), "--layout", "pixels"], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    ep = cs.open(tmp_path / "ep.b2nd")
    assert ep.layout == "NHWC" and np.array_equal(ep[:], e[:])
    from carraystore.store.convert import convert_store

    convert_store(e.path, tmp_path / "ee.b2nd", "encoded", chunk_images=5)  # entries kept, new chunking
    ee = cs.open(tmp_path / "ee.b2nd")
    assert ee.chunk_images == 5 and all(ee.entry(i) == e.entry(i) for i in range(len(e)))
    q = convert_store(p.path, tmp_path / "q.b2nd", "encoded", quality=80)
    assert not q.lossless and cs.open(tmp_path / "q.b2nd").entry(0)[:3] == b"\xff\xd8\xff"
    with pytest.raises(cs.StoreExistsError):
        convert_store(p.path, tmp_path / "q.b2nd", "encoded")
    assert not [f for f in tmp_path.iterdir() if f.name.startswith(".")]  # no temporary left behind


def _store_of(tmp_path: Path, entries: list[bytes], formats: tuple[str, ...] = ("jpeg",)) -> Path:
    """An encoded store holding ``entries`` as they are, recording ``formats`` (hostile stores)."""
    path = tmp_path / "h.b2nd"
    good = [_jpeg(_photo(i)) for i in range(3)]
    with create(path, (H, W, 3), layout="encoded", chunk_images=4) as w:
        w._encoding = Encoding(formats)  # what the record will say, whatever the entries are
        for e in good + entries:
            w._encoding = Encoding(formats)
            w._sizes.append(np.array([len(e)], dtype="<u4"))
            flat = w._buf.reshape(-1)
            if w._fill == 0:
                flat[...] = 0
                w._pos = 0
            flat[w._pos : w._pos + len(e)] = np.frombuffer(e, dtype=np.uint8)
            w._pos += len(e)
            w._fill += 1
            if w._fill == 4:
                w._flush_chunk()
    return path


@pytest.mark.parametrize(
    "make, formats, words",
    [
        (lambda: _jpeg(_photo(9))[:300], ("jpeg",), ["image 3 (chunk 0)", "does not decode"]),
        (lambda: _png(_photo(9)), ("jpeg",), ["image 3 (chunk 0)", "a PNG entry", "jpeg"]),
        (lambda: _png_bomb(100000), ("jpeg", "png"), ["image 3", "decompression bomb"]),
        (lambda: _png_bomb(4000), ("jpeg", "png"), ["image 3", "says 4000x4000 pixels", "32x24"]),
        (lambda: _jpeg_claiming(65000), ("jpeg",), ["image 3", "decompression bomb"]),
        (lambda: b"\xff\xd8\xff" + b"\x00" * 50, ("jpeg",), ["image 3", "does not decode"]),
        (lambda: b"GIF89a" + b"\x00" * 40, ("jpeg",), ["image 3", "not a JPEG, PNG or WebP"]),
    ],
    ids=["truncated-jpeg", "png-posing-as-jpeg", "png-bomb", "png-other-size", "jpeg-bomb", "garbage-jpeg", "unknown"],
)
def test_hostile_entries_are_named_errors(tmp_path: Path, make, formats, words) -> None:
    entry = make()
    path = _store_of(tmp_path, [entry], formats)
    s = cs.open(path)
    for read in (lambda: s[3], lambda: s[:], lambda: s.read_chunk(0)):
        with pytest.raises(EncodedImageError) as info:
            read()
        assert all(w in str(info.value) for w in words), str(info.value)
    assert isinstance(info.value, CorruptStoreError)
    problems = s.verify()
    assert [p.chunk for p in problems] == [0] and "image 3" in problems[0].reason
    with pytest.raises(LoaderError, match="chunk 0"):
        list(s.batches(4, shuffle=False))


def _png_bomb(side: int) -> bytes:
    """A real PNG whose IHDR says ``side`` x ``side`` (CRC fixed): a decompression bomb's header."""
    import zlib

    png = bytearray(_png(_photo(1)))
    png[16:24] = side.to_bytes(4, "big") * 2
    png[29:33] = zlib.crc32(bytes(png[12:29])).to_bytes(4, "big")
    return bytes(png)


def _jpeg_claiming(side: int) -> bytes:
    data = _jpeg(_photo(1))
    sof = data.index(b"\xff\xc0")
    return data[: sof + 5] + side.to_bytes(2, "big") * 2 + data[sof + 9 :]


def test_bomb_is_refused_before_decoding() -> None:
    out = np.empty((H, W, 3), np.uint8)
    for bomb, fmt in ((_png_bomb(100000), "png"), (_jpeg_claiming(65000), "jpeg")):
        with pytest.raises(EncodedImageError, match="decompression bomb"):
            decode_entry(bomb, out, "rgb", (fmt,), lambda: "item 0")
    with pytest.raises(EncodedImageError, match="says 4000x4000 pixels"):
        decode_entry(_png_bomb(4000), out, "rgb", ("png",), lambda: "item 0")


def test_metadata_rules(tmp_path: Path) -> None:
    with pytest.raises(InvalidInputError, match="uint8"):
        create(tmp_path / "x.b2nd", (H, W, 3), dtype="uint16", layout="encoded")
    w = create(tmp_path / "y.b2nd", (H, W, 3), layout="encoded")
    with pytest.raises(InvalidInputError, match="not a JPEG, PNG or WebP file"):
        w.append_encoded([b"hello"])
    with pytest.raises(InvalidInputError, match="neither a JPEG"):
        w.append_entries([b"hello"])
    w.abort()
    path = _store_of(tmp_path, [])
    s = cs.open(path)
    rec = s.meta.to_record()
    rec["entry_sizes"] = np.array([5, 6, 10**7], "<u4").tobytes()
    with pytest.raises(FormatError, match="entry 2"):
        type(s.meta).from_record(rec, "x")
    rec = s.meta.to_record()
    rec["format_version"] = 1
    with pytest.raises(FormatError, match="format version 2"):
        type(s.meta).from_record(rec, "x")


def _jpeg_of_length(img: np.ndarray, n: int) -> bytes:
    """A real JPEG of ``img`` exactly ``n`` bytes long (a comment segment pads it)."""
    for q in range(95, 5, -5):
        plain = image_bytes(img[..., 0] if img.shape[2] == 1 else img, "JPEG", quality=q)
        pad = n - len(plain) - 4  # a COM segment: marker, length, then the text
        if pad > 0:
            data = image_bytes(img[..., 0] if img.shape[2] == 1 else img, "JPEG", quality=q, comment=b"x" * pad)
            if len(data) == n:
                return data
    raise AssertionError(f"no JPEG of {n} bytes")


@pytest.mark.parametrize("extra", [0, 40])
def test_a_file_as_long_as_the_raw_pixels_is_stored_as_its_decoded_pixels(tmp_path: Path, extra: int) -> None:
    """append_encoded() is given files: one whose length is exactly H*W*C (a 784-byte 28x28 grayscale
    JPEG), or longer, is kept as its decoded pixels; stored as is it would read back as its own bytes."""
    rng = np.random.default_rng(3)
    img = (rng.integers(0, 40, (28, 28, 1)) + np.arange(28)[:, None, None] * 7).astype(np.uint8)
    data = _jpeg_of_length(img, 28 * 28 + extra)
    small = image_bytes(np.full((28, 28), 128, np.uint8), "JPEG", quality=50)
    assert len(small) < 784
    path = tmp_path / "g.b2nd"
    with create(path, (28, 28, 1), layout="encoded") as w:
        w.append_encoded([small, data], labels=[0, 1])
    with cs.open(path) as s:
        assert s.verify() == []
        assert np.array_equal(s[1], pillow_pixels(data, "L"))
        assert s.entry(0) == small  # a shorter file is kept byte for byte
        assert len(s.entry(1)) == 784 and s.entry(1) == pillow_pixels(data, "L").tobytes()
