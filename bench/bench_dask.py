"""carraystore on dask: ingest images/s locally and on a cluster, and the writer's memory in from_dask.

Two measurements, each mode in a fresh process (so that start-up, caches and memory of one
mode never leak into another; at the ``tiny`` scale, the smoke test, every mode runs in one
process instead, with one cluster grown from 1 to 2 workers):

* **ingest**: a folder of real-photo JPEGs (``carraystore.ingest.sample_data``) ingested with
  resizing, side by side: the local ingest with 1 decoding process and with all cores,
  and ``from_directory(client=...)`` on a ``LocalCluster`` of 1 and of 2 worker processes
  (one thread each). Cluster start-up is not timed; the output is checked to be the local
  ingest's store byte for byte.
* **from_dask**: a lazily generated uint8 image array (photo crops shifted per item:
  compressible, every item different) written with ``carraystore.dask.from_dask`` on a
  ``LocalCluster`` of 2 worker processes, and with dask's threaded scheduler (no cluster).
  The writer process's RSS is sampled every 10 ms in a thread (psutil); the goal is a
  peak under 300 MB for a 2 GB array.

Scale (``CARRAYSTORE_BENCH_SCALE``): ``tiny`` (CI smoke: 48 images, 30 MB array),
``small`` (400 images, 0.5 GB), ``default`` (2000 images, 2.0 GB array), ``large``
(8000 images, 8 GB array).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from benchpaths import data_dir, results_dir

SCALE = os.environ.get("CARRAYSTORE_BENCH_SCALE", "default")
HERE = Path(__file__).resolve().parent
IMAGES = {"tiny": 48, "small": 400, "default": 2000, "large": 8000}
ARRAY_ITEMS = {"tiny": 200, "small": 3300, "default": 13300, "large": 53200}  # of 224x224x3 uint8: 150,528 bytes each
if SCALE not in IMAGES:
    raise ValueError(f"CARRAYSTORE_BENCH_SCALE={SCALE!r}: use one of {sorted(IMAGES)}")
ITEM = (224, 224, 3)
RSS_GOAL_MB = 300  # MB of 10**6 bytes
INGEST_MODES = ("local-1", "local-all", "cluster-1", "cluster-2")

_CHILD = r"""
import json, logging, os, sys, threading, time
import psutil

class Peak:
    "The process's RSS, sampled every 10 ms in a thread."
    def __init__(self):
        self.proc, self.peak, self.stop = psutil.Process(), 0, threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)
    def run(self):
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.01)
    def __enter__(self):
        self.peak = self.proc.memory_info().rss
        self.t.start()
        return self
    def __exit__(self, *a):
        self.stop.set(); self.t.join()

class Clusters:
    # Started clusters whose workers have imported carraystore (a long-lived cluster's state).
    # One job per process (every scale but tiny): the job's own cluster. Several jobs in one
    # process (tiny, the smoke test): one cluster, grown to the next job's worker count, and
    # closed before a job without a cluster (dask would use its client as the default).
    def __init__(self):
        self.cl = self.client = None
    def get(self, n):
        from distributed import Client, LocalCluster
        if self.cl is not None and len(self.cl.workers) > n:
            self.close()
        if self.cl is None:
            self.cl = LocalCluster(processes=True, n_workers=n, threads_per_worker=1, dashboard_address='127.0.0.1:0', silence_logs=logging.ERROR)
            self.client = Client(self.cl)
        else:
            self.cl.scale(n)
        self.client.wait_for_workers(n)
        self.client.run(lambda: [__import__(m) for m in ("carraystore.ingest.images", "carraystore.dask", "PIL.Image")])
        return self.client
    def close(self):
        if self.cl is not None:
            self.client.close(); self.cl.close()
            self.cl = self.client = None

