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
import stat
import sys
import time
import unicodedata
import warnings
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from carraystore.codec import Codec
from carraystore.errors import CarrayStoreError, ImageDecodeError, IngestError, InvalidInputError
from carraystore.format import validate_key
from carraystore.reader import is_url
from carraystore.writer import StoreWriter, check_class_names, compress_chunk, create

__all__ = [
    "IMAGE_EXTENSIONS",
    "INTERPOLATIONS",
    "IngestResult",
    "DecodeOptions",
    "list_images",
    "image_files",
    "split_like_folders",
    "validation_split_indices",
    "SPLIT_NAMES",
    "DEFAULT_MAX_SKIPPED",
    "decode_image",
    "from_directory",
]

#: File extensions read (case-insensitive): Keras' five plus WebP and TIFF, which Pillow decodes.
#: The one list: ingest, ``carraystore bench`` and bench/ all find images with :func:`image_files`.
IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")

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
#: Pixel types of an ingested store: 8-bit (the default, as Keras) or 16-bit.
DTYPES = ("uint8", "uint16")
#: Pillow modes of 16-bit grayscale images (the only 16-bit PNGs Pillow decodes at full depth).
_DEEP_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")
#: How each store dtype treats files of the other bit depth (recorded in the provenance).
_DEPTH_RULE = {
    "uint8": "16-bit files reduced to 8 bits by their high byte (value >> 8), as Pillow and tf.image decode them",
    "uint16": "8-bit files scaled to 16 bits (value * 257); 16-bit colour PNGs are refused (Pillow decodes them to 8 bits)",
}

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
#: The default of ``max_skipped``: an ingest that skips more than 1% of the files stops.
DEFAULT_MAX_SKIPPED = 0.01


@dataclass(frozen=True)
class DecodeOptions:
    """How each file becomes an array (picklable: sent to worker processes)."""

    color_mode: str = "rgb"
    image_size: tuple[int, int] | None = None
    interpolation: str = "bilinear"
    crop_to_aspect_ratio: bool = False
    dtype: str = "uint8"


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


# -- listing ---------------------------------------------------------------------------------


def shown_name(name: str) -> str:
    """A file name as text that can be printed and stored: undecodable bytes as ``\\xNN``, control characters escaped."""
    text = os.fsencode(name).decode("utf-8", "backslashreplace")
    return "".join(repr(c)[1:-1] if unicodedata.category(c) == "Cc" else c for c in text)


def _walk_images(root: Path, follow_links: bool) -> tuple[list[Path], list[Path]]:
    """All image files under ``root`` (sorted; a folder's files before its sub-folders) and the others (ignored).

    With ``follow_links``, a link to a folder that was already listed (a loop, or a second way
    to the same folder) is not entered again: it lands in the ignored list, named with the reason.
    """
    images: list[Path] = []
    other: list[Path] = []
    seen: set[tuple[int, int]] = set()

    def walk(folder: Path) -> None:
        try:
            st = os.stat(folder)
            if (st.st_dev, st.st_ino) in seen:
                link = f"link to {os.readlink(folder)}, " if folder.is_symlink() else ""
                other.append(Path(f"{folder}/ ({link}a folder already listed: not entered again)"))
                return
            seen.add((st.st_dev, st.st_ino))
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            other.append(Path(f"{folder}/ (cannot be listed: {exc.strerror})"))
            return
        subdirs: list[Path] = []
        for e in entries:
            p = Path(e.path)
            try:
                is_dir = e.is_dir()
            except OSError:
                is_dir = False
            if not is_dir:
                (images if p.suffix.lower() in IMAGE_EXTENSIONS else other).append(p)
            elif not e.is_symlink() or follow_links:
                subdirs.append(p)
            else:
                other.append(
                    Path(f"{p}/ (a link to a folder: not followed; pass follow_links=True, CLI --follow-links)")
                )
        for d in subdirs:
            walk(d)

    walk(root)
    return images, other


