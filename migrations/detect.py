"""Which of the sample formats (WebDataset shards, TFRecord files, Parquet/Arrow tables) a source is, and its splits.

``open_sample_source`` is called by :func:`carraystore.migrations.core.open_migration_source` before
the legacy formats; it returns None for anything that is none of these three.
"""

from __future__ import annotations

import gzip
import os
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from carraystore.base.errors import InvalidInputError, MigrationError

from .bcolz import is_carray, is_ctable
from .parquet import ARROW_FILE_MAGIC, PARQUET_MAGIC, TableReader, TableSet, find_tables
from .samples import SampleReader, SampleSource, brace_expand, is_url
from .tfrecord import TFRecordReader, looks_like_tfrecord, tfds_splits, tfrecord_files
from .webdataset import WebDatasetReader, is_tar

__all__ = ["sample_locations", "open_sample_source", "sample_splits", "SampleKwargs"]

#: The keywords of :func:`open_sample_source` that only the sample formats take.
SampleKwargs = ("keys", "groups", "color_mode", "image_size")
_TAR_NAMES = (".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tar.xz")


def sample_locations(src: Any) -> list[str] | None:
    """The files ``src`` names when it is a list of them, a brace pattern (``shard-{000..009}.tar``) or a URL;
    None for a single local path (detected by :func:`open_sample_source` from its bytes)."""
    if isinstance(src, (list, tuple)):
        out: list[str] = []
        for s in src:
            out += sample_locations(s) or [os.fspath(s)]
        if not out:
            raise InvalidInputError("an empty list of sources")
        return out
    if src is None:
        return None
    text = os.fspath(src)
    if is_url(text):
        return brace_expand(text) if "{" in text else [text]
    if "{" in text and not Path(text).exists():
        return brace_expand(text)
    return None


def _head(p: Path, n: int = 1024) -> bytes:
    with open(p, "rb") as f:
        return f.read(n)


def _gunzip_head(p: Path, n: int = 1024) -> bytes:
    try:
        with gzip.open(p, "rb") as f:
            return f.read(n)
    except (OSError, EOFError, zlib.error):
        return b""


def _kind_of_file(p: Path) -> str | None:
    """ "webdataset", "tfrecord", "table" or None, from the file's first bytes."""
    head = _head(p)
    if head[:4] == PARQUET_MAGIC or head[:6] == ARROW_FILE_MAGIC:
        return "table"
    if head[:4] == b"\xff\xff\xff\xff" and p.suffix == ".arrow":
        return "table"
    if is_tar(head):
        return "webdataset"
    if head[:2] == b"\x1f\x8b":
        inner = _gunzip_head(p)
        if is_tar(inner):
            return "webdataset"
        if looks_like_tfrecord(inner[:12]):
            return "tfrecord"
        return None
    if head[:3] == b"BZh" or head[:6] == b"\xfd7zXZ\x00":
        return "webdataset" if p.name.lower().endswith(_TAR_NAMES) else None
    if looks_like_tfrecord(head[:12]):
        return "tfrecord"
    if head[:1] == b"\x78" and len(head) > 1 and (head[0] * 256 + head[1]) % 31 == 0 and "tfrec" in p.name.lower():
        return "tfrecord"  # a ZLIB-compressed TFRecord file
    return None


def _kind_of_name(name: str) -> str | None:
    low = name.lower().rsplit("?", 1)[0]
    if low.endswith(_TAR_NAMES):
        return "webdataset"
    if "tfrec" in low:
        return "tfrecord"
    if low.endswith((".parquet", ".arrow")):
        return "table"
    return None


def _reader_of(kind: str, files: Sequence[str], location: str, path: Path, split: str = "") -> SampleReader:
    if kind == "webdataset":
        return WebDatasetReader(files, location, path)
    if kind == "tfrecord":
        reader = TFRecordReader(files, location, path)
        if split:
            reader.notes.append(f"split {split!r}")
        return reader
    if any(is_url(f) for f in files):
        raise InvalidInputError(
            f"{location}: Parquet and Arrow tables are migrated from local files; download them first"
        )
    table_kind = "Parquet" if all(Path(f).suffix != ".arrow" for f in files) else "Arrow"
    return TableReader([Path(f) for f in files], table_kind, location, path, split)


