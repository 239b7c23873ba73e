"""Upgrading stores written in an older carraystore format version.

A registry maps each old version ``v`` to a :class:`FormatMigration` turning its metadata
record into version ``v + 1``'s logical description (shape, dtype, layout, codec, labels,
keys, class names, attrs, columns). Upgrades run up to ``FORMAT_VERSION``; the pixels are
then streamed into a store by the current writer and verified like any migration.

The only step upgrades the synthetic version 0 below, which exercises the mechanism; no
real store was written in it (version 1 is the first released format).

Synthetic format version 0: a blosc2 NDArray ``.b2nd`` of shape (N, H, W, C), with the
fixed meta layer ``carraystore = {"format": "carraystore", "format_version": 0}`` and the
variable-length meta ``carraystore`` = a msgpack map ``{"format": "carraystore",
"format_version": 0, "shape": [H, W, C], "dtype": "uint8", "count": N, "codec": "zstd:1",
"classes": [names] | None, "labels": [int, ...] | None, "paths": [str, ...] | None,
"attrs": {...}}`` (no checksums, no layout, labels as a plain list, the codec as text).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from carraystore.base.errors import CarrayStoreError, FormatError, FormatVersionError, MigrationError
from carraystore.format.codec import Codec
from carraystore.format.frame import Frame, read_frame
from carraystore.format.record import FORMAT_NAME, FORMAT_VERSION, META_KEY, dtype_from_record, dtype_to_record
from carraystore.sources.local import LocalFileSource

from .base import Block, Source

__all__ = [
    "FormatMigration",
    "FORMAT_MIGRATIONS",
    "register_format_migration",
    "upgrade_record",
    "store_format_version",
    "is_old_store",
    "open_old_store",
    "OldStoreSource",
]


@dataclass(frozen=True)
class FormatMigration:
    """One step: a record of ``from_version`` -> a record of ``from_version + 1``."""

    from_version: int
    description: str
    upgrade: Callable[[dict[str, Any]], dict[str, Any]]


#: from_version -> the step that upgrades it to from_version + 1
FORMAT_MIGRATIONS: dict[int, FormatMigration] = {}


def register_format_migration(
    from_version: int, description: str
) -> Callable[[Callable[[dict[str, Any]], dict[str, Any]]], Callable[[dict[str, Any]], dict[str, Any]]]:
    """Decorator: register ``fn(record) -> record`` as the upgrade from ``from_version``."""

    def deco(fn: Callable[[dict[str, Any]], dict[str, Any]]) -> Callable[[dict[str, Any]], dict[str, Any]]:
        if from_version in FORMAT_MIGRATIONS:
            raise ValueError(f"a format migration from version {from_version} is already registered")
        FORMAT_MIGRATIONS[from_version] = FormatMigration(from_version, description, fn)
        return fn

    return deco


def upgrade_record(
    rec: dict[str, Any], registry: dict[int, FormatMigration] | None = None, target: int = FORMAT_VERSION
) -> tuple[dict[str, Any], list[str]]:
    """Upgrade ``rec`` to ``target``: (record, the steps applied); a missing step is a MigrationError."""
    registry = FORMAT_MIGRATIONS if registry is None else registry
    version = rec.get("format_version")
    if not isinstance(version, int):
        raise MigrationError("store metadata has no integer format_version")
    if version > target:
        raise FormatVersionError(
            f"store format version {version} is newer than this carraystore ({target}); upgrade carraystore"
        )
    steps = []
    while version < target:
        step = registry.get(version)
        if step is None:
            raise MigrationError(
                f"no migration from store format version {version} to {version + 1} is known to this carraystore"
            )
        rec = step.upgrade(dict(rec))
        if rec.get("format_version") != version + 1:
            raise MigrationError(
                f"format migration from version {version} produced version {rec.get('format_version')}"
            )
        steps.append(f"v{version} -> v{version + 1}: {step.description}")
        version += 1
    return rec, steps


@register_format_migration(
    0, "field names of format 1, labels as int64, keys from paths, codec as a Codec, layout NHWC"
)
def _v0_to_v1(rec: dict[str, Any]) -> dict[str, Any]:
    try:
        name, _, level = str(rec.get("codec") or "zstd:1").partition(":")
        labels = rec.get("labels")
        return {
            "format": FORMAT_NAME,
            "format_version": 1,
            "image_shape": [int(x) for x in rec["shape"]],
            "dtype": dtype_to_record(np.dtype(rec["dtype"])),
            "nimages": int(rec["count"]),
            "layout": "NHWC",
            "codec": Codec(name, int(level or 1)).to_config(),
            "class_names": list(rec["classes"]) if rec.get("classes") is not None else None,
            "labels": np.asarray(labels, dtype="<i8") if labels is not None else None,
            "keys": list(rec["paths"]) if rec.get("paths") is not None else None,
            "attrs": dict(rec.get("attrs") or {}),
            "provenance": dict(rec.get("provenance") or {}),
            "columns": {},
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise MigrationError(f"format version 0 metadata is malformed ({exc!r})") from exc


# -- reading older stores ---------------------------------------------------------------------


def _open_blosc2(path: Path) -> Any:
    import blosc2

    try:
        return blosc2.open(str(path), mode="r")
    except Exception:
        return None


def _frame(path: Path) -> Frame | None:
    """The parsed frame of ``path``, or None when it is not a blosc2 frame."""
    try:
        source = LocalFileSource(path)
    except OSError:
        return None
    try:
        return read_frame(source)
    except CarrayStoreError:
        return None
    finally:
        source.close()


def store_format_version(path: str | Path) -> int | None:
    """The format version of the carraystore store at ``path``, or None if it is not one."""
    frame = _frame(Path(path))
    raw = frame.metalayers.get(META_KEY) if frame is not None else None
    if raw is None:
        return None
    try:
        fixed = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception:
        return None
    version = fixed.get("format_version") if isinstance(fixed, dict) else None
    return version if isinstance(version, int) else None


def is_old_store(path: str | Path) -> bool:
    """True if ``path`` is a carraystore store of a format version older than this library's."""
    version = store_format_version(path)
    return version is not None and version < FORMAT_VERSION


