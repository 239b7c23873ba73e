"""Appends cost what they add: 32 images appended to a big store and to a small one.

Two real stores of 224x224 RGB images with int labels and keys, side by side in one run:
a small one (~20 MB) and a big one (~10 GB on disk at the default scale). The images are
random pixels (incompressible: the file's size is the data's size) written with the
``fast`` preset, so the big store is built at disk speed; it is cached under
``bench/out/`` between runs. Each trial appends the same 32 new images (``carraystore.append``,
journal, fsyncs and the metadata rewrite included) to each store, alternating, and
records the time and the bytes the file grew. Goal (asserted unless tiny): the median
append to the big store takes at most 3x the median append to the small one.

Scale (``CARRAYSTORE_BENCH_SCALE``): ``tiny`` (big store ~200 MB), ``default`` (~10 GB),
``large`` (~20 GB); ``CARRAYSTORE_BENCH_APPEND_BIG_MB`` sets another size. Free disk is
checked first; the big store shrinks to fit (and says so). Writes ``append.json`` and
``append.md``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
from benchpaths import data_dir, results_dir

import carraystore

SCALE = os.environ.get("CARRAYSTORE_BENCH_SCALE", "default")
HERE = Path(__file__).resolve().parent
SHAPE = (224, 224, 3)
IMAGE_BYTES = int(np.prod(SHAPE))
BIG_BYTES = {"tiny": 200 * 2**20, "default": 10 * 2**30, "large": 20 * 2**30}
SMALL_BYTES = 20 * 2**20
APPEND_N = 32
TRIALS = 3 if SCALE == "tiny" else 7
GOAL = 3.0


def _pool(n: int = 64) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, (n, *SHAPE), dtype=np.uint8)


def _build(path: Path, nbytes: int) -> int:
    """A store of about ``nbytes`` on disk (cached: rebuilt only when missing or another size)."""
    n = max(APPEND_N, nbytes // IMAGE_BYTES)
    if path.exists():
        with carraystore.open(path) as s:
            if n <= len(s) <= 1.5 * n and s.attrs.get("bench_n") == n:
                return len(s)
        path.unlink()
    pool = _pool()
    block = 256
    with carraystore.create(
        path, SHAPE, codec="fast", class_names=[str(c) for c in range(10)], attrs={"bench_n": n}
    ) as w:
        for start in range(0, n, block):
            m = min(block, n - start)
            idx = np.arange(start, start + m)
            w.append(pool[idx % len(pool)], labels=idx % 10, keys=[f"train/{i % 10}/img_{i:08d}.jpg" for i in idx])
    return n


def _fits(nbytes: int, folder: Path) -> tuple[int, str]:
    free = shutil.disk_usage(folder).free
    if nbytes + SMALL_BYTES + 2 * 2**30 <= free:
        return nbytes, ""
    smaller = max(SMALL_BYTES * 10, free - SMALL_BYTES - 2 * 2**30) // 2**30 * 2**30 or SMALL_BYTES * 10
    return (
        smaller,
        f"only {free / 2**30:.1f} GiB free: the big store is {smaller / 2**30:.1f} GiB instead of {nbytes / 2**30:.0f} GiB",
    )


def _append_once(path: Path, images: np.ndarray, start: int) -> tuple[float, int]:
    before = path.stat().st_size
    t0 = time.perf_counter()
    with carraystore.append(path) as w:
        idx = np.arange(start, start + len(images))
        w.append(images, labels=idx % 10, keys=[f"new/{i % 10}/img_{i:08d}.jpg" for i in idx])
    return time.perf_counter() - t0, path.stat().st_size - before


def test_append_cost(benchmark: Any) -> None:
    folder = data_dir() / "append"
    folder.mkdir(parents=True, exist_ok=True)
    want = int(os.environ.get("CARRAYSTORE_BENCH_APPEND_BIG_MB", 0)) * 2**20 or BIG_BYTES[SCALE]
    big_bytes, note = _fits(want, folder)
    small, big = folder / "small.b2nd", folder / f"big-{big_bytes // 2**20}MiB.b2nd"
    t0 = time.perf_counter()
    n_small = _build(small, SMALL_BYTES)
    n_big = _build(big, big_bytes)
    build_s = time.perf_counter() - t0
    # the trials append to the cached stores themselves; _build makes them again once they
    # have grown past 1.5x their size
    new = np.random.default_rng(1).integers(0, 256, (APPEND_N, *SHAPE), dtype=np.uint8)
    rows: dict[str, list[tuple[float, int]]] = {"small": [], "big": []}
    counts = {"small": n_small, "big": n_big}
    paths = {"small": small, "big": big}

    def trial() -> None:
        for name in ("small", "big"):
            rows[name].append(_append_once(paths[name], new, counts[name]))
            counts[name] += APPEND_N

    benchmark.pedantic(trial, rounds=TRIALS, iterations=1)
    med = {k: statistics.median(t for t, _ in v) for k, v in rows.items()}
    grown = {k: statistics.median(b for _, b in v) for k, v in rows.items()}
    sizes = {k: paths[k].stat().st_size for k in paths}
    ratio = med["big"] / med["small"]
    summary = {
        "scale": SCALE,
        "image_shape": list(SHAPE),
        "append_images": APPEND_N,
        "trials": TRIALS,
        "stores": {
            k: {
                "images": counts[k],
                "file_bytes": sizes[k],
                "append_s_median": med[k],
                "append_s": [t for t, _ in rows[k]],
                "bytes_written_median": grown[k],
                "appended_image_bytes": APPEND_N * IMAGE_BYTES,
            }
            for k in paths
        },
        "ratio_big_over_small": ratio,
        "goal": f"<= {GOAL}x",
        "met": ratio <= GOAL,
        "build_s": build_s,
        "note": note,
    }
    lines = [
        f"# Append cost (scale {SCALE})",
        "",
        f"{APPEND_N} images of {SHAPE[0]}x{SHAPE[1]}x{SHAPE[2]} appended with `carraystore.append` (journal, fsyncs and the "
        f"metadata rewrite included), median of {TRIALS} trials, alternating between the stores.",
        "",
        "| store | images | file size | append (s, median) | file grew by (bytes, median) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for k in ("small", "big"):
        lines.append(f"| {k} | {counts[k]:,} | {sizes[k] / 2**20:,.0f} MiB | {med[k]:.3f} | {grown[k]:,.0f} |")
    lines += ["", f"Big / small: **{ratio:.2f}x** (goal <= {GOAL:g}x: {'met' if ratio <= GOAL else 'NOT met'})."]
    if note:
        lines += ["", f"Note: {note}."]
    rdir = results_dir(SCALE)
    rdir.mkdir(parents=True, exist_ok=True)
    (rdir / "append.json").write_text(json.dumps(summary, indent=2) + "\n")
    (rdir / "append.md").write_text("\n".join(lines) + "\n")
    benchmark.extra_info.update({"ratio": ratio, **{f"{k}_s": v for k, v in med.items()}})
    # the appended images landed
    for k in paths:
        with carraystore.open(paths[k]) as s:
            assert np.array_equal(s[len(s) - APPEND_N :], new)
    if SCALE != "tiny":
        assert ratio <= GOAL, (
            f"appending to the big store costs {ratio:.2f}x appending to the small one (goal <= {GOAL}x)"
        )
