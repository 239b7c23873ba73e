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

__all__ = ["NpyFiles", "NpzCache", "Hdf5", "Zarr", "Bcolz", "Lance", "NumpyMemory", "CarrayStore", "MigratedBcolz"]


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


class Lance(Peer):
    """A Lance dataset of the pixels (one fixed-size list of uint8 per image), read by random ``take`` per batch."""

    name = "lance"
    label = "Lance dataset of pixels, random take"
    requires = ("lance", "pyarrow")

    def build(self, ctx: Context, dest: Path) -> None:
        import lance
        import pyarrow as pa

        dest.mkdir(parents=True)
        x = ctx.images
        flat = pa.array(np.ascontiguousarray(x).reshape(-1), type=pa.uint8())
        pixels = pa.FixedSizeListArray.from_arrays(flat, int(np.prod(x.shape[1:])))
        table = pa.table({"image": pixels, "label": pa.array(ctx.folder.labels.astype(np.int64))})
        lance.write_dataset(table, str(dest / "data.lance"))
        np.save(dest / "shape.npy", np.array(x.shape[1:]))

    def reader(self, ctx: Context, dest: Path) -> Callable[[int], Iterator[Batch]]:
        import lance

        ds = lance.dataset(str(dest / "data.lance"))
        shape = tuple(int(v) for v in np.load(dest / "shape.npy"))
        n = ds.count_rows()

        def epoch(e: int) -> Iterator[Batch]:
            for idx in index_batches(n, ctx.batch_size, ctx.seed, e):
                t = ds.take(idx.tolist(), columns=["image", "label"])
                x = t.column("image").combine_chunks().flatten().to_numpy().reshape(len(idx), *shape)
                yield x, t.column("label").to_numpy()

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
    """``Store.batches`` on a store ingested with ``carraystore.from_directory`` (folder order).

    ``preset`` ``"encoded"``: the encoded layout (each JPEG file's own bytes, the layout's codec),
    decoded by the loader's threads.
    """

    def __init__(self, preset: str, shuffle: str) -> None:
        self.preset = preset
        self.shuffle = shuffle
        self.name = f"carraystore_{preset}_{shuffle}"
        self.label = (
            f"carraystore encoded layout (JPEG files), {shuffle} shuffle"
            if preset == "encoded"
            else f"carraystore {preset}, {shuffle} shuffle"
        )
        self.artifact = f"carraystore_{preset}"

    def key(self) -> dict[str, Any]:
        from carraystore.format.codec import Codec

        if self.preset == "encoded":
            return {"layout": "encoded"}
        return {"codec": Codec.preset(self.preset).to_config()}

    def build(self, ctx: Context, dest: Path) -> None:
        from carraystore.ingest.run import from_directory

        dest.mkdir(parents=True)
        how: dict[str, Any] = {"layout": "encoded"} if self.preset == "encoded" else {"codec": self.preset}
        from_directory(
            ctx.root if ctx.limit is None else _link_subset(ctx, dest),
            dest / "data.b2nd",
            image_size=ctx.image_size,
            color_mode=ctx.color_mode,
            keep_order=True,
            workers=os.cpu_count() or 1,
            **how,
        )
        shutil.rmtree(dest / "_subset", ignore_errors=True)

    def reader(self, ctx: Context, dest: Path) -> Callable[[int], Iterator[Batch]]:
        from carraystore.api.store import open_store

        store = open_store(dest / "data.b2nd")

        def epoch(e: int) -> Iterator[Batch]:
            with store.batches(ctx.batch_size, shuffle=self.shuffle, seed=ctx.seed, epoch=e) as it:
                yield from cast(Iterator[Batch], it)  # ingested from class folders: y is never None

        # the store's memory map keeps the pages it touched resident through an eviction: the child closes it first
        epoch.close = store.close  # type: ignore[attr-defined]
        return epoch


class MigratedBcolz(CarrayStore):
    """The bcolz peer's carrays (lz4-5, byte shuffle, chunks of 32 images) migrated with ``carraystore.migrate``'s
    defaults: what a bcolz user gets without choosing a codec; read with ``Store.batches``."""

    def __init__(self, shuffle: str = "block") -> None:
        super().__init__("migrated", shuffle)
        self.name = f"carraystore_from_bcolz_{shuffle}"
        self.label = f"carraystore migrated from bcolz (default codec), {shuffle} shuffle"
        self.artifact = "carraystore_from_bcolz"

    def missing(self) -> str | None:
        return Bcolz().missing()

    def key(self) -> dict[str, Any]:
        from carraystore.migrations.bcolz import default_codec_for

        return {"codec": default_codec_for({"cname": "lz4", "clevel": 5, "shuffle": 1}).to_config()}

    def build(self, ctx: Context, dest: Path) -> None:
        from carraystore.migrations.core import migrate
        from testsupport.bcolz_writer import write_carray

        dest.mkdir(parents=True)
        src = dest / "_bcolz"
        write_carray(src / "x", ctx.images, chunklen=PEER_CHUNK, cname="lz4", clevel=5, shuffle=1)
        write_carray(src / "y", ctx.folder.labels.astype(np.int64), chunklen=4096, cname="lz4", clevel=5, shuffle=1)
        migrate(None, dest / "data.b2nd", images=src / "x", labels=src / "y")
        shutil.rmtree(src)


def _link_subset(ctx: Context, dest: Path) -> Path:
    """A folder of symlinks to the chosen subset (ingest reads whole folders)."""
    sub = dest / "_subset"
    for p in ctx.folder.files:
        rel = p.relative_to(ctx.folder.root)
        (sub / rel).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(p.resolve(), sub / rel)
    return sub
