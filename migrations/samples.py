"""Sources of encoded image samples (WebDataset shards, TFRecord files, Parquet/Arrow tables), shared by the three.

A format module reads its files as :class:`Sample` values (where, a key, named values; re-readable)
through a :class:`SampleReader`. :class:`SampleSource` scans them once without decoding a pixel
(each image's header: size, mode, decompression bombs; which values are the labels, keys, groups
and fields, and why the rest are left out), then yields row blocks: the pixels decoded once as
``ingest`` decodes them (:func:`carraystore.ingest.images.decode_bytes`), with each image's source
bytes, which the encoded layout keeps where they decode to the same pixels (:func:`encoded_entries`).
"""

from __future__ import annotations

import functools
import io
import math
import os
import re
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from carraystore.base.errors import ImageDecodeError, InvalidInputError, MigrationError
from carraystore.base.resources import available_cpus
from carraystore.format.encoded import Encoding, entry_for_pixels, sniff, source_entry
from carraystore.format.record import dtype_to_record, key_problem
from carraystore.ingest.images import DEPTH_RULE, DecodeOptions, decode_bytes

from .base import FIELD_MAX_ROW_BYTES, FIELDS_MAX_ROW_BYTES, Block, Source

__all__ = [
    "SourceFormatError",
    "TruncatedSourceError",
    "SourceChecksumError",
    "MixedTypesError",
    "SourceImageError",
    "MAX_MEMBER_BYTES",
    "PILLOW_FORMATS",
    "Sample",
    "SampleReader",
    "SampleSource",
    "Unreadable",
    "brace_expand",
    "is_url",
    "open_binary",
    "read_exact",
    "encoded_entries",
    "entries_note",
    "image_magic",
]


class SourceFormatError(MigrationError):
    """A file of the source is not the format it looks like, or is damaged (the message names the file and where)."""


class TruncatedSourceError(SourceFormatError):
    """A file of the source ends inside a tar member, a record or a table: it was cut short (copy it again)."""


class SourceChecksumError(SourceFormatError):
    """A TFRecord record fails its CRC32C check: the file is damaged."""


class MixedTypesError(MigrationError):
    """A column holds values of different types (in different files of one split, or a union type)."""


class SourceImageError(MigrationError, ImageDecodeError):
    """A sample's image is not an image Pillow decodes (JPEG, PNG, WebP, GIF, BMP, TIFF, PPM), or is refused as a
    decompression bomb."""


#: The largest tar member, record or table cell read (a header claiming more is refused before it is read).
MAX_MEMBER_BYTES = 256 * 1024 * 1024
#: Distinct value names (members, features, columns, JSON keys) across a source; refused beyond.
MAX_VALUE_NAMES = 10_000
#: The image formats read from a sample (Pillow's names); anything else is not taken for an image.
PILLOW_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF", "PPM")
_GRAY_MODES = ("1", "L", "I;16", "I;16B", "I;16L", "I;16N", "I")
_DEEP_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")
_ALPHA_MODES = ("RGBA", "LA", "PA", "RGBa", "La")
_LABEL_RULE = "integers >= 0, one per sample"


@dataclass(frozen=True)
class Unreadable:
    """A value that cannot be a field, and why (an unknown member type, a nested structure, bad JSON)."""

    reason: str


@dataclass
class Sample:
    """One sample of a source: where it is (for messages), its key if the format has one, its named values."""

    where: str
    key: str | None
    values: dict[str, Any]


class SampleReader:
    """What a format module gives :class:`SampleSource`: its samples (re-readable) and what names mean in it."""

    kind = "samples"
    #: what the user pointed at, for the report
    path: Path
    #: the source as given (a path, a pattern, URLs), for messages
    location: str = ""
    codec: str = ""
    #: image value names tried in order when ``images`` is not given
    image_names: tuple[str, ...] = ()
    #: label value names tried in order when ``labels`` is not given
    label_names: tuple[str, ...] = ()
    #: key value names tried in order when the samples carry no key and ``keys`` is not given
    key_names: tuple[str, ...] = ()
    #: text values that may name the labels (label -> text, the same text for every sample of a label)
    class_text_names: tuple[str, ...] = ()
    #: an inferred image is the first of ``image_names`` each sample has (WebDataset: jpg in one, png in another)
    image_per_sample = False
    #: list values of one element in every sample are scalars (TFRecord features are lists)
    squeeze: bool = False
    #: class names the source's own metadata gives, and for which value
    class_names: tuple[str, ...] | None = None
    class_names_for: str | None = None
    #: "member", "feature" or "column", for messages
    value_word = "value"
    #: said when a label value is missing or negative (how the format marks "no label")
    missing_label_hint = ""
    attrs: dict[str, Any]

    def __init__(self) -> None:
        self.notes: list[str] = []
        self.attrs = {}
        self.provenance: dict[str, Any] = {}

    def samples(self) -> Iterator[Sample]:
        raise NotImplementedError

    #: the source's files or URLs, whose sizes make its bytes for the report
    locations: Sequence[str | Path] = ()

    @functools.cached_property
    def cbytes(self) -> int:
        """The source's bytes: the sum of its files' sizes (each asked once)."""
        return sum(location_size(str(loc)) for loc in self.locations)

    def close(self) -> None:
        """Release open files."""


