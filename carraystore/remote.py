"""Stores on object storage and HTTP servers, read by ranged GETs (layer 3).

:class:`RemoteSource` is the :class:`~carraystore.frame.ByteSource` of a URL: ``s3://``
(AWS or any S3-compatible server: SeaweedFS, MinIO, Ceph), ``gs://``, ``http(s)://`` (any
server that honours ``Range``) and ``file://``. The transport is `obstore
<https://developmentseed.org/obstore/>`_ (Rust ``object_store`` + ``reqwest``): a request
waits in Rust with the GIL released, and many are in flight from a few threads
(docs/remote.md has the measurements behind that choice).

- Opening costs one request: the first ranged GET brings the frame header and, from its
  ``Content-Range``, the object's size, ETag and modification time (the identity a chunk
  cache keys on). Reads inside those first bytes are served from memory.
- Every request has a timeout. Transient failures (timeouts, connection resets, bodies cut
  short, 5xx, 429, 503 SlowDown) are retried with exponential backoff and full jitter;
  each retry is logged at DEBUG on the ``carraystore.remote`` logger and counted in
  :attr:`RemoteSource.stats`. A permanent failure raises :class:`RemoteReadError` naming
  the URL and the byte range.
- :meth:`RemoteSource.prefetch` is a bounded read-ahead: the ranges it is told about are
  fetched in the background, ``max_inflight`` requests at a time, runs of ranges adjacent in
  the file and in the order given coalesced into one GET, and handed to :meth:`read` when
  asked for (each range once). Unclaimed bytes are bounded by ``readahead_bytes``.
- Bodies land in reused receive buffers (:class:`BufferPool`): a chunk's bytes are a
  read-only view of one, and a buffer is written again only when no view of it is left. A
  fresh allocation per chunk (MBs) would have the kernel fault in and zero its pages for
  every chunk, which on a fast link cost more than anything else beyond a local read.
- Fork and pickle: a RemoteSource pickles as its URL and options and re-opens on the other
  side. obstore's Rust runtime does not survive ``fork()`` (tokio): in a process forked
  after it ran, unsigned requests (HTTP, anonymous S3 and GCS) go through Python's own
  HTTP client instead, and signed ones raise a clear error instead of hanging (start
  workers with ``spawn``/``forkserver``, or use threads).
"""

from __future__ import annotations

import http.client
import logging
import os
import random
import re
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import quote, unquote, urlsplit

import numpy as np

from carraystore.errors import CorruptStoreError, InvalidInputError, MissingDependencyError, RemoteReadError
from carraystore.forksafe import at_fork_in_child
from carraystore.frame import HEAD_READ_BYTES

__all__ = [
    "RemoteSource",
    "BufferPool",
    "RemoteStats",
    "open_source",
    "make_object_store",
    "split_options",
    "DEFAULT_MAX_INFLIGHT",
    "DEFAULT_TIMEOUT",
    "DEFAULT_RETRIES",
    "SOURCE_OPTIONS",
    "tune_malloc",
]

log = logging.getLogger("carraystore.remote")

#: Requests in flight at once (read-ahead and ``read_many``). Enough to hide a link's
#: latency when ``max_inflight * chunk bytes >= bandwidth * round trip``: 16 chunks of
#: 1 MiB cover 400 Mbit/s at 300 ms.
DEFAULT_MAX_INFLIGHT = 16
#: Seconds one request may take (connect, headers and body) before it counts as failed.
DEFAULT_TIMEOUT = 30.0
#: Retries of a transient failure before the read fails.
DEFAULT_RETRIES = 6
#: Largest GET made of adjacent ranges.
DEFAULT_COALESCE_BYTES = 4 << 20
#: Bytes fetched ahead and not yet asked for (the read-ahead's memory bound).
DEFAULT_READAHEAD_BYTES = 256 << 20
#: First and longest pause between retries (seconds; each pause is drawn from [0, cap]).
#: Hinted ranges remembered beyond the read-ahead bound.
_MAX_PENDING = 1 << 16
#: Receive buffers are made in multiples of this (a store's chunks differ in length).
_BUFFER_STEP = 1 << 20
#: Smallest piece of a body handed from obstore to Python while it is copied into place.
_STREAM_PIECE = 64 << 10
BACKOFF_BASE = 0.1
BACKOFF_MAX = 5.0

