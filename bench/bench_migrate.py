"""Migration of a multi-GB legacy bcolz carray: throughput (MB/s) and peak memory (RSS).

The legacy array is what the fast.ai course saved with ``bcolz.carray(arr, rootdir=...)``:
float32 images (N, 224, 224, 3) with integer pixel values, lz4-5 + shuffle, 4 rows per
chunk, written with real c-blosc 1.x chunks by ``testsupport.bcolz_writer.write_carray``
(cached under ``bench/out/``). Each mode runs in a fresh process that reports its own peak
RSS, side by side:

* ``decode``: only read and decode every legacy chunk (the floor);
* ``migrate-noverify``: ``carraystore migrate --no-verify``;
* ``migrate``: ``carraystore migrate`` (writes, then re-reads and compares every chunk);
* ``naive``: load the whole array into memory, then write the store (what you would do
  with ``bcolz.open(path)[:]``).

Scale (``CARRAYSTORE_BENCH_SCALE``): ``tiny`` 12 rows (7 MB), ``default`` 3500 rows
(2.1 GB), ``large`` 7000 rows (4.2 GB). Goal, asserted unless tiny: a >= 2 GB carray
migrates with peak RSS under 300 MB.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from benchpaths import data_dir, results_dir

SCALE = os.environ.get("CARRAYSTORE_BENCH_SCALE", "default")
HERE = Path(__file__).resolve().parent
ROWS = {"tiny": 12, "default": 3500, "large": 7000}
if SCALE not in ROWS:
    raise ValueError(f"CARRAYSTORE_BENCH_SCALE={SCALE!r}: use one of {sorted(ROWS)}")
N = ROWS[SCALE]
SHAPE = (224, 224, 3)
CHUNKLEN = 4
ROW_BYTES = int(np.prod(SHAPE)) * 4
RSS_GOAL_MB = 300  # megabytes of 10**6 bytes, like every MB here
MODES = ("decode", "migrate-noverify", "migrate", "naive")

_CHILD = r"""
import json, resource, sys, time
import carraystore
from carraystore.migrations import migrate
from carraystore.migrations.bcolz import CarrayReader
mode, src, out = sys.argv[1:4]
t = time.perf_counter()  # after the imports: the modes differ in work, not in start-up
if mode == "decode":
    n = 0
    for chunk in CarrayReader.open(src).iter_chunks():
        n += chunk.nbytes
    info = {"nbytes": n}
elif mode == "naive":
    a = CarrayReader.open(src).read()
    with carraystore.create(out, a.shape[1:], dtype=a.dtype, overwrite=True) as w:
        w.append(a)
    info = {"nbytes": a.nbytes}
else:
    r = migrate(src, out, verify=(mode == "migrate"), overwrite=True, progress=False)
    info = {"nbytes": r.nbytes, "bytes_before": r.bytes_before, "bytes_after": r.bytes_after,
            "codec_before": r.codec_before, "codec_after": r.codec_after, "verified": r.verified}
seconds = time.perf_counter() - t
try:  # VmHWM: this process's own high-water mark (ru_maxrss can carry the parent's over exec)
    with open("/proc/self/status") as f:
        peak = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) * 1024
