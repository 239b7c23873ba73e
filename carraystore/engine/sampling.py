"""The order in which an epoch visits a store: pure index arithmetic (numpy only, no I/O).

Block shuffle (default): 1. the chunks in a random order (by ``seed`` and epoch only);
2. their items cut into ``world_size`` equal contiguous shards (padded by wrapping around, or
the tail dropped with ``drop_remainder``); 3. each shard cut into windows of ``window`` chunk
pieces (runs of items in one chunk; the first ramp up, :func:`ramp_windows`), items permuted
inside each window. ``shuffle="global"``: a full permutation (one window per shard);
``False``: store order. Every function is pure, so every worker, process and run agrees.
An *item* is a sample, or a clip's first sample (:func:`clip_starts`); ``span``: samples per item.
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from carraystore.base.errors import InvalidInputError

__all__ = [
    "Shuffle",
    "EpochPlan",
    "EpochOrder",
    "plan_epoch",
    "epoch_sequence",
    "ramp_windows",
    "epoch_order",
    "remainder_plan",
    "shard_length",
    "num_batches",
    "group_runs",
    "clip_starts",
    "clip_offsets",
]

#: How fast the first windows of a shard grow (:func:`ramp_windows`): 1, 4, 16, ... times the first.
RAMP_GROWTH = 4

#: ``"block"`` (default), ``"global"``, or ``False`` (store order).
Shuffle = str | bool | None

_SHUFFLES = ("block", "global", False)


def _check_shuffle(shuffle: Shuffle) -> str | bool:
    if shuffle is None:
        return False
    if shuffle is True:
        return "block"
    if shuffle not in _SHUFFLES:
        raise InvalidInputError(f"shuffle must be 'block', 'global' or False, got {shuffle!r}")
    return shuffle


def _nonneg(name: str, value: Any) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise InvalidInputError(f"{name} must be an integer, got {value!r}") from None
    if v < 0 or v != value:
        raise InvalidInputError(f"{name} must be an integer >= 0, got {value!r}")
    return v


def shard_length(n_items: int, world_size: int = 1, drop_remainder: bool = False) -> int:
    """Items per rank: ``ceil(n / world_size)`` (padded by wrapping) or ``floor`` (dropped)."""
    if world_size < 1:
        raise InvalidInputError(f"world_size must be >= 1, got {world_size}")
    return n_items // world_size if drop_remainder else -(-n_items // world_size)


def num_batches(length: int, batch_size: int, drop_remainder: bool = False) -> int:
    """Batches made from ``length`` items: the last one short, or dropped."""
    if batch_size < 1:
        raise InvalidInputError(f"batch_size must be >= 1, got {batch_size}")
    return length // batch_size if drop_remainder else -(-length // batch_size)


@dataclass(frozen=True)
class EpochPlan:
    """One rank's epoch: window ``w`` is ``items[window_starts[w]:window_starts[w+1]]``, chunks ``window_chunks[w]``."""

    items: np.ndarray
    window_starts: np.ndarray
    window_chunks: tuple[np.ndarray, ...]
    chunk_size: int
    span: int = 1

    def __len__(self) -> int:
        return len(self.items)

    @property
    def nwindows(self) -> int:
        return len(self.window_starts) - 1

    @property
    def total_chunks(self) -> int:
        """Chunks of all windows together (at least 1): the most a decoder ever holds."""
        return max(1, sum(len(c) for c in self.window_chunks))

    @property
    def max_window_chunks(self) -> int:
        """The most chunks any one window needs at once."""
        return max((len(c) for c in self.window_chunks), default=0)

    @functools.cached_property
    def _starts(self) -> list[int]:
        return [int(x) for x in self.window_starts]

    def window_of(self, position: int) -> int:
        """The window holding ``position`` in ``items``."""
        return bisect.bisect_right(self._starts, position) - 1

    def samples(self, start: int, stop: int) -> np.ndarray:
        """Sample indices at positions [start, stop): shape (n,) or (n, span) for sequences."""
        it = self.items[start:stop]
        if self.span == 1:
            return it
        return it[:, None] + np.arange(self.span, dtype=np.int64)

    def batches_of(self, w: int, batch_size: int, serves: tuple[int, int] = (0, 1)) -> range:
        """The batches ``b % n == k`` (``serves=(k, n)``) that draw from window ``w``."""
        lo, hi = int(self.window_starts[w]), int(self.window_starts[w + 1])
        if hi <= lo:
            return range(0)
        first, last = lo // batch_size, (hi - 1) // batch_size + 1
        k, n = serves
        return range(first + (k - first) % n, last, n)

    def chunk_order(self) -> np.ndarray:
        """Chunks in the order a loader decodes them (window after window)."""
        if not self.window_chunks:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(self.window_chunks)