# -- where the bytes come from ------------------------------------------------------------------


def is_url(location: Any) -> bool:
    """Whether ``location`` is a URL (``scheme://...``), read through the project's remote byte source."""
    return isinstance(location, str) and "://" in location and not location.startswith("file://")


_BRACE = re.compile(r"\{([^{}]*)\}")


def brace_expand(pattern: str) -> list[str]:
    """Expand WebDataset's shard patterns: ``{000..099}`` (zero padding kept) and ``{a,b,c}``, several per pattern."""
    depth = 0
    for ch in pattern:
        depth += (ch == "{") - (ch == "}")
        if depth > 1 or depth < 0:
            raise InvalidInputError(f"{pattern}: unbalanced or nested braces; give {{000..099}} or {{a,b}} patterns")
    m = _BRACE.search(pattern)
    if m is None:
        if "{" in pattern or "}" in pattern:
            raise InvalidInputError(f"{pattern}: unbalanced or nested braces; give {{000..099}} or {{a,b}} patterns")
        return [pattern]
    body = m.group(1)
    rng = re.fullmatch(r"(-?\d+)\.\.(-?\d+)", body)
    if rng is not None:
        lo, hi = int(rng.group(1)), int(rng.group(2))
        if hi < lo:
            raise InvalidInputError(f"{pattern}: the range {{{body}}} runs backwards")
        if hi - lo >= 1_000_000:
            raise InvalidInputError(f"{pattern}: the range {{{body}}} names more than a million shards")
        width = len(rng.group(1)) if rng.group(1).startswith("0") else 0
        choices = [str(i).zfill(width) for i in range(lo, hi + 1)]
    elif "," in body:
        choices = body.split(",")
    else:
        raise InvalidInputError(f"{pattern}: {{{body}}} is neither a range {{000..099}} nor a list {{a,b}}")
    head, tail = pattern[: m.start()], pattern[m.end() :]
    return [x for c in choices for x in brace_expand(head + c + tail)]


class _RemoteFile(io.RawIOBase):
    """A file at a URL read by ranged GETs of the remote byte source (obstore; ``carraystore[remote]``)."""

    def __init__(self, url: str) -> None:
        from carraystore.sources.remote import open_remote

        self._src = open_remote(url)
        self._size = self._src.size()
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._size - self._pos)
        if n <= 0:
            return 0
        data = self._src.read(self._pos, n)
        memoryview(b).cast("B")[:n] = data
        self._pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            self._src.close()
        super().close()


def open_binary(location: str | os.PathLike[str], buffer: int = 8 << 20) -> IO[bytes]:
    """A local file or a URL as a buffered, seekable binary file."""
    if is_url(location):
        return io.BufferedReader(_RemoteFile(str(location)), buffer_size=buffer)
    try:
        return open(location, "rb")  # noqa: SIM115 - the caller closes it
    except OSError as exc:
        raise MigrationError(f"{location}: cannot be read ({exc.strerror or exc})") from exc


def read_exact(f: IO[bytes], n: int, where: str, what: str) -> bytes:
    """Exactly ``n`` bytes from ``f``, else TruncatedSourceError saying what was cut short."""
    data = f.read(n)
    if len(data) != n:
        raise TruncatedSourceError(
            f"{where}: ends inside {what} ({len(data)} of its {n} bytes are there): the file is truncated; copy it again"
        )
    return data


def location_size(location: str) -> int:
    if is_url(location):
        try:
            with open_binary(location) as f:
                return int(f.seek(0, io.SEEK_END))
        except Exception:  # the size is for the report only
            return 0
    try:
        return os.path.getsize(location)
    except OSError:
        return 0


# -- images -------------------------------------------------------------------------------------

_MAGICS = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
)


def image_magic(data: Any) -> str | None:
    """The image format of ``data`` from its first bytes (Pillow's name), or None."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return None
    head = bytes(data[:12])
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if len(head) >= 3 and head[:1] == b"P" and head[1:2] in b"123456" and head[2:3] in b" \t\r\n":
        return "PPM"
    return next((name for magic, name in _MAGICS if head.startswith(magic)), None)


@dataclass(frozen=True)
class _Header:
    size: tuple[int, int]  # (width, height)
    mode: str
    format: str
    alpha: bool


def _image_header(data: bytes, where: str) -> _Header:
    """An image's size and mode from its header (no pixel decoded); a decompression bomb is refused here."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise SourceImageError(f"{where}: the image is empty (0 bytes)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=list(PILLOW_FORMATS)) as img:
                alpha = img.mode in _ALPHA_MODES or "transparency" in img.info
                return _Header((int(img.size[0]), int(img.size[1])), img.mode, str(img.format), alpha)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise SourceImageError(f"{where}: refused as a decompression bomb ({exc})") from exc
    except UnidentifiedImageError as exc:
        raise SourceImageError(
            f"{where}: not an image ({len(data)} bytes starting {data[:8]!r}); images are read as "
            f"{', '.join(PILLOW_FORMATS)}: name the image with --images NAME"
        ) from exc
    except Exception as exc:  # Pillow raises many types for bad headers
        raise SourceImageError(f"{where}: the image's header does not read ({type(exc).__name__}: {exc})") from exc


