"""Ingest: turn a folder of image files into a store (the main job).

Follows the conventions of ``keras.utils.image_dataset_from_directory``: labels inferred
from class sub-folders (sorted names), ``class_names``, ``image_size``, ``color_mode``,
``interpolation``, ``crop_to_aspect_ratio``, ``follow_links``. Files are decoded in
parallel processes and written in a seeded random order (so every chunk mixes classes)
unless ``shuffle=False``. Keys are each image's path relative to the folder.

This module plans (which stores, which files in which order, the write arguments) and
writes with local decoding processes; finding and decoding images is ``carraystore.ingest.images``,
the processes ``carraystore.ingest.decodepool``, the bad-file policy ``carraystore.ingest.badfiles``.
A ``runner`` decodes and writes each planned store elsewhere: ``carraystore.dask`` passes
one that decodes on a ``dask.distributed`` cluster.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import PIL

from carraystore.ingest.badfiles import DEFAULT_MAX_SKIPPED, BadFiles, allowed_skips, drop_bad_names, shape_error
from carraystore.format.codec import Codec
from carraystore.ingest.decodepool import decoded
from carraystore.format.encoded import Encoding, entry_for_pixels, source_entry
from carraystore.base.errors import GroupSplitError, IngestError, InvalidInputError
from carraystore.ingest.images import (
    DEPTH_RULE,
    IMAGE_EXTENSIONS,
    INGEST_DTYPES,
    INTERPOLATIONS,
    MODES,
    DecodeOptions,
    list_images,
    shown_name,
)
from carraystore.ingest.manifest import TARGET_FIELD, FieldTable, read_manifest
from carraystore.store.options import WriteOptions
from carraystore.store.reader import is_url
from carraystore.store.writer import StoreWriter, create
from carraystore.store.writer import append as open_append

__all__ = [
    "IngestResult",
    "StoreJob",
    "Runner",
    "run_locally",
    "split_like_folders",
    "validation_split_indices",
    "group_split_indices",
    "infer_groups",
    "natural_order",
    "SPLIT_NAMES",
    "from_directory",
]

log = logging.getLogger("carraystore.ingest.run")

#: Groups of the files: "inferred" (the folder below each class folder), None, one value per
#: file (sorted path order, as labels), a mapping relative path -> group, or a function of it.
Groups = str | Sequence[Any] | Mapping[str, Any] | Callable[[str], Any] | None

#: Folder names that mean a dataset split, not a class (compared in lower case).
SPLIT_NAMES = frozenset(
    {
        "train",
        "training",
        "val",
        "valid",
        "validation",
        "validate",
        "test",
        "testing",
        "dev",
        "eval",
        "evaluation",
        "holdout",
    }
)


@dataclass
class IngestResult:
    """What an ingest did: output path, counts, class names, skipped files, speed."""

    #: the store's path, or its URL
    path: Path | str
    nimages: int
    image_shape: tuple[int, ...]
    class_names: tuple[str, ...] | None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    seconds: float = 0.0
    nbytes: int = 0
    cbytes: int = 0
    #: number of groups (videos, sessions) among the written items, or None without groups
    ngroups: int | None = None
    #: what the ingest decided that the user should know (frame order, group split, ...)
    notes: list[str] = field(default_factory=list)
    #: for an append: the store's items after it (``nimages`` counts the added ones)
    total: int | None = None

    @property
    def images_per_s(self) -> float:
        return self.nimages / self.seconds if self.seconds > 0 else float("nan")

    def summary(self) -> str:
        ratio = self.nbytes / self.cbytes if self.cbytes else float("nan")
        what = (
            f"appended {self.nimages} images to {self.path} (now {self.total})"
            if self.total is not None
            else f"wrote {self.path}: {self.nimages} images"
        )
        lines = [
            f"{what} of {'x'.join(map(str, self.image_shape))} "
            f"in {self.seconds:.1f} s ({self.images_per_s:.0f} images/s); "
            f"{self.nbytes / 1e6:.1f} MB -> {self.cbytes / 1e6:.1f} MB (ratio {ratio:.2f})"
        ]
        if self.class_names is not None:
            lines.append(f"  classes: {', '.join(self.class_names)}")
        if self.ngroups is not None:
            lines.append(f"  groups: {self.ngroups} (whole videos/sessions: splits and clips never cut one)")
        lines.extend(f"  note: {n}" for n in self.notes)
        if self.ignored:
            lines.append(
                f"  ignored {len(self.ignored)} file(s) that are not in a class folder or not images, e.g. {shown_name(self.ignored[0])}"
            )
            lines.extend(
                f"    {shown_name(p)}" for p in self.ignored if p.endswith(")") and "/ (" in p
            )  # folders not entered
        if self.skipped:
            lines.append(f"  skipped {len(self.skipped)} file(s) that could not be decoded:")
            lines.extend(f"    {p}: {r}" for p, r in self.skipped)
        return "\n".join(lines)


@dataclass
class StoreJob:
    """One store of an ingest, planned: its files in write order and everything to write them.

    A runner decodes ``rels`` (relative to ``root``) with ``opts``, hands every file it
    cannot use to ``bad`` (which stops the ingest when the policy says so), writes the good
    ones in this order through :meth:`open_writer` with their ``labels`` and keys, records
    ``bad.skipped`` in the store, and returns :meth:`result`.
    """

    root: Path
    output: Path | str
    rels: list[str]
    labels: np.ndarray | None
    class_names: tuple[str, ...] | None
    ignored: list[str]
    opts: DecodeOptions
    bad: BadFiles
    #: the ``create`` arguments of the store (codec, chunk_images, class names, attrs, provenance, ...)
    write: dict[str, Any]
    workers: int
    progress: bool
    t0: float = field(default_factory=time.perf_counter)
    #: per-file fields (a targets manifest, float labels), looked up by key: ``fields.take(keys)``
    fields: FieldTable | None = None
    #: each file's group name (aligned with ``rels``), or None
    groups: list[str] | None = None
    #: an append: the store's writer, opened (and locked) before planning
    appender: StoreWriter | None = None
    notes: list[str] = field(default_factory=list)

    def columns_for(self, keys: Sequence[str]) -> dict[str, np.ndarray] | None:
        """The ``columns=`` of an append of the files ``keys`` (None without fields)."""
        return None if self.fields is None else self.fields.take(keys)

    @property
    def store_shape(self) -> tuple[int, ...] | None:
        """The item shape fixed before decoding: an appended-to store's, else None."""
        return self.appender.meta.image_shape if self.appender is not None else None

    def open_writer(self, shape: tuple[int, ...]) -> StoreWriter:
        """The store's writer, with one blosc2 thread, so that a chunk's blocks are in order and the same
        ingest always gives the same bytes (blosc2's threads place blocks as they finish)."""
        if self.appender is not None:
            if tuple(shape) != self.appender.meta.image_shape:
                raise IngestError(
                    f"{self.output}: the store holds {self.appender.meta.image_shape} images, these decode to {shape}"
                )
            return self.appender
        return create(self.output, shape, dtype=self.opts.dtype, nthreads=1, **self.write)

    def progress_bar(self, initial: int = 0) -> Any:
        """A tqdm bar over the files on stderr, or None without ``progress``."""
        if not self.progress:
            return None
        from tqdm import tqdm

        name = str(self.output).rsplit("/", 1)[-1]  # a path or a URL
        return tqdm(
            total=len(self.rels),
            initial=initial,
            desc=f"ingest {name}",
            unit="img",
            file=sys.stderr,
            dynamic_ncols=True,
        )

    def result(self, writer: StoreWriter, shape: tuple[int, ...]) -> IngestResult:
        """What the ingest of this store did, once ``writer`` is closed."""
        total = writer.nimages
        before = self.write.get("existing", 0) if self.appender is not None else 0
        n = total - before
        names = writer.meta.class_names if self.appender is not None else self.class_names
        group_names = writer.meta.group_names
        return IngestResult(
            path=self.output,
            nimages=n,
            image_shape=shape,
            class_names=names,
            skipped=self.bad.skipped,
            ignored=self.ignored,
            seconds=time.perf_counter() - self.t0,
            nbytes=n * int(np.prod(shape)) * np.dtype(self.opts.dtype).itemsize,
            cbytes=writer.file_size or 0,
            ngroups=len(set(self.groups)) if self.groups is not None and group_names is not None else None,
            notes=list(self.notes),
            total=total if self.appender is not None else None,
        )