def _rng(*words: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(w) for w in words]))


# stream tags: distinct random streams per purpose
_TAG_CHUNKS, _TAG_WINDOW, _TAG_GLOBAL, _TAG_CLIPS = 0x43484E4B, 0x57494E44, 0x474C4F42, 0x434C4950


@dataclass(frozen=True)
class EpochOrder:
    """What one rank's epoch order depends on besides the store (checked on construction).

    ``span``: consecutive samples per item (clips); ``batch_size`` sizes the first window.
    """

    shuffle: Shuffle = "block"
    seed: int = 0
    epoch: int = 0
    window: int = 16
    rank: int = 0
    world_size: int = 1
    drop_remainder: bool = False
    span: int = 1
    batch_size: int = 1

    def __post_init__(self) -> None:
        s = object.__setattr__
        s(self, "shuffle", _check_shuffle(self.shuffle))
        for name in ("seed", "epoch", "window", "rank", "world_size", "span", "batch_size"):
            s(self, name, _nonneg(name, getattr(self, name)))
        if self.window < 1 or self.world_size < 1 or self.span < 1 or self.batch_size < 1:
            raise InvalidInputError("window, world_size, span and batch_size must all be >= 1")
        if self.rank >= self.world_size:
            raise InvalidInputError(f"rank {self.rank} is not below world_size {self.world_size}")
        s(self, "drop_remainder", bool(self.drop_remainder))

    def replace(self, **changes: Any) -> EpochOrder:
        """A copy with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)


def plan_epoch(
    n_samples: int,
    chunk_size: int,
    order: EpochOrder | None = None,
    *,
    items: np.ndarray | None = None,
    ramp: bool = True,
    sequence: np.ndarray | None = None,
    **fields: Any,
) -> EpochPlan:
    """The epoch's order for one rank: ``order``, or an :class:`EpochOrder` of ``fields``.

    ``items``: sorted sample indices (default all; clip starts for sequences).
    ``ramp=False``: every window ``window`` pieces. ``sequence``: :func:`epoch_sequence` of
    the same arguments, to plan many ranks at once.
    """
    o = EpochOrder(**fields) if order is None else order.replace(**fields) if fields else order
    shuffle, seed, epoch, window, rank, span = o.shuffle, o.seed, o.epoch, o.window, o.rank, o.span
    n_samples = _nonneg("n_samples", n_samples)
    chunk_size = _nonneg("chunk_size", chunk_size)
    if chunk_size < 1:
        raise InvalidInputError("chunk_size must be >= 1")
    if sequence is not None:  # made for these arguments: the items are in it, already checked
        m = len(sequence)
    elif items is None:
        items = np.arange(n_samples, dtype=np.int64)
        m = n_samples
    else:
        items = np.asarray(items, dtype=np.int64).reshape(-1)
        if items.size and (items[0] < 0 or items[-1] + span > n_samples or np.any(np.diff(items) <= 0)):
            raise InvalidInputError("items must be strictly increasing and lie inside the store (with their span)")
        m = len(items)
    length = shard_length(m, o.world_size, o.drop_remainder)
    empty = EpochPlan(np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64), (), chunk_size, span)
    if length == 0:
        return empty

    # 1. the sequence every rank agrees on
    if sequence is None:
        assert items is not None
        seq = _sequence(items, chunk_size, shuffle, seed, epoch)
    else:
        seq = sequence

    # 2. this rank's shard (wrapping pads: item i of the padded sequence is seq[i % m]; drop_remainder cuts)
    lo, hi = rank * length, (rank + 1) * length
    part = np.ascontiguousarray(seq[lo:hi] if hi <= m else seq[np.arange(lo, hi, dtype=np.int64) % m])

    # 3. windows of `window` chunk pieces, items permuted inside each
    pchunk = part // chunk_size
    if shuffle == "global":
        window_id = np.zeros(length, dtype=np.int64)
    else:
        piece = np.concatenate([[0], np.cumsum(np.diff(pchunk) != 0)])
        if ramp:  # the first window holds a batch: as many pieces as its items need
            first = int(np.searchsorted(np.cumsum(np.bincount(piece)), o.batch_size)) + 1
            window_id = ramp_windows(piece, window, first)
        else:
            window_id = piece // window
    if shuffle == "block":
        keys = _rng(seed, epoch, _TAG_WINDOW, rank).random(length)
        part = part[np.lexsort((keys, window_id))]
    elif shuffle == "global":
        pass  # already a full permutation
    starts = np.concatenate([[0], np.flatnonzero(np.diff(window_id)) + 1, [length]]).astype(np.int64)
    chunks = [_chunks_needed(part[starts[w] : starts[w + 1]], chunk_size, span) for w in range(len(starts) - 1)]
    return EpochPlan(part, starts, tuple(chunks), chunk_size, span)


def epoch_sequence(n_samples: int, chunk_size: int, order: EpochOrder, items: np.ndarray | None = None) -> np.ndarray:
    """The item sequence every rank agrees on, before shards and windows (for ``plan_epoch(sequence=)``)."""
    chunk_size = _nonneg("chunk_size", chunk_size)
    if chunk_size < 1:
        raise InvalidInputError("chunk_size must be >= 1")
    if items is None:
        items = np.arange(_nonneg("n_samples", n_samples), dtype=np.int64)
    return _sequence(np.asarray(items, dtype=np.int64).reshape(-1), chunk_size, order.shuffle, order.seed, order.epoch)


def _sequence(items: np.ndarray, chunk_size: int, shuffle: Shuffle, seed: int, epoch: int) -> np.ndarray:
    m = len(items)
    if shuffle == "global":
        out: np.ndarray = items[_rng(seed, epoch, _TAG_GLOBAL).permutation(m)]
        return out
    if shuffle == "block" and m:
        ichunk = items // chunk_size
        run_starts = np.concatenate([[0], np.flatnonzero(np.diff(ichunk)) + 1])
        run_lens = np.diff(np.concatenate([run_starts, [m]]))
        perm = _rng(seed, epoch, _TAG_CHUNKS).permutation(len(run_starts))
        lens = run_lens[perm]
        out_starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        pos = np.arange(m, dtype=np.int64) + np.repeat(run_starts[perm] - out_starts, lens)
        out = items[pos]
        return out
    return items


def ramp_windows(piece: np.ndarray, window: int, first: int = 1) -> np.ndarray:
    """The window of each chunk piece (``piece``: 0, 0, 1, 2, 2, ... along a shard).

    The first windows hold ``first``, ``4 * first``, ... pieces (below ``window``;
    :data:`RAMP_GROWTH`), later ones ``window``: the first batch waits for one batch's
    chunks, not a whole window's.
    """
    first = max(1, min(int(first), window))
    sizes = []
    while first < window:
        sizes.append(first)
        first *= RAMP_GROWTH
    starts = np.cumsum([0, *sizes])  # where the ramp's windows start, in pieces
    p = np.asarray(piece, dtype=np.int64)
    ids: np.ndarray = np.where(
        p < starts[-1],
        np.searchsorted(starts, p, side="right") - 1,
        len(sizes) + (p - starts[-1]) // window,
    )
    return ids


def _chunks_needed(first: np.ndarray, chunk_size: int, span: int) -> np.ndarray:
    """The chunks (sorted, unique) that items ``first`` (with their span) lie in."""
    lo = first // chunk_size
    if span == 1:
        return np.unique(lo)
    hi = (first + span - 1) // chunk_size
    need = np.unique(np.concatenate([lo, hi]))
    # a clip may cover whole chunks between its first and last (span > chunk_size)
    if np.any(hi - lo > 1):
        extra = [np.arange(a, b + 1) for a, b in zip(lo[hi - lo > 1], hi[hi - lo > 1], strict=True)]
        need = np.unique(np.concatenate([need, *extra]))
    return need


def _shards(
    items: np.ndarray, windows: np.ndarray, world_size: int, drop_remainder: bool
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``items`` and their window labels cut into shards as in :func:`plan_epoch`."""
    length = shard_length(len(items), world_size, drop_remainder)
    total = length * world_size
    if total != len(items) and len(items):
        items, windows = np.resize(items, total), np.resize(windows, total)
    return [(items[r * length : (r + 1) * length], windows[r * length : (r + 1) * length]) for r in range(world_size)]