def image_files(root: str | os.PathLike[str], follow_links: bool = False) -> list[Path]:
    """Every image file under ``root`` (any depth), in sorted path order."""
    return _walk_images(Path(root), follow_links)[0]


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
    class_names = check_class_names(class_names, str(root))
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
            raise IngestError(
                f"{root}: no class sub-folders found; pass labels=None (CLI: --labels none) for an unlabelled folder"
            )
        for cls in names:
            if os.fsencode(cls).decode("utf-8", "replace") != cls:
                raise IngestError(
                    f"{root / shown_name(cls)}: a class folder's name must be valid UTF-8 (it becomes a class name); "
                    "rename the folder, or leave it out with class_names (CLI: --class-names)"
                )
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


def _open_regular_file(path: str | os.PathLike[str]) -> Any:
    """Open ``path`` for reading, refusing anything but a regular file (a FIFO would block forever)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ImageDecodeError(f"{path}: not a regular file (a FIFO, socket or device); only image files are read")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as exc:
        raise ImageDecodeError(f"{path}: file not found") from exc
    except OSError as exc:
        raise ImageDecodeError(f"{path}: cannot be read ({exc.strerror})") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced after the check above
        os.close(fd)
        raise ImageDecodeError(f"{path}: not a regular file (a FIFO, socket or device); only image files are read")
    return os.fdopen(fd, "rb")


def _png_bit_depth(f: Any) -> int | None:
    """The bit depth of a PNG's colour channels from its IHDR chunk, or None for other files."""
    f.seek(0)
    head = f.read(26)
    f.seek(0)
    if len(head) == 26 and head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR":
        return head[24]
    return None


def _resized(img: Any, opts: DecodeOptions) -> Any:
    if opts.image_size is None:
        return img
    h, w = opts.image_size
    box = _crop_box(img.width, img.height, h, w) if opts.crop_to_aspect_ratio else None
    if (img.height, img.width) != (h, w) or box is not None:
        img = img.resize((w, h), resample=INTERPOLATIONS[opts.interpolation], box=box)
    return img


def _pixels16(img: Any, opts: DecodeOptions, channels: int) -> np.ndarray:
    """A 16-bit grayscale image as (H, W, C) uint16 at full depth (resized in float32 when asked)."""
    gray = np.asarray(img).astype(np.float32)
    if opts.image_size is not None:
        gray = np.asarray(_resized(Image.fromarray(gray, "F"), opts))
    gray = np.clip(np.rint(gray), 0, 65535).astype(np.uint16)
    planes = [gray] * min(channels, 3) + ([np.full_like(gray, 65535)] if channels == 4 else [])
    return np.stack(planes, axis=-1)


def decode_image(path: str | os.PathLike[str], opts: DecodeOptions = DecodeOptions()) -> np.ndarray:
    """Decode one file into an (H, W, C) array of ``opts.dtype``; raise ImageDecodeError naming the file.

    Bit depth is converted explicitly, never clipped: into uint8, a 16-bit grayscale PNG
    keeps its high byte (as Pillow does for 16-bit colour PNGs); into uint16, 16-bit
    grayscale keeps every bit, 8-bit images are scaled by 257 and 16-bit colour PNGs are
    refused (Pillow decodes those to 8 bits only).
    """
    mode, channels = _MODES[opts.color_mode]
    try:
        with warnings.catch_warnings(), _open_regular_file(path) as f:
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            depth = _png_bit_depth(f)
            with Image.open(f) as img:
                img.load()
                deep = img.mode in _DEEP_MODES
                if opts.dtype == "uint16" and deep:
                    return _pixels16(img, opts, channels)
                if opts.dtype == "uint16" and depth == 16:
                    raise ImageDecodeError(
                        f"{path}: a 16-bit colour PNG, which Pillow decodes to 8 bits only; a uint16 store cannot hold "
                        "its full depth. Ingest it with dtype='uint8' (CLI: --dtype uint8), or convert it to 16-bit grayscale"
                    )
                if deep:  # 16 bits -> 8: the high byte, never a clip at 255
                    img = Image.fromarray((np.asarray(img).astype(np.uint32) >> 8).clip(0, 255).astype(np.uint8), "L")
                arr = np.asarray(_resized(img.convert(mode), opts), dtype=np.uint8)
                if opts.dtype == "uint16":
                    arr = arr.astype(np.uint16) * np.uint16(257)
    except ImageDecodeError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageDecodeError(f"{path}: refused as a decompression bomb ({exc})") from exc
    except FileNotFoundError as exc:
        raise ImageDecodeError(f"{path}: file not found") from exc
    except Exception as exc:  # PIL raises many types for bad data
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, Image.UnidentifiedImageError):  # its text names the file object, whose fd number varies
            reason = "not an image format Pillow can identify"
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
            out.append((None, msg[len(prefix) :] if msg.startswith(prefix) else msg))
    return out