#: Decodes and writes one planned store: :func:`run_locally` (the default) or a cluster's
#: (``carraystore.dask.from_directory`` passes one).
Runner = Callable[[StoreJob], IngestResult]


# -- the plan --------------------------------------------------------------------------------


def split_like_folders(root: str | os.PathLike[str]) -> list[str]:
    """The sub-folders of ``root`` that look like dataset splits (train/, validation/, test/, ...).

    Returns them when they probably are splits: two or more split names, or one split
    name that itself holds sub-folders (class folders). Otherwise an empty list.
    """
    rootp = Path(root)
    subdirs = sorted(d for d in rootp.iterdir() if d.is_dir() and not d.name.startswith("."))
    splits = [d for d in subdirs if d.name.lower() in SPLIT_NAMES]
    if len(splits) >= 2 or any(any(c.is_dir() for c in d.iterdir()) for d in splits):
        return [d.name for d in splits]
    return []


def validation_split_indices(
    n: int, validation_split: float, shuffle: bool, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) positions in the sorted file list, chosen exactly as Keras does.

    ``keras.utils.image_dataset_from_directory`` shuffles the sorted list with
    ``np.random.RandomState(seed)`` (when shuffling) and keeps the last
    ``int(validation_split * n)`` files for validation; the same seed picks the same files here.
    """
    _check_fraction(validation_split)
    n_val = int(validation_split * n)
    if n_val == 0 or n_val == n:
        raise IngestError(
            f"validation_split={validation_split} of {n} files leaves {'no file for validation' if n_val == 0 else 'no file for training'}"
        )
    order = np.arange(n)
    if shuffle:
        np.random.RandomState(seed).shuffle(order)
    return np.sort(order[: n - n_val]), np.sort(order[n - n_val :])


# -- groups and frame order -------------------------------------------------------------------

_DIGITS = re.compile(r"(\d+)")


def _natural(name: str) -> tuple[tuple[tuple[str, int], ...], str]:
    """``frame_2`` before ``frame_10``: text order, except that a run of digits compares as its number.

    Every other character is a token of its own; a digit run sorts where its first digit
    would in text order (after ``.`` and ``_``, before letters), then by value. The name
    itself breaks ties (``frame_01`` and ``frame_1``).
    """
    tokens: list[tuple[str, int]] = []
    for i, part in enumerate(_DIGITS.split(name)):
        if i % 2:
            tokens.append(("0", int(part)))
        else:
            tokens.extend((c, 0) for c in part)
    return tuple(tokens), name


def natural_order(rels: Sequence[str], class_first: bool = False) -> np.ndarray:
    """The positions of ``rels`` in natural order, folder by folder as the listing walks them.

    In every folder its files come before its sub-folders (as ``list_images`` lists them),
    and names compare with their digit runs as numbers: ``frame_2`` before ``frame_10``,
    ``video_9/`` before ``video_10/``. ``class_first`` keeps the first folder level (the class
    folders, in class-name order) in the order it comes in.
    """
    first: dict[str, int] = {}

    def key(rel: str) -> tuple[Any, ...]:
        parts = rel.split("/")
        out: list[Any] = []
        for i, part in enumerate(parts):
            is_dir = i < len(parts) - 1
            if i == 0 and class_first and is_dir:
                out.append((1, (first.setdefault(part, len(first)),), ""))
            else:
                out.append((int(is_dir), *_natural(part)))
        return tuple(out)

    keys = [key(r) for r in rels]
    return np.asarray(sorted(range(len(rels)), key=keys.__getitem__), dtype=np.int64)


def infer_groups(rels: Sequence[str], labels: Any, groups: Groups, root: Path) -> list[str] | None:
    """Each file's group name, or None when the files have no groups.

    ``groups="inferred"`` with class folders (``labels="inferred"``): the folder right below
    the class folder, named with its class (``walk/video_0001/frame_1.jpg`` is in group
    ``walk/video_0001``); files directly in a class folder form the group of that folder.
    Without a second folder level anywhere (plain class folders), or without class
    folders, no groups. A sequence gives one group per file in sorted path order (as
    labels), a mapping ``relative path -> group`` one for every file, a function
    ``group(relative path)`` one for each.
    """
    if groups is None:
        return None
    if isinstance(groups, str):
        if groups != "inferred":
            raise InvalidInputError(
                f"groups must be 'inferred', None, one group per file, a mapping or a function, got {groups!r}"
            )
        if labels != "inferred" or not any(r.count("/") >= 2 for r in rels):
            return None
        return ["/".join(r.split("/")[:2]) if r.count("/") >= 2 else r.split("/")[0] for r in rels]
    if isinstance(groups, Mapping):
        missing = [r for r in rels if r not in groups]
        extra = sorted(set(groups) - set(rels))
        if missing or extra:
            what = []
            if missing:
                what.append(f"{len(missing)} file(s) have no group, e.g. {', '.join(missing[:3])}")
            if extra:
                what.append(f"{len(extra)} group entr(ies) name no file, e.g. {', '.join(map(str, extra[:3]))}")
            raise IngestError(f"{root}: groups: {'; '.join(what)} (keys are paths relative to the folder)")
        values = [groups[r] for r in rels]
    elif callable(groups):
        values = [groups(r) for r in rels]
    else:
        values = list(groups)
        if len(values) != len(rels):
            raise IngestError(
                f"{root}: {len(values)} groups given for {len(rels)} image files "
                "(groups follow the sorted file paths, as labels do)"
            )
    out = []
    for rel, v in zip(rels, values, strict=True):
        if v is None or isinstance(v, (float, bytes)) or str(v) == "":
            raise IngestError(f"{root / rel}: group {v!r}; a group is a non-empty name or an integer")
        out.append(v if isinstance(v, str) else str(v))
    return out


def group_split_indices(
    groups: Sequence[str], labels: np.ndarray | None, validation_split: float, seed: int
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(training, validation) positions that keep every group whole, and notes on what was reached.

    Groups are drawn in a seeded order, class by class (a group's class is the label most of
    its files have): a group goes to validation while that brings the class's validation
    files closer to ``validation_split`` of its files, and a class always keeps one group
    for training. Without any such group, the smallest group goes. :class:`~carraystore.base.errors.GroupSplitError` when one part would
    be empty; the notes give the share reached and the classes missing from a part.
    """
    _check_fraction(validation_split)
    n = len(groups)
    names, inv = np.unique(np.asarray(groups, dtype=object).astype(str), return_inverse=True)
    g_count = len(names)
    sizes = np.bincount(inv, minlength=g_count)
    if labels is not None and n:
        lab = np.asarray(labels, dtype=np.int64)
        pairs, counts = np.unique(inv * (int(lab.max()) + 1) + lab, return_counts=True)
        best = np.full(g_count, -1, dtype=np.int64)
        most = np.zeros(g_count, dtype=np.int64)
        for pair, c in zip(pairs.tolist(), counts.tolist(), strict=True):
            g, label = divmod(pair, int(lab.max()) + 1)
            if c > most[g]:
                most[g], best[g] = c, label
        group_class = best
    else:
        lab = None
        group_class = np.zeros(g_count, dtype=np.int64)
    order = np.random.RandomState(seed).permutation(g_count)
    chosen = np.zeros(g_count, dtype=bool)
    for c in np.unique(group_class):
        members = [g for g in order.tolist() if group_class[g] == c]
        target = validation_split * int(sizes[members].sum())
        count = 0
        for g in members[:-1] if len(members) > 1 else []:  # a class's last group stays in training
            if count + sizes[g] / 2 <= target:
                chosen[g] = True
                count += int(sizes[g])
    if not chosen.any() and g_count >= 2:
        chosen[min(order.tolist(), key=lambda g: sizes[g])] = True
    val = chosen[inv]
    n_val = int(val.sum())
    if n_val == 0 or n_val == n:
        raise GroupSplitError(
            f"validation_split={validation_split} by groups: the {n} files form {g_count} group(s) "
            f"(videos, sessions: sizes {sorted(sizes.tolist())[:10]}), and a split never cuts a group, so "
            f"{'validation' if n_val == 0 else 'training'} would be empty. Ingest more groups, change "
            "validation_split, or split the folders yourself (split_dirs=True, CLI --split-dirs)"
        )
    notes = [
        f"validation_split={validation_split} keeps groups whole: {int(chosen.sum())} of {g_count} groups, "
        f"{n_val} of {n} files ({n_val / n:.1%}) in validation"
    ]
    if lab is not None:
        in_val, in_train = set(np.unique(lab[val]).tolist()), set(np.unique(lab[~val]).tolist())
        if in_val != in_train:
            notes.append(
                f"class coverage: {len(in_val)} class(es) in validation, {len(in_train)} in training; "
                f"label(s) {sorted(in_train - in_val)} not in validation, {sorted(in_val - in_train)} not in training "
                "(a class with one group can be in one part only)"
            )
        else:
            notes.append(f"class coverage: all {len(in_val)} classes in both parts")
    return np.flatnonzero(~val), np.flatnonzero(val), notes


