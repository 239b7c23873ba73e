"""Benchmark data: reproducible photo and video-like folders (cached by their parameters), page-cache eviction.

Folders are made with ``carraystore.ingest.sample_data`` from the photographs scikit-image
ships, so every run (and every machine) measures the same pixels.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from carraystore.base.errors import InvalidInputError

__all__ = ["cached_photo_folder", "cached_video_folder", "evict_from_page_cache", "path_size"]

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
