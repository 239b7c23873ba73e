"""SIGKILL at random moments of in-place appends: the store is the one before or after an
append, complete, and verifies."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
from helpers import indexed_images, kill_forked

import carraystore
from carraystore.format.frame import read_frame
from carraystore.sources.local import LocalFileSource

SHAPE = (12, 12, 3)
CHUNK = 4
K = 7  # images per append: not a multiple of CHUNK, so partial chunks get rewritten
TRIALS = 30


_images = partial(indexed_images, shape=SHAPE)


def _append_forever(path: Path, start: int, ready: Callable[[], object]) -> None:
    ready()
    i = start
    while True:
        with carraystore.append(path, lock_timeout=None) as w:
            w.append(_images(i, K), labels=np.arange(i, i + K) % 10, keys=[f"d/{j}.png" for j in range(i, i + K)])
        i += K


def test_sigkill_during_appends_leaves_old_or_new_store(tmp_path: Path) -> None:
    path = tmp_path / "s.b2nd"
    n0 = 9
    with carraystore.create(path, SHAPE, chunk_images=CHUNK, class_names=[str(c) for c in range(10)]) as w:
        w.append(_images(0, n0), labels=np.arange(n0) % 10, keys=[f"d/{j}.png" for j in range(n0)])
    rng = random.Random(11)
    n = n0
    rolled_back = grew = 0
    for _trial in range(TRIALS):  # the child appends until it is killed
        status = kill_forked(partial(_append_forever, path, n), rng.uniform(0.0, 0.12))
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        hot = (tmp_path / ".s.b2nd.journal").exists()
        with carraystore.open(path) as store:  # rolls back a hot journal
            m = len(store)
            assert m >= n and (m - n) % K == 0, f"{m} images after {n}: a partial append is visible"
            rolled_back += hot
            grew += m > n
            n = m
            assert np.array_equal(store[:], _images(0, n))
            assert np.array_equal(store.labels, np.arange(n) % 10)
            assert list(store.keys) == [f"d/{j}.png" for j in range(n)]
            assert store.verify() == []
        assert not (tmp_path / ".s.b2nd.journal").exists()
        assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name]
    # the trials hit both outcomes: appends that finished and appends rolled back
    print("grew", grew, "rolled back", rolled_back)
    assert grew >= 3 and rolled_back >= 3, (grew, rolled_back)
    # after all that, a normal append still works and the store is whole
    with carraystore.append(path) as w:
        w.append(_images(n, 2), labels=np.arange(n, n + 2) % 10, keys=[f"d/{j}.png" for j in range(n, n + 2)])
    with carraystore.open(path) as store:
        assert len(store) == n + 2 and store.verify() == []
        assert np.array_equal(store[n - 3 :], _images(n - 3, 5))


def _blob(r: int) -> str:
    return np.random.default_rng(r).bytes(3000 * (r % 4)).hex()  # the trailer grows and shrinks


def _update_forever(path: Path, start: int, ready: Callable[[], object]) -> None:
    from carraystore.store.metadata import update_metadata

    ready()
    r = start
    while True:
        update_metadata(
            path, class_names=[f"c{r}-{j}" for j in range(10)], attrs={"round": r, "blob": _blob(r)}, lock_timeout=None
        )
        r += 1


def test_sigkill_during_metadata_updates_leaves_old_or_new_metadata(tmp_path: Path) -> None:
    """``carraystore meta`` writes under the same journal: killed at random moments, the next
    reader rolls it back; the pixels' bytes are never touched."""
    path = tmp_path / "s.b2nd"
    n = 9
    with carraystore.create(path, SHAPE, chunk_images=CHUNK) as w:
        w.append(_images(0, n), labels=np.arange(n) % 10, keys=[f"d/{j}.png" for j in range(n)])
    frame = read_frame(LocalFileSource(path))
    h, c = frame.header_len, frame.cbytes  # the data chunks lie in [h, h + c)
    pixels = path.read_bytes()[h : h + c]
    rng = random.Random(12)
    r = 0
    rolled_back = changed = trial = 0
    deadline = time.monotonic() + 60
    # 20 kills at least; on a loaded machine (updates slow), more and later ones until both outcomes were seen
    while trial < 20 or ((changed < 3 or rolled_back < 3) and time.monotonic() < deadline):
        kill_forked(partial(_update_forever, path, r + 1), rng.uniform(0.0, 0.08 * (1 + trial // 20)))
        trial += 1
        hot = (tmp_path / ".s.b2nd.journal").exists()
        with carraystore.open(path) as store:  # rolls back a hot journal
            got = store.attrs.get("round", 0)
            assert got >= r
            if got:  # one update's metadata, whole: never a mix of two
                assert store.attrs["blob"] == _blob(got) and store.class_names == tuple(
                    f"c{got}-{j}" for j in range(10)
                )
            rolled_back += hot
            changed += got > r
            r = got
            assert len(store) == n and np.array_equal(store[:], _images(0, n)) and store.verify() == []
        assert not (tmp_path / ".s.b2nd.journal").exists()
        assert path.read_bytes()[h : h + c] == pixels
    print("changed", changed, "rolled back", rolled_back)
    assert changed >= 3 and rolled_back >= 3, (changed, rolled_back)
