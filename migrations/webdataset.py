"""WebDataset tar shards: samples grouped by key as WebDataset groups them, read with the standard library's tarfile.

A shard is streamed member by member (a member larger than ``MAX_MEMBER_BYTES`` is refused
before it is read); gzip, bzip2 and xz shards are decompressed with their checksums checked. A
shard that ends without the tar end-of-archive blocks, or with a damaged header, is refused
(``tarfile`` would end such a stream silently). The key of a member is its path up to the first
dot of its base name, its type the rest (lower case), as in ``webdataset.tariterators``.
"""

from __future__ import annotations

import bz2
import gzip
import io
import json
import lzma
import re
import tarfile
import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from carraystore.base.errors import MigrationError

from .npz import read_npy_header
from .samples import (
    MAX_MEMBER_BYTES,
    Sample,
    SampleReader,
    SourceFormatError,
    TruncatedSourceError,
    Unreadable,
    is_url,
    open_binary,
)

__all__ = ["WebDatasetReader", "IMAGE_TYPES", "LABEL_TYPES", "split_member_name", "is_tar", "member_value"]

#: Member types (the last part of the extension) read as encoded images, in the order one is picked.
IMAGE_TYPES = ("jpg", "jpeg", "png", "webp", "ppm", "pgm", "pbm", "bmp", "gif", "tif", "tiff", "img", "image")
#: Member types taken as the class label when ``--labels`` is not given, in order.
LABEL_TYPES = ("cls", "cls2", "class", "label")
_INT_TYPES = ("cls", "cls2", "class", "label", "index", "inx", "id")
_TEXT_TYPES = ("txt", "text")
_JSON_TYPES = ("json", "jsn")
_MSGPACK_TYPES = ("mp", "msgpack")
_PICKLE_TYPES = ("pyd", "pickle", "pkl")
_META = re.compile(r"__[^/]*__($|/)")
_NAME = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")


def split_member_name(name: str) -> tuple[str | None, str | None]:
    """(key, type) of a member name as WebDataset splits it: the path up to the first dot of the base name, the rest."""
    m = _NAME.match(name)
    return (m.group(1), m.group(2)) if m else (None, None)


def is_tar(head: bytes) -> bool:
    """Whether ``head`` (at least 512 bytes) starts a tar archive (ustar magic, or a valid v7 header checksum)."""
    if len(head) < 512:
        return False
    if head[257:262] == b"ustar":
        return True
    try:
        stored = int(head[148:156].split(b"\0", 1)[0].strip() or b"-1", 8)
    except ValueError:
        return False
    return stored == sum(head[:148]) + 256 + sum(head[156:512]) and any(head[:100])


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """A JSON (or msgpack) member's values: a mapping one level deep as ``prefix.key``, else the value itself."""
    if isinstance(value, dict):
        for k, v in value.items():
            name = f"{prefix}.{k}"
            if isinstance(v, dict):
                out[name] = Unreadable("a nested mapping; fields hold numbers, text or fixed-size lists")
            elif isinstance(v, list) and not all(isinstance(x, (int, float, bool)) for x in v):
                out[name] = Unreadable("a list of other than numbers")
            else:
                out[name] = v
    elif isinstance(value, list) and not all(isinstance(x, (int, float, bool)) for x in value):
        out[prefix] = Unreadable("a list of other than numbers")
    else:
        out[prefix] = value