#: storage_options keys that tune the source itself (not passed to the object store).
SOURCE_OPTIONS = ("max_inflight", "timeout", "retries", "coalesce_bytes", "readahead_bytes", "connect_timeout")

_SCHEMES = ("s3", "s3a", "gs", "gcs", "http", "https", "file")
#: obstore made a request in this process (its Rust runtime runs here)
_RUNTIME_STARTED = False
#: this process was forked after obstore's runtime started (in it or an ancestor): obstore
#: would hang here, so requests go through the plain HTTP client or fail clearly
_RUNTIME_INHERITED = False


def _after_fork_in_child() -> None:
    global _RUNTIME_INHERITED
    _RUNTIME_INHERITED = _RUNTIME_INHERITED or _RUNTIME_STARTED


at_fork_in_child(_after_fork_in_child)


# ---------------------------------------------------------------------------------------
# URLs and storage options -> an obstore store
# ---------------------------------------------------------------------------------------


def split_options(storage_options: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(source knobs, object-store options) out of ``storage_options``."""
    opts = dict(storage_options or {})
    knobs = {k: opts.pop(k) for k in SOURCE_OPTIONS if k in opts}
    return knobs, opts


def _truthy(v: Any) -> bool:
    if isinstance(v, str):
        return v.strip().lower() in ("1", "true", "yes", "on")
    return bool(v)


def _aws_has_credentials(config: Mapping[str, Any]) -> bool:
    if any(config.get(k) for k in ("access_key_id", "session_token", "role_arn", "web_identity_token_file")):
        return True
    env = os.environ
    return any(
        env.get(k)
        for k in (
            "AWS_ACCESS_KEY_ID",
            "AWS_PROFILE",
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        )
    )


def _client_options(knobs: Mapping[str, Any], client_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    timeout = float(knobs.get("timeout", DEFAULT_TIMEOUT))
    connect = float(knobs.get("connect_timeout", min(10.0, timeout)))
    out: dict[str, Any] = {
        "allow_http": True,  # an http:// endpoint (a storage node on the LAN) works without flags
        "timeout": timedelta(seconds=timeout),
        "connect_timeout": timedelta(seconds=connect),
        "pool_idle_timeout": timedelta(seconds=60),
    }
    for k, v in client_kwargs.items():  # obstore ClientConfig keys given in client_kwargs
        if k not in ("endpoint_url", "region_name", "verify"):
            out[k] = v
    if client_kwargs.get("verify") is False:
        out["allow_invalid_certificates"] = True
    return out


def _import_obstore() -> Any:
    try:
        import obstore.store
    except ImportError as exc:  # pragma: no cover - obstore is in the remote and test extras
        raise MissingDependencyError(
            "reading stores from URLs needs obstore: pip install 'carraystore[remote]'"
        ) from exc
    return obstore.store


def make_object_store(url: str, storage_options: Mapping[str, Any] | None = None) -> tuple[Any, str]:
    """An obstore store for ``url`` and the object's key in it.

    ``storage_options`` are fsspec-style (as pandas, zarr and dask take them):
    ``endpoint_url`` (or ``client_kwargs={"endpoint_url": ...}``), ``key``, ``secret``,
    ``token``, ``anon``, ``region`` (or ``client_kwargs={"region_name": ...}``); any
    other key is passed to obstore as a config value (``S3Config``, ``GCSConfig``,
    ``ClientConfig`` names). The standard environment (``AWS_ENDPOINT_URL``,
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ...) is read by obstore.
    Without credentials anywhere, S3 requests are anonymous (unsigned).
    """
    knobs, opts = split_options(storage_options)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise InvalidInputError(f"{url}: unsupported URL scheme {scheme!r}; use s3://, gs://, http(s):// or file://")
    st = _import_obstore()
    client_kwargs = dict(opts.pop("client_kwargs", None) or {})
    client = _client_options(knobs, client_kwargs)
    for k in list(opts):  # ClientConfig keys given at the top level
        if k in (
            "allow_http",
            "allow_invalid_certificates",
            "proxy_url",
            "user_agent",
            "default_headers",
            "http2_only",
            "http1_only",
        ):
            client[k] = opts.pop(k)
    retry = {"max_retries": 0}  # retries are ours: counted, logged, and bounded by `retries`
    anon = opts.pop("anon", None)
    provider = opts.pop("credential_provider", None)  # e.g. obstore.auth.boto3.Boto3CredentialProvider()
    extra = {"credential_provider": provider} if provider is not None else {}
    try:
        if scheme in ("s3", "s3a"):
            bucket, key = parts.netloc, unquote(parts.path.lstrip("/"))
            if not bucket or not key:
                raise InvalidInputError(f"{url}: an S3 URL is s3://bucket/key")
            config: dict[str, Any] = {}
            endpoint = opts.pop("endpoint_url", None) or client_kwargs.get("endpoint_url")
            if endpoint:
                config["endpoint"] = endpoint
            for fs_name, name in (
                ("key", "access_key_id"),
                ("secret", "secret_access_key"),
                ("token", "session_token"),
            ):
                if opts.get(fs_name) is not None:
                    config[name] = opts.pop(fs_name)
            region = opts.pop("region", None) or opts.pop("region_name", None) or client_kwargs.get("region_name")
            if region:
                config["region"] = region
            config.update(opts)
            if anon is None:
                anon = (
                    provider is None
                    and not _aws_has_credentials(config)
                    and not _truthy(config.get("skip_signature", False))
                )
                anon = anon or None
            if anon is not None:
                config["skip_signature"] = _truthy(anon) or _truthy(config.get("skip_signature", False))
            store = st.S3Store(bucket, config=config, client_options=client, retry_config=retry, **extra)
            return store, key
        if scheme in ("gs", "gcs"):
            bucket, key = parts.netloc, unquote(parts.path.lstrip("/"))
            if not bucket or not key:
                raise InvalidInputError(f"{url}: a GCS URL is gs://bucket/key")
            config = {}
            token = opts.pop("token", None)
            if token == "anon":
                anon = True
            elif isinstance(token, str) and token not in ("google_default", "cloud", "browser"):
                config["application_credentials"] = token
            opts.pop("project", None)
            config.update(opts)
            if anon:
                config["skip_signature"] = True
            return st.GCSStore(bucket, config=config, client_options=client, retry_config=retry, **extra), key
        if scheme in ("http", "https"):
            if opts:
                raise InvalidInputError(f"{url}: storage options {sorted(opts)} do not apply to HTTP URLs")
            path = parts.path
            if not path or path.endswith("/"):
                raise InvalidInputError(f"{url}: the URL must name a file")
            base, _, name = path.rpartition("/")
            store = st.HTTPStore.from_url(
                f"{scheme}://{parts.netloc}{base}/", client_options=client, retry_config=retry
            )
            return store, unquote(name)
        # file://
        path = unquote(parts.path)
        if parts.netloc and parts.netloc != "localhost":
            raise InvalidInputError(f"{url}: a file URL is file:///absolute/path")
        directory, _, name = path.rpartition("/")
        return st.LocalStore(directory or "/"), name
    except (InvalidInputError, MissingDependencyError):
        raise
    except Exception as exc:
        raise InvalidInputError(f"{url}: the storage options cannot be used ({type(exc).__name__}: {exc})") from exc


def plain_http_url(url: str, storage_options: Mapping[str, Any] | None = None) -> str | None:
    """The object's URL for an unsigned plain-HTTP GET, or None when requests must be signed.

    Used in processes forked after obstore's runtime started (obstore cannot run there):
    ``http(s)://`` URLs, anonymous S3 (path-style, on the configured endpoint) and
    anonymous GCS can still be read with Python's own HTTP client.
    """
    _, opts = split_options(storage_options)
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme in ("http", "https"):
        return url
    client_kwargs = dict(opts.get("client_kwargs") or {})
    anon = opts.get("anon")
    if opts.get("credential_provider") is not None:
        return None
    if scheme in ("s3", "s3a"):
        config = {"access_key_id": opts.get("key"), "session_token": opts.get("token")}
        config.update({k: v for k, v in opts.items() if k in ("access_key_id", "role_arn", "web_identity_token_file")})
        if anon is None:
            anon = _truthy(
                opts.get("skip_signature", os.environ.get("AWS_SKIP_SIGNATURE", False))
            ) or not _aws_has_credentials(config)
        if not _truthy(anon):
            return None
        endpoint = (
            opts.get("endpoint_url")
            or opts.get("endpoint")
            or client_kwargs.get("endpoint_url")
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
            or os.environ.get("AWS_ENDPOINT")
        )
        if not endpoint:
            region = (
                opts.get("region")
                or client_kwargs.get("region_name")
                or os.environ.get("AWS_REGION")
                or os.environ.get("AWS_DEFAULT_REGION")
                or "us-east-1"
            )
            endpoint = f"https://s3.{region}.amazonaws.com"
        return f"{endpoint.rstrip('/')}/{parts.netloc}{quote(unquote(parts.path))}"
    if scheme in ("gs", "gcs"):
        if _truthy(anon) or opts.get("token") == "anon":
            return f"https://storage.googleapis.com/{parts.netloc}{quote(unquote(parts.path))}"
        return None
    return None


class _HTTPStatusError(Exception):
    """A plain-HTTP GET answered with an error status."""


# ---------------------------------------------------------------------------------------
# which failures are worth retrying
# ---------------------------------------------------------------------------------------

_STATUS = re.compile(r"status(?: code)?:? *(\d{3})", re.IGNORECASE)
_TRANSIENT_TEXT = (
    "timed out",
    "timeout",
    "connection",
    "connect error",
    "error sending request",
    "error decoding response body",
    "error reading a body",
    "body from connection",
    "broken pipe",
    "reset by peer",
    "incomplete",
    "unexpected eof",
    "end of file",
    "slowdown",
    "slow down",
    "service unavailable",
    "internal server error",
    "bad gateway",
    "gateway timeout",
    "too many requests",
    "dispatch task is gone",
    "hyper",
)


def is_transient(exc: BaseException) -> bool:
    """Whether a failed request may succeed when tried again."""
    if isinstance(exc, (_ShortRead, TimeoutError, ConnectionError, http.client.HTTPException)):
        return True
    if isinstance(exc, (FileNotFoundError, PermissionError)):
        return False
    name = type(exc).__name__
    if name in (
        "NotFoundError",
        "PermissionDeniedError",
        "UnauthenticatedError",
        "InvalidPathError",
        "NotSupportedError",
        "PreconditionError",
    ):
        return False
    text = str(exc)
    m = _STATUS.search(text)
    if m:
        code = int(m.group(1))
        return code >= 500 or code in (408, 429)
    low = text.lower()
    return any(t in low for t in _TRANSIENT_TEXT)


class _ShortRead(Exception):
    """The server sent fewer bytes than the range holds (a body cut short)."""


# ---------------------------------------------------------------------------------------
# the source
# ---------------------------------------------------------------------------------------


class BufferPool:
    """Receive buffers used again and again, so that a chunk's body lands in memory that is
    already mapped.

    Without it every body (MBs) is a fresh allocation that glibc maps afresh, and the kernel
    faults in and zeroes its pages for every chunk: on a fast link that was the largest part
    of what a remote reader spends beyond a local one (docs/remote.md, "Receive buffers").
    A buffer is handed out again only when nothing else refers to it (no view of it, no
    array over it is left), so bytes someone still holds are never overwritten. Free
    buffers beyond ``keep_bytes`` in all are let go.
    """

    def __init__(self, keep_bytes: int) -> None:
        self.keep_bytes = int(keep_bytes)
        #: buffers made so far (a reused buffer is not counted again)
        self.allocated = 0
        self._lock = threading.Lock()
        self._bufs: list[np.ndarray] = [np.empty(0, np.uint8)]
        # what "held by this pool alone" reads as, measured the way take() measures it
        self._free_refs = sys.getrefcount(self._bufs[0])
        self._bufs.clear()

    def take(self, n: int) -> np.ndarray:
        """A uint8 buffer of at least ``n`` bytes that no one else holds."""
        with self._lock:
            bufs = self._bufs
            for i in range(len(bufs)):
                if len(bufs[i]) >= n and sys.getrefcount(bufs[i]) == self._free_refs:
                    return bufs[i]
            size = -(-max(n, 1) // _BUFFER_STEP) * _BUFFER_STEP
            held = sum(len(b) for b in bufs)
            for i in reversed(range(len(bufs))):  # over the budget: let free buffers go
                if held + size <= self.keep_bytes:
                    break
                if sys.getrefcount(bufs[i]) == self._free_refs:
                    held -= len(bufs[i])
                    del bufs[i]
            bufs.append(np.empty(size, np.uint8))
            self.allocated += 1
            return bufs[-1]

    @property
    def nbytes(self) -> int:
        """Bytes of the buffers the pool holds (free or in use)."""
        with self._lock:
            return sum(len(b) for b in self._bufs)

    def clear(self) -> None:
        """Forget every buffer (those still in use live on with their users)."""
        with self._lock:
            self._bufs = []


@dataclass
class RemoteStats:
    """Counters of one source: ``requests`` (GETs sent, retries included), ``bytes``
    (received), ``retries`` (requests sent again after a transient failure), ``coalesced``
    (ranges served by a GET made for several)."""

    requests: int = 0
    bytes: int = 0
    retries: int = 0
    coalesced: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"requests": self.requests, "bytes": self.bytes, "retries": self.retries, "coalesced": self.coalesced}


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
    """A store file at a URL, read by ranged GETs (the ``ByteSource`` protocol).

    Knobs (keyword arguments, or the same names in ``storage_options``): ``max_inflight``
    (requests at once, default 16), ``timeout`` (seconds per request, 30), ``retries``
    (of a transient failure, 6), ``coalesce_bytes`` (largest GET of adjacent ranges,
    4 MiB), ``readahead_bytes`` (fetched ahead and not yet read, 256 MiB).
    """

    def __init__(
        self,
        url: str,
        storage_options: Mapping[str, Any] | None = None,
        *,
        max_inflight: int | None = None,
        timeout: float | None = None,
        retries: int | None = None,
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
            "coalesce_bytes": coalesce_bytes,
            "readahead_bytes": readahead_bytes,
        }
        knobs.update({k: v for k, v in given.items() if v is not None})
        self._knobs = knobs
        self.max_inflight = _positive("max_inflight", knobs.get("max_inflight", DEFAULT_MAX_INFLIGHT), url)
        self.timeout = float(knobs.get("timeout", DEFAULT_TIMEOUT))
        if not self.timeout > 0:
            raise InvalidInputError(f"{url}: timeout must be > 0 seconds, got {self.timeout!r}")
        self.retries = int(knobs.get("retries", DEFAULT_RETRIES))
        if self.retries < 0:
            raise InvalidInputError(f"{url}: retries must be >= 0, got {self.retries!r}")
        self.coalesce_bytes = int(knobs.get("coalesce_bytes", DEFAULT_COALESCE_BYTES))
        self.readahead_bytes = int(knobs.get("readahead_bytes", DEFAULT_READAHEAD_BYTES))
        opts = dict(self.storage_options)
        opts.update({k: v for k, v in knobs.items() if k in ("timeout", "connect_timeout")})
        self._store, self.key = make_object_store(url, opts)
        self._plain_url = plain_http_url(url, self.storage_options)
        self._conns = threading.local()
        self._buffers = BufferPool(self.readahead_bytes)
        self.stats = RemoteStats()
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: dict[tuple[int, int], tuple[_Run, int]] = {}
        #: ranges hinted by prefetch and not started yet (the read-ahead bound was reached)
        self._pending: OrderedDict[tuple[int, int], None] = OrderedDict()
        self._runs: list[_Run] = []
        self._ahead_bytes = 0
        self._closed = False
        # the first request: the frame header, and the object's size and identity
        self._head, meta = self._fetch_first(HEAD_READ_BYTES)
        self._size = int(meta["size"])
        self.etag: str | None = meta.get("e_tag")
        last = meta.get("last_modified")
        self.last_modified: str | None = (
            last.isoformat() if hasattr(last, "isoformat") else (str(last) if last else None)
        )

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
            self._lock = threading.Lock()
            self._pool = None
            self._ahead = {}
            self._pending = OrderedDict()
            self._runs = []
            self._ahead_bytes = 0
            self._conns = threading.local()
            self._buffers = BufferPool(self.readahead_bytes)
            self._pid = os.getpid()

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
        """Send one ranged GET with Python's HTTP client (forked children); the response,
        its status checked and its body not read yet."""
        parts = urlsplit(self._plain_url)
        conn = getattr(self._conns, "conn", None)
        if conn is None:
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
            raise _HTTPStatusError(f"GET {self._plain_url}: status {resp.status}: {body[:200]!r}")
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
                    raise _ShortRead(f"{len(body)} of {length} bytes arrived")
                out[:] = body
                return
            if resp.length is not None and resp.length != length:
                raise _ShortRead(f"the server sends {resp.length} bytes for a range of {length}")
            pos = 0
            while pos < length:
                n = resp.readinto(out[pos:])
                if not n:
                    raise _ShortRead(f"{pos} of {length} bytes arrived")
                pos += n
        except BaseException:
            self._plain_drop()
            raise

    def _fetch_first(self, n: int) -> tuple[bytes, dict[str, Any]]:
        def once() -> tuple[bytes, dict[str, Any]]:
            if self._plain_only():
                data, meta = self._plain_get(0, n)
            else:
                res = _obstore().get(self._store, self.key, options={"range": (0, n)})
                data, meta = bytes(res.bytes()), dict(res.meta)
            if len(data) < min(n, int(meta["size"])):
                raise _ShortRead(f"{len(data)} of {min(n, int(meta['size']))} bytes arrived")
            return data, meta

        return self._with_retries(once, 0, n)

    def _get(self, offset: int, length: int) -> memoryview:
        """``length`` bytes at ``offset``, as a read-only view of a pooled receive buffer."""

        def once() -> memoryview:
            out = memoryview(self._buffers.take(length))[:length]
            if self._plain_only():
                self._plain_fill(offset, out)
            else:
                # If-Match: an object replaced since opening fails the request instead of
                # handing out bytes of another file
                options: dict[str, Any] = {"range": (offset, offset + length)}
                if self.etag:
                    options["if_match"] = self.etag
                pos = 0
                for piece in (
                    _obstore().get(self._store, self.key, options=options).stream(min_chunk_size=_STREAM_PIECE)
                ):
                    n = len(piece)
                    if pos + n > length:
                        raise _ShortRead(f"more than the {length} bytes asked for arrived")
                    out[pos : pos + n] = piece
                    pos += n
                if pos != length:
                    raise _ShortRead(f"{pos} of {length} bytes arrived")
            return out.toreadonly()

        return self._with_retries(once, offset, length)

    def _with_retries(self, once: Any, offset: int, length: int) -> Any:
        self._check_process()
        attempt = 0
        while True:
            with self._lock:
                self.stats.requests += 1
            try:
                out = once()
            except Exception as exc:
                if isinstance(exc, RemoteReadError):
                    raise
                transient = is_transient(exc)
                if not transient or attempt >= self.retries or self._closed:
                    raise self._failure(exc, offset, length, attempt + 1, transient) from exc
                attempt += 1
                pause = random.uniform(0, min(BACKOFF_MAX, BACKOFF_BASE * 2 ** (attempt - 1)))
                with self._lock:
                    self.stats.retries += 1
                log.debug(
                    "%s: bytes %d-%d: retry %d of %d in %.2f s after %s: %s",
                    self.url, offset, offset + length, attempt, self.retries, pause, type(exc).__name__, _short(exc),
                )  # fmt: skip
                time.sleep(pause)
                continue
            n = len(out[0]) if isinstance(out, tuple) else len(out)
            with self._lock:
                self.stats.bytes += n
            return out

    def _failure(self, exc: BaseException, offset: int, length: int, attempts: int, transient: bool) -> RemoteReadError:
        if type(exc).__name__ == "PreconditionError":
            why = "the object was replaced since the store was opened (its ETag changed); open it again"
        elif isinstance(exc, FileNotFoundError) or type(exc).__name__ == "NotFoundError":
            why = "the object does not exist (check the URL, bucket and endpoint)"
        elif type(exc).__name__ == "NotSupportedError" and "range" in str(exc).lower():
            why = (
                "the server ignores Range requests (it sends the whole file); serve the store from one that honours "
                f"them (nginx, Apache, caddy, an object store), or download it whole (curl -O {self.url}) and open the file"
            )
        elif isinstance(exc, PermissionError) or type(exc).__name__ in (
            "PermissionDeniedError",
            "UnauthenticatedError",
        ):
            why = "access was denied (check the credentials: storage_options key/secret, or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
        elif transient:
            why = f"the server kept failing ({attempts} attempts, timeout {self.timeout:g} s each); check that it is up and reachable"
        else:
            why = "the server refused the request"
        return RemoteReadError(
            f"{self.url}: reading bytes {offset}-{offset + length} failed: {why}: {type(exc).__name__}: {_short(exc)}",
            url=self.url,
            offset=offset,
            length=length,
            attempts=attempts,
        )

    # -- ByteSource -------------------------------------------------------------------------------
    def read(self, offset: int, length: int) -> bytes | memoryview:
        """Exactly ``length`` bytes at ``offset`` (from the read-ahead when it holds them), as
        ``bytes`` or a read-only view of the response's buffer (no copy)."""
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
            hit = self._ahead.pop((offset, length), None)
            if hit is None:
                self._pending.pop((offset, length), None)  # read now: not again from the hints
        if hit is not None:
            run, at = hit
            try:
                assert run.future is not None
                data = run.future.result()
                return data[at : at + length]  # a view: the run's buffer lives while it is used
            finally:
                with self._lock:
                    run.unclaimed -= 1
                    if run.unclaimed == 0:
                        self._forget_run(run)
                        self._pump()
        return self._get(offset, length)

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

    def prefetch(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Fetch these ranges in the background, in this order: ``max_inflight`` GETs at a time,
        adjacent ranges coalesced, at most ``readahead_bytes`` fetched and not yet read (the
        rest wait as hints and start as reads free room)."""
        self._check_process()
        with self._lock:
            if self._closed:
                return
            self._drop_stale()
            for r in dict.fromkeys((int(o), int(n)) for o, n in ranges):
                if r not in self._ahead and self._valid(r):
                    self._pending[r] = None
            while len(self._pending) > _MAX_PENDING:  # hints too far ahead: forget the oldest
                self._pending.popitem(last=False)
            self._pump()

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
        run = _Run(start, length, len(pieces))
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
        for r in stale:
            self._forget_run(r)
        self._pump()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            self._ahead.clear()
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


def _positive(name: str, value: Any, url: str) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        v = 0
    if v < 1:
        raise InvalidInputError(f"{url}: {name} must be an integer >= 1, got {value!r}")
    return v


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + "..."


#: glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: what :func:`tune_malloc` sets, as the environment variables that would set it
TUNED_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}


def tune_malloc(
    mmap_threshold: int = int(TUNED_MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]),
    trim_threshold: int = int(TUNED_MALLOC_ENV["MALLOC_TRIM_THRESHOLD_"]),
) -> bool:
    """Keep large freed blocks in glibc malloc's heap, for this whole process (opt-in).

    glibc maps each large block (above its mmap threshold) afresh and unmaps it when freed,
    so a program that allocates and frees MB-sized buffers over and over pays page faults
    for each. This raises glibc's mmap threshold and trim threshold, as the environment
    variables ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_`` would, at the cost of
    freed memory going back to the system less eagerly (up to ``trim_threshold``).
    carraystore's remote reads no longer need it: their bodies land in reused buffers
    (:class:`BufferPool`), and in the storage-node benchmark the tuning no longer changed the
    rate (docs/remote.md, "Receive buffers"). Returns False and changes nothing when either
    variable is set (the environment's choice stands: Dask's nanny sets a small trim
    threshold on purpose) or when the C library is not glibc.
    """
    if any(name in os.environ for name in TUNED_MALLOC_ENV):
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold))) and bool(
        mallopt(_M_TRIM_THRESHOLD, int(trim_threshold))
    )


def open_source(url: str, storage_options: Mapping[str, Any] | None = None) -> RemoteSource:
    """The byte source of a store at ``url`` (one request: the frame header and the size)."""
    return RemoteSource(url, storage_options)
