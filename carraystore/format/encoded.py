"""The encoded layout (FORMAT.md 10): images kept as their encoded bytes, decoded when read (layer 1).
The b2nd array is ``(N, H, W, C)`` uint8, but a chunk's decompressed bytes are its images' entries
back to back, then zeros. An entry is the encoded file (JPEG, PNG, WebP) or, when none is shorter,
the raw pixels (``H*W*C`` bytes); the record's ``entry_sizes`` holds each length. JPEGs are decoded
by simplejpeg only where :func:`jpeg_decoder` found it gives Pillow's pixels, else by Pillow, which
defines them (FORMAT.md 10.2; ``CARRAYSTORE_JPEG_DECODER=pillow`` forces it). Touches no file."""

from __future__ import annotations

import functools
import io
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from carraystore.base.errors import EncodedImageError, FormatError, InvalidInputError

__all__ = [
    "LAYOUT",
    "FORMAT_VERSION_ENCODED",
    "ENTRY_FORMATS",
    "ENCODE_FORMATS",
    "Encoding",
    "sniff",
    "file_format",
    "decode_file",
    "encode_pixels",
    "entry_for_pixels",
    "source_entry",
    "decode_entry",
    "decode_chunk_inplace",
    "chunk_entries",
    "jpeg_decoder",
    "JpegDecoder",
    "SCALES",
    "box_reduce",
    "reduce_images_inplace",
    "reduced_sizes",
    "reduced_view",
]

#: The layout name recorded in the metadata.
LAYOUT = "encoded"
#: Stores of the encoded layout are format version 2 (pixel stores stay version 1).
FORMAT_VERSION_ENCODED = 2
#: What an entry may be: an encoded file of one of these formats, or the raw pixels.
ENTRY_FORMATS = ("jpeg", "png", "webp", "raw")
#: Formats the writer encodes pixels to (``Encoding.reencode``).
ENCODE_FORMATS = ("png", "jpeg", "webp")
#: The one decoder this version knows, and the oldest version of it the stores were tested with.
DECODER = "pillow"
DECODER_MIN_VERSION = "10.0"
_PIL_NAMES = {"jpeg": "JPEG", "png": "PNG", "webp": "WEBP"}
_MODES = {1: "L", 3: "RGB", 4: "RGBA"}
_COLOR_MODE_CHANNELS = {"grayscale": 1, "rgb": 3, "rgba": 4}
_DEEP_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")
#: Pinned encoder settings (FORMAT.md 10.3): a later Pillow must encode the same way.
PNG_COMPRESS_LEVEL = 6
JPEG_SUBSAMPLING = 2  # 4:2:0
JPEG_SUBSAMPLING_NAME = "4:2:0"
#: The keys of the record's ``encoding`` map (FORMAT.md 10.3): all required, no other allowed.
ENCODING_KEYS = (
    "formats",
    "reencode",
    "quality",
    "png_compress_level",
    "jpeg_subsampling",
    "decoder",
    "decoder_min_version",
)


def sniff(entry: bytes | memoryview, image_nbytes: int) -> str:
    """The format of an entry from its length and first bytes: ``jpeg``, ``png``, ``webp``, ``raw`` or ``unknown``."""
    if len(entry) == image_nbytes:
        return "raw"
    return file_format(entry)


def file_format(data: bytes | memoryview) -> str:
    """The format of an image file from its first bytes alone: ``jpeg``, ``png``, ``webp`` or ``unknown``."""
    head = bytes(data[:12])
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    return "unknown"


