"""Write the TFRecord files the migration tests read, with TensorFlow's own writer (run once; the files are committed).

    python tests/data/tfrecord/make_tfrecords.py

``photos.tfrecord`` (plain), ``photos.tfrecord.gz`` (GZIP) and ``photos.tfrecord.zz`` (ZLIB) hold the
same six ``tf.train.Example`` records in the object-detection convention: a real-photo JPEG
(32x32, crops of scikit-image's photos) as ``image/encoded``, ``image/class/label`` and
``image/class/text``, ``image/filename``, ``image/height``/``image/width``, a fixed-length float
feature and a variable-length box list. ``expected.json`` holds each record's values, its
JPEG's SHA-256 and the JPEG as hex, so the tests check the files without TensorFlow.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
import tensorflow as tf
from PIL import Image

from carraystore.ingest.sample_data import load_photo, photo_crops

HERE = Path(__file__).resolve().parent
CLASSES = ("astronaut", "coffee", "rocket")


def records() -> list[dict]:
    rng = np.random.default_rng(7)
    out = []
    for i in range(6):
        cls = i % len(CLASSES)
        crop = photo_crops(load_photo(CLASSES[cls]), 1, (32, 32), rng)[0]
        buf = io.BytesIO()
        Image.fromarray(crop).save(buf, format="JPEG", quality=90)
        out.append(
            {
                "jpeg": buf.getvalue(),
                "label": cls,
                "text": CLASSES[cls],
                "filename": f"{CLASSES[cls]}/{i:04d}.jpg",
                "center": [float(np.float32(0.25 * i)), float(np.float32(-1.5))],
                "boxes": [float(np.float32(0.1 * k)) for k in range(i % 3)],
            }
        )
    return out


def example(r: dict) -> bytes:
    def b(v: bytes) -> tf.train.Feature:
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v]))

    def i64(v: list[int]) -> tf.train.Feature:
        return tf.train.Feature(int64_list=tf.train.Int64List(value=v))

    def f32(v: list[float]) -> tf.train.Feature:
        return tf.train.Feature(float_list=tf.train.FloatList(value=v))

    feature = {
        "image/encoded": b(r["jpeg"]),
        "image/format": b(b"jpeg"),
        "image/class/label": i64([r["label"]]),
        "image/class/text": b(r["text"].encode()),
        "image/filename": b(r["filename"].encode()),
        "image/height": i64([32]),
        "image/width": i64([32]),
        "image/center": f32(r["center"]),
        "image/object/bbox/xmin": f32(r["boxes"]),
    }
    return tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString()


def main() -> None:
    recs = records()
    for name, compression in (("photos.tfrecord", None), ("photos.tfrecord.gz", "GZIP"), ("photos.tfrecord.zz", "ZLIB")):
        options = tf.io.TFRecordOptions(compression_type=compression) if compression else None
        with tf.io.TFRecordWriter(str(HERE / name), options=options) as w:
            for r in recs:
                w.write(example(r))
    expected = [
        {**{k: v for k, v in r.items() if k != "jpeg"}, "sha256": hashlib.sha256(r["jpeg"]).hexdigest(), "jpeg_hex": r["jpeg"].hex()}
        for r in recs
    ]
    (HERE / "expected.json").write_text(json.dumps({"classes": CLASSES, "records": expected}, indent=1) + "\n")


if __name__ == "__main__":
    main()