def _read_record(frame: Frame | None, path: Path) -> dict[str, Any]:
    raw = frame.vlmeta(META_KEY) if frame is not None else None
    try:
        rec = msgpack.unpackb(raw, raw=False, strict_map_key=True) if raw is not None else None
    except Exception as exc:
        raise FormatError(f"{path}: the store's metadata cannot be read ({exc})") from exc
    if not isinstance(rec, dict) or rec.get("format") != FORMAT_NAME:
        raise FormatError(f"{path}: not a carraystore metadata record")
    return rec


class OldStoreSource(Source):
    """A carraystore store of an older format version, upgraded through the registry."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self._array = _open_blosc2(path)
        if self._array is None:
            raise MigrationError(f"{path}: cannot be opened as a blosc2 file")
        old = _read_record(_frame(path), path)
        self.old_version = int(old.get("format_version", -1))
        if self.old_version == FORMAT_VERSION:
            raise MigrationError(
                f"{path}: already at the current store format version {FORMAT_VERSION}; nothing to migrate"
            )
        rec, steps = upgrade_record(old)
        self.kind = f"carraystore store (format version {self.old_version})"
        self.codec = (
            f"{old.get('codec')}" if isinstance(old.get("codec"), str) else Codec.from_config(rec["codec"]).describe()
        )
        self.item_shape = tuple(int(x) for x in rec["image_shape"])
        self.dtype = dtype_from_record(rec["dtype"])
        self.nrows = int(rec["nimages"])
        if tuple(self._array.shape) != (self.nrows, *self.item_shape):
            raise MigrationError(
                f"{path}: the array's shape {tuple(self._array.shape)} does not match its metadata "
                f"({self.nrows}, {self.item_shape}); the file is damaged"
            )
        self.attrs = rec["attrs"]
        self.class_names = tuple(rec["class_names"]) if rec.get("class_names") is not None else None
        self._labels = rec.get("labels")
        self._keys = rec.get("keys")
        self.has_labels = self._labels is not None
        self.default_codec = Codec.from_config(rec["codec"])  # keep the store's codec unless asked
        self.provenance = {"format_version": self.old_version, "upgrades": steps, **rec.get("provenance", {})}
        self.notes += [f"format upgrade {s}" for s in steps]

    def blocks(self) -> Iterator[Block]:
        k = int(self._array.chunks[0]) if self.nrows else 1
        rows = max(k, (self.block_rows // k) * k)
        for a in range(0, self.nrows, rows):
            b = min(a + rows, self.nrows)
            data = np.ascontiguousarray(self._array[a:b])
            lab = np.asarray(self._labels[a:b]) if self._labels is not None else None
            keys = self._keys[a:b] if self._keys is not None else None
            yield Block(data, labels=lab, keys=keys)

    def close(self) -> None:
        self._array = None


def open_old_store(path: Path) -> OldStoreSource:
    """Open a store of an older format version as a migration Source."""
    return OldStoreSource(path)
