"""Peers that read the image files themselves (Keras load_img, Pillow threads, tf.data) or their JPEG bytes (TFRecord)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.loaders.peer import Batch, Context, Peer, index_batches

__all__ = ["KerasLoadImg", "PillowThreads", "TfDataJpeg", "TfRecord"]


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
            for idx in index_batches(len(files), ctx.batch_size, ctx.seed, e):
                x = np.stack(
                    [img_to_array(load_img(files[i], color_mode=ctx.color_mode, target_size=size)) for i in idx]
                )
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
                im = im.convert(ctx.pil_mode)
                if size is not None and im.size != (size[1], size[0]):
                    im = im.resize((size[1], size[0]), Image.Resampling.BILINEAR)
                arr = np.asarray(im)
                return arr[..., None] if arr.ndim == 2 else arr

        def epoch(e: int) -> Iterator[Batch]:
            batches = list(index_batches(len(files), ctx.batch_size, ctx.seed, e))
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


def _tf_decode(tf: Any, data: Any, size: tuple[int, int] | None, channels: int = 3) -> Any:
    if channels == 4:  # JPEG has no alpha: decode RGB and add an opaque alpha, as Pillow's convert("RGBA") does

        def jpeg() -> Any:
            rgb = tf.io.decode_jpeg(data, channels=3)
            return tf.concat(
                [rgb, tf.fill(tf.concat([tf.shape(rgb)[:2], [1]], 0), tf.constant(255, tf.uint8))], axis=-1
            )

        img = tf.cond(tf.io.is_jpeg(data), jpeg, lambda: tf.io.decode_image(data, channels=4, expand_animations=False))
    else:
        img = tf.io.decode_image(data, channels=channels, expand_animations=False)
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
            return _tf_decode(tf, tf.io.read_file(path), size, ctx.channels), y

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
                    if ctx.image_size is not None or ctx.color_mode != "rgb":
                        # store resized (or converted) images, as a converter would: JPEG, or PNG for RGBA
                        from io import BytesIO

                        from PIL import Image

                        buf = BytesIO()
                        img = ctx.images[i]
                        pil = Image.fromarray(img[..., 0] if img.shape[2] == 1 else img, ctx.pil_mode)
                        pil.save(
                            buf,
                            format="PNG" if ctx.color_mode == "rgba" else "JPEG",
                            **({} if ctx.color_mode == "rgba" else {"quality": 90}),
                        )
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
            if ctx.color_mode == "rgba":
                return tf.io.decode_png(ex["image"], channels=4), ex["label"]
            return tf.io.decode_jpeg(ex["image"], channels=ctx.channels), ex["label"]

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
