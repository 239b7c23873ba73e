"""TFRecord files of ``tf.train.Example``, read without TensorFlow: the record framing and its CRCs, and the
Example protobuf (Features, Feature, BytesList, FloatList, Int64List; packed or not) parsed here.

A record is ``uint64 length, uint32 masked CRC32C of the length, data, uint32 masked CRC32C of the
data``; both CRCs are checked (``google-crc32c`` when installed, else a table in Python). Files
may be GZIP or ZLIB compressed (``tf.io.TFRecordOptions``). A record longer than
``MAX_MEMBER_BYTES`` is refused before it is read.
"""

from __future__ import annotations

import gzip
import io
import re
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from functools import lru_cache
from pathlib import Path
from typing import IO, Any

import numpy as np

from carraystore.base.errors import MigrationError

from .base import FIELD_MAX_ROW_BYTES
from .samples import (
    MAX_MEMBER_BYTES,
    Sample,
    SampleReader,
    SourceChecksumError,
    SourceFormatError,
    TruncatedSourceError,
    Unreadable,
    is_url,
    open_binary,
    read_exact,
)

__all__ = [
    "TFRecordReader",
    "crc32c",
    "masked_crc32c",
    "parse_example",
    "read_records",
    "looks_like_tfrecord",
    "tfrecord_files",
    "ExampleError",
]

_POLY = 0x82F63B78  # CRC-32C (Castagnoli), reflected
#: Features in one Example (the record is refused beyond): more than the fields a store's record holds.
MAX_FEATURES = 10_000
#: A float or int64 list longer than this on the wire cannot be a field (FIELD_MAX_ROW_BYTES), so is not parsed.
_MAX_LIST_BYTES = 16 * FIELD_MAX_ROW_BYTES
_MASK_DELTA = 0xA282EAD8


class ExampleError(SourceFormatError):
    """A record is not a ``tf.train.Example`` protobuf (malformed, or another message such as a SequenceExample)."""


@lru_cache(maxsize=1)
def _table() -> tuple[int, ...]:
    out = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        out.append(c)
    return tuple(out)


def crc32c_python(data: bytes | memoryview) -> int:
    """CRC-32C of ``data`` by a table, in Python (the fallback when google-crc32c is not installed)."""
    t = _table()
    crc = 0xFFFFFFFF
    for b in bytes(data):
        crc = t[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


@lru_cache(maxsize=1)
def _crc_impl() -> tuple[Callable[[Any], int], str]:
    try:
        import google_crc32c

        if google_crc32c.implementation == "c":
            return (lambda d: int(google_crc32c.value(bytes(d)))), "google-crc32c"
    except ImportError:
        pass
    return crc32c_python, "python"


def crc32c(data: bytes | memoryview) -> int:
    """CRC-32C (Castagnoli) of ``data``."""
    return _crc_impl()[0](data)


def masked_crc32c(data: bytes | memoryview) -> int:
    """TFRecord's masked CRC: the CRC-32C rotated right by 15 bits plus 0xa282ead8."""
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + _MASK_DELTA) & 0xFFFFFFFF


# -- files and records ---------------------------------------------------------------------------

_TF_NAME = re.compile(r"\.(tfrecords?|tfrec)(-\d{5}-of-\d{5})?(\.gz|\.zz|\.zlib)?$", re.IGNORECASE)
_TFDS_SPLIT = re.compile(r"^(?P<name>.+?)-(?P<split>[^-./]+)\.(tfrecords?|tfrec)(-\d{5}-of-\d{5})?$", re.IGNORECASE)


def looks_like_tfrecord(head: bytes) -> bool:
    """Whether ``head`` (12+ bytes) starts with a record whose length CRC is right."""
    if len(head) < 12:
        return False
    (want,) = struct.unpack("<I", head[8:12])
    (length,) = struct.unpack("<Q", head[:8])
    return bool(masked_crc32c(head[:8]) == want and length <= MAX_MEMBER_BYTES)


def tfrecord_files(folder: Path) -> list[Path]:
    """The TFRecord files in ``folder`` (by name: ``*.tfrecord``, ``*.tfrecord-00000-of-00004``, ``*.tfrec``), sorted."""
    return sorted(p for p in folder.iterdir() if p.is_file() and _TF_NAME.search(p.name))


def tfds_splits(files: Sequence[Path]) -> dict[str, list[Path]]:
    """TensorFlow Datasets' files by split (``mnist-train.tfrecord-00000-of-00001``); {} when not named so."""
    out: dict[str, list[Path]] = {}
    for f in files:
        m = _TFDS_SPLIT.match(f.name)
        if m is None:
            return {}
        out.setdefault(m.group("split"), []).append(f)
    return out


