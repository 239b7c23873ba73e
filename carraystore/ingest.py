"""Ingest: turn a folder of image files into a store (the main job).

Follows the conventions of ``keras.utils.image_dataset_from_directory``: labels inferred
from class sub-folders (sorted names), ``class_names``, ``image_size``, ``color_mode``,
``interpolation``, ``crop_to_aspect_ratio``, ``follow_links``. Files are decoded in
parallel processes and written in a seeded random order (so every chunk mixes classes)
unless ``shuffle=False``. Keys are each image's path relative to the folder.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import secrets
import sys
import time
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from carraystore.errors import CarrayStoreError, ImageDecodeError, IngestError, InvalidInputError
from carraystore.format import Codec
from carraystore.writer import StoreWriter, compress_chunk, create

__all__ = [
    "IMAGE_EXTENSIONS",
    "INTERPOLATIONS",
    "IngestResult",
    "DecodeOptions",
    "list_images",
    "decode_image",
    "from_directory",
]

#: File extensions read, as in Keras (case-insensitive).
IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png", ".bmp", ".gif")

#: Keras interpolation names that Pillow can do, and Pillow's filter for each.
INTERPOLATIONS = {
    "bilinear": Image.Resampling.BILINEAR,
    "nearest": Image.Resampling.NEAREST,
    "bicubic": Image.Resampling.BICUBIC,
    "area": Image.Resampling.BOX,
    "lanczos3": Image.Resampling.LANCZOS,
    "hamming": Image.Resampling.HAMMING,
}
_MODES = {"grayscale": ("L", 1), "rgb": ("RGB", 3), "rgba": ("RGBA", 4)}
_FILES_PER_TASK = 16


@dataclass(frozen=True)
class DecodeOptions:
    """How each file becomes an array (picklable: sent to worker processes)."""

    color_mode: str = "rgb"
    image_size: tuple[int, int] | None = None
    interpolation: str = "bilinear"
    crop_to_aspect_ratio: bool = False


@dataclass
class IngestResult:
    """What an ingest did: output path, counts, class names, skipped files, speed."""

    path: Path
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
            lines.append(f"  ignored {len(self.ignored)} file(s) that are not in a class folder or not images, e.g. {self.ignored[0]}")
        if self.skipped:
            lines.append(f"  skipped {len(self.skipped)} file(s) that could not be decoded:")
            lines.extend(f"    {p}: {r}" for p, r in self.skipped)
        return "\n".join(lines)


# -- listing ---------------------------------------------------------------------------------


def _walk_images(root: Path, follow_links: bool) -> tuple[list[Path], list[Path]]:
    """All image files under ``root`` (sorted) and the other files found (ignored)."""
    images, other = [], []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=follow_links):
        dirnames.sort()
        for name in sorted(filenames):
            p = Path(dirpath) / name
            (images if p.suffix.lower() in IMAGE_EXTENSIONS else other).append(p)
    return images, other


def list_images(
    directory: str | os.PathLike[str],
    labels: str | Sequence[int] | None = "inferred",
    class_names: Sequence[str] | None = None,
    follow_links: bool = False,
) -> tuple[list[str], np.ndarray | None, tuple[str, ...] | None, list[str]]:
    """Index a folder as Keras does: (relative paths, labels or None, class names, ignored files)."""
    root = Path(directory)
    if not root.is_dir():
        raise IngestError(f"{root}: not a folder of images")
    ignored: list[str] = []
    if labels == "inferred":
        subdirs = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
        if class_names is not None:
            missing = [c for c in class_names if c not in subdirs]
            if missing:
                raise IngestError(
                    f"{root}: class_names {list(class_names)} name folders that do not exist: {missing}; "
                    f"the sub-folders are {subdirs}"
                )
            names = tuple(class_names)
        else:
            names = tuple(subdirs)
        if not names:
            raise IngestError(f"{root}: no class sub-folders found; pass labels=None (CLI: --labels none) for an unlabelled folder")
        rels: list[str] = []
        labs: list[int] = []
        for i, cls in enumerate(names):
            files, other = _walk_images(root / cls, follow_links)
            rels.extend(p.relative_to(root).as_posix() for p in files)
            labs.extend([i] * len(files))
            ignored.extend(p.relative_to(root).as_posix() for p in other)
        ignored.extend(p.name for p in root.iterdir() if p.is_file())
        unlisted = sorted(set(subdirs) - set(names))
        ignored.extend(f"{d}/" for d in unlisted)
        return rels, np.asarray(labs, dtype=np.int64), names, ignored
    files, other = _walk_images(root, follow_links)
    rels = [p.relative_to(root).as_posix() for p in files]
    ignored.extend(p.relative_to(root).as_posix() for p in other)
    if labels is None:
        return rels, None, tuple(class_names) if class_names is not None else None, ignored
    if isinstance(labels, str):
        raise InvalidInputError(f"labels must be 'inferred', None or a list of integers, got {labels!r}")
    lab = np.asarray(labels, dtype=np.int64)
    if lab.shape != (len(rels),):
        raise IngestError(
            f"{root}: {len(lab)} labels given for {len(rels)} image files (labels follow the sorted file paths, as in Keras)"
        )
    return rels, lab, tuple(class_names) if class_names is not None else None, ignored


# -- decoding --------------------------------------------------------------------------------


def _crop_box(w: int, h: int, target_h: int, target_w: int) -> tuple[int, int, int, int]:
    """The largest centred window of the target aspect ratio (as Keras' crop_to_aspect_ratio)."""
    crop_h = min(h, int(round(w * target_h / target_w)))
    crop_w = min(w, int(round(h * target_w / target_h)))
    x = (w - crop_w) // 2
    y = (h - crop_h) // 2
    return x, y, x + crop_w, y + crop_h


def decode_image(path: str | os.PathLike[str], opts: DecodeOptions = DecodeOptions()) -> np.ndarray:
    """Decode one file into an (H, W, C) uint8 array; raise ImageDecodeError naming the file."""
    mode, channels = _MODES[opts.color_mode]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                img.load()
                img = img.convert(mode)
                if opts.image_size is not None:
                    h, w = opts.image_size
                    resample = INTERPOLATIONS[opts.interpolation]
                    box = _crop_box(img.width, img.height, h, w) if opts.crop_to_aspect_ratio else None
                    if (img.height, img.width) != (h, w) or box is not None:
                        img = img.resize((w, h), resample=resample, box=box)
                arr = np.asarray(img, dtype=np.uint8)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageDecodeError(f"{path}: refused as a decompression bomb ({exc})") from exc
    except FileNotFoundError as exc:
        raise ImageDecodeError(f"{path}: file not found") from exc
    except Exception as exc:  # PIL raises many types for bad data
        reason = str(exc) or type(exc).__name__
        if os.path.exists(path) and os.path.getsize(path) == 0:
            reason = "empty file"
        raise ImageDecodeError(f"{path}: cannot decode ({reason})") from exc
    if arr.ndim == 2:
        arr = arr[..., None]
    if arr.shape[2] != channels:  # pragma: no cover - Pillow's convert guarantees it
        raise ImageDecodeError(f"{path}: decoded to {arr.shape[2]} channels, expected {channels}")
    return arr


def _decode_task(root: str, rels: list[str], opts: DecodeOptions) -> list[tuple[np.ndarray | None, str | None]]:
    """Worker: decode several files; failures come back as reasons, not exceptions."""
    out: list[tuple[np.ndarray | None, str | None]] = []
    for rel in rels:
        try:
            out.append((decode_image(os.path.join(root, rel), opts), None))
        except ImageDecodeError as exc:
            msg = str(exc)
            prefix = f"{os.path.join(root, rel)}: "
            out.append((None, msg[len(prefix):] if msg.startswith(prefix) else msg))
    return out


def _shape_error(arr: np.ndarray | None, first_shape: tuple[int, ...] | None, first_rel: str) -> str | None:
    """Why a decoded image cannot join the store (its shape differs from the first one), or None."""
    if arr is None or first_shape is None or arr.shape == first_shape:
        return None
    return (
        f"decoded to {arr.shape[0]}x{arr.shape[1]}x{arr.shape[2]} but earlier images are "
        f"{'x'.join(map(str, first_shape))} (e.g. {first_rel}); pass image_size (CLI: --image-size H W) to resize"
    )


def _bad_file_error(root: Path, rel: str, err: str) -> IngestError:
    """The error of ``on_error='fail'`` for the first bad file."""
    return IngestError(
        f"{root / rel}: {err}. Fix or remove the file, or pass on_error='skip' (CLI: --on-error skip) "
        "to skip bad files (they are listed in the output and in the store's metadata)"
    )


def _exit_with_parent(main_pid: int) -> None:
    """Worker initializer: end this decoding process when the ingesting process is gone.

    A killed ingest (SIGKILL) cannot stop its pool; without this its forkserver and
    decoding processes would keep running.
    """
    import threading

    def watch() -> None:
        while True:
            time.sleep(0.25)
            try:
                os.kill(main_pid, 0)
            except ProcessLookupError:
                os._exit(1)
            except PermissionError:  # pragma: no cover - a reused pid of another user
                os._exit(1)

    threading.Thread(target=watch, name="carraystore-parent-watch", daemon=True).start()


def _decoded(
    root: Path, rels: list[str], opts: DecodeOptions, workers: int
) -> Iterator[tuple[str, np.ndarray | None, str | None]]:
    """Yield (rel, array or None, error or None) in the order of ``rels``; memory bounded."""
    tasks = [rels[i : i + _FILES_PER_TASK] for i in range(0, len(rels), _FILES_PER_TASK)]
    if workers <= 1:
        for t in tasks:
            for rel, (arr, err) in zip(t, _decode_task(str(root), t, opts)):
                yield rel, arr, err
        return
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    with cf.ProcessPoolExecutor(
        max_workers=workers, mp_context=ctx, initializer=_exit_with_parent, initargs=(os.getpid(),)
    ) as pool:
        pending: deque[tuple[list[str], cf.Future]] = deque()
        it = iter(tasks)
        try:
            for t in it:
                pending.append((t, pool.submit(_decode_task, str(root), t, opts)))
                if len(pending) >= 3 * workers:
                    break
            while pending:
                t, fut = pending.popleft()
                nxt = next(it, None)
                if nxt is not None:
                    pending.append((nxt, pool.submit(_decode_task, str(root), nxt, opts)))
                for rel, (arr, err) in zip(t, fut.result()):
                    yield rel, arr, err
        finally:
            for _, fut in pending:
                fut.cancel()


# -- the job ---------------------------------------------------------------------------------


def _check_options(color_mode: str, image_size: Any, interpolation: str, on_error: str) -> tuple[int, int] | None:
    if color_mode not in _MODES:
        raise InvalidInputError(f"color_mode must be one of {sorted(_MODES)}, got {color_mode!r}")
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
    output: Path,
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
    attrs: dict[str, Any] | None,
    provenance: dict[str, Any],
    client: Any = None,
) -> IngestResult:
    if not rels:
        raise IngestError(f"{root}: no image files found (looked for {', '.join(IMAGE_EXTENSIONS)})")
    t0 = time.perf_counter()
    order = np.random.default_rng(seed).permutation(len(rels)) if shuffle else np.arange(len(rels))
    rels = [rels[i] for i in order]
    if labels is not None:
        labels = labels[order]
    if client is not None:
        return _ingest_on_cluster(
            client, root, output, rels, labels, class_names, ignored, opts, t0=t0, on_error=on_error, codec=codec,
            chunk_images=chunk_images, overwrite=overwrite, progress=progress, attrs=attrs, provenance=provenance,
        )
    _, channels = _MODES[opts.color_mode]
    writer: StoreWriter | None = None
    skipped: list[tuple[str, str]] = []
    first_shape: tuple[int, ...] | None = None
    first_rel = ""
    batch_imgs: list[np.ndarray] = []
    batch_labels: list[int] = []
    batch_keys: list[str] = []

    def open_writer(shape: tuple[int, ...]) -> StoreWriter:
        return create(
            output,
            shape,
            dtype="uint8",
            codec=codec,
            chunk_images=chunk_images,
            class_names=class_names,
            attrs=attrs,
            overwrite=overwrite,
            provenance=provenance,
            nthreads=1,  # with more threads blosc2 orders a chunk's blocks as they finish: bytes would vary
        )

    def flush() -> None:
        assert writer is not None
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
        writer = open_writer(first_shape)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(rels), desc=f"ingest {output.name}", unit="img", file=sys.stderr, dynamic_ncols=True)
    try:
        for pos, (rel, arr, err) in enumerate(_decoded(root, rels, opts, workers)):
            if bar is not None:
                bar.update(1)
            err = err or _shape_error(arr, first_shape, first_rel)
            if err is not None:
                if on_error == "fail":
                    raise _bad_file_error(root, rel, err)
                skipped.append((rel, err))
                continue
            assert arr is not None
            if writer is None:
                first_shape = arr.shape
                first_rel = rel
                writer = open_writer(first_shape)
            elif not first_rel:
                first_rel = rel
            batch_imgs.append(arr)
            if labels is not None:
                batch_labels.append(int(labels[pos]))
            batch_keys.append(rel)
            if len(batch_imgs) >= 64:
                flush()
        if writer is None:
            raise IngestError(f"{root}: none of the {len(rels)} image files could be decoded; first failure: {skipped[0][0]}: {skipped[0][1]}")
        flush()
        for rel, reason in skipped:
            writer.add_skipped(rel, reason)
        writer.close()
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    n = len(rels) - len(skipped)
    shape = first_shape or ()
    return IngestResult(
        path=output,
        nimages=n,
        image_shape=shape,
        class_names=class_names,
        skipped=skipped,
        ignored=ignored,
        seconds=time.perf_counter() - t0,
        nbytes=n * int(np.prod(shape)),
        cbytes=output.stat().st_size,
    )


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
    client: Any = None,
) -> IngestResult | dict[str, IngestResult]:
    """Ingest a folder of images into a store at ``output`` (a ``.b2nd`` path).

    With ``split_dirs=True``, every sub-folder of ``directory`` (train/, validation/, ...)
    becomes its own store ``output/<split>.b2nd`` with one shared list of class names;
    the result is then a dict split -> IngestResult.

    ``image_size=None`` keeps the files' own size (they must all agree); ``keep_order=True``
    (or ``shuffle=False``) writes files in sorted path order, e.g. for video frames.
    ``workers`` decoding processes (default: all cores; 1 decodes in this process).
    ``codec`` is a Codec or a preset name (``fast``, ``balanced``, ``small``).
    ``client`` (a ``dask.distributed.Client``) decodes on its cluster instead of local
    processes (``workers`` is then unused); the store is byte for byte the one a local
    ingest writes (docs/dask.md). The workers read the files at the same path, so
    ``directory`` must be on a file system they all see.
    """
    root = Path(directory)
    size = _check_options(color_mode, image_size, interpolation, on_error)
    opts = DecodeOptions(color_mode, size, interpolation, bool(crop_to_aspect_ratio))
    if workers is None:
        workers = os.cpu_count() or 1
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
        client=client,
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
            "shuffled": shuffle,
            "seed": seed if shuffle else None,
        }

    if not split_dirs:
        out = Path(output)
        rels, labs, names, ignored = list_images(root, labels, class_names, follow_links)
        return _ingest_one(root, out, rels, labs, names, ignored, opts, provenance=provenance(root.name), **common)  # type: ignore[arg-type]

    if not root.is_dir():
        raise IngestError(f"{root}: not a folder")
    splits = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not splits:
        raise IngestError(f"{root}: --split-dirs expects split sub-folders such as train/ and validation/")
    if labels not in ("inferred", None):
        raise InvalidInputError("with split_dirs, labels must be 'inferred' or None")
    out_dir = Path(output)
    if out_dir.suffix == ".b2nd":
        raise InvalidInputError(f"{out_dir}: with split_dirs the output is a folder that receives <split>.b2nd files")
    out_dir.mkdir(parents=True, exist_ok=True)
    names_all: tuple[str, ...] | None = None
    if labels == "inferred":
        if class_names is not None:
            names_all = tuple(class_names)
        else:
            names_all = tuple(sorted({d.name for s in splits for d in (root / s).iterdir() if d.is_dir() and not d.name.startswith(".")}))
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
            src, out_dir / f"{split}.b2nd", rels, labs, names, ignored, opts, provenance=provenance(f"{root.name}/{split}"), **common  # type: ignore[arg-type]
        )
    return results


