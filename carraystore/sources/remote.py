"""Stores on object storage and HTTP servers, read by ranged GETs (layer 2).
:class:`RemoteSource` is the :class:`~carraystore.format.frame.ByteSource` of an ``s3://`` (AWS or
any S3-compatible server), ``gs://``, ``http(s)://`` (any server honouring ``Range``) or ``file://``
URL, through obstore (requests wait in Rust with the GIL released; docs/remote.md). Opening is one
GET (header, size, ETag); transient failures are retried (:mod:`carraystore.sources.retry`), a
permanent one raises :class:`RemoteReadError` naming URL and byte range. It pickles as URL and
options. obstore's runtime does not survive ``fork()``: in a child forked after it ran, unsigned
requests use Python's HTTP client and signed ones raise (use ``spawn``/``forkserver``, or threads)."""

from __future__ import annotations

import dataclasses
import http.client
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

from carraystore.base.errors import CorruptStoreError, InvalidInputError, RemoteReadError
from carraystore.base.forksafe import at_fork_in_child
from carraystore.format.frame import HEAD_READ_BYTES
from carraystore.sources.buffers import BufferPool
from carraystore.sources.remoteconfig import (
    DEFAULT_COALESCE_BYTES,
    DEFAULT_MAX_INFLIGHT,
    DEFAULT_READAHEAD_BYTES,
    DEFAULT_RETRIES,
    DEFAULT_RETRY_TIMEOUT,
    DEFAULT_TIMEOUT,
    make_object_store,
    plain_http_url,
    split_options,
)
from carraystore.sources.retry import HTTPStatusError, Retrier, RetryPolicy, ShortRead

__all__ = ["RemoteSource", "RemoteStats", "open_remote"]

log = logging.getLogger("carraystore.sources.remote")

#: What one request returns: the bytes of a range, or (bytes, meta) of the opening read.
_Got = TypeVar("_Got", memoryview, tuple[bytes, dict[str, Any]])

#: Hinted ranges remembered beyond the read-ahead bound.
_MAX_PENDING = 1 << 16
#: Longest time (s) the opening request is retried: a wrong endpoint fails within half a minute.
OPEN_RETRY_TIMEOUT = 30.0
#: Smallest piece of a body handed from obstore to Python while it is copied into place.
_STREAM_PIECE = 64 << 10

#: obstore made a request in this process (its Rust runtime runs here)
_RUNTIME_STARTED = False
#: forked after obstore's runtime started (here or in an ancestor): obstore would hang
_RUNTIME_INHERITED = False


def _after_fork_in_child() -> None:
    global _RUNTIME_INHERITED
    _RUNTIME_INHERITED = _RUNTIME_INHERITED or _RUNTIME_STARTED


at_fork_in_child(_after_fork_in_child)


@dataclass
class RemoteStats:
    """Counters of one source: GETs sent (retries included), bytes received, retries, and
    ``coalesced`` (ranges served by a GET made for several)."""

    requests: int = 0
    bytes: int = 0
    retries: int = 0
    coalesced: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class _Run:
    """One GET fetched ahead: ``pieces`` (offset, length) ranges of it not yet claimed."""

    __slots__ = ("start", "length", "future", "unclaimed", "done_at")

    def __init__(self, start: int, length: int, pieces: int) -> None:
        self.start = start
        self.length = length
        self.future: Future[bytes | memoryview] | None = None
        self.unclaimed = pieces
        self.done_at: float | None = None


