"""``make demo``: the main job end to end on a small dataset of real photographs.

Builds a labelled image folder (train/ and val/) from scikit-image's photos, ingests it,
prints ``info``, then compares the images/s of shuffled epochs with per-file Pillow loading:
a warm-up epoch each, then ``--rounds`` interleaved rounds; medians and their spread.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import blosc2
import numpy as np
from PIL import Image

from carraystore.api.store import Store, open_store
from carraystore.cli.main import main as cli_main
from carraystore.ingest.sample_data import make_photo_folder


def _image_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))


def _pillow_epoch(files: list[Path], seed: int) -> int:
    """Decode every file once, in a shuffled order, as a per-file loader does."""
    order = np.random.default_rng(seed).permutation(len(files))
    for i in order:
        with Image.open(files[i]) as img:
            np.asarray(img.convert("RGB"))
    return len(files)


def _store_epoch(store: Store, epoch: int, batch_size: int = 32) -> int:
    """One block-shuffled epoch (its own order) of an open store."""
    n = 0
    for x, _y in store.batches(batch_size, shuffle="block", seed=0, epoch=epoch):
        n += len(x)
    return n


def time_rounds(contenders: dict[str, Callable[[int], int]], rounds: int) -> dict[str, list[tuple[int, float]]]:
    """(images, seconds) per contender and round, after a warm-up; the first contender changes each round."""
    names = list(contenders)
    for name in names:  # warm-up: page cache, buffer pools, threads
        contenders[name](0)
    times: dict[str, list[tuple[int, float]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            n = contenders[name](r + 1)
            times[name].append((n, time.perf_counter() - t0))
    return times


def _rates(runs: list[tuple[int, float]]) -> list[float]:
    return [n / t for n, t in runs]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="demo-out", help="working folder (default demo-out)")
    ap.add_argument("-n", type=int, default=1200, help="number of photos to make (default 1200)")
    ap.add_argument("--size", type=int, default=256, help="image side in pixels (default 256)")
    ap.add_argument("--rounds", type=int, default=9, help="timed epochs per loader; the median counts (default 9)")
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

    rounds = max(1, args.rounds)
    print(
        f"\n== 5. shuffled epochs of the training split: median of {rounds} interleaved rounds"
        " (warm page cache, after one warm-up epoch each)"
    )
    files = _image_files(photos / "train")
    with open_store(out / "train.b2nd") as default_store, open_store(fast) as fast_store:
        contenders: dict[str, Callable[[int], int]] = {
            "per-file Pillow loop (open + JPEG decode)": lambda e: _pillow_epoch(files, seed=e),
            "carraystore, default preset": lambda e: _store_epoch(default_store, e),
            "carraystore, --preset fast": lambda e: _store_epoch(fast_store, e),
        }
        times = time_rounds(contenders, rounds)
    sizes = [sum(p.stat().st_size for p in files), (out / "train.b2nd").stat().st_size, fast.stat().st_size]
    base = _rates(times["per-file Pillow loop (open + JPEG decode)"])
    print(f"   {'loader':<44}{'images':>8}{'images/s':>11}{'min-max':>15}{'speedup':>9}{'MB on disk':>12}")
    for (name, runs), size in zip(times.items(), sizes, strict=True):
        rates = _rates(runs)
        # speedup: the median over rounds of this loader's images/s over the Pillow loop's in the same round
        speedup = statistics.median(r / b for r, b in zip(rates, base, strict=True))
        spread = f"{min(rates):.0f}-{max(rates):.0f}"
        print(
            f"   {name:<44}{runs[0][0]:>8}{statistics.median(rates):>11.0f}{spread:>15}"
            f"{speedup:>8.1f}x{size / 1e6:>12.1f}"
        )
    print(
        "   (images/s: the median epoch, min-max: the slowest and fastest; speedup: the median of each round's"
        " ratio to the Pillow loop)"
    )
    print("   (the JPEG row's size is the train split's JPEG files; a store holds decoded pixels)")
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    print(f"\n   cores: {os.cpu_count()}{load}, blosc2 {blosc2.__version__}, numpy {np.__version__}")
    print(
        "   (other processes competing for the cores move every row; the median of interleaved rounds is the fair one)"
    )
    print(f"   stores: {out / 'train.b2nd'}, {out / 'val.b2nd'}, {fast}  (single files: copy them anywhere)")
    print(
        "   more: `make bench` compares carraystore with tf.data, TFRecord, HDF5, zarr, bcolz, npy/npz (docs/benchmarks.md)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