# -- on a dask.distributed cluster -------------------------------------------------------------


def _chunk_task(
    root: str, rels: list[str], opts: DecodeOptions, shape: tuple[int, ...], first_rel: str, meta: Any
) -> tuple[bytes, int, int, list[tuple[int, str]]]:
    """On a cluster worker: decode the files of one planned chunk exactly as a local ingest
    does (``_decode_task``, ``_shape_error``) and compress the good ones as one store chunk.

    Returns (compressed chunk, number of good images, CRC32, [(index in ``rels``, reason)]).
    """
    good: list[np.ndarray] = []
    errors: list[tuple[int, str]] = []
    for j, (arr, err) in enumerate(_decode_task(root, rels, opts)):
        err = err or _shape_error(arr, shape, first_rel)
        if err is None and arr is not None:
            good.append(arr)
        else:
            errors.append((j, err or "not decoded"))
    items = np.stack(good) if good else np.zeros((0, *shape), dtype=meta.np_dtype)
    data, crc = compress_chunk(meta, items)
    return data, len(good), crc, errors


def _ingest_on_cluster(
    client: Any,
    root: Path,
    output: Path,
    rels: list[str],
    labels: np.ndarray | None,
    class_names: tuple[str, ...] | None,
    ignored: list[str],
    opts: DecodeOptions,
    *,
    t0: float,
    on_error: str,
    codec: Codec | str | None,
    chunk_images: int | None,
    overwrite: bool,
    progress: bool,
    attrs: dict[str, Any] | None,
    provenance: dict[str, Any],
) -> IngestResult:
    """``_ingest_one`` with the decoding on a dask.distributed cluster (same order, same bytes).

    This process plans: the item shape (``image_size``, or the first file that decodes, as
    locally), then the files of each chunk. Workers decode, resize and compress whole
    chunks (``_chunk_task``); this process places them in order (``carraystore.dask.in_order``,
    a bounded window) with the keys and labels it already knows. A chunk with bad files comes
    back short: the plan then gives the next task fewer files so that later chunks line up
    again, and chunks already under way are decompressed and appended here (same bytes).
    """
    import blosc2

    from carraystore.dask import in_order

    sees = client.run(os.path.isdir, str(root))
    blind = sorted(w for w, ok in sees.items() if not ok)
    if blind:
        raise IngestError(
            f"{root}: worker(s) {', '.join(blind)} cannot see this folder; a distributed ingest reads the files "
            "on the workers, so the folder must be at the same path on every worker (a shared file system)"
        )
    _, channels = _MODES[opts.color_mode]
    first_rel = ""
    if opts.image_size is not None:
        shape: tuple[int, ...] = (*opts.image_size, channels)
    else:  # the first image that decodes fixes the shape, as in the local ingest
        first_err: tuple[str, str] | None = None
        for rel in rels:
            arr, err = _decode_task(str(root), [rel], opts)[0]
            if err is None and arr is not None:
                shape, first_rel = arr.shape, rel
                break
            if on_error == "fail":
                raise _bad_file_error(root, rel, err or "not decoded")
            first_err = first_err or (rel, err or "not decoded")
        else:
            assert first_err is not None
            raise IngestError(f"{root}: none of the {len(rels)} image files could be decoded; first failure: {first_err[0]}: {first_err[1]}")
    writer: StoreWriter = create(
        output,
        shape,
        dtype="uint8",
        codec=codec,
        chunk_images=chunk_images,
        class_names=class_names,
        attrs=attrs,
        overwrite=overwrite,
        provenance=provenance,
        nthreads=1,  # as the local ingest: the same bytes
    )
    meta = writer.meta
    k = meta.chunk_images
    skipped: list[tuple[str, str]] = []
    window = max(4, 2 * sum(client.nthreads().values()))
    groups: list[tuple[int, int]] = []  # the planned (start, stop) file range of every task, in order
    bad_seen = [0]  # bad files among the groups already placed
    tag = f"carraystore-ingest-{secrets.token_hex(4)}"

    def plan() -> Any:
        pos = 0
        while pos < len(rels):
            # images before `pos` if every file in flight decodes; fill up to the next chunk boundary
            size = k - (pos - bad_seen[0]) % k
            start, pos = pos, min(pos + size, len(rels))
            groups.append((start, pos))
            yield lambda a=start, b=pos: client.submit(
                _chunk_task, str(root), rels[a:b], opts, shape, first_rel, meta, key=f"{tag}-{a}-{b}"
            )

    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(rels), desc=f"ingest {output.name}", unit="img", file=sys.stderr, dynamic_ncols=True)
    results = in_order(client, plan(), window)
    try:
        for g in range(len(rels)):  # at most one task per file; the plan ends the loop
            try:
                data, ngood, crc, errors = next(results)
            except StopIteration:
                break
            except CarrayStoreError:
                raise
            except Exception as exc:  # the cluster gave up on a task (e.g. it killed several workers)
                start, stop = groups[g]
                raise IngestError(
                    f"{root}: the cluster could not decode the chunk of files {rels[start]} .. {rels[stop - 1]} "
                    f"({type(exc).__name__}: {exc}); ingest those files locally to find the one at fault"
                ) from exc
            start, stop = groups[g]
            bad = {j for j, _ in errors}
            for j, err in errors:
                if on_error == "fail":
                    raise _bad_file_error(root, rels[start + j], err)
                skipped.append((rels[start + j], err))
            bad_seen[0] += len(bad)
            idx = [i for i in range(start, stop) if i - start not in bad]
            lab = labels[idx] if labels is not None else None
            keys = [rels[i] for i in idx]
            if ngood and writer.nimages % k == 0:
                writer.append_compressed_chunk(data, ngood, crc, labels=lab, keys=keys)
            elif ngood:  # a chunk planned before an earlier bad file shifted the boundaries
                items = np.frombuffer(blosc2.decompress2(data), dtype=meta.np_dtype).reshape(k, *shape)[:ngood]
                writer.append(items, labels=lab, keys=keys)
            if bar is not None:
                bar.update(stop - start)
        for rel, reason in skipped:
            writer.add_skipped(rel, reason)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        results.close()  # cancels the tasks still under way, now rather than at garbage collection
        if bar is not None:
            bar.close()
    n = len(rels) - len(skipped)
    return IngestResult(
        path=output,
        nimages=n,
        image_shape=shape,
        class_names=class_names,
        skipped=skipped,
        ignored=ignored,
        seconds=time.perf_counter() - t0,
        nbytes=n * int(np.prod(shape)),
        cbytes=output.stat().st_size,
    )