def member_value(kind: str, data: bytes, name: str, out: dict[str, Any]) -> None:
    """Put the value(s) of one member of type ``kind`` (its full suffix ``name``) into ``out``."""
    last = kind.rsplit(".", 1)[-1]
    if last in IMAGE_TYPES:
        out[name] = data
    elif last in _INT_TYPES:
        text = data.decode("utf-8", "replace").strip()
        try:
            out[name] = int(text)
        except ValueError:
            out[name] = text
    elif last in _TEXT_TYPES:
        try:
            out[name] = data.decode("utf-8")
        except UnicodeDecodeError:
            out[name] = Unreadable("text that is not UTF-8")
    elif last in _JSON_TYPES:
        try:
            _flatten(name, json.loads(data), out)
        except (ValueError, RecursionError) as exc:
            out[name] = Unreadable(f"JSON that does not parse ({exc})")
    elif last in _MSGPACK_TYPES:
        import msgpack

        try:
            _flatten(name, msgpack.unpackb(data, raw=False, strict_map_key=False), out)
        except Exception as exc:  # msgpack raises several types for bad data
            out[name] = Unreadable(f"msgpack that does not parse ({type(exc).__name__})")
    elif last == "npy":
        if not data.startswith(b"\x93NUMPY"):
            out[name] = Unreadable("not an .npy (no NUMPY header)")
            return
        try:
            f = io.BytesIO(data)
            shape, _fortran, dtype = read_npy_header(f, name, allow_objects=True)
            if dtype.hasobject:
                out[name] = Unreadable("an .npy of Python objects, never unpickled")
                return
            if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize > len(data) - f.tell():
                out[name] = Unreadable(
                    f"an .npy whose header claims {dtype}{list(shape)}, more than its {len(data)} bytes"
                )
                return
            out[name] = np.load(io.BytesIO(data), allow_pickle=False)
        except ValueError as exc:
            pickled = "pickle" in str(exc) or "Object arrays" in str(exc)
            out[name] = Unreadable("an .npy of Python objects, never unpickled" if pickled else f"not an .npy ({exc})")
        except (OSError, EOFError, MigrationError) as exc:
            out[name] = Unreadable(f"not an .npy ({exc})")
    elif last in _PICKLE_TYPES:
        out[name] = Unreadable("pickled; never unpickled (unpickling runs code from the file)")
    else:
        out[name] = Unreadable(f"a member of type .{kind} that carraystore does not read ({len(data)} bytes)")


class _Window:
    """A forward stream that remembers its last bytes, so that the block at the end of a tar can be looked at."""

    KEEP = 1 << 17

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.pos = 0
        self.tail = b""

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.pos += len(data)
        self.tail = (self.tail + data)[-self.KEEP :]
        return data

    def block_at(self, offset: int, n: int) -> bytes:
        """Bytes ``offset``..``offset + n`` of the stream (read on when needed; short at its end)."""
        start = self.pos - len(self.tail)
        if offset < start:
            raise SourceFormatError(f"tar offset {offset} is behind the stream")
        while self.pos < offset + n:
            if not self.read(offset + n - self.pos):
                break
        start = self.pos - len(self.tail)
        return self.tail[offset - start : offset - start + n]

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def _decompressed(f: IO[bytes], where: str) -> tuple[Any, str]:
    """The shard's tar stream (decompressed, checksums checked by the decompressor) and its compression."""
    head = f.peek(6)[:6] if hasattr(f, "peek") else b""
    if head[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=f, mode="rb"), "gzip"
    if head[:3] == b"BZh":
        return bz2.BZ2File(f), "bzip2"
    if head[:6] == b"\xfd7zXZ\x00":
        return lzma.LZMAFile(f), "xz"
    return f, ""


_STREAM_ERRORS = (EOFError, OSError, zlib.error, lzma.LZMAError, tarfile.TarError)


