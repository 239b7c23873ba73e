"""Remote epochs: carraystore over a URL, and the peers a user would pick for remote data.

Used by ``python -m bench.loaders URL`` (:func:`store_epochs`) and by
``bench/bench_remote.py`` (:func:`run_contender` in a fresh process per contender, behind
a :class:`~testsupport.netproxy.NetProxy`). carraystore runs as one store per
:data:`STORE_KINDS` entry (written by :func:`build_store`, read with
``carraystore.open(url).batches``): ``carraystore`` (pixels, the default preset),
``carraystore_fast`` (pixels, ``fast``) and ``carraystore_encoded`` (layout ``"encoded"``:
the JPEG files' own bytes, decoded by the loader's threads). The peers, all reading the
same images from the same S3 server through the same link:

- ``jpeg_get``: one GET per JPEG with a thread pool, decoded with Pillow (today's habit);
- ``webdataset``: WebDataset tar shards of JPEGs streamed over HTTP (its ``curl`` pipe),
  shard order shuffled, a 1,000-sample shuffle buffer, decoded to uint8;
- ``zarr``: a zarr v3 array (blosc lz4, one chunk = the store's chunk of images) through
  zarr's ``ObjectStore`` on obstore, chunks in a random order read by a thread pool;
- ``mds``: MosaicML Streaming's ``StreamingDataset`` on ``s3://`` (MDS shards of the same
  JPEGs), its ``StreamingDataLoader`` with 2 worker processes;
- ``litdata``: LitData's ``StreamingDataset`` on ``s3://`` (LitData chunks of the same
  JPEGs), its ``StreamingDataLoader`` with 2 worker processes.

``mds`` and ``litdata`` need PyTorch, which carraystore does not install: they run in the
peers' own environment (``make bench-peers-env``, :mod:`testsupport.torchpeers`),
each epoch from an empty local cache (every epoch crosses the link, as carraystore's);
without that environment they are listed as not run (:data:`SKIPPED_PEERS`).

A contender prints one JSON line per epoch (``{"epoch": e, "phase": "start"|"end", ...}``)
so the parent can read the proxy's request and byte counters at the epoch's boundaries.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from bench.procstats import cpu_seconds, peak_rss_mb

__all__ = [
    "store_epochs",
    "run_contender",
    "build_store",
    "select_run",
    "CONTENDERS",
    "STORE_KINDS",
    "TORCH_PEERS",
    "SKIPPED_PEERS",
]

#: The carraystore contenders, each a store written from the same image folder: how
#: (``build_store``'s arguments beside the chunk size). ``encoded`` keeps each JPEG file's
#: bytes as they are (FORMAT.md 10); its codec is the layout's default (lz4 1, no filter).
STORE_KINDS: dict[str, dict[str, Any]] = {
    "carraystore": {"codec": "balanced"},
    "carraystore_fast": {"codec": "fast"},
    "carraystore_encoded": {"layout": "encoded"},
}
CONTENDERS = (
    *STORE_KINDS,
    "carraystore_local",
    "jpeg_get",
    "webdataset",
    "zarr",
    "mds",
    "litdata",
)
#: The peers that need PyTorch (run by the peers' environment's Python, not carraystore's)
TORCH_PEERS = ("mds", "litdata")
#: Why each of :data:`TORCH_PEERS` is not run when the peers' environment is absent.
SKIPPED_PEERS = {
    "mds": "MosaicML Streaming needs PyTorch, installed apart from carraystore: run `make bench-peers-env`",
    "litdata": "LitData needs PyTorch, installed apart from carraystore: run `make bench-peers-env`",
}


def _timed(batches: Iterator[Any]) -> dict[str, float]:
    """images/s of an epoch, its first batch's wait, the rate after the first batch, and
    the CPU seconds this process spent (all its threads)."""
    c0 = cpu_seconds()
    t0 = time.perf_counter()
    first = None
    n = n_first = 0
    for x in batches:
        if first is None:
            first = time.perf_counter() - t0
            n_first = len(x)
        n += len(x)
    dt = time.perf_counter() - t0
    cpu = cpu_seconds() - c0
    first = first or 0.0
    steady = (n - n_first) / (dt - first) if dt > first and n > n_first else float("nan")
    return {
        "images": n,
        "seconds": dt,
        "images_per_s": n / dt if dt > 0 else float("nan"),
        "first_batch_s": first,
        "after_first_images_per_s": steady,
        "cpu_s": cpu,
    }


def store_epochs(
    location: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    batch_size: int = 64,
    epochs: int = 2,
    seed: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_size: int | None = None,
    report: Any = None,
    loader: Mapping[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """Time ``epochs`` block-shuffled epochs of ``store.batches`` from a path or URL.

    Per epoch: images/s, time to the first batch, and for a URL the requests and MB the
    source fetched (its own counters; retries included). ``report(dict)`` is called at
    each epoch's start and end. ``loader``: more arguments of ``batches`` (``window``,
    ``num_threads``, ...).
    """
    from carraystore.api.store import open_store

    kwargs: dict[str, Any] = {}
    if cache_dir is not None:
        kwargs.update(cache_dir=cache_dir, cache_size=cache_size)
    t0 = time.perf_counter()
    store = open_store(location, storage_options, **kwargs)
    open_s = time.perf_counter() - t0
    out = []
    try:
        remote = getattr(store.source, "inner", store.source)  # behind a chunk cache: what crosses the network
        stats = getattr(remote, "stats", None)
        if not hasattr(stats, "requests"):  # a local file
            stats = None
        for e in range(epochs):
            r0 = (stats.requests, stats.bytes) if stats is not None else (0, 0)
            if report:
                report({"epoch": e, "phase": "start"})
            row: dict[str, Any] = {
                "epoch": e,
                "open_s": open_s,
                **_timed(x for x, _ in store.batches(batch_size, seed=seed, epoch=e, **dict(loader or {}))),
            }
            if stats is not None:
                row["requests"] = stats.requests - r0[0]
                row["mb"] = (stats.bytes - r0[1]) / 1e6
            row["peak_rss_mb"] = peak_rss_mb()
            if report:
                report({**row, "phase": "end"})
            out.append(row)
        return out
    finally:
        store.close()


def build_store(
    kind: str, folder: str | os.PathLike[str], out: str | os.PathLike[str], *, chunk_images: int, workers: int = 1
) -> None:
    """Write the image folder ``folder`` as the store of contender ``kind`` (:data:`STORE_KINDS`) at ``out``."""
    from carraystore.ingest.run import from_directory

    if kind not in STORE_KINDS:
        raise ValueError(f"unknown store contender {kind!r}; one of {sorted(STORE_KINDS)}")
    from_directory(folder, out, workers=workers, chunk_images=chunk_images, **STORE_KINDS[kind])


def select_run(
    stores: Mapping[str, str],
    contenders: tuple[str, ...],
    links: list[tuple[int, int | None]],
    env: Mapping[str, str],
) -> tuple[dict[str, str], tuple[str, ...], list[tuple[int, int | None]], str]:
    """A benchmark run of some of its contenders and links, and the name of its results.

    ``env`` (the environment): ``CARRAYSTORE_BENCH_REMOTE_ONLY`` (contenders, comma
    separated, in the order given), ``CARRAYSTORE_BENCH_REMOTE_LINKS`` (``RTT:Mbit`` pairs,
    comma separated; ``none`` for no cap: ``0:none,20:400``), ``CARRAYSTORE_BENCH_REMOTE_NAME``
    (results file name, default ``remote``). Returns (stores, contenders, links, name) with
    the stores and contenders kept in the order asked.
    """
    only = [c.strip() for c in env.get("CARRAYSTORE_BENCH_REMOTE_ONLY", "").split(",") if c.strip()]
    if only:
        unknown = [c for c in only if c not in contenders]
        if unknown:
            raise ValueError(f"CARRAYSTORE_BENCH_REMOTE_ONLY: {unknown} not among the contenders {list(contenders)}")
        contenders = tuple(only)
        stores = {k: v for k, v in stores.items() if k in only}
    given = env.get("CARRAYSTORE_BENCH_REMOTE_LINKS", "").strip()
    if given:
        links = []
        for pair in given.split(","):
            rtt, _, mbit = pair.strip().partition(":")
            links.append((int(rtt), None if mbit.strip().lower() in ("", "none") else int(mbit)))
    name = env.get("CARRAYSTORE_BENCH_REMOTE_NAME", "").strip() or "remote"
    if not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"CARRAYSTORE_BENCH_REMOTE_NAME must be a plain file name, got {name!r}")
    return dict(stores), contenders, links, name


# ---------------------------------------------------------------------------------------
# peers
# ---------------------------------------------------------------------------------------


def _s3(endpoint: str, bucket: str) -> Any:
    from obstore.store import S3Store

    return S3Store(
        bucket, endpoint=endpoint, region="us-east-1", skip_signature=True, client_options={"allow_http": True}
    )


def _decode_jpeg(data: bytes) -> np.ndarray:
    import io

    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


def _jpeg_get_epoch(spec: dict[str, Any], e: int, pool: Any, store: Any) -> Iterator[np.ndarray]:
    import obstore

    keys = spec["keys"]
    bs = spec["batch_size"]
    perm = np.random.default_rng([spec["seed"], e]).permutation(len(keys))

    def load(i: int) -> np.ndarray:
        return _decode_jpeg(bytes(obstore.get(store, keys[i]).bytes()))

    window = spec.get("threads", 32) * 2
    pending: list[Any] = []
    batch: list[np.ndarray] = []
    order = iter(perm)
    for i in order:
        pending.append(pool.submit(load, int(i)))
        if len(pending) >= window:
            break
    while pending:
        batch.append(pending.pop(0).result())
        nxt = next(order, None)
        if nxt is not None:
            pending.append(pool.submit(load, int(nxt)))
        if len(batch) == bs:
            yield np.stack(batch)
            batch = []
    if batch:
        yield np.stack(batch)


def _webdataset_epoch(spec: dict[str, Any], e: int) -> Iterator[np.ndarray]:
    import webdataset as wds

    ds = (
        wds.WebDataset(
            spec["shard_urls"], shardshuffle=len(spec["shard_urls"]), seed=spec["seed"] + e, empty_check=False
        )
        .shuffle(1000)
        .decode("rgb8")
        .to_tuple("jpg", "cls")
        .batched(spec["batch_size"], partial=True)
    )
    for x, _y in ds:
        yield np.asarray(x)


def _zarr_epoch(spec: dict[str, Any], e: int, pool: Any, arr: Any) -> Iterator[np.ndarray]:
    k = arr.chunks[0]
    n = arr.shape[0]
    nchunks = -(-n // k)
    rng = np.random.default_rng([spec["seed"], e])
    order = rng.permutation(nchunks)
    bs = spec["batch_size"]
    carry = np.empty((0, *arr.shape[1:]), dtype=arr.dtype)
    for chunk in pool.map(lambda c: arr[c * k : min(n, (c + 1) * k)], order):
        chunk = chunk[rng.permutation(len(chunk))]
        carry = np.concatenate([carry, chunk]) if len(carry) else chunk
        while len(carry) >= bs:
            yield carry[:bs]
            carry = carry[bs:]
    if len(carry):
        yield carry


def run_contender(spec: dict[str, Any], emit: Any = None) -> list[dict[str, Any]]:
    """Run one contender's epochs as ``spec`` says; ``emit(dict)`` at epoch boundaries."""
    from concurrent.futures import ThreadPoolExecutor

    emit = emit or (lambda d: None)
    kind = spec["kind"]
    epochs = spec["epochs"]
    if kind in STORE_KINDS or kind == "carraystore_local":
        loader = spec.get("loader")  # more arguments of batches (window, num_threads, ...)
        if kind == "carraystore_local":  # the local warm rate: one untimed epoch fills the page cache
            store_epochs(
                spec["location"], None, batch_size=spec["batch_size"], epochs=1, seed=spec["seed"] + 1000, loader=loader
            )
        return store_epochs(
            spec["location"],
            spec.get("storage_options"),
            batch_size=spec["batch_size"],
            epochs=epochs,
            seed=spec["seed"],
            report=emit,
            loader=loader,
        )
    rows = []
    epoch: Callable[[int], Iterator[np.ndarray]]
    with ThreadPoolExecutor(spec.get("threads", 32)) as pool:
        if kind == "jpeg_get":
            store = _s3(spec["endpoint"], spec["bucket"])
            epoch = lambda e: _jpeg_get_epoch(spec, e, pool, store)  # noqa: E731
        elif kind == "webdataset":
            epoch = lambda e: _webdataset_epoch(spec, e)  # noqa: E731
        elif kind == "zarr":
            import zarr
            from zarr.storage import ObjectStore

            zs = ObjectStore(_s3(spec["endpoint"], spec["bucket"]), read_only=True)
            arr = zarr.open_array(store=zs, path=spec["zarr_path"], mode="r")
            epoch = lambda e: _zarr_epoch(spec, e, pool, arr)  # noqa: E731
        elif kind in TORCH_PEERS:  # only in the peers' environment (PyTorch)
            from testsupport import torchpeers

            os.environ.update(spec.get("env", {}))  # MDS: S3_ENDPOINT_URL and keys, read by its boto3 client
            if kind == "mds":
                torchpeers.start_mds_fork_server()  # start-up, not an epoch's work
            epoch = lambda e: (torchpeers.mds_epoch if kind == "mds" else torchpeers.litdata_epoch)(spec, e)  # noqa: E731
        else:
            raise ValueError(f"unknown contender {kind!r}")
        for e in range(epochs):
            emit({"epoch": e, "phase": "start"})
            row = {"epoch": e, **_timed(epoch(e)), "peak_rss_mb": peak_rss_mb()}
            emit({**row, "phase": "end"})
            rows.append(row)
    return rows


