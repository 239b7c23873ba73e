"""The format specification in code (FORMAT.md): names, limits and the metadata record (layer 1).
:class:`StoreMeta` (sealed by :func:`seal_record`), keys (:class:`StringTable`), attrs, dtype records."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsIndex, overload

import msgpack
import numpy as np
from numpy.lib.format import descr_to_dtype

from carraystore.base.errors import FormatError, FormatVersionError, InvalidInputError, MetadataChecksumError
from carraystore.format.codec import Codec, crc32
from carraystore.format.encoded import FORMAT_VERSION_ENCODED, Encoding, check_sizes

__all__ = [
    "FORMAT_NAME",
    "FORMAT_VERSION",
    "META_KEY",
    "StoreMeta",
    "StringTable",
    "validate_key",
    "DTYPES",
    "COLOR_MODES",
    "LAYOUTS",
    "dtype_to_record",
    "dtype_from_record",
]

#: Name written in the fixed ``meta`` layer so a reader knows the file is a store.
FORMAT_NAME = "carraystore"
#: Current format version. Readers refuse newer versions; older ones are upgraded by migrations.
FORMAT_VERSION = 1
#: The one key under which all metadata lives, both in ``meta`` (fixed) and ``vlmeta`` (variable).
META_KEY = "carraystore"

#: Pixel dtypes an image store (layout "NHWC") may hold.
DTYPES = ("uint8", "uint16", "float32")
#: Colour modes by channel count.
COLOR_MODES = {1: "grayscale", 3: "rgb", 4: "rgba"}
#: "NHWC": images (H, W, C), C in 1/3/4, a pixel dtype; "array": any item shape, any fixed-size dtype.
LAYOUTS = ("NHWC", "array", "encoded")
#: The newest format version this carraystore reads: 2, stores of the "encoded" layout (FORMAT.md 10).
MAX_FORMAT_VERSION = FORMAT_VERSION_ENCODED
#: Fixed-meta key saying the record carries its checksum, and the record's last entry (FORMAT.md 4.3).
META_CRC_KEY = "meta_crc32"
#: Decompressed record limit: this plus METADATA_BYTES_PER_ITEM per item (FORMAT.md "Limits").
METADATA_BASE_BYTES = 64 * 1024 * 1024
METADATA_BYTES_PER_ITEM = 16 * 1024
#: Maps and lists in the metadata nest at most this deep (attrs, provenance).
METADATA_MAX_DEPTH = 64
#: Labels are 0 <= label < LABEL_LIMIT (they fit int32 for Keras and tf.data).
LABEL_LIMIT = 2**31


def dtype_to_record(dt: np.dtype) -> Any:
    """A JSON-able, exact description of a numpy dtype: ``dt.str`` or, if structured, its descr."""
    dt = np.dtype(dt)
    if dt.hasobject:
        raise InvalidInputError(f"dtype {dt} holds Python objects, which a store cannot hold (it never pickles)")
    if dt.subdtype is not None:
        raise InvalidInputError(
            f"dtype {dt} is a sub-array dtype; put its shape {dt.shape} into the item shape instead (FORMAT.md 4.2)"
        )
    if dt.fields is None:
        return dt.str
    return [[_field_name(name), *(_descr_field(rest))] for name, *rest in dt.descr]


def _field_name(name: Any) -> str:
    if not isinstance(name, str):  # numpy writes a titled field's name as (title, name)
        raise InvalidInputError(
            f"structured dtype field {name!r} has a title, which a store does not keep (FORMAT.md 4.2); "
            "rebuild the dtype without titles"
        )
    return name


def _descr_field(rest: list[Any]) -> list[Any]:
    typ = rest[0]
    out = [typ if isinstance(typ, str) else [[_field_name(n), *(_descr_field(r))] for n, *r in typ]]
    if len(rest) > 1:
        out.append(list(rest[1]))
    return out


def dtype_from_record(rec: Any) -> np.dtype:
    """Inverse of ``dtype_to_record``; never evaluates code."""

    def fields(items: Any) -> list[tuple[Any, ...]]:
        out = []
        for item in items:
            if not isinstance(item, list) or len(item) not in (2, 3) or not isinstance(item[0], str):
                raise FormatError(f"malformed structured dtype field {item!r}")
            typ = item[1] if isinstance(item[1], str) else fields(item[1])
            out.append((item[0], typ, tuple(item[2])) if len(item) == 3 else (item[0], typ))
        return out

    try:
        # descr_to_dtype (as .npy does) restores padding ('' fields are gaps): offsets/itemsize round-trip
        dt = np.dtype(rec) if isinstance(rec, str) else descr_to_dtype(fields(rec))
    except FormatError:
        raise
    except Exception as exc:  # numpy parses some dtype strings with ast: SyntaxError, RecursionError, ...
        raise FormatError(f"unknown dtype {rec!r} in the metadata ({exc})") from exc
    if dt.hasobject:
        raise FormatError(f"dtype {rec!r} holds Python objects; stores never do")
    return dt


def metadata_limit(nimages: int) -> int:
    """The most bytes a store of ``nimages`` items may hold in its decompressed metadata record."""
    return METADATA_BASE_BYTES + max(0, int(nimages)) * METADATA_BYTES_PER_ITEM


# -- keys ------------------------------------------------------------------------------
def validate_key(key: str) -> str:
    """Check that ``key`` is a relative, portable path or id; return it with '/' separators.
    A backslash is a name character on POSIX and a separator on Windows (where it becomes '/');
    either way a key may not be absolute nor climb with '..'."""
    k, problem = _key_problem(key)
    if problem is None:
        return k
    if problem.startswith("is not valid UTF-8"):
        raise InvalidInputError(f"key {ascii(key)} {problem}")
    raise InvalidInputError(f"key {key!r} {problem}")


def key_problem(key: str) -> str | None:
    """Why ``key`` cannot be a key (the phrase after the key in ``validate_key``'s error), or None."""
    return _key_problem(key)[1]


def _key_problem(key: Any) -> tuple[str, str | None]:
    if not isinstance(key, str) or not key:
        return "", "is not a non-empty string: keys must be non-empty strings"
    k = key.replace("\\", "/") if os.sep == "\\" else key
    if "\x00" in k or "\n" in k:
        return k, "holds a NUL or newline character, which keys may not contain"
    try:
        k.encode("utf-8")
    except UnicodeEncodeError:
        return k, "is not valid UTF-8 (an undecodable file name?)"
    if k.startswith(("/", "\\")):
        return k, (
            "is an absolute path; stores hold relative paths or ids only so that they can be "
            "moved and shared (make it relative to the dataset's root folder)"
        )
    if len(k) > 1 and k[1] == ":" and k[0].isascii():  # a drive letter is one byte, as the reader's check reads it
        return k, (
            f"starts with the drive letter {k[:2]!r}, an absolute path on Windows; stores hold relative paths "
            "that mean the same on every system (rename the folder or file)"
        )
    if k.startswith("~"):
        return k, (
            "starts with '~', a home folder to shells and to export; stores hold relative paths that mean the "
            "same everywhere (rename the folder or file)"
        )
    if any(part == ".." for part in k.replace("\\", "/").split("/")):
        return k, (
            "climbs out of its folder with '..' (a backslash separates folders on Windows); "
            "give a path relative to the root"
        )
    if any(part in ("", ".") for part in k.split("/")):
        return k, (
            "has an empty or '.' path component ('x/', 'a//b', 'a/./b', '.'), which names the same file as "
            "another key would (or a folder); give the normalised relative path ('a/b')"
        )
    return k, None


def _check_key_bytes(blob: bytes, offsets: np.ndarray, what: str) -> None:
    """The rules of ``validate_key`` for a whole key table at once (FORMAT.md 4.5); FormatError names the key."""
    if not isinstance(blob, bytes):
        raise FormatError(f"metadata {what!r}: 'utf8' must be bytes")
    n = len(offsets) - 1
    if n <= 0:
        return
    starts = offsets[:-1].astype(np.int64)
    ends = offsets[1:].astype(np.int64)

    def bad(i: int, why: str) -> FormatError:
        key = blob[int(starts[i]) : int(ends[i])].decode("utf-8", "backslashreplace")
        return FormatError(
            f"metadata {what!r}: key {i} ({key!r}) {why}; the file is damaged or was not written by carraystore"
        )

    def first(mask: np.ndarray) -> int:
        return int(np.argmax(mask))

    if np.any(ends == starts):
        raise bad(first(ends == starts), "is empty")
    b = np.frombuffer(blob, dtype=np.uint8)
    if b.size and int(b.max()) >= 0x80:  # pure ASCII needs no decoding
        try:
            blob.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise bad(int(np.searchsorted(ends, exc.start, side="right")), "is not valid UTF-8") from None
    cont = (b[starts] & 0xC0) == 0x80  # a key may not begin inside another's character
    if np.any(cont):
        raise bad(first(cont), "is not valid UTF-8")
    for ch, why in ((b"\x00", "holds a NUL character"), (b"\n", "holds a newline")):
        hit = blob.find(ch)  # memchr: far faster than a numpy comparison over the whole blob
        if hit >= 0:
            raise bad(int(np.searchsorted(ends, hit, side="right")), why)
    # a backslash counts as a separator here, as in validate_key (it is one on Windows)
    absolute = (b[starts] == ord("/")) | (b[starts] == ord("\\")) | (b[starts] == ord("~"))
    two = ends - starts > 1
    absolute[two] |= b[starts[two] + 1] == ord(":")
    if np.any(absolute):
        raise bad(first(absolute), "is an absolute path")
    dots = b == ord(".")
    for pos in np.flatnonzero(dots[:-1] & dots[1:]).tolist():  # every "..", then whether it is a component
        i = int(np.searchsorted(ends, pos, side="right"))
        lo, hi = int(starts[i]), int(ends[i])
        if pos + 1 >= hi:  # the second dot begins the next key: no ".." in one key here
            continue
        if (pos == lo or blob[pos - 1] in b"/\\") and (pos + 2 == hi or blob[pos + 2] in b"/\\"):
            raise bad(i, "has a '..' component")
    # empty components ('x/', 'a//b') and '.' components ('.', './a', 'a/./b'); '/' only separates here
    slash = b == ord("/")
    first_byte = np.zeros(len(b), dtype=bool)
    first_byte[starts] = True
    last_byte = np.zeros(len(b), dtype=bool)
    last_byte[ends - 1] = True
    after_slash = np.zeros(len(b), dtype=bool)
    after_slash[1:] = slash[:-1]
    before_slash = np.zeros(len(b), dtype=bool)
    before_slash[:-1] = slash[1:]
    empty = slash & (last_byte | (before_slash & ~last_byte))
    if np.any(empty):
        raise bad(int(np.searchsorted(ends, first(empty), side="right")), "has an empty path component")
    lone_dot = dots & (first_byte | after_slash) & (last_byte | before_slash)
    if np.any(lone_dot):
        raise bad(int(np.searchsorted(ends, first(lone_dot), side="right")), "has a '.' path component")


class StringTable(Sequence[str]):
    """A compact read-only list of strings: UTF-8 bytes plus offsets, decoded on access."""

    def __init__(self, blob: bytes, offsets: np.ndarray) -> None:
        self._blob = blob
        self._offsets = offsets

    @classmethod
    def from_strings(cls, strings: Iterable[str]) -> StringTable:
        encoded = [s.encode("utf-8") for s in strings]
        offsets = np.zeros(len(encoded) + 1, dtype="<u8")
        if encoded:
            np.cumsum([len(e) for e in encoded], out=offsets[1:])
        return cls(b"".join(encoded), offsets)

    def __len__(self) -> int:
        return len(self._offsets) - 1

    @overload
    def __getitem__(self, i: SupportsIndex) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: SupportsIndex | slice) -> str | list[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self)
        k = int(i)
        if k < 0:
            k += n
        if not 0 <= k < n:
            raise IndexError(f"key index {k} out of range for {n} keys")
        return self._blob[int(self._offsets[k]) : int(self._offsets[k + 1])].decode("utf-8")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StringTable):
            return self._blob == other._blob and np.array_equal(self._offsets, other._offsets)
        if isinstance(other, Sequence):
            return list(self) == list(other)
        return NotImplemented

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        return f"StringTable([{head}{', ...' if len(self) > 3 else ''}], n={len(self)})"

    def to_record(self) -> dict[str, bytes]:
        return {"utf8": self._blob, "offsets": self._offsets.astype("<u8").tobytes()}

    @classmethod
    def from_record(cls, rec: Any, n: int, what: str) -> StringTable:
        if not isinstance(rec, dict) or set(rec) != {"utf8", "offsets"}:
            raise FormatError(f"metadata {what!r} must be a mapping with 'utf8' and 'offsets'")
        offsets = np.frombuffer(rec["offsets"], dtype="<u8")
        if (
            len(offsets) != n + 1
            or int(offsets[0]) != 0
            or int(offsets[-1]) != len(rec["utf8"])
            or np.any(offsets[1:] < offsets[:-1])  # no int64 copies: this runs on every open
        ):
            raise FormatError(f"metadata {what!r} has inconsistent offsets for {n} entries")
        return cls(rec["utf8"], offsets)

    def concat(self, other: StringTable) -> StringTable:
        return StringTable.join([self, other])

    @staticmethod
    def join(tables: Sequence[StringTable]) -> StringTable:
        """One table of every string of ``tables`` in order (one pass, whatever their number)."""
        if not tables:
            return StringTable(b"", np.zeros(1, dtype="<u8"))
        sizes = np.array([len(t._blob) for t in tables], dtype="<u8")
        starts = np.concatenate([np.zeros(1, dtype="<u8"), np.cumsum(sizes, dtype="<u8")])
        offs = np.concatenate([tables[0]._offsets[:1], *(t._offsets[1:] + starts[i] for i, t in enumerate(tables))])
        return StringTable(b"".join(t._blob for t in tables), offs.astype("<u8"))


