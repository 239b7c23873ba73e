"""Fault injectors, used inside a forked worker process.

- :func:`kill_at_call`: SIGKILL the process at its K-th file-system call (``os.write``,
  ``os.pwrite``, ``os.ftruncate``, ``os.fsync``, ``os.replace``, ``os.unlink`` ... as the
  library makes them through the ``os`` module), before that call runs. Writes that
  blosc2 makes in C are not counted: a kill lands before or after them, never inside.
- :func:`limit_file_size`: ``RLIMIT_FSIZE`` with ``SIGXFSZ`` ignored, so a write past the
  limit fails with ``EFBIG`` as a full disk fails with ``ENOSPC``.
- :class:`Tmpfs`: a real small tmpfs (needs the right to mount; :func:`tmpfs_available`
  says whether this machine gives it) filled up to a few pages, so writes fail with ``ENOSPC``.
- :data:`MUTANTS`: seeded bugs, to show that the checker catches what they break.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "COUNTED",
    "MUTANTS",
    "Tmpfs",
    "apply_mutant",
    "disarm",
    "kill_at_call",
    "limit_file_size",
    "restore_file_size",
    "tmpfs_available",
]

#: The ``os`` functions counted as file-system calls that change something.
COUNTED = (
    "write",
    "pwrite",
    "writev",
    "pwritev",
    "ftruncate",
    "truncate",
    "fsync",
    "fdatasync",
    "replace",
    "rename",
    "unlink",
    "remove",
    "link",
    "sendfile",
    "copy_file_range",
    "posix_fallocate",
)
_REAL: dict[str, Callable[..., Any]] = {n: getattr(os, n) for n in COUNTED if hasattr(os, n)}
_state: dict[str, Any] = {"calls": 0, "armed": False}


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_at_call(k: int, *, while_exists: Path | None = None, trace: Callable[[str], None] | None = None) -> None:
    """From now on, SIGKILL this process before its ``k``-th counted call (1 = the first).

    ``while_exists``: count only calls made while that file exists (the journal: a kill
    there leaves a hot journal), and die at the latest before that file is removed.
    ``trace(name)`` sees every counted call (for ``--replay``).
    """
    _state.update(calls=0, armed=True, k=k)

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if _state["armed"]:
                gone = (
                    while_exists is not None
                    and name in ("unlink", "remove", "rename", "replace")
                    and args
                    and os.fspath(args[0]) == os.fspath(while_exists)
                )
                if while_exists is None or os.path.exists(while_exists):
                    _state["calls"] += 1
                    if trace is not None:
                        trace(f"{_state['calls']}: os.{name}")
                    if _state["calls"] >= k or gone:
                        _die()
            return real(*args, **kwargs)

        return counted

    for name, real in _REAL.items():
        setattr(os, name, wrap(name, real))


def disarm() -> int:
    """Stop counting; put the real functions back. Returns the calls counted."""
    _state["armed"] = False
    for name, real in _REAL.items():
        setattr(os, name, real)
    return int(_state["calls"])


def limit_file_size(nbytes: int) -> None:
    """No file this process writes may grow past ``nbytes``: such writes fail with EFBIG."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    _soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (max(0, nbytes), hard))


def restore_file_size() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))


class Tmpfs:
    """A small tmpfs mounted on ``folder`` (``size`` bytes), for real ``ENOSPC``."""

    def __init__(self, folder: Path, size: int = 4 << 20) -> None:
        self.folder = folder
        self.size = size
        self.mounted = False

    def mount(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={self.size},mode=0755", "tmpfs", str(self.folder)],
            check=True,
            capture_output=True,
            timeout=20,
        )
        self.mounted = True

    def unmount(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.folder)], check=False, capture_output=True, timeout=20)
            self.mounted = False

    def __enter__(self) -> Tmpfs:
        self.mount()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.unmount()


def free_bytes(folder: Path) -> int:
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


def fill(folder: Path, leave: int) -> Path:
    """Fill the file system of ``folder`` until about ``leave`` bytes are free; returns the filler file."""
    filler = folder / "filler.bin"
    free = free_bytes(folder)
    size = max(0, free - leave)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        block = b"\0" * (1 << 20)
        while size > 0:
            try:
                n = _REAL["write"](fd, block[: min(size, len(block))])
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
            size -= n
    finally:
        os.close(fd)
    return filler


