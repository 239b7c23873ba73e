"""Crash safety of in-place writes under faults: a rollback killed at each of its system calls,
a full disk (a file size limit) at every stage of an append, a metadata update and a copy, a store
with a second name (a hard link), and a store moved onto the path while an append is at work."""

from __future__ import annotations

import os
import pickle
import resource
import shutil
import signal
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import indexed_images

import carraystore
import carraystore.store.inplace as inplace_module
from carraystore.base.errors import (
    CarrayStoreError,
    CorruptStoreError,
    InvalidInputError,
    StoreChangedError,
    WriteError,
)
from carraystore.base.lock import WriterLock
from carraystore.sources.journal import journal_path, rollback

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or not hasattr(signal, "SIGXFSZ"), reason="needs POSIX")

SHAPE = (8, 8, 3)
CHUNK = 4
N = 40
_images = partial(indexed_images, shape=SHAPE)
#: an attr of 6,000 characters that does not compress: removing it shortens the file by about 4 KB
BIG = {"big": np.random.default_rng(1).bytes(3000).hex()}


def _store(path: Path, n: int = N, **kw: Any) -> Path:
    with carraystore.create(path, SHAPE, chunk_images=CHUNK, nthreads=1, **kw) as w:
        w.append(_images(0, n), labels=np.arange(n) % 5, keys=[f"d/{i}.png" for i in range(n)])
    return path


def _append(path: Path, start: int, n: int) -> None:
    with carraystore.append(path, nthreads=1) as w:
        w.append(_images(start, n), labels=np.arange(n) % 5, keys=[f"n/{i}.png" for i in range(start, start + n)])


def _tail_at(path: Path) -> int:
    """Where the data chunks end: the write's marker goes here."""
    with carraystore.open(path) as s:
        return int(s._frame.header_len + s._frame.cbytes)