# -- metadata --------------------------------------------------------------------------
#: The sealed record's last bytes before its 4-byte CRC (FORMAT.md 4.3).
_SEAL = b"\xaa" + META_CRC_KEY.encode() + b"\xce"


def seal_record(rec: Mapping[str, Any]) -> bytes:
    """Pack a metadata record as msgpack, its checksum the last entry (FORMAT.md 4.3): ``"meta_crc32"``,
    a msgpack uint32 (``0xce`` + 4 bytes big-endian), the CRC-32 of every byte before it."""
    body = {k: v for k, v in rec.items() if k != META_CRC_KEY}
    body[META_CRC_KEY] = 0xFFFFFFFF  # always packed as 0xce + 4 bytes
    raw = bytearray(msgpack.packb(body, use_bin_type=True))
    if not raw.endswith(_SEAL + b"\xff\xff\xff\xff"):  # pragma: no cover - msgpack keeps dict order
        raise RuntimeError("msgpack did not pack the metadata checksum last")
    raw[-4:] = crc32(bytes(raw[:-4])).to_bytes(4, "big")
    return bytes(raw)


def check_record_seal(raw: bytes, where: str) -> bool:
    """Whether ``raw`` is a sealed record (raise MetadataChecksumError if its checksum fails)."""
    if len(raw) < len(_SEAL) + 5:
        return False
    tail = raw[-4 - len(_SEAL) : -4]
    if tail != _SEAL:
        # a seal with a byte or two changed is damage, not an unsealed record with an unknown key
        if sum(a != b for a, b in zip(tail, _SEAL, strict=True)) <= 2:
            raise MetadataChecksumError(
                f"{where}: the metadata record's checksum entry is damaged (its key reads {tail[1:-1]!r}); "
                "keys, labels or other metadata may be damaged too: restore the file from a copy"
            )
        return False
    want = int.from_bytes(raw[-4:], "big")
    got = crc32(memoryview(raw)[:-4])  # no copy of a record that may be tens of MB
    if got != want:
        raise MetadataChecksumError(
            f"{where}: the metadata record fails its checksum (recorded {want:08x}, computed {got:08x}); "
            "keys, labels or other metadata were changed or damaged: restore the file from a copy"
        )
    return True