def run(kind, mode, src, out, clusters):
    import numpy as np
    import carraystore as cs
    info = {"kind": kind, "mode": mode}
    if not mode.startswith("cluster"):
        clusters.close()
    if kind == "ingest":
        kw = dict(image_size=(128, 128), chunk_images=64, overwrite=True)
        if mode.startswith("cluster"):
            kw["client"] = clusters.get(int(mode.split("-")[1]))
        else:
            kw["workers"] = 1 if mode == "local-1" else os.cpu_count()
        t = time.perf_counter()
        r = cs.from_directory(src, out, **kw)
        info.update(seconds=time.perf_counter() - t, nimages=r.nimages)
    else:  # from_dask
        import contextlib
        import dask.array as da
        from carraystore.dask import from_dask
        from carraystore.ingest.sample_data import PHOTOS, load_photo, photo_crops
        n = int(src)
        rng = np.random.default_rng(0)
        crops = np.stack([c for name in PHOTOS[:4] for c in photo_crops(load_photo(name), 4, (224, 224), rng)])
        def make(block_info=None):
            (a, b), *_ = block_info[None]["array-location"]
            return np.stack([np.roll(crops[i % len(crops)], i // len(crops), axis=1) for i in range(a, b)])
        x = da.map_blocks(make, dtype=np.uint8, chunks=((100,) * (n // 100) + ((n % 100,) if n % 100 else ()), (224,), (224,), (3,)))
        current = clusters.get(2).as_current() if mode == "cluster-2" else contextlib.nullcontext()
        with current, Peak() as p:
            t = time.perf_counter()
            s = from_dask(x, out, overwrite=True)
            seconds = time.perf_counter() - t
        info.update(seconds=seconds, nbytes=s.nbytes, cbytes=s.cbytes, chunk_images=s.chunk_images,
                    nchunks=s.nchunks, writer_peak_rss_mb=p.peak / 1e6, nitems=len(s))
        s.close()
    return info

def main():
    "argv[1]: a JSON list of jobs [kind, mode, src, out]; prints a JSON list of their results."
    clusters = Clusters()
    try:
        print(json.dumps([run(*job, clusters) for job in json.loads(sys.argv[1])]))
    finally:
        clusters.close()

if __name__ == "__main__":
    main()
"""


def photo_folder(n: int) -> Path:
    """``n`` real-photo JPEGs of 256x256 in 4 classes (cached; a partial write never counts)."""
    from carraystore.ingest.sample_data import make_photo_folder

    path = data_dir() / f"dask-photos-256-{n}"
    if (path / ".done").exists():
        return path
    tmp = path.with_name(path.name + ".partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    make_photo_folder(tmp, n=n, size=(256, 256), seed=1)
    (tmp / ".done").write_text("")
    tmp.rename(path)
    return path


def run_children(jobs: list[tuple[str, str, str, Path]], tmp: Path) -> list[dict]:
    """Run ``jobs`` (kind, mode, source, output) in one fresh process; their results in order."""
    script = tmp / "bench_dask_child.py"
    script.write_text(_CHILD)
    spec = json.dumps([[kind, mode, src, str(out)] for kind, mode, src, out in jobs])
    r = subprocess.run([sys.executable, str(script), spec], capture_output=True, text=True, cwd=tmp)
    if r.returncode != 0:
        modes = ", ".join(f"{kind} {mode}" for kind, mode, _, _ in jobs)
        raise RuntimeError(f"{modes} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_dask_ingest_and_from_dask(benchmark, tmp_path: Path) -> None:
    pytest.importorskip("distributed")
    pytest.importorskip("psutil")
    n = IMAGES[SCALE]
    m = ARRAY_ITEMS[SCALE]
    src = photo_folder(n)
    out_dir = data_dir() if SCALE != "tiny" else tmp_path
    out_dir.mkdir(parents=True, exist_ok=True)
    jobs = [("ingest", mode, str(src), out_dir / f"bench-dask-ingest-{mode}.b2nd") for mode in INGEST_MODES]
    jobs += [
        ("from_dask", mode, str(m), out_dir / f"bench-dask-from-dask-{mode}.b2nd") for mode in ("cluster-2", "threads")
    ]
    results: dict[tuple[str, str], dict] = {}
    stores: dict[str, bytes] = {}
    try:
        if SCALE == "tiny":  # the smoke test: every job in one process, one cluster grown from 1 to 2 workers
            done = benchmark.pedantic(run_children, args=(jobs, tmp_path), rounds=1, iterations=1)
            results = {(kind, mode): r for (kind, mode, _, _), r in zip(jobs, done, strict=True)}
            stores = {mode: out.read_bytes() for kind, mode, _, out in jobs if kind == "ingest"}
        else:  # every job in a fresh process: start-up, caches and memory of one never leak into another
            for job in jobs:
                kind, mode, _, out = job
                if (kind, mode) == ("ingest", "cluster-2"):
                    [results[kind, mode]] = benchmark.pedantic(
                        run_children, args=([job], tmp_path), rounds=1, iterations=1
                    )
                else:
                    [results[kind, mode]] = run_children([job], tmp_path)
                if kind == "ingest":
                    stores[mode] = out.read_bytes()
                out.unlink(missing_ok=True)
    finally:
        for _, _, _, out in jobs:
            out.unlink(missing_ok=True)
    ingest = {mode: results["ingest", mode] for mode in INGEST_MODES}
    for r in ingest.values():
        r["images_per_s"] = r["nimages"] / r["seconds"]
    assert len(set(stores.values())) == 1, "the cluster ingest must write the local ingest's store byte for byte"
    assert len(stores) == len(INGEST_MODES)
    written = {mode: results["from_dask", mode] for mode in ("cluster-2", "threads")}
    base = ingest["local-1"]["images_per_s"]
    summary = {
        "scale": SCALE,
        "cpus": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
        "ingest": {
            "images": n,
            "source": "256x256 JPEG photo crops (carraystore.ingest.sample_data), resized to 128x128, 64 per chunk",
            "modes": {
                k: {
                    "seconds": round(v["seconds"], 2),
                    "images_per_s": round(v["images_per_s"], 1),
                    "vs_local_1": round(v["images_per_s"] / base, 2),
                }
                for k, v in ingest.items()
            },
            "byte_identical": True,
        },
        "from_dask": {
            "array": f"{m} x {ITEM} uint8, generated lazily (photo crops shifted per item)",
            "gb": round(written["cluster-2"]["nbytes"] / 1e9, 3),
            "modes": {
                k: {
                    "seconds": round(v["seconds"], 2),
                    "mb_per_s": round(v["nbytes"] / 1e6 / v["seconds"], 1),
                    "writer_peak_rss_mb": round(v["writer_peak_rss_mb"], 1),
                    "store_gb": round(v["cbytes"] / 1e9, 3),
                    "chunk_images": v["chunk_images"],
                    "nchunks": v["nchunks"],
                }
                for k, v in written.items()
            },
        },
    }
    benchmark.extra_info.update(summary)
    rdir = results_dir(SCALE)
    rdir.mkdir(parents=True, exist_ok=True)
    (rdir / "dask.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = [
        f"# carraystore on dask ({SCALE} scale, {os.cpu_count()} CPUs, {summary['date']})",
        "",
        f"## Ingest: {n} images ({summary['ingest']['source']})",
        "",
        ("Every mode in a fresh process. " if SCALE != "tiny" else "Every mode in one process (the tiny smoke run). ")
        + "Timed: the whole `from_directory` call (the local modes start their decoding "
        "processes inside it; the clusters are started, with carraystore imported on the workers, before). "
        "All four stores are byte-identical.",
        "",
        "| mode | seconds | images/s | vs local, 1 process |",
        "| --- | ---: | ---: | ---: |",
    ]
    names = {
        "local-1": "local, 1 decoding process",
        "local-all": f"local, {os.cpu_count()} decoding processes",
        "cluster-1": "LocalCluster, 1 worker process",
        "cluster-2": "LocalCluster, 2 worker processes",
    }
    lines += [
        f"| {names[k]} | {v['seconds']:.2f} | {v['images_per_s']:.0f} | {v['vs_local_1']:.2f} |"
        for k, v in summary["ingest"]["modes"].items()
    ]
    lines += [
        "",
        f"## from_dask: {summary['from_dask']['array']}, {summary['from_dask']['gb']} GB",
        "",
        f"Writer peak RSS sampled every 10 ms (psutil); goal under {RSS_GOAL_MB} MB for a 2 GB array.",
        "",
        "| mode | seconds | MB/s | writer peak RSS (MB) | store (GB) |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    wnames = {
        "cluster-2": "LocalCluster, 2 worker processes",
        "threads": "no cluster (threaded scheduler, in the writer)",
    }
    lines += [
        f"| {wnames[k]} | {v['seconds']:.2f} | {v['mb_per_s']:.0f} | {v['writer_peak_rss_mb']:.0f} | {v['store_gb']:.3f} |"
        for k, v in summary["from_dask"]["modes"].items()
    ]
    (rdir / "dask.md").write_text("\n".join(lines) + "\n")
    if SCALE in ("default", "large"):
        assert summary["from_dask"]["gb"] >= 2.0, "the goal is about arrays of at least 2 GB"
        rss = summary["from_dask"]["modes"]["cluster-2"]["writer_peak_rss_mb"]
        assert rss < RSS_GOAL_MB, f"writer peak RSS {rss:.0f} MB"