_SIZE_MISMATCH = "but earlier images are"


def _shape_error(arr: np.ndarray | None, first_shape: tuple[int, ...] | None, first_rel: str) -> str | None:
    """Why a decoded image cannot join the store (its shape differs from the first one), or None."""
    if arr is None or first_shape is None or arr.shape == first_shape:
        return None
    return (
        f"decoded to {arr.shape[0]}x{arr.shape[1]}x{arr.shape[2]} {_SIZE_MISMATCH} "
        f"{'x'.join(map(str, first_shape))} (e.g. {first_rel}); pass image_size (CLI: --image-size H W) to resize"
    )


class _BadFiles:
    """The files an ingest cannot use, handled alike by the local and the cluster ingest.

    With ``on_error='fail'`` the first one stops the ingest; with ``'skip'`` they are listed
    (``skipped``: printable name, reason) until more than ``max_skipped`` allows, and then
    the ingest stops, writing nothing.
    """

    def __init__(
        self,
        root: Path,
        total: int,
        on_error: str,
        max_skipped: float | int,
        allowed: int,
        skipped: list[tuple[str, str]],
    ):
        self.root, self.total, self.on_error = root, total, on_error
        self.max_skipped, self.allowed, self.skipped = max_skipped, allowed, skipped
        self.named = len(skipped)  # skipped for their names before decoding: not among the ``total``

    def add(self, pos: int, rel: str, err: str, first_shape: tuple[int, ...] | None, first_rel: str) -> None:
        """File ``rel`` (position ``pos`` of ``total`` in the write order) cannot be used because of ``err``."""
        root = self.root
        if self.on_error == "fail" and _SIZE_MISMATCH in err:
            # never suggest skipping here: in a folder of mixed sizes it would drop most images
            raise IngestError(
                f"{root / rel}: {err} them all to one size (e.g. --image-size "
                f"{first_shape[0] if first_shape else 256} {first_shape[1] if first_shape else 256})"
            )
        if self.on_error == "fail":
            raise IngestError(
                f"{root / rel}: {err}. Fix or remove the file, or pass on_error='skip' (CLI: --on-error skip) "
                "to skip bad files (they are listed in the output and in the store's metadata)"
            )
        skipped = self.skipped
        skipped.append((shown_name(rel), err))
        if len(skipped) <= self.allowed:
            return
        n_size = sum(_SIZE_MISMATCH in r for _, r in skipped)
        if n_size:  # raising the limit would only drop more of them: point to resizing
            todo = (
                f"{n_size} of them differ in size from the first image ({first_rel}): pass image_size "
                f"(CLI: --image-size H W) to resize every image instead of skipping them"
            )
        else:
            todo = (
                "fix or remove the files, or, if losing them is fine, raise the limit "
                "(max_skipped=0.05 or a count; CLI: --max-skipped 5% or --max-skipped 20)"
            )
        raise IngestError(
            f"{root}: {len(skipped)} of the first {pos + 1} of {self.total} image files could not be used, more "
            f"than max_skipped (CLI: --max-skipped) allows ({_describe_limit(self.max_skipped)} = {self.allowed} of "
            f"{self.total}); nothing was written. First: {skipped[0][0]}: {skipped[0][1]}. To go on, {todo}"
        )

    def none_decoded(self) -> IngestError:
        """The error when not one of the files decodes (and skipping them all was allowed)."""
        first = self.skipped[0]
        return IngestError(
            f"{self.root}: none of the {self.total + self.named} image files could be decoded; first failure: {first[0]}: {first[1]}"
        )