def remainder_plan(
    first: Callable[[int, int], EpochPlan],
    consumed: Sequence[tuple[int, int]],
    rank: int = 0,
    world_size: int = 1,
    drop_remainder: bool = False,
) -> EpochPlan:
    """One rank's plan for the rest of an interrupted epoch, at any world size.

    ``first(rank, world_size)``: the epoch's plan of a rank. ``consumed``: the runs so far as
    ``(world_size, samples each rank consumed)``, oldest first (ranks in lockstep, as under
    DDP). The unconsumed rest is re-sharded like an epoch; items keep their order and
    windows, so nothing consumed comes back and nothing left is lost.
    """
    if not consumed:
        return first(rank, world_size)
    if not 0 <= rank < world_size:
        raise InvalidInputError(f"rank {rank} is not below world_size {world_size}")
    w0, c0 = (int(v) for v in consumed[0])
    plans = [first(r, w0) for r in range(w0)]
    chunk_size, span = plans[0].chunk_size, plans[0].span
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    base = 0
    for p in plans:
        wid = np.repeat(np.arange(p.nwindows, dtype=np.int64), np.diff(p.window_starts)) + base
        base += p.nwindows
        parts.append((p.items, wid))
    items = wids = np.zeros(0, dtype=np.int64)
    for level, (w, c) in enumerate(consumed):
        w, c = int(w), int(c)
        if level:
            parts = _shards(items, wids, w, drop_remainder)
        length = len(parts[0][0]) if parts else 0
        if not 0 <= c <= length:
            raise InvalidInputError(
                f"a run of world_size {w} cannot have consumed {c} samples per rank: its shards hold {length}"
            )
        items = np.concatenate([p[0][c:] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
        wids = np.concatenate([p[1][c:] for p in parts]) if parts else np.zeros(0, dtype=np.int64)
    part, wid = _shards(items, wids, world_size, drop_remainder)[rank]
    part = np.ascontiguousarray(part, dtype=np.int64)
    if not len(part):
        return EpochPlan(np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64), (), chunk_size, span)
    starts = np.concatenate([[0], np.flatnonzero(np.diff(wid)) + 1, [len(part)]]).astype(np.int64)
    chunks = tuple(_chunks_needed(part[starts[w] : starts[w + 1]], chunk_size, span) for w in range(len(starts) - 1))
    return EpochPlan(part, starts, chunks, chunk_size, span)


def epoch_order(n_samples: int, chunk_size: int, **order: Any) -> np.ndarray:
    """The sample indices (int64) one rank visits in one epoch (``order``: :class:`EpochOrder` fields)."""
    return plan_epoch(n_samples, chunk_size, EpochOrder(**order)).items


# -- sequences --------------------------------------------------------------------------


def group_runs(groups: Sequence[Any] | np.ndarray) -> np.ndarray:
    """Boundaries [0, ..., n] of the runs of equal consecutive values (a group that recurs starts a new run)."""
    n = len(groups)
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    arr = np.asarray(groups)
    if arr.ndim != 1:
        arr = np.asarray([str(g) for g in groups])
    change = np.flatnonzero(arr[1:] != arr[:-1]) + 1
    return np.concatenate([[0], change, [n]]).astype(np.int64)


def clip_starts(
    boundaries: np.ndarray, length: int, stride: int | None = None, offsets: np.ndarray | None = None
) -> np.ndarray:
    """First sample of every clip of ``length`` consecutive samples inside one run.

    ``boundaries`` from :func:`group_runs`; ``stride`` defaults to ``length``; a tail shorter
    than ``length`` makes no clip. ``offsets`` (one per run, at most its slack; see
    :func:`clip_offsets`) shift each run's clips.
    """
    length = _nonneg("sequence_length", length)
    stride = length if stride is None else _nonneg("sequence_stride", stride)
    if length < 1 or stride < 1:
        raise InvalidInputError("sequence_length and sequence_stride must be >= 1")
    b = np.asarray(boundaries, dtype=np.int64)
    first, lens = b[:-1], np.diff(b)
    count = np.where(lens >= length, (lens - length) // stride + 1, 0)
    if offsets is not None:
        offsets = np.asarray(offsets, dtype=np.int64)
        slack = np.where(count > 0, lens - length - (count - 1) * stride, 0)
        if offsets.shape != first.shape or np.any(offsets < 0) or np.any(offsets > slack):
            raise InvalidInputError("offsets must give one value per run, between 0 and the run's slack")
        first = first + offsets
    total = int(count.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    run_of = np.repeat(np.arange(len(count)), count)
    k = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    starts: np.ndarray = first[run_of] + k * stride
    return starts


def clip_offsets(
    boundaries: np.ndarray, length: int, stride: int | None = None, *, seed: int = 0, epoch: int = 0
) -> np.ndarray:
    """A random start offset per run for one epoch: a pure function of (seed, epoch, runs).

    A run's offset is uniform in ``[0, slack]`` (``slack``: frames its clips leave unused at
    its end), so every run keeps its clip count and every rank computes the same starts.
    """
    length = _nonneg("sequence_length", length)
    stride = length if stride is None else _nonneg("sequence_stride", stride)
    seed, epoch = _nonneg("seed", seed), _nonneg("epoch", epoch)
    b = np.asarray(boundaries, dtype=np.int64)
    lens = np.diff(b)
    count = np.where(lens >= length, (lens - length) // max(1, stride) + 1, 0)
    slack = np.where(count > 0, lens - length - (count - 1) * stride, 0)
    u = _rng(seed, epoch, _TAG_CLIPS).random(len(lens))
    offsets: np.ndarray = np.minimum((u * (slack + 1)).astype(np.int64), slack)
    return offsets


# -- shuffle quality ------------------------------------------------------------------------