# -- values as fields ------------------------------------------------------------------------------


def _pytype(v: Any) -> str:
    return type(v).__name__


class _ValueScan:
    """What one named value looks like across the samples; decides the field it becomes, or why it cannot."""

    def __init__(self, name: str, squeeze: bool) -> None:
        self.name = name
        self.squeeze = squeeze
        self.count = 0
        self.types: Counter[str] = Counter()
        self.kinds: set[str] = set()
        self.dtypes: set[str] = set()
        self.shapes: set[tuple[int, ...]] = set()
        self.maxlen = 0
        self.utf8 = True
        self.big_int = False
        self.unreadable: str | None = None

    def add(self, v: Any) -> None:
        if v is None:
            return
        self.count += 1
        self.types[_pytype(v)] += 1
        if isinstance(v, Unreadable):
            self.unreadable = self.unreadable or v.reason
            return
        kind, dt, shape = _classify(v)
        if kind == "unreadable":
            self.unreadable = self.unreadable or f"{_pytype(v)} values, not numbers, text or arrays of one type"
            return
        self.kinds.add(kind)
        if dt is not None:
            self.dtypes.add(dt)
        self.shapes.add(shape)
        if kind == "str":
            self.maxlen = max(self.maxlen, len(v))
        elif kind == "bytes":
            self.maxlen = max(self.maxlen, len(v))
            if self.utf8:
                try:
                    bytes(v).decode("utf-8")
                except UnicodeDecodeError:
                    self.utf8 = False
        elif kind == "int" and not isinstance(v, np.generic) and not -(2**53) <= int(v) <= 2**53:
            self.big_int = True
            if not -(2**63) <= int(v) < 2**63:
                self.unreadable = self.unreadable or f"an integer ({v}) beyond int64"

    def decide(self, nrows: int) -> tuple[np.dtype, tuple[int, ...]] | str:
        """(dtype, row shape) of the field, or why the value is left out."""
        if self.count < nrows:
            return f"present in {self.count} of {nrows} samples; a field needs a value for every item"
        if self.unreadable is not None:
            return self.unreadable
        kinds = self.kinds
        what = ", ".join(f"{n} x {t}" for t, n in self.types.most_common())
        if len(kinds) > 1 and kinds != {"int", "float"}:
            return f"values of mixed types ({what})"
        if len(self.shapes) > 1:
            lens = sorted({s[0] if s else 1 for s in self.shapes})
            if all(len(s) <= 1 for s in self.shapes):
                return (
                    f"lists whose length varies ({lens[0]}..{lens[-1]} values); a field holds the same number per item"
                )
            return f"arrays of different shapes ({sorted(self.shapes)[:4]})"
        shape = next(iter(self.shapes))
        if self.squeeze and shape == (1,):
            shape = ()
        kind = next(iter(kinds))
        try:
            if kinds == {"int", "float"}:
                if self.big_int:
                    return f"floats mixed with integers too large to be exact as float64 ({what})"
                dt = np.dtype("<f8") if "float64" in self.dtypes or not self.dtypes else np.result_type(*self.dtypes)
            elif kind == "str" or (kind == "bytes" and self.utf8):
                dt = np.dtype(f"<U{max(1, self.maxlen)}")
            elif kind == "bytes":
                dt = np.dtype(f"S{max(1, self.maxlen)}")
            elif len(self.dtypes) == 1:
                dt = np.dtype(next(iter(self.dtypes)))
            else:
                dt = np.result_type(*self.dtypes)
                if any(np.dtype(d).kind != dt.kind for d in self.dtypes):
                    return f"values of mixed types ({sorted(self.dtypes)})"
            dtype_to_record(dt)
        except (TypeError, InvalidInputError) as exc:
            return f"a type a store does not hold ({exc})"
        row = math.prod(shape) * dt.itemsize
        if row > FIELD_MAX_ROW_BYTES:
            size = f"text of up to {self.maxlen} characters" if dt.kind in "US" else f"{row} bytes per item"
            return f"{size}, more than a field holds ({FIELD_MAX_ROW_BYTES} bytes per item)"
        return dt, shape


