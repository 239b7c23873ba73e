"""Side-by-side loader comparison: the same images through every common way of feeding them.

Peers (each skipped with a reason when its library is missing):

- ``keras_load_img``: ``keras.utils.load_img`` + ``img_to_array`` per file (float32, as
  in the Keras tutorials) — the baseline published caching speedups were measured against;
- ``pillow_threads``: Pillow per file, decoded by a thread pool (one thread per core);
- ``tfdata_jpeg``: tf.data from the JPEG files, ``decode_jpeg`` with parallel map;
- ``tfrecord``: TFRecord shards of JPEG bytes through tf.data (interleaved reads, shuffle buffer);
- ``npy_files``: one ``.npy`` per image, ``np.load`` per file;
- ``npz_cache``: one ``np.savez_compressed`` file, loaded whole every epoch;
- ``hdf5``: h5py, gzip-4, chunks of 32 images, read with a chunk-shuffle generator;
- ``zarr``: zarr v3 with ``BloscCodec()`` defaults, chunks of 32 images, chunk-shuffle generator;
- ``bcolz``: a legacy bcolz carray (lz4, written and read by ``carraystore.migrations.bcolz``),
  chunk-shuffle generator;
- ``numpy_memory``: the images in RAM, fancy-indexed batches (the upper bound);
- ``carraystore_<preset>_<shuffle>``: ``Store.batches`` with block or global shuffle.

Every on-disk artifact is written in the folder's (class-sorted) order — the worst case
for chunk-level shuffling, which the "distinct labels per batch" column shows.

Every artifact is built first. Then ``epochs`` rounds run every peer once each, in a
fresh Python process (``python -m carraystore.benchmarks.loaders --child``), so that its
peak RSS (``VmHWM``) is its own and so that other work on the machine falls on all
peers alike. In a round, a peer reads two untimed batches (imports, thread pools,
graph tracing), then its files are evicted from the page cache
(``posix_fadvise(DONTNEED)``) and a cold epoch is timed, then (the cache now holding
the files) a warm epoch. Reported numbers are medians over the rounds.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.benchmarks.datasets import (
    ImageFolder,
    decode_images,
    evict_from_page_cache,
    list_image_folder,
    path_size,
)
from carraystore.errors import InvalidInputError

__all__ = [
    "PEERS",
    "ON_DISK",
    "PeerResult",
    "Comparison",
    "available_peers",
    "run_comparison",
    "write_results",
    "results_table",
    "plot_results",
    "check_goals",
    "library_versions",
    "machine_info",
]

Batch = tuple[np.ndarray, np.ndarray]
#: Chunk length (images) of the HDF5, zarr and bcolz peers: one batch per chunk.
PEER_CHUNK = 32
BUILD_VERSION = "1"  # bump to invalidate cached artifacts when a builder changes


# ---------------------------------------------------------------------------------------
# peers
# ---------------------------------------------------------------------------------------


@dataclass
class Context:
    """What a peer needs to build or read: the image folder and the run's settings."""

    root: str
    limit: int | None
    image_size: tuple[int, int] | None
    batch_size: int
    seed: int
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
            self._images = decode_images(self.folder.files, self.image_size)
        return self._images

    def to_json(self) -> dict[str, Any]:
        return {"root": self.root, "limit": self.limit, "image_size": self.image_size, "batch_size": self.batch_size, "seed": self.seed}


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
        """A function epoch -> iterator of (x, y) batches (x any array, y int labels)."""
        raise NotImplementedError


def _perm(n: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n)


def _index_batches(n: int, batch_size: int, seed: int, epoch: int) -> Iterator[np.ndarray]:
    p = _perm(n, seed, epoch)
    for i in range(0, n, batch_size):
        yield p[i : i + batch_size]


