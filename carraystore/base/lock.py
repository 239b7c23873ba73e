"""One writer at a time: the writer lock of a store (layer 0).
Writers hold an exclusive ``fcntl.flock`` on ``.NAME.b2nd.lock``, whose content names the holder for
:class:`~carraystore.base.errors.StoreLockedError`. The kernel drops the lock when the holder dies, so
it is never stale. docs/appends.md says on which filesystems flock works."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
import weakref
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from carraystore.base.errors import CarrayStoreError, StoreLockedError, WriteError
from carraystore.base.forksafe import at_fork_in_child

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no locking (documented)
    fcntl = None  # type: ignore[assignment]

__all__ = ["WriterLock", "lock_path", "lock_holder"]

_POLL_S = 0.05
#: Locks this process holds: a forked child closes its copies (the parent keeps the lock).
_HELD: weakref.WeakSet[WriterLock] = weakref.WeakSet()


def _forget_in_child() -> None:
    for lock in list(_HELD):
        fd, lock._fd = lock._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)  # only the child's reference: the parent still holds the lock
    _HELD.clear()


at_fork_in_child(_forget_in_child)


def lock_path(path: Path) -> Path:
    """The lock file of the store at ``path``: ``.NAME.b2nd.lock`` in the same folder."""
    return path.with_name(f".{path.name}.lock")


def lock_holder(path: Path) -> dict[str, Any] | None:
    """What the lock file of ``path`` says about its holder (None when absent or unreadable)."""
    try:
        info = json.loads(lock_path(path).read_text() or "null")
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _describe(info: dict[str, Any] | None) -> str:
    if not info:
        return "another process (it has not written its name yet)"
    return (
        f"{info.get('purpose', 'a writer')} in process {info.get('pid')} on host {info.get('host')} "
        f"since {info.get('since')} ({info.get('command')})"
    )


class WriterLock:
    """The exclusive writer lock of one store; a context manager. ``timeout``: seconds to wait for
    another writer (0, the default, fails at once; None waits for ever); StoreLockedError names the holder."""

    def __init__(self, path: str | os.PathLike[str], purpose: str = "a writer", timeout: float | None = 0.0) -> None:
        self.path = Path(path)
        self.purpose = purpose
        self.timeout = timeout
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self, blocking: bool = True) -> bool:
        """Take the lock (waiting up to ``timeout``); with ``blocking=False`` return False instead of raising."""
        if self._fd is not None:
            return True
        if fcntl is None:  # pragma: no cover
            return True
        lp = lock_path(self.path)
        deadline = None if self.timeout is None else time.monotonic() + max(0.0, float(self.timeout))
        while True:
            try:
                # never through a link planted at this predictable name: it would truncate its target
                fd = os.open(
                    lp, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), 0o644
                )
            except OSError as exc:
                if not blocking:
                    return False
                if exc.errno == errno.ELOOP:
                    raise WriteError(
                        f"{lp} is a symbolic link; a writer never follows one at its lock file's name (it would "
                        "overwrite the file it points to): remove the link, then write again"
                    ) from exc
                raise CarrayStoreError(
                    f"{lp}: cannot create the writer lock file ({exc}); is the folder writable?"
                ) from exc
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                if not blocking:
                    return False
                if deadline is not None and time.monotonic() >= deadline:
                    waited = f" (waited {self.timeout:g} s)" if self.timeout else ""
                    raise StoreLockedError(
                        f"{self.path} is being written by {_describe(lock_holder(self.path))}{waited}; "
                        "one writer at a time: wait for it to finish, or pass lock_timeout=SECONDS (CLI: --wait SECONDS)"
                    ) from None
                time.sleep(_POLL_S)
                continue
            # the previous holder may have removed the file before our flock: it must still be at the lock path
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(lp))
            except OSError:
                same = False
            if not same:
                os.close(fd)
                continue
            self._fd = fd
            _HELD.add(self)
            self._write_info()
            return True

    def _write_info(self) -> None:
        info = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "command": " ".join(sys.argv)[:300] or sys.executable,
            "since": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "purpose": self.purpose,
        }
        fd = self._fd
        assert fd is not None
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)

    def release(self) -> None:
        """Let go: remove the lock file (while still holding it), then unlock."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        _HELD.discard(self)
        with contextlib.suppress(OSError):
            os.unlink(lock_path(self.path))
        os.close(fd)  # closing the last descriptor drops the flock

    def __enter__(self) -> WriterLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