def _check_fraction(validation_split: Any) -> None:
    if (
        not isinstance(validation_split, (int, float))
        or isinstance(validation_split, bool)
        or not 0 < validation_split < 1
    ):
        raise InvalidInputError(f"validation_split must be a fraction between 0 and 1, got {validation_split!r}")


def _check_options(color_mode: str, image_size: Any, interpolation: str, on_error: str) -> tuple[int, int] | None:
    if color_mode not in MODES:
        raise InvalidInputError(f"color_mode must be one of {sorted(MODES)}, got {color_mode!r}")
    if interpolation not in INTERPOLATIONS:
        raise InvalidInputError(
            f"interpolation {interpolation!r} is not available; choose one of {sorted(INTERPOLATIONS)} "
            "(Keras' gaussian, lanczos5 and mitchellcubic have no Pillow equivalent)"
        )
    if on_error not in ("fail", "skip"):
        raise InvalidInputError(f"on_error must be 'fail' or 'skip', got {on_error!r}")
    if image_size is None:
        return None
    size = tuple(int(x) for x in image_size)
    if len(size) != 2 or min(size) < 1:
        raise InvalidInputError(f"image_size must be (height, width), got {image_size!r}")
    return size


def _ingest_one(
    root: Path,
    output: Path | str,
    rels: list[str],
    labels: np.ndarray | None,
    class_names: tuple[str, ...] | None,
    ignored: list[str],
    opts: DecodeOptions,
    *,
    shuffle: bool,
    seed: int,
    workers: int,
    on_error: str,
    codec: Codec | str | None,
    chunk_images: int | None,
    overwrite: bool,
    progress: bool,
    lock_timeout: float | None,
    attrs: dict[str, Any] | None,
    provenance: dict[str, Any],
    max_skipped: float | int = DEFAULT_MAX_SKIPPED,
    storage_options: dict[str, Any] | None = None,
    tmp_dir: str | os.PathLike[str] | None = None,
    runner: Runner | None = None,
    fields: FieldTable | None = None,
    groups: list[str] | None = None,
    appender: StoreWriter | None = None,
    notes: Sequence[str] = (),
    class_folders: bool = False,
    layout: str = "pixels",
    quality: int | None = None,
) -> IngestResult:
    """Plan one store (bad names dropped, the write order, the write arguments) and run it."""
    if not rels:
        raise IngestError(f"{root}: no image files found (looked for {', '.join(IMAGE_EXTENSIONS)})")
    allowed = allowed_skips(max_skipped, len(rels))
    t0 = time.perf_counter()
    group_of = dict(zip(rels, groups, strict=True)) if groups is not None else None
    rels, labels, skipped = drop_bad_names(root, rels, labels, on_error)
    notes = list(notes)
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(rels))
    else:  # in order: natural order, frame_2 before frame_10
        order = natural_order(rels, class_first=class_folders)
        differ = np.flatnonzero(order != np.arange(len(rels)))
        if len(differ):
            i = int(differ[0])
            note = (
                f"file names are numbered without leading zeros: written in natural order ({rels[order[i]]} "
                f"before {rels[i]}, as frame_2 before frame_10), not in text order"
            )
            notes.append(note)
            log.info("%s: %s", root, note)
    rels = [rels[i] for i in order]
    if labels is not None:
        labels = labels[order]
    bad = BadFiles(root, len(rels), on_error, max_skipped, allowed, skipped)
    write: dict[str, Any] = dict(
        codec=codec,
        chunk_images=chunk_images,
        class_names=class_names,
        attrs=attrs,
        overwrite=overwrite,
        provenance=provenance,
        lock_timeout=lock_timeout,
        storage_options=storage_options,
        tmp_dir=tmp_dir,
    )
    if layout == "encoded":
        write.update(layout="encoded", encoding=Encoding.for_quality(quality))
    if appender is not None:
        write["existing"] = appender.nimages
    job = StoreJob(
        root, output, rels, labels, class_names, ignored, opts, bad, write, workers, progress, t0, fields=fields
    )
    job.groups = [group_of[r] for r in rels] if group_of is not None else None
    job.appender, job.notes = appender, notes
    return (runner or run_locally)(job)


