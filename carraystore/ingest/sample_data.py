"""Small labelled image folders made reproducibly from the photographs scikit-image ships.

Each class is one photo; samples are random crops, resized and randomly flipped, saved as
JPEG (or PNG) in class folders. Needs scikit-image (the ``demo``/``test``/``bench`` extras).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

from carraystore.base.errors import MissingDependencyError

__all__ = ["PHOTOS", "load_photo", "make_photo_folder", "make_video_folder", "photo_crops"]

#: Colour photographs shipped inside the scikit-image wheel (no download needed).
PHOTOS: tuple[str, ...] = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "hubble_deep_field",
    "immunohistochemistry",
    "stereo_motorcycle",
    "colorwheel",
)


def load_photo(name: str) -> np.ndarray:
    """One of ``PHOTOS`` as an (H, W, 3) uint8 array."""
    try:
        import skimage.data
    except ImportError as exc:
        raise MissingDependencyError(
            "sample photos come from scikit-image: pip install 'carraystore[demo]' (or scikit-image)"
        ) from exc
    img = getattr(skimage.data, name)()
    if isinstance(img, tuple):
        img = img[0]
    img = np.asarray(img)
    if img.ndim == 2:
        img = np.stack([img] * 3, axis=-1)
    return np.ascontiguousarray(img[..., :3]).astype(np.uint8)


def photo_crops(
    photo: np.ndarray, n: int, size: tuple[int, int], rng: np.random.Generator, min_scale: float = 0.35
) -> list[np.ndarray]:
    """``n`` random crops of ``photo`` (random scale and position, random horizontal flip)."""
    h, w = photo.shape[:2]
    out = []
    aspect = size[1] / size[0]
    pil = Image.fromarray(photo)
    for _ in range(n):
        scale = rng.uniform(min_scale, 1.0)
        ch = int(min(h, w / aspect) * scale)
        cw = int(ch * aspect)
        y = int(rng.integers(0, h - ch + 1))
        x = int(rng.integers(0, w - cw + 1))
        crop = pil.crop((x, y, x + cw, y + ch)).resize((size[1], size[0]), Image.Resampling.BILINEAR)
        if rng.random() < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        out.append(np.asarray(crop))
    return out


def make_photo_folder(
    out: str | os.PathLike[str],
    n: int = 300,
    size: tuple[int, int] = (256, 256),
    classes: Sequence[str] | None = None,
    seed: int = 0,
    splits: dict[str, float] | None = None,
    fmt: str = "jpeg",
    quality: int = 90,
) -> Path:
    """Write ``n`` images to ``out/<class>/`` (with ``splits={"train": 0.8, ...}``: ``out/train/<class>/``)."""
    root = Path(out)
    names = list(classes) if classes is not None else list(PHOTOS[:4])
    unknown = [c for c in names if c not in PHOTOS]
    if unknown:
        raise ValueError(f"unknown photo classes {unknown}; choose from {PHOTOS}")
    rng = np.random.default_rng(seed)
    per_class = [n // len(names) + (1 if i < n % len(names) else 0) for i in range(len(names))]
    ext = {"jpeg": "jpg", "png": "png"}[fmt]
    split_items = list((splits or {"": 1.0}).items())
    for cls, count in zip(names, per_class, strict=True):
        photo = load_photo(cls)
        crops = photo_crops(photo, count, size, rng)
        start = 0
        for si, (split, frac) in enumerate(split_items):
            m = count - start if si == len(split_items) - 1 else int(round(count * frac))
            folder = root / split / cls if split else root / cls
            folder.mkdir(parents=True, exist_ok=True)
            for j, arr in enumerate(crops[start : start + m]):
                path = folder / f"{cls}_{start + j:05d}.{ext}"
                if fmt == "jpeg":
                    Image.fromarray(arr).save(path, quality=quality)
                else:
                    Image.fromarray(arr).save(path)
            start += m
    return root


def make_video_folder(
    out: str | os.PathLike[str],
    clips: int = 4,
    frames: int = 24,
    size: tuple[int, int] = (128, 128),
    seed: int = 0,
    fmt: str = "jpeg",
) -> Path:
    """Video-like clips: a window sliding across a photo, as ``out/<photo>/clip<k>/frame_<t>.jpg``."""
    root = Path(out)
    rng = np.random.default_rng(seed)
    ext = {"jpeg": "jpg", "png": "png"}[fmt]
    for k in range(clips):
        name = PHOTOS[k % len(PHOTOS)]
        photo = load_photo(name)
        h, w = photo.shape[:2]
        ch, cw = min(h, size[0] * 2), min(w, size[1] * 2)
        y = int(rng.integers(0, h - ch + 1))
        folder = root / name / f"clip{k:03d}"
        folder.mkdir(parents=True, exist_ok=True)
        pil = Image.fromarray(photo)
        for t in range(frames):
            x = int(round((w - cw) * t / max(1, frames - 1)))
            frame = pil.crop((x, y, x + cw, y + ch)).resize((size[1], size[0]), Image.Resampling.BILINEAR)
            if fmt == "jpeg":
                frame.save(folder / f"frame_{t:05d}.{ext}", quality=90)
            else:
                frame.save(folder / f"frame_{t:05d}.{ext}")
    return root
