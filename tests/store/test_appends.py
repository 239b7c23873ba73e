"""In-place appends, the writer lock and readers during appends."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import blosc2
import numpy as np
import pytest
from helpers import indexed_images, kill_mid_append

import carraystore
from carraystore.base.errors import StoreExistsError, StoreLockedError
from carraystore.format.frame import read_frame
from carraystore.sources.local import LocalFileSource

SHAPE = (16, 16, 3)
CHUNK = 4
ROOT = Path(__file__).resolve().parents[2]


_images = partial(indexed_images, shape=SHAPE)


def _keys(start: int, n: int) -> list[str]:
    return [f"d/{j}.png" for j in range(start, start + n)]


def _store(path: Path, n: int) -> None:
    with carraystore.create(path, SHAPE, chunk_images=CHUNK) as w:
        w.append(_images(0, n), labels=np.arange(n) % 5, keys=_keys(0, n))


def _append(path: Path, start: int, n: int, **kw: object) -> None:
    with carraystore.append(path, **kw) as w:  # type: ignore[arg-type]
        w.append(_images(start, n), labels=np.arange(start, start + n) % 5, keys=_keys(start, n))


def _data_region(path: Path) -> tuple[int, int]:
    f = read_frame(LocalFileSource(path))
    return f.header_len, f.header_len + f.cbytes


def test_append_only_adds_bytes_after_the_old_data(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    _store(path, 7)  # a partial last chunk
    for start, n in ((7, 5), (12, 1), (13, 4), (17, 0)):
        old = path.read_bytes()
        h, end = _data_region(path)
        _append(path, start, n)
        new = path.read_bytes()
        assert new[h:end] == old[h:end], "an old data chunk was overwritten"
        f = read_frame(LocalFileSource(path))
        assert f.header_len == h and f.header_len + f.cbytes >= end
        if n == 0:
            assert new == old  # an append of nothing changes nothing
    total = 17
    with carraystore.open(path) as s:
        assert np.array_equal(s[:], _images(0, total)) and list(s.keys) == _keys(0, total) and s.verify() == []
    # plain blosc2 reads the appended frame too
    assert np.array_equal(blosc2.open(str(path), mode="r")[...], _images(0, total))
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]


def _bytes_written() -> int:
    """Bytes this process has handed to write calls so far (Linux /proc/self/io ``wchar``)."""
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["wchar"])


@pytest.mark.skipif(not Path("/proc/self/io").exists(), reason="needs Linux /proc/self/io")
def test_append_costs_what_it_adds(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    _store(path, 2000)
    size, inode = path.stat().st_size, path.stat().st_ino
    before = _bytes_written()
    _append(path, 2000, 8)
    written = _bytes_written() - before
    # 8 images of 768 bytes, the journal (header, offsets, trailer), the rewritten metadata
    # (~30 bytes an image): a small fraction of the store, and no copy of it
    assert written < size / 10, (written, size)
    assert path.stat().st_ino == inode  # the same file, grown in place (no copy renamed over it)
    with carraystore.open(path) as s:
        assert np.array_equal(s[1995:], _images(1995, 13))


def test_abort_restores_the_store_byte_for_byte(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    _store(path, 10)
    old = path.read_bytes()
    with pytest.raises(RuntimeError, match="boom"), carraystore.append(path) as w:
        w.append(_images(10, 9), labels=np.arange(9) % 5, keys=_keys(10, 9))
        assert path.read_bytes() != old  # chunks were written in place
        raise RuntimeError("boom")
    assert path.read_bytes() == old
    assert not (tmp_path / ".s.b2nd.journal").exists()


def test_readers_before_during_and_after_an_append(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    _store(path, 10)
    early = carraystore.open(path)
    assert np.array_equal(early[8:10], _images(8, 2))  # maps the file before the append
    w = carraystore.append(path)
    w.append(_images(10, 11), labels=np.arange(10, 21) % 5, keys=_keys(10, 11))  # chunks now in the file
    assert (tmp_path / ".s.b2nd.journal").exists()
    during = carraystore.open(path)  # a writer at work: the store as it was, through the journal
    assert len(during) == 10 and np.array_equal(during[:], _images(0, 10)) and during.verify() == []
    w.close()
    after = carraystore.open(path)
    assert len(after) == 21 and np.array_equal(after[:], _images(0, 21)) and after.verify() == []
    # the readers opened earlier still read the old store, whole and unchanged
    for old in (early, during):
        assert len(old) == 10 and np.array_equal(old[:], _images(0, 10)) and old.verify() == []
        old.close()
    after.close()


def test_a_second_writer_gets_an_error_naming_the_holder(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    _store(path, 5)
    with carraystore.append(path) as w:
        with pytest.raises(StoreLockedError, match=rf"append in process {os.getpid()} on host"):
            carraystore.append(path)
        with pytest.raises(StoreLockedError, match="being written by append"):
            carraystore.create(path, SHAPE, overwrite=True)
        w.append(_images(5, 1), labels=[0], keys=_keys(5, 1))
    # the lock went with the writer
    assert not (tmp_path / ".s.b2nd.lock").exists()
    _append(path, 6, 1)
    assert len(carraystore.open(path)) == 7


def test_a_second_writer_waits_with_lock_timeout(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    _store(path, 5)
    w = carraystore.append(path)
    w.append(_images(5, 2), labels=np.arange(5, 7) % 5, keys=_keys(5, 2))
    threading.Timer(0.3, w.close).start()
    t0 = time.monotonic()
    _append(path, 7, 3, lock_timeout=10)
    assert time.monotonic() - t0 >= 0.25
    with carraystore.open(path) as s:
        assert np.array_equal(s[:], _images(0, 10)) and list(s.keys) == _keys(0, 10)
    # and a timeout that runs out names the holder
    w2 = carraystore.append(path)
    t0 = time.monotonic()
    with pytest.raises(StoreLockedError, match=r"waited 0.2 s"):
        carraystore.append(path, lock_timeout=0.2)
    assert time.monotonic() - t0 >= 0.2
    w2.abort()


def test_two_creates_of_one_target_never_both_succeed(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    w = carraystore.create(path, SHAPE)
    with pytest.raises(StoreLockedError):
        carraystore.create(path, SHAPE, overwrite=True)
    w.append(_images(0, 3))
    w.close()
    with pytest.raises(StoreExistsError):  # and after the first one, the second sees its store
        carraystore.create(path, SHAPE, lock_timeout=1)


APPENDER = """
import sys, numpy as np, carraystore
path, who, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
for r in range(rounds):
    with carraystore.append(path, lock_timeout=60) as w:
        w.append(np.full((3, 16, 16, 3), r, np.uint8), labels=[1, 2, 3], keys=[f"{who}/{r}/{i}" for i in range(3)])