def _classify(v: Any) -> tuple[str, str | None, tuple[int, ...]]:
    """(kind, numpy dtype or None, shape) of one value."""
    if isinstance(v, (bool, np.bool_)):
        return "bool", "|b1", ()
    if isinstance(v, np.generic):
        kind = "float" if v.dtype.kind == "f" else ("int" if v.dtype.kind in "iu" else "num")
        if v.dtype.kind in "OV":
            return "unreadable", None, ()
        if v.dtype.kind in "US":
            return ("str" if v.dtype.kind == "U" else "bytes"), None, ()
        return kind, v.dtype.str, ()
    if isinstance(v, int):
        return "int", "<i8", ()
    if isinstance(v, float):
        return "float", "<f8", ()
    if isinstance(v, str):
        return "str", None, ()
    if isinstance(v, (bytes, bytearray)):
        return "bytes", None, ()
    if isinstance(v, (list, tuple)):
        try:
            v = np.asarray(v)
        except ValueError:
            return "unreadable", None, ()
    if isinstance(v, np.ndarray):
        if v.dtype.hasobject or v.dtype.kind in "V" or v.ndim == 0 and v.dtype.kind in "US":
            return "unreadable", None, ()
        if v.dtype.kind in "US":
            return "array", v.dtype.str, tuple(v.shape)
        return "array", v.dtype.str, tuple(v.shape)
    return "unreadable", None, ()


def _to_column(values: Sequence[Any], dt: np.dtype, shape: tuple[int, ...], where: str) -> np.ndarray:
    out = np.empty((len(values), *shape), dtype=dt)
    for i, v in enumerate(values):
        if isinstance(v, (bytes, bytearray)) and dt.kind == "U":
            v = bytes(v).decode("utf-8")
        try:
            if shape:
                out[i] = np.asarray(v).reshape(shape)
            else:
                out[i] = np.asarray(v).reshape(()) if isinstance(v, (np.ndarray, list, tuple)) else v
        except (ValueError, TypeError, OverflowError) as exc:
            raise MigrationError(f"{where}: value {v!r} changed type while reading ({exc})") from exc
    return out


def _label_of(v: Any) -> int | None:
    """A label value as a class index, or None when it is not one (an integer >= 0)."""
    if isinstance(v, (list, tuple)):
        v = np.asarray(v)
    if isinstance(v, np.ndarray):
        if v.shape not in ((), (1,)) or v.dtype.kind not in "iu":
            return None
        v = v.reshape(())[()]
    if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
        return None
    i = int(v)
    return i if 0 <= i < 2**31 else None


def _text_of(v: Any) -> str | None:
    if isinstance(v, np.ndarray) and v.shape == (1,):
        v = v[0]
    if isinstance(v, (list, tuple)) and len(v) == 1:
        v = v[0]
    if isinstance(v, (bytes, bytearray)):
        try:
            return bytes(v).decode("utf-8")
        except UnicodeDecodeError:
            return None
    return v if isinstance(v, str) else None


def _group_of(v: Any) -> str | None:
    if isinstance(v, np.ndarray) and v.shape == (1,):
        v = v[0]
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    t = _text_of(v)
    return t if t else None


# -- the source --------------------------------------------------------------------------------------


def _color_mode(headers: Counter[tuple[str, bool]]) -> tuple[str, str]:
    """The colour mode that holds every image (any alpha: rgba; all gray: grayscale; else rgb), and why."""
    if any(alpha for (_m, alpha) in headers):
        n = sum(c for (_m, alpha), c in headers.items() if alpha)
        return "rgba", f"{n} image(s) have an alpha channel or transparency"
    if all(m in _GRAY_MODES for (m, _a) in headers):
        return "grayscale", "every image is grayscale"
    return "rgb", "the images are colour"


@dataclass
class _Plan:
    images: str
    labels: str | None
    keys: str | None  # None: the samples' own keys (or none)
    groups: str | None
    fields: dict[str, tuple[np.dtype, tuple[int, ...]]] = field(default_factory=dict)
    #: image names tried in order in each sample (WebDataset: jpg, else png, ...); () for one name
    choices: tuple[str, ...] = ()