class _ZlibReader(io.RawIOBase):
    """A ZLIB-compressed TFRecord file (``TFRecordOptions(compression_type="ZLIB")``) decompressed as it is read."""

    def __init__(self, f: IO[bytes], where: str) -> None:
        self._f = f
        self._d = zlib.decompressobj()
        self._buf = b""
        self._where = where

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf:
            if self._d.eof:
                return 0
            chunk = self._d.unconsumed_tail or self._f.read(1 << 16)
            if not chunk:
                raise TruncatedSourceError(f"{self._where}: the ZLIB stream is cut short: the file is truncated")
            try:
                self._buf = self._d.decompress(chunk, 1 << 20)
            except zlib.error as exc:
                raise SourceFormatError(f"{self._where}: the ZLIB stream is damaged ({exc})") from exc
        n = min(len(b), len(self._buf))
        memoryview(b).cast("B")[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def _records_stream(f: IO[bytes], where: str) -> tuple[IO[bytes], str]:
    """The file's record stream (decompressed) and its compression ("", "gzip" or "zlib")."""
    head = f.peek(12)[:12] if hasattr(f, "peek") else b""
    if head[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=f, mode="rb"), "gzip"  # type: ignore[return-value]
    if head and not looks_like_tfrecord(head) and head[0] == 0x78 and (head[0] * 256 + head[1]) % 31 == 0:
        return io.BufferedReader(_ZlibReader(f, where)), "zlib"
    return f, ""


def read_records(f: IO[bytes], where: str) -> Iterator[bytes]:
    """The records of a TFRecord stream, each CRC-checked; named errors for truncation and bad CRCs."""
    i = 0
    while True:
        at = f"{where}: record {i}"
        try:
            head = f.read(12)
            if not head:
                return
            if len(head) < 12:
                raise TruncatedSourceError(
                    f"{at}: the file ends inside a record's header: it is truncated; copy it again"
                )
            (length,) = struct.unpack("<Q", head[:8])
            (want,) = struct.unpack("<I", head[8:12])
            if masked_crc32c(head[:8]) != want:
                raise SourceChecksumError(
                    f"{at}: the length's CRC32C does not match: the file is damaged (or not a TFRecord file)"
                )
            if length > MAX_MEMBER_BYTES:
                raise SourceFormatError(
                    f"{at}: claims {length} bytes, more than the {MAX_MEMBER_BYTES} a record may have; refused unread"
                )
            data = read_exact(f, length, at, "its data")
            crc = read_exact(f, 4, at, "its data CRC")
        except EOFError as exc:
            raise TruncatedSourceError(f"{at}: the compressed file is cut short ({exc}); copy it again") from exc
        except (OSError, zlib.error) as exc:  # gzip: a bad CRC or header
            raise SourceFormatError(f"{at}: the compressed file is damaged ({type(exc).__name__}: {exc})") from exc
        if masked_crc32c(data) != struct.unpack("<I", crc)[0]:
            raise SourceChecksumError(f"{at}: the data's CRC32C does not match: the record is damaged")
        yield data
        i += 1


# -- the Example protobuf ----------------------------------------------------------------------------


def _varint(buf: memoryview, pos: int, end: int, where: str) -> tuple[int, int]:
    result = 0
    shift = 0
    while True:
        if pos >= end:
            raise ExampleError(f"{where}: a varint runs past the end of its message")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ExampleError(f"{where}: a varint longer than 10 bytes")


def _fields(buf: memoryview, pos: int, end: int, where: str) -> Iterator[tuple[int, int, int, int]]:
    """(field number, wire type, value or start, end) of each field of the message ``buf[pos:end]``."""
    while pos < end:
        tag, pos = _varint(buf, pos, end, where)
        number, wire = tag >> 3, tag & 7
        if number == 0:
            raise ExampleError(f"{where}: a field numbered 0")
        if wire == 0:
            v, pos = _varint(buf, pos, end, where)
            yield number, 0, v, pos
        elif wire == 1 or wire == 5:
            size = 8 if wire == 1 else 4
            if pos + size > end:
                raise ExampleError(f"{where}: a fixed-size field runs past the end of its message")
            yield number, wire, pos, pos + size
            pos += size
        elif wire == 2:
            n, pos = _varint(buf, pos, end, where)
            if pos + n > end:
                raise ExampleError(f"{where}: a field of {n} bytes runs past the end of its message")
            yield number, 2, pos, pos + n
            pos += n
        else:
            raise ExampleError(f"{where}: wire type {wire} (groups) is not used by tf.train.Example")


def _int64(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _feature(buf: memoryview, pos: int, end: int, where: str) -> Any:
    """One Feature: bytes (one value) or a list of them, float32 or int64 arrays."""
    value: Any = Unreadable("an empty feature (no list of values)")
    for number, wire, a, b in _fields(buf, pos, end, where):
        if wire != 2 or number not in (1, 2, 3):
            continue
        if number == 1:  # BytesList
            spans = [(s, e) for n, w, s, e in _fields(buf, a, b, where) if n == 1 and w == 2]
            value = (
                bytes(buf[slice(*spans[0])]) if len(spans) == 1 else Unreadable(f"a list of {len(spans)} byte strings")
            )
        elif b - a > _MAX_LIST_BYTES:  # more values than a field holds: not parsed one by one
            value = Unreadable(f"a list of {b - a} bytes of numbers, more than a field holds")
        elif number == 2:  # FloatList
            parts: list[np.ndarray] = []
            for n, w, s, e in _fields(buf, a, b, where):
                if n != 1:
                    continue
                if w == 2:
                    if (e - s) % 4:
                        raise ExampleError(f"{where}: a packed float list of {e - s} bytes")
                    parts.append(np.frombuffer(buf[s:e], dtype="<f4"))
                elif w == 5:
                    parts.append(np.frombuffer(buf[s:e], dtype="<f4"))
            value = np.concatenate(parts).astype(np.float32) if parts else np.empty(0, np.float32)
        else:  # Int64List
            ints: list[int] = []
            for n, w, s, e in _fields(buf, a, b, where):
                if n != 1:
                    continue
                if w == 2:
                    p = s
                    while p < e:
                        v, p = _varint(buf, p, e, where)
                        ints.append(_int64(v))
                elif w == 0:
                    ints.append(_int64(s))
            value = np.array(ints, dtype=np.int64)
    return value


def parse_example(record: bytes | memoryview, where: str) -> dict[str, Any]:
    """A serialized ``tf.train.Example`` as {feature name: bytes | float32 array | int64 array | Unreadable}."""
    buf = memoryview(record)
    out: dict[str, Any] = {}
    saw_features = False
    count = 0
    for number, wire, a, b in _fields(buf, 0, len(buf), where):
        if number != 1 or wire != 2:
            raise ExampleError(
                f"{where}: not a tf.train.Example (field {number}, wire type {wire}); a SequenceExample or another "
                "message is not migrated"
            )
        saw_features = True
        for n, w, s, e in _fields(buf, a, b, where):  # Features: map<string, Feature> feature = 1
            if n != 1 or w != 2:
                continue
            key: str | None = None
            feature: Any = Unreadable("an empty feature (no list of values)")
            for kn, kw, ks, ke in _fields(buf, s, e, where):
                if kn == 1 and kw == 2:
                    try:
                        key = bytes(buf[ks:ke]).decode("utf-8")
                    except UnicodeDecodeError as exc:
                        raise ExampleError(f"{where}: a feature name that is not UTF-8") from exc
                elif kn == 2 and kw == 2:
                    feature = _feature(buf, ks, ke, where)
            if key is None:
                raise ExampleError(f"{where}: a feature without a name")
            out[key] = feature
            count += 1
            if count > MAX_FEATURES:
                raise ExampleError(f"{where}: more than {MAX_FEATURES} features; the record is damaged or hostile")
    if not saw_features and len(buf):
        raise ExampleError(f"{where}: not a tf.train.Example (no features)")
    return out


# -- the reader --------------------------------------------------------------------------------------


class TFRecordReader(SampleReader):
    """TFRecord files of ``tf.train.Example`` as samples: one per record, its features by name."""

    kind = "TFRecord"
    image_names = ("image/encoded", "image", "image_raw", "img", "encoded", "jpeg", "png")
    label_names = ("image/class/label", "label", "labels", "class", "image/label")
    key_names = ("image/filename",)
    class_text_names = ("image/class/text",)
    squeeze = True
    value_word = "feature"

    def __init__(self, files: Sequence[str], location: str, path: Path) -> None:
        super().__init__()
        if not files:
            raise MigrationError(f"{location}: no TFRecord files to migrate")
        self.files = [str(f) for f in files]
        self.locations = self.files
        self.location = location
        self.path = path
        self._compression = ""
        self._crc_noted = False
        self.provenance = {"tfrecord": {"files": len(self.files), "names": [Path(f).name for f in self.files[:16]]}}
        self._class_names_file()

    def _class_names_file(self) -> None:
        """TensorFlow Datasets writes a ClassLabel's names as ``<feature>.labels.txt`` beside the files."""
        if is_url(self.files[0]):
            return
        folder = Path(self.files[0]).parent
        for name in self.label_names:
            f = folder / f"{name.replace('/', '_')}.labels.txt"
            if f.is_file():
                names = tuple(line for line in f.read_text(encoding="utf-8").splitlines() if line)
                if names:
                    self.class_names, self.class_names_for = names, name
                    self.notes.append(f"class names of feature {name!r} from {f.name}")
                return

    def samples(self) -> Iterator[Sample]:
        if not self._crc_noted:
            self._crc_noted = True
            if _crc_impl()[1] == "python":
                self.notes.append(
                    "CRC32C checked in Python (slow): pip install google-crc32c (in carraystore[migrate]) to speed it up"
                )
        for name in self.files:
            with open_binary(name) as raw:
                f, compression = _records_stream(raw, name)
                self._compression = self._compression or compression
                self.codec = f"TFRecord ({compression})" if compression else "TFRecord"
                for i, record in enumerate(read_records(f, name)):
                    where = f"{name}: record {i}"
                    yield Sample(where, None, parse_example(record, where))
