"""Ingest: turn a folder of image files into a store (the main job).

Follows the conventions of ``keras.utils.image_dataset_from_directory``: labels inferred
from class sub-folders (sorted names), ``class_names``, ``image_size``, ``color_mode``,
``interpolation``, ``crop_to_aspect_ratio``, ``follow_links``. Files are decoded in
parallel processes and written in a seeded random order (so every chunk mixes classes)
unless ``shuffle=False``. Keys are each image's path relative to the folder.

This module plans (which stores, which files in which order, the write arguments) and
writes with local decoding processes; finding and decoding images is ``carraystore.images``,
the processes ``carraystore.decodepool``, the bad-file policy ``carraystore.badfiles``.
A ``runner`` decodes and writes each planned store elsewhere: ``carraystore.dask`` passes
one that decodes on a ``dask.distributed`` cluster.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from carraystore.badfiles import DEFAULT_MAX_SKIPPED, BadFiles, allowed_skips, drop_bad_names, shape_error
from carraystore.codec import Codec
from carraystore.decodepool import decoded
from carraystore.encoded import Encoding, entry_for_pixels, source_entry
from carraystore.errors import IngestError, InvalidInputError
from carraystore.images import (
    DEPTH_RULE,
    IMAGE_EXTENSIONS,
    INGEST_DTYPES,
    INTERPOLATIONS,
    MODES,
    DecodeOptions,
    list_images,
    shown_name,
)
from carraystore.reader import is_url
from carraystore.writer import StoreWriter, create

__all__ = [
    "IngestResult",
    "StoreJob",
    "Runner",
    "run_locally",
    "split_like_folders",
    "validation_split_indices",
    "SPLIT_NAMES",
    "from_directory",
]

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

    @property
    def images_per_s(self) -> float:
        return self.nimages / self.seconds if self.seconds > 0 else float("nan")

    def summary(self) -> str:
        ratio = self.nbytes / self.cbytes if self.cbytes else float("nan")
        lines = [
            f"wrote {self.path}: {self.nimages} images of {'x'.join(map(str, self.image_shape))} "
            f"in {self.seconds:.1f} s ({self.images_per_s:.0f} images/s); "
            f"{self.nbytes / 1e6:.1f} MB -> {self.cbytes / 1e6:.1f} MB (ratio {ratio:.2f})"
        ]
        if self.class_names is not None:
            lines.append(f"  classes: {', '.join(self.class_names)}")
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

    def open_writer(self, shape: tuple[int, ...]) -> StoreWriter:
        """The store's writer, with one blosc2 thread, so that a chunk's blocks are in order and the same
        ingest always gives the same bytes (blosc2's threads place blocks as they finish)."""
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
        n = writer.nimages
        return IngestResult(
            path=self.output,
            nimages=n,
            image_shape=shape,
            class_names=self.class_names,
            skipped=self.bad.skipped,
            ignored=self.ignored,
            seconds=time.perf_counter() - self.t0,
            nbytes=n * int(np.prod(shape)) * np.dtype(self.opts.dtype).itemsize,
            cbytes=writer.file_size or 0,
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
    if (
        not isinstance(validation_split, (int, float))
        or isinstance(validation_split, bool)
        or not 0 < validation_split < 1
    ):
        raise InvalidInputError(f"validation_split must be a fraction between 0 and 1, got {validation_split!r}")
    n_val = int(validation_split * n)
    if n_val == 0 or n_val == n:
        raise IngestError(
            f"validation_split={validation_split} of {n} files leaves {'no file for validation' if n_val == 0 else 'no file for training'}"
        )
    order = np.arange(n)
    if shuffle:
        np.random.RandomState(seed).shuffle(order)
    return np.sort(order[: n - n_val]), np.sort(order[n - n_val :])


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
    return size  # type: ignore[return-value]


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
    layout: str = "pixels",
    quality: int | None = None,
) -> IngestResult:
    """Plan one store (bad names dropped, the write order, the write arguments) and run it."""
    if not rels:
        raise IngestError(f"{root}: no image files found (looked for {', '.join(IMAGE_EXTENSIONS)})")
    allowed = allowed_skips(max_skipped, len(rels))
    t0 = time.perf_counter()
    rels, labels, skipped = drop_bad_names(root, rels, labels, on_error)
    order = np.random.default_rng(seed).permutation(len(rels)) if shuffle else np.arange(len(rels))
    rels = [rels[i] for i in order]
    if labels is not None:
        labels = labels[order]
    bad = BadFiles(root, len(rels), on_error, max_skipped, allowed, skipped)
    write = dict(
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
    job = StoreJob(root, output, rels, labels, class_names, ignored, opts, bad, write, workers, progress, t0)
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

    def flush() -> None:
        assert writer is not None
        if batch_imgs and writer.meta.layout == "encoded":
            writer.append_encoded(
                _entries(job, batch_keys, batch_imgs, writer.meta.encoding),
                labels=np.asarray(batch_labels, dtype=np.int64) if labels is not None else None,
                keys=list(batch_keys),
            )
            batch_imgs.clear()
            batch_labels.clear()
            batch_keys.clear()
        if batch_imgs:
            writer.append(
                np.stack(batch_imgs),
                labels=np.asarray(batch_labels, dtype=np.int64) if labels is not None else None,
                keys=list(batch_keys),
            )
            batch_imgs.clear()
            batch_labels.clear()
            batch_keys.clear()

    if opts.image_size is not None:
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


def from_directory(
    directory: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    labels: str | Sequence[int] | None = "inferred",
    class_names: Sequence[str] | None = None,
    image_size: tuple[int, int] | None = None,
    interpolation: str = "bilinear",
    color_mode: str = "rgb",
    crop_to_aspect_ratio: bool = False,
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
    dtype: str = "uint8",
    max_skipped: float | int = DEFAULT_MAX_SKIPPED,
    allow_split_names: bool = False,
    validation_split: float | None = None,
    subset: str | None = None,
    lock_timeout: float | None = 0.0,
    storage_options: dict[str, Any] | None = None,
    tmp_dir: str | os.PathLike[str] | None = None,
    runner: Runner | None = None,
    layout: str = "pixels",
    quality: int | None = None,
) -> IngestResult | dict[str, IngestResult]:
    """Ingest a folder of images into a store at ``output`` (a ``.b2nd`` path).

    With ``split_dirs=True``, every sub-folder of ``directory`` (train/, validation/, ...)
    becomes its own store ``output/<split>.b2nd`` with one shared list of class names;
    the result is then a dict split -> IngestResult.

    ``image_size=None`` keeps the files' own size (they must all agree); ``keep_order=True``
    (or ``shuffle=False``) writes files in sorted path order, e.g. for video frames.
    ``workers`` decoding processes (default: all cores; 1 decodes in this process).
    ``codec`` is a Codec or a preset name (``fast``, ``balanced``, ``small``).
    ``dtype`` is ``"uint8"`` (16-bit files keep their high byte) or ``"uint16"`` (16-bit grayscale
    kept exactly, 8-bit files scaled by 257, 16-bit colour PNGs refused): see ``images.decode_image``.
    File names that cannot be keys (not UTF-8, newline) and files that are not regular files
    follow ``on_error`` like undecodable ones.

    With ``on_error="skip"`` files that do not decode are skipped and listed, but when more
    than ``max_skipped`` of them fail (a fraction below 1, default 0.01 = 1%, or a count of
    files) the ingest stops and writes nothing. A folder whose sub-folders look like splits
    (train/ and validation/, ...) is refused unless ``split_dirs=True`` (one store per
    split) or ``allow_split_names=True`` (they really are classes).

    ``validation_split`` and ``subset`` work as in ``image_dataset_from_directory``: the
    same ``seed`` puts the same files in the validation set as Keras does (the last
    ``int(validation_split * n)`` of the sorted list shuffled with that seed; with
    ``keep_order`` the last files in path order). ``subset="training"`` or
    ``"validation"`` writes that part to ``output``; ``subset="both"`` writes both in one
    call, ``output/training.b2nd`` and ``output/validation.b2nd``, and returns a dict.
    ``lock_timeout``: seconds to wait while another writer holds the output store (None:
    for ever); then :class:`~carraystore.errors.StoreLockedError` names the holder.

    ``output`` may be a URL (``s3://bucket/train.b2nd``; with ``split_dirs`` a prefix
    ``s3://bucket/data`` that receives ``<split>.b2nd`` objects): each store is written in a
    staging folder under ``tmp_dir`` (default ``TMPDIR``) and uploaded when complete.

    ``layout="encoded"`` keeps each image as an encoded file (FORMAT.md 10): a file's own
    bytes when it is a JPEG, PNG or WebP that decodes to exactly the pixels the default
    ``layout="pixels"`` would store (no resize, no colour change), else those pixels
    encoded once as PNG (lossless), or as JPEG at ``quality`` (then every image is).

    ``runner`` decodes and writes each planned store (a :class:`StoreJob`): by default
    :func:`run_locally`, in ``workers`` local processes. ``carraystore.dask.from_directory``
    (and ``carraystore.from_directory(..., client=)``) passes one that decodes on a
    ``dask.distributed`` cluster.
    """
    root = Path(directory)
    size = _check_options(color_mode, image_size, interpolation, on_error)
    if dtype not in INGEST_DTYPES:
        raise InvalidInputError(f"dtype must be one of {INGEST_DTYPES}, got {dtype!r}")
    opts = DecodeOptions(color_mode, size, interpolation, bool(crop_to_aspect_ratio), dtype)
    if workers is None:
        workers = os.cpu_count() or 1
    if layout not in ("pixels", "encoded"):
        raise InvalidInputError(f"layout must be 'pixels' or 'encoded', got {layout!r}")
    if layout == "encoded" and dtype != "uint8":
        raise InvalidInputError("layout='encoded' holds uint8 images; leave dtype at 'uint8'")
    if quality is not None and layout != "encoded":
        raise InvalidInputError("quality= applies to layout='encoded' only")
    Encoding.for_quality(quality)  # checks the quality
    shuffle = shuffle and not keep_order
    common = dict(
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
        layout=layout,
        quality=quality,
    )

    def provenance(src_name: str) -> dict[str, Any]:
        return {
            "source": src_name,  # a folder name, never an absolute path
            "source_kind": "image_folder",
            "labels": "inferred" if labels == "inferred" else ("none" if labels is None else "given"),
            "image_size": list(size) if size else None,
            "interpolation": interpolation,
            "resize_library": f"Pillow {Image.__version__}" if size else None,
            "crop_to_aspect_ratio": bool(crop_to_aspect_ratio),
            "color_mode": color_mode,
            "dtype": dtype,
            "bit_depth": DEPTH_RULE[dtype],
            "shuffled": shuffle,
            "seed": seed if shuffle else None,
        }

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
        if root.is_dir() and not allow_split_names and labels in ("inferred", None) and class_names is None:
            splits = split_like_folders(root)
            if splits:
                raise IngestError(
                    f"{root}: its sub-folders {', '.join(s + '/' for s in splits)} look like dataset splits, not classes; "
                    f"ingesting them as one store would make the classes {', '.join(splits)} and mix the splits. "
                    f"Pass split_dirs=True (CLI: --split-dirs) for one store per split, or ingest one split "
                    f"(e.g. {root / splits[0]}); if they really are classes pass allow_split_names=True "
                    "(CLI: --allow-split-names)"
                )
        rels, labs, names, ignored = list_images(root, labels, class_names, follow_links)
        if subset is None:
            return _ingest_one(root, out, rels, labs, names, ignored, opts, provenance=provenance(root.name), **common)  # type: ignore[arg-type]
        if not rels:
            raise IngestError(f"{root}: no image files found (looked for {', '.join(IMAGE_EXTENSIONS)})")
        parts = dict(
            zip(
                ("training", "validation"),
                validation_split_indices(len(rels), validation_split, shuffle, seed),
                strict=True,
            )
        )  # type: ignore[arg-type]
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
                "split_seed": seed if shuffle else None,
            }
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
                **common,  # type: ignore[arg-type]
            )
        return results if subset == "both" else results[subset]

    if not root.is_dir():
        raise IngestError(f"{root}: not a folder")
    splits = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not splits:
        raise IngestError(f"{root}: --split-dirs expects split sub-folders such as train/ and validation/")
    if labels not in ("inferred", None):
        raise InvalidInputError("with split_dirs, labels must be 'inferred' or None")
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
    results: dict[str, IngestResult] = {}
    for split in splits:
        src = root / split
        if labels == "inferred":
            present = [c for c in names_all or () if (src / c).is_dir()]
            rels, _, _, ignored = list_images(src, "inferred", present, follow_links)
            # labels index the shared class list, not the split's own
            idx = {c: i for i, c in enumerate(names_all or ())}
            labs = np.asarray([idx[r.split("/", 1)[0]] for r in rels], dtype=np.int64)
            names = names_all
        else:
            rels, labs, names, ignored = list_images(src, None, None, follow_links)
        results[split] = _ingest_one(
            src,
            split_output(split),
            rels,
            labs,
            names,
            ignored,
            opts,
            provenance=provenance(f"{root.name}/{split}"),
            **common,  # type: ignore[arg-type]
        )
    return results