class SampleSource(Source):
    """Samples of encoded images as a migration source: scanned once, then read in row blocks of decoded pixels."""

    def __init__(
        self,
        reader: SampleReader,
        *,
        images: str | None = None,
        labels: str | None = None,
        keys: str | None = None,
        groups: str | None = None,
        no_labels: bool = False,
        color_mode: str | None = None,
        image_size: Sequence[int] | None = None,
        workers: int | None = None,
    ) -> None:
        super().__init__()
        self.reader = reader
        self.kind = reader.kind
        self.path = reader.path
        self.location = reader.location or str(reader.path)
        self.attrs = dict(reader.attrs)
        self.default_codec = None
        self.workers = max(1, workers if workers is not None else min(8, available_cpus()))
        if no_labels and labels is not None:
            raise InvalidInputError("give either labels or no_labels (--no-labels), not both")
        if color_mode is not None and color_mode not in ("grayscale", "rgb", "rgba"):
            raise InvalidInputError(f"color_mode must be grayscale, rgb or rgba, got {color_mode!r}")
        size = None if image_size is None else tuple(int(x) for x in image_size)
        if size is not None and (len(size) != 2 or min(size) < 1):
            raise InvalidInputError(f"image_size must be (height, width), got {image_size!r}")
        try:
            self._scan(images, labels, keys, groups, no_labels, color_mode, size)
        except BaseException:
            reader.close()
            raise
        self.codec = reader.codec  # known once the files were read
        self.notes = reader.notes + self.notes

    # -- the scan: no pixel decoded --------------------------------------------------------------
    def _scan(
        self,
        images: str | None,
        labels: str | None,
        keys: str | None,
        groups: str | None,
        no_labels: bool,
        color_mode: str | None,
        size: tuple[int, ...] | None,
    ) -> None:
        r = self.reader
        word = r.value_word
        plan: _Plan | None = None
        scans: dict[str, _ValueScan] = {}
        modes: Counter[tuple[str, bool]] = Counter()
        formats: Counter[str] = Counter()
        first: tuple[tuple[int, int], str] | None = None
        label_values: list[int | None] = []
        label_texts: list[str | None] = []
        texts: dict[str, dict[int, set[str]]] = {t: {} for t in r.class_text_names}
        sample_keys: list[str | None] = []
        used: Counter[str] = Counter()
        group_names: set[str] = set()
        n = 0
        deep = 0
        for s in r.samples():
            if plan is None:
                plan = self._plan = self._names(s, images, labels, keys, groups, no_labels)
            name = self._image_name(s)
            img = s.values.get(name)
            if not isinstance(img, (bytes, bytearray, memoryview)):
                raise SourceImageError(
                    f"{s.where}: no image {word} {name!r}"
                    + (f" ({img.reason})" if isinstance(img, Unreadable) else "")
                    + (f" (it is {_pytype(img)})" if img is not None and not isinstance(img, Unreadable) else "")
                    + f"; the sample has {sorted(s.values)[:12]}"
                )
            used[name] += 1
            h = _image_header(bytes(img), f"{s.where}, {word} {name!r}")
            modes[(h.mode, h.alpha)] += 1
            formats[h.format] += 1
            deep += h.mode in _DEEP_MODES
            if first is None:
                first = (h.size, s.where)
            elif h.size != first[0] and size is None:
                (w0, h0), where0 = first
                raise MigrationError(
                    f"{s.where}: the image is {h.size[0]}x{h.size[1]} pixels, the first ({where0}) is {w0}x{h0}; a "
                    "store holds images of one size: pass --image-size H W (image_size=(H, W)) to resize them all"
                )
            if plan.labels is not None:
                lab = _label_of(s.values.get(plan.labels))
                label_values.append(lab)
                label_texts.append(_text_of(s.values.get(plan.labels)) if lab is None else None)
                for t, seen in texts.items():
                    text = _text_of(s.values.get(t))
                    if lab is not None and text is not None:
                        seen.setdefault(lab, set()).add(text)
            if plan.groups is not None:
                group = _group_of(s.values.get(plan.groups))
                if group is None:
                    raise MigrationError(
                        f"{s.where}: {word} {plan.groups!r} (--groups) is "
                        + ("missing" if plan.groups not in s.values else f"{s.values[plan.groups]!r}")
                        + "; every sample needs a group: a non-empty name or an integer"
                    )
                group_names.add(group)
            sample_keys.append(self._key(s, plan))
            for name, v in s.values.items():
                if name not in self._not_fields:
                    scans.setdefault(name, _ValueScan(name, r.squeeze)).add(v)
            if len(scans) > MAX_VALUE_NAMES:
                raise SourceFormatError(
                    f"{s.where}: the samples so far hold more than {MAX_VALUE_NAMES} distinct {word}s; a store keeps "
                    f"at most {FIELDS_MAX_ROW_BYTES} bytes of fields per item; the source is damaged or hostile"
                )
            n += 1
        if plan is None or first is None:
            raise MigrationError(f"{self.location}: holds no samples")
        self.nrows = n
        self._decide_labels(plan, label_values, label_texts, labels, scans, texts)
        self._decide_keys(plan, sample_keys, keys, scans)
        self._decide_fields(plan, scans, n)
        if plan.groups is not None:
            self.notes.append(f"groups from {word} {plan.groups!r}: {len(group_names)} groups")
        if color_mode is None:
            color_mode, why = _color_mode(modes)
            self.notes.append(f"colour mode {color_mode} ({why}); --color-mode picks another")
        elif color_mode != "rgba" and any(a for (_m, a) in modes):
            self.notes.append(f"colour mode {color_mode}: the alpha channel of some images is dropped (--color-mode)")
        if deep:
            self.notes.append(f"{deep} 16-bit image(s): {DEPTH_RULE['uint8']}")
        channels = {"grayscale": 1, "rgb": 3, "rgba": 4}[color_mode]
        (w0, h0), _ = first
        hw = (size[0], size[1]) if size is not None else (h0, w0)
        self.item_shape = (*hw, channels)
        self.dtype = np.dtype(np.uint8)
        self.decode = DecodeOptions(color_mode=color_mode, image_size=(hw[0], hw[1]) if size is not None else None)
        if size is not None:
            self.notes.append(f"images resized to {size[0]}x{size[1]} (bilinear, as ingest --image-size)")
        shown = ", ".join(f"{k} {v}" for k, v in formats.most_common())
        which = " or ".join(repr(n) for n, _ in used.most_common())
        self.notes.insert(0, f"images from {word} {which} ({shown})")
        self.provenance = {
            **r.provenance,
            "images": plan.images,
            "labels": plan.labels,
            "keys": plan.keys if plan.keys is not None else ("sample keys" if self._has_keys else None),
            "groups": plan.groups,
            "decoding": {"color_mode": color_mode, "image_size": list(size) if size else None, "dtype": "uint8"},
        }

    def _names(
        self, s: Sample, images: str | None, labels: str | None, keys: str | None, groups: str | None, no_labels: bool
    ) -> _Plan:
        """The image, labels, keys and groups values, from the flags or the format's names and the first sample."""
        r, word, have = self.reader, self.reader.value_word, s.values
        for flag, name in (("--images", images), ("--labels", labels), ("--keys", keys), ("--groups", groups)):
            if name is not None and name not in have:
                raise MigrationError(
                    f"{s.where}: no {word} {name!r} ({flag}); the first sample has {word}s {sorted(have)[:20]}"
                )
        found = [n for n in have if image_magic(have[n]) is not None]
        inferred_images = images is None
        if images is None:
            named = [n for n in r.image_names if n in found]
            if named:
                images = named[0]
            elif len(found) == 1:
                images = found[0]
            elif found:
                raise MigrationError(
                    f"{s.where}: several {word}s could be the image: {found}; choose one with --images NAME"
                )
            else:
                raise SourceImageError(
                    f"{s.where}: no {word} holds an image ({', '.join(PILLOW_FORMATS)}); the sample has "
                    f"{sorted(have)[:20]}; name the image with --images NAME"
                )
        seconds = [n for n in found if n != images and n not in (labels, keys, groups)]
        for o in seconds:
            self.notes.append(
                f"not migrated: {word} {o!r} (a second image; migrate it as a store of its own with --images {o})"
            )
        self._labels_inferred = labels is None
        if labels is None and not no_labels:
            labels = next((n for n in r.label_names if n in have and n not in (images, keys, groups)), None)
            if labels is None:
                self.notes.append(
                    f"no labels: no {word} named {', '.join(repr(n) for n in r.label_names[:4])}; --labels NAME takes one"
                )
        self._keys_inferred = keys is None and s.key is None
        if self._keys_inferred:
            keys = next((n for n in r.key_names if n in have and n not in (images, labels, groups)), None)
        used = [images, labels, keys, groups]
        dup = {n for n in used if n is not None and used.count(n) > 1}
        if dup:
            raise InvalidInputError(f"{s.where}: {sorted(dup)} named for two roles (images, labels, keys, groups)")
        self._not_fields = {images, groups, *seconds}
        plan = _Plan(images, None if no_labels else labels, keys, groups)
        if r.image_per_sample and inferred_images:  # WebDataset: a sample without a .jpg may have a .png
            plan.choices = tuple(n for n in r.image_names if n not in (labels, keys, groups))
            self._not_fields.update(plan.choices)
        return plan

    def _image_name(self, s: Sample) -> str:
        """The name of ``s``'s image: the plan's, or with per-sample choices the first of them the sample has."""
        plan = self._plan
        if plan.choices and plan.images not in s.values:
            return next((n for n in plan.choices if n in s.values), plan.images)
        return plan.images

    def _decide_labels(
        self,
        plan: _Plan,
        values: list[int | None],
        label_texts: list[str | None],
        given: str | None,
        scans: dict[str, _ValueScan],
        texts: dict[str, dict[int, set[str]]],
    ) -> None:
        r, word = self.reader, self.reader.value_word
        self.has_labels = False
        self._labels: np.ndarray | None = None
        self._label_index: dict[str, int] | None = None
        if plan.labels is None:
            return
        bad = [i for i, v in enumerate(values) if v is None]
        if bad and len(bad) == len(values) and all(label_texts):  # class names as text: sorted, as Keras does
            sorted_names = sorted({t for t in label_texts if t})
            self._label_index = {n: i for i, n in enumerate(sorted_names)}
            scans.pop(plan.labels, None)
            self.has_labels = True
            self._labels = np.asarray([self._label_index[t] for t in label_texts if t], dtype="<i8")
            self.class_names = tuple(sorted_names)
            shown = f"{sorted_names[:10]}{' ...' if len(sorted_names) > 10 else ''}"
            self.notes.append(
                f"labels from {word} {plan.labels!r}: {len(sorted_names)} class names from its text, sorted: {shown}"
            )
            return
        if bad:
            if given is not None:
                raise MigrationError(
                    f"{self.location}: --labels {given!r}: sample {bad[0]} (and {len(bad) - 1} more) has no class "
                    f"label ({_LABEL_RULE}); leave out --labels to keep the {word} as a field"
                )
            self.notes.append(
                f"{word} {plan.labels!r} not taken as the labels: {len(bad)} of {len(values)} samples have no "
                f"class label there ({_LABEL_RULE}{r.missing_label_hint}): kept as a field if it can be one"
            )
            plan.labels = None
            return
        scans.pop(plan.labels, None)
        self.has_labels = True
        self._labels = np.asarray(values, dtype="<i8")
        top = int(self._labels.max())
        names = r.class_names if r.class_names_for == plan.labels else None
        if names is not None:
            if top >= len(names):
                self.notes.append(
                    f"class names of {plan.labels!r} in the source's metadata ({len(names)}) do not cover the labels "
                    f"(up to {top}): not used; --class-names names them"
                )
            else:
                self.class_names = names
                shown = f"{list(names)[:10]}{' ...' if len(names) > 10 else ''}"
                self.notes.append(f"class names from the source's metadata: {shown}")
        for t, seen in texts.items():
            if self.class_names is not None or t not in scans:
                continue
            if set(seen) == set(range(top + 1)) and all(len(v) == 1 for v in seen.values()):
                names = tuple(next(iter(seen[i])) for i in range(top + 1))
                if len(set(names)) == len(names) and all(names):
                    self.class_names = names
                    del scans[t]
                    self.notes.append(f"class names from {word} {t!r}: {list(names)[:10]}")
                    continue
            self.notes.append(f"{word} {t!r} does not name each label with one text of its own: kept as a field")
        self.notes.append(f"labels from {word} {plan.labels!r}" + (" (inferred)" if self._labels_inferred else ""))

    def _key(self, s: Sample, plan: _Plan) -> str | None:
        if plan.keys is None:
            return s.key
        return _text_of(s.values.get(plan.keys))

    def _decide_keys(
        self, plan: _Plan, keys: list[str | None], given: str | None, scans: dict[str, _ValueScan]
    ) -> None:
        word = self.reader.value_word
        self._has_keys = False
        if plan.keys is None and all(k is None for k in keys):
            return
        name = f"{word} {plan.keys!r}" if plan.keys is not None else "the samples' names"
        bad = next(
            (
                (i, k, "is missing" if k is None else key_problem(k))
                for i, k in enumerate(keys)
                if k is None or key_problem(k)
            ),
            None,
        )
        if bad is None:
            self._has_keys = True
            scans.pop(plan.keys or "", None)
            self.notes.append(f"keys from {name}")
            dup = len(keys) - len(set(keys))
            if dup:
                self.notes.append(f"{dup} key(s) repeat an earlier sample's key (kept as they are)")
            return
        if plan.keys is not None and self._keys_inferred and given is None:
            self.notes.append(f"no keys: {name} is not a key in every sample (sample {bad[0]}: {bad[1]!r} {bad[2]})")
            plan.keys = None
            return
        i, k, why = bad
        raise MigrationError(
            f"{self.location}: sample {i}: its key {k!r} from {name} {why}; a store's keys are relative paths or ids"
        )

    def _decide_fields(self, plan: _Plan, scans: dict[str, _ValueScan], n: int) -> None:
        word = self.reader.value_word
        budget = FIELDS_MAX_ROW_BYTES
        for name, scan in scans.items():
            got = scan.decide(n)
            if isinstance(got, str):
                self.notes.append(f"not migrated: {word} {name!r} ({got})")
                continue
            dt, shape = got
            row = math.prod(shape) * dt.itemsize
            if row > budget:
                self.notes.append(
                    f"not migrated: {word} {name!r} (the fields before it already take "
                    f"{FIELDS_MAX_ROW_BYTES - budget} bytes per item, at most {FIELDS_MAX_ROW_BYTES})"
                )
                continue
            budget -= row
            plan.fields[name] = (dt, shape)

    # -- reading ---------------------------------------------------------------------------------
    @property
    def cbytes(self) -> int:
        return self.reader.cbytes

    def blocks(self) -> Iterator[Block]:
        rows = self.block_rows
        batch: list[Sample] = []
        with ThreadPoolExecutor(self.workers, thread_name_prefix="carraystore-migrate") as pool:
            for s in self.reader.samples():
                batch.append(s)
                if len(batch) == rows:
                    yield self._block(batch, pool)
                    batch = []
            if batch:
                yield self._block(batch, pool)

    def _decode(self, s: Sample) -> tuple[np.ndarray, bytes]:
        word = self.reader.value_word
        name = self._image_name(s)
        where = f"{s.where}, {word} {name!r}"
        data = s.values.get(name)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise SourceImageError(f"{where}: missing on re-reading (the source changed)")
        data = bytes(data)
        try:
            arr = decode_bytes(data, where, self.decode, PILLOW_FORMATS)
        except SourceImageError:
            raise
        except ImageDecodeError as exc:
            raise SourceImageError(str(exc)) from exc
        if arr.shape != self.item_shape:
            raise SourceImageError(
                f"{where}: decodes to {arr.shape}, the store's images are {self.item_shape} (the source changed?)"
            )
        return arr, data

    def _block(self, batch: list[Sample], pool: ThreadPoolExecutor) -> Block:
        plan = self._plan
        decoded = list(pool.map(self._decode, batch))
        data = np.stack([a for a, _ in decoded])
        labels = None
        if plan.labels is not None:
            index = self._label_index
            labs = [
                _label_of(v) if index is None else index.get(_text_of(v) or "")
                for v in (s.values.get(plan.labels) for s in batch)
            ]
            bad = next((s for s, v in zip(batch, labs, strict=True) if v is None), None)
            if bad is not None:
                raise MigrationError(f"{bad.where}: no class label on re-reading (the source changed)")
            labels = np.asarray(labs, dtype="<i8")
        keys = None
        if self._has_keys:
            ks = [self._key(s, plan) for s in batch]
            if any(k is None for k in ks):
                raise MigrationError(f"{batch[0].where}: a key went missing on re-reading (the source changed)")
            keys = [str(k) for k in ks]
        groups = None
        if plan.groups is not None:
            gs = [_group_of(s.values.get(plan.groups)) for s in batch]
            if any(g is None for g in gs):
                raise MigrationError(f"{batch[0].where}: a group went missing on re-reading (the source changed)")
            groups = [str(g) for g in gs]
        columns = None
        if plan.fields:
            columns = {}
            for name, (dt, shape) in plan.fields.items():
                values = [s.values.get(name) for s in batch]
                if any(v is None for v in values):
                    raise MigrationError(f"{batch[0].where}: {name!r} went missing on re-reading (the source changed)")
                columns[name] = _to_column(values, dt, shape, f"{batch[0].where}, {name!r}")
        return Block(data, labels=labels, keys=keys, columns=columns, groups=groups, encoded=[e for _, e in decoded])

    def close(self) -> None:
        self.reader.close()


