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

import numpy as np
from PIL import Image

import carraystore
from carraystore.cli import main as cli_main
from carraystore.sample_data import make_photo_folder


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
    with carraystore.open(path) as store:
        t0 = time.perf_counter()
        n = 0
        for x, _y in store.batches(batch_size, shuffle="block", seed=seed, epoch=0):
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

    print("\n== 4. one shuffled epoch of the training split, read twice from a warm page cache")
    _pillow_epoch(photos / "train", seed=1)  # warm the page cache for a fair comparison
    n_files, t_files = _pillow_epoch(photos / "train", seed=0)
    _store_epoch(out / "train.b2nd", seed=1)
    n_store, t_store = _store_epoch(out / "train.b2nd", seed=0)
    rate_files, rate_store = n_files / t_files, n_store / t_store
    rows = [
        ("per-file Pillow (open + JPEG decode)", n_files, rate_files),
        ("carraystore, block shuffle", n_store, rate_store),
    ]
    print(f"   {'loader':<40}{'images':>8}{'images/s':>12}{'speedup':>10}")
    for name, n, rate in rows:
        print(f"   {name:<40}{n:>8}{rate:>12.0f}{rate / rate_files:>9.1f}x")
    print(f"\n   cores: {os.cpu_count()}, blosc2 {carraystore.store.blosc2.__version__}, numpy {np.__version__}")
    print(f"   stores: {out / 'train.b2nd'}, {out / 'val.b2nd'}  (single files: copy them anywhere)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
