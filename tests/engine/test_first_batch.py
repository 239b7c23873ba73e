"""Time to the first batch: an epoch's first batch waits for one batch's chunks.

The epoch plan ramps its first windows up (the pieces of one batch, then 4 and 16 times
as many, up to ``window``), so the engine serves the first batch once its few chunks are
decoded, not a whole window; a remote source fetches that first window alone before the
rest, so that it does not share the link with every chunk in flight. The order stays a
pure function of the seed and the epoch, every sample once.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from helpers import make_store

import carraystore
from carraystore.engine.decoder import EpochDecoder
from carraystore.engine.sampling import RAMP_GROWTH, plan_epoch, ramp_windows
from carraystore.engine.spec import LoaderSpec, make_spec

N, CHUNK, BATCH = 160, 16, 16  # 10 chunks: more than the 7-chunk store of the issue, fewer than a window


@pytest.fixture(scope="module")
def small_store(tmp_path_factory: pytest.TempPathFactory, photo_patches: Callable[..., np.ndarray]) -> Path:
    path, x = tmp_path_factory.mktemp("first_batch") / "s.b2nd", photo_patches(N, size=(24, 24), seed=3)
    return make_store(path, x, np.arange(N) % 3, chunk_images=CHUNK, class_names=["a", "b", "c"])


def test_ramp_windows_start_from_the_first_pieces_and_grow() -> None:
    p = np.arange(40)
    assert RAMP_GROWTH == 4
    assert np.bincount(ramp_windows(p, 16)).tolist() == [1, 4, 16, 16, 3]
    assert np.bincount(ramp_windows(p, 16, first=3)).tolist() == [3, 12, 16, 9]
    assert np.bincount(ramp_windows(p, 6)).tolist() == [1, 4, 6, 6, 6, 6, 6, 5]
    assert np.bincount(ramp_windows(p, 1)).tolist() == [1] * 40
    assert np.bincount(ramp_windows(p, 4, first=9)).tolist() == [4] * 10  # a batch over a window: no ramp


@pytest.mark.parametrize(
    ("chunk", "batch", "chunks"),
    [(84, 64, 1), (21, 64, 4), (16, 16, 1), (10, 35, 4)],
    ids=["600-photos-default-chunks", "600-photos-1MiB-chunks", "chunk=batch", "batch-over-chunks"],
)
def test_the_first_batch_of_a_block_shuffle_needs_one_batchs_chunks(chunk: int, batch: int, chunks: int) -> None:
    """600 photos as the issue measured them: 8 chunks of 84, window 16 (it needed all 8)."""
    for seed, epoch in [(0, 0), (3, 1), (7, 12)]:
        plan = plan_epoch(600, chunk, seed=seed, epoch=epoch, window=16, batch_size=batch)
        assert len(np.unique(plan.samples(0, batch) // chunk)) == chunks
        assert plan.window_chunks[0].size == chunks  # the first window is that batch's chunks
        assert plan.max_window_chunks <= 16
        assert np.array_equal(np.sort(plan.items), np.arange(600))
        # the old plan (every window 16 chunks) needed the whole store for the first batch
        flat = plan_epoch(600, chunk, seed=seed, epoch=epoch, window=16, batch_size=batch, ramp=False)
        assert len(np.unique(flat.samples(0, batch) // chunk)) > chunks


def test_shards_ramp_each_and_a_resumed_epoch_keeps_the_windows() -> None:
    from carraystore.engine.sampling import remainder_plan

    def first(rank: int, world: int) -> Any:
        return plan_epoch(1000, 20, seed=5, epoch=2, window=8, rank=rank, world_size=world, batch_size=32)

    plans = [first(r, 2) for r in range(2)]
    window_of = np.empty(1000, dtype=np.int64)  # each item's window in the run of 2 ranks
    for r, p in enumerate(plans):
        assert len(p.window_chunks[0]) <= 3  # 32 items lie in 2 or 3 pieces of at most 20
        for w in range(p.nwindows):
            window_of[p.items[p.window_starts[w] : p.window_starts[w + 1]]] = r * 1000 + w
    assert np.array_equal(np.sort(np.concatenate([p.items for p in plans])), np.arange(1000))
    # the run stopped after 100 samples per rank, resumed by 4 ranks: nothing lost or repeated
    rest = [remainder_plan(first, [(2, 100)], r, 4) for r in range(4)]
    seen = np.concatenate([p.items[:100] for p in plans] + [r.items for r in rest])
    assert np.array_equal(np.sort(seen), np.arange(1000))
    for r in rest:  # and a window of the resumed plan lies inside one window of the first run
        for w in range(r.nwindows):
            assert len(np.unique(window_of[r.items[r.window_starts[w] : r.window_starts[w + 1]]])) == 1


class _HeldDecodes:
    """Holds the decoding of every chunk but ``free`` until released; counts the decodes done."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, free: set[int]) -> None:
        self.free = free
        self.release = threading.Event()
        self.done: list[int] = []
        real = LoaderSpec.decode_chunk

        def decode_chunk(spec: LoaderSpec, chunk: int, out: np.ndarray, **kw: Any) -> None:
            if chunk not in self.free:
                self.release.wait(30)
            real(spec, chunk, out, **kw)
            self.done.append(chunk)

        monkeypatch.setattr(LoaderSpec, "decode_chunk", decode_chunk)


