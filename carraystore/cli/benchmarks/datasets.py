"""The images a benchmark measures: an image folder's files and labels, decoded to one array."""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from carraystore.base.errors import InvalidInputError
from carraystore.ingest.images import IMAGE_EXTENSIONS, DecodeOptions, decode_image, image_files

__all__ = [
    "IMAGE_EXTENSIONS",
    "ImageFolder",
    "list_image_folder",
    "decode_images",
]


class ImageFolder:
    """The image files under a root folder: sorted paths, labels (first folder; ``"."`` in the root), class names."""

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

    With ``size=None`` every image must have the first image's size (the error names the first
    that differs). ``color_mode``: ``grayscale``, ``rgb`` or ``rgba`` (C = 1, 3, 4).
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