def _chunk_shuffle(
    n: int, chunk: int, batch_size: int, seed: int, epoch: int, read: Callable[[int, int], np.ndarray], labels: np.ndarray
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


class KerasLoadImg(Peer):
    name = "keras_load_img"
    label = "Keras load_img per file"
    requires = ("keras",)
    builds = False

    def files(self, ctx: Context, dest: Path) -> list[Path]:
        return list(ctx.folder.files)

    def reader(self, ctx: Context, dest: Path) -> Callable[[int], Iterator[Batch]]:
        os.environ.setdefault("KERAS_BACKEND", "tensorflow")
        from keras.utils import img_to_array, load_img

        files, labels = ctx.folder.files, ctx.folder.labels
        size = ctx.image_size

        def epoch(e: int) -> Iterator[Batch]:
            for idx in _index_batches(len(files), ctx.batch_size, ctx.seed, e):
                x = np.stack([img_to_array(load_img(files[i], target_size=size)) for i in idx])
                yield x, labels[idx]

        return epoch


class PillowThreads(Peer):
    name = "pillow_threads"
    label = "Pillow per file, thread pool"
    requires = ("PIL",)
    builds = False

    def files(self, ctx: Context, dest: Path) -> list[Path]:
        return list(ctx.folder.files)

    def reader(self, ctx: Context, dest: Path) -> Callable[[int], Iterator[Batch]]:
        from concurrent.futures import ThreadPoolExecutor

        from PIL import Image

        files, labels = ctx.folder.files, ctx.folder.labels
        size = ctx.image_size
        pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1)

        def load(i: int) -> np.ndarray:
            with Image.open(files[i]) as im:
                im = im.convert("RGB")
                if size is not None and im.size != (size[1], size[0]):
                    im = im.resize((size[1], size[0]), Image.BILINEAR)
                return np.asarray(im)

        def epoch(e: int) -> Iterator[Batch]:
            batches = list(_index_batches(len(files), ctx.batch_size, ctx.seed, e))
            pending = None  # one batch is decoding ahead of the consumer
            for k, idx in enumerate(batches):
                if pending is None:
                    pending = [pool.submit(load, int(i)) for i in idx]
                nxt = [pool.submit(load, int(i)) for i in batches[k + 1]] if k + 1 < len(batches) else None
                x = np.stack([f.result() for f in pending])
                pending = nxt
                yield x, labels[idx]

        return epoch


def _tf() -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

    return tf


def _tf_decode(tf: Any, data: Any, size: tuple[int, int] | None) -> Any:
    img = tf.io.decode_image(data, channels=3, expand_animations=False)
    if size is not None:
        img = tf.cast(tf.image.resize(img, size), tf.uint8)
    return img


def _tf_epoch(ds: Any) -> Callable[[int], Iterator[Batch]]:
    def epoch(e: int) -> Iterator[Batch]:
        for x, y in ds:
            yield x, y.numpy()

    return epoch


class TfDataJpeg(Peer):
    name = "tfdata_jpeg"
    label = "tf.data from JPEG files (parallel decode)"
    requires = ("tensorflow",)
    builds = False

    def files(self, ctx: Context, dest: Path) -> list[Path]:
        return list(ctx.folder.files)

    def reader(self, ctx: Context, dest: Path) -> Callable[[int], Iterator[Batch]]:
        tf = _tf()
        files = [str(p) for p in ctx.folder.files]
        size = ctx.image_size
        auto = tf.data.AUTOTUNE

        def load(path: Any, y: Any) -> Any:
            return _tf_decode(tf, tf.io.read_file(path), size), y

        ds = (
            tf.data.Dataset.from_tensor_slices((files, ctx.folder.labels))
            .shuffle(len(files), seed=ctx.seed, reshuffle_each_iteration=True)
            .map(load, num_parallel_calls=auto)
            .batch(ctx.batch_size)
            .prefetch(auto)
        )
        return _tf_epoch(ds)


class TfRecord(Peer):
    name = "tfrecord"
    label = "TFRecord shards of JPEG bytes, tf.data"
    requires = ("tensorflow",)
    shards = 8
    shuffle_buffer = 1024

    def build(self, ctx: Context, dest: Path) -> None:
        tf = _tf()
        dest.mkdir(parents=True)
        files, labels = ctx.folder.files, ctx.folder.labels
        per = -(-len(files) // self.shards)
        for s in range(self.shards):
            with tf.io.TFRecordWriter(str(dest / f"shard-{s:03d}.tfrecord")) as w:
                for i in range(s * per, min(len(files), (s + 1) * per)):
                    data = Path(files[i]).read_bytes()
                    if ctx.image_size is not None:  # store resized JPEGs, as a converter would
                        from io import BytesIO

                        from PIL import Image

                        buf = BytesIO()
                        Image.fromarray(ctx.images[i]).save(buf, format="JPEG", quality=90)
                        data = buf.getvalue()
                    ex = tf.train.Example(
                        features=tf.train.Features(
                            feature={
                                "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[data])),
                                "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(labels[i])])),
                            }
                        )
                    )
                    w.write(ex.SerializeToString())

    def reader(self, ctx: Context, dest: Path) -> Callable[[int], Iterator[Batch]]:
        tf = _tf()
        auto = tf.data.AUTOTUNE
        spec = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}

        def parse(rec: Any) -> Any:
            ex = tf.io.parse_single_example(rec, spec)
            return tf.io.decode_jpeg(ex["image"], channels=3), ex["label"]

        shards = sorted(str(p) for p in dest.glob("*.tfrecord"))
        ds = (
            tf.data.Dataset.from_tensor_slices(shards)
            .shuffle(len(shards), seed=ctx.seed, reshuffle_each_iteration=True)
            .interleave(tf.data.TFRecordDataset, cycle_length=len(shards), num_parallel_calls=auto, deterministic=False)
            .shuffle(self.shuffle_buffer, seed=ctx.seed, reshuffle_each_iteration=True)
            .map(parse, num_parallel_calls=auto)
            .batch(ctx.batch_size)
            .prefetch(auto)
        )
        return _tf_epoch(ds)