except (OSError, StopIteration):
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
info.update(mode=mode, seconds=seconds, peak_rss_mb=peak / 1e6)
print(json.dumps(info))
"""


def legacy_carray(n: int) -> Path:
    """The cached legacy carray of ``n`` rows (written once; a partial write never counts)."""
    from carraystore.ingest.sample_data import PHOTOS, load_photo, photo_crops
    from testsupport.bcolz_writer import write_carray

    root = data_dir()
    path = root / f"legacy-fastai-f32-224-c{CHUNKLEN}-{n}.bc"
    if (path / "meta" / "sizes").is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    need = n * ROW_BYTES * 0.8  # legacy (~0.26x) + store (~0.17x) + naive copy, with margin
    free = shutil.disk_usage(root).free
    if free < need:
        pytest.skip(f"{free / 1e9:.1f} GB free under {root}; this scale needs about {need / 1e9:.1f} GB")
    rng = np.random.default_rng(0)
    crops = np.stack([c for name in PHOTOS[:4] for c in photo_crops(load_photo(name), 8, SHAPE[:2], rng)]).astype(
        np.float32
    )

    def rows():  # integer-valued float32 pixels, as Keras image generators produced them
        for a in range(0, n, 64):
            b = min(a + 64, n)
            yield np.stack([np.roll(crops[i % len(crops)], i // len(crops), axis=1) for i in range(a, b)])

    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write_carray(tmp, rows(), CHUNKLEN, cname="lz4", clevel=5, shuffle=1, shape=(n, *SHAPE), dtype=np.float32)
    tmp.rename(path)
    return path


def run_mode(mode: str, src: Path, out: Path) -> dict:
    """Run one mode in a fresh interpreter; returns its JSON report (seconds, peak RSS, sizes)."""
    r = subprocess.run([sys.executable, "-c", _CHILD, mode, str(src), str(out)], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_migrate_legacy_carray(benchmark, tmp_path: Path) -> None:
    src = legacy_carray(N)
    out_dir = data_dir() if SCALE != "tiny" else tmp_path
    results: dict[str, dict] = {}
    for mode in MODES:
        out = out_dir / f"bench-migrate-{mode}.b2nd"
        try:
            if mode == "migrate":
                results[mode] = benchmark.pedantic(run_mode, args=(mode, src, out), rounds=1, iterations=1)
            else:
                results[mode] = run_mode(mode, src, out)
        finally:
            out.unlink(missing_ok=True)
    for r in results.values():
        r["mb_per_s"] = r["nbytes"] / 1e6 / r["seconds"]
    m = results["migrate"]
    summary = {
        "scale": SCALE,
        "rows": N,
        "array": f"{N} x {SHAPE} float32, lz4-5 shuffle, chunklen {CHUNKLEN}",
        "legacy_gb": round(m["nbytes"] / 1e9, 3),
        "legacy_on_disk_gb": round(m["bytes_before"] / 1e9, 3),
        "store_on_disk_gb": round(m["bytes_after"] / 1e9, 3),
        "codec_after": m["codec_after"],
        "migrate_mb_per_s": round(m["mb_per_s"], 1),
        "migrate_peak_rss_mb": round(m["peak_rss_mb"], 1),
        "rss_naive_over_migrate": round(results["naive"]["peak_rss_mb"] / m["peak_rss_mb"], 1),
        "speed_migrate_over_decode": round(m["mb_per_s"] / results["decode"]["mb_per_s"], 3),
        "modes": {
            k: {
                "seconds": round(v["seconds"], 2),
                "mb_per_s": round(v["mb_per_s"], 1),
                "peak_rss_mb": round(v["peak_rss_mb"], 1),
            }
            for k, v in results.items()
        },
        "date": time.strftime("%Y-%m-%d"),
        "cpus": os.cpu_count(),
    }
    benchmark.extra_info.update(summary)
    rdir = results_dir(SCALE)
    rdir.mkdir(parents=True, exist_ok=True)
    (rdir / "migrate.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        f"# Migrating a legacy bcolz carray ({SCALE} scale)",
        "",
        f"{summary['array']}: {summary['legacy_gb']} GB uncompressed, {summary['legacy_on_disk_gb']} GB on disk "
        f"-> store {summary['store_on_disk_gb']} GB ({m['codec_after']}). {os.cpu_count()} CPUs. Each mode in a fresh process.",
        "",
        "| mode | seconds | MB/s (uncompressed) | peak RSS (MB) |",
        "| --- | ---: | ---: | ---: |",
    ]
    lines += [
        f"| {k} | {v['seconds']:.1f} | {v['mb_per_s']:.0f} | {v['peak_rss_mb']:.0f} |" for k, v in results.items()
    ]
    (rdir / "migrate.md").write_text("\n".join(lines) + "\n")
    assert m["verified"] and m["nbytes"] == N * ROW_BYTES
    if SCALE != "tiny":
        assert m["nbytes"] >= 2e9, "the goal is about arrays of at least 2 GB"
        assert m["peak_rss_mb"] < RSS_GOAL_MB, f"peak RSS {m['peak_rss_mb']:.0f} MB"
        assert results["naive"]["peak_rss_mb"] > m["nbytes"] / 1e6  # the comparison is real: naive holds it all
