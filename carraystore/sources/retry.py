"""Retries of remote requests: which failures are transient, backoff, a budget in time (layer 2).
Transient (:func:`is_transient`): timeouts, refused or dropped connections, bodies cut short, 5xx,
408, 429, S3's ``503 SlowDown``; not 404, 403, a replaced object or a server ignoring ``Range``.
:class:`Retrier` logs retries at DEBUG on ``carraystore.sources.remote``, a WARNING per ``log_every``
s of failing, and finally raises :class:`~carraystore.base.errors.RemoteReadError` (URL, byte range)."""

from __future__ import annotations

import http.client
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from carraystore.base.errors import RemoteReadError

__all__ = [
    "BACKOFF_BASE",
    "BACKOFF_MAX",
    "LOG_EVERY",
    "HTTPStatusError",
    "RetryPolicy",
    "Retrier",
    "ShortRead",
    "backoff",
    "is_transient",
    "short",
    "status_of",
    "what_failed",
]

log = logging.getLogger("carraystore.sources.remote")

#: First and longest pause between retries (seconds; each pause is drawn from [0, cap]).
BACKOFF_BASE = 0.1
BACKOFF_MAX = 5.0
#: Seconds between the warnings a source logs while a server keeps failing.
LOG_EVERY = 10.0

T = TypeVar("T")


class ShortRead(Exception):
    """The server sent fewer bytes than the range holds (a body cut short)."""


class HTTPStatusError(Exception):
    """A plain-HTTP GET answered with an error status."""


# -- which failures are worth retrying --------------------------------------------------
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
#: obstore appends a multi-line dump of the Rust error after this; the line before says it
_DEBUG_DUMP = "Debug source:"


def status_of(exc: BaseException) -> int | None:
    """The HTTP status a failed request's error names, if any."""
    m = _STATUS.search(str(exc))
    return int(m.group(1)) if m else None


def is_transient(exc: BaseException) -> bool:
    """Whether a failed request may succeed when tried again."""
    if isinstance(exc, (ShortRead, TimeoutError, ConnectionError, http.client.HTTPException)):
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
    code = status_of(exc)
    if code is not None:
        return code >= 500 or code in (408, 429)
    low = str(exc).lower()
    return any(t in low for t in _TRANSIENT_TEXT)


def what_failed(exc: BaseException, timeout: float | None = None) -> str:
    """What a transient failure was, in words: refused, timed out, dropped, an HTTP status."""
    text = str(exc)
    low = text.lower()
    if isinstance(exc, ConnectionRefusedError) or "connection refused" in low or "connectionrefused" in low:
        return "the connection was refused (nothing listens at the server's address: is it up?)"
    timed_out = (
        isinstance(exc, TimeoutError)
        or "timed out" in low
        or "timedout" in low
        or "kind: timeout" in low
        or "operation timeout" in low
    )
    if timed_out:
        within = f" within {timeout:g} s" if timeout else ""
        return f"the request timed out (no answer{within})"
    code = status_of(exc)
    if code is not None:
        return f"the server answered HTTP {code}"
    if isinstance(exc, ShortRead):
        return f"the body was cut short ({exc})"
    if isinstance(exc, (ConnectionResetError, BrokenPipeError)) or "reset by peer" in low or "connectionreset" in low:
        return "the connection was reset"
    if any(t in low for t in ("incomplete", "unexpected eof", "end of file", "error decoding response body")):
        return "the connection was dropped in the middle of the body"
    return "the request failed"


def short(exc: BaseException, limit: int = 300) -> str:
    """An error's text on one line, obstore's Rust debug dump left out, at most ``limit`` characters."""
    text = str(exc)
    head, sep, _ = text.partition(_DEBUG_DUMP)
    if sep and head.strip():
        text = head
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def backoff(attempt: int, base: float = BACKOFF_BASE, cap: float = BACKOFF_MAX, rand: Any = random.uniform) -> float:
    """The pause before retry ``attempt`` (1, 2, ...): full jitter over ``base * 2**(attempt-1)`` capped at ``cap``."""
    return float(rand(0.0, min(cap, base * 2 ** min(attempt - 1, 60))))


# -- the policy and the loop ------------------------------------------------------------
@dataclass
class RetryPolicy:
    """How a failing request is tried again: ``retry_timeout`` s from the first failure (default 120: a
    restarting storage node is waited for), ``retries`` a count limit too (None: none), ``timeout`` s per
    attempt (for messages), ``log_every`` s between warnings; ``clock``, ``sleep``, ``rand`` for tests."""

    retry_timeout: float = 120.0
    retries: int | None = None
    timeout: float | None = None
    log_every: float = LOG_EVERY
    backoff_base: float = BACKOFF_BASE
    backoff_max: float = BACKOFF_MAX
    clock: Callable[[], float] = time.monotonic
    sleep: Callable[[float], None] = time.sleep
    rand: Callable[[float, float], float] = random.uniform