@dataclass(frozen=True)
class Encoding:
    """How a store of the encoded layout holds its images (the record's ``encoding`` map): ``formats``, the
    entry formats in use (others are refused); ``reencode``/``quality``, what the writer encodes pixels to:
    ``png`` (lossless, default) or ``jpeg``/``webp`` at ``quality`` 1-100 (webp without one is lossless)."""

    formats: tuple[str, ...] = ()
    reencode: str = "png"
    quality: int | None = None
    decoder: str = DECODER
    decoder_min_version: str = DECODER_MIN_VERSION

    def __post_init__(self) -> None:
        if self.reencode not in ENCODE_FORMATS:
            raise InvalidInputError(f"encoding format {self.reencode!r} is not one of {ENCODE_FORMATS}")
        if self.quality is not None and (
            isinstance(self.quality, bool) or not isinstance(self.quality, int) or not 1 <= self.quality <= 100
        ):
            raise InvalidInputError(f"encoding quality must be an integer 1..100, got {self.quality!r}")
        if self.reencode == "jpeg" and self.quality is None:
            raise InvalidInputError("encoding jpeg needs a quality (1..100); png is the lossless choice")
        if self.reencode == "png" and self.quality is not None:
            raise InvalidInputError("png is lossless and takes no quality; use reencode='jpeg' or 'webp' with quality")
        bad = [f for f in self.formats if f not in ENTRY_FORMATS]
        if bad:
            raise InvalidInputError(f"entry formats {bad} are not among {ENTRY_FORMATS}")
        object.__setattr__(self, "formats", tuple(f for f in ENTRY_FORMATS if f in self.formats))

    @classmethod
    def for_quality(cls, quality: int | None, fmt: str | None = None) -> Encoding:
        """The encoding of ``quality``: PNG (lossless) when None, JPEG (or ``fmt``) at ``quality`` otherwise."""
        if fmt is None:
            fmt = "png" if quality is None else "jpeg"
        return cls(reencode=fmt, quality=quality)

    def with_formats(self, more: Sequence[str]) -> Encoding:
        return Encoding(
            tuple({*self.formats, *more}), self.reencode, self.quality, self.decoder, self.decoder_min_version
        )

    def to_record(self) -> dict[str, Any]:
        """The record's ``encoding`` map (FORMAT.md 10.3): every key of :data:`ENCODING_KEYS`, in that order."""
        return {
            "formats": list(self.formats),
            "reencode": self.reencode,
            "quality": self.quality,
            "png_compress_level": PNG_COMPRESS_LEVEL,
            "jpeg_subsampling": JPEG_SUBSAMPLING_NAME,
            "decoder": self.decoder,
            "decoder_min_version": self.decoder_min_version,
        }

    @classmethod
    def from_record(cls, rec: Any, where: str) -> Encoding:
        """The ``encoding`` map read by FORMAT.md 10.3: every key required, none other, each value checked;
        FormatError names the key."""
        if not isinstance(rec, Mapping):
            raise FormatError(f"{where}: metadata 'encoding' must be a mapping (FORMAT.md 10.3)")

        def bad(why: str) -> FormatError:
            return FormatError(
                f"{where}: metadata 'encoding' {why} (FORMAT.md 10.3); the file is damaged or was "
                "written by another tool"
            )

        missing = [k for k in ENCODING_KEYS if k not in rec]
        if missing:
            raise bad(f"lacks {', '.join(repr(k) for k in missing)}")
        unknown = sorted(str(k) for k in rec if k not in ENCODING_KEYS)
        if unknown:
            raise bad(f"holds the unknown key{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}")
        formats = rec["formats"]
        if not isinstance(formats, list) or not all(isinstance(f, str) for f in formats):
            raise bad(f"'formats' is {formats!r}, not an array of names")
        if len(set(formats)) != len(formats):
            raise bad(f"'formats' {formats!r} lists a format twice")
        if rec["decoder"] != DECODER:
            raise FormatError(
                f"{where}: the store's images need the decoder {rec['decoder']!r}; this carraystore decodes with "
                f"{DECODER!r} only (FORMAT.md 10.3)"
            )
        if not isinstance(rec["decoder_min_version"], str):
            raise bad(f"'decoder_min_version' is {rec['decoder_min_version']!r}, not a string")
        if not isinstance(rec["reencode"], str):
            raise bad(f"'reencode' is {rec['reencode']!r}, not a format name")
        pinned = (("png_compress_level", PNG_COMPRESS_LEVEL), ("jpeg_subsampling", JPEG_SUBSAMPLING_NAME))
        for key, value in pinned:
            got = rec[key]
            if got != value or type(got) is not type(value):
                raise bad(f"'{key}' is {got!r}; format version 2 pins it to {value!r}")
        try:
            return cls(
                formats=tuple(formats),
                reencode=rec["reencode"],
                quality=rec["quality"],
                decoder=DECODER,
                decoder_min_version=rec["decoder_min_version"],
            )
        except InvalidInputError as exc:
            raise bad(f"is malformed ({exc})") from exc


