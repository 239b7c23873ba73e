"""A TCP proxy on loopback that emulates a network link and injects faults.

Used by the remote tests (faults) and the remote benchmarks (a link with a round trip and
a bandwidth cap), in front of any HTTP server (SeaweedFS's S3 gateway, a plain HTTP
server)::

    with NetProxy("127.0.0.1", 8333, rtt=0.020, bandwidth=400e6 / 8) as proxy:
        url_endpoint = proxy.url          # http://127.0.0.1:<port>
        proxy.inject_503(2)               # the next 2 requests get "503 SlowDown"
        proxy.cut_after(100_000)          # drop a connection mid-body, once
        proxy.stall_after(100_000)        # stop sending, keep the connection open, once
        print(proxy.stats)                # connections, requests, bytes each way, faults

- ``rtt``: seconds added to every round trip (half on each direction, as a link's
  propagation delay: data keeps flowing, it just arrives later).
- ``bandwidth``: bytes per second, shared by every connection in each direction.
- Faults are armed for the next request(s) or the next bytes sent to the client; each is
  counted in ``stats``. Only loopback addresses are used.
- ``python -m testsupport.netproxy --to 127.0.0.1:8333 --rtt 0.02 --mbit 400``
  runs one in a process of its own (prints ``port N``), so that its threads do not share
  the GIL of the process being measured.
"""

from __future__ import annotations

import collections
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NetProxy", "ProxyStats"]

_BUF = 64 * 1024
_SLOWDOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


@dataclass
class ProxyStats:
    """What went through the proxy."""

    connections: int = 0
    requests: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    injected_503: int = 0
    cuts: int = 0
    stalls: int = 0
    request_lines: list[str] = field(default_factory=list)


class _Bucket:
    """A token bucket: ``rate`` bytes per second shared by its users (None: unlimited)."""

    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.lock = threading.Lock()
        self.next_free = time.monotonic()

    def take(self, n: int) -> None:
        if not self.rate:
            return
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_free)
            self.next_free = start + n / self.rate
            wait = self.next_free - now
        if wait > 0:
            time.sleep(wait)


class _Pipe:
    """One direction of one connection: read, delay by ``delay`` seconds, cap, write."""

    def __init__(self, proxy: NetProxy, src: socket.socket, dst: socket.socket, down: bool, conn: _Conn) -> None:
        self.proxy = proxy
        self.src = src
        self.dst = dst
        self.down = down
        self.conn = conn
        self.queue: collections.deque[tuple[float, bytes | None]] = collections.deque()
        self.cond = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True, name="netproxy-read")
        self.writer = threading.Thread(target=self._write, daemon=True, name="netproxy-write")

    def start(self) -> None:
        self.reader.start()
        self.writer.start()

    def put(self, data: bytes | None) -> None:
        with self.cond:
            self.queue.append((time.monotonic() + self.proxy.rtt / 2, data))
            self.cond.notify()

    def _read(self) -> None:
        try:
            if self.down:
                while True:
                    data = self.src.recv(_BUF)
                    if not data:
                        break
                    self.put(data)
            else:
                self.conn.read_requests(self)
        except OSError:
            pass
        self.put(None)

    def _write(self) -> None:
        proxy = self.proxy
        try:
            while True:
                with self.cond:
                    while not self.queue:
                        self.cond.wait()
                    due, data = self.queue.popleft()
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                if data is None:
                    try:
                        self.dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    return
                view = memoryview(data)
                while view:
                    piece = view[:_BUF]
                    if self.down:
                        fault = proxy._down_fault(len(piece))
                        if fault == "cut":
                            self.conn.reset()
                            return
                        if fault == "stall":
                            self.conn.stall()
                            return
                    (proxy.down_bucket if self.down else proxy.up_bucket).take(len(piece))
                    self.dst.sendall(piece)
                    with proxy.lock:
                        if self.down:
                            proxy.stats.bytes_down += len(piece)
                        else:
                            proxy.stats.bytes_up += len(piece)
                    view = view[len(piece) :]
        except OSError:
            self.conn.close()