def _check_plain(rec: Any, where: str) -> None:
    """Refuse msgpack timestamps (an extension type) and nesting deeper than METADATA_MAX_DEPTH."""
    stack = [(rec, 1)]
    while stack:
        obj, depth = stack.pop()
        if isinstance(obj, msgpack.Timestamp):
            raise FormatError(
                f"{where}: metadata holds a msgpack timestamp (extension type -1); carraystore metadata never does"
            )
        if isinstance(obj, (dict, list)):
            if depth > METADATA_MAX_DEPTH:
                raise FormatError(
                    f"{where}: metadata nests deeper than {METADATA_MAX_DEPTH} levels; the file is damaged or hostile"
                )
            stack.extend((v, depth + 1) for v in (obj.values() if isinstance(obj, dict) else obj))


def json_attrs(attrs: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """``attrs`` as a store keeps them: JSON values (tuples become lists, keys strings). InvalidInputError
    names an attr JSON or msgpack cannot hold (objects, ints outside -2**63 .. 2**64-1); NaN stays a float."""
    attrs = dict(attrs or {})
    _check_plain(attrs, where)  # nesting first: json.dumps recurses
    plain: dict[str, Any] = {}
    for key, value in attrs.items():
        try:
            (name,) = json.loads(json.dumps({key: None}))  # JSON's key: 1 -> "1" (msgpack readers refuse int keys)
            plain[name] = json.loads(json.dumps(value))
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"{where}: attrs[{key!r}] is not a JSON value ({exc})") from exc
    stack: list[tuple[str, Any]] = list(plain.items())
    while stack:
        name, obj = stack.pop()
        if isinstance(obj, dict):
            stack.extend((name, v) for v in obj.values())
        elif isinstance(obj, list):
            stack.extend((name, v) for v in obj)
        elif isinstance(obj, int) and not isinstance(obj, bool) and not -(2**63) <= obj < 2**64:
            raise InvalidInputError(
                f"{where}: attrs[{name!r}] holds the integer {obj}, outside msgpack's -2**63 .. 2**64-1; store it as text"
            )
    return plain