"""


def test_two_processes_appending_at_once_lose_nothing(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    _store(path, 5)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen([sys.executable, "-c", APPENDER, str(path), who, "12"], env=env, stderr=subprocess.PIPE)
        for who in ("a", "b")
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
    with carraystore.open(path) as s:
        assert len(s) == 5 + 2 * 12 * 3 and s.verify() == []
        keys = list(s.keys)[5:]
        assert sorted(keys) == sorted(f"{who}/{r}/{i}" for who in "ab" for r in range(12) for i in range(3))
        # each append's three images stayed together with their keys
        for j in range(0, len(keys), 3):
            who, r, _ = keys[j].split("/")
            assert keys[j : j + 3] == [f"{who}/{r}/{i}" for i in range(3)]
            assert np.all(s[5 + j : 5 + j + 3] == int(r))


LOOP = """
import sys, numpy as np, carraystore
path, start = sys.argv[1], int(sys.argv[2])
def images(a, n):
    return np.stack([np.random.default_rng(i).integers(0, 256, (16, 16, 3), dtype=np.uint8) for i in range(a, a + n)])
i = start
print("go", flush=True)
while True:
    with carraystore.append(path, lock_timeout=None) as w:
        w.append(images(i, 6), labels=np.arange(i, i + 6) % 5, keys=[f"d/{j}.png" for j in range(i, i + 6)])
    i += 6
