"""Where a small remote store's epoch goes: every GET and every batch on one time line.

Run from the repository root (not a pytest file; about a minute)::

    PYTHONPATH=$PWD .venv/bin/python bench/remote_timeline.py [--rtt 20] [--mbit 400] [--max-inflight 16]

The store of ``bench_first_batch.py``'s ``chunks_1mib`` case (600 real photo crops of
128x128, 21 images per chunk, the default preset) is uploaded to a SeaweedFS server on
loopback and read through the link proxy (``testsupport.netproxy`` in a process of its own)
with ``store.batches(64)``, block-shuffled, 3 epochs after one untimed. For the last epoch
it records when each GET started and ended (the remote source's ``_get``, coalesced runs
included) and when each batch arrived, and splits the epoch into: the first window's GETs
(the "lead", fetched alone), the gap before the rest were asked for, the rest's transfer
(and the rate it got against the calibrated link), and the tail after the last byte
(decoding what arrived last). Writes ``remote_timeline.md``/``.json`` to
``bench/results/small/`` (``remote_timeline_inflight<N>`` with ``--max-inflight N``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import carraystore  # noqa: E402
from bench.remote_epochs import link_mb_per_s  # noqa: E402
from carraystore.ingest.sample_data import PHOTOS, load_photo, photo_crops  # noqa: E402
from carraystore.sources import remote  # noqa: E402
from carraystore.store.reader import StoreReader  # noqa: E402
from testsupport.servers import seaweedfs_bucket  # noqa: E402

BUCKET = "timeline"
N, SIZE, K, BATCH = 600, (128, 128), 21, 64


def _store(folder: Path, k: int) -> Path:
    path = folder / "s.b2nd"
    rng = np.random.default_rng(0)
    x = np.concatenate([np.stack(photo_crops(load_photo(p), N // 4, SIZE, rng)) for p in PHOTOS[:4]])
    with carraystore.create(path, (*SIZE, 3), chunk_images=k) as w:
        w.append(x, np.arange(N) % 5)
    return path


def _epoch(store: Any, epoch: int, events: list[tuple[Any, ...]], t0: list[float]) -> dict[str, Any]:
    events.clear()
    t0[0] = time.perf_counter()
    it = store.batches(BATCH, seed=0, epoch=epoch)
    for _ in it:
        events.append(("batch", time.perf_counter() - t0[0]))
    total = time.perf_counter() - t0[0]
    plan = it._s.decoder.plan
    return {"total_s": total, "windows": [len(c) for c in plan.window_chunks], "events": list(events)}


def _split(row: dict[str, Any], store_bytes: int, link_mb: float) -> dict[str, float]:
    """The epoch's GETs: its own (started in it, before it hinted the next epoch's first
    window), those carried from the previous epoch (started before it: its first window,
    hinted then), and the next epoch's (started after its hint)."""
    total = row["total_s"]
    gets = [e for e in row["events"] if e[0] == "get"]
    hints = [e[1] for e in row["events"] if e[0] == "hint"]
    hint = max(hints) if hints else float("inf")  # the last: once its own bytes were in
    batches = [e[1] for e in row["events"] if e[0] == "batch"]
    own = [g for g in gets if 0 <= g[1] < hint]
    carried = [g for g in gets if g[1] < 0]
    busy, until = 0.0, 0.0  # the union of the GETs' intervals within the epoch
    for _, start, end, *_ in sorted(gets, key=lambda g: g[1]):
        start, end = max(start, until, 0.0), min(end, total)
        if end > start:
            busy += end - start
            until = end
    last_byte = max((g[2] for g in own), default=0.0)
    return {
        "first_request_s": min((g[1] for g in own), default=float("nan")),
        "carried_mb": sum(g[4] for g in carried) / 1e6,
        "first_batch_s": batches[0],
        "second_batch_s": batches[1] if len(batches) > 1 else float("nan"),
        "last_byte_s": last_byte,
        "hint_s": hint if hints else float("nan"),
        "total_s": total,
        "decoding_after_last_byte_s": total - last_byte,
        "link_busy_share": busy / total,
        "link_mb_per_s": link_mb,
        "ideal_s": store_bytes / (link_mb * 1e6),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rtt", type=int, default=20, help="round trip, ms (default 20)")
    ap.add_argument("--mbit", type=int, default=400, help="link cap, Mbit/s (default 400)")
    ap.add_argument("--max-inflight", type=int, default=None, help="the storage option (default: the library's)")
    ap.add_argument("--chunk-images", type=int, default=K, help=f"images per chunk (default {K})")
    args = ap.parse_args()

    events: list[tuple[Any, ...]] = []
    t0 = [0.0]
    real_get = remote.RemoteSource._get

    def timed_get(self: Any, offset: int, length: int) -> Any:
        t = time.perf_counter()
        out = real_get(self, offset, length)
        events.append(("get", t - t0[0], time.perf_counter() - t0[0], offset, length))
        return out

    remote.RemoteSource._get = timed_get  # type: ignore[method-assign]
    real_prefetch = StoreReader.prefetch_chunks

    def noted_prefetch(self: Any, chunks: Any, again: bool = False) -> None:
        if again:  # the loader hints the next epoch's first window
            events.append(("hint", time.perf_counter() - t0[0]))
        real_prefetch(self, chunks, again=again)

    StoreReader.prefetch_chunks = noted_prefetch  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as d, seaweedfs_bucket(BUCKET) as srv:
        path = _store(Path(d), args.chunk_images)
        size = path.stat().st_size
        url = f"s3://{BUCKET}/s.b2nd"
        carraystore.copy(path, url, dst_storage_options=srv.storage_options, overwrite=True)
        import obstore

        obstore.put(srv.s3_store(BUCKET), "calibration.bin", os.urandom(32 << 20))
        cmd = [sys.executable, "-m", "testsupport.netproxy", "--to", f"127.0.0.1:{srv.s3_port}", "--rtt"]
        cmd += [str(args.rtt / 1000), "--mbit", str(args.mbit)]
        proxy = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.PIPE, cwd=ROOT, text=True)
        try:
            assert proxy.stdout is not None
            endpoint = f"http://127.0.0.1:{int(proxy.stdout.readline().split()[1])}"
            link_mb = min(link_mb_per_s(endpoint, BUCKET, "calibration.bin", 32 << 20), args.mbit / 8)
            so: dict[str, Any] = {"endpoint_url": endpoint, "anon": True}
            if args.max_inflight:
                so["max_inflight"] = args.max_inflight
            with carraystore.open(path) as local:
                chunk_bytes = sum(max(0, local.chunk_byte_range(c)[1]) for c in range(local.nchunks))
            with carraystore.open(url, storage_options=so) as store:
                _epoch(store, 0, events, t0)  # untimed: connections and threads up
                rows = []
                for e in (1, 2, 3):
                    row = {"epoch": e, **_epoch(store, e, events, t0)}
                    rows.append({**row, "split": _split(row, chunk_bytes, link_mb)})
        finally:
            assert proxy.stdin is not None
            proxy.stdin.close()
            proxy.terminate()
            proxy.wait(10)
    _report(args, rows, size)
    return 0


