"""What a loader peer is: the run's Context, the Peer interface, and the epoch orders peers read in."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.cli.benchmarks.datasets import ImageFolder, decode_images, list_image_folder

__all__ = ["Batch", "PEER_CHUNK", "Context", "Peer", "index_batches", "chunk_shuffle"]

Batch = tuple[np.ndarray, np.ndarray]
#: Chunk length (images) of the HDF5, zarr and bcolz peers: one batch per chunk.
PEER_CHUNK = 32


@dataclass
class Context:
    """What a peer needs to build or read: the image folder and the run's settings."""

    root: str
    limit: int | None
    image_size: tuple[int, int] | None
    batch_size: int
    seed: int
    #: ``grayscale``, ``rgb`` or ``rgba``, as ``carraystore ingest --color-mode``
    color_mode: str = "rgb"
    _folder: ImageFolder | None = field(default=None, repr=False)
    _images: np.ndarray | None = field(default=None, repr=False)

    @property
    def folder(self) -> ImageFolder:
        if self._folder is None:
            self._folder = list_image_folder(self.root, limit=self.limit, seed=self.seed)
        return self._folder

    @property
    def images(self) -> np.ndarray:
        if self._images is None:
            self._images = decode_images(self.folder.files, self.image_size, color_mode=self.color_mode)
        return self._images

    def to_json(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "limit": self.limit,
            "image_size": self.image_size,
            "batch_size": self.batch_size,
            "seed": self.seed,
            "color_mode": self.color_mode,
        }

    @property
    def channels(self) -> int:
        """Channels of a decoded image: 1, 3 or 4."""
        return {"grayscale": 1, "rgb": 3, "rgba": 4}[self.color_mode]

    @property
    def pil_mode(self) -> str:
        """Pillow's name of the color mode: L, RGB or RGBA."""
        return {"grayscale": "L", "rgb": "RGB", "rgba": "RGBA"}[self.color_mode]


class Peer:
    """One way of loading the images. Subclasses fill in build/reader/files."""

    name = ""
    label = ""
    requires: tuple[str, ...] = ()
    on_disk = True
    #: True: ``build`` writes an artifact; False: the peer reads the image folder itself.
    builds = True

    def missing(self) -> str | None:
        """Why this peer cannot run here, or None."""
        for mod in self.requires:
            if importlib.util.find_spec(mod) is None:
                return f"{mod} is not installed"
        return None

    def build(self, ctx: Context, dest: Path) -> None:
        raise NotImplementedError

    def key(self) -> dict[str, Any]:
        """What else (beyond the images) the artifact depends on; a change rebuilds it."""
        return {}

    def files(self, ctx: Context, dest: Path) -> list[Path]:
        """Paths to evict for a cold-cache epoch."""
        return [dest]

    def reader(self, ctx: Context, dest: Path) -> Callable[[int], Iterator[Batch]]:
        """A function epoch -> iterator of (x, y) batches (x any array, y int labels).

        A reader holding a memory map gives the function a ``close`` attribute: pages a live
        map has touched survive ``posix_fadvise(DONTNEED)``, so the child closes the reader
        and opens a new one before each eviction.
        """
        raise NotImplementedError


def _perm(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def index_batches(n: int, batch_size: int, seed: int, epoch: int) -> Iterator[np.ndarray]:
    p = _perm(n, seed, epoch)
    for i in range(0, n, batch_size):
        yield p[i : i + batch_size]


def chunk_shuffle(
    n: int,
    chunk: int,
    batch_size: int,
    seed: int,
    epoch: int,
    read: Callable[[int, int], np.ndarray],
    labels: np.ndarray,
) -> Iterator[Batch]:
    """The chunk-shuffle generator: chunks in random order, images shuffled inside each chunk."""
    rng = np.random.default_rng([seed, epoch])
    nchunks = -(-n // chunk)
    pend_x: list[np.ndarray] = []
    pend_y: list[np.ndarray] = []
    have = 0
    for c in rng.permutation(nchunks):
        a, b = int(c) * chunk, min(n, (int(c) + 1) * chunk)
        x = read(a, b)
        order = rng.permutation(b - a)
        pend_x.append(x[order])
        pend_y.append(labels[a:b][order])
        have += b - a
        while have >= batch_size:
            xs, ys = np.concatenate(pend_x), np.concatenate(pend_y)
            yield xs[:batch_size], ys[:batch_size]
            pend_x, pend_y = [xs[batch_size:]], [ys[batch_size:]]
            have -= batch_size
    if have:
        yield np.concatenate(pend_x), np.concatenate(pend_y)