def _exit_with_parent(main_pid: int) -> None:
    """Worker initializer: end this decoding process as soon as the ingesting process is gone.

    A killed ingest (SIGKILL) cannot stop its pool, and a dead process stays a zombie (still
    "alive" to ``kill(pid, 0)``) until its caller reaps it, which a caller reading the
    ingest's output pipes to EOF first never does (and the forkserver, the workers' parent,
    lives as long as they do). So every 0.25 s the worker checks that the ingesting process
    exists and is no zombie (``/proc``), and that it was not re-parented; on Linux it also
    asks for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``).
    """
    import threading

    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - no prctl in this libc
            pass

    def gone() -> bool:
        if os.getppid() != parent:
            return True
        try:
            os.kill(main_pid, 0)
            with open(f"/proc/{main_pid}/stat", "rb") as f:  # a zombie is dead, though kill() finds it
                return f.read().rpartition(b")")[2].split()[0] in (b"Z", b"X")
        except FileNotFoundError:  # no /proc (macOS): kill() is the test
            return False
        except (ProcessLookupError, PermissionError):  # gone, or a reused pid of another user
            return True

    def watch() -> None:
        while not gone():
            time.sleep(0.25)
        os._exit(1)

    if gone():  # the parent died before the death signal was asked for
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


def _allowed_skips(max_skipped: float | int, total: int) -> int:
    """How many of ``total`` files may be skipped: a fraction below 1 (0.01 = 1%) or a count."""
    if isinstance(max_skipped, bool) or not isinstance(max_skipped, (int, float)) or max_skipped < 0:
        raise InvalidInputError(f"max_skipped must be a fraction in [0, 1) or a count of files, got {max_skipped!r}")
    if isinstance(max_skipped, float) and max_skipped < 1:
        return int(max_skipped * total + 1e-9)
    if float(max_skipped) != int(max_skipped):
        raise InvalidInputError(
            f"max_skipped must be a fraction in [0, 1) or a whole count of files, got {max_skipped!r}"
        )
    return int(max_skipped)


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


def _describe_limit(max_skipped: float | int) -> str:
    if isinstance(max_skipped, float) and max_skipped < 1:
        return f"{max_skipped * 100:g}%"
    return f"{int(max_skipped)} file(s)"


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


def _drop_bad_names(
    root: Path, rels: list[str], labels: np.ndarray | None, on_error: str
) -> tuple[list[str], np.ndarray | None, list[tuple[str, str]]]:
    """Files whose names cannot be keys (not UTF-8, newline, ...): an error, or skipped with ``on_error='skip'``.

    Returns the other files, their labels, and the skipped ones as (printable name, reason).
    """
    keep: list[int] = []
    skipped: list[tuple[str, str]] = []
    for i, rel in enumerate(rels):
        try:
            validate_key(rel)
        except InvalidInputError as exc:
            reason = "file name is not valid UTF-8" if "UTF-8" in str(exc) else "file name holds a NUL or newline"
            reason += ", so it cannot be a key (FORMAT.md, keys)"
            if on_error == "fail":
                raise IngestError(
                    f"{root / shown_name(rel)}: {reason} (non-ASCII bytes shown as \\xNN). Rename the file, or pass "
                    "on_error='skip' (CLI: --on-error skip) to skip it (it is listed in the output and the store's metadata)"
                ) from None
            skipped.append((shown_name(rel), reason))
            continue
        keep.append(i)
    if not skipped:
        return rels, labels, skipped
    return [rels[i] for i in keep], (labels[keep] if labels is not None else None), skipped