def _in_child(work: Callable[[], object], *, fsize: int | None = None) -> tuple[str, str, bool, str]:
    """Run ``work()`` in a forked child (under a file size limit of ``fsize`` bytes, SIGXFSZ ignored so that
    writes fail with EFBIG); return the class name, message, whether it is a CarrayStoreError, and its notes."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            os.close(r)
            if fsize is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, resource.RLIM_INFINITY))
            with warnings.catch_warnings(record=True) as warned:  # Python 3.10: notes come as warnings
                warnings.simplefilter("always")
                try:
                    work()
                    out = ("ok", "", True, "")
                except BaseException as exc:
                    notes = " | ".join([*getattr(exc, "__notes__", []), *(str(w.message) for w in warned)])
                    out = (type(exc).__name__, str(exc), isinstance(exc, CarrayStoreError), notes)
            os.write(w, pickle.dumps(out))
        finally:
            os._exit(0)
    os.close(w)
    data = b""
    while block := os.read(r, 1 << 16):
        data += block
    os.close(r)
    os.waitpid(pid, 0)
    result: tuple[str, str, bool, str] = pickle.loads(data)
    return result


def _check_intact(path: Path, n: int, original: bytes | None = None) -> None:
    """The store opens (repaired by the open if a journal is left) and holds ``n`` items: the ``original``
    bytes when given, else it verifies and holds the first N images."""
    with carraystore.open(path) as s:
        assert len(s) == n
        if original is None:
            s.verify()
            np.testing.assert_array_equal(s[:N], _images(0, N))
    assert not journal_path(path).exists()
    if original is not None:
        assert path.read_bytes() == original


# -- rollback killed at each of its system calls -------------------------------------------------------

_CALLS = ("pwrite", "write", "ftruncate", "fsync", "unlink", "rename", "replace")


def _rollback_killed_at(path: Path, k: int, torn: bool) -> int:
    """In a forked child holding the writer lock, roll ``path``'s journal back, SIGKILLed just before its
    ``k``-th write, truncate, fsync or unlink (``torn``: a ``pwrite`` writes half its bytes first).
    Returns the child's wait status (0: the rollback finished before its ``k``-th call)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            count = [0]

            def counted(name: str, real: Callable[..., Any], *args: Any) -> Any:
                count[0] += 1
                if count[0] == k:
                    if torn and name == "pwrite" and len(args[1]) > 1:
                        real(args[0], bytes(args[1])[: len(args[1]) // 2], args[2])
                    os.kill(os.getpid(), signal.SIGKILL)
                return real(*args)

            with WriterLock(path, purpose="test rollback"):
                for name in _CALLS:
                    setattr(os, name, partial(counted, name, getattr(os, name)))
                rollback(path)
        finally:
            os._exit(0)
    return os.waitpid(pid, 0)[1]


def _die_in_child(path: Path, where: str) -> None:
    """Leave a hot journal: a forked child writes to ``path`` and is killed at ``where``."""

    def die(*_: Any, **__: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        try:
            if where == "chunks":  # chunks written after the marker, the header and index not yet
                inplace_module._InPlaceWrite.commit = die  # type: ignore[method-assign]
            elif where == "header":  # header and offsets index rewritten, the trailer not yet
                inplace_module._write_meta = die
            else:  # the new store complete, the journal not yet removed
                inplace_module.remove_journal = die  # type: ignore[attr-defined]
            if where == "meta-shrunk":  # a metadata update that shortened the file
                carraystore.update_metadata(path, remove_attrs=["big"])
            else:
                _append(path, N, 9)
        finally:
            os._exit(0)
    assert os.waitpid(pid, 0)[1] == signal.SIGKILL
    assert journal_path(path).exists()


@pytest.mark.parametrize("where", ["chunks", "header", "committed", "meta-shrunk"])
def test_a_rollback_killed_at_any_system_call_is_finished_by_the_next_open(tmp_path: Path, where: str) -> None:
    """Rollback wrote the saved tail over the write's marker, then truncated: killed in between,
    the file held neither the marker nor the old state, and every open raised StaleJournalError."""
    path = _store(tmp_path / "s.b2nd", attrs=BIG if where == "meta-shrunk" else None)
    original = path.read_bytes()
    _die_in_child(path, where)
    hot, journal = path.read_bytes(), journal_path(path).read_bytes()
    points = 0
    for k in range(1, 40):
        finished = True
        for torn in (False, True):
            path.write_bytes(hot)
            journal_path(path).write_bytes(journal)
            status = _rollback_killed_at(path, k, torn)
            if status == 0:
                continue
            finished = False
            assert status == signal.SIGKILL
            points += 1
            if journal_path(path).exists():  # a reader while a writer holds the lock: the store before the write
                with WriterLock(path, purpose="test"), carraystore.open(path) as s:
                    assert len(s) == N
                    np.testing.assert_array_equal(s[N - 3 :], _images(N - 3, 3))
            _check_intact(path, N, original)  # the next open finishes the rollback
        if finished:
            break
    assert points >= 8, points  # every write, the truncate, the fsyncs and the journal's removal were hit
    _append(path, N, 5)  # and the store takes appends again
    _check_intact(path, N + 5)


# -- a full disk (a file size limit) ------------------------------------------------------------------


def _limits(path: Path) -> list[int]:
    """File size limits at every stage of a write to ``path``: before the marker, inside it, between it and
    the old end of the file, and past the end (the chunks, the index, the trailer)."""
    mark, end = _tail_at(path), path.stat().st_size
    return [mark - 5, mark + 10, mark + 40, end - 3, end + 50, end + 700, end + 2000]


def _named(result: tuple[str, str, bool, str], path: Path) -> None:
    name, message, named, _ = result
    assert named, f"{name}: {message}"
    assert isinstance(message, str) and str(path.name) in message and "File too large" in message, message


def test_a_full_disk_during_an_append_is_a_named_error_and_the_store_stays_whole(tmp_path: Path) -> None:
    """With the limit between the marker and the old end of the file, the rollback in abort() raised a
    bare OSError (errno 27) that masked the WriteError; inside the marker it left a journal that no
    longer matched its file (StaleJournalError on every open)."""
    src = _store(tmp_path / "src.b2nd")
    original = src.read_bytes()
    for limit in _limits(src):
        path = tmp_path / f"append-{limit}.b2nd"
        shutil.copyfile(src, path)
        result = _in_child(partial(_append, path, N, 30), fsize=limit)
        if result[0] == "ok":
            _check_intact(path, N + 30)
        else:
            _named(result, path)
            _check_intact(path, N, original)


def test_a_full_disk_during_a_metadata_update_or_a_copy_is_a_named_error(tmp_path: Path) -> None:
    src = _store(tmp_path / "src.b2nd", attrs={"big": "x" * 3000})
    original = src.read_bytes()
    for limit in _limits(src):
        path = tmp_path / f"meta-{limit}.b2nd"
        shutil.copyfile(src, path)
        attrs = {"more": np.random.default_rng(limit).integers(0, 10, 900).tolist()}  # grows the trailer
        result = _in_child(partial(carraystore.update_metadata, path, attrs=attrs), fsize=limit)
        if result[0] == "ok":
            with carraystore.open(path) as s:
                assert s.meta.attrs["more"] == attrs["more"]
        else:
            _named(result, path)
            _check_intact(path, N, original)
        copy = tmp_path / f"copy-{limit}.b2nd"
        result = _in_child(partial(carraystore.copy, src, copy), fsize=limit)
        if result[0] == "ok":
            assert copy.read_bytes() == original
        else:
            _named(result, copy)
            assert sorted(p.name for p in tmp_path.iterdir() if f"copy-{limit}" in p.name) == []


def test_a_failing_undo_never_masks_the_error_that_made_the_write_abort(tmp_path: Path) -> None:
    """A metadata update that shortened the file fails after its trailer is written; undoing it must
    grow the file again, past a file size limit set just then: the undo fails too. The first error comes
    out, the second as a note; the journal stays, and the next open rolls it back. (The rollback in
    abort() raised a bare OSError that replaced the first error.)"""
    path = _store(tmp_path / "s.b2nd", attrs=BIG)
    original = path.read_bytes()

    def update() -> None:
        def fail(_: object) -> None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 10, resource.RLIM_INFINITY))
            raise CorruptStoreError(f"{path}: the read-back check fails (simulated)")

        inplace_module.open_unguarded = fail  # type: ignore[attr-defined,assignment]  # the forked child only
        carraystore.update_metadata(path, remove_attrs=["big"])

    name, message, named, notes = _in_child(update)
    assert (name, named) == ("CorruptStoreError", True) and "simulated" in message
    assert "undoing the write failed too" in notes and "File too large" in notes and "journal" in notes, notes
    assert journal_path(path).exists() and path.stat().st_size < len(original)
    _check_intact(path, N, original)


# -- hard links ----------------------------------------------------------------------------------------


def test_a_store_with_a_hard_link_is_not_written_in_place(tmp_path: Path) -> None:
    """The lock and the journal sit beside each name: two appends through two names of one file were
    both acknowledged and the first was lost, and a reader through the other name saw uncommitted data."""
    path = _store(tmp_path / "s.b2nd")
    link = tmp_path / "h.b2nd"
    os.link(path, link)
    original = path.read_bytes()
    for name in (path, link):
        with pytest.raises(InvalidInputError, match=r"2 names \(hard links.*cp .*mv "):
            _append(name, N, 6)
        with pytest.raises(InvalidInputError, match="hard links"):
            carraystore.update_metadata(name, attrs={"a": 1})
    assert path.read_bytes() == original and not journal_path(path).exists() and not journal_path(link).exists()
    # what the message says: a file of its own for this name; the other keeps the old store
    shutil.copyfile(path, tmp_path / "s.b2nd.copy")
    os.replace(tmp_path / "s.b2nd.copy", path)
    _append(path, N, 6)
    _check_intact(path, N + 6)
    _check_intact(link, N, original)


def test_a_hard_link_made_during_an_append_stops_its_commit(tmp_path: Path) -> None:
    path = _store(tmp_path / "s.b2nd")
    original = path.read_bytes()
    w = carraystore.append(path, nthreads=1)
    w.append(_images(N, 9), labels=np.zeros(9, int), keys=[f"n/{i}.png" for i in range(9)])
    os.link(path, tmp_path / "h.b2nd")
    try:  # a reader through the new name finds no journal: the half-written file fails by name, never reads new
        with carraystore.open(tmp_path / "h.b2nd") as s:
            assert len(s) == N
    except CorruptStoreError:
        pass
    with pytest.raises(InvalidInputError, match="hard links"):
        w.close()
    for name in (path, tmp_path / "h.b2nd"):  # through both names: the store before the append
        _check_intact(name, N, original)


# -- a store moved onto the path during an append -------------------------------------------------------


def test_a_store_moved_onto_the_path_during_an_append_is_left_untouched(tmp_path: Path) -> None:
    """The commit wrote the metadata through blosc2.open(path): the other store's keys, labels and CRCs
    were replaced by the append's, and it no longer opened."""
    path = _store(tmp_path / "s.b2nd")
    original = path.read_bytes()
    other = _store(tmp_path / "other.b2nd", n=12)
    others = other.read_bytes()
    w = carraystore.append(path, nthreads=1)
    w.append(_images(N, 9), labels=np.zeros(9, int), keys=[f"n/{i}.png" for i in range(9)])
    os.rename(path, tmp_path / "moved.b2nd")  # `mv s.b2nd moved.b2nd; mv other.b2nd s.b2nd`
    os.rename(other, path)
    with pytest.raises(StoreChangedError, match=r"replaced by another file.*not committed.*left as it is"):
        w.close()
    assert path.read_bytes() == others and not journal_path(path).exists()
    with carraystore.open(path) as s:
        assert len(s) == 12
        s.verify()
    assert (tmp_path / "moved.b2nd").read_bytes() == original  # the file it wrote: undone through its descriptor


def test_write_errors_are_never_bare_os_errors(tmp_path: Path) -> None:
    """A journal that cannot be written (its folder is full) is a WriteError naming the journal."""
    path = _store(tmp_path / "s.b2nd")
    result = _in_child(partial(_append, path, N, 9), fsize=100)
    assert result[0] in ("WriteError", "NoSpaceError") and result[2], result
    assert ".s.b2nd.journal" in result[1] and "File too large" in result[1]
    assert issubclass(WriteError, OSError)  # callers catching OSError still catch it
    _check_intact(path, N)
