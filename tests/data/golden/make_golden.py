"""Write the golden stores of this carraystore version, ONCE. Kept for the record.

Golden files are written by one version, committed, and never regenerated: the tests of
every later version read them (``tests/format/test_golden.py``), the way numcodecs keeps its
``fixture/`` folder. This script refuses to touch a folder that already exists. A later
version that wants goldens of its own adds a new folder (its version in the name); it never
rewrites an old one.

Each store ``NAME.b2nd`` comes with its expected content: ``NAME.npy`` (the items),
``NAME.json`` (labels, keys, class names, attrs, codec, geometry, checksums, ...) and
``NAME.col-COLUMN.npy`` per column. ``MANIFEST.json`` lists every file's SHA-256.

Run from the repository root:  python tests/data/golden/make_golden.py
The stores of the encoded layout (format version 2, FORMAT.md 10) have their own folder,
``carraystore-0.1.0+encoded``, written once by:  python tests/data/golden/make_golden.py encoded
(each ``NAME.json`` then also lists every entry's SHA-256 under ``entries``).
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import blosc2
import numpy as np
from PIL import Image

import carraystore
from carraystore.format.record import dtype_to_record
from carraystore.ingest.sample_data import load_photo, photo_crops

HERE = Path(__file__).resolve().parent
OUT = HERE / f"carraystore-{carraystore.__version__}"


def crops(photo: str, n: int, size: tuple[int, int], seed: int) -> np.ndarray:
    return np.stack(photo_crops(load_photo(photo), n, size, np.random.default_rng(seed)))


def gray(rgb: np.ndarray) -> np.ndarray:
    return np.stack([np.asarray(Image.fromarray(x).convert("L")) for x in rgb])[..., None]


def write(name: str, items: np.ndarray, appends: list[dict], *, create: dict, append_later: list[dict] | None = None,
          skipped: list[tuple[str, str]] = ()) -> None:
    path = OUT / f"{name}.b2nd"
    with carraystore.create(path, items.shape[1:], dtype=items.dtype, **create) as w:
        for a in appends:
            (w.append_entries if "entries" in a else w.append)(**a)
        for p, reason in skipped:
            w.add_skipped(p, reason)
    for a in append_later or []:
        with carraystore.append(path) as w:
            (w.append_entries if "entries" in a else w.append)(**a)
    store = carraystore.open(path)
    assert store.verify() == [] and store[:].tobytes() == items.tobytes(), name
    np.save(OUT / f"{name}.npy", items, allow_pickle=False)
    columns = {}
    for col, arr in store.columns.items():
        np.save(OUT / f"{name}.col-{col}.npy", np.asarray(arr), allow_pickle=False)
        columns[col] = f"{name}.col-{col}.npy"
    expected = {
        "format_version": store.meta.format_version,
        "writer_version": store.meta.writer_version,
        "blosc2_version": store.meta.blosc2_version,
        "layout": store.layout,
        "shape": list(store.shape),
        "image_shape": list(store.image_shape),
        "dtype": dtype_to_record(store.dtype),
        "color_mode": store.color_mode,
        "chunk_images": store.chunk_images,
        "nchunks": store.nchunks,
        "codec": store.codec.to_config(),
        "crc32": [int(c) for c in store.meta.crc32],
        "labels": None if store.labels is None else store.labels.tolist(),
        "keys": None if store.keys is None else list(store.keys),
        "class_names": None if store.class_names is None else list(store.class_names),
        "attrs": store.attrs,
        "provenance": store.provenance,
        "skipped": [dict(s) for s in store.skipped],
        "columns": columns,
    }
    if store.layout == "encoded":
        expected["encoding"] = store.meta.encoding.to_record()
        expected["entries"] = [hashlib.sha256(store.entry(i)).hexdigest() for i in range(len(store))]
    (OUT / f"{name}.json").write_text(json.dumps(expected, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> None:
    if OUT.exists():
        sys.exit(f"{OUT} exists: golden files are written once and never regenerated")
    OUT.mkdir(parents=True)

    rgb = crops("astronaut", 10, (16, 16), 1)
    rgb = np.concatenate([rgb, crops("coffee", 10, (16, 16), 2)])
    labels = np.array([0] * 10 + [1] * 10)
    order = np.random.default_rng(3).permutation(20)
    rgb, labels = rgb[order], labels[order]
    keys = [f"{'astronaut' if lab == 0 else 'coffee'}/img_{i:03d}.jpg" for i, lab in enumerate(labels)]
    write("rgb_uint8", rgb,
          [dict(images=rgb[:13], labels=labels[:13], keys=keys[:13]), dict(images=rgb[13:], labels=labels[13:], keys=keys[13:])],
          create=dict(chunk_images=8, class_names=["astronaut", "coffee"],
                      attrs={"description": "golden RGB", "split": "train", "nested": {"list": [1, 2.5, "ü"], "none": None}},
                      provenance={"source": "photos", "image_size": [16, 16], "interpolation": "bilinear"}),
          skipped=[("coffee/broken.jpg", "truncated JPEG")])

    g = gray(crops("chelsea", 13, (16, 16), 4))
    write("gray_uint8", g, [dict(images=g, keys=[f"chelsea/{i}.png" for i in range(13)])], create=dict(chunk_images=5))

    rgba_rgb = crops("rocket", 10, (12, 12), 5)
    alpha = gray(crops("coffee", 10, (12, 12), 6))
    rgba = np.concatenate([rgba_rgb, alpha], axis=-1)
    write("rgba_uint8", rgba, [dict(images=rgba, labels=np.arange(10) % 3)],
          create=dict(codec="fast", chunk_images=4, class_names=["a", "b", "c"]))

    g16 = (gray(crops("astronaut", 9, (16, 16), 7)).astype(np.uint16) << 8) | gray(crops("chelsea", 9, (16, 16), 8))
    write("uint16_gray", g16, [dict(images=g16, labels=np.arange(9) % 2)], create=dict(chunk_images=4))

    small = crops("coffee", 12, (16, 16), 9)
    write("small_preset_rgb", small, [dict(images=small, keys=[f"c/{i}.jpg" for i in range(12)])],
          create=dict(codec=carraystore.Codec("zstd", 5, filters=("shuffle", "bytedelta"), block_images=4), chunk_images=8))

    f32 = crops("rocket", 6, (8, 8), 10).astype(np.float32) / np.float32(255)
    write("float32_rgb", f32, [dict(images=f32)], create=dict(chunk_images=4))

    black = np.concatenate([np.zeros((8, 8, 8, 3), np.uint8), crops("astronaut", 4, (8, 8), 11)])
    write("black_frames", black, [dict(images=black)], create=dict(chunk_images=8, attrs={"first chunk": "all zeros"}))

    grown = crops("chelsea", 17, (8, 8), 12)
    write("appended", grown, [dict(images=grown[:11], labels=np.zeros(11, int), keys=[f"a/{i}" for i in range(11)])],
          create=dict(chunk_images=4, class_names=["cat"]),
          append_later=[dict(images=grown[11:], labels=np.zeros(6, int), keys=[f"b/{i}" for i in range(6)])])

    write("empty", np.zeros((0, 8, 8, 3), np.uint8), [], create=dict(class_names=["x", "y"]))

    dt = np.dtype({"names": ["label", "key", "mean", "when", "big", "name"],
                   "formats": ["<i2", "S12", ("<f4", (3,)), "<M8[ms]", ">u4", "<U4"],
                   "offsets": [0, 4, 16, 32, 40, 44], "itemsize": 64})
    src = crops("chelsea", 30, (8, 8), 13)
    rec = np.zeros(30, dtype=dt)
    rec["label"] = np.arange(30) % 5 - 2
    rec["key"] = [f"r/{i:04d}.png".encode() for i in range(30)]
    rec["mean"] = src.reshape(30, -1, 3).mean(axis=1)
    rec["when"] = np.datetime64("2024-01-02T03:04:05.678") + np.arange(30) * np.timedelta64(997, "ms")
    rec["big"] = [int(x.sum()) for x in src]
    rec["name"] = ["cat", "ünï", "日本"] * 10
    frame = np.arange(30, dtype=np.int32)
    clip = np.array([f"clip{i // 10}".encode() for i in range(30)], dtype="S6")
    write("array_records", rec, [dict(images=rec[:17], columns={"frame": frame[:17], "clip": clip[:17]}),
                                 dict(images=rec[17:], columns={"frame": frame[17:], "clip": clip[17:]})],
          create=dict(chunk_images=8, layout="array"))

    f64 = src.reshape(30, 64, 3).astype(np.float64).std(axis=1).reshape(30, 3) / 7
    write("array_float64", f64, [dict(images=f64)], create=dict(chunk_images=16, layout="array"))

    manifest = {
        "writer_version": carraystore.__version__,
        "blosc2_version": blosc2.__version__,
        "numpy_version": np.__version__,
        "files": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(OUT.iterdir())},
    }
    (OUT / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"wrote {len(manifest['files'])} files, {total} bytes, to {OUT}")


def encode(img: np.ndarray, fmt: str, **kw) -> bytes:
    import io

    b = io.BytesIO()
    Image.fromarray(img[..., 0] if img.shape[2] == 1 else img).save(b, format=fmt, **kw)
    return b.getvalue()


def decode(data: bytes, mode: str) -> np.ndarray:
    import io

    a = np.asarray(Image.open(io.BytesIO(data)).convert(mode))
    return a[..., None] if a.ndim == 2 else a


def main_encoded() -> None:
    """The encoded layout's golden stores (format version 2)."""
    global OUT
    OUT = HERE / f"carraystore-{carraystore.__version__}+encoded"
    if OUT.exists():
        sys.exit(f"{OUT} exists: golden files are written once and never regenerated")
    OUT.mkdir(parents=True)

    rgb = np.concatenate([crops("astronaut", 7, (32, 32), 21), crops("coffee", 7, (32, 32), 22)])
    labels = np.array([0] * 7 + [1] * 7)
    jpegs = [encode(x, "JPEG", quality=85) for x in rgb]
    items = np.stack([decode(j, "RGB") for j in jpegs])
    keys = [f"{'astronaut' if lab == 0 else 'coffee'}/{i:03d}.jpg" for i, lab in enumerate(labels)]
    write("jpeg_rgb", items,
          [dict(entries=jpegs[:9], labels=labels[:9], keys=keys[:9])],
          create=dict(layout="encoded", chunk_images=4, class_names=["astronaut", "coffee"],
                      attrs={"description": "source JPEGs kept byte for byte"}),
          append_later=[dict(entries=jpegs[9:], labels=labels[9:], keys=keys[9:])])

    g = gray(crops("chelsea", 6, (24, 24), 23))
    pngs = [encode(x, "PNG") for x in g]
    write("png_gray", g, [dict(entries=pngs, keys=[f"chelsea/{i}.png" for i in range(6)])],
          create=dict(layout="encoded", chunk_images=4))

    mixed = crops("rocket", 6, (24, 24), 24)
    noise = np.random.default_rng(25).integers(0, 256, (24, 24, 3), dtype=np.uint8)  # no encoding is shorter: raw
    webp = encode(mixed[2], "WEBP", lossless=True)
    entries = [encode(mixed[0], "JPEG", quality=90), encode(mixed[1], "PNG"), webp, noise.tobytes()]
    expect = np.stack([decode(entries[0], "RGB"), mixed[1], decode(webp, "RGB"), noise])
    write("mixed_rgb", np.concatenate([expect, mixed[3:]]),
          [dict(entries=entries), dict(images=mixed[3:])],  # the last three: pixels, encoded by the writer (PNG)
          create=dict(layout="encoded", chunk_images=3, codec=carraystore.Codec("zstd", 1, filters=())))

    write("empty_encoded", np.zeros((0, 8, 8, 3), np.uint8), [], create=dict(layout="encoded"))

    manifest = {
        "writer_version": carraystore.__version__,
        "blosc2_version": blosc2.__version__,
        "numpy_version": np.__version__,
        "pillow_version": Image.__version__,
        "files": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(OUT.iterdir())},
    }
    (OUT / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"wrote {len(manifest['files'])} files, {total} bytes, to {OUT}")


if __name__ == "__main__":
    main_encoded() if sys.argv[1:] == ["encoded"] else main()
