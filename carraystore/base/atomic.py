"""Atomic files: a file appears under its name only when complete (layer 0).
Writers write a hidden temporary beside the target (:func:`temp_path`), fsync and rename it into
place (:func:`publish`); the next writer holding the target's lock removes killed writers' temporaries
(:func:`remove_stale_temps`). :func:`named_write_errors` names failures (NoSpaceError, WriteError)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

from carraystore.base.errors import CarrayStoreError, NoSpaceError, StoreExistsError, WriteError

__all__ = [
    "refuse_folder_target",
    "temp_path",
    "remove_stale_temps",
    "fsync_path",
    "publish",
    "write_error",
    "named_write_errors",
]

# ``.NAME.partial-PID-RANDOM`` (stores) and ``.NAME.migrating-PID-RANDOM.b2nd`` (migrations)
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?:partial|migrating)-(?P<pid>\d+)-[0-9a-f]+(?:\.b2nd)?$")


def refuse_folder_target(path: Path) -> None:
    """A store is a file: an output path that is a folder is refused, overwrite or not."""
    if path.is_dir():
        raise StoreExistsError(
            f"{path} is a folder; a store is a file and overwrite replaces only a file: choose another name"
        )


def temp_path(path: Path, kind: str = "partial") -> Path:
    """A fresh hidden temporary name beside ``path`` for a writer of this process."""
    suffix = ".b2nd" if kind != "partial" else ""
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}{suffix}")


def remove_stale_temps(path: Path) -> None:
    """Remove temporary files that killed writers left next to ``path``. Call it holding ``path``'s
    :class:`~carraystore.base.lock.WriterLock`: every live writer holds it, so such files are then dead."""
    with contextlib.suppress(OSError):
        for p in path.parent.iterdir():
            m = _TEMP.match(p.name)
            if m and m.group("name") == path.name:
                with contextlib.suppress(OSError):
                    p.unlink()


def fsync_path(path: Path, directory: bool = False) -> None:
    """fsync a file (or a folder, so that a rename in it is durable); errors are ignored."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish(tmp: Path, path: Path) -> None:
    """Make the finished temporary file ``tmp`` the store at ``path``: fsync, rename, fsync the folder."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent, directory=True)


def write_text_atomically(path: Path, text: str) -> None:
    """``text`` as the whole of ``path``, never half-written: a temporary file, fsynced and renamed over it."""
    tmp = temp_path(path)
    try:
        tmp.write_text(text)
        publish(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


#: A write failing while the folder has less free space than this (plus ``need``) failed for lack of space.
_SPACE_MARGIN = 1 << 20


def _size_limit(target: Path, need: int) -> int | None:
    """The process's file size limit (``ulimit -f``) when a write of ``need`` more bytes to ``target`` may hit it."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        size = target.stat().st_size
    except OSError:
        size = 0
    return soft if size + need + _SPACE_MARGIN >= soft else None


def write_error(exc: BaseException, target: Path, what: str, need: int = 0) -> WriteError:
    """The named error for a failed write of ``what`` into ``target``. blosc2 fails with a bare
    ``RuntimeError`` (no errno), so "no space" is also read from free space below ``need`` + 1 MiB,
    and "file too large" from a file size limit (``ulimit -f``) within reach."""
    folder = target.parent
    free: int | None = None
    with contextlib.suppress(OSError):
        st = os.statvfs(folder)
        free = st.f_bavail * st.f_frsize
    code = getattr(exc, "errno", None)
    cause = str(exc) or type(exc).__name__
    if code is None and (limit := _size_limit(target, need)) is not None:
        code = errno.EFBIG
        cause = f"[Errno {code}] {os.strerror(code)}: files are limited to {limit} bytes (ulimit -f); {cause}"
    if code in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)) or (
        code is None and free is not None and free < need + _SPACE_MARGIN
    ):
        left = f" ({free} bytes free)" if free is not None else ""
        error: WriteError = NoSpaceError(
            f"no space left on {folder}{left} while writing {what} to {target}; "
            "free some space or write elsewhere (the unfinished file is removed)"
        )
    else:
        error = WriteError(
            f"could not write {what} to {target} ({cause}); check the folder's permissions, quota and file size limit"
        )
    error.errno = code or (errno.ENOSPC if isinstance(error, NoSpaceError) else errno.EIO)
    return error


@contextlib.contextmanager
def named_write_errors(target: Path, what: str, need: int = 0) -> Iterator[None]:
    """Turn a failed write inside the block (``OSError``, blosc2's ``RuntimeError``) into :func:`write_error`."""
    try:
        yield
    except CarrayStoreError:
        raise
    except (RuntimeError, OSError) as exc:
        raise write_error(exc, target, what, need) from exc