"""


def _for_at_least(seconds: float, at_most: float = 60.0) -> Callable[[bool], bool]:
    """``keep_going(enough)``: True for ``seconds``, then until ``enough`` or ``at_most`` seconds.
    A loop racing another process checks for a while, and a loaded machine gets longer to
    show what the test waits for, rather than a false failure."""
    t0 = time.monotonic()

    def keep_going(enough: bool) -> bool:
        t = time.monotonic() - t0
        return t < seconds or (not enough and t < at_most)

    return keep_going


def test_opening_during_an_append_loop_never_sees_damage(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    _store(path, 9)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", LOOP, str(path), "9"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"go"
        seen: set[int] = set()
        keep_going = _for_at_least(3.0)
        opens = 0
        # at least 3 s, and on a loaded machine until the store grew twice (at most 60 s)
        while keep_going(len(seen) >= 3):
            with carraystore.open(path) as s:  # never a false "damaged"
                n = len(s)
                assert (n - 9) % 6 == 0
                assert np.array_equal(s[n - 2 :], _images(n - 2, 2))
                assert s.keys[n - 1] == f"d/{n - 1}.png"
            seen.add(n)
            opens += 1
        assert len(seen) >= 3, seen  # the store grew while it was opened again and again
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with carraystore.open(path) as s:
        assert s.verify() == [] and np.array_equal(s[:], _images(0, len(s)))


def test_a_dead_writers_temp_files_go_whatever_pid_they_name(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    _store(path, 3)
    # left by writers on other hosts, or killed: pid 1 is alive here, yet nobody holds the lock
    stale = [tmp_path / ".s.b2nd.partial-1-0badc0de", tmp_path / ".s.b2nd.migrating-1-0badc0de.b2nd"]
    for p in stale:
        p.write_bytes(b"x" * 100)
    _append(path, 3, 2)
    assert not any(p.exists() for p in stale)


def test_lock_file_names_its_holder(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    _store(path, 3)
    with carraystore.append(path):
        info = json.loads((tmp_path / ".s.b2nd.lock").read_text())
        assert info["pid"] == os.getpid() and info["purpose"] == "append" and info["host"] and info["since"]


def test_ingest_into_a_target_another_writer_holds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from carraystore.base.lock import WriterLock
    from carraystore.cli.main import main
    from carraystore.ingest.sample_data import make_photo_folder

    folder = make_photo_folder(tmp_path / "photos", n=12, size=(32, 32), seed=3)
    out = tmp_path / "s.b2nd"
    holder = WriterLock(out, purpose="ingest")
    holder.acquire()
    # the second ingest fails, naming the first; nothing is written
    assert main(["ingest", str(folder), str(out), "-q", "--workers", "1"]) != 0
    err = capsys.readouterr().err
    assert "being written by ingest" in err and f"process {os.getpid()}" in err and "--wait" in err
    assert not out.exists()
    # with --wait it runs once the first writer is done
    threading.Timer(0.5, holder.release).start()
    t0 = time.monotonic()
    assert main(["ingest", str(folder), str(out), "-q", "--workers", "1", "--wait", "20"]) == 0
    assert time.monotonic() - t0 >= 0.4
    with carraystore.open(out) as s:
        assert len(s) == 12 and s.verify() == []


HOLD_AND_FORK = """
import os, sys, time, carraystore
w = carraystore.append(sys.argv[1])
pid = os.fork()
if pid == 0:
    time.sleep(60)
    os._exit(0)
