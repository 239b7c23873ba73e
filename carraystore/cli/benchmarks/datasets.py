"""Benchmark data: reproducible photo / video-like folders, image-folder decoding, page-cache eviction.

Folders are made with ``carraystore.ingest.sample_data`` from the photographs scikit-image
ships, so every run (and every machine) measures the same pixels. They are cached
under a folder named by their parameters, so repeated runs do not regenerate them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from carraystore.base.errors import InvalidInputError
from carraystore.ingest.images import IMAGE_EXTENSIONS, DecodeOptions, decode_image, image_files

__all__ = [
    "IMAGE_EXTENSIONS",
    "ImageFolder",
    "cached_photo_folder",
    "cached_video_folder",
    "list_image_folder",
    "decode_images",
    "evict_from_page_cache",
    "path_size",
]

_DONE = ".complete"


def _cached(folder: Path, make: Callable[[Path], object]) -> Path:
    """Return ``folder``, building it with ``make(tmp)`` first unless a finished copy exists."""
    if (folder / _DONE).exists():
        return folder
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    make(tmp)
    (tmp / _DONE).write_text("ok\n")
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder


def cached_photo_folder(
    cache: str | os.PathLike[str],
    n: int,
    size: tuple[int, int] = (256, 256),
    classes: Sequence[str] | None = None,
    seed: int = 0,
) -> Path:
    """A folder of ``n`` real-photo JPEGs in class folders (all 8 sample photos by default), cached."""
    from carraystore.ingest.sample_data import PHOTOS, make_photo_folder

    names = list(classes) if classes is not None else list(PHOTOS)
    folder = Path(cache) / f"photos-n{n}-{size[0]}x{size[1]}-c{len(names)}-s{seed}"
    return _cached(folder, lambda tmp: make_photo_folder(tmp, n=n, size=size, classes=names, seed=seed))


def cached_video_folder(
    cache: str | os.PathLike[str], clips: int, frames: int, size: tuple[int, int] = (256, 256), seed: int = 0
) -> Path:
    """Video-like frames (windows sliding across a photo, overlapping), cached."""
    from carraystore.ingest.sample_data import make_video_folder

    folder = Path(cache) / f"video-c{clips}-f{frames}-{size[0]}x{size[1]}-s{seed}"
    return _cached(folder, lambda tmp: make_video_folder(tmp, clips=clips, frames=frames, size=size, seed=seed))


class ImageFolder:
    """The image files under a root folder: sorted paths, integer labels, class names.

    The class of a file is its first folder below the root (the layout
    ``keras.utils.image_dataset_from_directory`` reads); files directly in the root
    get the class ``"."``.
    """

    def __init__(self, root: Path, files: list[Path], labels: np.ndarray, class_names: list[str]) -> None:
        self.root = root
        self.files = files
        self.labels = labels
        self.class_names = class_names

    def __len__(self) -> int:
        return len(self.files)

    def keys(self) -> list[str]:
        """Paths relative to the root, with '/' separators."""
        return [p.relative_to(self.root).as_posix() for p in self.files]

    def subset(self, idx: Iterable[int]) -> ImageFolder:
        idx = list(idx)
        return ImageFolder(self.root, [self.files[i] for i in idx], self.labels[idx], self.class_names)


def list_image_folder(root: str | os.PathLike[str], limit: int | None = None, seed: int = 0) -> ImageFolder:
    """Scan ``root`` for images. With ``limit``, keep a seeded random subset of that size (in file order)."""
    rootp = Path(root)
    if not rootp.is_dir():
        raise InvalidInputError(f"{rootp}: not a folder of images")
    files = image_files(rootp)
    if not files:
        raise InvalidInputError(f"{rootp}: no image files ({', '.join(IMAGE_EXTENSIONS)}) found under it")
    tops = [p.relative_to(rootp).parts[0] if len(p.relative_to(rootp).parts) > 1 else "." for p in files]
    class_names = sorted(set(tops))
    index = {c: i for i, c in enumerate(class_names)}
    labels = np.array([index[t] for t in tops], dtype=np.int64)
    folder = ImageFolder(rootp, files, labels, class_names)
    if limit is not None and limit < len(files):
        keep = np.sort(np.random.default_rng(seed).choice(len(files), size=limit, replace=False))
        folder = folder.subset(int(i) for i in keep)
    return folder


def decode_images(
    files: Sequence[Path], size: tuple[int, int] | None = None, workers: int | None = None, color_mode: str = "rgb"
) -> np.ndarray:
    """Decode ``files`` to an (n, H, W, C) uint8 array as ``carraystore ingest`` does (Pillow, threads).

    With ``size=None`` every image must have the first image's size; otherwise the error
    names the first that differs and says to pass a size (CLI: ``--image-size H W``).
    ``color_mode`` is ``grayscale``, ``rgb`` or ``rgba`` (C = 1, 3, 4).
    """
    if not files:
        raise InvalidInputError("no images to decode")
    opts = DecodeOptions(color_mode=color_mode, image_size=tuple(size) if size is not None else None)  # type: ignore[arg-type]
    first = decode_image(files[0], opts)
    h, w = first.shape[:2]
    out = np.empty((len(files), *first.shape), dtype=np.uint8)
    out[0] = first

    def work(i: int) -> None:
        img = decode_image(files[i], opts)
        if img.shape != first.shape:
            raise InvalidInputError(
                f"{files[i]}: image is {img.shape[1]}x{img.shape[0]} but {files[0]} is {w}x{h}; "
                "pass an image size (CLI: --image-size H W) to resize them all"
            )
        out[i] = img

    with ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 1)) as pool:
        list(pool.map(work, range(1, len(files))))
    return out


def _iter_files(paths: Iterable[str | os.PathLike[str]]) -> Iterable[Path]:
    for p in paths:
        p = Path(p)
        if p.is_dir():
            yield from (q for q in p.rglob("*") if q.is_file())
        elif p.is_file():
            yield p


def evict_from_page_cache(paths: Iterable[str | os.PathLike[str]]) -> int:
    """Drop the given files (folders: every file below) from the OS page cache.

    Uses ``fsync`` then ``posix_fadvise(POSIX_FADV_DONTNEED)``, which needs no privileges;
    returns the number of files advised. Raises InvalidInputError where the OS lacks it.
    """
    if not hasattr(os, "posix_fadvise"):
        raise InvalidInputError("this OS has no posix_fadvise: cold-cache runs are only available on Linux/Unix")
    count = 0
    for p in _iter_files(paths):
        fd = os.open(p, os.O_RDONLY)
        try:
            try:
                os.fsync(fd)
            except OSError:
                pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        finally:
            os.close(fd)
    return count


def path_size(path: str | os.PathLike[str]) -> int:
    """Bytes on disk of a file, or of every file below a folder (apparent sizes)."""
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    return sum(q.stat().st_size for q in p.rglob("*") if q.is_file())