class NpyFiles(Peer):
    name = "npy_files"
    label = "one .npy per image"

    def build(self, ctx: Context, dest: Path) -> None:
        dest.mkdir(parents=True)
        for i, img in enumerate(ctx.images):
            np.save(dest / f"{i:07d}.npy", img)
        np.save(dest / "labels.npy", ctx.folder.labels)

    def reader(self, ctx: Context, dest: Path) -> Callable[[int], Iterator[Batch]]:
        labels = np.load(dest / "labels.npy")
        files = [dest / f"{i:07d}.npy" for i in range(len(labels))]

        def epoch(e: int) -> Iterator[Batch]:
            for idx in _index_batches(len(files), ctx.batch_size, ctx.seed, e):
                yield np.stack([np.load(files[i]) for i in idx]), labels[idx]

        return epoch


class NpzCache(Peer):
    name = "npz_cache"
    label = "np.savez_compressed cache"

    def build(self, ctx: Context, dest: Path) -> None:
        dest.mkdir(parents=True)
        np.savez_compressed(dest / "cache.npz", x=ctx.images, y=ctx.folder.labels)

    def reader(self, ctx: Context, dest: Path) -> Callable[[int], Iterator[Batch]]:
        def epoch(e: int) -> Iterator[Batch]:
            with np.load(dest / "cache.npz") as f:
                x, y = f["x"], f["y"]
            for idx in _index_batches(len(x), ctx.batch_size, ctx.seed, e):
                yield x[idx], y[idx]

        return epoch


class Hdf5(Peer):
    name = "hdf5"
    label = "HDF5 (h5py) gzip, chunk-shuffle"
    requires = ("h5py",)

    def build(self, ctx: Context, dest: Path) -> None:
        import h5py

        dest.mkdir(parents=True)
        x = ctx.images
        with h5py.File(dest / "data.h5", "w") as f:
            f.create_dataset("x", data=x, chunks=(min(PEER_CHUNK, len(x)), *x.shape[1:]), compression="gzip")
            f.create_dataset("y", data=ctx.folder.labels)

    def reader(self, ctx: Context, dest: Path) -> Callable[[int], Iterator[Batch]]:
        import h5py

        f = h5py.File(dest / "data.h5", "r")
        x, y = f["x"], f["y"][:]
        chunk = x.chunks[0]

        def epoch(e: int) -> Iterator[Batch]:
            return _chunk_shuffle(len(y), chunk, ctx.batch_size, ctx.seed, e, lambda a, b: x[a:b], y)

        return epoch


class Zarr(Peer):
    name = "zarr"
    label = "zarr v3 + blosc, chunk-shuffle"
    requires = ("zarr",)

    def build(self, ctx: Context, dest: Path) -> None:
        import zarr
        from zarr.codecs import BloscCodec

        dest.mkdir(parents=True)
        x = ctx.images
        z = zarr.create_array(
            store=str(dest / "data.zarr"),
            shape=x.shape,
            chunks=(min(PEER_CHUNK, len(x)), *x.shape[1:]),
            dtype=x.dtype,
            compressors=BloscCodec(),
            zarr_format=3,
        )
        z[:] = x
        np.save(dest / "labels.npy", ctx.folder.labels)

    def reader(self, ctx: Context, dest: Path) -> Callable[[int], Iterator[Batch]]:
        import zarr

        z = zarr.open_array(str(dest / "data.zarr"), mode="r")
        y = np.load(dest / "labels.npy")
        chunk = z.chunks[0]

        def epoch(e: int) -> Iterator[Batch]:
            return _chunk_shuffle(len(y), chunk, ctx.batch_size, ctx.seed, e, lambda a, b: z[a:b], y)

        return epoch


