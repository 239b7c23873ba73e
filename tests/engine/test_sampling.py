"""carraystore.engine.sampling: the epoch's order is a pure function of its arguments."""

from __future__ import annotations

import math

import numpy as np
import pytest

from carraystore.base.errors import InvalidInputError
from carraystore.engine.sampling import (
    clip_starts,
    epoch_order,
    group_runs,
    num_batches,
    plan_epoch,
    shard_length,
)
from carraystore.engine.shuffle_report import distinct_per_batch, pairs_kept_together

SIZES = [(1, 1), (7, 3), (100, 8), (1000, 64), (1003, 37)]


@pytest.mark.parametrize("shuffle", ["block", "global", False])
@pytest.mark.parametrize("n,k", SIZES)
def test_one_rank_visits_every_sample_once(n: int, k: int, shuffle: str | bool) -> None:
    for epoch in (0, 1, 5):
        order = epoch_order(n, k, seed=3, epoch=epoch, window=4, shuffle=shuffle)
        assert order.dtype == np.int64
        assert np.array_equal(np.sort(order), np.arange(n))


@pytest.mark.parametrize("shuffle", ["block", "global", False])
@pytest.mark.parametrize("world", [2, 3, 7, 16])
@pytest.mark.parametrize("n,k", [(100, 8), (1003, 37), (5, 2)])
def test_shards_are_disjoint_equal_and_cover_everything(n: int, k: int, world: int, shuffle: str | bool) -> None:
    for drop in (False, True):
        parts = [
            epoch_order(n, k, seed=1, epoch=2, window=3, rank=r, world_size=world, drop_remainder=drop, shuffle=shuffle)
            for r in range(world)
        ]
        lengths = {len(p) for p in parts}
        assert lengths == {shard_length(n, world, drop)}
        allp = np.concatenate(parts)
        if drop:
            # disjoint, and only fewer than world_size samples are left out
            assert len(np.unique(allp)) == len(allp)
            assert n - len(allp) < world
        else:
            # every sample; padding repeats at most world_size - 1 of them, each once more
            assert set(allp.tolist()) == set(range(n))
            assert len(allp) - n < world
            if n >= world:
                assert np.max(np.bincount(allp)) <= 2


def test_same_arguments_same_order_and_other_seeds_or_epochs_differ() -> None:
    a = epoch_order(5000, 50, seed=7, epoch=3, window=8)
    assert np.array_equal(a, epoch_order(5000, 50, seed=7, epoch=3, window=8))
    for other in (epoch_order(5000, 50, seed=8, epoch=3, window=8), epoch_order(5000, 50, seed=7, epoch=4, window=8)):
        assert not np.array_equal(a, other)
        # and not merely rotated or slightly moved: most positions change
        assert np.mean(a != other) > 0.9
    g = epoch_order(5000, 50, seed=7, epoch=3, shuffle="global")
    assert not np.array_equal(g, epoch_order(5000, 50, seed=7, epoch=4, shuffle="global"))
    assert np.array_equal(epoch_order(5000, 50, shuffle=False), np.arange(5000))