class _Conn:
    """One client connection and its upstream connection."""

    def __init__(self, proxy: NetProxy, client: socket.socket) -> None:
        self.proxy = proxy
        self.client = client
        self.upstream = socket.create_connection(proxy.target, timeout=30)
        self.upstream.settimeout(None)
        self.closed = False
        self.up = _Pipe(proxy, client, self.upstream, down=False, conn=self)
        self.down = _Pipe(proxy, self.upstream, client, down=True, conn=self)
        self.reply_lock = threading.Lock()

    def start(self) -> None:
        self.up.start()
        self.down.start()

    def read_requests(self, pipe: _Pipe) -> None:
        """Forward the client's requests one by one (answering some with 503 itself)."""
        buf = b""
        sock = self.client
        while True:
            while b"\r\n\r\n" not in buf:
                data = sock.recv(_BUF)
                if not data:
                    if buf:
                        pipe.put(buf)
                    return
                buf += data
            head, _, buf = buf.partition(b"\r\n\r\n")
            head += b"\r\n\r\n"
            lines = head.split(b"\r\n")
            headers = {}
            for line in lines[1:]:
                k, _, v = line.partition(b":")
                headers[k.strip().lower()] = v.strip()
            proxy = self.proxy
            with proxy.lock:
                proxy.stats.requests += 1
                proxy.stats.request_lines.append(lines[0].decode("latin-1"))
                inject = proxy._pending_503 > 0
                if inject:
                    proxy._pending_503 -= 1
                    proxy.stats.injected_503 += 1
            if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
                # a body of unknown length: stop parsing, pass the rest through untouched
                pipe.put(head + buf)
                while True:
                    data = sock.recv(_BUF)
                    if not data:
                        return
                    pipe.put(data)
            length = int(headers.get(b"content-length", b"0") or 0)
            body_parts = []
            have = min(len(buf), length)
            body_parts.append(buf[:have])
            buf = buf[have:]
            left = length - have
            while left > 0:
                data = sock.recv(min(_BUF, left))
                if not data:
                    return
                body_parts.append(data)
                left -= len(data)
            if inject:
                reply = (
                    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                    + b"Content-Length: " + str(len(_SLOWDOWN)).encode() + b"\r\n\r\n" + _SLOWDOWN
                )  # fmt: skip
                # the answer travels the down direction, after the link's delay
                self.down.put(reply)
                continue
            pipe.put(head)
            for part in body_parts:
                if part:
                    pipe.put(part)

    def reset(self) -> None:
        """Drop both connections abruptly (RST): a connection lost in the middle of a body."""
        for s in (self.client, self.upstream):
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:
                pass
        self.close()

    def stall(self) -> None:
        """Stop forwarding to the client; the connection stays open until the proxy stops."""
        with self.proxy.lock:
            self.proxy._stalled.append(self)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for s in (self.client, self.upstream):
            try:
                s.close()
            except OSError:
                pass


class NetProxy:
    """Forwards ``127.0.0.1:<port>`` to ``(host, port)`` with a round trip, a cap and faults."""

    def __init__(self, host: str, port: int, *, rtt: float = 0.0, bandwidth: float | None = None) -> None:
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"NetProxy forwards to loopback only, not {host!r}")
        self.target = (host, int(port))
        self.rtt = float(rtt)
        self.up_bucket = _Bucket(bandwidth)
        self.down_bucket = _Bucket(bandwidth)
        self.stats = ProxyStats()
        self.lock = threading.Lock()
        self._pending_503 = 0
        self._cut_at: list[tuple[str, int]] = []  # (kind, downstream bytes still to pass)
        self._stalled: list[_Conn] = []
        self._conns: list[_Conn] = []
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self.port = self._listener.getsockname()[1]
        self._stopped = False
        self._thread = threading.Thread(target=self._accept, daemon=True, name="netproxy-accept")
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # -- faults ---------------------------------------------------------------------------
    def inject_503(self, n: int = 1) -> None:
        """Answer the next ``n`` requests with ``503 Slow Down`` (not forwarded)."""
        with self.lock:
            self._pending_503 += n

    def cut_after(self, nbytes: int, times: int = 1) -> None:
        """Drop the connection (RST) once ``nbytes`` more bytes went to the client; ``times`` times."""
        with self.lock:
            for _ in range(times):
                self._cut_at.append(("cut", int(nbytes)))

    def stall_after(self, nbytes: int, times: int = 1) -> None:
        """Stop sending to the client (connection left open) after ``nbytes`` more bytes."""
        with self.lock:
            for _ in range(times):
                self._cut_at.append(("stall", int(nbytes)))

    def _down_fault(self, n: int) -> str | None:
        with self.lock:
            if not self._cut_at:
                return None
            kind, left = self._cut_at[0]
            if left > n:
                self._cut_at[0] = (kind, left - n)
                return None
            self._cut_at.pop(0)
            if kind == "cut":
                self.stats.cuts += 1
            else:
                self.stats.stalls += 1
            return kind

    # -- lifetime ---------------------------------------------------------------------------
    def _accept(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                conn = _Conn(self, client)
            except OSError:
                client.close()  # the server is down: the client sees the connection closed
                continue
            with self.lock:
                self.stats.connections += 1
                self._conns.append(conn)
            conn.start()

    def stop(self) -> None:
        """Stop listening and close every connection."""
        self._stopped = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self._listener.close()
        except OSError:
            pass
        with self.lock:
            conns = list(self._conns)
        for c in conns:
            c.close()
        self._thread.join(timeout=5)

    def __enter__(self) -> NetProxy:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    """``python -m testsupport.netproxy --to 127.0.0.1:8333 --rtt 0.02 --mbit 400``

    Runs a proxy in a process of its own (so that its threads do not share the GIL with the
    process being measured); prints ``port <N>`` on its first line, then serves until killed.
    """
    import argparse
    import signal
    import sys

    ap = argparse.ArgumentParser(prog="python -m testsupport.netproxy", description=main.__doc__)
    ap.add_argument("--to", required=True, help="HOST:PORT to forward to (loopback only)")
    ap.add_argument("--rtt", type=float, default=0.0, help="added round trip, seconds")
    ap.add_argument("--mbit", type=float, default=None, help="bandwidth cap, Mbit/s, each direction")
    args = ap.parse_args(argv)
    host, _, port = args.to.rpartition(":")
    proxy = NetProxy(host, int(port), rtt=args.rtt, bandwidth=args.mbit * 1e6 / 8 if args.mbit else None)
    print(f"port {proxy.port}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    proxy.stop()
    sys.stdout.flush()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
