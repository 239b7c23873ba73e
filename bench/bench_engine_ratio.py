"""The engine against its codec: ``store.batches`` against raw decompression of the same chunks.

Per preset (``fast``, ``balanced``, ``small``), one store ingested from real-photo JPEGs
(``bench/benchdata.py``), opened once; every round times, interleaved in one process on
the same file (the machine is shared: alternating keeps the rows comparable):

- ``raw``: the store's compressed chunks, held in memory, decompressed by as many threads
  as the engine's (``default_threads()``), each into its own preallocated chunk buffer
  (``blosc2.set_releasegil(True)``, one blosc2 thread each): the codec's own rate, its
  output staying in the CPU cache;
- ``raw_to_memory``: the same, each thread writing into a rotating set of buffers as large
  as the engine's batch buffers, so the output goes to memory as a loader's must;
- ``direct_loop`` (direct-mode presets): the engine's own method with none of its bookkeeping:
  image by image (one ``blosc2_getitem_ctx`` call each, as the engine's) into as many rotating
  batch buffers as the engine keeps, in the engine's block-shuffled order, each thread taking
  every other batch: the ceiling of decompressing straight into batches on these cores;
- ``verify=True``, ``verify="always"``, ``verify=False``: one block-shuffled epoch of
  ``store.batches(B)`` (default window, threads and memory), every batch taken.
  ``verify=True`` checks each chunk once per process while the file is unchanged (the
  warm-up epoch did), ``"always"`` every read, as ``verify=True`` did before.

Images/s is the best round and the median; the ratio is the engine's best round over
``raw``'s best (the goal: 0.7 for every preset) and the median over the median. Each
contender's CPU seconds per epoch (the process's, best round) are recorded too: on a
loaded machine they say what the wall clock cannot. One more epoch per preset runs with
the engine's parts timed by thread CPU time (the codec calls, the CRC32 checks, the page
cache hints, the gather copy, the rest: the engine's own Python), and the load average
before and after says how busy the machine was. Goals are reported, not asserted.
"""

from __future__ import annotations

import functools
import hashlib
import os
import resource
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blosc2
import numpy as np
from benchpaths import data_dir, write_json

import carraystore
from bench.benchdata import cached_photo_folder
from carraystore.engine import decoder as engine
from carraystore.engine.options import default_threads
from carraystore.format import blocks
from carraystore.store import reader as reader_module

SCALE = os.environ.get("CARRAYSTORE_BENCH_SCALE", "default")

SCALES = {
    "tiny": dict(n=96, size=(32, 32), batch_size=16, rounds=1, chunk_images=16),
    "default": dict(n=3000, size=(256, 256), batch_size=32, rounds=7, chunk_images=None),
}
if SCALE not in SCALES:
    raise ValueError(f"CARRAYSTORE_BENCH_SCALE={SCALE!r}: use one of {sorted(SCALES)}")
CFG = SCALES[SCALE]
PRESETS = ("fast", "balanced", "small")
GOAL = 0.7
CONTENDERS = ("raw", "raw_to_memory", "direct_loop", "verify=True", "verify='always'", "verify=False")
VERIFY: dict[str, Any] = {"verify=True": True, "verify='always'": "always", "verify=False": False}