def run_locally(job: StoreJob) -> IngestResult:
    """The default runner: decode in ``job.workers`` local processes (``decodepool``), write in order."""
    opts, labels, bad = job.opts, job.labels, job.bad
    _, channels = MODES[opts.color_mode]
    writer: StoreWriter | None = None
    first_shape: tuple[int, ...] | None = None
    first_rel = ""
    batch_imgs: list[np.ndarray] = []
    batch_labels: list[int] = []
    batch_keys: list[str] = []
    batch_groups: list[str] = []
    groups = job.groups

    def flush() -> None:
        assert writer is not None
        if not batch_imgs:
            return
        per_item: dict[str, Any] = dict(
            labels=np.asarray(batch_labels, dtype=np.int64) if labels is not None else None,
            keys=list(batch_keys),
            columns=job.columns_for(batch_keys),
            groups=list(batch_groups) if groups is not None else None,
        )
        if writer.meta.layout == "encoded":  # the files' own bytes where they decode to these pixels
            writer.append_encoded(_entries(job, batch_keys, batch_imgs, writer.meta.encoding), **per_item)
        else:
            writer.append(np.stack(batch_imgs), **per_item)
        batch_imgs.clear()
        batch_labels.clear()
        batch_keys.clear()
        batch_groups.clear()

    if job.store_shape is not None:  # an append: the store fixes the shape
        first_shape, first_rel = job.store_shape, "the store's images"
        writer = job.open_writer(first_shape)
    elif opts.image_size is not None:
        first_shape = (*opts.image_size, channels)
        writer = job.open_writer(first_shape)
    bar = job.progress_bar()
    try:
        for pos, (rel, arr, err) in enumerate(decoded(job.root, job.rels, opts, job.workers)):
            if bar is not None:
                bar.update(1)
            err = err or shape_error(arr, first_shape, first_rel)
            if err is not None:
                bad.add(pos, rel, err, first_shape, first_rel)
                continue
            assert arr is not None
            if writer is None:
                first_shape = arr.shape
                first_rel = rel
                writer = job.open_writer(first_shape)
            elif not first_rel:
                first_rel = rel
            batch_imgs.append(arr)
            if labels is not None:
                batch_labels.append(int(labels[pos]))
            if groups is not None:
                batch_groups.append(groups[pos])
            batch_keys.append(rel)
            if len(batch_imgs) >= 64:
                flush()
        if writer is None:
            raise bad.none_decoded()
        flush()
        for rel, reason in bad.skipped:
            writer.add_skipped(rel, reason)
        writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    return job.result(writer, first_shape or ())


def _float_labels(labels: Any) -> np.ndarray | None:
    """``labels`` given as floats or vectors (a regression target), else None (class labels, "inferred", None)."""
    if labels is None or isinstance(labels, str):
        return None
    arr = np.asarray(labels)
    if arr.dtype.kind == "f" or arr.ndim > 1:
        if arr.dtype.kind not in "biuf":
            raise InvalidInputError(f"labels must be numbers, got {arr.dtype}")
        return arr
    return None


def _fields_for(
    root: Path, rels: list[str], target_values: np.ndarray | None, table: FieldTable | None
) -> FieldTable | None:
    """The per-file fields of an ingest: float ``labels`` as the field "target", and a manifest's."""
    fields = None
    if target_values is not None:
        if len(target_values) != len(rels):
            raise IngestError(
                f"{root}: {len(target_values)} labels given for {len(rels)} image files (labels follow the sorted "
                "file paths, as in Keras)"
            )
        fields = FieldTable.from_values(rels, TARGET_FIELD, target_values)
    if table is not None:
        table.check_files(rels, str(root))
        fields = table if fields is None else fields.merged(table)
    return fields


def _entries(job: StoreJob, rels: list[str], pixels: list[np.ndarray], encoding: Encoding | None) -> list[bytes]:
    """Layout "encoded": each file's own bytes when they decode to exactly its pixels, else the
    pixels encoded with the store's pinned format (FORMAT.md 10.3)."""
    assert encoding is not None
    out = []
    for rel, arr in zip(rels, pixels, strict=True):
        kept = None
        if encoding.quality is None:  # a quality asks for every image to be encoded at it
            try:
                data = (job.root / rel).read_bytes()
            except OSError:
                data = b""
            kept = source_entry(data, arr, job.opts.color_mode)
        out.append(kept if kept is not None else entry_for_pixels(arr, encoding))
    return out