def _child_main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())

    def emit(d: dict[str, Any]) -> None:
        print("EPOCH " + json.dumps(d), flush=True)

    rows = run_contender(spec, emit)
    print("RESULT " + json.dumps(rows), flush=True)
    return 0


def link_mb_per_s(endpoint: str, bucket: str, key: str, total_bytes: int) -> float:
    """What an emulated link delivers: 8 concurrent ranged GETs of an eighth of ``total_bytes``
    of the object ``key`` through ``endpoint`` (an unsigned S3 endpoint), MB/s, best of 2."""
    from concurrent.futures import ThreadPoolExecutor

    import obstore
    from obstore.store import S3Store

    store = S3Store(
        bucket, endpoint=endpoint, region="us-east-1", skip_signature=True, client_options={"allow_http": True}
    )
    part = total_bytes // 8
    best = 0.0
    with ThreadPoolExecutor(8) as pool:
        for _ in range(2):
            t0 = time.perf_counter()
            list(pool.map(lambda i: obstore.get_range(store, key, start=i * part, length=part), range(8)))
            best = max(best, total_bytes / (time.perf_counter() - t0) / 1e6)
    return best


if __name__ == "__main__":  # pragma: no cover - a child process of bench/bench_remote.py
    sys.exit(_child_main(sys.argv[1:]))