_TMPFS_PROBE: dict[str, str | None] = {}


def tmpfs_available() -> str | None:
    """None when this process may mount a small tmpfs, else why not (the ENOSPC runs are skipped)."""
    if "why" not in _TMPFS_PROBE:
        why: str | None = None
        if shutil.which("mount") is None:
            why = "no mount command"
        elif hasattr(os, "geteuid") and os.geteuid() != 0:
            why = "not root: cannot mount a small tmpfs"
        else:
            probe = Path(tempfile.mkdtemp(prefix="carraystore-tmpfs-probe-"))
            t = Tmpfs(probe, 1 << 20)
            try:
                t.mount()
            except (OSError, subprocess.SubprocessError) as exc:
                why = f"mount -t tmpfs failed ({getattr(exc, 'stderr', b'') or exc!s})".strip()
            finally:
                t.unmount()
                with contextlib.suppress(OSError):
                    probe.rmdir()
        _TMPFS_PROBE["why"] = why
    return _TMPFS_PROBE["why"]


# -- seeded bugs ---------------------------------------------------------------------------------


class _Proxy:
    """A module stand-in: ``overrides`` first, then the real module's attributes."""

    def __init__(self, module: Any, **overrides: Any) -> None:
        self._module = module
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _rollback_without_truncate() -> None:
    import carraystore.sources.journal as journal

    assert hasattr(journal, "os") and hasattr(journal, "rollback"), "the journal module changed: update the mutant"
    setattr(journal, "os", _Proxy(os, ftruncate=lambda fd, length: None))  # noqa: B010


def _no_flock() -> None:
    import hashlib

    import carraystore.base.lock as lock

    real = getattr(lock, "fcntl", None)
    assert real is not None, "the lock module changed: update the mutant"

    def flock(fd: int, op: int) -> None:
        """No lock. Writers that "take" it meet first: each waits (up to 0.3 s) until another
        process arrived at the same lock within the last 0.3 s, so that writers let in at
        one moment overlap even on a loaded machine (else one may finish before the next runs)."""
        if not op & real.LOCK_EX:
            return
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            return
        arrivals = Path(tempfile.gettempdir()) / f"carraystore-no-flock-{hashlib.sha1(path.encode()).hexdigest()}"
        with open(arrivals, "a") as f:
            f.write(f"{os.getpid()} {time.time()}\n")
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            now = time.time()
            recent = {
                pid for pid, t in (line.split() for line in arrivals.read_text().splitlines()) if now - float(t) < 0.3
            }
            if len(recent - {str(os.getpid())}) >= 1:
                return
            time.sleep(0.002)

    setattr(lock, "fcntl", _Proxy(real, flock=flock))  # noqa: B010

    import carraystore.store.inplace as inplace

    write_meta = getattr(inplace, "_write_meta", None)
    assert write_meta is not None, "the in-place writer changed: update the mutant"

    def slow_write_meta(array: Any, meta: Any) -> None:
        time.sleep(0.05)  # a commit that takes a while: a writer let in beside it reads the old state
        write_meta(array, meta)

    setattr(inplace, "_write_meta", slow_write_meta)  # noqa: B010


def _journal_kept() -> None:
    import carraystore.store.inplace as inplace

    # a commit that never removes its journal: the next opener rolls the committed write back
    assert hasattr(inplace, "remove_journal"), "the in-place writer changed: update the mutant"
    setattr(inplace, "remove_journal", lambda path: None)  # noqa: B010


def _wrong_pixel() -> None:
    import blosc2
    import numpy as np

    real = blosc2.compress2

    def compress2(src: Any, *args: Any, **kw: Any) -> Any:
        if isinstance(src, np.ndarray) and src.ndim >= 2 and src.size:  # a chunk of items, not metadata
            src = np.array(src, copy=True)
            src.reshape(-1).view(np.uint8)[0] ^= 0x10  # one bit of the chunk's first pixel
        return real(src, *args, **kw)

    blosc2.compress2 = compress2


#: Seeded bugs a campaign can run under (``--mutant NAME``): the checker must report them.
MUTANTS: dict[str, Callable[[], None]] = {
    "rollback-no-truncate": _rollback_without_truncate,
    "no-flock": _no_flock,
    "journal-kept": _journal_kept,
    "wrong-pixel": _wrong_pixel,
}


def apply_mutant(name: str | None) -> None:
    if name:
        MUTANTS[name]()