def _ingest_writer(
    output: Path | str, shape: tuple[int, ...], opts: DecodeOptions, write: dict[str, Any]
) -> StoreWriter:
    """The store writer of an ingest, local or on a cluster: one blosc2 thread, so that a chunk's
    blocks are in order and the same ingest always gives the same bytes (blosc2's threads
    place blocks as they finish). ``write``: the ``create`` arguments the caller was given."""
    return create(output, shape, dtype=opts.dtype, nthreads=1, **write)


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
    client: Any = None,
) -> IngestResult:
    if not rels:
        raise IngestError(f"{root}: no image files found (looked for {', '.join(IMAGE_EXTENSIONS)})")
    allowed = _allowed_skips(max_skipped, len(rels))
    t0 = time.perf_counter()
    rels, labels, skipped = _drop_bad_names(root, rels, labels, on_error)
    order = np.random.default_rng(seed).permutation(len(rels)) if shuffle else np.arange(len(rels))
    rels = [rels[i] for i in order]
    if labels is not None:
        labels = labels[order]
    bad = _BadFiles(root, len(rels), on_error, max_skipped, allowed, skipped)
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
    if client is not None:
        return _ingest_on_cluster(
            client, root, output, rels, labels, class_names, ignored, opts, bad, write, t0=t0, progress=progress
        )
    _, channels = _MODES[opts.color_mode]
    writer: StoreWriter | None = None
    first_shape: tuple[int, ...] | None = None
    first_rel = ""
    batch_imgs: list[np.ndarray] = []
    batch_labels: list[int] = []
    batch_keys: list[str] = []

    def open_writer(shape: tuple[int, ...]) -> StoreWriter:
        return _ingest_writer(output, shape, opts, write)

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

        bar = tqdm(
            total=len(rels),
            desc=f"ingest {str(output).rsplit('/', 1)[-1]}",
            unit="img",
            file=sys.stderr,
            dynamic_ncols=True,
        )
    try:
        for pos, (rel, arr, err) in enumerate(_decoded(root, rels, opts, workers)):
            if bar is not None:
                bar.update(1)
            err = err or _shape_error(arr, first_shape, first_rel)
            if err is not None:
                bad.add(pos, rel, err, first_shape, first_rel)
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
            raise bad.none_decoded()
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
    n = writer.nimages
    shape = first_shape or ()
    return IngestResult(
        path=output,
        nimages=n,
        image_shape=shape,
        class_names=class_names,
        skipped=skipped,
        ignored=ignored,
        seconds=time.perf_counter() - t0,
        nbytes=n * int(np.prod(shape)) * np.dtype(opts.dtype).itemsize,
        cbytes=writer.file_size or 0,
    )


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
    ``dtype`` is ``"uint8"`` (16-bit files keep their high byte) or ``"uint16"`` (16-bit grayscale
    kept exactly, 8-bit files scaled by 257, 16-bit colour PNGs refused): see ``decode_image``.
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
    ``client`` (a ``dask.distributed.Client``) decodes on its cluster instead of local
    processes (``workers`` is then unused); the store is byte for byte the one a local
    ingest writes (docs/dask.md). The workers read the files at the same path, so
    ``directory`` must be on a file system they all see.
    """
    root = Path(directory)
    size = _check_options(color_mode, image_size, interpolation, on_error)
    if dtype not in DTYPES:
        raise InvalidInputError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    opts = DecodeOptions(color_mode, size, interpolation, bool(crop_to_aspect_ratio), dtype)
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
        max_skipped=max_skipped,
        lock_timeout=lock_timeout,
        storage_options=storage_options,
        tmp_dir=tmp_dir,
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
            "dtype": dtype,
            "bit_depth": _DEPTH_RULE[dtype],
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
        _allowed_skips(max_skipped, 1)  # a bad value fails before any work
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
            zip(("training", "validation"), validation_split_indices(len(rels), validation_split, shuffle, seed))
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
    output: Path | str,
    rels: list[str],
    labels: np.ndarray | None,
    class_names: tuple[str, ...] | None,
    ignored: list[str],
    opts: DecodeOptions,
    bad: _BadFiles,
    write: dict[str, Any],
    *,
    t0: float,
    progress: bool,
) -> IngestResult:
    """``_ingest_one`` with the decoding on a dask.distributed cluster (same order, same bytes).

    This process plans: the item shape (``image_size``, or the first file that decodes, as
    locally; the files before it are bad ones, handled here), then the files of each chunk.
    Workers decode, resize and compress whole chunks (``_chunk_task``); this process places
    them in order (``carraystore.dask.in_order``, a bounded window) with the keys and labels
    it already knows, and treats bad files as the local ingest does (``_BadFiles``: the same
    ``on_error``, ``max_skipped`` and messages). A chunk with bad files comes back short: the
    plan then gives the next task fewer files so that later chunks line up again, and chunks
    already under way are decompressed and appended here (same bytes).
    """
    import blosc2

    from carraystore.dask import in_order

    sees = client.run(os.path.isdir, str(root))
    if not sees:  # the tasks would wait for a worker for ever
        raise IngestError(
            f"{root}: the dask cluster at {client.scheduler.address} has no workers; start workers "
            "(`dask worker ADDRESS`) or ingest without --dask-scheduler / client"
        )
    blind = sorted(w for w, ok in sees.items() if not ok)
    if blind:
        raise IngestError(
            f"{root}: worker(s) {', '.join(blind)} cannot see this folder; a distributed ingest reads the files "
            "on the workers, so the folder must be at the same path on every worker (a shared file system)"
        )
    _, channels = _MODES[opts.color_mode]
    first_rel = ""
    begin = 0  # the files before the first one that decodes are bad: handled here, not sent out
    if opts.image_size is not None:
        shape: tuple[int, ...] = (*opts.image_size, channels)
    else:  # the first image that decodes fixes the shape, as in the local ingest
        for begin, rel in enumerate(rels):
            arr, err = _decode_task(str(root), [rel], opts)[0]
            if err is None and arr is not None:
                shape, first_rel = arr.shape, rel
                break
            bad.add(begin, rel, err or "not decoded", None, "")
        else:
            raise bad.none_decoded()
    writer = _ingest_writer(output, shape, opts, write)  # as the local ingest: the same bytes
    meta = writer.meta
    k = meta.chunk_images
    window = max(4, 2 * sum(client.nthreads().values()))
    groups: list[tuple[int, int]] = []  # the planned (start, stop) file range of every task, in order
    bad_seen = [begin]  # bad files among the groups already placed (and before them)
    tag = f"carraystore-ingest-{secrets.token_hex(4)}"

    def plan() -> Any:
        pos = begin
        while pos < len(rels):
            # images before `pos` if every file in flight decodes; fill up to the next chunk boundary
            size = k - (pos - bad_seen[0]) % k
            start, pos = pos, min(pos + size, len(rels))
            groups.append((start, pos))
            yield lambda a=start, b=pos: client.submit(
                _chunk_task, str(root), rels[a:b], opts, shape, first_rel, meta, key=f"{tag}-{a}-{b}"
            )

    bar = None
    results = in_order(client, plan(), window)
    try:
        if progress:
            from tqdm import tqdm

            name = str(output).rsplit("/", 1)[-1]  # a path or a URL
            bar = tqdm(
                total=len(rels), initial=begin, desc=f"ingest {name}", unit="img", file=sys.stderr, dynamic_ncols=True
            )
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
            for j, err in errors:
                bad.add(start + j, rels[start + j], err, shape, first_rel)
            bad_seen[0] += len(errors)
            failed = {j for j, _ in errors}
            idx = [i for i in range(start, stop) if i - start not in failed]
            lab = labels[idx] if labels is not None else None
            keys = [rels[i] for i in idx]
            if ngood and writer.nimages % k == 0:
                writer.append_compressed_chunk(data, ngood, crc, labels=lab, keys=keys)
            elif ngood:  # a chunk planned before an earlier bad file shifted the boundaries
                items = np.frombuffer(blosc2.decompress2(data), dtype=meta.np_dtype).reshape(k, *shape)[:ngood]
                writer.append(items, labels=lab, keys=keys)
            if bar is not None:
                bar.update(stop - start)
        for rel, reason in bad.skipped:
            writer.add_skipped(rel, reason)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    finally:
        results.close()  # cancels the tasks still under way, now rather than at garbage collection
        if bar is not None:
            bar.close()
    n = writer.nimages
    return IngestResult(
        path=output,
        nimages=n,
        image_shape=shape,
        class_names=class_names,
        skipped=bad.skipped,
        ignored=ignored,
        seconds=time.perf_counter() - t0,
        nbytes=n * int(np.prod(shape)) * np.dtype(opts.dtype).itemsize,
        cbytes=writer.file_size or 0,
    )