# -- encoding ------------------------------------------------------------------------------------
def _pil_image(pixels: np.ndarray) -> Any:
    from PIL import Image

    c = pixels.shape[2]
    return Image.fromarray(pixels[..., 0] if c == 1 else pixels, _MODES[c])


def encode_pixels(pixels: np.ndarray, encoding: Encoding) -> bytes:
    """``pixels`` (H, W, C) uint8 encoded with the store's pinned format and quality."""
    img = _pil_image(np.ascontiguousarray(pixels))
    buf = io.BytesIO()
    if encoding.reencode == "png":
        img.save(buf, format="PNG", compress_level=PNG_COMPRESS_LEVEL, optimize=False)
    elif encoding.reencode == "jpeg":
        if img.mode == "RGBA":
            raise InvalidInputError("RGBA images cannot be encoded as JPEG; use png (the default) or webp")
        img.save(buf, format="JPEG", quality=encoding.quality, subsampling=JPEG_SUBSAMPLING, optimize=False)
    else:
        if encoding.quality is None:
            img.save(buf, format="WEBP", lossless=True, quality=100, method=4)
        else:
            img.save(buf, format="WEBP", quality=encoding.quality, method=4)
    return buf.getvalue()


def entry_for_pixels(pixels: np.ndarray, encoding: Encoding) -> bytes:
    """The entry that holds ``pixels``: their encoding, or the raw pixels when that is not shorter."""
    enc = encode_pixels(pixels, encoding)
    return enc if len(enc) < pixels.nbytes else np.ascontiguousarray(pixels).tobytes()


def source_entry(data: bytes, expected: np.ndarray, color_mode: str) -> bytes | None:
    """``data`` (a source file's bytes) as an entry when it decodes to exactly ``expected``, else None
    (colour-converted as :func:`carraystore.ingest.images.decode_image` does)."""
    fmt = sniff(data, expected.nbytes)
    if fmt not in _PIL_NAMES or len(data) >= expected.nbytes:
        return None
    out = np.empty_like(expected)
    try:
        decode_entry(data, out, color_mode, (fmt,), lambda: "source file")
    except EncodedImageError:
        return None
    return data if np.array_equal(out, expected) else None


# -- decoding ------------------------------------------------------------------------------------
def decode_entry(
    entry: bytes | memoryview,
    out: np.ndarray,
    color_mode: str,
    formats: Sequence[str],
    what: Callable[[], str],
    scale: int = 1,
) -> str:
    """Decode one entry into ``out`` ((H, W, C) uint8, or (H/scale, W/scale, C)); return its format. The format
    must be among ``formats`` and the header state the store's size, checked before decoding (no decompression
    bomb); failures raise EncodedImageError starting with ``what()``. ``entry`` must not share memory with
    ``out``; ``scale`` 1, 2, 4 or 8 (JPEG: libjpeg's scaled IDCT; others: :func:`box_reduce`)."""
    h, w, c = out.shape
    full = (h * scale, w * scale, c)
    nbytes = h * w * c * scale * scale
    fmt = sniff(entry, nbytes)
    if fmt not in formats:
        shown = "not a JPEG, PNG or WebP file" if fmt == "unknown" else f"a {fmt.upper()} entry"
        raise EncodedImageError(
            f"{what()}: {shown}, but the store's entries are {', '.join(formats) or 'none'}; the store is damaged: "
            "run `carraystore verify` on it"
        )
    if fmt == "raw":
        pixels = np.frombuffer(entry, dtype=np.uint8).reshape(full)
        if scale == 1:
            out[...] = pixels
        else:
            box_reduce(pixels, scale, out=out)
        return fmt
    if fmt == "jpeg":
        dec = jpeg_decoder()
        if dec.name == "simplejpeg" and (scale == 1 or dec.scaled):
            import simplejpeg

            if _decode_simplejpeg(simplejpeg, entry, out, scale):
                return fmt
    _decode_pillow(entry, out, fmt, what, scale)
    return fmt


