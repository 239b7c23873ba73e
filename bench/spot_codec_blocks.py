"""Spot check of the codec question: the default (balanced) against larger blocks and no filter.

168 of the 256x256 real-photo JPEGs of the loader benchmark (decoded), chunks of 21 images
(~4 MiB), one thread each way, best of 3 decompressions. Run: python bench/spot_codec_blocks.py
(after bench/bench_loaders.py made bench/out/data). Results: bench/results/small/codec_blocks.md.
"""

import glob
import time

import blosc2
import numpy as np
from PIL import Image

files = sorted(glob.glob("bench/out/data/photos-n2000-256x256-c8-s0/*/*.jpg"))[::10][:168]
imgs = np.stack([np.asarray(Image.open(f).convert("RGB")) for f in files])
print(imgs.shape)
chunk_imgs = 21  # ~4 MiB
chunks = [imgs[i : i + chunk_imgs] for i in range(0, len(imgs), chunk_imgs)]
F = blosc2.Filter
C = blosc2.Codec
cands = {
    "balanced zstd1 sh+bd b1": (C.ZSTD, 1, [F.SHUFFLE, F.BYTEDELTA], 1),
    "zstd1 sh+bd b16": (C.ZSTD, 1, [F.SHUFFLE, F.BYTEDELTA], 16),
    "zstd5 none b16": (C.ZSTD, 5, [F.NOFILTER], 16),
    "zstd1 none b16": (C.ZSTD, 1, [F.NOFILTER], 16),
    "zstd3 sh+bd b4": (C.ZSTD, 3, [F.SHUFFLE, F.BYTEDELTA], 4),
    "lz4hc9 none b16": (C.LZ4HC, 9, [F.NOFILTER], 16),
    "lz4 none b1 (fast)": (C.LZ4, 1, [F.NOFILTER], 1),
}
img_bytes = imgs[0].nbytes
for name, (codec, lvl, filters, bimg) in cands.items():
    meta = [3 if f == F.BYTEDELTA else 0 for f in filters]
    cp = dict(
        codec=codec,
        clevel=lvl,
        filters=filters,
        filters_meta=meta,
        typesize=3,
        blocksize=bimg * img_bytes,
        splitmode=blosc2.SplitMode.NEVER_SPLIT,
        nthreads=1,
    )
    t = time.perf_counter()
    cs = [blosc2.compress2(c.tobytes(), **cp) for c in chunks]
    tc = time.perf_counter() - t
    out = np.empty(chunks[0].nbytes, np.uint8)
    best = 1e9
    for _ in range(3):
        t = time.perf_counter()
        for c, ch in zip(cs, chunks, strict=True):
            blosc2.decompress2(c, dst=out[: ch.nbytes], nthreads=1)
        best = min(best, time.perf_counter() - t)
    raw = imgs.nbytes
    comp = sum(len(c) for c in cs)
    print(
        f"{name:26s} ratio {raw / comp:.3f}  compress {raw / tc / 1e6:7.0f} MB/s  decompress {raw / best / 1e6:6.0f} MB/s  ({raw / best / img_bytes:,.0f} img/s/core)"
    )
