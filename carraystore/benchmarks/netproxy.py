"""A TCP proxy on loopback that emulates a network link: added round-trip time and a bandwidth cap.

``LinkProxy(target_port, rtt_ms=20, mbit=400)`` listens on a free 127.0.0.1 port and
forwards every connection to ``127.0.0.1:target_port``. Each direction's bytes are held
for half the round-trip time, and the bytes of all connections share one token bucket
per direction (one link of ``mbit`` megabits per second, like a NIC), so many requests
in flight share the cap as they would on a real link. It counts connections, bytes and
HTTP requests (request lines seen from the client), which the remote benchmark reports.

Connection setup is not delayed (clients keep connections alive; the handshake is paid
once per connection). Only loopback targets are accepted. It runs an asyncio loop in a
daemon thread; ``stop()`` closes the listener and every connection.
"""

from __future__ import annotations

import asyncio
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

__all__ = ["LinkProxy", "LinkStats"]

_REQUEST_LINE = re.compile(rb"(?:^|\r\n)(GET|HEAD|PUT|POST|DELETE) \S+ HTTP/1\.[01]\r\n")
_BLOCK = 64 * 1024


@dataclass
class LinkStats:
    """Traffic through the proxy since it started (or since ``reset()``)."""

    connections: int = 0
    requests: int = 0
    bytes_up: int = 0  # client -> server
    bytes_down: int = 0  # server -> client
    gets: int = 0


class _Bucket:
    """One direction of the link: bytes leave no faster than ``mbit`` megabits per second."""

    #: seconds of sending time that may be made up after a late wake-up (sleep overshoot)
    BURST_S = 0.05

    def __init__(self, mbit: float | None) -> None:
        self.rate = mbit * 1e6 / 8 if mbit else None
        self.free_at = 0.0

    async def send(self, n: int) -> None:
        if self.rate is None:
            return
        now = time.monotonic()
        self.free_at = max(self.free_at, now - self.BURST_S) + n / self.rate
        wait = self.free_at - now
        if wait > 0:
            await asyncio.sleep(wait)


class LinkProxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target_port`` with ``rtt_ms`` and ``mbit``."""

    def __init__(self, target_port: int, rtt_ms: float = 0.0, mbit: float | None = None, target_host: str = "127.0.0.1") -> None:
        if not target_host.startswith("127.") and target_host not in ("localhost", "::1"):
            raise ValueError(f"LinkProxy forwards to loopback only, not {target_host}")
        self.target = (target_host, int(target_port))
        self.rtt_ms = float(rtt_ms)
        self.mbit = mbit
        self.stats = LinkStats()
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:PORT``: the proxied server's URL."""
        return f"http://127.0.0.1:{self.port}"

    def reset(self) -> LinkStats:
        """Return the counts so far and start counting from zero."""
        with self._lock:
            old, self.stats = self.stats, LinkStats()
        return old

    def start(self) -> LinkProxy:
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            asyncio.set_event_loop(loop)
            self._up, self._down = _Bucket(self.mbit), _Bucket(self.mbit)
            self._server = loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            self.port = self._server.sockets[0].getsockname()[1]
            ready.set()
            try:
                loop.run_forever()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name=f"linkproxy-{self.target[1]}", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the link proxy did not start")
        return self

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return

        async def shutdown() -> None:
            self._server.close()
            for t in list(self._tasks):
                t.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        try:
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(10)
            self._loop = None

    def __enter__(self) -> LinkProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- forwarding ------------------------------------------------------------------------
    async def _handle(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            sreader, swriter = await asyncio.open_connection(*self.target)
        except OSError:
            cwriter.close()
            self._tasks.discard(task)
            return
        with self._lock:
            self.stats.connections += 1
        try:
            await asyncio.gather(
                self._pipe(creader, swriter, self._up, upstream=True),
                self._pipe(sreader, cwriter, self._down, upstream=False),
            )
        except asyncio.CancelledError:
            pass
        finally:
            self._tasks.discard(task)
            for w in (cwriter, swriter):
                w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, bucket: _Bucket, upstream: bool) -> None:
        delay = self.rtt_ms / 2000.0
        queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                item = await queue.get()
                if item is None:
                    break
                due, data = item
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                await bucket.send(len(data))
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()

        task = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await reader.read(_BLOCK)
                if not data:
                    break
                with self._lock:
                    if upstream:
                        self.stats.bytes_up += len(data)
                        # a client writes a request's head in one piece: its line starts a read or follows \r\n
                        found = _REQUEST_LINE.findall(data)
                        self.stats.requests += len(found)
                        self.stats.gets += sum(1 for m in found if m == b"GET")
                    else:
                        self.stats.bytes_down += len(data)
                queue.put_nowait((time.monotonic() + delay, data))
        except (ConnectionError, OSError):
            pass
        finally:
            queue.put_nowait(None)
            try:
                await task
            except (ConnectionError, OSError):
                pass