class Bcolz(Peer):
    name = "bcolz"
    label = "legacy bcolz carray (lz4), chunk-shuffle"

    def missing(self) -> str | None:
        try:
            from carraystore.migrations import bcolz as mod
        except ImportError as exc:
            return f"carraystore.migrations.bcolz is not available ({exc})"
        if not hasattr(mod, "write_carray") or not hasattr(mod, "CarrayReader"):
            return "carraystore.migrations.bcolz has no write_carray() / CarrayReader yet"
        if importlib.util.find_spec("numcodecs") is None:
            return "numcodecs is not installed (bcolz chunks are c-blosc 1.x)"
        return None

    def build(self, ctx: Context, dest: Path) -> None:
        from carraystore.migrations.bcolz import write_carray

        dest.mkdir(parents=True)
        write_carray(dest / "x", ctx.images, chunklen=PEER_CHUNK, cname="lz4", clevel=5, shuffle=1)
        np.save(dest / "labels.npy", ctx.folder.labels)

    def reader(self, ctx: Context, dest: Path) -> Callable[[int], Iterator[Batch]]:
        from carraystore.migrations.bcolz import CarrayReader

        arr = CarrayReader.open(dest / "x")
        y = np.load(dest / "labels.npy")
        buf = np.empty((arr.chunklen, *arr.item_shape), dtype=arr.dtype)

        def read(a: int, b: int) -> np.ndarray:
            return arr.read_chunk(a // arr.rows_per_file, out=buf)[: b - a]

        def epoch(e: int) -> Iterator[Batch]:
            return _chunk_shuffle(len(y), arr.rows_per_file, ctx.batch_size, ctx.seed, e, read, y)

        return epoch


class NumpyMemory(Peer):
    name = "numpy_memory"
    label = "in-memory numpy (upper bound)"
    on_disk = False

    def build(self, ctx: Context, dest: Path) -> None:
        dest.mkdir(parents=True)
        np.save(dest / "x.npy", ctx.images)
        np.save(dest / "y.npy", ctx.folder.labels)

    def files(self, ctx: Context, dest: Path) -> list[Path]:
        return []

    def reader(self, ctx: Context, dest: Path) -> Callable[[int], Iterator[Batch]]:
        x = np.load(dest / "x.npy")  # read once into RAM, outside the timed epochs
        y = np.load(dest / "y.npy")

        def epoch(e: int) -> Iterator[Batch]:
            for idx in _index_batches(len(x), ctx.batch_size, ctx.seed, e):
                yield x[idx], y[idx]

        return epoch


class CarrayStore(Peer):
    """``Store.batches`` on a store ingested with ``carraystore.from_directory`` (folder order)."""

    def __init__(self, preset: str, shuffle: str) -> None:
        self.preset = preset
        self.shuffle = shuffle
        self.name = f"carraystore_{preset}_{shuffle}"
        self.label = f"carraystore {preset}, {shuffle} shuffle"
        self.artifact = f"carraystore_{preset}"

    def key(self) -> dict[str, Any]:
        from carraystore.format import Codec

        return {"codec": Codec.preset(self.preset).to_config()}

    def build(self, ctx: Context, dest: Path) -> None:
        from carraystore.ingest import from_directory

        dest.mkdir(parents=True)
        from_directory(
            ctx.root if ctx.limit is None else _link_subset(ctx, dest),
            dest / "data.b2nd",
            image_size=ctx.image_size,
            codec=self.preset,
            keep_order=True,
            workers=os.cpu_count() or 1,
        )
        shutil.rmtree(dest / "_subset", ignore_errors=True)

    def reader(self, ctx: Context, dest: Path) -> Callable[[int], Iterator[Batch]]:
        from carraystore.reader import open_store

        store = open_store(dest / "data.b2nd")

        def epoch(e: int) -> Iterator[Batch]:
            with store.batches(ctx.batch_size, shuffle=self.shuffle, seed=ctx.seed, epoch=e) as it:
                yield from it

        return epoch


def _link_subset(ctx: Context, dest: Path) -> Path:
    """A folder of symlinks to the chosen subset (ingest reads whole folders)."""
    sub = dest / "_subset"
    for p in ctx.folder.files:
        rel = p.relative_to(ctx.folder.root)
        (sub / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(p.resolve(), sub / rel)
    return sub


#: Every peer, in table order.
PEERS: list[Peer] = [
    KerasLoadImg(),
    PillowThreads(),
    TfDataJpeg(),
    TfRecord(),
    NpyFiles(),
    NpzCache(),
    Hdf5(),
    Zarr(),
    Bcolz(),
    NumpyMemory(),
    CarrayStore("fast", "block"),
    CarrayStore("balanced", "block"),
    CarrayStore("small", "block"),
    CarrayStore("fast", "global"),
    CarrayStore("balanced", "global"),
]
PEER_BY_NAME = {p.name: p for p in PEERS}
#: Peers whose data lives on disk (the ones the goals compare against).
ON_DISK = [p.name for p in PEERS if p.on_disk and not isinstance(p, CarrayStore)]


def available_peers(names: Sequence[str] | None = None) -> tuple[list[Peer], dict[str, str]]:
    """The peers that can run here (optionally only ``names``) and a reason for each skipped one."""
    chosen = PEERS if names is None else [PEER_BY_NAME[n] for n in names]
    ok, skipped = [], {}
    for p in chosen:
        why = p.missing()
        if why is None:
            ok.append(p)
        else:
            skipped[p.name] = why
    return ok, skipped


def _artifact_dir(work: Path, peer: Peer) -> Path:
    return work / getattr(peer, "artifact", peer.name)


def build_artifact(peer: Peer, ctx: Context, work: Path) -> tuple[Path, float]:
    """Build (or reuse) ``peer``'s artifact under ``work``; returns its path and build seconds.

    An artifact is reused only if it was built from the same images (root, subset, size,
    file list) with the same builder version and peer settings (e.g. the preset's codec).
    """
    dest = _artifact_dir(work, peer)
    if not peer.builds:
        return dest, 0.0
    folder = ctx.folder
    key = {
        "version": BUILD_VERSION,
        "root": ctx.root,
        "limit": ctx.limit,
        "seed": ctx.seed,
        "image_size": list(ctx.image_size) if ctx.image_size else None,
        "files": len(folder.files),
        "sizes": sum(p.stat().st_size for p in folder.files),
        **peer.key(),
    }
    marker = dest / ".complete.json"
    if marker.exists():
        with contextlib.suppress(ValueError, KeyError, OSError):
            info = json.loads(marker.read_text())
            if info.get("key") == json.loads(json.dumps(key)):
                return dest, float(info["build_s"])
    shutil.rmtree(dest, ignore_errors=True)
    t = time.perf_counter()
    peer.build(ctx, dest)
    build_s = time.perf_counter() - t
    marker.write_text(json.dumps({"key": key, "build_s": build_s}))
    return dest, build_s


# ---------------------------------------------------------------------------------------
# the child process: one peer, warm then cold epochs
# ---------------------------------------------------------------------------------------


def _run_epoch(read: Callable[[int], Iterator[Batch]], e: int, batch_size: int) -> tuple[float, int, list[int]]:
    t = time.perf_counter()
    n = 0
    distinct = []
    for x, y in read(e):
        m = len(y)
        n += m
        if m == batch_size:
            distinct.append(len(np.unique(np.asarray(y))))
        del x
    return time.perf_counter() - t, n, distinct


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one round of one peer as described by ``spec`` (called in the child process).

    A round: two untimed batches (imports, thread pools, graph tracing), then with
    ``cold``: evict the peer's files and time a cold epoch, which also fills the page
    cache, then time a warm epoch; without ``cold``: one untimed epoch, one timed warm epoch.
    """
    ctx = Context(**spec["ctx"])
    if ctx.image_size is not None:
        ctx.image_size = tuple(ctx.image_size)  # type: ignore[assignment]
    peer = PEER_BY_NAME[spec["peer"]]
    dest = Path(spec["dest"])
    read = peer.reader(ctx, dest)
    files = peer.files(ctx, dest)
    base = 3 * int(spec.get("round", 0))  # a different shuffle every epoch of every round
    for i, _ in enumerate(read(base)):
        if i >= 1:
            break
    cold_t = None
    if spec["cold"] and files:
        evict_from_page_cache(files)
        cold_t, _, _ = _run_epoch(read, base + 1, ctx.batch_size)
    else:
        _run_epoch(read, base + 1, ctx.batch_size)
    warm_t, n, diversity = _run_epoch(read, base + 2, ctx.batch_size)
    return {
        "n": n,
        "warm_s": warm_t,
        "cold_s": cold_t,
        "diversity": float(np.mean(diversity)) if diversity else None,
        "peak_rss_mb": _maxrss_mb(),
    }


def _maxrss_mb() -> float:
    """Peak RSS of this process in MB.

    Linux: ``VmHWM`` of /proc/self/status, the high-water mark of this program's own
    memory; ``ru_maxrss`` would also count the parent's RSS at fork time, which Linux
    carries across ``exec``.
    """
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 1024 / 1024


# ---------------------------------------------------------------------------------------
# the comparison
# ---------------------------------------------------------------------------------------


@dataclass
class PeerResult:
    """One row of the comparison."""

    name: str
    label: str
    status: str  # "ok", "skipped" or "error"
    reason: str = ""
    n_images: int = 0
    images_per_s_warm: float | None = None
    images_per_s_cold: float | None = None
    mb_per_s_warm: float | None = None
    mb_per_s_cold: float | None = None
    bytes_on_disk: int | None = None
    peak_rss_mb: float | None = None
    diversity: float | None = None
    build_s: float | None = None
    warm_s: list[float] = field(default_factory=list)
    cold_s: list[float] = field(default_factory=list)
    on_disk: bool = True


@dataclass
class Comparison:
    """All rows plus what they were measured on."""

    rows: list[PeerResult]
    info: dict[str, Any]

    def row(self, name: str) -> PeerResult | None:
        return next((r for r in self.rows if r.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {"info": self.info, "rows": [asdict(r) for r in self.rows], "goals": check_goals(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Comparison:
        return cls([PeerResult(**r) for r in data["rows"]], data["info"])


def run_comparison(
    root: str | os.PathLike[str],
    work: str | os.PathLike[str],
    *,
    limit: int | None = None,
    image_size: tuple[int, int] | None = None,
    batch_size: int = 32,
    epochs: int = 3,
    cold: bool = True,
    seed: int = 0,
    peers: Sequence[str] | None = None,
    timeout_s: float = 600.0,
    progress: Callable[[str], None] | None = None,
) -> Comparison:
    """Build every available peer's copy of the images under ``work`` and time each in a fresh process."""
    say = progress or (lambda s: None)
    ctx = Context(str(Path(root).resolve()), limit, image_size, batch_size, seed)
    folder = ctx.folder
    n = len(folder)
    if n < batch_size:
        raise InvalidInputError(f"{root}: {n} images is fewer than one batch of {batch_size}")
    ok, skipped = available_peers(peers)
    load_before = _loadavg()
    workp = Path(work)
    workp.mkdir(parents=True, exist_ok=True)
    image_nbytes = _image_nbytes(ctx)
    jpeg_bytes = sum(p.stat().st_size for p in folder.files)
    runnable: list[tuple[Peer, Path, float]] = []
    results: dict[str, PeerResult] = {}
    for peer in (PEER_BY_NAME[x] for x in (peers or PEER_BY_NAME)):
        if peer.name in skipped:
            results[peer.name] = PeerResult(peer.name, peer.label, "skipped", skipped[peer.name], on_disk=peer.on_disk)
            say(f"{peer.name}: skipped ({skipped[peer.name]})")
            continue
        try:
            say(f"{peer.name}: building")
            dest, build_s = build_artifact(peer, ctx, workp)
        except Exception as exc:  # a broken peer must not stop the comparison
            results[peer.name] = PeerResult(peer.name, peer.label, "error", f"build failed: {exc!r}"[:500], on_disk=peer.on_disk)
            say(f"{peer.name}: build failed: {exc!r}")
            continue
        size = jpeg_bytes if not peer.builds else (path_size(dest) if peer.on_disk else path_size(dest / "x.npy"))
        results[peer.name] = PeerResult(
            peer.name, peer.label, "ok", n_images=n, bytes_on_disk=size, build_s=build_s if peer.builds else None,
            on_disk=peer.on_disk, peak_rss_mb=0.0,
        )
        runnable.append((peer, dest, build_s))
    # Rounds: every peer once per round, so that other work on the machine falls on all alike.
    for rnd in range(epochs):
        for peer, dest, _ in runnable:
            row = results[peer.name]
            if row.status != "ok":
                continue
            spec = {"peer": peer.name, "dest": str(dest), "ctx": ctx.to_json(), "round": rnd, "cold": cold}
            try:
                res = _spawn(spec, timeout_s)
            except Exception as exc:
                row.status, row.reason = "error", str(exc)[:500]
                say(f"{peer.name}: failed: {str(exc)[:300]}")
                continue
            if res["n"] != n:
                row.status, row.reason = "error", f"delivered {res['n']} images of {n}"
                continue
            row.warm_s.append(res["warm_s"])
            if res["cold_s"] is not None:
                row.cold_s.append(res["cold_s"])
            row.peak_rss_mb = max(row.peak_rss_mb or 0.0, res["peak_rss_mb"])
            if rnd == 0:
                row.diversity = res["diversity"]
            cold_txt = f", {n / res['cold_s']:.0f} cold" if res["cold_s"] else ""
            say(f"round {rnd + 1}/{epochs} {peer.name}: {n / res['warm_s']:.0f} img/s warm{cold_txt}")
    rows = []
    for name in peers or PEER_BY_NAME:
        row = results[name]
        if row.status == "ok":
            wm = statistics.median(row.warm_s)
            cm = statistics.median(row.cold_s) if row.cold_s else None
            row.images_per_s_warm = n / wm
            row.mb_per_s_warm = n / wm * image_nbytes / 1e6
            row.images_per_s_cold = n / cm if cm else None
            row.mb_per_s_cold = n / cm * image_nbytes / 1e6 if cm else None
        else:
            row.warm_s, row.cold_s = [], []
        rows.append(row)
    info = {
        "images": n,
        "image_shape": list(_image_shape(ctx)),
        "source": str(root),
        "source_bytes": jpeg_bytes,
        "batch_size": batch_size,
        "epochs": epochs,
        "cold": cold,
        "seed": seed,
        "machine": machine_info(),
        "versions": library_versions(),
        "date": time.strftime("%Y-%m-%d"),
        "load_average_before_after": [load_before, _loadavg()],
    }
    return Comparison(rows, info)


def _loadavg() -> float | None:
    """The 1-minute load average (other work on the machine skews timings), or None."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _image_shape(ctx: Context) -> tuple[int, ...]:
    if ctx._images is not None:
        return tuple(ctx._images.shape[1:])
    return tuple(decode_images(ctx.folder.files[:1], ctx.image_size).shape[1:])


def _image_nbytes(ctx: Context) -> int:
    return int(math.prod(_image_shape(ctx)))


def _spawn(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("KERAS_BACKEND", "tensorflow")
    proc = subprocess.run(
        [sys.executable, "-m", "carraystore.benchmarks.loaders", "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"exit status {proc.returncode}: " + " | ".join(tail))
    return json.loads(lines[-1])


# ---------------------------------------------------------------------------------------
# goals, tables, charts
# ---------------------------------------------------------------------------------------


def check_goals(cmp: Comparison) -> dict[str, Any]:
    """The issue's three goals, measured: each with ``met`` (True/False/None) and the numbers."""
    ok = [r for r in cmp.rows if r.status == "ok"]
    disk = [r for r in ok if r.name in ON_DISK]
    goals: dict[str, Any] = {}
    fast = cmp.row("carraystore_fast_block")
    if fast and fast.status == "ok" and disk:
        best = max(disk, key=lambda r: r.images_per_s_warm or 0)
        ratio = (fast.images_per_s_warm or 0) / (best.images_per_s_warm or 1)
        goals["warm_fast_2x"] = {
            "met": ratio >= 2.0,
            "carraystore": fast.images_per_s_warm,
            "best_peer": best.name,
            "best_peer_images_per_s": best.images_per_s_warm,
            "ratio": ratio,
        }
    default = cmp.row("carraystore_balanced_block")
    cold_disk = [r for r in disk if r.images_per_s_cold]
    if default and default.status == "ok" and default.images_per_s_cold and cold_disk:
        best = max(cold_disk, key=lambda r: r.images_per_s_cold or 0)
        goals["cold_default_beats_all"] = {
            "met": default.images_per_s_cold > (best.images_per_s_cold or 0),
            "carraystore": default.images_per_s_cold,
            "best_peer": best.name,
            "best_peer_images_per_s": best.images_per_s_cold,
            "ratio": default.images_per_s_cold / (best.images_per_s_cold or 1),
        }
    small = next((r for r in ok if r.name == "carraystore_small_block"), None)
    npz = cmp.row("npz_cache")
    if small and npz and npz.status == "ok" and small.bytes_on_disk and npz.bytes_on_disk:
        goals["small_not_larger_than_npz"] = {
            "met": small.bytes_on_disk <= npz.bytes_on_disk,
            "carraystore_small_bytes": small.bytes_on_disk,
            "npz_bytes": npz.bytes_on_disk,
            "ratio": small.bytes_on_disk / npz.bytes_on_disk,
        }
    return goals


def _fmt(v: float | None, digits: int = 0) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def results_table(cmp: Comparison) -> str:
    """The comparison as a markdown table."""
    lines = [
        "| loader | images/s warm | images/s cold | MB/s warm | MB/s cold | on disk MB | peak RSS MB | labels/batch | build s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in cmp.rows:
        if r.status != "ok":
            lines.append(f"| {r.label} | {r.status}: {r.reason} | | | | | | | |")
            continue
        disk = _fmt(r.bytes_on_disk / 1e6, 1) if r.bytes_on_disk is not None else "—"
        lines.append(
            f"| {r.label} | {_fmt(r.images_per_s_warm)} | {_fmt(r.images_per_s_cold)} | {_fmt(r.mb_per_s_warm)} | "
            f"{_fmt(r.mb_per_s_cold)} | {disk} | {_fmt(r.peak_rss_mb)} | {_fmt(r.diversity, 1)} | {_fmt(r.build_s, 1)} |"
        )
    return "\n".join(lines) + "\n"


def goals_text(cmp: Comparison) -> str:
    """The goals as plain sentences with the numbers."""
    g = check_goals(cmp)
    out = []
    if "warm_fast_2x" in g:
        x = g["warm_fast_2x"]
        out.append(
            f"- Warm cache, `fast` preset, block shuffle: {x['carraystore']:,.0f} images/s vs {x['best_peer_images_per_s']:,.0f} "
            f"for the fastest on-disk peer ({x['best_peer']}): {x['ratio']:.2f}x — goal >= 2x **{'met' if x['met'] else 'NOT met'}**."
        )
    if "cold_default_beats_all" in g:
        x = g["cold_default_beats_all"]
        out.append(
            f"- Cold cache, default (`balanced`) preset, block shuffle: {x['carraystore']:,.0f} images/s vs "
            f"{x['best_peer_images_per_s']:,.0f} for the fastest on-disk peer ({x['best_peer']}): {x['ratio']:.2f}x — "
            f"goal > 1x **{'met' if x['met'] else 'NOT met'}**."
        )
    if "small_not_larger_than_npz" in g:
        x = g["small_not_larger_than_npz"]
        out.append(
            f"- `small` store {x['carraystore_small_bytes'] / 1e6:,.1f} MB vs `.npz` cache {x['npz_bytes'] / 1e6:,.1f} MB "
            f"({x['ratio']:.2f}x) — goal <= 1x **{'met' if x['met'] else 'NOT met'}**."
        )
    return "\n".join(out) + ("\n" if out else "")


def plot_results(cmp: Comparison, path: str | os.PathLike[str]) -> Path | None:
    """A horizontal bar chart of images/s, warm and cold; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in cmp.rows if r.status == "ok"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    y = np.arange(len(rows))
    warm = [r.images_per_s_warm or 0 for r in rows]
    cold = [r.images_per_s_cold or 0 for r in rows]
    colors = ["tab:purple" if r.name.startswith("carraystore") else ("tab:gray" if not r.on_disk else "tab:blue") for r in rows]
    ax.barh(y - 0.2, warm, height=0.4, color=colors, label="warm page cache")
    ax.barh(y + 0.2, cold, height=0.4, color=colors, alpha=0.45, label="cold (evicted before each epoch)")
    for yi, w in zip(y, warm):
        ax.text(w, yi - 0.2, f" {w:,.0f}", va="center", fontsize=7)
    ax.set_yticks(y, [r.label for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("images/s (log scale; higher is better)")
    shape = "x".join(str(s) for s in cmp.info.get("image_shape", []))
    ax.set_title(f"{cmp.info.get('images')} images of {shape}, batch {cmp.info.get('batch_size')}, "
                 f"median of {cmp.info.get('epochs')} rounds, {cmp.info.get('machine', {}).get('cpus')} cores", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_results(cmp: Comparison, out_dir: str | os.PathLike[str], stem: str = "loaders") -> dict[str, Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cmp.to_json(), indent=1))
    os.replace(tmp, paths["json"])
    paths["md"].write_text(markdown_report(cmp))
    png = plot_results(cmp, out / f"{stem}.png")
    if png is not None:
        paths["png"] = png
    return paths


def markdown_report(cmp: Comparison, heading: str = "# Loader comparison") -> str:
    """Heading, what it ran on, the table and the goals."""
    i = cmp.info
    m = i.get("machine", {})
    shape = "x".join(str(s) for s in i.get("image_shape", []))
    vers = ", ".join(f"{k} {v}" for k, v in i.get("versions", {}).items())
    lines = [
        heading,
        "",
        f"{i.get('images')} images of {shape} (uint8) from `{Path(str(i.get('source', ''))).name}`, batch {i.get('batch_size')}, "
        f"median of {i.get('epochs')} rounds; in each round every loader runs in a fresh process (peak RSS is its own, "
        "imports included): a cold epoch (every file of the loader evicted from the page cache first), then a warm epoch. "
        "On-disk copies are written in class-sorted folder order (the worst case for chunk-level shuffles: see labels/batch).",
        "",
        f"Machine: {m.get('cpus')} cores ({m.get('cpu')}), {m.get('memory_gb')} GB RAM, {m.get('system')}, Python {m.get('python')}; "
        f"measured {i.get('date')}"
        + (f"; 1-minute load average {i['load_average_before_after'][0]} before, {i['load_average_before_after'][1]} after "
           "(the machine was shared: loads above the core count slow every row)" if i.get("load_average_before_after") else "")
        + ".",
        "",
        f"Libraries: {vers}.",
        "",
        results_table(cmp),
        goals_text(cmp),
    ]
    skipped = [r for r in cmp.rows if r.status != "ok"]
    if skipped:
        lines += ["Not measured:", ""] + [f"- {r.label}: {r.status} ({r.reason})" for r in skipped] + [""]
    return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    """CPU count and model, memory, OS and Python of this machine."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(Exception):
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    return {
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu": cpu,
        "memory_gb": mem,
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }


def library_versions() -> dict[str, str]:
    """Versions of carraystore and of every peer's library that is installed."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("carraystore", "blosc2", "numpy", "pillow", "tensorflow-cpu", "tensorflow", "keras", "h5py", "zarr", "numcodecs"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            continue
    if "tensorflow-cpu" in out and "tensorflow" in out:
        del out["tensorflow"]
    return out


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child_main(json.loads(args.child))
        sys.stdout.write(json.dumps(result) + "\n")
        return 0
    parser.error("use `carraystore bench loaders DIR`")
    return 2


if __name__ == "__main__":
    sys.exit(_main())
