"""Ingest: turn a folder of image files into a store, as ``keras.utils.image_dataset_from_directory`` reads it.

:func:`from_directory` checks its arguments, plans the stores (``ingest.plan``, or
``ingest.append``) and runs each :class:`StoreJob` through a runner: :func:`run_locally`
(decoding threads) or a ``dask.distributed`` cluster (``ingest.cluster``).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import PIL

from carraystore.base.errors import InvalidInputError
from carraystore.format.encoded import Encoding, entry_for_pixels, source_entry
from carraystore.ingest.append import check_append_args, plan_append
from carraystore.ingest.badfiles import DEFAULT_MAX_SKIPPED, shape_error
from carraystore.ingest.cluster import run_on_cluster
from carraystore.ingest.decodepool import decoded
from carraystore.ingest.images import DECODE_OPTION_FIELDS, DEPTH_RULE, MODES, DecodeKwargs, DecodeOptions
from carraystore.ingest.job import IngestResult, Runner, StoreJob
from carraystore.ingest.plan import Groups, plan_folder
from carraystore.store.options import WriteKwargs, WriteOptions
from carraystore.store.writer import StoreWriter

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["IngestResult", "StoreJob", "Runner", "run_locally", "from_directory", "IngestKwargs"]


class IngestKwargs(WriteKwargs, DecodeKwargs, total=False):
    """``from_directory``'s option keywords: the write options (:class:`WriteKwargs`) and the decode options (:class:`DecodeKwargs`)."""


def from_directory(
    directory: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    labels: str | Sequence[int] | Sequence[float] | np.ndarray | None = "inferred",
    targets: str | os.PathLike[str] | None = None,
    groups: Groups = "inferred",
    layout: str | None = None,
    quality: int | None = None,
    shuffle: bool = True,
    seed: int = 0,
    keep_order: bool = False,
    split_dirs: bool = False,
    allow_split_names: bool = False,
    validation_split: float | None = None,
    subset: str | None = None,
    follow_links: bool = False,
    on_error: str = "fail",
    max_skipped: float | int = DEFAULT_MAX_SKIPPED,
    append: bool = False,
    skip_existing: bool = False,
    workers: int | None = None,
    client: Any = None,
    runner: Runner | None = None,
    options: WriteOptions | None = None,
    **kw: Unpack[IngestKwargs],
) -> IngestResult | dict[str, IngestResult]:
    """Ingest a folder of images into a store at ``output`` (a ``.b2nd`` path or URL); returns an IngestResult.

    Keys are paths relative to the folder.

    ``labels``: ``"inferred"`` (class sub-folders, sorted, or ``class_names`` in label order),
    None, or one value per file in sorted path order: integers are class labels; floats or
    vectors become the field ``"target"`` (docs/targets.md). ``targets``: a CSV or JSON-lines
    manifest of per-file fields keyed by relative path (column ``file`` or ``path``; ``group``
    gives groups); every file needs a row and every row a file, else
    :class:`~carraystore.base.errors.ManifestError`. ``groups`` (items that belong together):
    ``"inferred"`` (the folder below each class folder), one value per file, a mapping
    path -> group, a function of the path, or None. Splits keep groups whole; clips never cross one.

    ``image_size`` (None: the files' own size, which must agree), ``color_mode``,
    ``interpolation`` and ``crop_to_aspect_ratio`` work as in Keras; ``dtype`` ``"uint8"`` or
    ``"uint16"`` (16-bit grayscale kept exactly). ``layout="encoded"`` keeps each file's own
    bytes where they decode to the same pixels, else encodes PNG, or JPEG at ``quality`` (FORMAT.md 10);
    None: ``"pixels"``, or an appended-to store's own layout.

    Files are written in a seeded random order unless ``shuffle=False`` or ``keep_order=True``
    (natural path order: ``frame_2`` before ``frame_10``). ``split_dirs=True`` writes one store
    per sub-folder (``output/<split>.b2nd``); split-like sub-folders are refused otherwise
    unless ``allow_split_names=True``. ``validation_split`` with ``subset`` (``"training"``,
    ``"validation"`` or ``"both"``) picks the files Keras picks with the same ``seed``, or whole
    groups (:class:`~carraystore.base.errors.GroupSplitError` when a part would be empty).
    Several stores come back as a dict name -> IngestResult.

    ``on_error="skip"`` skips and lists undecodable files (or names that cannot be keys),
    writing nothing when more than ``max_skipped`` fail (a fraction below 1 or a count).
    ``append=True`` adds the folder to the store ``output`` in place (locked, crash-safe),
    with the store's decode options, layout and encoding; ``targets``/float ``labels`` give the new
    files' fields (the store's own); files already in it are refused, or left out with
    ``skip_existing=True``.

    Write options come as keywords or ``options`` (:class:`~carraystore.store.options.WriteOptions`).
    ``workers``: decoding threads (default: all cores). ``client`` (``dask.distributed``)
    decodes on its cluster, the files at the same path on every worker (docs/dask.md);
    ``runner`` runs each planned :class:`~carraystore.ingest.job.StoreJob` some other way.
    """
    keywords: dict[str, Any] = dict(kw)
    write = {k: v for k, v in keywords.items() if k not in DECODE_OPTION_FIELDS}
    wopts = WriteOptions.merged(options, str(output), **write)
    # the decode options given, checked; an append takes those left out (None) from the store
    decode = {k: v for k, v in keywords.items() if k in DECODE_OPTION_FIELDS and v is not None}
    opts = DecodeOptions(**decode)
    if on_error not in ("fail", "skip"):
        raise InvalidInputError(f"on_error must be 'fail' or 'skip', got {on_error!r}")
    if skip_existing and not append:
        raise InvalidInputError("skip_existing applies to append=True (CLI: --skip-existing with --append)")
    if runner is None:
        runner = functools.partial(run_on_cluster, client) if client is not None else run_locally
    workers = workers if workers is not None else os.cpu_count() or 1
    shuffle = shuffle and not keep_order
    run: dict[str, Any] = dict(workers=workers, on_error=on_error, max_skipped=max_skipped)
    if layout is not None and layout not in ("pixels", "encoded"):
        raise InvalidInputError(f"layout must be 'pixels' or 'encoded', got {layout!r}")
    if append:
        check_append_args(output, wopts.overwrite, split_dirs, subset, wopts.chunk_images, wopts.attrs)
        given = {f: decode.get(f) for f in DECODE_OPTION_FIELDS} | {"image_size": opts.image_size}
        plan, writer, opts = plan_append(
            directory,
            output,
            wopts,
            given,
            labels=labels,
            targets=targets,
            layout=layout,
            quality=quality,
            groups=groups,
            skip_existing=skip_existing,
            shuffle=shuffle,
            seed=seed,
            follow_links=follow_links,
            on_error=on_error,
            max_skipped=max_skipped,
        )
        if not plan.rels:  # nothing new: the store is left as it was
            writer.close()
            meta = writer.meta
            return IngestResult(
                path=plan.output,
                nimages=0,
                image_shape=meta.image_shape,
                class_names=meta.class_names,
                ignored=plan.ignored,
                notes=plan.notes,
                total=meta.nimages,
            )
        try:
            return runner(StoreJob(plan, opts, wopts, appender=writer, **run))
        except BaseException:
            writer.abort()  # a runner that failed before writing leaves the lock to no one
            raise
    size = opts.image_size
    layout = layout or "pixels"
    if layout == "encoded" and opts.dtype != "uint8":
        raise InvalidInputError("layout='encoded' holds uint8 images; leave dtype at 'uint8'")
    if quality is not None and layout != "encoded":
        raise InvalidInputError("quality= applies to layout='encoded' only")
    encoding = Encoding.for_quality(quality)  # checks the quality
    plans = plan_folder(
        directory,
        output,
        labels=labels,
        class_names=wopts.class_names,
        targets=targets,
        groups=groups,
        shuffle=shuffle,
        seed=seed,
        follow_links=follow_links,
        split_dirs=split_dirs,
        allow_split_names=allow_split_names,
        validation_split=validation_split,
        subset=subset,
        on_error=on_error,
        max_skipped=max_skipped,
        decoding={
            "image_size": list(size) if size else None,
            "interpolation": opts.interpolation,
            "resize_library": f"Pillow {PIL.__version__}" if size else None,
            "crop_to_aspect_ratio": opts.crop_to_aspect_ratio,
            "color_mode": opts.color_mode,
            "dtype": opts.dtype,
            "bit_depth": DEPTH_RULE[opts.dtype],
        },
    )
    enc = encoding if layout == "encoded" else None
    results = {name: runner(StoreJob(plan, opts, wopts, encoding=enc, **run)) for name, plan in plans.items()}
    return results if split_dirs or subset == "both" else next(iter(results.values()))