@dataclass(frozen=True)
class StoreMeta:
    """Everything a store records about itself, stored under ``vlmeta['carraystore']``."""

    image_shape: tuple[int, ...]
    dtype: Any  # a dtype record: ``dtype_to_record(np.dtype)``
    codec: Codec
    chunk_images: int
    nimages: int = 0
    format_version: int = FORMAT_VERSION
    writer_version: str = ""
    blosc2_version: str = ""
    layout: str = "NHWC"
    color_mode: str = ""
    class_names: tuple[str, ...] | None = None
    labels: np.ndarray | None = None
    keys: StringTable | None = None
    crc32: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype="<u4"))
    provenance: dict[str, Any] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    skipped: tuple[dict[str, str], ...] = ()
    columns: dict[str, np.ndarray] = field(default_factory=dict)
    #: groups (video, session, patient): ``groups[i]`` indexes ``group_names`` (FORMAT.md 4.6)
    group_names: tuple[str, ...] | None = None
    groups: np.ndarray | None = None
    #: layout "encoded" only (FORMAT.md 10): how images are encoded, and each entry's length in bytes
    encoding: Encoding | None = None
    entry_sizes: np.ndarray | None = None

    @property
    def np_dtype(self) -> np.dtype:
        return dtype_from_record(self.dtype) if not isinstance(self.dtype, np.dtype) else self.dtype

    @property
    def image_nbytes(self) -> int:
        return int(math.prod(self.image_shape)) * self.np_dtype.itemsize

    @property
    def blocksize(self) -> int:
        block_images = self.codec.block_images
        if block_images is None:  # validate() refuses such a record
            raise FormatError("the codec's block_images is not pinned")
        return self.image_nbytes * block_images

    @property
    def nchunks(self) -> int:
        return -(-self.nimages // self.chunk_images)

    def to_record(self) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "writer_version": self.writer_version,
            "blosc2_version": self.blosc2_version,
            "layout": self.layout,
            "image_shape": list(self.image_shape),
            "dtype": self.dtype,
            "color_mode": self.color_mode,
            "nimages": self.nimages,
            "chunk_images": self.chunk_images,
            "codec": self.codec.to_config(),
            "blocksize": self.blocksize,
            "chunks": [self.chunk_images, *self.image_shape],
            "blocks": [self.codec.block_images, *self.image_shape],
            "class_names": list(self.class_names) if self.class_names is not None else None,
            "labels": self.labels.astype("<i8").tobytes() if self.labels is not None else None,
            "keys": self.keys.to_record() if self.keys is not None else None,
            "crc32": np.asarray(self.crc32, dtype="<u4").tobytes(),
            "provenance": self.provenance,
            "attrs": self.attrs,
            "skipped": [dict(s) for s in self.skipped],
            "columns": {
                name: {
                    "dtype": dtype_to_record(col.dtype),
                    "shape": list(col.shape[1:]),
                    "data": np.ascontiguousarray(col).tobytes(),
                }
                for name, col in self.columns.items()
            },
        }
        if self.group_names is not None:  # written only when present: records without groups stay as they were
            rec["group_names"] = list(self.group_names)
            rec["groups"] = np.asarray(self.groups, dtype="<i4").tobytes()
        if self.layout == "encoded":
            rec["encoding"] = self.encoding.to_record() if self.encoding is not None else None
            sizes = self.entry_sizes if self.entry_sizes is not None else np.zeros(0, dtype="<u4")
            rec["entry_sizes"] = np.asarray(sizes, dtype="<u4").tobytes()
        return rec

    def to_bytes(self) -> bytes:
        """The record as sealed msgpack bytes: what a writer stores in vlmeta (FORMAT.md 4.3)."""
        return seal_record(self.to_record())

    @classmethod
    def from_bytes(cls, raw: bytes, where: str = "store") -> StoreMeta:
        """Decode and validate metadata. Plain msgpack only: nothing is unpickled or executed."""
        return cls.from_record(cls.unpack_record(raw, where), where)

    @staticmethod
    def unpack_record(raw: bytes, where: str = "store", require_crc: bool = False) -> Any:
        """The plain msgpack record in ``raw`` (extension types refused), not yet validated. A checksum
        entry (FORMAT.md 4.3) must match and is removed; ``require_crc`` makes its absence an error."""
        sealed = check_record_seal(raw, where)
        if require_crc and not sealed:
            raise MetadataChecksumError(
                f"{where}: the metadata record has lost its checksum (the file says it carries one); "
                "the file is damaged: restore it from a copy"
            )

        def refuse_ext(code: int, data: bytes) -> Any:
            raise FormatError(
                f"{where}: metadata holds a msgpack extension type {code}; carraystore metadata never does"
            )

        try:
            rec = msgpack.unpackb(raw, raw=False, ext_hook=refuse_ext, strict_map_key=True, timestamp=0)
        except FormatError:
            raise
        except Exception as exc:
            raise FormatError(f"{where}: metadata is not valid msgpack ({exc}); the file may be damaged") from exc
        _check_plain(rec, where)
        if sealed and isinstance(rec, dict):
            rec.pop(META_CRC_KEY, None)
        return rec

    @classmethod
    def from_record(cls, rec: Any, where: str = "store") -> StoreMeta:
        if not isinstance(rec, dict) or rec.get("format") != FORMAT_NAME:
            raise FormatError(f"{where}: metadata is not a carraystore record")
        version = rec.get("format_version")
        if not isinstance(version, int) or isinstance(version, bool):
            raise FormatError(f"{where}: metadata has no integer format_version")

        def optional(key: str, default: str) -> str:  # FORMAT.md 4.1: an optional key may be absent or nil
            value = rec.get(key)
            return default if value is None else str(value)

        layout = optional("layout", "NHWC")
        encoded = layout == "encoded"
        if version > MAX_FORMAT_VERSION:
            raise FormatVersionError(
                f"{where}: store format version {version} is newer than this carraystore reads "
                f"(format versions {FORMAT_VERSION} and {MAX_FORMAT_VERSION}); upgrade carraystore"
            )
        if version == FORMAT_VERSION_ENCODED and not encoded:  # FORMAT.md 3 and 10: version 2 is layout encoded
            raise FormatError(
                f"{where}: the store says format version {FORMAT_VERSION_ENCODED} with layout {layout!r}; format "
                f"version {FORMAT_VERSION_ENCODED} is the layout 'encoded' only, a store of layout {layout!r} is "
                f"format version {FORMAT_VERSION} (FORMAT.md 10): the file is damaged or was written by another tool"
            )
        if encoded and version != FORMAT_VERSION_ENCODED:
            raise FormatError(
                f"{where}: a store of layout 'encoded' is format version {FORMAT_VERSION_ENCODED}, "
                f"this one says {version}; the file is damaged"
            )
        if version < FORMAT_VERSION:
            raise FormatVersionError(
                f"{where}: store format version {version} is older than the current {FORMAT_VERSION}; "
                f"upgrade it with `carraystore migrate {where} NEW.b2nd`"
            )
        try:
            image_shape = tuple(int(x) for x in rec["image_shape"])
            dtype = rec["dtype"]
            if not isinstance(dtype, (str, list)):
                raise FormatError(f"{where}: dtype {dtype!r} is neither a string nor a field list")
            dtype_from_record(dtype)
            nimages = int(rec["nimages"])
            chunk_images = int(rec["chunk_images"])
            codec = Codec.from_config(rec["codec"])
            labels = np.frombuffer(rec["labels"], dtype="<i8") if rec.get("labels") is not None else None
            keys = StringTable.from_record(rec["keys"], nimages, "keys") if rec.get("keys") is not None else None
            if keys is not None:
                _check_key_bytes(keys._blob, keys._offsets, "keys")
            crc = np.frombuffer(rec["crc32"], dtype="<u4")
            class_names = tuple(rec["class_names"]) if rec.get("class_names") is not None else None
            if class_names is not None and labels is None and nimages == 0:
                labels = np.zeros(0, dtype="<i8")  # FORMAT.md 4.4: class names make an empty store labelled
            meta = cls(
                image_shape=image_shape,
                dtype=dtype,
                codec=codec,
                chunk_images=chunk_images,
                nimages=nimages,
                format_version=version,
                writer_version=optional("writer_version", ""),
                blosc2_version=optional("blosc2_version", ""),
                layout=layout,
                color_mode=optional("color_mode", ""),
                class_names=class_names,
                labels=labels,
                keys=keys,
                crc32=crc,
                provenance=dict(rec.get("provenance") or {}),
                attrs=dict(rec.get("attrs") or {}),
                skipped=tuple(dict(s) for s in rec.get("skipped") or ()),
                columns=_columns_from_record(rec.get("columns") or {}, nimages, where),
                **_groups_from_record(rec, where),
                encoding=Encoding.from_record(rec.get("encoding"), where) if encoded else None,
                entry_sizes=np.frombuffer(rec["entry_sizes"], dtype="<u4") if encoded else None,
            )
        except FormatError as exc:  # from a part (codec, keys, dtype): name the file too
            if str(exc).startswith(f"{where}:"):
                raise
            raise type(exc)(f"{where}: {exc}") from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{where}: metadata field missing or malformed: {exc!r}") from exc
        meta.validate(where)
        if rec.get("blocksize") != meta.blocksize:
            raise FormatError(
                f"{where}: recorded blocksize {rec.get('blocksize')} != {meta.blocksize} derived from the layout"
            )
        return meta

    def validate(self, where: str = "store") -> None:
        """Check internal consistency; raise FormatError naming the field."""
        dt = self.np_dtype
        if self.layout not in LAYOUTS:
            raise FormatError(f"{where}: layout {self.layout!r} is not one of {LAYOUTS}")
        if self.layout == "encoded":
            self._validate_encoded(where)
        if self.layout in ("NHWC", "encoded"):
            if dt.name not in DTYPES:
                raise FormatError(f"{where}: dtype {self.dtype!r} is not one of {DTYPES} (image layout)")
            if len(self.image_shape) != 3 or self.image_shape[2] not in COLOR_MODES or min(self.image_shape) < 1:
                raise FormatError(f"{where}: image_shape {self.image_shape} must be (H, W, C) with C in 1, 3, 4")
            if self.color_mode != COLOR_MODES[self.image_shape[2]]:
                raise FormatError(
                    f"{where}: color_mode {self.color_mode!r} does not match C = {self.image_shape[2]} "
                    f"(FORMAT.md 4.1: {COLOR_MODES[self.image_shape[2]]!r})"
                )
        elif self.color_mode:
            raise FormatError(f"{where}: color_mode {self.color_mode!r} in a store of layout 'array' (must be empty)")
        elif self.image_shape and min(self.image_shape) < 1:
            raise FormatError(f"{where}: item shape {self.image_shape} has an empty dimension")
        if dt.itemsize == 0:
            raise FormatError(f"{where}: dtype {self.dtype!r} has no size")
        if self.chunk_images < 1 or self.nimages < 0:
            raise FormatError(f"{where}: chunk_images {self.chunk_images} / nimages {self.nimages} out of range")
        if self.codec.typesize is None or self.codec.block_images is None:
            raise FormatError(f"{where}: codec typesize/block_images are not pinned")
        if self.chunk_images % self.codec.block_images:
            raise FormatError(
                f"{where}: chunk_images {self.chunk_images} is not a multiple of block_images {self.codec.block_images}"
            )
        if self.blocksize % self.codec.typesize:
            raise FormatError(
                f"{where}: blocksize {self.blocksize} is not a multiple of typesize {self.codec.typesize}"
            )
        if len(self.crc32) != self.nchunks:
            raise FormatError(f"{where}: {len(self.crc32)} checksums recorded for {self.nchunks} chunks")
        if self.class_names is not None and self.labels is None and self.nimages:
            raise FormatError(
                f"{where}: the store has class names but no labels for its {self.nimages} items; class names name "
                "label values, so a store with class names is labelled (FORMAT.md 4.4): the file is damaged or "
                "was written by another tool"
            )
        if self.labels is not None and len(self.labels) != self.nimages:
            raise FormatError(f"{where}: {len(self.labels)} labels for {self.nimages} images")
        if self.keys is not None and len(self.keys) != self.nimages:
            raise FormatError(f"{where}: {len(self.keys)} keys for {self.nimages} images")
        if self.class_names is not None:
            if not all(isinstance(c, str) for c in self.class_names):
                raise FormatError(f"{where}: class_names must be strings, got {list(self.class_names)[:5]!r}")
            if len(set(self.class_names)) != len(self.class_names):
                raise FormatError(
                    f"{where}: class_names repeat a name ({list(self.class_names)[:10]!r}); each class needs its own"
                )
        if self.labels is not None and len(self.labels):
            lo, hi = int(self.labels.min()), int(self.labels.max())
            limit = len(self.class_names) if self.class_names is not None else LABEL_LIMIT
            if lo < 0 or hi >= limit:
                names = (
                    f"there are {limit} class names"
                    if self.class_names is not None
                    else f"labels must lie in 0..{LABEL_LIMIT - 1}"
                )
                raise FormatError(f"{where}: labels span {lo}..{hi} but {names} (FORMAT.md 4.4)")
        self._validate_groups(where)
        for name, col in self.columns.items():
            if len(col) != self.nimages:
                raise FormatError(f"{where}: column {name!r} has {len(col)} rows for {self.nimages} items")
        _check_plain(self.attrs, where)  # before json.dumps, which recurses
        _check_plain(self.provenance, where)
        try:
            json.dumps(self.attrs)  # attrs must stay JSON
            json.dumps(self.provenance)
        except (TypeError, ValueError) as exc:
            raise FormatError(f"{where}: attrs and provenance must be JSON-serialisable ({exc})") from exc

    def _validate_groups(self, where: str) -> None:
        """``group_names`` and ``groups`` come together; names distinct, indices in range (FORMAT.md 4.6)."""
        names, groups = self.group_names, self.groups
        if (names is None) != (groups is None):
            raise FormatError(f"{where}: 'group_names' and 'groups' go together; the record has only one of them")
        if names is None or groups is None:
            return
        if not all(isinstance(g, str) and g for g in names):
            raise FormatError(f"{where}: group_names must be non-empty strings, got {list(names)[:5]!r}")
        if len(set(names)) != len(names):
            raise FormatError(f"{where}: group_names repeat a name ({list(names)[:10]!r}); each group needs its own")
        if len(groups) != self.nimages:
            raise FormatError(f"{where}: {len(groups)} group indices for {self.nimages} items")
        if len(groups) and (int(groups.min()) < 0 or int(groups.max()) >= len(names)):
            raise FormatError(
                f"{where}: group indices span {int(groups.min())}..{int(groups.max())} but there are "
                f"{len(names)} group names (FORMAT.md 4.6)"
            )

    def _validate_encoded(self, where: str) -> None:
        """The encoded layout's own rules (FORMAT.md 10.1)."""
        if self.format_version != FORMAT_VERSION_ENCODED:
            raise FormatError(f"{where}: layout 'encoded' needs format version {FORMAT_VERSION_ENCODED}")
        if self.np_dtype != np.uint8:
            raise FormatError(f"{where}: a store of layout 'encoded' decodes to uint8, not {self.dtype!r}")
        if self.encoding is None or self.entry_sizes is None:
            raise FormatError(f"{where}: layout 'encoded' needs 'encoding' and 'entry_sizes' in the metadata")
        if len(self.entry_sizes) != self.nimages:
            raise FormatError(f"{where}: {len(self.entry_sizes)} entry sizes for {self.nimages} images")
        check_sizes(self.entry_sizes, self.image_nbytes, where)