def store_for(preset: str) -> Path:
    folder = cached_photo_folder(data_dir(), CFG["n"], size=CFG["size"])
    codec = hashlib.sha1(repr(carraystore.Codec.preset(preset)).encode()).hexdigest()[:8]
    out = data_dir().parent / "engine_ratio" / f"{folder.name}-k{CFG['chunk_images'] or 'auto'}-{preset}-{codec}.b2nd"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        carraystore.from_directory(folder, out, chunk_images=CFG["chunk_images"], codec=preset, overwrite=True)
    return out


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Raw:
    """Every chunk decompressed by ``threads`` threads, chunk ``c`` by thread ``c % threads``."""

    def __init__(self, store: carraystore.Store, threads: int, pool_bytes: int) -> None:
        self.chunks = [store.read_chunk_bytes(c) for c in range(store.nchunks)]  # in memory: no I/O timed
        self.threads = threads
        shape = (store.chunk_images, *store.image_shape)
        per = max(1, -(-pool_bytes // (threads * store.chunk_nbytes)))
        self.hot = [[np.empty(shape, dtype=store.dtype)] for _ in range(threads)]
        self.cold = [[np.empty(shape, dtype=store.dtype) for _ in range(per)] for _ in range(threads)]
        for bufs in (*self.hot, *self.cold):
            for b in bufs:
                b.fill(0)  # touched: no page faults timed

    def epoch(self, to_memory: bool) -> int:
        pools = self.cold if to_memory else self.hot

        def work(k: int) -> None:
            bufs = pools[k]
            for j, c in enumerate(range(k, len(self.chunks), self.threads)):
                blosc2.decompress2(self.chunks[c], dst=bufs[j % len(bufs)], nthreads=1)

        threads = [threading.Thread(target=work, args=(k,)) for k in range(self.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return len(self.chunks)


class DirectLoop:
    """Image by image into rotating batch buffers, ``threads`` threads taking every other batch,
    in the order of ``plan``: direct mode's decompression and writes with no engine around them."""

    def __init__(self, store: carraystore.Store, plan: Any, threads: int, nbuffers: int, batch_size: int) -> None:
        self.views = [np.frombuffer(store.chunk_buffer(c), dtype=np.uint8) for c in range(store.nchunks)]
        order = np.asarray(plan.samples(0, len(plan.items))).reshape(-1).tolist()
        k, nbytes = store.chunk_images, int(store.meta.image_nbytes)
        self.readers = [
            blocks.BlockReader(blocks.library(), int(store.codec.typesize or 1), nbytes) for _ in range(threads)
        ]
        units = self.readers[0].units
        self.addrs = [self.views[i // k].ctypes.data for i in order]
        self.sizes = [len(self.views[i // k]) for i in order]
        self.starts = [(i % k) * units for i in order]
        self.bufs = [np.zeros((batch_size, *store.image_shape), dtype=store.dtype) for _ in range(nbuffers)]
        self.n, self.b, self.nbytes, self.threads = len(order), batch_size, nbytes, threads

    def epoch(self) -> int:
        nbatches = -(-self.n // self.b)

        def work(t: int) -> None:
            r = self.readers[t]
            for i in range(t, nbatches, self.threads):
                lo, hi = i * self.b, min(self.n, (i + 1) * self.b)
                base = self.bufs[i % len(self.bufs)].ctypes.data
                dests = range(base, base + (hi - lo) * self.nbytes, self.nbytes)
                r.get_many(self.addrs[lo:hi], self.sizes[lo:hi], self.starts[lo:hi], dests)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(self.threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return self.n


def engine_epoch(store: carraystore.Store, verify: Any, epoch: int) -> int:
    n = 0
    for x, _ in store.batches(CFG["batch_size"], epoch=epoch, verify=verify):
        n += len(x)
    return n


def parts_epoch(store: carraystore.Store, verify: Any, epoch: int) -> dict[str, float]:
    """CPU seconds per part of one engine epoch, from thread CPU time around the codec calls,
    the CRC32 checks, the page cache hints and the gather copy; the rest is the engine's own."""
    spent: dict[str, float] = dict.fromkeys(("codec", "crc", "hints", "gather"), 0.0)
    lock = threading.Lock()
    saved: list[tuple[Any, str, Any]] = []

    def timed(owner: Any, name: str, part: str) -> None:
        real = getattr(owner, name)

        @functools.wraps(real)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.thread_time()
            try:
                return real(*args, **kwargs)
            finally:
                dt = time.thread_time() - t
                with lock:
                    spent[part] += dt

        saved.append((owner, name, real))
        setattr(owner, name, wrapper)

    timed(reader_module.StoreReader, "decompress_chunk", "codec")
    timed(blocks.BlockReader, "get_many", "codec")
    timed(reader_module.StoreReader, "check_chunk_bytes", "crc")
    timed(reader_module.StoreReader, "prefetch_chunks", "hints")
    timed(engine, "gather", "gather")
    try:
        c0 = cpu_s()
        t0 = time.perf_counter()
        engine_epoch(store, verify, epoch)
        wall, total = time.perf_counter() - t0, cpu_s() - c0
    finally:
        for owner, name, real in reversed(saved):
            setattr(owner, name, real)
    rest = total - sum(spent.values())
    return {"wall_s": wall, "cpu_s": total, **{f"{k}_s": v for k, v in spent.items()}, "rest_s": rest}


def measure(preset: str) -> dict[str, Any]:
    store = carraystore.open(store_for(preset))
    n = len(store)
    threads = default_threads()
    warm = store.batches(CFG["batch_size"])
    memory, direct = warm.memory, warm._s.decoder.direct
    assert sum(len(x) for x, _ in warm) == n  # warm-up: page cache, buffer pool, every chunk checked once
    raw = Raw(store, threads, memory.batch_buffers * memory.batch_bytes)
    loop = DirectLoop(store, warm.plan, threads, memory.batch_buffers, CFG["batch_size"]) if direct else None
    run: dict[str, Callable[[int], int]] = {
        "raw": lambda e: raw.epoch(False) and n,
        "raw_to_memory": lambda e: raw.epoch(True) and n,
        "direct_loop": lambda e: loop.epoch() if loop is not None else 0,
        **{name: functools.partial(lambda e, v: engine_epoch(store, v, e), v=v) for name, v in VERIFY.items()},
    }
    names = [k for k in CONTENDERS if k != "direct_loop" or loop is not None]
    wall: dict[str, list[float]] = {k: [] for k in names}
    cpu: dict[str, list[float]] = {k: [] for k in names}
    for r in range(CFG["rounds"]):
        order = names[r % len(names) :] + names[: r % len(names)]  # nobody always first
        for name in order:
            c0, t0 = cpu_s(), time.perf_counter()
            got = run[name](r + 1)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(cpu_s() - c0)
            assert got == n, (preset, name, got, n)
    parts = parts_epoch(store, True, CFG["rounds"] + 1)
    best = {k: n / min(v) for k, v in wall.items()}
    median = {k: n / float(np.median(v)) for k, v in wall.items()}
    return {
        "preset": preset,
        "store": f"{n} photos {store.image_shape}, {store.codec.describe()}, {store.nchunks} chunks of "
        f"{store.chunk_images}, {store.cbytes / 1e6:.0f} MB",
        "mode": "direct (image by image into the batch)" if direct else "chunks into slots, then gathered",
        "assemblers": memory.assemblers,
        "images_per_s_best": {k: round(v) for k, v in best.items()},
        "images_per_s_median": {k: round(v) for k, v in median.items()},
        "cpu_ms_per_epoch_best": {k: round(1000 * min(v), 1) for k, v in cpu.items()},
        "ratio_best": {k: round(best[k] / best["raw"], 3) for k in VERIFY},
        "ratio_median": {k: round(median[k] / median["raw"], 3) for k in VERIFY},
        "ratio_to_memory_best": {k: round(best[k] / best["raw_to_memory"], 3) for k in VERIFY},
        # the method's ceiling (direct mode only): the loop over raw, the engine over the loop
        "direct_loop_over_raw_best": round(best["direct_loop"] / best["raw"], 3) if loop is not None else None,
        "engine_over_direct_loop_best": (
            round(best["verify=True"] / best["direct_loop"], 3) if loop is not None else None
        ),
        "cpu_ratio": {k: round(min(cpu["raw"]) / min(cpu[k]), 3) for k in VERIFY},
        "parts_ms": {k.removesuffix("_s"): round(1000 * v, 1) for k, v in parts.items()},
    }


def test_engine_against_its_codec(benchmark) -> None:
    load_before = os.getloadavg()
    rows = [measure(p) for p in PRESETS]
    load_after = os.getloadavg()
    fast = carraystore.open(store_for("fast"))
    benchmark.pedantic(engine_epoch, args=(fast, True, 0), rounds=1, iterations=1)
    info = {
        "scale": SCALE,
        "batch_size": CFG["batch_size"],
        "loader_threads": default_threads(),
        "cpu_count": os.cpu_count(),
        "rounds": CFG["rounds"],
        "goal": GOAL,
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "goal_met": {r["preset"]: r["ratio_best"]["verify=True"] >= GOAL for r in rows},
        "rows": rows,
    }
    benchmark.extra_info.update(info)
    out = write_json(SCALE, "engine_ratio.json", info)
    lines = [
        f"# The engine against its codec ({SCALE})",
        "",
        f"`bench/bench_engine_ratio.py`: batch {CFG['batch_size']}; {default_threads()} threads for raw "
        f"decompression and for the engine, on {os.cpu_count()} CPUs; {CFG['rounds']} interleaved rounds; warm page "
        f"cache; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after (1 min).",
        "",
        "Images/s, best round (median):",
        "",
        "| preset | mode | raw | raw to memory | direct loop | verify=True | verify='always' | verify=False |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *[
            f"| {r['preset']} | {r['mode']}, {r['assemblers']} assembler(s) | "
            + " | ".join(
                f"{r['images_per_s_best'][k]:,} ({r['images_per_s_median'][k]:,})"
                if k in r["images_per_s_best"]
                else "—"
                for k in CONTENDERS
            )
            + " |"
            for r in rows
        ],
        "",
        f"Engine / raw (goal {GOAL}): best over best (median over median; CPU seconds of raw over the engine's):",
        "",
        "| preset | verify=True | verify='always' | verify=False | verify=True / raw to memory |"
        " direct loop / raw | verify=True / direct loop |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *[
            f"| {r['preset']} | "
            + " | ".join(
                f"**{r['ratio_best'][k]:.2f}** ({r['ratio_median'][k]:.2f}; CPU {r['cpu_ratio'][k]:.2f})"
                for k in VERIFY
            )
            + f" | {r['ratio_to_memory_best']['verify=True']:.2f} | "
            + " | ".join(
                "—" if r[k] is None else f"{r[k]:.2f}"
                for k in ("direct_loop_over_raw_best", "engine_over_direct_loop_best")
            )
            + " |"
            for r in rows
        ],
        "",
        "CPU milliseconds of one epoch, best round: raw, raw to memory, the direct loop and the engine:",
        "",
        "| preset | raw | raw to memory | direct loop | verify=True | verify='always' | verify=False |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        *[
            f"| {r['preset']} | "
            + " | ".join(
                f"{r['cpu_ms_per_epoch_best'][k]:,}" if k in r["cpu_ms_per_epoch_best"] else "—" for k in CONTENDERS
            )
            + " |"
            for r in rows
        ],
        "",
        "Where one more `verify=True` epoch's CPU goes (ms, thread CPU time; the rest is the engine's own Python,"
        " the threads' hand-offs and the page faults):",
        "",
        "| preset | wall | CPU | codec | CRC32 | page cache hints | gather copy | rest |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *[
            f"| {r['preset']} | "
            + " | ".join(f"{r['parts_ms'][k]:,}" for k in ("wall", "cpu", "codec", "crc", "hints", "gather", "rest"))
            + " |"
            for r in rows
        ],
        "",
    ]
    (out / "engine_ratio.md").write_text("\n".join(lines))
    print("\n" + "\n".join(lines))