print(pid, flush=True)
time.sleep(60)
"""


def test_a_killed_writers_forked_children_do_not_keep_its_lock(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    _store(path, 5)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", HOLD_AND_FORK, str(path)], env=env, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    try:
        with pytest.raises(StoreLockedError):
            carraystore.append(path)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        os.kill(child, 0)  # the forked child lives on (60 s)
        # yet the lock died with the writer (the wait covers the child still running its fork hooks)
        _append(path, 5, 2, lock_timeout=5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    assert len(carraystore.open(path)) == 7


def test_two_paths_to_one_store_share_one_lock(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    _store(path, 5)
    link = tmp_path / "link.b2nd"
    link.symlink_to(path)
    with carraystore.append(link) as w:
        with pytest.raises(StoreLockedError):
            carraystore.append(path)
        w.append(_images(5, 3), labels=np.arange(5, 8) % 5, keys=_keys(5, 3))
        with carraystore.open(link) as during:  # the journal beside the real file is found
            assert len(during) == 5
    with carraystore.open(link) as s:
        assert np.array_equal(s[:], _images(0, 8))


def _kill_mid_append(path: Path, start: int) -> None:
    """Leave a hot journal: a child writes 9 images in place and is SIGKILLed before close()."""
    kill_mid_append(
        path, lambda w: w.append(_images(start, 9), labels=np.arange(start, start + 9) % 5, keys=_keys(start, 9))
    )


def test_a_reader_that_cannot_roll_back_reads_the_old_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import carraystore.sources.journal

    path = tmp_path / "s.b2nd"
    _store(path, 6)
    old = path.read_bytes()
    _kill_mid_append(path, 6)
    assert (tmp_path / ".s.b2nd.journal").exists() and path.stat().st_size > len(old)
    torn = path.read_bytes()
    # a reader without write permission (root can write anyway: the check is what is replaced)
    monkeypatch.setattr(carraystore.sources.journal.os, "access", lambda *a, **k: False)
    with carraystore.open(path) as s:
        assert len(s) == 6 and np.array_equal(s[:], _images(0, 6)) and s.verify() == []
        assert list(s.keys) == _keys(0, 6)
    assert path.read_bytes() == torn and (tmp_path / ".s.b2nd.journal").exists()  # nothing written
    monkeypatch.undo()
    # a reader that may write rolls it back: the old store, byte for byte
    with carraystore.open(path) as s:
        assert len(s) == 6
    assert path.read_bytes() == old and not (tmp_path / ".s.b2nd.journal").exists()


def test_a_killed_migrations_temp_files_go_with_the_next_migrate(tmp_path: Path) -> None:
    from carraystore.migrations.core import migrate

    src = tmp_path / "cache.npz"
    np.savez(src, images=_images(0, 10), labels=np.arange(10) % 3)
    out = tmp_path / "out.b2nd"
    holder = carraystore.create(out, SHAPE)  # a writer at work on the target
    # a migrate killed on this host (its pid is alive: ours) or on another one
    stale = tmp_path / f".out.b2nd.migrating-{os.getpid()}-0badc0de.b2nd"
    stale.write_bytes(b"x" * 1000)
    with pytest.raises(StoreLockedError, match="being written by create"):
        migrate(src, out, images="images", labels="labels", progress=False)
    assert stale.exists()  # nobody removes a temp file while the target's lock is held
    holder.abort()
    migrate(src, out, images="images", labels="labels", progress=False)
    assert not stale.exists()
    with carraystore.open(out) as s:
        assert np.array_equal(s[:], _images(0, 10))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache.npz", "out.b2nd"]


# -- metadata updates (carraystore meta) are writers like appends ------------------------------

HOLD_APPEND = """
import sys, numpy as np, carraystore
w = carraystore.append(sys.argv[1])
w.append(np.full((3, 16, 16, 3), 7, np.uint8), labels=[1, 2, 3], keys=["h/0", "h/1", "h/2"])
print("go", flush=True)
sys.stdin.readline()  # holds the lock until the parent says so
w.close()
"""

HOLD_META = """
import json, sys, carraystore.store.inplace as ip, carraystore.store.metadata as w
real = ip._write_meta
def paused(array, meta):
    real(array, meta)  # the new trailer is written; the journal and the lock are still there
    print("go", flush=True)
    sys.stdin.readline()
