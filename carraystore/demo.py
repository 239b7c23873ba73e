"""``make demo``: the main job end to end on a small dataset of real photographs.

Builds a labelled image folder from scikit-image's photos (random crops, scales and
flips saved as JPEG in class folders, split into train/ and val/), ingests it into
``train.b2nd`` and ``val.b2nd``, prints ``info``, then reads one shuffled epoch and
compares images/s with per-file Pillow loading of the same folder.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import blosc2
import numpy as np
from PIL import Image

from carraystore.cli import main as cli_main
from carraystore.sample_data import make_photo_folder
from carraystore.store import open_store


def _pillow_epoch(root: Path, seed: int) -> tuple[int, float]:
    """Decode every file of ``root`` once, in a shuffled order, as a per-file loader does."""
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    order = np.random.default_rng(seed).permutation(len(files))
    t0 = time.perf_counter()
    for i in order:
        with Image.open(files[i]) as img:
            np.asarray(img.convert("RGB"))
    return len(files), time.perf_counter() - t0


def _store_epoch(path: Path, seed: int, batch_size: int = 32) -> tuple[int, float]:
    """One warm-up epoch, then one timed epoch (a new order) on the same open store."""
    with open_store(path) as store:
        for epoch in (0, 1):
            t0 = time.perf_counter()
            n = 0
            for x, _y in store.batches(batch_size, shuffle="block", seed=seed, epoch=epoch):
                n += len(x)
        return n, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="demo-out", help="working folder (default demo-out)")
    ap.add_argument("-n", type=int, default=600, help="number of photos to make (default 600)")
    ap.add_argument("--size", type=int, default=256, help="image side in pixels (default 256)")
    args = ap.parse_args(argv)

    out = Path(args.out)
    photos = out / "photos"
    print(f"== 1. a labelled folder of real photographs: {photos}/{{train,val}}/<class>/*.jpg")
    if photos.exists():
        shutil.rmtree(photos)
    make_photo_folder(photos, n=args.n, size=(args.size, args.size), splits={"train": 0.8, "val": 0.2}, seed=0)
    nfiles = sum(1 for _ in photos.rglob("*.jpg"))
    jpeg_bytes = sum(p.stat().st_size for p in photos.rglob("*.jpg"))
    print(f"   {nfiles} JPEG files, {jpeg_bytes / 1e6:.1f} MB")

    print(f"\n== 2. carraystore ingest {photos} {out} --split-dirs --overwrite")
    rc = cli_main(["ingest", str(photos), str(out), "--split-dirs", "--overwrite"])
    if rc:
        return rc

    print(f"\n== 3. carraystore info {out / 'train.b2nd'}")
    cli_main(["info", str(out / "train.b2nd")])

    fast = out / "train-fast.b2nd"
    print(f"\n== 4. the same split with the `fast` preset (bigger file, faster to decode): {fast}")
    rc = cli_main(["ingest", str(photos / "train"), str(fast), "--preset", "fast", "--overwrite", "-q"])
    if rc:
        return rc

    print("\n== 5. one shuffled epoch of the training split (warm page cache, after one warm-up epoch)")
    _pillow_epoch(photos / "train", seed=1)  # warm the page cache for a fair comparison
    n_files, t_files = _pillow_epoch(photos / "train", seed=0)
    rows = [("per-file Pillow loop (open + JPEG decode)", n_files, n_files / t_files, jpeg_bytes * 0.8)]
    for name, path in (("carraystore, default preset", out / "train.b2nd"), ("carraystore, --preset fast", fast)):
        n, t = _store_epoch(path, seed=0)
        rows.append((name, n, n / t, path.stat().st_size))
    rate_files = rows[0][2]
    print(f"   {'loader':<44}{'images':>8}{'images/s':>11}{'speedup':>9}{'MB on disk':>12}")
    for name, n, rate, size in rows:
        print(f"   {name:<44}{n:>8}{rate:>11.0f}{rate / rate_files:>8.1f}x{size / 1e6:>12.1f}")
    print("   (the JPEG row's size is the train split's share of the JPEG folder; a store holds decoded pixels)")
    print(f"\n   cores: {os.cpu_count()}, blosc2 {blosc2.__version__}, numpy {np.__version__}")
    print(f"   stores: {out / 'train.b2nd'}, {out / 'val.b2nd'}, {fast}  (single files: copy them anywhere)")
    print(
        "   more: `make bench` compares carraystore with tf.data, TFRecord, HDF5, zarr, bcolz, npy/npz (docs/benchmarks.md)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