def run_locally(job: StoreJob) -> IngestResult:
    """The default runner: decode in ``job.workers`` local threads (``decodepool``), write in order."""
    plan, opts, bad = job.plan, job.opts, job.bad
    labels, groups = plan.labels, plan.groups
    _, channels = MODES[opts.color_mode]
    writer: StoreWriter | None = None
    first_shape: tuple[int, ...] | None = None
    first_rel = ""
    batch_imgs: list[np.ndarray] = []
    batch_labels: list[int] = []
    batch_keys: list[str] = []
    batch_groups: list[str] = []

    def flush() -> None:
        assert writer is not None
        if not batch_imgs:
            return
        per_item: dict[str, Any] = dict(
            labels=np.asarray(batch_labels, dtype=np.int64) if labels is not None else None,
            keys=list(batch_keys),
            columns=plan.columns_for(batch_keys),
            groups=list(batch_groups) if groups is not None else None,
        )
        if writer.meta.layout == "encoded":  # the files' own bytes where they decode to these pixels
            writer.append_entries(_entries(job, batch_keys, batch_imgs, writer.meta.encoding), **per_item)
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
        for pos, (rel, arr, err) in enumerate(decoded(plan.root, plan.rels, opts, job.workers)):
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


def _entries(job: StoreJob, rels: list[str], pixels: list[np.ndarray], encoding: Encoding | None) -> list[bytes]:
    """Layout "encoded": a file's own bytes if they decode to its pixels, else the pinned format (FORMAT.md 10.3)."""
    assert encoding is not None
    out = []
    counts = job.entry_counts
    for rel, arr in zip(rels, pixels, strict=True):
        kept = None
        path = job.plan.root / rel
        if encoding.quality is None:  # a quality asks for every image to be encoded at it
            try:
                data = path.read_bytes()
            except OSError:
                data = b""
            job.source_bytes += len(data)
            kept = source_entry(data, arr, job.opts.color_mode)
        else:  # the file's size is all the report needs: not read again
            with contextlib.suppress(OSError):
                job.source_bytes += path.stat().st_size
        if kept is not None:
            counts["kept"] = counts.get("kept", 0) + 1
            out.append(kept)
            continue
        entry = entry_for_pixels(arr, encoding)
        how = "raw" if len(entry) == arr.nbytes else encoding.reencode
        counts[how] = counts.get(how, 0) + 1
        out.append(entry)
    return out