class Retrier:
    """Runs the requests of one source (``url``) under a :class:`RetryPolicy`; thread-safe.
    ``on_attempt()``/``on_retry()`` are called before every attempt/retry; ``closed()`` True ends retrying."""

    def __init__(
        self,
        url: str,
        policy: RetryPolicy,
        *,
        on_attempt: Callable[[], None] | None = None,
        on_retry: Callable[[], None] | None = None,
        closed: Callable[[], bool] | None = None,
    ) -> None:
        self.url = url
        self.policy = policy
        self._on_attempt = on_attempt or (lambda: None)
        self._on_retry = on_retry or (lambda: None)
        self._closed = closed or (lambda: False)
        self._lock = threading.Lock()
        self._next_warning = float("-inf")

    def call(self, once: Callable[[], T], offset: int, length: int) -> T:
        """``once()``, retried while it fails transiently within budget; RemoteReadError when it fails for good."""
        p = self.policy
        first_failure: float | None = None
        attempt = 0
        while True:
            self._on_attempt()
            try:
                return once()
            except RemoteReadError:
                raise
            except Exception as exc:
                now = p.clock()
                if first_failure is None:
                    first_failure = now
                failing = now - first_failure
                transient = is_transient(exc)
                out_of_count = p.retries is not None and attempt >= p.retries
                if not transient or out_of_count or failing >= p.retry_timeout or self._closed():
                    raise self.failure(exc, offset, length, attempt + 1, failing, transient, out_of_count) from exc
                attempt += 1
                pause = min(backoff(attempt, p.backoff_base, p.backoff_max, p.rand), p.retry_timeout - failing)
                self._on_retry()
                log.debug(
                    "%s: bytes %d-%d: retry %d in %.2f s after %s: %s",
                    self.url, offset, offset + length, attempt, pause, type(exc).__name__, short(exc),
                )  # fmt: skip
                self._maybe_warn(now, failing, attempt, exc, offset, length)
                p.sleep(max(0.0, pause))

    def _maybe_warn(
        self, now: float, failing: float, attempts: int, exc: BaseException, offset: int, length: int
    ) -> None:
        """A warning once per ``log_every`` seconds for the source, once a request has failed that long."""
        p = self.policy
        if failing < p.log_every:
            return
        with self._lock:
            if now < self._next_warning:
                return
            self._next_warning = now + p.log_every
        log.warning(
            "%s: bytes %d-%d: the server has been failing for %.0f s (%d attempts; the last: %s); "
            "trying again for up to %.0f s more (storage option retry_timeout=%g)",
            self.url, offset, offset + length, failing, attempts, what_failed(exc, p.timeout),
            max(0.0, p.retry_timeout - failing), p.retry_timeout,
        )  # fmt: skip

    def failure(
        self,
        exc: BaseException,
        offset: int,
        length: int,
        attempts: int,
        failing: float,
        transient: bool,
        out_of_count: bool = False,
    ) -> RemoteReadError:
        """The error that ends a request: what happened, the URL and the byte range."""
        url = self.url
        name = type(exc).__name__
        if name == "PreconditionError":
            why = "the object was replaced since the store was opened (its ETag changed); open it again"
        elif isinstance(exc, FileNotFoundError) or name == "NotFoundError":
            why = "the object does not exist (check the URL, bucket and endpoint)"
        elif name == "NotSupportedError" and "range" in str(exc).lower():
            why = (
                "the server ignores Range requests (it sends the whole file); serve the store from one that honours "
                f"them (nginx, Apache, caddy, an object store), or download it whole (curl -O {url}) and open the file"
            )
        elif isinstance(exc, PermissionError) or name in ("PermissionDeniedError", "UnauthenticatedError"):
            why = "access was denied (check the credentials: storage_options key/secret, or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
        elif transient:
            what = what_failed(exc, self.policy.timeout)
            if self._closed():
                why = f"{what}; the source was closed meanwhile"
            elif attempts == 1:  # the option that allowed none: retries=0, or a retry_timeout already spent
                options = ["retries=0"] if out_of_count else []
                if failing >= self.policy.retry_timeout:
                    options.append(f"retry_timeout={self.policy.retry_timeout:g}")
                allowed = f" (storage option {' and '.join(options)})" if options else ""
                why = f"{what}; no retries allowed{allowed}"
            else:
                limit = (
                    f"retries={self.policy.retries} spent"
                    if out_of_count
                    else f"retry_timeout={self.policy.retry_timeout:g} s spent"
                )
                why = (
                    f"the server kept failing for {failing:.1f} s ({attempts} attempts, {limit}); the last attempt: "
                    f"{what}; check that the server is up and reachable, or raise the storage option retry_timeout"
                )
        else:
            code = status_of(exc)
            why = "the request failed and cannot succeed when tried again" + (f" (HTTP {code})" if code else "")
        return RemoteReadError(
            f"{url}: reading bytes {offset}-{offset + length} failed: {why}: {name}: {short(exc)}",
            url=url,
            offset=offset,
            length=length,
            attempts=attempts,
        )
