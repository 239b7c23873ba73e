"""The migration pipeline: detect the source, stream it into a store, verify, rename into place.

Every source (bcolz carray / ctable / two carrays, ``.npz`` cache, HDF5 dataset, store of an
older format version) is a :class:`Source`: a description (item shape, dtype, rows, attrs)
plus ``blocks()``, a generator of row blocks read from disk a few chunks at a time. The
pipeline writes the blocks into a hidden temporary store beside the output, then reads
the store back chunk by chunk and compares it with a second pass over the source, bit for
bit, and only then renames the store into place. On any failure nothing is left at the
output path, and the source is only ever opened for reading.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.errors import InvalidInputError, MigrationError, StoreExistsError
from carraystore.format import COLOR_MODES, DTYPES, Codec

__all__ = [
    "Block",
    "Source",
    "MigrationReport",
    "MigrationVerifyError",
    "migrate",
    "open_source",
    "labels_from_array",
    "store_layout",
]

#: Rows per block aim at about this many uncompressed bytes (a few chunks at most).
BLOCK_TARGET_BYTES = 8 * 1024 * 1024
_TMP = re.compile(r"^\.(?P<name>.+)\.migrating-(?P<pid>\d+)-[0-9a-f]+\.b2nd$")


class MigrationVerifyError(MigrationError):
    """The written store does not read back equal to the source (nothing was kept)."""


@dataclass
class Block:
    """Consecutive rows of a source: the items, and optional labels, keys and metadata columns."""

    data: np.ndarray
    labels: np.ndarray | None = None
    keys: Sequence[str] | None = None
    columns: dict[str, np.ndarray] | None = None


class Source:
    """Something that can be migrated: a description plus a re-readable stream of blocks."""

    kind: str = "source"
    #: what the user pointed at (for messages and the summary)
    path: Path
    item_shape: tuple[int, ...]
    dtype: np.dtype
    nrows: int
    attrs: dict[str, Any]
    class_names: tuple[str, ...] | None = None
    #: compression of the source as text, e.g. ``lz4-5 shuffle``
    codec: str = ""
    #: whether blocks carry labels
    has_labels: bool = False
    #: the store codec used when the caller picks none (None: the ``balanced`` preset)
    default_codec: Codec | None = None

    def __init__(self) -> None:
        self.warnings: list[str] = []
        self.notes: list[str] = []
        self.provenance: dict[str, Any] = {}

    @property
    def cbytes(self) -> int:
        """Bytes the source takes on disk."""
        return _disk_size(self.path)

    @property
    def row_nbytes(self) -> int:
        return int(math.prod(self.item_shape)) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.nrows * self.row_nbytes

    @property
    def block_rows(self) -> int:
        return max(1, BLOCK_TARGET_BYTES // max(1, self.row_nbytes))

    def blocks(self) -> Iterator[Block]:
        """Row blocks in order, read from disk; may be called again (verification re-reads)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release open files."""


def _disk_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, f))
    return total


def store_layout(item_shape: Sequence[int], dtype: np.dtype) -> str:
    """"NHWC" for (H, W, C) images (C in 1/3/4, an image dtype), else "array" (shape kept exactly)."""
    dt = np.dtype(dtype)
    shape = tuple(item_shape)
    if len(shape) == 3 and shape[2] in COLOR_MODES and dt.name in DTYPES and dt.isnative and min(shape) >= 1:
        return "NHWC"
    return "array"


def labels_from_array(values: np.ndarray, where: str) -> tuple[np.ndarray, tuple[str, ...] | None, str]:
    """Integer class labels from a labels array: (labels, class_names or None, what was done).

    Accepts non-negative integers (any integer dtype, bool, or integral floats), strings
    (class names: sorted, labels index them) and one-hot rows (N, K). Anything else is a
    MigrationError that says how to keep the array instead.
    """
    a = np.asarray(values)
    n = len(a)
    hint = "; leave it out of --labels to keep it as a metadata column instead"
    if a.dtype.kind in "SU" and a.ndim == 1:
        text = a.astype(str) if a.dtype.kind == "U" else np.array([s.decode("utf-8", "replace") for s in a.tolist()], dtype=str)
        names, inv = np.unique(text, return_inverse=True)
        return inv.astype("<i8").reshape(-1), tuple(str(s) for s in names), f"class names {list(names)[:10]}{' ...' if len(names) > 10 else ''} from strings"
    if a.ndim == 2 and a.shape[1] > 1 and a.dtype.kind in "biuf":
        ones = a == 1
        if n and bool(np.all(ones.sum(axis=1) == 1)) and bool(np.all((a == 0) | ones)):
            return np.argmax(a, axis=1).astype("<i8"), None, f"one-hot labels ({a.shape[1]} classes) turned into class indices"
        raise MigrationError(f"{where}: labels of shape {a.shape} are not one-hot rows{hint}")
    if a.ndim == 2 and a.shape[1] == 1:
        a = a[:, 0]
    if a.ndim != 1:
        raise MigrationError(f"{where}: labels must be one per row, got shape {a.shape}{hint}")
    if a.dtype.kind == "b":
        return a.astype("<i8"), None, "boolean labels as 0/1"
    if a.dtype.kind == "f":
        if n and not (np.all(np.isfinite(a)) and np.all(a == np.round(a))):
            raise MigrationError(f"{where}: labels are {a.dtype} with non-integer values{hint}")
        a = a.astype(np.int64)
    elif a.dtype.kind not in "iu":
        raise MigrationError(f"{where}: labels of dtype {a.dtype} are not class labels{hint}")
    if n and a.dtype.kind == "u" and a.dtype.itemsize == 8 and int(a.max()) > np.iinfo(np.int64).max:
        raise MigrationError(f"{where}: labels do not fit int64{hint}")
    if n and int(a.min()) < 0:
        raise MigrationError(f"{where}: labels include negative values ({int(a.min())}){hint}")
    return a.astype("<i8"), None, f"{a.dtype} labels"


# ---------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------


@dataclass
class MigrationReport:
    """What ``migrate`` did: sizes, codecs, time, and anything the user should know."""

    source: str
    output: str
    kind: str
    rows: int
    item_shape: tuple[int, ...]
    dtype: str
    nbytes: int
    bytes_before: int
    bytes_after: int
    codec_before: str
    codec_after: str
    seconds: float
    verified: bool
    labels: bool = False
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def mb_per_s(self) -> float:
        """Uncompressed megabytes (1e6 bytes) migrated per second, verification included."""
        return self.nbytes / 1e6 / self.seconds if self.seconds > 0 else float("inf")

    def summary(self) -> str:
        """A few lines for humans."""
        lines = [
            f"migrated {self.kind} {self.source} -> {self.output}",
            f"  rows:    {self.rows} x {self.item_shape} {self.dtype}" + (" (with labels)" if self.labels else ""),
            f"  bytes:   {_size(self.bytes_before)} before -> {_size(self.bytes_after)} after "
            f"({_size(self.nbytes)} uncompressed)",
            f"  codec:   {self.codec_before or '?'} -> {self.codec_after}",
            f"  time:    {self.seconds:.2f} s ({self.mb_per_s:,.1f} MB/s), "
            + ("verified bit-exact against the source" if self.verified else "NOT verified (--no-verify)"),
        ]
        lines += [f"  note:    {n}" for n in self.notes]
        lines += [f"  warning: {w}" for w in self.warnings]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return f"{n} B"


# ---------------------------------------------------------------------------------------
# detection
# ---------------------------------------------------------------------------------------

_ZIP_MAGIC = b"PK\x03\x04"
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


def _looks_like_path(value: str | os.PathLike[str] | None) -> bool:
    return value is not None and Path(value).exists()


def open_source(
    src: str | os.PathLike[str] | None,
    *,
    images: str | os.PathLike[str] | None = None,
    labels: str | os.PathLike[str] | None = None,
    dataset: str | None = None,
    allow_pickle: bool = False,
) -> Source:
    """Detect what ``src`` is and open it as a Source (see ``migrate`` for the arguments)."""
    from carraystore.migrations import bcolz as bz

    if src is None:
        if images is None:
            raise InvalidInputError("give a source to migrate, or --images X.bc (and --labels Y.bc) for two bcolz arrays")
        if not bz.is_carray(images):
            raise MigrationError(f"{images}: --images without a SRC must be a bcolz carray folder")
        from carraystore.migrations.bcolz_sources import TwoArraySource

        return TwoArraySource(Path(images), Path(labels) if labels is not None else None, allow_pickle=allow_pickle)
    p = Path(src)
    if not p.exists():
        raise MigrationError(f"{p}: no such file or folder")
    if p.is_dir():
        from carraystore.migrations import bcolz_sources as bs

        if dataset is not None:
            raise InvalidInputError(f"{p}: --dataset names an HDF5 dataset; {p} is a folder")
        if bz.is_ctable(p):
            return bs.CtableSource(p, images=_name(images), labels=_name(labels), allow_pickle=allow_pickle)
        if bz.is_carray(p):
            if images is not None:
                raise InvalidInputError(f"{p} is a carray: --images names a column of a ctable (or use --images X.bc without SRC)")
            if labels is not None:
                if not bz.is_carray(labels):
                    raise MigrationError(f"{labels}: --labels for a carray must be a bcolz carray folder of labels")
                return bs.TwoArraySource(p, Path(labels), allow_pickle=allow_pickle)
            return bs.CarraySource(p, allow_pickle=allow_pickle)
        raise MigrationError(
            f"{p}: a folder, but not a bcolz carray (no meta/storage) or ctable (no __rootdirs__); "
            "point at the rootdir you gave bcolz (e.g. train_data.bc)"
        )
    with open(p, "rb") as f:
        head = f.read(8)
    if head[:4] == _ZIP_MAGIC:
        from carraystore.migrations.npz import NpzSource

        if dataset is not None:
            raise InvalidInputError(f"{p}: --dataset is for HDF5 files; for an .npz use --images NAME")
        return NpzSource(p, images=_name(images), labels=_name(labels))
    if head == _HDF5_MAGIC:
        from carraystore.migrations.hdf5 import Hdf5Source

        return Hdf5Source(p, dataset=dataset or _name(images), labels=_name(labels))
    from carraystore.migrations.versions import is_old_store, open_old_store

    if is_old_store(p):
        return open_old_store(p)
    raise MigrationError(
        f"{p}: not a format carraystore can migrate; it reads bcolz carray/ctable folders, .npz files, "
        "HDF5 files and carraystore stores of an older format version"
    )


def _name(value: str | os.PathLike[str] | None) -> str | None:
    return None if value is None else str(value)


# ---------------------------------------------------------------------------------------
# the pipeline
# ---------------------------------------------------------------------------------------


def _remove_stale_tmp(out: Path) -> None:
    with contextlib.suppress(OSError):
        for p in out.parent.iterdir():
            m = _TMP.match(p.name)
            if not m or m.group("name") != out.name:
                continue
            try:
                os.kill(int(m.group("pid")), 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    p.unlink()
            except PermissionError:
                pass


def _resolve_codec(codec: Codec | str | None, preset: str | None) -> Codec | str | None:
    if codec is not None and preset is not None:
        raise InvalidInputError("give either codec= or preset=, not both")
    return preset if preset is not None else codec


def migrate(
    src: str | os.PathLike[str] | None,
    out: str | os.PathLike[str],
    *,
    images: str | os.PathLike[str] | None = None,
    labels: str | os.PathLike[str] | None = None,
    dataset: str | None = None,
    allow_pickle: bool = False,
    verify: bool = True,
    codec: Codec | str | None = None,
    preset: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
    chunk_images: int | None = None,
) -> MigrationReport:
    """Migrate a legacy array or file into a store at ``out`` (a ``.b2nd`` path).

    ``src`` is a bcolz carray or ctable rootdir, an ``.npz`` cache, an HDF5 file or a store
    of an older format version; or None with ``images`` (and ``labels``) naming two bcolz
    carrays. For a ctable, ``images`` / ``labels`` name columns (inferred when
    unambiguous); for an HDF5 file ``dataset`` (and ``labels``) name datasets; for an
    ``.npz`` of arrays ``images`` / ``labels`` name members. ``allow_pickle`` lets
    object-dtype bcolz arrays be unpickled (this runs code from the file: only for files
    you trust). ``verify`` re-reads the store and compares it bit for bit with the source
    before the store is renamed into place. ``codec`` / ``preset`` pick the store's codec
    (default: the ``balanced`` preset). Returns a MigrationReport.
    """
    t0 = time.perf_counter()
    for given in (src, images if src is None else None, labels if src is None else None):
        if given is not None and not Path(given).exists():
            raise MigrationError(f"{given}: no such file or folder")
    out_p = Path(out)
    if out_p.suffix != ".b2nd":
        raise InvalidInputError(f"{out_p}: the output store's name must end in .b2nd")
    if not out_p.parent.is_dir():
        raise InvalidInputError(f"{out_p}: folder {out_p.parent} does not exist")
    if out_p.exists() and not overwrite:
        raise StoreExistsError(f"{out_p} already exists; pass --overwrite (overwrite=True) to replace it")
    for s in (src, images if src is None else None, labels if src is None else None):
        if s is not None and Path(s).exists() and out_p.exists() and out_p.resolve() == Path(s).resolve():
            raise InvalidInputError(f"{out_p}: the output would replace the source; write to a new file")
    chosen = _resolve_codec(codec, preset)
    source = open_source(src, images=images, labels=labels, dataset=dataset, allow_pickle=allow_pickle)
    _remove_stale_tmp(out_p)
    tmp = out_p.with_name(f".{out_p.name}.migrating-{os.getpid()}-{secrets.token_hex(4)}.b2nd")
    try:
        store_codec = _write(source, tmp, chosen if chosen is not None else source.default_codec, progress, chunk_images)
        if verify:
            _verify(source, tmp, progress)
        if out_p.exists() and not overwrite:
            raise StoreExistsError(f"{out_p} appeared while migrating; not replacing it (pass --overwrite)")
        os.replace(tmp, out_p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        source.close()
        raise
    source.close()
    return MigrationReport(
        source=str(source.path),
        output=str(out_p),
        kind=source.kind,
        rows=source.nrows,
        item_shape=tuple(source.item_shape),
        dtype=str(source.dtype),
        nbytes=source.nbytes,
        bytes_before=source.cbytes,
        bytes_after=out_p.stat().st_size,
        codec_before=source.codec,
        codec_after=store_codec.describe(),
        seconds=time.perf_counter() - t0,
        verified=verify,
        labels=source.has_labels,
        warnings=list(source.warnings),
        notes=list(source.notes),
    )


def _bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="rows", unit_scale=True, disable=not enabled, file=sys.stderr, leave=False)


def _write(source: Source, tmp: Path, codec: Codec | str | None, progress: bool, chunk_images: int | None) -> Codec:
    from carraystore.writer import create

    layout = store_layout(source.item_shape, source.dtype)
    provenance = {"migrated_from": {"kind": source.kind, "name": source.path.name, **source.provenance}}
    writer = create(
        tmp,
        source.item_shape,
        dtype=source.dtype,
        codec=codec,
        chunk_images=chunk_images,
        class_names=source.class_names,
        attrs=source.attrs,
        layout=layout,
        provenance=provenance,
    )
    with writer, _bar(source.nrows, f"migrate {source.path.name}", progress) as bar:
        rows = 0
        for block in source.blocks():
            writer.append(block.data, labels=block.labels, keys=block.keys, columns=block.columns)
            rows += len(block.data)
            bar.update(len(block.data))
        if rows != source.nrows:
            raise MigrationError(f"{source.path}: read {rows} rows, the source says {source.nrows}")
        resolved = writer.meta.codec
    return resolved


def _as_bytes(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8)


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    """Index of the first row whose bytes differ."""
    ra = _as_bytes(a).reshape(len(a), -1)
    rb = _as_bytes(b).reshape(len(b), -1)
    return int(np.argmax(np.any(ra != rb, axis=1)))


def _verify(source: Source, path: Path, progress: bool) -> None:
    """Compare the store at ``path`` with a fresh pass over the source, chunk by chunk."""
    from carraystore.reader import open_store

    store = open_store(path)
    try:
        if len(store) != source.nrows or tuple(store.image_shape) != tuple(source.item_shape) or store.dtype != source.dtype:
            raise MigrationVerifyError(
                f"{source.path}: the store reads back as {len(store)} x {store.image_shape} {store.dtype}, "
                f"the source is {source.nrows} x {source.item_shape} {source.dtype}"
            )
        k = store.chunk_images
        buf = np.empty((k, *store.image_shape), dtype=store.dtype)
        cur = -1
        chunk = buf[:0]
        pos = 0
        labels, keys, columns = store.labels, store.keys, store.columns
        with _bar(source.nrows, f"verify {path.name}", progress) as bar:
            for block in source.blocks():
                n = len(block.data)
                got = 0
                while got < n:
                    c = (pos + got) // k
                    if c != cur:
                        chunk = store.read_chunk(c, out=buf)
                        cur = c
                    lo = pos + got - c * k
                    take = min(n - got, len(chunk) - lo)
                    mine, theirs = chunk[lo : lo + take], block.data[got : got + take]
                    if not np.array_equal(_as_bytes(mine), _as_bytes(theirs)):
                        row = pos + got + _first_difference(mine, theirs)
                        raise MigrationVerifyError(
                            f"{source.path}: row {row} differs between the source and the written store "
                            f"(store chunk {c}); nothing was kept"
                        )
                    got += take
                if block.labels is not None and (labels is None or not np.array_equal(labels[pos : pos + n], block.labels)):
                    raise MigrationVerifyError(f"{source.path}: labels of rows {pos}..{pos + n - 1} differ in the store")
                if block.keys is not None and (keys is None or list(keys[pos : pos + n]) != list(block.keys)):
                    raise MigrationVerifyError(f"{source.path}: keys of rows {pos}..{pos + n - 1} differ in the store")
                for name, col in (block.columns or {}).items():
                    if name not in columns or not np.array_equal(_as_bytes(columns[name][pos : pos + n]), _as_bytes(col)):
                        raise MigrationVerifyError(f"{source.path}: column {name!r} of rows {pos}..{pos + n - 1} differs in the store")
                pos += n
                bar.update(n)
        if pos != len(store):
            raise MigrationVerifyError(f"{source.path}: the source gave {pos} rows on re-reading, the store holds {len(store)}")
        if store.attrs != source.attrs:
            raise MigrationVerifyError(f"{source.path}: attrs differ in the store")
    finally:
        store.close()