def test_block_shuffle_windows_hold_at_most_window_chunks() -> None:
    n, k, w = 2000, 25, 6
    plan = plan_epoch(n, k, seed=2, epoch=1, window=w)
    assert plan.window_starts[0] == 0 and plan.window_starts[-1] == n
    chunk_seq = []
    for i in range(plan.nwindows):
        items = plan.items[plan.window_starts[i] : plan.window_starts[i + 1]]
        chunks = np.unique(items // k)
        assert np.array_equal(chunks, plan.window_chunks[i])
        assert len(chunks) <= w
        # whole chunks: every sample of those chunks is in this window
        assert len(items) == sum(min(k, n - c * k) for c in chunks)
        chunk_seq.extend(chunks.tolist())
    assert sorted(chunk_seq) == list(range(math.ceil(n / k)))
    # chunks are visited in a random order, not the file's
    assert chunk_seq != sorted(chunk_seq)
    # samples are mixed inside a (full) window, not chunk after chunk
    full = next(i for i in range(plan.nwindows) if len(plan.window_chunks[i]) == w)
    first = plan.items[plan.window_starts[full] : plan.window_starts[full + 1]]
    assert len(np.unique(first[:30] // k)) > 2


def test_batch_and_shard_counts() -> None:
    assert num_batches(100, 32) == 4 and num_batches(100, 32, drop_remainder=True) == 3
    assert shard_length(10, 3) == 4 and shard_length(10, 3, drop_remainder=True) == 3
    with pytest.raises(InvalidInputError):
        num_batches(10, 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(rank=2, world_size=2),
        dict(window=0),
        dict(seed=-1),
        dict(shuffle="random"),
        dict(epoch=1.5),
    ],
)
def test_bad_arguments_raise(kwargs: dict) -> None:
    with pytest.raises(InvalidInputError):
        epoch_order(100, 10, **kwargs)


def test_clips_never_cross_a_group() -> None:
    groups = ["a"] * 10 + ["b"] * 7 + ["c"] * 2 + ["a"] * 5
    runs = group_runs(groups)
    assert runs.tolist() == [0, 10, 17, 19, 24]
    starts = clip_starts(runs, 3)
    assert starts.tolist() == [0, 3, 6, 10, 13, 19]
    for s in starts:
        assert len({groups[j] for j in range(s, s + 3)}) == 1
        assert np.searchsorted(runs, s, side="right") == np.searchsorted(runs, s + 2, side="right")
    assert clip_starts(runs, 3, stride=1).tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 19, 20, 21]


def test_sequence_plan_covers_every_clip_and_lists_the_chunks_it_spans() -> None:
    groups = np.repeat(np.arange(9), 23)
    starts = clip_starts(group_runs(groups), 5)
    plan = plan_epoch(len(groups), 10, seed=4, epoch=2, window=3, items=starts, span=5)
    assert np.array_equal(np.sort(plan.items), starts)
    for w in range(plan.nwindows):
        s = plan.samples(int(plan.window_starts[w]), int(plan.window_starts[w + 1]))
        assert s.shape[1] == 5
        assert set(np.unique(s // 10).tolist()) <= set(plan.window_chunks[w].tolist())


def test_shuffle_quality_metrics() -> None:
    labels = np.repeat(np.arange(8), 8)  # 64 samples, class-sorted
    assert distinct_per_batch(labels, np.arange(64), 8) == 1.0
    interleaved = np.arange(64).reshape(8, 8).T.reshape(-1)  # one sample of each old batch
    assert distinct_per_batch(labels, interleaved, 8) == 8.0
    order = np.arange(64)
    assert pairs_kept_together(order, order, 8) == 1.0
    assert pairs_kept_together(order, interleaved, 8) == 0.0
    # a full shuffle keeps about (B - 1) / (n - 1) of the pairs
    rng = np.random.default_rng(0)
    kept = [pairs_kept_together(rng.permutation(20000), rng.permutation(20000), 32) for _ in range(3)]
    assert abs(np.mean(kept) - 31 / 19999) < 0.5 * 31 / 19999


def test_clip_offsets_keep_the_clip_count_and_stay_in_their_runs() -> None:
    from carraystore.engine.sampling import clip_offsets, clip_starts

    runs = np.array([0, 23, 46, 50, 69, 100])  # runs of 23, 23, 4, 19, 31 frames
    fixed = clip_starts(runs, 5, 3)
    seen = set()
    for epoch in range(20):
        off = clip_offsets(runs, 5, 3, seed=1, epoch=epoch)
        assert np.array_equal(off, clip_offsets(runs, 5, 3, seed=1, epoch=epoch))  # a pure function
        starts = clip_starts(runs, 5, 3, offsets=off)
        assert len(starts) == len(fixed)
        run = np.searchsorted(runs, starts, side="right") - 1
        assert np.all(starts + 5 <= runs[run + 1]), "a clip never leaves its run"
        seen.add(tuple(off))
    assert len(seen) > 5
    assert clip_offsets(runs, 5, 3, seed=1, epoch=0)[2] == 0  # a run shorter than a clip has no clip to move
    with pytest.raises(InvalidInputError, match="slack"):
        clip_starts(runs, 5, 3, offsets=np.array([3, 0, 0, 0, 0]))  # 23 frames, stride 3: slack 0
