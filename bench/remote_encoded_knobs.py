"""Where the encoded layout's remote epochs go: the knobs of bench_remote.py's carraystore_encoded.

Run from the repository root (not a pytest file; it takes minutes)::

    PYTHONPATH=$PWD .venv/bin/python bench/remote_encoded_knobs.py [--scale medium] [--rtt 20] [--mbit 400]

The same SeaweedFS server, photos, stores and emulated link as ``bench/bench_remote.py``
(its own helpers build and upload them; cached under bench/out). The encoded store is read
over the link with ``carraystore.open(url).batches`` at its defaults and with one knob
changed at a time: ``num_threads`` (decoder threads), ``window`` (chunks per shuffle
window), ``max_inflight`` (GETs at once, a storage option) and the chunk size
(``chunk_images``: other stores of the same JPEGs). LitData runs once beside them, at the
same moment, as the reference. For every run: images/s (median of the epochs), first
batch, requests and MB per epoch, and the CPU seconds per epoch of the three processes on
the machine's cores: the reader, the link proxy (this process's threads) and the
SeaweedFS server. Then, without a link: the decode alone on one core (the CRC check,
lz4, simplejpeg; ``carraystore bench layout``'s measure), and the local warm rate at 1
and 2 decoder threads. Writes ``remote_encoded_knobs.md``/``.json`` beside the other
results of that scale.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
KIND = "carraystore_encoded"


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", default="medium", help="bench_remote.py's scale (default medium: 10,000 photos)")
    ap.add_argument("--rtt", type=int, default=20, help="round trip, ms (default 20)")
    ap.add_argument("--mbit", type=int, default=400, help="link cap, Mbit/s (default 400)")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="rounds over every run (interleaved; medians reported)")
    ap.add_argument("--chunks", default="21,85,256", help="chunk_images of the encoded stores (first: the bench's)")
    return ap.parse_args()


ARGS = _parse()
# bench_remote.py reads its scale and selection at import: the encoded store and LitData only
os.environ["CARRAYSTORE_BENCH_SCALE"] = ARGS.scale
os.environ["CARRAYSTORE_BENCH_REMOTE_ONLY"] = ",".join((KIND, "litdata"))
sys.path.insert(0, str(HERE))

import bench_remote as br  # noqa: E402

import carraystore  # noqa: E402
from bench.procstats import cpu_seconds  # noqa: E402
from bench.remote_epochs import build_store  # noqa: E402
from carraystore.cli.benchmarks.layout import _decode_rate  # noqa: E402
from testsupport.netproxy import NetProxy  # noqa: E402
from testsupport.servers import start_seaweedfs, stop_process  # noqa: E402


def _variants(chunks: list[int]) -> list[tuple[str, int, dict[str, Any], dict[str, Any]]]:
    """(label, chunk_images, batches arguments, storage options) of each run."""
    base = chunks[0]
    out: list[tuple[str, int, dict[str, Any], dict[str, Any]]] = [("defaults", base, {}, {})]
    out += [(f"num_threads={t}", base, {"num_threads": t}, {}) for t in (1, 3, 4)]
    out += [(f"window={w}", base, {"window": w}, {}) for w in (4, 8, 32)]
    out += [(f"max_inflight={m}", base, {}, {"max_inflight": m}) for m in (4, 8, 32)]
    out += [(f"chunk_images={c}", c, {}, {}) for c in chunks[1:]]
    out += [
        (f"chunk_images={c}, num_threads=4, max_inflight=32", c, {"num_threads": 4}, {"max_inflight": 32})
        for c in chunks[-1:]
    ]
    return out


def _watched_run(spec: dict[str, Any], link: NetProxy, server_pid: int) -> dict[str, Any]:
    """bench_remote's run of one contender, with the CPU of the proxy (this process) and the server."""
    c_proxy, c_server, t0 = cpu_seconds(), cpu_seconds(server_pid), time.perf_counter()
    r = br._run(spec, link)
    n = spec["epochs"]
    r["wall_s"] = time.perf_counter() - t0
    r["proxy_cpu_s_per_epoch"] = (cpu_seconds() - c_proxy) / n
    r["server_cpu_s_per_epoch"] = (cpu_seconds(server_pid) - c_server) / n
    if r["status"] == "ok":
        cpus = [e["cpu_s"] for e in r["epochs"] if "cpu_s" in e]
        r["reader_cpu_s_per_epoch"] = statistics.median(cpus) if cpus else None
    r["load_average"] = os.getloadavg()
    return r