def _in_thread(fn: Callable[[], Any], timeout: float) -> tuple[bool, Any]:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), (out[0] if out else None)


def test_the_engine_serves_the_first_batch_with_one_chunk_decoded(
    small_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = carraystore.open(small_store)
    spec = make_spec(store, BATCH, seed=4, epoch=1, window=16, num_threads=2)
    plan = spec.plan(1)
    assert store.nchunks == 10 and plan.window_chunks[0].size == 1
    held = _HeldDecodes(monkeypatch, set(plan.window_chunks[0].tolist()))
    dec = EpochDecoder(spec, 1, 16 + 16, 2, "test-first-batch", direct=False)
    try:
        dec.read_ahead(0)  # as the streaming loader starts: every window it has slots for
        finished, first = _in_thread(lambda: tuple(np.copy(v) for v in dec.batch(0)), timeout=20)
        decoded_then = dec.chunks_decoded
        held.release.set()
        assert finished, "the first batch waited for chunks it does not draw from"
        assert decoded_then == 1 and held.done[:1] == plan.window_chunks[0].tolist()
        batches = [first] + [tuple(np.copy(v) for v in dec.batch(i)) for i in range(1, spec.num_batches)]
    finally:
        held.release.set()
        dec.close()
    x = np.concatenate([b[0] for b in batches])
    assert np.array_equal(x, store[plan.items])  # the plan's order, every sample once
    assert np.array_equal(np.sort(plan.items), np.arange(N))


def test_the_streaming_loader_hands_out_the_first_batch_before_the_window_is_decoded(
    small_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = carraystore.open(small_store)
    plan = make_spec(store, BATCH, seed=9, epoch=0).plan(0)
    held = _HeldDecodes(monkeypatch, set(plan.window_chunks[0].tolist()))
    it = iter(store.batches(BATCH, seed=9, epoch=0))
    try:
        finished, first = _in_thread(lambda: next(it), timeout=20)
        decoded = len(held.done)
        held.release.set()
        assert finished and decoded == 1
        rest = [x for x, _ in it]
    finally:
        held.release.set()
    x = np.concatenate([first[0], *rest])
    assert np.array_equal(x, store[plan.items])


@pytest.fixture
def served_store(http_server: Any, small_store: Path) -> Iterator[str]:
    pytest.importorskip("obstore")
    shutil.copy(small_store, http_server.root / "s.b2nd")
    yield f"{http_server.url}/s.b2nd"


def test_a_remote_store_fetches_the_first_window_before_the_rest(served_store: str, small_store: Path) -> None:
    """Chunks fetched together share the link: the first window's bytes come alone, first."""
    local = carraystore.open(small_store)
    with carraystore.open(served_store) as store:
        src = store.source
        gets: list[tuple[int, float, float]] = []
        real_get = src._get

        def timed_get(offset: int, length: int) -> Any:
            t0 = time.monotonic()
            try:
                return real_get(offset, length)
            finally:
                gets.append((offset, t0, time.monotonic()))

        src._get = timed_get  # type: ignore[method-assign]
        # epoch 0 from scratch: its first window alone, then the rest
        plan = make_spec(store, BATCH, seed=2, epoch=0).plan(0)
        lead = {local.chunk_byte_range(int(c))[0] for c in plan.window_chunks[0]}
        it = store.batches(BATCH, seed=2, epoch=0)
        x = np.concatenate([x for x, _ in it])
        assert np.array_equal(x, local[plan.items])
        # (a chunk of it may be fetched again at the end, for epoch 1: the first GET of each counts)
        first = [min((g for g in gets if g[0] == o), key=lambda g: g[1]) for o in lead if any(g[0] == o for g in gets)]
        others = [g for g in gets if g[0] not in lead]
        assert first and others
        lead_in = max(end for _, _, end in first)
        assert min(start for _, start, _ in others) >= lead_in, (
            "another chunk was requested while the first window was on its way"
        )
        # epoch 1's first window was hinted by epoch 0 once epoch 0's bytes were in: epoch 1
        # begins with it fetched (or on its way), and asks for nothing of it
        assert it._s.decoder.link.next_epoch_hinted
        plan = make_spec(store, BATCH, seed=2, epoch=1).plan(1)
        lead = {local.chunk_byte_range(int(c))[0] for c in plan.window_chunks[0]}
        gets.clear()
        t0 = time.monotonic()
        x = np.concatenate([x for x, _ in store.batches(BATCH, seed=2, epoch=1)])
        assert np.array_equal(x, local[plan.items])
        assert not [g for g in gets if g[0] in lead and g[1] >= t0], "epoch 1 fetched its first window itself"
