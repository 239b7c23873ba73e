"""Crash safety: a writer killed with SIGKILL never leaves a partial store at the output path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from helpers import wait_for_partial

import carraystore
from carraystore.ingest.sample_data import make_photo_folder

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX signals")

# Writes images into ``path`` forever; says "writing" once the temporary file has data.
WRITE_FOREVER = """
import sys, numpy as np, carraystore
path, data = sys.argv[1], np.load(sys.argv[2])
with carraystore.create(path, data.shape[1:], chunk_images=8, overwrite=True, class_names=["a", "b"]) as w:
    said = False
    while True:
        w.append(data, labels=np.arange(len(data)) % 2, keys=["k/%d.jpg" % i for i in range(len(data))])
        if not said:
            print("writing", flush=True)
            said = True
"""

# Replaces the store at ``path`` with complete new versions, round after round.
REPLACE_FOREVER = """
import sys, itertools, numpy as np, carraystore
path, data = sys.argv[1], np.load(sys.argv[2])
for r in itertools.count(1):
    with carraystore.create(path, data.shape[1:], chunk_images=8, overwrite=True, attrs={"round": r}) as w:
        w.append(np.roll(data, r, axis=0))
    if r == 1:
        print("replacing", flush=True)
"""


def _partials(folder: Path, name: str) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith(f".{name}.partial-")]


def _start(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _wait_for_line(proc: subprocess.Popen[str], expected: str) -> None:
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != expected:
        proc.kill()
        raise AssertionError(f"writer did not start: {line!r} {proc.stderr.read() if proc.stderr else ''}")


def _kill(proc: subprocess.Popen[str]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.fixture()
def data(tmp_path: Path, photo_patches: Callable[..., np.ndarray]) -> Path:
    path = tmp_path / "data.npy"
    np.save(path, photo_patches(60, (32, 32), 7))
    return path


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_sigkill_while_writing_a_new_store_leaves_nothing_at_the_path(delay: float, tmp_path: Path, data: Path) -> None:
    out = tmp_path / "new.b2nd"
    proc = _start(WRITE_FOREVER, str(out), str(data))
    try:
        _wait_for_line(proc, "writing")
        time.sleep(delay)
        assert len(_partials(tmp_path, "new.b2nd")) == 1  # killed mid-write, with a temporary file present
    finally:
        _kill(proc)
    assert not out.exists()
    with pytest.raises(FileNotFoundError):
        carraystore.open(out)
    # the next writer removes the dead writer's temporary file
    with carraystore.create(out, (32, 32, 3)) as w:
        w.append(np.load(data)[:3])
    assert _partials(tmp_path, "new.b2nd") == [] and len(carraystore.open(out)) == 3


@pytest.mark.parametrize("delay", [0.0, 0.3])
def test_sigkill_while_overwriting_leaves_the_earlier_store_untouched(
    delay: float, tmp_path: Path, data: Path, photo_patches: Callable[..., np.ndarray]
) -> None:
    out = tmp_path / "s.b2nd"
    earlier = photo_patches(21, (32, 32), 99)
    with carraystore.create(out, (32, 32, 3), chunk_images=8, attrs={"earlier": True}) as w:
        w.append(earlier, keys=[f"old/{i}.png" for i in range(21)])
    before = out.read_bytes()
    proc = _start(WRITE_FOREVER, str(out), str(data))
    try:
        _wait_for_line(proc, "writing")
        time.sleep(delay)
        assert len(_partials(tmp_path, "s.b2nd")) == 1
    finally:
        _kill(proc)
    assert out.read_bytes() == before
    store = carraystore.open(out)
    assert np.array_equal(store[:], earlier) and store.attrs == {"earlier": True} and store.verify() == []


@pytest.mark.parametrize("delay", [0.05, 0.2, 0.5])
def test_the_path_always_holds_a_complete_store_while_it_is_replaced(delay: float, tmp_path: Path, data: Path) -> None:
    """Killed at any moment, even inside close(): the path holds the previous or the next version, whole."""
    out = tmp_path / "r.b2nd"
    images = np.load(data)
    proc = _start(REPLACE_FOREVER, str(out), str(data))
    try:
        _wait_for_line(proc, "replacing")
        time.sleep(delay)
    finally:
        _kill(proc)
    store = carraystore.open(out)
    r = store.attrs["round"]
    assert r >= 1 and store.verify() == []
    assert np.array_equal(store[:], np.roll(images, r, axis=0))


KILLABLE_INGEST = """
import sys, carraystore
print("start", flush=True)
carraystore.from_directory(sys.argv[1], sys.argv[2], workers=int(sys.argv[3]), overwrite=True, chunk_images=4)
"""


@pytest.fixture(scope="module")
def big_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """600 real-photo JPEGs of 128x128: an ingest that takes long enough to be killed mid-way."""
    return make_photo_folder(tmp_path_factory.mktemp("crash_src"), n=600, size=(128, 128), seed=2)


def _ingest_and_kill(folder: Path, out: Path, workers: int) -> list[int]:
    """Start from_directory in a subprocess, SIGKILL it mid-write; return its child process ids."""
    import psutil

    proc = _start(KILLABLE_INGEST, str(folder), str(out), str(workers))
    children: list[int] = []
    try:
        _wait_for_line(proc, "start")
        wait_for_partial(proc, out, larger_than=100_000, poll=0.01)
        children = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    finally:
        _kill(proc)
    return children


def _alive(pids: list[int]) -> list[int]:
    import psutil

    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _reap(pids: list[int]) -> None:
    """Kill the given leftover processes (ours: started by the killed ingest)."""
    for pid in _alive(pids):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_sigkill_during_parallel_ingest(
    tmp_path: Path, big_folder: Path, photo_patches: Callable[..., np.ndarray]
) -> None:
    """from_directory with two decoding threads, killed mid-write: no new file, old file intact."""
    pytest.importorskip("psutil")
    fresh = tmp_path / "fresh.b2nd"
    kids = _ingest_and_kill(big_folder, fresh, workers=2)
    _reap(kids)
    assert not fresh.exists()

    out = tmp_path / "train.b2nd"
    earlier = photo_patches(10, (16, 16), 5)
    with carraystore.create(out, (16, 16, 3)) as w:
        w.append(earlier)
    before = out.read_bytes()
    kids = _ingest_and_kill(big_folder, out, workers=2)
    _reap(kids)
    assert out.read_bytes() == before and np.array_equal(carraystore.open(out)[:], earlier)


def test_decoding_processes_exit_when_the_ingest_is_killed(tmp_path: Path, big_folder: Path) -> None:
    pytest.importorskip("psutil")
    kids = _ingest_and_kill(big_folder, tmp_path / "x.b2nd", workers=2)
    try:
        # the ingest decodes in threads: it starts no process, so none can outlive it
        assert kids == [], f"the ingest started processes {kids}; decoding runs in threads"
        deadline = time.time() + 5
        while _alive(kids) and time.time() < deadline:
            time.sleep(0.1)
        assert _alive(kids) == [], f"processes {_alive(kids)} outlived the killed ingest"
    finally:
        _reap(kids)