def main() -> int:
    chunks = [int(c) for c in ARGS.chunks.split(",")]
    cfg = br.CFG
    work = (
        br.data_dir().parent / "remote" / f"n{cfg['n']}-{cfg['size'][0]}x{cfg['size'][1]}-chunk{br.CHUNK_BYTES >> 10}k"
    )
    work.mkdir(parents=True, exist_ok=True)
    assert chunks[0] == max(1, br.CHUNK_BYTES // (cfg["size"][0] * cfg["size"][1] * 3)), "first chunk: the bench's"
    local = br._build_local(work)
    stores = {chunks[0]: local["stores"][KIND]}
    for c in chunks[1:]:
        stores[c] = work / f"encoded-c{c}.b2nd"
        if not stores[c].exists():
            build_store(KIND, local["folder"], stores[c], chunk_images=c)
    n = len(local["rels"])
    info: dict[str, Any] = {
        "scale": ARGS.scale,
        "images": n,
        "image_shape": [*cfg["size"], 3],
        "batch_size": cfg["batch_size"],
        "epochs": ARGS.epochs,
        "rtt_ms": ARGS.rtt,
        "mbit": ARGS.mbit,
        "cores": len(os.sched_getaffinity(0)),
        "load_average_start": os.getloadavg(),
        "bytes_per_image": {c: round(p.stat().st_size / n) for c, p in stores.items()},
    }
    # without a link: the decode alone on one core, and the local warm rate at 1 and 2 threads
    bpi, per_core, _ = _decode_rate(stores[chunks[0]], repeats=3)
    info["decode_one_core_images_per_s"] = per_core
    info["local"] = {}
    for t in (1, 2):
        r = br._run(
            {
                "kind": "carraystore_local",
                "location": str(stores[chunks[0]]),
                "epochs": ARGS.epochs,
                "batch_size": cfg["batch_size"],
                "seed": 0,
                "loader": {"num_threads": t},
            },
            None,
        )
        assert r["status"] == "ok", r
        cpus = [e["cpu_s"] for e in r["epochs"]]
        info["local"][t] = {
            "images_per_s": r["images_per_s"],
            "cpu_s_per_epoch": statistics.median(cpus),
            "images_per_cpu_s": n / statistics.median(cpus),
        }
    with tempfile.TemporaryDirectory(prefix="carraystore-knobs-weed-") as d:
        srv = start_seaweedfs(Path(d))
        try:
            srv.make_bucket(br.BUCKET)
            up = br._upload(srv, local)
            urls = {chunks[0]: up["store_urls"][KIND]}
            for c in chunks[1:]:
                urls[c] = f"s3://{br.BUCKET}/store/{stores[c].name}"
                carraystore.copy(stores[c], urls[c], dst_storage_options=srv.storage_options, overwrite=True)
            import obstore

            obstore.put(srv.s3_store(br.BUCKET), "calibration.bin", os.urandom(br.CALIBRATION_BYTES))
            runs: dict[str, Any] = {}
            with NetProxy("127.0.0.1", srv.s3_port, rtt=ARGS.rtt / 1000, bandwidth=ARGS.mbit * 1e6 / 8) as link:
                info["measured_link_mb_per_s"] = br._link_mb_per_s(srv, link.url)
                base = br._spec(KIND, link.url, up)
                specs = {
                    label: {
                        **base,
                        "epochs": ARGS.epochs,
                        "location": urls[c],
                        "storage_options": {**base["storage_options"], **knobs},
                        "loader": loader,
                    }
                    for label, c, loader, knobs in _variants(chunks)
                }
                specs["litdata (reference)"] = {**br._spec("litdata", link.url, up), "epochs": ARGS.epochs}
                for _ in range(ARGS.repeats):  # rounds over every run: the machine's other load hits them all alike
                    for label, spec in specs.items():
                        runs.setdefault(label, []).append(_watched_run(spec, link, srv.proc.pid))
                        print(_row(label, _median(runs[label]), n), flush=True)
        finally:
            stop_process(srv.proc, kill=True)
    info["runs"] = runs
    info["load_average_end"] = os.getloadavg()
    out = br.results_dir(ARGS.scale)
    out.mkdir(parents=True, exist_ok=True)
    (out / "remote_encoded_knobs.json").write_text(json.dumps(info, indent=2) + "\n")
    md = _markdown(info)
    (out / "remote_encoded_knobs.md").write_text(md)
    print(md)
    return 0


def _median(repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each measure over the repeats of one run (failed repeats: the first failure)."""
    ok = [r for r in repeats if r["status"] == "ok"]
    if len(ok) < len(repeats):
        return next(r for r in repeats if r["status"] != "ok")
    keys = (
        "images_per_s",
        "first_batch_s",
        "requests_per_epoch",
        "mb_per_epoch",
        "reader_cpu_s_per_epoch",
        "proxy_cpu_s_per_epoch",
        "server_cpu_s_per_epoch",
    )
    out: dict[str, Any] = {"status": "ok", "repeats": len(ok)}
    for k in keys:
        vals = [r[k] for r in ok if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    out["images_per_s_all"] = [r["images_per_s"] for r in ok]
    out["load_average"] = [statistics.median(r["load_average"][0] for r in ok)]
    return out


def _f(v: Any, d: int = 0) -> str:
    return "-" if v is None else f"{v:,.{d}f}"


def _row(label: str, r: dict[str, Any], n: int) -> str:
    if r["status"] != "ok":
        return f"| {label} | failed: {r['error'].strip().splitlines()[-1][:100] if r['error'].strip() else '?'} |"
    cpu = r.get("reader_cpu_s_per_epoch")
    spread = "/".join(f"{v:,.0f}" for v in r.get("images_per_s_all", []))
    return (
        f"| {label} | {_f(r['images_per_s'])} | {spread} | {_f(r['first_batch_s'], 3)} | {_f(r['requests_per_epoch'])} | "
        f"{_f(r['mb_per_epoch'], 1)} | {_f(cpu, 2)} | {_f(r['proxy_cpu_s_per_epoch'], 2)} | "
        f"{_f(r['server_cpu_s_per_epoch'], 2)} | {_f(n / cpu if cpu else None)} | {r['load_average'][0]:.1f} |"
    )


def _markdown(info: dict[str, Any]) -> str:
    n = info["images"]
    link_bps = min(info["measured_link_mb_per_s"] * 1e6, info["mbit"] * 1e6 / 8)
    bpi = info["bytes_per_image"]
    lines = [
        f"# The encoded layout over a link: knobs ({n} photos {info['image_shape'][0]}x{info['image_shape'][1]}, "
        f"RTT {info['rtt_ms']} ms, {info['mbit']} Mbit/s, {info['cores']} cores, load average "
        f"{info['load_average_start'][0]:.1f} at the start, {info['load_average_end'][0]:.1f} at the end)",
        "",
        "bench/remote_encoded_knobs.py: bench_remote.py's carraystore_encoded (the JPEG files in an encoded "
        "store, read with `carraystore.open(url).batches`), one knob changed at a time; LitData beside it.",
        "",
        "Bytes per image (store file / images): " + ", ".join(f"chunks of {c}: {v:,}" for c, v in bpi.items()) + ".",
        f"The emulated link delivered {info['measured_link_mb_per_s']:,.0f} MB/s to 8 concurrent 4 MiB GETs; "
        "link limit (the lesser of that and the cap, over the bytes per image): "
        + ", ".join(f"chunks of {c}: {link_bps / v:,.0f} images/s" for c, v in bpi.items())
        + ".",
        "",
        f"Without a link: one core decodes **{info['decode_one_core_images_per_s']:,.0f} images/s** (CPU time "
        "of the CRC check, lz4 and simplejpeg, chunks in memory); local warm rate (page cache) "
        + ", ".join(
            f"{t} decoder thread(s) {v['images_per_s']:,.0f} images/s ({v['images_per_cpu_s']:,.0f} per CPU second "
            "of the reader)"
            for t, v in info["local"].items()
        )
        + ".",
        "",
        "| run | images/s | each round | first batch (s) | requests / epoch | MB / epoch | reader CPU s / epoch | proxy CPU s / epoch "
        "| server CPU s / epoch | images per reader CPU s | load avg |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    lines += [_row(label, _median(r), n) for label, r in info["runs"].items()]
    lines += [
        "",
        f"Medians over {ARGS.repeats} rounds (each round runs every line once, in this order; 'each round': "
        "images/s of each); load avg: the 1-minute load average after the run (median).",
        "CPU seconds per epoch: the reader process (all its threads; LitData's main process only, its 2 DataLoader "
        "workers not counted), the link proxy (threads of the benchmark's own process) and the SeaweedFS server; "
        "all three share the machine's cores with whatever else runs there.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
