"""Peers that read a converted copy of the decoded images: .npy files, .npz, HDF5, zarr, bcolz, numpy in RAM, carraystore."""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np

from bench.loaders.peer import PEER_CHUNK, Batch, Context, Peer, chunk_shuffle, index_batches

__all__ = ["NpyFiles", "NpzCache", "Hdf5", "Zarr", "Bcolz", "NumpyMemory", "CarrayStore"]


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
            for idx in index_batches(len(files), ctx.batch_size, ctx.seed, e):
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
            for idx in index_batches(len(x), ctx.batch_size, ctx.seed, e):
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
            return chunk_shuffle(len(y), chunk, ctx.batch_size, ctx.seed, e, lambda a, b: x[a:b], y)

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
            return chunk_shuffle(len(y), chunk, ctx.batch_size, ctx.seed, e, lambda a, b: np.asarray(z[a:b]), y)

        return epoch


class Bcolz(Peer):
    name = "bcolz"
    label = "legacy bcolz carray (lz4), chunk-shuffle"

    def missing(self) -> str | None:
        if importlib.util.find_spec("numcodecs") is None:
            return "numcodecs is not installed (bcolz chunks are c-blosc 1.x)"
        return None

    def build(self, ctx: Context, dest: Path) -> None:
        from testsupport.bcolz_writer import write_carray

        dest.mkdir(parents=True)
        write_carray(dest / "x", ctx.images, chunklen=PEER_CHUNK, cname="lz4", clevel=5, shuffle=1)
        np.save(dest / "labels.npy", ctx.folder.labels)

    def reader(self, ctx: Context, dest: Path) -> Callable[[int], Iterator[Batch]]:
        from carraystore.migrations.bcolz import CarrayReader

        arr = CarrayReader.open(dest / "x")
        y = np.load(dest / "labels.npy")
        buf = np.empty((arr.chunklen, *arr.item_shape), dtype=arr.dtype)

        def read(a: int, b: int) -> np.ndarray:
            return np.asarray(arr.read_chunk(a // arr.rows_per_file, out=buf)[: b - a])

        def epoch(e: int) -> Iterator[Batch]:
            return chunk_shuffle(len(y), arr.rows_per_file, ctx.batch_size, ctx.seed, e, read, y)

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
            for idx in index_batches(len(x), ctx.batch_size, ctx.seed, e):
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
        from carraystore.format.codec import Codec

        return {"codec": Codec.preset(self.preset).to_config()}

    def build(self, ctx: Context, dest: Path) -> None:
        from carraystore.ingest.run import from_directory

        dest.mkdir(parents=True)
        from_directory(
            ctx.root if ctx.limit is None else _link_subset(ctx, dest),
            dest / "data.b2nd",
            image_size=ctx.image_size,
            color_mode=ctx.color_mode,
            codec=self.preset,
            keep_order=True,
            workers=os.cpu_count() or 1,
        )
        shutil.rmtree(dest / "_subset", ignore_errors=True)

    def reader(self, ctx: Context, dest: Path) -> Callable[[int], Iterator[Batch]]:
        from carraystore.api.store import open_store

        store = open_store(dest / "data.b2nd")

        def epoch(e: int) -> Iterator[Batch]:
            with store.batches(ctx.batch_size, shuffle=self.shuffle, seed=ctx.seed, epoch=e) as it:
                yield from cast(Iterator[Batch], it)  # ingested from class folders: y is never None

        return epoch


def _link_subset(ctx: Context, dest: Path) -> Path:
    """A folder of symlinks to the chosen subset (ingest reads whole folders)."""
    sub = dest / "_subset"
    for p in ctx.folder.files:
        rel = p.relative_to(ctx.folder.root)
        (sub / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(p.resolve(), sub / rel)
    return sub