def _report(args: argparse.Namespace, rows: list[dict[str, Any]], size: int) -> None:
    out = HERE / "results" / "small"
    out.mkdir(parents=True, exist_ok=True)
    keys = list(rows[0]["split"])
    med = {k: statistics.median(r["split"][k] for r in rows) for k in keys}
    lines = [
        f"# Where a small remote store's epoch goes ({N} photos {SIZE[0]}x{SIZE[1]}, {args.chunk_images} per chunk, batches of {BATCH}, "
        f"RTT {args.rtt} ms, {args.mbit} Mbit/s, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f})",
        "",
        "Made by `bench/remote_timeline.py` (SeaweedFS on loopback behind the link proxy; the reader, the proxy and the "
        "server share the machine's cores). Medians over 3 epochs (after an untimed one); times from the epoch's start.",
        "",
        f"Windows (chunks): {rows[0]['windows']}; max_inflight: {args.max_inflight or 'default'}.",
        "",
        "| epoch | first GET of its own (s) | MB fetched before it began | first batch (s) | second batch (s) | "
        "its last byte (s) | next epoch hinted (s) | end (s) | decoding after its last byte (s) | link busy | "
        "share of the link limit |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {r['epoch']} | {x['first_request_s']:.3f} | {x['carried_mb']:.2f} | {x['first_batch_s']:.3f} | "
            f"{x['second_batch_s']:.3f} | {x['last_byte_s']:.3f} | {x['hint_s']:.3f} | {x['total_s']:.3f} | "
            f"{x['decoding_after_last_byte_s']:.3f} | {x['link_busy_share']:.2f} | {x['ideal_s'] / x['total_s']:.2f} |"
            for r in rows
            for x in [r["split"]]
        ),
        "",
        f"Every byte of the store at the calibrated link rate ({med['link_mb_per_s']:.1f} MB/s, 8 GETs alone): "
        f"{med['ideal_s']:.3f} s. Median epoch {med['total_s']:.3f} s: **{med['ideal_s'] / med['total_s']:.2f}** of the "
        "link limit. 'MB fetched before it began': the epoch's first window, hinted by the epoch before once its own "
        "bytes were in.",
        "",
        "Last epoch's GETs (start, end in ms, bytes):",
        "",
        "```",
        *(
            f"{e[1] * 1000:7.1f} {e[2] * 1000:7.1f} {e[4]:>9,}"
            for e in sorted((e for e in rows[-1]["events"] if e[0] == "get"), key=lambda e: e[1])
        ),
        "```",
        "",
    ]
    name = "remote_timeline" + (f"_inflight{args.max_inflight}" if args.max_inflight else "")
    name += f"_chunks{args.chunk_images}" if args.chunk_images != K else ""
    (out / f"{name}.md").write_text("\n".join(lines))
    (out / f"{name}.json").write_text(
        json.dumps({"args": vars(args), "store_bytes": size, "median": med, "epochs": rows}, indent=1)
    )
    print("\n".join(lines[:16]))


if __name__ == "__main__":
    sys.exit(main())