def decode_file(data: bytes, out: np.ndarray, what: Callable[[], str]) -> str:
    """Decode a JPEG, PNG or WebP file of any length into ``out`` ((H, W, C) uint8) as an entry of that
    format decodes (FORMAT.md 10.2); return its format. EncodedImageError for anything else."""
    fmt = file_format(data)
    if fmt not in _PIL_NAMES:
        raise EncodedImageError(f"{what()}: not a JPEG, PNG or WebP file")
    _decode_pillow(data, out, fmt, what)
    return fmt


def _decode_pillow(
    entry: bytes | memoryview, out: np.ndarray, fmt: str, what: Callable[[], str], scale: int = 1
) -> None:
    """Decode an entry with Pillow: the pixels FORMAT.md 10.2 defines."""
    h, w, c = out.shape
    h, w = h * scale, w * scale
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(entry), formats=[_PIL_NAMES[fmt]]) as img:
                if img.size != (w, h):  # before decoding: a header claiming 100000x100000 is refused here
                    raise EncodedImageError(
                        f"{what()}: the {fmt.upper()} header says {img.size[0]}x{img.size[1]} pixels, the store's "
                        f"images are {w}x{h}; the store is damaged or hostile: run `carraystore verify` on it"
                    )
                reduce_after = scale
                if scale > 1 and fmt == "jpeg":
                    # the JPEG's own mode: draft("L") would decode the Y plane, not convert("L")
                    img.draft(img.mode, (w // scale, h // scale))
                    if img.size == (w // scale, h // scale):
                        reduce_after = 1
                    else:  # pragma: no cover - libjpeg scales by 1/2, 1/4 and 1/8 exactly
                        img = Image.open(io.BytesIO(entry), formats=["JPEG"])
                img.load()
                if img.mode in _DEEP_MODES:  # 16 bits -> 8: the high byte, as decode_image does
                    img = Image.fromarray((np.asarray(img).astype(np.uint32) >> 8).clip(0, 255).astype(np.uint8), "L")
                arr = np.asarray(img.convert(_MODES[c]), dtype=np.uint8)
    except EncodedImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise EncodedImageError(
            f"{what()}: the {fmt.upper()} header claims an image far larger than the store's {w}x{h}, refused "
            f"undecoded as a decompression bomb ({exc}); the store is damaged or hostile"
        ) from exc
    except Exception as exc:  # Pillow raises many types for bad data
        raise EncodedImageError(
            f"{what()}: the {fmt.upper()} entry does not decode ({type(exc).__name__}: {exc}); "
            "the store is damaged: run `carraystore verify` on it"
        ) from exc
    if reduce_after > 1:
        box_reduce(arr.reshape(h, w, c), reduce_after, out=out)
    else:
        out[...] = arr.reshape(out.shape)


# -- decoding at a smaller size -------------------------------------------------------------------
#: What the stored size may be divided by when decoding at a smaller size (libjpeg's scaled IDCT).
SCALES = (1, 2, 4, 8)


def reduced_sizes(height: int, width: int) -> list[tuple[int, int]]:
    """The (height, width) an image may be decoded at: divided by a SCALES entry that divides both."""
    return [(height // k, width // k) for k in SCALES if height % k == 0 and width % k == 0]


def box_reduce(images: np.ndarray, scale: int, out: np.ndarray | None = None) -> np.ndarray:
    """``images`` (..., H, W, C) uint8 reduced by ``scale``: each pixel the box mean, rounded half up.
    Exactly Pillow's ``Image.reduce(scale)`` for L and RGB; RGBA is averaged per channel (Pillow differs)."""
    *lead, h, w, c = images.shape
    if h % scale or w % scale:
        raise InvalidInputError(f"box_reduce: a {h}x{w} image does not divide by {scale}")
    hr, wr = h // scale, w // scale
    if out is None:
        out = np.empty((*lead, hr, wr, c), dtype=np.uint8)
    if scale == 1:
        out[...] = images
        return out
    n = scale * scale
    # uint16 sums; columns one channel at a time (long strided loops are faster)
    x = images.reshape(-1, hr, scale, w * c)
    rows = x[:, :, 0].astype(np.uint16)
    for r in range(1, scale):
        rows += x[:, :, r]
    cols = rows.reshape(-1, hr, wr, scale, c)
    total = np.empty((len(cols), hr, wr, c), np.uint16)
    for ch in range(c):
        t = total[..., ch]
        np.add(cols[:, :, :, 0, ch], cols[:, :, :, 1, ch], out=t)
        for q in range(2, scale):
            t += cols[:, :, :, q, ch]
    total += n // 2
    total >>= n.bit_length() - 1
    out[...] = total.reshape(out.shape)
    return out


#: images reduced at once by :func:`reduce_images_inplace` (bounds its temporary arrays)
_REDUCE_GROUP_BYTES = 4 << 20


def reduce_images_inplace(buf: np.ndarray, scale: int, count: int | None = None) -> None:
    """Reduce the first ``count`` images of ``buf`` ((k, H, W, C) uint8, C-contiguous) by ``scale``,
    each into the first bytes of its own slot, written only after it was read."""
    k, h, w, c = buf.shape
    count = k if count is None else count
    nb = h * w * c
    m = nb // (scale * scale)
    flat = buf.reshape(k, nb)
    group = max(1, _REDUCE_GROUP_BYTES // max(1, nb))
    for a in range(0, count, group):
        b = min(count, a + group)
        small = box_reduce(buf[a:b], scale)
        flat[a:b, :m] = small.reshape(b - a, m)


def reduced_view(buf: np.ndarray, scale: int) -> np.ndarray:
    """The reduced images of ``buf`` (see :func:`reduce_images_inplace`) as a (k, H/s, W/s, C) view."""
    k, h, w, c = buf.shape
    nb = h * w * c
    hr, wr = h // scale, w // scale
    return buf.reshape(k, nb)[:, : hr * wr * c].reshape(k, hr, wr, c)


# -- the fast JPEG path ---------------------------------------------------------------------------
#: JPEG colour spaces and subsamplings simplejpeg decodes here (all covered by the check).
_FAST_COLORSPACES = ("YCbCr", "Gray")
_FAST_SUBSAMPLINGS = ("444", "422", "420", "Gray")
_FAST_TARGETS = {1: "GRAY", 3: "RGB", 4: "RGBA"}
#: Set ``CARRAYSTORE_JPEG_DECODER=pillow`` to decode every JPEG with Pillow.
JPEG_DECODER_ENV = "CARRAYSTORE_JPEG_DECODER"


@dataclass(frozen=True)
class JpegDecoder:
    """Which decoder JPEG entries get in this process (:func:`jpeg_decoder`)."""

    name: str  # "simplejpeg" or "pillow"
    version: str
    reason: str  # why: "identical to Pillow on N checks", or why simplejpeg is not used
    #: whether simplejpeg also decodes at reduced sizes (its scaled IDCT gave Pillow's draft pixels)
    scaled: bool = False


_jpeg_decoder: JpegDecoder | None = None

#: the check images' sizes: odd (the edges of upsampling), and one that 8 divides (scaled decoding)
_CHECK_SIZE = (29, 37)
_CHECK_SIZE_SCALED = (40, 56)


def _check_images(size: tuple[int, int] = _CHECK_SIZE) -> list[bytes]:
    """Small JPEGs encoded by Pillow: every kind the fast path takes (odd sizes: the edges of upsampling)."""
    from PIL import Image

    h, w = size
    y, x = np.mgrid[0:h, 0:w]
    hashed = (x * 7919 + y * 104729 + x * y * 31) % 251  # texture without a random generator
    rgb = np.stack([(x * 7 + hashed) % 256, (y * 9 + 2 * hashed) % 256, ((x + y) * 3 + hashed // 2) % 256], -1)
    rgb = rgb.astype(np.uint8)
    out = []
    for mode in ("RGB", "L"):
        img = Image.fromarray(rgb).convert(mode)
        for subsampling in (0, 1, 2) if mode == "RGB" else (0,):
            for progressive in (False, True):
                buf = io.BytesIO()
                img.save(buf, format="JPEG", quality=87, subsampling=subsampling, progressive=progressive)
                out.append(buf.getvalue())
    return out


def _agrees(simplejpeg: Any, size: tuple[int, int], scales: Sequence[int]) -> int:
    """Checks on which simplejpeg gave Pillow's pixels (0 at the first that differs)."""
    h, w = size
    checks = 0
    for data in _check_images(size):
        for c in _FAST_TARGETS:
            for k in scales:
                want = np.empty((h // k, w // k, c), np.uint8)
                got = np.full((h // k, w // k, c), 7, np.uint8)
                _decode_pillow(data, want, "jpeg", lambda: "check image", k)
                if not _decode_simplejpeg(simplejpeg, data, got, k) or not np.array_equal(got, want):
                    return 0
                checks += 1
    return checks


def _decide_jpeg_decoder() -> JpegDecoder:
    from PIL import __version__ as pillow_version

    pillow = functools.partial(JpegDecoder, "pillow", pillow_version)
    if os.environ.get(JPEG_DECODER_ENV, "").strip().lower() == "pillow":
        return pillow(f"{JPEG_DECODER_ENV}=pillow")
    try:
        import simplejpeg
    except ImportError:
        return pillow("simplejpeg is not installed")
    version = str(getattr(simplejpeg, "__version__", "?"))
    try:
        checks = _agrees(simplejpeg, _CHECK_SIZE, (1,))
        if not checks:
            return pillow(f"simplejpeg {version} does not give Pillow {pillow_version}'s pixels on every check")
    except Exception as exc:  # a broken install: Pillow decodes
        return pillow(f"simplejpeg {version} failed its check ({type(exc).__name__}: {exc})")
    reason = f"identical to Pillow {pillow_version} on {checks} checks"
    try:  # decoding at 1/2, 1/4, 1/8: against Pillow's draft, the same way
        scaled = _agrees(simplejpeg, _CHECK_SIZE_SCALED, SCALES[1:])
    except Exception as exc:
        scaled, why = 0, f"failed its check ({type(exc).__name__}: {exc})"
    else:
        why = "does not give Pillow's draft pixels on every check"
    reason += f", {scaled} scaled" if scaled else f"; reduced sizes by Pillow (simplejpeg {why})"
    return JpegDecoder("simplejpeg", version, reason, scaled=bool(scaled))


def jpeg_decoder() -> JpegDecoder:
    """The decoder of JPEG entries in this process, decided (and checked) on first use."""
    global _jpeg_decoder
    if _jpeg_decoder is None:  # two threads may both decide: the same answer, no lock to carry across fork()
        _jpeg_decoder = _decide_jpeg_decoder()
    return _jpeg_decoder


def _decode_simplejpeg(simplejpeg: Any, entry: bytes | memoryview, out: np.ndarray, scale: int = 1) -> bool:
    """Decode a JPEG entry into ``out`` with simplejpeg; False (``out`` undefined) where Pillow must."""
    h, w, c = out.shape
    try:
        eh, ew, colorspace, subsampling = simplejpeg.decode_jpeg_header(entry)
        if (
            (eh, ew) != (h * scale, w * scale)
            or colorspace not in _FAST_COLORSPACES
            or subsampling not in _FAST_SUBSAMPLINGS
        ):
            return False  # another size (Pillow names the error), CMYK, 4:4:0...: Pillow
        kw: dict[str, Any] = {}
        if scale > 1:
            # simplejpeg picks the smallest n/8 at least the size asked for: exact only from 8 pixels on
            kw = {"min_height": h, "min_width": w}
            if max(eh, ew) < 8 or simplejpeg.decode_jpeg_header(entry, **kw)[:2] != (h, w):
                return False
        if c == 1 and colorspace != "Gray":  # Pillow's L of a colour JPEG is its RGB converted, not the Y plane
            from PIL import Image

            rgb = simplejpeg.decode_jpeg(entry, "RGB", strict=True, **kw)
            if rgb.shape[:2] != (h, w):
                return False
            out[..., 0] = np.asarray(Image.fromarray(rgb, "RGB").convert("L"))
            return True
        target = out if out.flags.c_contiguous else np.empty(out.shape, np.uint8)
        got = simplejpeg.decode_jpeg(entry, _FAST_TARGETS[c], buffer=target, strict=True, **kw)
        if got.shape != out.shape:
            return False
        if target is not out:
            out[...] = target
    except Exception:  # corrupt data, a libjpeg warning (strict): Pillow decides, and names the error
        return False
    return True


def chunk_entries(payload: np.ndarray, sizes: np.ndarray) -> list[memoryview]:
    """The entries of one decompressed chunk (``payload``: its bytes) given their ``sizes``."""
    flat = np.ascontiguousarray(payload).reshape(-1).view(np.uint8).data
    ends = np.cumsum(sizes.astype(np.int64))
    starts = ends - sizes.astype(np.int64)
    return [flat[int(a) : int(b)] for a, b in zip(starts, ends, strict=True)]


def decode_chunk_inplace(
    buf: np.ndarray,
    sizes: np.ndarray,
    color_mode: str,
    formats: Sequence[str],
    what: Callable[[int], str],
    scale: int = 1,
) -> None:
    """Decode the ``len(sizes)`` entries that ``buf`` ((k, H, W, C) uint8) holds into ``buf`` itself. Entry
    ``j`` starts at or before ``j * H*W*C``, so decoding last first never overwrites an unread entry; at
    ``scale`` > 1 images land in the first bytes of their slots (:func:`reduced_view`). ``what(j)`` names image j."""
    k, h, w, c = buf.shape
    nb = h * w * c
    small = (h // scale, w // scale, c)
    m = small[0] * small[1] * c
    flat = buf.reshape(-1)
    ends = np.cumsum(sizes.astype(np.int64))
    for j in range(len(sizes) - 1, -1, -1):
        a, b = int(ends[j] - sizes[j]), int(ends[j])
        entry = flat[a:b].tobytes()  # a copy: its bytes may lie under image j's own pixels
        out = buf[j] if scale == 1 else flat[j * nb : j * nb + m].reshape(small)
        decode_entry(entry, out, color_mode, formats, functools.partial(what, j), scale)
    if nb and len(sizes) < len(buf):
        buf[len(sizes) :] = 0


def check_sizes(sizes: np.ndarray, image_nbytes: int, where: str) -> None:
    """Every entry size in 1..image_nbytes (so a chunk's entries fit it); FormatError naming the item."""
    bad = (sizes < 1) | (sizes > image_nbytes)
    if np.any(bad):
        i = int(np.argmax(bad))
        raise FormatError(
            f"{where}: entry {i} is {int(sizes[i])} bytes; an entry holds 1..{image_nbytes} bytes (FORMAT.md 10.1)"
        )


def color_channels(color_mode: str) -> int:
    return _COLOR_MODE_CHANNELS[color_mode]


def default_codec() -> Any:
    """The default codec of an encoded store: lz4 level 1, no filter (entries are compressed already)."""
    from carraystore.format.codec import Codec

    return Codec("lz4", 1, filters=())