def _pick_split(where: str, splits: dict[str, list[Any]], group: str | None, how: str) -> tuple[str, list[Any]]:
    if group is not None:
        g = group.strip("/")
        if g not in splits:
            raise MigrationError(f"{where}: no split {group!r}; its splits are {sorted(splits)}")
        return g, splits[g]
    if len(splits) > 1:
        raise MigrationError(
            f"{where}: holds the splits {list(splits)} ({how}); migrate them into one store each "
            "(CLI: OUT as a folder; Python: carraystore.migrations.core.migrate_splits(src, folder)), "
            "or one with --group NAME (group=NAME)"
        )
    name, files = next(iter(splits.items()))
    return name, files


def _folder_sources(p: Path) -> tuple[str, dict[str, list[Any]], str] | None:
    """(kind, files by split, how the splits were found) of a folder of shards, records or tables; None if none."""
    if is_carray(p) or is_ctable(p):  # bcolz: not walked
        return None
    tables: TableSet | None = find_tables(p)
    if tables is not None:
        return "table", {k: [str(f) for f in v] for k, v in tables.splits.items()}, tables.how
    tars = sorted(f for f in p.iterdir() if f.is_file() and f.name.lower().endswith(_TAR_NAMES))
    if tars:
        return "webdataset", {"": [str(f) for f in tars]}, ""
    records = tfrecord_files(p)
    if records:
        by = tfds_splits(records)
        if by:
            return "tfrecord", {k: [str(f) for f in v] for k, v in by.items()}, "TensorFlow Datasets file names"
        return "tfrecord", {"": [str(f) for f in records]}, ""
    return None


def sample_splits(src: Any) -> list[str]:
    """The split names of a source with two or more (a datasets folder, Hub Parquet names, TFDS files), else []."""
    if sample_locations(src) is not None or src is None:
        return []
    p = Path(os.fspath(src))
    if not p.is_dir():
        return []
    found = _folder_sources(p)
    if found is None:
        return []
    splits = [s for s in found[1] if s]
    return splits if len(splits) > 1 else []


def open_sample_source(
    src: Any,
    *,
    images: str | None = None,
    labels: str | None = None,
    keys: str | None = None,
    groups: str | None = None,
    no_labels: bool = False,
    color_mode: str | None = None,
    image_size: Sequence[int] | None = None,
    group: str | None = None,
) -> SampleSource | None:
    """The WebDataset, TFRecord or Parquet/Arrow source ``src`` names, scanned; None when it is none of them."""
    locations = sample_locations(src)
    split = ""
    if locations is not None:
        where = str(src) if not isinstance(src, (list, tuple)) else f"{locations[0]} (+{len(locations) - 1} more)"
        kinds = set()
        for loc in locations:
            if is_url(loc):
                kinds.add(_kind_of_name(loc))
            elif not Path(loc).is_file():
                raise MigrationError(f"{loc}: no such file")
            else:
                kinds.add(_kind_of_file(Path(loc)) or _kind_of_name(loc))
        if None in kinds or len(kinds) != 1:
            raise MigrationError(
                f"{where}: not all WebDataset tar shards, TFRecord files or Parquet/Arrow files "
                f"(found {sorted(str(k) for k in kinds)}); give files of one format"
            )
        kind = next(iter(k for k in kinds if k is not None))
        first = locations[0]
        path = Path(first) if not is_url(first) else Path(first.rsplit("/", 1)[-1])
        files: list[Any] = locations
        if group is not None:
            raise InvalidInputError(f"{where}: --group picks a split of a folder; these files are one source")
    else:
        p = Path(os.fspath(src))
        where, path = str(p), p
        if p.is_dir():
            found = _folder_sources(p)
            if found is None:
                return None
            kind, by_split, how = found
            split, files = _pick_split(where, by_split, group, how)
        elif p.is_file():
            k = _kind_of_file(p)
            if k is None:
                return None
            if group is not None:
                raise InvalidInputError(f"{p}: --group names a split of a folder (or an HDF5 group); {p} is one file")
            kind, files = k, [str(p)]
        else:
            return None
    reader = _reader_of(kind, files, where, path, split)
    return SampleSource(
        reader,
        images=images,
        labels=labels,
        keys=keys,
        groups=groups,
        no_labels=no_labels,
        color_mode=color_mode,
        image_size=image_size,
    )