class RemoteSource:
    """A store file at a URL, read by ranged GETs (the ``ByteSource`` protocol); thread-safe. Knobs (keywords,
    or in ``storage_options``), defaults in parentheses: ``max_inflight`` (16), ``timeout`` (30 s per request),
    ``retry_timeout`` (120 s from the first failure), ``retries`` (None: no count), ``coalesce_bytes``
    (largest GET of adjacent ranges, 4 MiB), ``readahead_bytes`` (fetched ahead and unread, 256 MiB)."""

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        max_inflight: int | None = None,
        timeout: float | None = None,
        retries: int | None = None,
        retry_timeout: float | None = None,
        coalesce_bytes: int | None = None,
        readahead_bytes: int | None = None,
    ) -> None:
        self.url = url
        self.location = url
        self.storage_options = dict(storage_options or {})
        knobs, _ = split_options(self.storage_options)
        given = {
            "max_inflight": max_inflight,
            "timeout": timeout,
            "retries": retries,
            "retry_timeout": retry_timeout,
            "coalesce_bytes": coalesce_bytes,
            "readahead_bytes": readahead_bytes,
        }
        knobs.update({k: v for k, v in given.items() if v is not None})
        self._knobs = knobs
        self.max_inflight = _positive("max_inflight", knobs.get("max_inflight", DEFAULT_MAX_INFLIGHT), url)
        self.timeout = float(knobs.get("timeout", DEFAULT_TIMEOUT))
        if not self.timeout > 0:
            raise InvalidInputError(f"{url}: timeout must be > 0 seconds, got {self.timeout!r}")
        retries_given = knobs.get("retries", DEFAULT_RETRIES)
        self.retries: int | None = None if retries_given is None else int(retries_given)
        if self.retries is not None and self.retries < 0:
            raise InvalidInputError(f"{url}: retries must be >= 0 (or None: no count), got {self.retries!r}")
        self._policy = RetryPolicy(
            retry_timeout=_retry_timeout(knobs.get("retry_timeout", DEFAULT_RETRY_TIMEOUT), url),
            retries=self.retries,
            timeout=self.timeout,
        )
        self._retrier = Retrier(
            url, self._policy, on_attempt=self._count_request, on_retry=self._count_retry, closed=self._is_closed
        )
        self.coalesce_bytes = int(knobs.get("coalesce_bytes", DEFAULT_COALESCE_BYTES))
        self.readahead_bytes = int(knobs.get("readahead_bytes", DEFAULT_READAHEAD_BYTES))
        opts = dict(self.storage_options)
        opts.update({k: v for k, v in knobs.items() if k in ("timeout", "connect_timeout")})
        self._store, self.key = make_object_store(url, opts)
        self._plain_url = plain_http_url(url, self.storage_options)
        self.stats = RemoteStats()
        self._fresh()
        self._closed = False
        # the first request (header, size, identity), retried at most OPEN_RETRY_TIMEOUT s
        opening = Retrier(
            url,
            RetryPolicy(min(self._policy.retry_timeout, OPEN_RETRY_TIMEOUT), self.retries, self.timeout),
            on_attempt=self._count_request,
            on_retry=self._count_retry,
            closed=self._is_closed,
        )
        self._head, meta = self._fetch_first(HEAD_READ_BYTES, opening)
        self._size = int(meta["size"])
        self.etag: str | None = meta.get("e_tag")
        last: Any = meta.get("last_modified")
        self.last_modified: str | None = (
            last.isoformat() if hasattr(last, "isoformat") else (str(last) if last else None)
        )

    @property
    def retry_timeout(self) -> float:
        """Seconds a failing request is tried again, from its first failure."""
        return self._policy.retry_timeout

    @retry_timeout.setter
    def retry_timeout(self, seconds: float) -> None:
        self._policy.retry_timeout = _retry_timeout(seconds, self.url)
        self._knobs["retry_timeout"] = self._policy.retry_timeout  # travels with a pickled source

    def _is_closed(self) -> bool:
        return self._closed

    def _count_request(self) -> None:
        with self._lock:
            self.stats.requests += 1

    def _count_retry(self) -> None:
        with self._lock:
            self.stats.retries += 1

    # -- identity ---------------------------------------------------------------------------
    @property
    def identity(self) -> str:
        """What names this object's current content: URL, size, ETag or modification time."""
        return f"{self.url}|{self._size}|{self.etag or self.last_modified or ''}"

    def size(self) -> int:
        return self._size

    @property
    def head_bytes(self) -> int:
        """Bytes at the start of the object held in memory since opening (served without a request)."""
        return len(self._head)

    # -- requests ---------------------------------------------------------------------------
    def _check_process(self) -> None:
        """Raise if closed; in a forked child, start afresh (new lock, pool, read-ahead)."""
        if self._closed:
            raise ValueError(f"{self.url}: the source was closed")
        if os.getpid() != self._pid:
            self._fresh()

    def _fresh(self) -> None:
        """The process's own lock, connections, buffers and read-ahead (at opening, and in a forked child)."""
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._conns = threading.local()
        self._buffers = BufferPool(self.readahead_bytes)
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: dict[tuple[int, int], tuple[_Run, int]] = {}
        #: ranges fetched ahead to be read again (``prefetch(again=True)``): extra reads that keep them
        self._again: dict[tuple[int, int], int] = {}
        #: ranges hinted by prefetch and not started yet (the read-ahead bound was reached)
        self._pending: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._runs: list[_Run] = []
        self._ahead_bytes = 0

    def _plain_only(self) -> bool:
        """Whether requests must avoid obstore here (this process was forked after it ran)."""
        if not _RUNTIME_INHERITED:
            return False
        if self._plain_url is None:
            raise RemoteReadError(
                f"{self.url}: this process was forked from one that had used obstore, whose Rust runtime does not "
                "survive fork(), and signed requests need it; start worker processes with the 'spawn' or "
                "'forkserver' multiprocessing method (a pickled Store re-opens by URL there), or use threads "
                "(Keras: use_multiprocessing=False)",
                url=self.url,
            )
        return True

    def _plain_request(self, start: int, length: int) -> http.client.HTTPResponse:
        """One ranged GET with Python's HTTP client (forked children): the response, status checked, body unread."""
        assert self._plain_url is not None  # the callers checked _plain_only()
        parts = urlsplit(self._plain_url)
        conn = getattr(self._conns, "conn", None)
        if conn is None:
            if not parts.hostname:
                raise InvalidInputError(f"{self._plain_url}: the URL names no host")
            cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            conn = self._conns.conn = cls(parts.hostname, parts.port, timeout=self.timeout)
        target = parts.path + (f"?{parts.query}" if parts.query else "")
        try:
            conn.request("GET", target, headers={"Range": f"bytes={start}-{start + length - 1}"})
            resp = conn.getresponse()
            if resp.status not in (200, 206):
                body = resp.read()
        except BaseException:
            self._plain_drop()
            raise
        if resp.status == 404:
            raise FileNotFoundError(f"GET {self._plain_url}: status 404")
        if resp.status in (401, 403):
            raise PermissionError(f"GET {self._plain_url}: status {resp.status}")
        if resp.status not in (200, 206):
            raise HTTPStatusError(f"GET {self._plain_url}: status {resp.status}: {body[:200]!r}")
        return resp

    def _plain_drop(self) -> None:
        conn = getattr(self._conns, "conn", None)
        if conn is not None:
            conn.close()
        self._conns.conn = None

    def _plain_get(self, start: int, length: int) -> tuple[bytes, dict[str, Any]]:
        """One ranged GET with Python's HTTP client (forked children): (bytes, meta)."""
        resp = self._plain_request(start, length)
        try:
            body = resp.read()
        except BaseException:
            self._plain_drop()
            raise
        total = resp.getheader("Content-Range", "").rpartition("/")[2]
        size = int(total) if total.isdigit() else (len(body) if resp.status == 200 else -1)
        if resp.status == 200:  # the server ignored Range
            body = body[start : start + length]
        return body, {"size": size, "e_tag": resp.getheader("ETag"), "last_modified": resp.getheader("Last-Modified")}

    def _plain_fill(self, start: int, out: memoryview) -> None:
        """Exactly ``len(out)`` bytes at ``start`` into ``out``, by Python's HTTP client."""
        length = len(out)
        resp = self._plain_request(start, length)
        try:
            if resp.status == 200:  # the server ignored Range: the whole body, then the part asked for
                body = resp.read()[start : start + length]
                if len(body) != length:
                    raise ShortRead(f"{len(body)} of {length} bytes arrived")
                out[:] = body
                return
            if resp.length is not None and resp.length != length:
                raise ShortRead(f"the server sends {resp.length} bytes for a range of {length}")
            pos = 0
            while pos < length:
                n = resp.readinto(out[pos:])
                if not n:
                    raise ShortRead(f"{pos} of {length} bytes arrived")
                pos += n
        except BaseException:
            self._plain_drop()
            raise

    def _fetch_first(self, n: int, retrier: Retrier) -> tuple[bytes, dict[str, Any]]:
        def once() -> tuple[bytes, dict[str, Any]]:
            if self._plain_only():
                data, meta = self._plain_get(0, n)
            else:
                res = _obstore().get(self._store, self.key, options={"range": (0, n)})
                data, meta = bytes(res.bytes()), dict(res.meta)
            if len(data) < min(n, int(meta["size"])):
                raise ShortRead(f"{len(data)} of {min(n, int(meta['size']))} bytes arrived")
            return data, meta

        return self._call(retrier, once, 0, n)

    def _get(self, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset``, as a read-only view of a pooled receive buffer."""

        def once() -> memoryview:
            out = self._buffers.take(length).data[:length]
            if self._plain_only():
                self._plain_fill(offset, out)
            else:
                # If-Match: an object replaced since opening fails instead of giving another file's bytes
                options: dict[str, Any] = {"range": (offset, offset + length)}
                if self.etag:
                    options["if_match"] = self.etag
                pos = 0
                for piece in (
                    _obstore().get(self._store, self.key, options=options).stream(min_chunk_size=_STREAM_PIECE)
                ):
                    n = len(piece)
                    if pos + n > length:
                        raise ShortRead(f"more than the {length} bytes asked for arrived")
                    out[pos : pos + n] = piece
                    pos += n
                if pos != length:
                    raise ShortRead(f"{pos} of {length} bytes arrived")
            return out.toreadonly()

        return self._call(self._retrier, once, offset, length)

    def _call(self, retrier: Retrier, once: Callable[[], _Got], offset: int, length: int) -> _Got:
        """``once()`` under ``retrier``'s policy; the bytes received are counted."""
        self._check_process()
        out = retrier.call(once, offset, length)
        n = len(out[0]) if isinstance(out, tuple) else len(out)
        with self._lock:
            self.stats.bytes += n
        return out

    # -- ByteSource -------------------------------------------------------------------------------
    def read(self, offset: int, length: int) -> bytes | memoryview:
        """Exactly ``length`` bytes at ``offset``: ``bytes`` or a read-only view of a receive buffer."""
        self._check_process()
        offset, length = int(offset), int(length)
        if offset < 0 or length < 0 or offset + length > self._size:
            raise CorruptStoreError(
                f"{self.url}: bytes {offset}-{offset + length} lie outside the object of {self._size} bytes; "
                "the store is truncated or damaged"
            )
        if length == 0:
            return b""
        if offset + length <= len(self._head):
            return self._head[offset : offset + length]
        with self._lock:
            key = (offset, length)
            hit = self._ahead.get(key)
            kept = False  # left in the read-ahead for a later read
            if hit is None:
                self._pending.pop(key, None)  # read now: not again from the hints
                extra = self._again.pop(key, 0)
                if extra:  # hinted for more reads than this one: they are fetched later
                    self._pending[key] = None
                    if extra > 1:
                        self._again[key] = extra - 1
            elif self._again.get(key):  # read once more later: kept
                kept = True
                self._again[key] -= 1
                if not self._again[key]:
                    del self._again[key]
            else:
                del self._ahead[key]
        if hit is not None:
            run, at = hit
            try:
                assert run.future is not None
                try:
                    data = run.future.result()
                except BaseException:
                    # the GET ahead failed: a read kept for later sends a fresh GET
                    with self._lock:
                        now = self._ahead.get(key)
                        if kept and now is not None and now[0] is run:
                            del self._ahead[key]
                            run.unclaimed -= 1 + self._again.pop(key, 0)
                    raise
                return data[at : at + length]  # a view: the run's buffer lives while it is used
            finally:
                with self._lock:
                    run.unclaimed -= 1
                    if run.unclaimed == 0:
                        self._forget_run(run)
                        self._pump()
        return self._get(offset, length)

    def discard(self, offset: int, length: int) -> None:
        """Forget bytes of this range fetched ahead (they failed a check): the next read sends a fresh GET."""
        r = (int(offset), int(length))
        with self._lock:
            self._pending.pop(r, None)
            hit = self._ahead.pop(r, None)
            extra = self._again.pop(r, 0)
            if hit is not None:
                run = hit[0]
                run.unclaimed -= 1 + extra
                if run.unclaimed == 0:
                    self._forget_run(run)
                    self._pump()

    def read_many(self, ranges: Sequence[tuple[int, int]]) -> list[bytes | memoryview]:
        """Every range's bytes, in order; fetched concurrently, adjacent ranges coalesced."""
        self._check_process()
        ranges = [(int(o), int(n)) for o, n in ranges]
        with self._lock:
            wanted = [r for r in dict.fromkeys(ranges) if r not in self._ahead and self._valid(r)]
            for r in wanted:
                self._pending.pop(r, None)
            for pieces in self._runs_of(wanted):
                self._submit(pieces)
        return [self.read(o, n) for o, n in ranges]

    def prefetch(self, ranges: Sequence[tuple[int, int]], again: bool = False) -> None:
        """Fetch these ranges in the background, in order, adjacent ones coalesced: at most ``max_inflight``
        GETs and ``readahead_bytes`` unread, the rest wait as hints. Each is kept for one read; ``again``
        keeps an already hinted range for one more."""
        self._check_process()
        with self._lock:
            if self._closed:
                return
            self._drop_stale()
            for r in dict.fromkeys((int(o), int(n)) for o, n in ranges):
                hit = self._ahead.get(r)
                if again and (hit is not None or r in self._pending):
                    if hit is not None:
                        hit[0].unclaimed += 1
                    self._again[r] = self._again.get(r, 0) + 1
                elif hit is None and self._valid(r):
                    self._pending[r] = None
            while len(self._pending) > _MAX_PENDING:  # hints too far ahead: forget the oldest
                self._again.pop(self._pending.popitem(last=False)[0], None)
            self._pump()

    def hinted(self, ranges: Sequence[tuple[int, int]]) -> bool:
        """Whether every one of these ranges is fetched ahead or waits to be (and not read yet)."""
        with self._lock:
            return all((int(o), int(n)) in self._ahead or (int(o), int(n)) in self._pending for o, n in ranges)

    def wait_prefetched(self, ranges: Sequence[tuple[int, int]], timeout: float | None = None) -> bool:
        """Wait until none of these ranges is still to be fetched ahead; False after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        wanted = [(int(o), int(n)) for o, n in ranges]
        while True:
            with self._lock:
                if any(r in self._pending for r in wanted):  # not sent yet: look again soon
                    futures: list[Future[bytes | memoryview] | None] = [None]
                else:
                    futures = [
                        hit[0].future
                        for r in wanted
                        if (hit := self._ahead.get(r)) is not None and hit[0].done_at is None
                    ]
            if not futures:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            f = futures[0]
            if f is None:
                time.sleep(min(0.01, left) if left is not None else 0.01)
            else:
                wait_futures([f], timeout=left)

    def _valid(self, r: tuple[int, int]) -> bool:
        o, n = r
        return n > 0 and o >= 0 and o + n <= self._size and o + n > len(self._head)

    def _runs_of(self, ranges: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """Group ranges, in the order given, into runs adjacent in the file (each a GET)."""
        runs: list[list[tuple[int, int]]] = []
        for o, n in ranges:
            if runs:
                lo, ln = runs[-1][-1]
                total = lo + ln - runs[-1][0][0]
                if lo + ln == o and total + n <= self.coalesce_bytes:
                    runs[-1].append((o, n))
                    continue
            runs.append([(o, n)])
        return runs

    def _pump(self) -> None:
        """Start GETs for the hinted ranges, in order, while the read-ahead bound allows (lock held)."""
        while self._pending and not self._closed:
            pieces: list[tuple[int, int]] = []
            for r in self._pending:
                if pieces:
                    lo, ln = pieces[-1]
                    if lo + ln != r[0] or lo + ln - pieces[0][0] + r[1] > self.coalesce_bytes:
                        break
                pieces.append(r)
            length = pieces[-1][0] + pieces[-1][1] - pieces[0][0]
            if self._ahead_bytes and self._ahead_bytes + length > self.readahead_bytes:
                return
            for r in pieces:
                del self._pending[r]
            self._submit(pieces)

    def _submit(self, pieces: list[tuple[int, int]]) -> None:
        """One GET for adjacent ``pieces`` in the background (lock held)."""
        start = pieces[0][0]
        length = pieces[-1][0] + pieces[-1][1] - start
        run = _Run(start, length, len(pieces) + sum(self._again.get(p, 0) for p in pieces))
        for o, n in pieces:
            self._ahead[(o, n)] = (run, o - start)
        if len(pieces) > 1:
            self.stats.coalesced += len(pieces)
        self._runs.append(run)
        self._ahead_bytes += length
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.max_inflight, thread_name_prefix=f"carraystore-remote-{id(self):x}")
        run.future = self._pool.submit(self._fetch_run, run)

    def _fetch_run(self, run: _Run) -> bytes | memoryview:
        try:
            return self._get(run.start, run.length)
        finally:
            run.done_at = time.monotonic()

    def _forget_run(self, run: _Run) -> None:
        """(lock held)"""
        try:
            self._runs.remove(run)
        except ValueError:
            return
        self._ahead_bytes -= run.length

    def _drop_stale(self, age: float = 60.0) -> None:
        """Forget runs fetched long ago and never fully read (the order changed) (lock held)."""
        now = time.monotonic()
        stale = [r for r in self._runs if r.done_at is not None and now - r.done_at > age]
        if not stale:
            return
        gone = set(map(id, stale))
        for key in [k for k, (r, _) in self._ahead.items() if id(r) in gone]:
            del self._ahead[key]
            self._again.pop(key, None)
        for r in stale:
            self._forget_run(r)
        self._pump()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            self._ahead.clear()
            self._again.clear()
            self._pending.clear()
            self._runs.clear()
            self._ahead_bytes = 0
        self._buffers.clear()
        if pool is not None and os.getpid() == self._pid:
            pool.shutdown(wait=False, cancel_futures=True)

    # -- pickling: the URL and the options travel, connections never ------------------------------
    def __getstate__(self) -> dict[str, Any]:
        return {"url": self.url, "storage_options": self.storage_options, "knobs": self._knobs}

    def __setstate__(self, state: dict[str, Any]) -> None:
        other = RemoteSource(
            state["url"],
            state["storage_options"],
            **{k: v for k, v in state["knobs"].items() if k != "connect_timeout"},
        )
        self.__dict__.update(other.__dict__)

    def __repr__(self) -> str:
        return f"<RemoteSource {self.url!r} size={self._size}>"


def _obstore() -> Any:
    """obstore, noting that its runtime now runs in this process."""
    global _RUNTIME_STARTED
    import obstore

    _RUNTIME_STARTED = True
    return obstore


def _retry_timeout(value: Any, url: str) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = -1.0
    if not v >= 0:
        raise InvalidInputError(f"{url}: retry_timeout must be seconds >= 0, got {value!r}")
    return v


def _positive(name: str, value: Any, url: str) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        v = 0
    if v < 1:
        raise InvalidInputError(f"{url}: {name} must be an integer >= 1, got {value!r}")
    return v


def open_remote(url: str, storage_options: Mapping[str, Any] | None = None) -> RemoteSource:
    """The byte source of a store at ``url`` (one request: the frame header and the size)."""
    return RemoteSource(url, storage_options)
