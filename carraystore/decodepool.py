"""The decoding processes of a local ingest: a process pool whose workers end with the ingest.

:func:`decoded` hands groups of files to ``workers`` processes (forkserver, else spawn)
and yields the results in file order with a bounded number of groups in flight. Each
worker watches the ingesting process (:func:`_exit_with_parent`) and ends when it is gone,
so a killed ingest leaves no decoding process behind.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from carraystore.images import DecodeOptions, decode_files

__all__ = ["decoded"]

#: Files per task sent to a decoding process.
_FILES_PER_TASK = 16


def _exit_with_parent(main_pid: int) -> None:
    """Worker initializer: end this decoding process as soon as the ingesting process is gone.

    A killed ingest (SIGKILL) cannot stop its pool, and a dead process stays a zombie (still
    "alive" to ``kill(pid, 0)``) until its caller reaps it, which a caller reading the
    ingest's output pipes to EOF first never does (and the forkserver, the workers' parent,
    lives as long as they do). So every 0.25 s the worker checks that the ingesting process
    exists and is no zombie (``/proc``), and that it was not re-parented; on Linux it also
    asks for SIGKILL when its parent dies (``PR_SET_PDEATHSIG``).
    """
    import threading

    parent = os.getppid()
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - no prctl in this libc
            pass

    def gone() -> bool:
        if os.getppid() != parent:
            return True
        try:
            os.kill(main_pid, 0)
            with open(f"/proc/{main_pid}/stat", "rb") as f:  # a zombie is dead, though kill() finds it
                return f.read().rpartition(b")")[2].split()[0] in (b"Z", b"X")
        except FileNotFoundError:  # no /proc (macOS): kill() is the test
            return False
        except (ProcessLookupError, PermissionError):  # gone, or a reused pid of another user
            return True

    def watch() -> None:
        while not gone():
            time.sleep(0.25)
        os._exit(1)

    if gone():  # the parent died before the death signal was asked for
        os._exit(1)
    threading.Thread(target=watch, name="carraystore-parent-watch", daemon=True).start()


def decoded(
    root: Path, rels: list[str], opts: DecodeOptions, workers: int
) -> Iterator[tuple[str, np.ndarray | None, str | None]]:
    """Yield (rel, array or None, error or None) in the order of ``rels``; memory bounded."""
    tasks = [rels[i : i + _FILES_PER_TASK] for i in range(0, len(rels), _FILES_PER_TASK)]
    if workers <= 1:
        for t in tasks:
            for rel, (arr, err) in zip(t, decode_files(str(root), t, opts), strict=True):
                yield rel, arr, err
        return
    methods = multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    with cf.ProcessPoolExecutor(
        max_workers=workers, mp_context=ctx, initializer=_exit_with_parent, initargs=(os.getpid(),)
    ) as pool:
        pending: deque[tuple[list[str], cf.Future]] = deque()
        it = iter(tasks)
        try:
            for t in it:
                pending.append((t, pool.submit(decode_files, str(root), t, opts)))
                if len(pending) >= 3 * workers:
                    break
            while pending:
                t, fut = pending.popleft()
                nxt = next(it, None)
                if nxt is not None:
                    pending.append((nxt, pool.submit(decode_files, str(root), nxt, opts)))
                for rel, (arr, err) in zip(t, fut.result(), strict=True):
                    yield rel, arr, err
        finally:
            for _, fut in pending:
                fut.cancel()