ip._write_meta = paused
w.update_metadata(sys.argv[1], **json.loads(sys.argv[2]))
"""
BLOB = np.random.default_rng(5).bytes(20000).hex()
GROW = json.dumps({"class_names": ["a", "b", "c", "d", "e"], "attrs": {"blob": BLOB}})


def _child(script: str, path: Path, *args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(path), *args],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"go", (
        proc.stderr.read() if proc.stderr else ""
    )
    return proc


def _let_go(proc: subprocess.Popen[bytes]) -> None:
    _, err = proc.communicate(b"\n", timeout=60)
    assert proc.returncode == 0, err.decode()[-2000:]


def test_a_meta_update_and_an_append_exclude_each_other(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from carraystore.cli.main import main
    from carraystore.store.metadata import update_metadata

    path = tmp_path / "s.b2nd"
    _store(path, 6)
    start, stop = _data_region(path)
    pixels = path.read_bytes()[start:stop]
    # another process appends: a metadata update is refused, naming it, and changes nothing
    proc = _child(HOLD_APPEND, path)
    try:
        with pytest.raises(StoreLockedError, match=rf"being written by append in process {proc.pid} on host"):
            update_metadata(path, attrs={"epochs": 3})
        assert main(["meta", str(path), "--attr", "epochs=3"]) == 2
        err = capsys.readouterr().err
        assert f"append in process {proc.pid}" in err and "--wait" in err
        # with --wait it runs once the append is done
        threading.Timer(0.5, proc.stdin.write, [b"\n"]).start()  # type: ignore[union-attr]
        threading.Timer(0.6, proc.stdin.flush).start()  # type: ignore[union-attr]
        t0 = time.monotonic()
        assert main(["meta", str(path), "--attr", "epochs=3", "--wait", "30", "--json"]) == 0
        assert time.monotonic() - t0 >= 0.4
        assert json.loads(capsys.readouterr().out)["attrs"] == {"epochs": 3}
    finally:
        _let_go(proc)
    with carraystore.open(path) as s:  # neither write was lost
        assert len(s) == 9 and s.attrs == {"epochs": 3} and s.verify() == []
        assert list(s.keys)[6:] == ["h/0", "h/1", "h/2"]
    assert path.read_bytes()[start:stop] == pixels
    # another process updates the metadata: an append is refused, naming it; readers read the old store
    before = path.read_bytes()
    proc = _child(HOLD_META, path, GROW)
    try:
        assert (tmp_path / ".s.b2nd.journal").exists()  # the one rollback journal, as an append's
        with pytest.raises(StoreLockedError, match=rf"being written by meta in process {proc.pid} on host"):
            _append(path, 9, 2)
        with pytest.raises(StoreLockedError, match=rf"meta in process {proc.pid}"):
            update_metadata(path, attrs={"epochs": 4})
        with carraystore.open(path) as during:  # the store before the update, through the journal
            assert during.attrs == {"epochs": 3} and during.class_names is None
            assert len(during) == 9 and during.verify() == [] and np.array_equal(during[:6], _images(0, 6))
    finally:
        _let_go(proc)
    assert not (tmp_path / ".s.b2nd.journal").exists() and not (tmp_path / ".s.b2nd.lock").exists()
    assert path.read_bytes() != before
    _append(path, 9, 2)
    with carraystore.open(path) as s:
        assert len(s) == 11 and s.class_names == ("a", "b", "c", "d", "e") and s.attrs["blob"] == BLOB
        assert s.verify() == [] and np.array_equal(s[9:], _images(9, 2))
    assert path.read_bytes()[start:stop] == pixels  # the old chunks' bytes, never rewritten


def test_a_meta_update_killed_mid_write_is_rolled_back_by_a_reader(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    _store(path, 6)
    old = path.read_bytes()
    proc = _child(HOLD_META, path, GROW)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (tmp_path / ".s.b2nd.journal").exists() and path.read_bytes() != old
    with carraystore.open(path) as s:  # the writer is gone: the reader rolls its write back first
        assert s.attrs == {} and s.class_names is None and len(s) == 6 and s.verify() == []
    assert path.read_bytes() == old and not (tmp_path / ".s.b2nd.journal").exists()


def test_a_reader_during_a_shrinking_meta_update_reads_the_old_store(tmp_path: Path) -> None:
    from carraystore.store.metadata import update_metadata

    path = tmp_path / "s.b2nd"
    _store(path, 6)
    update_metadata(path, attrs={"blob": BLOB, "epochs": 3})
    old_size = path.stat().st_size
    proc = _child(HOLD_META, path, json.dumps({"remove_attrs": ["blob"]}))
    try:
        assert path.stat().st_size < old_size - 10_000  # the trailer shrank; the journal holds the old one
        with carraystore.open(path) as during:  # the bytes past the file's end come from the journal
            assert during.attrs == {"blob": BLOB, "epochs": 3} and during.verify() == []
            assert np.array_equal(during[:], _images(0, 6))
    finally:
        _let_go(proc)
    with carraystore.open(path) as s:
        assert s.attrs == {"epochs": 3} and s.verify() == [] and np.array_equal(s[:], _images(0, 6))


META_LOOP = """
import sys, numpy as np, carraystore.store.metadata as w
path = sys.argv[1]
print("go", flush=True)
i = 0
while True:
    blob = np.random.default_rng(i).bytes(4000 * (i % 4)).hex()  # the trailer grows and shrinks
    w.update_metadata(path, class_names=[f"c{i}-{j}" for j in range(5)], attrs={"round": i, "blob": blob}, lock_timeout=None)
    i += 1