class WebDatasetReader(SampleReader):
    """WebDataset shards (local files or URLs) as samples: one per key, its members by type."""

    kind = "WebDataset shards"
    image_names = IMAGE_TYPES
    label_names = LABEL_TYPES
    image_per_sample = True
    value_word = "member"

    def __init__(self, shards: Sequence[str], location: str, path: Path) -> None:
        super().__init__()
        if not shards:
            raise MigrationError(f"{location}: no tar shards to migrate")
        self.shards = list(shards)
        self.locations = self.shards
        self.location = location
        self.path = path
        self._compression = ""
        self._skipped: dict[str, int] = {}
        self._noted = False
        self.provenance = {
            "webdataset": {"shards": len(self.shards), "names": [Path(s).name for s in self.shards[:16]]}
        }

    def samples(self) -> Iterator[Sample]:
        for shard in self.shards:
            yield from self._shard(shard)
        if not self._noted:
            self._noted = True
            self.codec = f"tar ({self._compression})" if self._compression else "tar"
            for what, n in self._skipped.items():
                self.notes.append(f"left out: {n} tar entr{'y' if n == 1 else 'ies'} ({what})")

    def _shard(self, shard: str) -> Iterator[Sample]:
        name = shard if is_url(shard) else str(shard)
        with open_binary(shard) as raw:
            stream, compression = _decompressed(raw, name)
            self._compression = self._compression or compression
            window = _Window(stream)
            current: Sample | None = None
            kinds: set[str] = set()
            held = 0
            try:
                tar = tarfile.open(fileobj=window, mode="r|")  # type: ignore[call-overload]  # noqa: SIM115
            except tarfile.ReadError as exc:
                raise SourceFormatError(f"{name}: not a tar archive ({exc})") from exc
            except _STREAM_ERRORS as exc:
                raise _stream_error(name, exc) from exc
            try:
                for info in tar:
                    member = info.name
                    if not info.isreg():
                        self._count("not a regular file: a folder, link or device")
                        continue
                    if _META.match(member):
                        self._count("WebDataset metadata (__name__)")
                        continue
                    key, kind = split_member_name(member)
                    if key is None or kind is None:
                        self._count("no extension, so no sample key and type")
                        continue
                    if info.size > MAX_MEMBER_BYTES:
                        raise SourceFormatError(
                            f"{name}: member {member!r} claims {info.size} bytes, more than the {MAX_MEMBER_BYTES} "
                            "a member may have; the shard is damaged or hostile"
                        )
                    f = tar.extractfile(info)
                    assert f is not None
                    data = f.read()
                    if len(data) != info.size:
                        raise TruncatedSourceError(f"{name}: member {member!r} is cut short: the shard is truncated")
                    if current is not None and key == current.key:
                        held += len(data)
                        if held > MAX_MEMBER_BYTES:
                            raise SourceFormatError(
                                f"{name}: sample {key!r} holds more than {MAX_MEMBER_BYTES} bytes in its members; "
                                "the shard is damaged or hostile"
                            )
                    else:
                        held = len(data)
                    tar.members = []  # streaming: keep no list of every member
                    kind = kind.lower()
                    if current is None or key != current.key:
                        if current is not None:
                            yield current
                        current = Sample(f"{name}: sample {key!r}", key, {})
                        kinds = set()
                    if kind in kinds:
                        raise SourceFormatError(
                            f"{name}: sample {key!r} has two members of type {kind!r} (WebDataset refuses such shards)"
                        )
                    kinds.add(kind)
                    member_value(kind, data, kind, current.values)
                end = tar.offset
                block = window.block_at(end, 512)
                if len(block) < 512:
                    raise TruncatedSourceError(
                        f"{name}: ends at byte {window.pos} without the tar end-of-archive blocks: the shard is "
                        "truncated (a member, or the end of the archive, is missing); copy it again"
                    )
                if block.strip(b"\0"):
                    raise SourceFormatError(
                        f"{name}: the tar header at byte {end} is damaged (neither a member nor the end of the "
                        "archive); the shard is corrupt"
                    )
                window.drain()  # a compressed shard's checksum is checked at its end
            except tarfile.ReadError as exc:
                if "unexpected end of data" in str(exc) or "truncated" in str(exc):
                    raise TruncatedSourceError(
                        f"{name}: the tar stream is cut short ({exc}): the shard is truncated"
                    ) from exc
                raise SourceFormatError(f"{name}: not a valid tar shard ({exc})") from exc
            except _STREAM_ERRORS as exc:
                raise _stream_error(name, exc) from exc
            if current is not None:
                yield current

    def _count(self, what: str) -> None:
        if not self._noted:
            self._skipped[what] = self._skipped.get(what, 0) + 1


def _stream_error(name: str, exc: BaseException) -> MigrationError:
    if isinstance(exc, EOFError):
        return TruncatedSourceError(f"{name}: the compressed shard is cut short ({exc}); copy it again")
    if isinstance(exc, MigrationError):
        return exc
    return SourceFormatError(f"{name}: the shard does not read ({type(exc).__name__}: {exc})")