# -- the encoded layout -------------------------------------------------------------------------------


def encoded_entries(
    block: Block, encoding: Encoding, color_mode: str, pool: ThreadPoolExecutor | None = None
) -> tuple[list[bytes], Counter[str]]:
    """The entries of a block for a store of layout "encoded", with ingest's rule: a sample's source bytes
    where they decode to exactly its pixels (:func:`source_entry`), else its pixels in the pinned format;
    and why each was (``kept jpeg``) or was not kept."""
    sources: Sequence[bytes | None] = block.encoded if block.encoded is not None else [None] * len(block.data)
    nbytes = int(np.prod(block.data.shape[1:]))

    def one(j: int) -> tuple[bytes, str]:
        data = sources[j]
        pixels = block.data[j]
        if data is None:
            return entry_for_pixels(pixels, encoding), "encoded from the source's pixels (it holds no image files)"
        kept = source_entry(data, pixels, color_mode)
        if kept is not None:
            return kept, f"kept {sniff(kept, nbytes)}"
        fmt = sniff(data, nbytes)
        if fmt not in ("jpeg", "png", "webp"):
            why = f"{(image_magic(data) or 'not JPEG/PNG/WebP').upper()} is not a format entries keep"
        elif len(data) >= nbytes:
            why = "larger than its pixels"
        else:
            why = "decodes to other pixels than the store's (resized, colour-converted or a decoder difference)"
        return entry_for_pixels(pixels, encoding), why

    idx = range(len(block.data))
    results = list(pool.map(one, idx)) if pool is not None else [one(j) for j in idx]
    return [e for e, _ in results], Counter(w for _, w in results)


def entries_note(why: Counter[str], rows: int, encoding: Encoding) -> str:
    """The summary's line on the encoded layout: how many images are their source bytes, and why the rest are not."""
    kept = {w[5:]: n for w, n in why.items() if w.startswith("kept ")}
    other = {w: n for w, n in why.items() if not w.startswith("kept ")}
    pinned = encoding.reencode.upper() + (f" at quality {encoding.quality}" if encoding.quality is not None else "")
    text = f"layout encoded: {sum(kept.values())} of {rows} images kept as their source bytes"
    if kept:
        text += " (" + ", ".join(f"{fmt.upper()} {n}" for fmt, n in sorted(kept.items())) + ")"
    if other:
        text += f"; {sum(other.values())} stored as {pinned} (or raw pixels where shorter): " + "; ".join(
            f"{n} {w}" for w, n in sorted(other.items(), key=lambda x: -x[1])
        )
    return text