def _groups_from_record(rec: dict[str, Any], where: str) -> dict[str, Any]:
    """``group_names`` and ``groups`` of a record (both absent in stores without groups, and in 0.1.0's)."""
    names, groups = rec.get("group_names"), rec.get("groups")
    if names is None and groups is None:
        return {}
    if names is None or groups is None:
        raise FormatError(f"{where}: 'group_names' and 'groups' go together; the record has only one of them")
    if not isinstance(names, list) or not isinstance(groups, bytes) or len(groups) % 4:
        raise FormatError(
            f"{where}: 'group_names' must be an array of str and 'groups' int32 bytes, both present (FORMAT.md 4.6)"
        )
    return {"group_names": tuple(names), "groups": np.frombuffer(groups, dtype="<i4")}


def _columns_from_record(rec: Any, n: int, where: str) -> dict[str, np.ndarray]:
    if not isinstance(rec, dict):
        raise FormatError(f"{where}: metadata 'columns' must be a mapping")
    out = {}
    for name, c in rec.items():
        if not isinstance(name, str) or not name:
            raise FormatError(f"{where}: field name {name!r} in 'columns' is not a non-empty string (FORMAT.md 4.4a)")
        try:
            dt = dtype_from_record(c["dtype"])
            shape = (n, *(int(x) for x in c["shape"]))
            out[name] = np.frombuffer(c["data"], dtype=dt).reshape(shape)
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"{where}: column {name!r} is malformed ({exc})") from exc
    return out


def as_records(a: np.ndarray) -> np.ndarray:
    """``a`` viewed as raw records, so that assignment copies every byte (padding included)."""
    return a.view(np.dtype((np.void, a.dtype.itemsize))) if a.dtype.fields is not None else a