def _output_folder(path: Path) -> None:
    """Make the folder that receives one store per split; a file in the way is a named error."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise InvalidInputError(
            f"{path} is a file (or under one); with several splits the output is a folder that receives one store "
            "per split: choose a folder name"
        ) from exc


def _store_decode_options(
    meta: Any,
    where: str,
    size: tuple[int, int] | None,
    color_mode: str | None,
    interpolation: str | None,
    crop_to_aspect_ratio: bool | None,
    dtype: str | None,
) -> DecodeOptions:
    """An append's decode options: the store's; an option given that differs is refused by name."""
    if meta.layout != "NHWC" or meta.np_dtype.name not in INGEST_DTYPES:
        raise InvalidInputError(
            f"{where}: the store holds {meta.layout} items of {meta.np_dtype}, not images an ingest writes "
            f"({'/'.join(INGEST_DTYPES)}, height x width x channels); images cannot be appended to it"
        )
    prov = meta.provenance or {}
    h, w = meta.image_shape[:2]

    def same(name: str, given: Any, stored: Any, cli: str) -> Any:
        if given is not None and stored is not None and given != stored:
            raise InvalidInputError(
                f"{where}: {name}={given!r}, but the store was written with {name}={stored!r}; an append takes "
                f"the store's decode options: leave {name} out (CLI: {cli})"
            )
        return stored if given is None else given

    mode = same("color_mode", color_mode, meta.color_mode, "--color-mode")
    dt = same("dtype", dtype, meta.np_dtype.name, "--dtype")
    if size is not None and tuple(size) != (h, w):
        raise InvalidInputError(
            f"{where}: image_size={tuple(size)}, but the store holds {h}x{w} images; an append resizes to the "
            f"store's size: leave image_size out (CLI: --image-size) or pass ({h}, {w})"
        )
    from_folder = prov.get("source_kind") == "image_folder"
    if size is None and not (from_folder and prov.get("image_size") is None):
        size = (h, w)  # the store was resized (or is not from a folder): resize to its size
    interp = same("interpolation", interpolation, prov.get("interpolation") if from_folder else None, "--interpolation")
    crop = same(
        "crop_to_aspect_ratio",
        crop_to_aspect_ratio,
        prov.get("crop_to_aspect_ratio") if from_folder else None,
        "--crop-to-aspect-ratio",
    )
    return DecodeOptions(mode, size, interp or "bilinear", bool(crop), dt)


def _append_plan(
    writer: StoreWriter,
    root: Path,
    rels: list[str],
    labs: np.ndarray | None,
    names: tuple[str, ...] | None,
    groups: list[str] | None,
    groups_given: bool,
    skip_existing: bool,
) -> tuple[list[str], np.ndarray | None, list[str] | None, list[str]]:
    """An append's files, labels (indexing the store's class list, new classes added at its end) and groups."""
    meta, where = writer.meta, str(writer.path)
    notes: list[str] = []
    if meta.nimages and meta.keys is None:
        raise IngestError(
            f"{where}: the store has no keys; an ingest names every item by its file path, so it cannot append "
            "to this store (append with carraystore.append and keys= of your own)"
        )
    if meta.nimages and (labs is not None) != (meta.labels is not None):
        raise IngestError(
            f"{where}: the store is {'labelled' if meta.labels is not None else 'unlabelled'} and the folder "
            f"{'is' if labs is not None else 'is not'}; pass labels={'None' if labs is not None else repr('inferred')} "
            f"(CLI: --labels {'none' if labs is not None else 'inferred'}) to match the store"
        )
    existing = set(meta.keys) if meta.keys is not None else set()
    dup = [i for i, r in enumerate(rels) if r in existing]
    if dup and not skip_existing:
        raise IngestError(
            f"{where}: {len(dup)} of the {len(rels)} files are already in the store (same key), e.g. "
            f"{', '.join(rels[i] for i in dup[:3])}; pass skip_existing=True (CLI: --skip-existing) to add only "
            "the new files"
        )
    if dup:
        keep = np.setdiff1d(np.arange(len(rels)), dup)
        rels = [rels[i] for i in keep]
        labs = labs[keep] if labs is not None else None
        groups = [groups[i] for i in keep] if groups is not None else None
        notes.append(f"skipped {len(dup)} file(s) already in the store (skip_existing)")
    if labs is not None and names is not None:
        full = writer.extend_class_names(names)
        added = [c for c in full if c not in (meta.class_names or ())]
        if added:
            notes.append(f"new classes added after the store's: {', '.join(added)}")
        index = {c: i for i, c in enumerate(full)}
        labs = np.asarray([index[names[int(v)]] for v in labs], dtype=np.int64)
    if groups is not None and meta.nimages and meta.group_names is None:
        if groups_given:
            raise IngestError(
                f"{where}: the store has no groups (its items were written without them), so groups= cannot be "
                "recorded for the new ones; leave groups out"
            )
        notes.append("the store records no groups, so the new files' group folders are not recorded either")
        groups = None
    if groups is None and meta.group_names is not None and meta.nimages:
        raise IngestError(
            f"{where}: the store records groups (videos, sessions), but {root} has no group folders "
            "(class/group/file) and no groups= were given; pass groups= (one per file) to append"
        )
    return rels, labs, groups, notes


def from_directory(
    directory: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    labels: str | Sequence[int] | Sequence[float] | np.ndarray | None = "inferred",
    class_names: Sequence[str] | None = None,
    targets: str | os.PathLike[str] | None = None,
    image_size: tuple[int, int] | None = None,
    interpolation: str | None = None,
    color_mode: str | None = None,
    crop_to_aspect_ratio: bool | None = None,
    shuffle: bool = True,
    seed: int = 0,
    keep_order: bool = False,
    workers: int | None = None,
    on_error: str = "fail",
    codec: Codec | str | None = None,
    chunk_images: int | None = None,
    split_dirs: bool = False,
    follow_links: bool = False,
    overwrite: bool = False,
    progress: bool = False,
    attrs: dict[str, Any] | None = None,
    dtype: str | None = None,
    max_skipped: float | int = DEFAULT_MAX_SKIPPED,
    allow_split_names: bool = False,
    validation_split: float | None = None,
    subset: str | None = None,
    lock_timeout: float | None = 0.0,
    storage_options: dict[str, Any] | None = None,
    tmp_dir: str | os.PathLike[str] | None = None,
    groups: Groups = "inferred",
    append: bool = False,
    skip_existing: bool = False,
    runner: Runner | None = None,
    layout: str = "pixels",
    quality: int | None = None,
    options: WriteOptions | None = None,
) -> IngestResult | dict[str, IngestResult]:
    """Ingest a folder of images into a store at ``output`` (a ``.b2nd`` path).

    ``options`` (:class:`~carraystore.store.options.WriteOptions`) holds the write options (codec,
    chunk_images, class_names, attrs, overwrite, lock_timeout, storage_options, tmp_dir,
    progress) in one value; the same keywords still work, and one that contradicts
    ``options`` is an InvalidInputError.

    With ``split_dirs=True``, every sub-folder of ``directory`` (train/, validation/, ...)
    becomes its own store ``output/<split>.b2nd`` with one shared list of class names;
    the result is then a dict split -> IngestResult.

    ``labels``: ``"inferred"`` (class sub-folders), None, or one value per file in sorted
    path order. Integers are class labels. Floats, or vectors (one row per file), are a
    regression **target**, never cast to classes: they become the field ``"target"`` (the
    store is then unlabelled; load it with ``targets="target"``, docs/targets.md).

    ``targets``: a manifest (CSV or JSON lines) of per-file fields keyed by the path
    relative to ``directory`` (a column ``file`` or ``path``); every other column becomes a
    field (``store.columns``): whole numbers int64, other numbers float64, JSON arrays
    vectors. Every image file must have a row and every row a file, or
    :class:`~carraystore.base.errors.ManifestError` names them (see ``carraystore.ingest.manifest``).
    With ``split_dirs`` the rows are keyed relative to ``directory`` too (``train/cat/1.jpg``).

    ``image_size=None`` keeps the files' own size (they must all agree); ``keep_order=True``
    (or ``shuffle=False``) writes files in natural path order (``frame_2`` before
    ``frame_10``; a note says so when names lack leading zeros), e.g. for video frames.
    ``workers`` decoding threads (default: all cores; 1 decodes in the calling thread).
    ``codec`` is a Codec or a preset name (``fast``, ``balanced``, ``small``).
    ``color_mode`` (default ``"rgb"``), ``interpolation`` (default ``"bilinear"``) and
    ``crop_to_aspect_ratio`` (default False) as in Keras.
    ``dtype`` is ``"uint8"`` (the default; 16-bit files keep their high byte) or ``"uint16"`` (16-bit grayscale
    kept exactly, 8-bit files scaled by 257, 16-bit colour PNGs refused): see ``images.decode_image``.
    File names that cannot be keys (not UTF-8, newline) and files that are not regular files
    follow ``on_error`` like undecodable ones.

    ``groups`` (videos, sessions, patients: items that belong together) are recorded in the
    store (``Store.groups``, ``Store.group_names``): ``"inferred"`` (default) takes the folder
    below each class folder (``walk/video_0001/frame_1.jpg``: class ``walk``, group
    ``walk/video_0001``; plain class folders have no groups); or one value per file in
    sorted path order, a mapping relative path -> group, a function of the relative path,
    or None. Validation splits keep groups whole, clips never cross one.

    With ``on_error="skip"`` files that do not decode are skipped and listed, but when more
    than ``max_skipped`` of them fail (a fraction below 1, default 0.01 = 1%, or a count of
    files) the ingest stops and writes nothing. A folder whose sub-folders look like splits
    (train/ and validation/, ...) is refused unless ``split_dirs=True`` (one store per
    split) or ``allow_split_names=True`` (they really are classes).

    ``validation_split`` and ``subset`` work as in ``image_dataset_from_directory``: the
    same ``seed`` puts the same files in the validation set as Keras does (the last
    ``int(validation_split * n)`` of the sorted list shuffled with that seed; with
    ``keep_order`` the last files in path order). With groups, whole groups are drawn
    instead (seeded, class by class), the share reached and the class coverage are noted,
    and :class:`~carraystore.base.errors.GroupSplitError` says when a part would be empty.
    ``subset="training"`` or ``"validation"`` writes that part to ``output``;
    ``subset="both"`` writes both in one call, ``output/training.b2nd`` and
    ``output/validation.b2nd``, and returns a dict.
    ``lock_timeout``: seconds to wait while another writer holds the output store (None:
    for ever); then :class:`~carraystore.base.errors.StoreLockedError` names the holder.

    ``append=True`` adds the folder's images to the existing store ``output``, in place,
    crash-safe and locked as ``carraystore.append``: the decode options come from the
    store (an image_size, color_mode, dtype, interpolation that differs is refused by
    name), new classes are added after the store's (existing ones keep their label), and
    files whose key is already in the store are refused, or left out with
    ``skip_existing=True``. A store written in order stays in order.

    ``output`` may be a URL (``s3://bucket/train.b2nd``; with ``split_dirs`` a prefix
    ``s3://bucket/data`` that receives ``<split>.b2nd`` objects): each store is written in a
    staging folder under ``tmp_dir`` (default ``TMPDIR``) and uploaded when complete.

    ``layout="encoded"`` keeps each image as an encoded file (FORMAT.md 10): a file's own
    bytes when it is a JPEG, PNG or WebP that decodes to exactly the pixels the default
    ``layout="pixels"`` would store (no resize, no colour change), else those pixels
    encoded once as PNG (lossless), or as JPEG at ``quality`` (then every image is).

    ``runner`` decodes and writes each planned store (a :class:`StoreJob`): by default
    :func:`run_locally`, in ``workers`` local threads. ``carraystore.dask.from_directory``
    (and ``carraystore.from_directory(..., client=)``) passes one that decodes on a
    ``dask.distributed`` cluster.
    """
    wopts = WriteOptions.merged(
        options,
        str(output),
        codec=codec,
        chunk_images=chunk_images,
        class_names=class_names,
        attrs=attrs,
        overwrite=overwrite,
        lock_timeout=lock_timeout,
        storage_options=storage_options,
        tmp_dir=tmp_dir,
        progress=progress,
    )
    codec, chunk_images, overwrite = wopts.codec, wopts.chunk_images, wopts.overwrite
    class_names = list(wopts.class_names) if wopts.class_names is not None else None
    attrs = dict(wopts.attrs) if wopts.attrs is not None else None
    storage_options = dict(wopts.storage_options) if wopts.storage_options is not None else None
    lock_timeout, tmp_dir, progress = wopts.lock_timeout, wopts.tmp_dir, wopts.progress
    root = Path(directory)
    size = _check_options(color_mode or "rgb", image_size, interpolation or "bilinear", on_error)
    target_values = _float_labels(labels)
    table = read_manifest(targets) if targets is not None else None
    if table is not None and table.groups is not None:  # the manifest's "group" column
        if not (isinstance(groups, str) and groups == "inferred"):
            raise InvalidInputError(
                f"{targets}: the manifest's 'group' column and groups= both give the files' groups; give one"
            )
        if split_dirs:
            raise InvalidInputError(
                f"{targets}: a 'group' column with split_dirs is not supported yet; groups come from the folders there"
            )
        groups = table.group_of()
    if append and (table is not None or target_values is not None):
        raise InvalidInputError(
            f"{output}: append=True with per-file targets (a manifest, or float labels) is not supported yet; "
            "ingest the new files into a store of their own, or append with carraystore.append(..., columns=)"
        )
    if dtype is not None and dtype not in INGEST_DTYPES:
        raise InvalidInputError(f"dtype must be one of {INGEST_DTYPES}, got {dtype!r}")
    if skip_existing and not append:
        raise InvalidInputError("skip_existing applies to append=True (CLI: --skip-existing with --append)")
    if append:
        _check_append_args(output, overwrite, split_dirs, subset, chunk_images, attrs)
        if layout != "pixels" or quality is not None:
            raise InvalidInputError(
                f"{output}: append=True keeps the store's own layout and encoding; leave layout and quality out"
            )
        return _append_directory(
            root,
            output,
            size=size,
            labels=labels,
            class_names=class_names,
            interpolation=interpolation,
            color_mode=color_mode,
            crop_to_aspect_ratio=crop_to_aspect_ratio,
            dtype=dtype,
            shuffle=shuffle and not keep_order,
            seed=seed,
            workers=workers,
            on_error=on_error,
            codec=codec,
            follow_links=follow_links,
            progress=progress,
            max_skipped=max_skipped,
            lock_timeout=lock_timeout,
            storage_options=storage_options,
            tmp_dir=tmp_dir,
            groups=groups,
            skip_existing=skip_existing,
            runner=runner,
        )
    interpolation = interpolation or "bilinear"
    color_mode = color_mode or "rgb"
    crop_to_aspect_ratio = bool(crop_to_aspect_ratio)
    dtype = dtype or "uint8"
    opts = DecodeOptions(color_mode, size, interpolation, crop_to_aspect_ratio, dtype)
    if workers is None:
        workers = os.cpu_count() or 1
    if layout not in ("pixels", "encoded"):
        raise InvalidInputError(f"layout must be 'pixels' or 'encoded', got {layout!r}")
    if layout == "encoded" and dtype not in (None, "uint8"):
        raise InvalidInputError("layout='encoded' holds uint8 images; leave dtype at 'uint8'")
    if quality is not None and layout != "encoded":
        raise InvalidInputError("quality= applies to layout='encoded' only")
    Encoding.for_quality(quality)  # checks the quality
    shuffle = shuffle and not keep_order
    common: dict[str, Any] = dict(
        shuffle=shuffle,
        seed=seed,
        workers=workers,
        on_error=on_error,
        codec=codec,
        chunk_images=chunk_images,
        overwrite=overwrite,
        progress=progress,
        attrs=attrs,
        max_skipped=max_skipped,
        lock_timeout=lock_timeout,
        storage_options=storage_options,
        tmp_dir=tmp_dir,
        runner=runner,
        class_folders=labels == "inferred",
        layout=layout,
        quality=quality,
    )

    def provenance(src_name: str) -> dict[str, Any]:
        return {
            "source": src_name,  # a folder name, never an absolute path
            "source_kind": "image_folder",
            "labels": "inferred"
            if isinstance(labels, str) and labels == "inferred"
            else (
                "none" if labels is None else "given" if target_values is None else f"given as field {TARGET_FIELD!r}"
            ),
            "image_size": list(size) if size else None,
            "interpolation": interpolation,
            "resize_library": f"Pillow {PIL.__version__}" if size else None,
            "crop_to_aspect_ratio": bool(crop_to_aspect_ratio),
            "color_mode": color_mode,
            "dtype": dtype,
            "bit_depth": DEPTH_RULE[dtype],
            "shuffled": shuffle,
            "seed": seed if shuffle else None,
        } | ({"targets": Path(targets).name} if targets is not None else {})

    remote = is_url(output)
    if (validation_split is None) != (subset is None):
        raise InvalidInputError(
            "validation_split and subset go together (as in Keras): e.g. validation_split=0.2, subset='both' "
            "(CLI: --validation-split 0.2 --subset both)"
        )
    if subset is not None and subset not in ("training", "validation", "both"):
        raise InvalidInputError(f"subset must be 'training', 'validation' or 'both', got {subset!r}")
    if subset is not None and split_dirs:
        raise InvalidInputError(
            "split_dirs already gives one store per split folder; leave out validation_split and subset"
        )
    if not split_dirs:
        out = str(output) if remote else Path(output)
        allowed_skips(max_skipped, 1)  # a bad value fails before any work
        if (
            root.is_dir()
            and not allow_split_names
            and (labels is None or isinstance(labels, str) and labels == "inferred")
            and class_names is None
        ):
            splits = split_like_folders(root)
            if splits:
                raise IngestError(
                    f"{root}: its sub-folders {', '.join(s + '/' for s in splits)} look like dataset splits, not classes; "
                    f"ingesting them as one store would make the classes {', '.join(splits)} and mix the splits. "
                    f"Pass split_dirs=True (CLI: --split-dirs) for one store per split, or ingest one split "
                    f"(e.g. {root / splits[0]}); if they really are classes pass allow_split_names=True "
                    "(CLI: --allow-split-names)"
                )
        int_labels = None if target_values is not None else labels
        rels, labs, names, ignored = list_images(root, int_labels, class_names, follow_links)  # type: ignore[arg-type]
        fields = _fields_for(root, rels, target_values, table)
        grp = infer_groups(rels, int_labels, groups, root)
        if subset is None:
            return _ingest_one(
                root,
                out,
                rels,
                labs,
                names,
                ignored,
                opts,
                provenance=provenance(root.name),
                fields=fields,
                groups=grp,
                **common,
            )
        if not rels:
            raise IngestError(f"{root}: no image files found (looked for {', '.join(IMAGE_EXTENSIONS)})")
        split_notes: list[str] = []
        if grp is not None:
            train_idx, val_idx, split_notes = group_split_indices(grp, labs, validation_split, seed)  # type: ignore[arg-type]
        else:
            train_idx, val_idx = validation_split_indices(len(rels), validation_split, shuffle, seed)  # type: ignore[arg-type]
        parts = {"training": train_idx, "validation": val_idx}
        wanted = ("training", "validation") if subset == "both" else (subset,)
        if subset == "both":
            if str(out).rstrip("/").endswith(".b2nd"):
                raise InvalidInputError(
                    f"{out}: with subset='both' the output is a folder that receives training.b2nd and validation.b2nd"
                )
            if not remote:
                _output_folder(Path(out))
        results: dict[str, IngestResult] = {}
        for part in wanted:
            idx = parts[part]
            prov = provenance(root.name) | {
                "validation_split": validation_split,
                "subset": part,
                "split_seed": seed if shuffle or grp is not None else None,
            }
            if grp is not None:
                prov["split_by"] = "groups"
                prov["validation_share"] = round(len(val_idx) / len(rels), 6)
            results[part] = _ingest_one(
                root,
                (f"{str(out).rstrip('/')}/{part}.b2nd" if remote else Path(out) / f"{part}.b2nd")
                if subset == "both"
                else out,
                [rels[i] for i in idx],
                labs[idx] if labs is not None else None,
                names,
                ignored,
                opts,
                provenance=prov,
                fields=fields,
                groups=[grp[i] for i in idx] if grp is not None else None,
                notes=split_notes,
                **common,
            )
        return results if subset == "both" else results[subset]

    if not root.is_dir():
        raise IngestError(f"{root}: not a folder")
    splits = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not splits:
        raise IngestError(f"{root}: --split-dirs expects split sub-folders such as train/ and validation/")
    if not (labels is None or (isinstance(labels, str) and labels == "inferred")):
        raise InvalidInputError(
            "with split_dirs, labels must be 'inferred' or None (per-file values: a manifest, targets=FILE)"
        )
    if str(output).rstrip("/").endswith(".b2nd"):
        raise InvalidInputError(f"{output}: with split_dirs the output is a folder that receives <split>.b2nd files")
    if not remote:
        _output_folder(Path(output))

    def split_output(split: str) -> Path | str:
        return f"{str(output).rstrip('/')}/{split}.b2nd" if remote else Path(output) / f"{split}.b2nd"

    names_all: tuple[str, ...] | None = None
    if labels == "inferred":
        if class_names is not None:
            names_all = tuple(class_names)
        else:
            names_all = tuple(
                sorted(
                    {d.name for s in splits for d in (root / s).iterdir() if d.is_dir() and not d.name.startswith(".")}
                )
            )
    listed: dict[str, tuple[list[str], np.ndarray | None, tuple[str, ...] | None, list[str], Any]] = {}
    for split in splits:
        src = root / split
        if labels == "inferred":
            present = [c for c in names_all or () if (src / c).is_dir()]
            rels, _, _, ignored = list_images(src, "inferred", present, follow_links)
            # labels index the shared class list, not the split's own
            class_index = {c: i for i, c in enumerate(names_all or ())}
            labs = np.asarray([class_index[r.split("/", 1)[0]] for r in rels], dtype=np.int64)
            names = names_all
        else:
            rels, labs, names, ignored = list_images(src, None, None, follow_links)
        # the user's split folders are the splits: left as they are, groups recorded inside each
        grp = infer_groups(rels, labels, groups if isinstance(groups, str) or groups is None else None, src)
        listed[split] = (rels, labs, names, ignored, grp)
    if table is not None:  # rows keyed relative to the top folder: every split's files at once
        table.check_files([f"{split}/{r}" for split, (rels, *_) in listed.items() for r in rels], str(root))
    results = {}
    for split, (rels, labs, names, ignored, grp) in listed.items():
        results[split] = _ingest_one(
            root / split,
            split_output(split),
            rels,
            labs,
            names,
            ignored,
            opts,
            provenance=provenance(f"{root.name}/{split}"),
            fields=table.under(split) if table is not None else None,
            groups=grp,
            **common,
        )
    return results


def _check_append_args(
    output: Any, overwrite: bool, split_dirs: bool, subset: str | None, chunk_images: int | None, attrs: Any
) -> None:
    """Arguments that an append cannot take, refused by name."""
    if overwrite:
        raise InvalidInputError(f"{output}: append=True adds to the store and overwrite=True replaces it; choose one")
    if split_dirs or subset is not None:
        raise InvalidInputError(
            f"{output}: append=True adds one folder to one store; leave out split_dirs / validation_split and subset "
            "(append each split's folder to its own store)"
        )
    if chunk_images is not None or attrs is not None:
        raise InvalidInputError(
            f"{output}: an append keeps the store's chunk size and attrs; leave chunk_images and attrs out "
            "(attrs change with update_metadata, CLI: carraystore meta)"
        )


def _append_directory(
    root: Path,
    output: str | os.PathLike[str],
    *,
    size: tuple[int, int] | None,
    labels: Any,
    class_names: Sequence[str] | None,
    interpolation: str | None,
    color_mode: str | None,
    crop_to_aspect_ratio: bool | None,
    dtype: str | None,
    shuffle: bool,
    seed: int,
    workers: int | None,
    on_error: str,
    codec: Codec | str | None,
    follow_links: bool,
    progress: bool,
    max_skipped: float | int,
    lock_timeout: float | None,
    storage_options: dict[str, Any] | None,
    tmp_dir: Any,
    groups: Groups,
    skip_existing: bool,
    runner: Runner | None,
) -> IngestResult:
    """``from_directory(..., append=True)``: plan under the store's writer lock, then decode and append."""
    allowed_skips(max_skipped, 1)
    out = str(output) if is_url(output) else Path(output)
    rels, labs, names, ignored = list_images(root, labels, class_names, follow_links)
    grp = infer_groups(rels, labels, groups, root)
    options = WriteOptions(codec=codec) if codec is not None else None
    writer = open_append(
        out, nthreads=1, lock_timeout=lock_timeout, storage_options=storage_options, tmp_dir=tmp_dir, options=options
    )
    try:
        meta = writer.meta
        opts = _store_decode_options(meta, str(out), size, color_mode, interpolation, crop_to_aspect_ratio, dtype)
        rels, labs, grp, notes = _append_plan(
            writer, root, rels, labs, names, grp, not isinstance(groups, str) and groups is not None, skip_existing
        )
        if meta.provenance.get("shuffled") is False:
            shuffle = False  # a store written in order (video frames) stays in order
        if not rels:
            writer.close()  # nothing new: the store is left as it was
            return IngestResult(
                path=out,
                nimages=0,
                image_shape=meta.image_shape,
                class_names=meta.class_names,
                ignored=ignored,
                notes=notes,
                total=meta.nimages,
            )
        return _ingest_one(
            root,
            out,
            rels,
            labs,
            writer.meta.class_names,
            ignored,
            opts,
            shuffle=shuffle,
            seed=seed,
            workers=workers if workers is not None else os.cpu_count() or 1,
            on_error=on_error,
            codec=None,
            chunk_images=None,
            overwrite=False,
            progress=progress,
            lock_timeout=lock_timeout,
            attrs=None,
            provenance={},
            max_skipped=max_skipped,
            runner=runner,
            groups=grp,
            appender=writer,
            notes=notes,
            class_folders=labels == "inferred",
        )
    except BaseException:
        writer.abort()
        raise
