"""What checking every chunk's CRC32 costs the loader: ``verify=True`` against ``verify=False``.

On one store per preset, ingested from real-photo JPEGs (``balanced`` is the default
preset; ``fast`` on images over 64 KiB runs the engine's direct mode), every round times,
interleaved on the same file, one block-shuffled epoch of ``store.batches(B)`` with and
without the check. The cost is ``1 - (images/s with verify) / (images/s without)``, best
rounds against best rounds, with the medians beside them. On a shared machine the
wall-clock rows are noisy, so the file also measures the CPU time (``time.thread_time``,
one thread) of the CRC32 of every chunk against the CPU time of decompressing them:
the share the check adds to a loader that is CPU-bound, which is what the assertion uses.
The rule: the check is on by default when it costs under 5% with the default
preset.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
from benchpaths import data_dir, write_json

import carraystore
from bench.benchdata import cached_photo_folder
from carraystore.engine.loader import default_threads
from carraystore.format.codec import crc32

SCALE = os.environ.get("CARRAYSTORE_BENCH_SCALE", "default")
HERE = Path(__file__).resolve().parent

SCALES = {
    "tiny": dict(n=96, size=(32, 32), batch_size=16, rounds=1, chunk_images=16),
    "small": dict(n=2000, size=(128, 128), batch_size=64, rounds=11, chunk_images=None),
    "default": dict(n=12000, size=(128, 128), batch_size=64, rounds=9, chunk_images=None),
    "large": dict(n=40000, size=(128, 128), batch_size=64, rounds=7, chunk_images=None),
}
if SCALE not in SCALES:
    raise ValueError(f"CARRAYSTORE_BENCH_SCALE={SCALE!r}: use one of {sorted(SCALES)}")
CFG = SCALES[SCALE]
#: the most the default check may cost
LIMIT = 0.05
PRESETS = ("balanced", "fast")


def store_for(preset: str) -> Path:
    folder = cached_photo_folder(data_dir(), CFG["n"], size=CFG["size"])
    out = data_dir().parent / "verify" / f"{folder.name}-k{CFG['chunk_images'] or 'auto'}-{preset}.b2nd"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        carraystore.from_directory(folder, out, chunk_images=CFG["chunk_images"], codec=preset, overwrite=True)
    return out


def epoch_seconds(store: carraystore.Store, verify: bool, epoch: int) -> float:
    t = time.perf_counter()
    n = 0
    for x, _ in store.batches(CFG["batch_size"], epoch=epoch, verify=verify):
        n += len(x)
    dt = time.perf_counter() - t
    assert n == len(store)
    return dt


def cpu_seconds(store: carraystore.Store, repeats: int) -> tuple[float, float]:
    """CPU seconds (this thread) of the CRC32s and of the decompressions of every chunk."""
    buf = np.empty((store.chunk_images, *store.image_shape), dtype=store.dtype)
    crc = dec = 0.0
    chunks = [store.read_chunk_bytes(c) for c in range(store.nchunks)]  # resident: no page faults timed
    for r in range(repeats):
        for c, data in enumerate(chunks):
            for step in (
                ("crc", "dec") if (r + c) % 2 == 0 else ("dec", "crc")
            ):  # neither always warms the cache for the other
                t0 = time.thread_time()
                if step == "crc":
                    crc32(data)
                else:
                    store.decompress_chunk(c, data, buf, nthreads=1)
                dt = time.thread_time() - t0
                if step == "crc":
                    crc += dt
                else:
                    dec += dt
    return crc, dec


def test_verify_cost(benchmark) -> None:
    rows = []
    for preset in PRESETS:
        store = carraystore.open(store_for(preset))
        n = len(store)
        epoch_seconds(store, False, 0)  # warm the page cache and the buffer pool
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(CFG["rounds"]):
            order = (False, True) if r % 2 == 0 else (True, False)
            for verify in order:
                times[verify].append(epoch_seconds(store, verify, r + 1))
        best = {v: n / min(t) for v, t in times.items()}
        median = {v: n / float(np.median(t)) for v, t in times.items()}
        crc_s, dec_s = cpu_seconds(store, CFG["rounds"])
        rows.append(
            {
                "preset": preset,
                "store": f"{n} photos {store.image_shape}, {store.codec.describe()}, {store.nchunks} chunks of {store.chunk_images}",
                "compressed_mb": round(store.path.stat().st_size / 1e6, 1),
                "images_per_s_off_best": round(best[False]),
                "images_per_s_on_best": round(best[True]),
                "images_per_s_off_median": round(median[False]),
                "images_per_s_on_median": round(median[True]),
                "cost_best": round(1 - best[True] / best[False], 4),
                "cost_median": round(1 - median[True] / median[False], 4),
                "crc_cpu_s": round(crc_s, 4),
                "decompress_cpu_s": round(dec_s, 4),
                "cost_cpu": round(crc_s / dec_s, 4),
            }
        )
    default = carraystore.open(store_for("balanced"))
    benchmark.pedantic(epoch_seconds, args=(default, True, 0), rounds=1, iterations=1)

    info = {
        "scale": SCALE,
        "batch_size": CFG["batch_size"],
        "loader_threads": default_threads(),
        "cpu_count": os.cpu_count(),
        "rounds": CFG["rounds"],
        "rows": rows,
    }
    benchmark.extra_info.update(info)
    out = write_json(SCALE, "verify.json", info)
    lines = [
        f"# CRC32 check of every chunk: verify=True against verify=False ({SCALE})",
        "",
        f"Batch {CFG['batch_size']}; {default_threads()} loader threads on {os.cpu_count()} CPUs; "
        f"{CFG['rounds']} interleaved rounds; warm page cache.",
        "",
        "| preset | store | MB | images/s off (best) | images/s on (best) | cost (best) | cost (median) | CRC CPU / decompress CPU |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *[
            f"| {r['preset']} | {r['store']} | {r['compressed_mb']} | {r['images_per_s_off_best']:,} | "
            f"{r['images_per_s_on_best']:,} | {100 * r['cost_best']:.1f}% | {100 * r['cost_median']:.1f}% | "
            f"{100 * r['cost_cpu']:.2f}% |"
            for r in rows
        ],
        "",
    ]
    (out / "verify.md").write_text("\n".join(lines))
    print("\n" + "\n".join(lines))
    if SCALE != "tiny":
        cost = rows[0]["cost_cpu"]
        assert cost < LIMIT, (
            f"the CRC check costs {100 * cost:.1f}% of the decompression CPU time with the default preset"
        )
