"""The migration pipeline: detect the source, stream it into a store, verify, rename into place.

Every source is a :class:`Source`: a description (item shape, dtype, rows, attrs) plus
``blocks()``, row blocks read a few chunks at a time. The blocks go into a hidden temporary
store beside the output, which is compared bit for bit with a second pass over the source
before the rename. On failure nothing is left at the output; the source is only read. An
output URL is staged locally and uploaded only when complete and verified.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from carraystore.base.atomic import publish, refuse_folder_target, remove_stale_temps, temp_path
from carraystore.base.errors import InvalidInputError, MigrationError, StoreExistsError
from carraystore.base.lock import WriterLock
from carraystore.base.resources import available_cpus
from carraystore.format.codec import Codec
from carraystore.format.encoded import Encoding
from carraystore.format.record import COLOR_MODES
from carraystore.migrations.base import Block, Source, labels_from_array, store_layout
from carraystore.sources.journal import rollback
from carraystore.sources.upload import RemoteTarget
from carraystore.store.options import WriteKwargs, WriteOptions
from carraystore.store.reader import StoreReader, is_url, open_store
from carraystore.store.writer import create

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "Block",
    "Source",
    "MigrationReport",
    "MigrationVerifyError",
    "migrate",
    "migrate_splits",
    "split_outputs",
    "source_splits",
    "open_migration_source",
    "labels_from_array",
    "store_layout",
]


class MigrationVerifyError(MigrationError):
    """The written store does not read back equal to the source (nothing was kept)."""


# -- the report ----------------------------------------------------------------------


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
    #: the fields (per-item columns) written: name -> dtype and row shape, e.g. ``float32[8]``
    fields: dict[str, str] = field(default_factory=dict)
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
        if self.fields:
            lines.append("  fields:  " + ", ".join(f"{n} {d}" for n, d in self.fields.items()))
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


# -- detection -----------------------------------------------------------------------

_ZIP_MAGIC = b"PK\x03\x04"
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"


def _looks_like_path(value: str | os.PathLike[str] | None) -> bool:
    return value is not None and Path(value).exists()


def open_migration_source(
    src: str | os.PathLike[str] | None,
    *,
    images: str | os.PathLike[str] | None = None,
    labels: str | os.PathLike[str] | None = None,
    dataset: str | None = None,
    allow_pickle: bool = False,
    no_labels: bool = False,
    group: str | None = None,
    onehot_to_class: bool = False,
    keys: str | None = None,
    groups: str | None = None,
    color_mode: str | None = None,
    image_size: Sequence[int] | None = None,
) -> Source:
    """Detect what ``src`` is and open it as a migration Source (arguments: ``migrate``'s)."""
    from carraystore.migrations import bcolz as bz
    from carraystore.migrations.detect import open_sample_source, sample_locations

    only_samples = {"keys": keys, "groups": groups, "color_mode": color_mode, "image_size": image_size}
    if src is not None and (sample_locations(src) is not None or Path(src).exists()):
        found = open_sample_source(
            src, images=_name(images), labels=_name(labels), no_labels=no_labels, group=group, **only_samples
        )
        if found is not None:
            if dataset is not None or onehot_to_class:
                found.close()
                raise InvalidInputError(
                    f"{src}: --dataset and --onehot-to-class are for array sources (HDF5, npz, bcolz), not {found.kind}"
                )
            return found
    given = [f"--{k.replace('_', '-')}" for k, v in only_samples.items() if v is not None]
    if given:
        raise InvalidInputError(f"{src}: {', '.join(given)} apply to WebDataset, TFRecord and Parquet/Arrow sources")

    if src is None:
        if images is None:
            raise InvalidInputError(
                "give a source to migrate, or --images X.bc (and --labels Y.bc) for two bcolz arrays"
            )
        if not bz.is_carray(images):
            raise MigrationError(f"{images}: --images without a SRC must be a bcolz carray folder")
        from carraystore.migrations.bcolz_sources import TwoArraySource

        return TwoArraySource(Path(images), Path(labels) if labels is not None else None, allow_pickle=allow_pickle)
    p = Path(src)
    if not p.exists():
        raise MigrationError(f"{p}: no such file or folder")
    if group is not None and (p.is_dir() or _head(p) != _HDF5_MAGIC):
        raise InvalidInputError(f"{p}: --group names a group (a split) of an HDF5 file; {p} is not one")
    if not p.is_dir() and not p.is_file():  # reading a FIFO's first bytes would block for ever
        raise MigrationError(f"{p} is not a regular file (a FIFO or device?); migrate reads files and bcolz folders")
    if p.is_dir():
        from carraystore.migrations import bcolz_sources as bs

        if dataset is not None:
            raise InvalidInputError(f"{p}: --dataset names an HDF5 dataset; {p} is a folder")
        if bz.is_ctable(p):
            return bs.CtableSource(
                p, images=_name(images), labels=_name(labels), allow_pickle=allow_pickle, onehot=onehot_to_class
            )
        if bz.is_carray(p):
            if images is not None:
                raise InvalidInputError(
                    f"{p} is a carray: --images names a column of a ctable (or use --images X.bc without SRC)"
                )
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
        return NpzSource(
            p,
            images=_name(images),
            labels=_name(labels),
            no_labels=no_labels,
            allow_pickle=allow_pickle,
            onehot=onehot_to_class,
        )
    if head == _HDF5_MAGIC:
        from carraystore.migrations.hdf5 import Hdf5Source

        return Hdf5Source(
            p,
            dataset=dataset or _name(images),
            labels=_name(labels),
            no_labels=no_labels,
            group=group,
            onehot=onehot_to_class,
        )
    from carraystore.migrations import npy

    if head[:6] == npy.NPY_MAGIC or npy.is_pickle(p, head):
        if dataset is not None or images is not None:
            raise InvalidInputError(f"{p}: a single array; --dataset / --images name arrays inside a file")
        if labels is not None and not Path(labels).is_file():
            raise InvalidInputError(f"{p}: --labels for a single array is a second .npy file, got {labels}")
        lab = Path(labels) if labels is not None else None
        cls = npy.NpySource if head[:6] == npy.NPY_MAGIC else npy.PickleSource
        return cls(p, labels=lab, allow_pickle=allow_pickle, onehot=onehot_to_class)
    from carraystore.migrations.versions import open_old_store, store_format_version

    if store_format_version(p) is not None:
        return open_old_store(p)  # a store of the current version gets "nothing to migrate"
    raise MigrationError(
        f"{p}: not a format carraystore can migrate; it reads bcolz carray/ctable folders, .npz files, "
        "HDF5 files, .npy files (pickles with --allow-pickle) and carraystore stores of an older format version"
    )


def _head(p: Path) -> bytes:
    with open(p, "rb") as f:
        return f.read(8)


def _name(value: str | os.PathLike[str] | None) -> str | None:
    return None if value is None else str(value)


# -- the pipeline --------------------------------------------------------------------


def migrate(
    src: str | os.PathLike[str] | None,
    out: str | os.PathLike[str],
    *,
    images: str | os.PathLike[str] | None = None,
    labels: str | os.PathLike[str] | None = None,
    dataset: str | None = None,
    allow_pickle: bool = False,
    verify: bool = True,
    no_labels: bool = False,
    options: WriteOptions | None = None,
    group: str | None = None,
    onehot_to_class: bool = False,
    keys: str | None = None,
    groups: str | None = None,
    color_mode: str | None = None,
    image_size: Sequence[int] | None = None,
    layout: str = "pixels",
    **write: Unpack[WriteKwargs],
) -> MigrationReport:
    """Migrate a legacy array or file into a store at ``out`` (a ``.b2nd`` path or URL); returns a MigrationReport.

    ``src``: a bcolz carray or ctable rootdir, an ``.npz``, an HDF5 file, a ``.npy`` (``labels``:
    a second ``.npy``) or an older store; or None with ``images`` and ``labels`` naming two
    bcolz carrays. ``images``/``labels`` name ctable columns or npz members, ``dataset`` (and
    ``labels``) HDF5 datasets. Labels are inferred when exactly one integer array fits;
    ``no_labels=True`` leaves them out; ``onehot_to_class=True`` takes one-hot rows as class
    labels (else OneHotLabelsError). Other arrays with one row per item become fields; what
    cannot is named in ``report.notes``. ``group``: one split of an HDF5 file (all:
    :func:`migrate_splits`). Pickled data needs ``allow_pickle=True`` (else
    PickleNotAllowedError): unpickling runs code from the file, so only for files you trust.

    WebDataset shards (a list, a ``{000..099}`` pattern or URLs), TFRecord files and Parquet/Arrow
    tables (docs/migrating.md): ``images``/``labels``/``keys``/``groups`` name members, features
    or columns (else inferred); ``color_mode``/``image_size`` decode as ``ingest`` does; ``group``
    picks one split. ``layout="encoded"`` keeps each image's source bytes where they decode to its
    pixels, else PNG (lossless: the store stays bit-exact), for any uint8 (H, W, C) source.

    ``verify``: compare the store bit for bit with the source before the rename. Write options
    (``codec`` default ``balanced``; ``class_names`` default the source's
    ``class_names``/``classes``/``label_names``) as keywords or ``options``; ``attrs`` are
    refused: a migration keeps the source's.
    """
    t0 = time.perf_counter()
    what: dict[str, Any] = dict(  # what to read from src, as open_migration_source takes it
        images=images,
        labels=labels,
        dataset=dataset,
        allow_pickle=allow_pickle,
        no_labels=no_labels,
        group=group,
        onehot_to_class=onehot_to_class,
        keys=keys,
        groups=groups,
        color_mode=color_mode,
        image_size=image_size,
    )
    if layout not in ("pixels", "encoded"):
        raise InvalidInputError(f"layout must be 'pixels' or 'encoded', got {layout!r}")
    encoding = Encoding() if layout == "encoded" else None
    opts = WriteOptions.merged(options, str(out), **write)
    opts.refuse(
        ("attrs",),
        str(out),
        "a migration keeps the source's attrs (it is verified against them); change them afterwards with "
        "update_metadata (CLI: carraystore meta --attr)",
    )
    from carraystore.migrations.detect import sample_locations

    for given in (src, images if src is None else None, labels if src is None else None):
        if given is not None and sample_locations(given) is None and not Path(given).exists():
            raise MigrationError(f"{given}: no such file or folder")
    if is_url(out):
        target = RemoteTarget(str(out), opts.storage_options, overwrite=opts.overwrite, tmp_dir=opts.tmp_dir)
        try:
            staged = opts.replace(overwrite=False, lock_timeout=0.0, storage_options=None, tmp_dir=None)
            report = migrate(src, target.local_path, verify=verify, options=staged, layout=layout, **what)
            target.upload()
        finally:
            target.cleanup()
        report.output = str(out)
        report.seconds = time.perf_counter() - t0
        return report
    if opts.storage_options:
        raise InvalidInputError(f"{out}: storage_options apply to URLs only, not to local paths")
    out_p = Path(out)
    if out_p.suffix != ".b2nd":
        raise InvalidInputError(f"{out_p}: the output store's name must end in .b2nd")
    if not out_p.parent.is_dir():
        raise InvalidInputError(f"{out_p}: folder {out_p.parent} does not exist")
    lock = WriterLock(Path(os.path.realpath(out_p)), purpose="migrate", timeout=opts.lock_timeout)
    lock.acquire()
    try:
        return _migrate_locked(src, out_p, what, verify, opts, t0, encoding)
    finally:
        lock.release()


def split_outputs(out: str | os.PathLike[str], groups: Sequence[str]) -> dict[str, str]:
    """Where each group's store goes: ``out`` with ``{group}`` is a name pattern, else a folder
    (not ending in ``.b2nd``; a URL ending in ``/``) that gets ``GROUP.b2nd`` (``/`` -> ``_``)."""
    text = str(out)
    names = {g: g.strip("/").replace("/", "_") for g in groups}
    if "{group}" in text:
        return {g: text.replace("{group}", n) for g, n in names.items()}
    if is_url(text):
        if not text.endswith("/"):
            raise InvalidInputError(
                f"{text}: one store per group needs OUT as a folder URL ending in / or a name with {{group}}"
            )
        return {g: f"{text}{n}.b2nd" for g, n in names.items()}
    if text.endswith(".b2nd"):
        raise InvalidInputError(
            f"the source holds one split per group {list(groups)}: give OUT as a folder (OUT/ gets "
            f"{', '.join(n + '.b2nd' for n in names.values())}) or a name with {{group}} (data_{{group}}.b2nd), "
            "or migrate one split with --group NAME"
        )
    return {g: str(Path(text) / f"{n}.b2nd") for g, n in names.items()}


def migrate_splits(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    groups: Sequence[str] | None = None,
    **kwargs: Any,
) -> dict[str, MigrationReport]:
    """Migrate every split group (``train/``, ``val/``, ...) of an HDF5 file into one store each; return the reports.

    ``out``: a folder or a ``{group}`` pattern (:func:`split_outputs`); ``groups``: some
    (default all). Other keywords are :func:`migrate`'s. Each store is atomic; none starts
    while any output exists (unless ``overwrite``).
    """
    found = source_splits(src)
    if not found:
        raise MigrationError(
            f"{src}: not an HDF5 file with one group per split (train/images, val/images, ...) nor a folder of "
            "splits (a datasets save_to_disk folder, Hub Parquet files, TensorFlow Datasets TFRecord files)"
        )
    for g in groups or ():
        if g.strip("/") not in found:
            raise MigrationError(f"{src}: no split {g!r}; its splits are {found}")
    targets = split_outputs(out, [g.strip("/") for g in groups] if groups else found)
    options = kwargs.get("options")
    overwrite = bool(kwargs.get("overwrite")) or bool(options is not None and options.overwrite)
    local = not is_url(str(out))
    if local:
        existing = [t for t in targets.values() if Path(t).exists()]
        if existing and not overwrite:
            raise StoreExistsError(f"{existing} already exist; pass --overwrite (overwrite=True) to replace them")
        folder = Path(next(iter(targets.values()))).parent
        if "{group}" not in str(out) and not folder.is_dir():
            if not folder.parent.is_dir():
                raise InvalidInputError(f"{out}: folder {folder.parent} does not exist")
            folder.mkdir()
    return {g: migrate(src, t, group=g, **kwargs) for g, t in targets.items()}


def source_splits(src: str | os.PathLike[str]) -> list[str]:
    """The splits of ``src``: an HDF5 file's split groups, a datasets folder's or TFDS files' splits; [] if none."""
    p = Path(src)
    if p.is_file() and _head(p) == _HDF5_MAGIC:
        from carraystore.migrations.hdf5 import hdf5_split_groups

        return list(hdf5_split_groups(p))
    from carraystore.migrations.detect import sample_splits

    return list(sample_splits(p))


def _migrate_locked(
    src: str | os.PathLike[str] | None,
    out_p: Path,
    what: dict[str, Any],
    verify: bool,
    opts: WriteOptions,
    t0: float,
    encoding: Encoding | None = None,
) -> MigrationReport:
    refuse_folder_target(out_p)
    if out_p.exists() and not opts.overwrite:
        raise StoreExistsError(f"{out_p} already exists; pass --overwrite (overwrite=True) to replace it")
    images, labels = (None, None) if src is not None else (what["images"], what["labels"])
    for s in (src, images, labels):
        if (
            isinstance(s, (str, os.PathLike))
            and Path(s).exists()
            and out_p.exists()
            and out_p.resolve() == Path(s).resolve()
        ):
            raise InvalidInputError(f"{out_p}: the output would replace the source; write to a new file")
    if what["no_labels"] and what["labels"] is not None:
        raise InvalidInputError("give either labels or no_labels (--no-labels), not both")
    source = open_migration_source(src, **what)
    if opts.class_names is not None:
        _set_class_names(source, opts.class_names)
    rollback(Path(os.path.realpath(out_p)))  # undo a half-done append to out_p first
    remove_stale_temps(out_p)  # dead: we hold the lock every writer of out_p holds
    tmp = temp_path(out_p, "migrating")
    try:
        store_codec, fields, kept = _write(source, tmp, opts, encoding)
        if verify:
            _verify(source, tmp, opts.progress, *(() if kept is None else (kept,)))
        if out_p.exists() and not opts.overwrite:
            raise StoreExistsError(f"{out_p} appeared while migrating; not replacing it (pass --overwrite)")
        publish(tmp, out_p)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        source.close()
        raise
    source.close()
    return MigrationReport(
        source=str(getattr(source, "location", "") or source.path),
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
        fields=fields,
        warnings=list(source.warnings),
        notes=list(source.notes),
    )


def _set_class_names(source: Source, class_names: Sequence[str]) -> None:
    """Give the source's labels the names the user passed (checked: distinct, enough for the labels)."""
    names = tuple(str(c) for c in class_names)
    where = f"{source.path}: --class-names {','.join(names)}"
    if not source.has_labels:
        source.close()
        raise InvalidInputError(f"{where}: the source has no labels to name; give the labels too (--labels NAME)")
    if len(set(names)) != len(names) or not all(names):
        source.close()
        raise InvalidInputError(f"{where}: class names must be distinct and non-empty")
    labels = getattr(source, "_labels", None)
    if labels is not None and len(labels) and int(np.max(labels)) >= len(names):
        source.close()
        raise InvalidInputError(
            f"{where}: the labels go up to {int(np.max(labels))}, so {int(np.max(labels)) + 1} names are needed"
        )
    if source.class_names is not None and source.class_names != names:
        source.notes.append(f"class names {list(source.class_names)[:10]} from the source replaced by --class-names")
    source.class_names = names


def _bar(total: int, desc: str, enabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="rows", unit_scale=True, disable=not enabled, file=sys.stderr, leave=False)


def _write(
    source: Source, tmp: Path, opts: WriteOptions, encoding: Encoding | None = None
) -> tuple[Codec, dict[str, str], int | None]:
    """Write the source's blocks into ``tmp``; (the codec, the fields, how many entries are source bytes or None)."""
    layout = store_layout(source.item_shape, source.dtype)
    if encoding is not None:
        if layout != "NHWC" or source.dtype != np.uint8:
            raise InvalidInputError(
                f"{source.path}: --layout encoded holds uint8 images (H, W, 1|3|4); the source's items are "
                f"{source.dtype}{list(source.item_shape)}: leave out --layout"
            )
        layout = "encoded"
    provenance = {"migrated_from": {"kind": source.kind, "name": source.path.name, **source.provenance}}
    writer = create(
        tmp,
        source.item_shape,
        dtype=source.dtype,
        codec=opts.codec if opts.codec is not None else source.default_codec,
        chunk_images=opts.chunk_images,
        class_names=source.class_names,
        attrs=source.attrs,
        layout=layout,
        provenance=provenance,
        encoding=encoding,
    )
    from carraystore.migrations.samples import encoded_entries, entries_note

    why: Counter[str] = Counter()
    with (
        writer,
        _bar(source.nrows, f"migrate {source.path.name}", opts.progress) as bar,
        ThreadPoolExecutor(max(1, min(8, available_cpus()))) as pool,
    ):
        rows = 0
        fields: dict[str, str] = {}
        for block in source.blocks():
            for name, col in (block.columns or {}).items():
                fields.setdefault(name, f"{col.dtype}{list(col.shape[1:]) if col.ndim > 1 else ''}")
            items: dict[str, Any] = dict(
                labels=block.labels, keys=block.keys, columns=block.columns, groups=block.groups
            )
            if encoding is not None:
                entries, reasons = encoded_entries(block, encoding, COLOR_MODES[source.item_shape[2]], pool)
                why.update(reasons)
                writer.append_entries(entries, **items)
            else:
                writer.append(block.data, **items)
            rows += len(block.data)
            bar.update(len(block.data))
        if rows != source.nrows:
            raise MigrationError(f"{source.path}: read {rows} rows, the source says {source.nrows}")
        resolved = writer.meta.codec
    if encoding is None:
        return resolved, fields, None
    source.notes.append(entries_note(why, rows, encoding))
    return resolved, fields, sum(n for w, n in why.items() if w.startswith("kept "))


def _as_bytes(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.reshape(-1).view(np.uint8)


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    """Index of the first row whose bytes differ."""
    ra = _as_bytes(a).reshape(len(a), -1)
    rb = _as_bytes(b).reshape(len(b), -1)
    return int(np.argmax(np.any(ra != rb, axis=1)))


def _same_attrs(a: Any, b: Any) -> bool:
    """Whether two attrs are the same JSON values (a NaN attribute equals itself, unlike with ``==``)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def _verify(source: Source, path: Path, progress: bool, kept: int | None = None) -> None:
    """Compare the store at ``path`` with a fresh pass over the source, chunk by chunk (groups, and with ``kept``
    the number of entries byte for byte the source's files, too)."""
    store: StoreReader = open_store(path)
    try:
        if (
            len(store) != source.nrows
            or tuple(store.item_shape) != tuple(source.item_shape)
            or store.dtype != source.dtype
        ):
            raise MigrationVerifyError(
                f"{source.path}: the store reads back as {len(store)} x {store.item_shape} {store.dtype}, "
                f"the source is {source.nrows} x {source.item_shape} {source.dtype}"
            )
        k = store.chunk_images
        buf = np.empty((k, *store.item_shape), dtype=store.dtype)
        cur = -1
        chunk = buf[:0]
        pos = 0
        labels, keys, columns = store.labels, store.keys, store.columns
        group_names = np.asarray(store.group_names or (), dtype=object)
        same_bytes = 0
        entries: list[bytes] = []
        with _bar(source.nrows, f"verify {path.name}", progress) as bar:
            for block in source.blocks():
                n = len(block.data)
                got = 0
                while got < n:
                    c = (pos + got) // k
                    if c != cur:
                        chunk = store.read_chunk(c, out=buf)
                        cur = c
                        entries = store.chunk_entries(c) if kept is not None else []
                    lo = pos + got - c * k
                    take = min(n - got, len(chunk) - lo)
                    mine, theirs = chunk[lo : lo + take], block.data[got : got + take]
                    if kept is not None and block.encoded is not None:
                        stored = entries[lo : lo + take]
                        same_bytes += sum(a == b for a, b in zip(stored, block.encoded[got : got + take], strict=True))
                    if not np.array_equal(_as_bytes(mine), _as_bytes(theirs)):
                        row = pos + got + _first_difference(mine, theirs)
                        raise MigrationVerifyError(
                            f"{source.path}: row {row} differs between the source and the written store "
                            f"(store chunk {c}); nothing was kept"
                        )
                    got += take
                if block.labels is not None and (
                    labels is None or not np.array_equal(labels[pos : pos + n], block.labels)
                ):
                    raise MigrationVerifyError(
                        f"{source.path}: labels of rows {pos}..{pos + n - 1} differ in the store"
                    )
                if block.keys is not None and (keys is None or list(keys[pos : pos + n]) != list(block.keys)):
                    raise MigrationVerifyError(f"{source.path}: keys of rows {pos}..{pos + n - 1} differ in the store")
                if block.groups is not None and (
                    store.groups is None or list(group_names[store.groups[pos : pos + n]]) != list(block.groups)
                ):
                    raise MigrationVerifyError(
                        f"{source.path}: groups of rows {pos}..{pos + n - 1} differ in the store"
                    )
                for name, col in (block.columns or {}).items():
                    if name not in columns or not np.array_equal(
                        _as_bytes(columns[name][pos : pos + n]), _as_bytes(col)
                    ):
                        raise MigrationVerifyError(
                            f"{source.path}: column {name!r} of rows {pos}..{pos + n - 1} differs in the store"
                        )
                pos += n
                bar.update(n)
        if pos != len(store):
            raise MigrationVerifyError(
                f"{source.path}: the source gave {pos} rows on re-reading, the store holds {len(store)}"
            )
        if kept is not None and same_bytes < kept:
            raise MigrationVerifyError(
                f"{source.path}: {kept} images were kept as their source bytes, but only {same_bytes} stored entries "
                "equal them"
            )
        if not _same_attrs(store.attrs, source.attrs):
            raise MigrationVerifyError(f"{source.path}: attrs differ in the store")
    finally:
        store.close()