"""


def test_opening_during_a_meta_update_loop_never_sees_damage(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    _store(path, 9)
    start, stop = _data_region(path)
    pixels = path.read_bytes()[start:stop]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", META_LOOP, str(path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"go"
        rounds: set[int] = set()
        n = 9
        opens = 0
        # at least 3 s, and on a loaded machine until 3 updates and an append were seen (at most 60 s)
        keep_going = _for_at_least(3.0)
        while keep_going(len(rounds) >= 3 and n > 9):
            with carraystore.open(path) as s:  # never a false "damaged", never a mix of two updates
                r = s.attrs.get("round")
                if r is not None:
                    assert s.attrs["blob"] == np.random.default_rng(r).bytes(4000 * (r % 4)).hex()
                    assert s.class_names == tuple(f"c{r}-{j}" for j in range(5))
                    rounds.add(r)
                assert (
                    len(s) == n and np.array_equal(s[n - 2 :], _images(n - 2, 2)) and s.keys[n - 1] == f"d/{n - 1}.png"
                )
            opens += 1
            if opens % 10 == 0:  # appends take turns with the updates
                _append(path, n, 3, lock_timeout=30)
                n += 3
        assert len(rounds) >= 3 and n > 9, (rounds, n)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with carraystore.open(path) as s:  # rolls back an update the kill interrupted
        assert len(s) == n and s.verify() == [] and np.array_equal(s[:], _images(0, n))
    assert not (tmp_path / ".s.b2nd.journal").exists()
    assert path.read_bytes()[start:stop] == pixels  # the first chunks' bytes, never rewritten


def test_a_meta_update_of_an_empty_store_is_in_place_and_locked(tmp_path: Path) -> None:
    from carraystore.base.lock import WriterLock
    from carraystore.store.metadata import update_metadata

    path = tmp_path / "s.b2nd"
    with carraystore.create(path, SHAPE, chunk_images=CHUNK, attrs={"a": 1}):
        pass
    inode = path.stat().st_ino
    with (
        WriterLock(path, purpose="ingest"),  # any writer excludes it, and it waits with a timeout
        pytest.raises(StoreLockedError, match=r"being written by ingest .* \(waited 0.2 s\)"),
    ):
        update_metadata(path, attrs={"b": 2}, lock_timeout=0.2)
    assert update_metadata(path, attrs={"b": 2}, remove_attrs=["a"]).attrs == {"b": 2}
    assert path.stat().st_ino == inode and sorted(p.name for p in tmp_path.iterdir()) == ["s.b2nd"]
    _append(path, 0, 5)  # and it appends as before
    with carraystore.open(path) as s:
        assert s.attrs == {"b": 2} and len(s) == 5 and s.verify() == []
    # remote stores are read-only here: named, not "no such store"
    with pytest.raises(carraystore.base.errors.InvalidInputError, match="local stores only"):
        update_metadata("s3://bucket/s.b2nd", attrs={"b": 3})


def test_a_link_planted_at_the_lock_name_is_never_followed(tmp_path: Path) -> None:
    """The lock's name is predictable: a symlink planted there (a shared folder) must not make a
    writer truncate and overwrite the file it points to (it did: the victim held the lock JSON)."""
    path = tmp_path / "s.b2nd"
    _store(path, 6)
    before = path.read_bytes()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / ".s.b2nd.lock").symlink_to(victim)
    for write in (lambda: _append(path, 6, 5), lambda: carraystore.update_metadata(path, attrs={"a": 1})):
        with pytest.raises(carraystore.WriteError, match="symbolic link"):
            write()
        assert victim.read_text() == "precious\n"
        assert path.read_bytes() == before
    (tmp_path / ".s.b2nd.lock").unlink()
    _append(path, 6, 5)
    assert len(carraystore.open(path)) == 11


def test_a_link_at_the_journal_name_is_never_written_through(tmp_path: Path) -> None:
    from carraystore.sources.journal import Journal, journal_path, write_journal

    path = tmp_path / "s.b2nd"
    _store(path, 6)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    journal_path(path).symlink_to(victim)
    with pytest.raises(carraystore.WriteError, match="symbolic link"):
        write_journal(path, Journal(path.stat().st_size, ((0, b"x" * 8),)))
    assert victim.read_text() == "precious\n"


_DIE_IN_COMMIT = r"""
import os, sys, numpy as np, carraystore
import carraystore.store.inplace as ip
ip._InPlaceWrite.commit = lambda self, meta: os.kill(os.getpid(), 9)  # die after the chunks, journal hot
a = carraystore.append(sys.argv[1])
a.append(np.zeros((9, 16, 16, 3), np.uint8), labels=np.zeros(9, int), keys=[f"n/{i}.png" for i in range(9)])
a.close()
"""


def test_a_journal_is_never_rolled_back_onto_a_file_restored_over_the_store(tmp_path: Path) -> None:
    """A write died (hot journal); the user copies another store (a backup) over the path: the stale
    journal was applied to it, writing the old header and trailer into the restored copy."""
    from carraystore.sources.journal import journal_path

    path, other = tmp_path / "s.b2nd", tmp_path / "other.b2nd"
    _store(path, 10)
    with carraystore.create(other, SHAPE, chunk_images=CHUNK) as w:
        w.append(_images(100, 10), labels=np.arange(10) % 5, keys=_keys(100, 10))
    r = subprocess.run([sys.executable, "-c", _DIE_IN_COMMIT, str(path)], timeout=120)
    assert r.returncode == -signal.SIGKILL and journal_path(path).exists()
    restored = other.read_bytes()
    path.write_bytes(restored)  # `cp other.b2nd s.b2nd`
    with pytest.raises(carraystore.CorruptStoreError, match=r"interrupted write to another file.*delete"):
        carraystore.open(path)
    with pytest.raises(carraystore.CorruptStoreError, match="another file"):
        _append(path, 10, 2)
    assert path.read_bytes() == restored  # nothing written into the restored copy
    journal_path(path).unlink()  # what the error says to do
    s = carraystore.open(path)
    assert s.verify() == [] and list(s.keys) == _keys(100, 10)


def test_a_journal_still_rolls_back_its_own_file(tmp_path: Path) -> None:
    from carraystore.sources.journal import journal_path

    path = tmp_path / "s.b2nd"
    _store(path, 10)
    before = path.read_bytes()
    r = subprocess.run([sys.executable, "-c", _DIE_IN_COMMIT, str(path)], timeout=120)
    assert r.returncode == -signal.SIGKILL and journal_path(path).exists()
    assert len(carraystore.open(path)) == 10
    assert path.read_bytes() == before and not journal_path(path).exists()


def test_abort_after_close_or_twice_keeps_an_appended_store(tmp_path: Path) -> None:
    # an in-place append's temporary file is the store itself: a second abort(), or one
    # after close(), used to delete the store
    path = tmp_path / "s.b2nd"
    _store(path, 10)
    w = carraystore.append(path)
    w.append(_images(10, 3), labels=np.arange(10, 13) % 5, keys=_keys(10, 3))
    w.close()
    after = path.read_bytes()
    w.abort()
    assert path.read_bytes() == after and len(carraystore.open(path)) == 13
    w = carraystore.append(path)
    w.append(_images(13, 5), labels=np.arange(13, 18) % 5, keys=_keys(13, 5))
    w.abort()
    w.abort()
    assert path.read_bytes() == after
    s = carraystore.open(path)
    assert len(s) == 13 and s.verify() == []
