"""How well an epoch's order is shuffled, measured against a global shuffle (layer 4).

Pure functions of an order (no I/O). **Diversity**: mean distinct values per full batch
(classes, groups, source chunks) over the exact expectation under a global shuffle (about
1.0 for one; a window of ``w`` chunks gives batches of at most ``w`` chunks).
**Displacement**: ``|position in epoch - position in store| / length`` (global shuffle: about
1/3 mean, 0.29 median; store order 0). ``BatchIterator.shuffle_report()`` and
``carraystore bench shuffle STORE`` use them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from carraystore.base.errors import InvalidInputError
from carraystore.engine.options import DEFAULT_WINDOW
from carraystore.engine.sampling import EpochOrder, Shuffle, _check_shuffle, plan_epoch

__all__ = [
    "Diversity",
    "ShuffleReport",
    "distinct_per_batch",
    "expected_distinct_per_batch",
    "pairs_kept_together",
    "displacement",
    "expected_displacement",
    "report_for_order",
    "shuffle_report",
    "compare_windows",
    "shuffle_table",
    "store_groups",
    "DEFAULT_WINDOW",
]

#: The median of ``|U - V|`` for independent uniforms: a global shuffle's median displacement.
GLOBAL_MEDIAN_DISPLACEMENT = 1.0 - 1.0 / math.sqrt(2.0)


@dataclass(frozen=True)
class Diversity:
    """Distinct values of one kind (``name``: classes, groups, chunks) per full batch."""

    name: str
    observed: float
    expected: float

    @property
    def score(self) -> float:
        """``observed / expected``: about 1.0 for a global shuffle, lower for a poorer mix."""
        return self.observed / self.expected if self.expected > 0 else math.nan


@dataclass(frozen=True)
class ShuffleReport:
    """One epoch's order measured against a global shuffle of the same samples."""

    shuffle: str
    window: int | None
    seed: int
    epoch: int
    batch_size: int
    length: int
    chunk_size: int | None
    diversity: tuple[Diversity, ...]
    displacement_mean: float
    displacement_median: float
    displacement_expected: float

    @property
    def full_batches(self) -> int:
        return self.length // self.batch_size

    def diversity_of(self, name: str) -> Diversity | None:
        """The diversity measure called ``name`` ("classes", "groups", "chunks"), or None."""
        return next((d for d in self.diversity if d.name == name), None)

    @property
    def displacement_score(self) -> float:
        """Mean displacement over a global shuffle's: about 1.0 for one, 0 for the store's order."""
        return self.displacement_mean / self.displacement_expected if self.displacement_expected > 0 else math.nan

    def summary(self) -> str:
        """A few lines a person reads: each measure beside what a global shuffle gives."""
        block = "block shuffle" + (f", window {self.window} chunks" if self.window is not None else "")
        how = {"block": block, "global": "global shuffle"}.get(self.shuffle, "store order (no shuffle)")
        lines = [
            f"{how}, seed {self.seed}, epoch {self.epoch}: {self.length:,} samples, "
            f"{self.full_batches:,} full batches of {self.batch_size}"
        ]
        for d in self.diversity:
            lines.append(
                f"  {d.name + ' per batch:':<22}{d.observed:8.2f}   global shuffle {d.expected:8.2f}   score {d.score:.2f}"
            )
        lines.append(
            f"  {'displacement:':<22}mean {self.displacement_mean:.3f}, median {self.displacement_median:.3f} of the epoch"
            f"   global shuffle {self.displacement_expected:.3f}, {GLOBAL_MEDIAN_DISPLACEMENT:.3f}"
            f"   score {self.displacement_score:.2f}"
        )
        return "\n".join(lines)


# -- the measures: pure functions of an order ----------------------------------------------


def _codes(values: Sequence[Any] | np.ndarray) -> np.ndarray:
    """``values`` as int64 codes (equal values, equal codes)."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        arr = np.asarray([str(v) for v in values])
    if arr.dtype.kind in "iub":
        return arr.astype(np.int64)
    if arr.dtype == object:
        arr = np.asarray([str(v) for v in arr])
    return np.unique(arr, return_inverse=True)[1].astype(np.int64).reshape(-1)


def distinct_per_batch(values: np.ndarray, order: np.ndarray, batch_size: int) -> float:
    """Mean number of distinct ``values[i]`` per full batch when visiting ``order`` (NaN: no full batch)."""
    if batch_size < 1:
        raise InvalidInputError(f"batch_size must be >= 1, got {batch_size}")
    order = np.asarray(order, dtype=np.int64).reshape(-1)
    nb = len(order) // batch_size
    if nb == 0:
        return math.nan
    v = _codes(values)[order[: nb * batch_size]].reshape(nb, batch_size)
    v = np.sort(v, axis=1)
    return float(np.mean(1 + np.count_nonzero(np.diff(v, axis=1), axis=1)))


def pairs_kept_together(previous: np.ndarray, current: np.ndarray, batch_size: int) -> float:
    """Share of same-batch pairs in ``current`` that shared a batch in ``previous`` (ideal: (B - 1) / (n - 1))."""
    prev, cur = np.asarray(previous, dtype=np.int64), np.asarray(current, dtype=np.int64)
    n = int(max(prev.max(initial=-1), cur.max(initial=-1))) + 1
    bprev = np.full(n, -1, dtype=np.int64)
    bprev[prev] = np.arange(len(prev)) // batch_size
    bcur = np.arange(len(cur)) // batch_size
    _, counts = np.unique(bcur, return_counts=True)
    pairs_total = int(np.sum(counts * (counts - 1) // 2))
    if pairs_total == 0:
        return math.nan
    seen = bprev[cur] >= 0
    key = bcur[seen] * (int(bprev.max(initial=0)) + 1) + bprev[cur[seen]]
    _, kc = np.unique(key, return_counts=True)
    pairs_kept = int(np.sum(kc * (kc - 1) // 2))
    return pairs_kept / pairs_total


def expected_distinct_per_batch(values: np.ndarray, batch_size: int) -> float:
    """Exact mean distinct values in ``batch_size`` items drawn without replacement from
    ``values``: ``sum over k of 1 - C(n - n_k, B) / C(n, B)``."""
    if batch_size < 1:
        raise InvalidInputError(f"batch_size must be >= 1, got {batch_size}")
    codes = _codes(values)
    n = len(codes)
    if n < batch_size:
        return math.nan
    counts = np.unique(codes, return_counts=True)[1]
    b = batch_size
    lg_all = math.lgamma(n + 1) - math.lgamma(n - b + 1)
    total = 0.0
    for nk in counts.tolist():
        rest = n - nk
        miss = 0.0 if rest < b else math.exp(math.lgamma(rest + 1) - math.lgamma(rest - b + 1) - lg_all)
        total += 1.0 - miss
    return total


def displacement(order: np.ndarray) -> np.ndarray:
    """``|position in order - position in sorted order| / len(order)`` of every item (floats)."""
    order = np.asarray(order, dtype=np.int64).reshape(-1)
    n = len(order)
    if n == 0:
        return np.zeros(0)
    home = np.empty(n, dtype=np.int64)
    home[np.argsort(order, kind="stable")] = np.arange(n)
    out: np.ndarray = np.abs(np.arange(n) - home) / n
    return out


def expected_displacement(n: int) -> float:
    """A uniform random permutation's mean displacement: ``(n^2 - 1) / (3 n^2)`` (about 1/3)."""
    return (n * n - 1) / (3.0 * n * n) if n > 0 else math.nan


def report_for_order(
    order: np.ndarray,
    batch_size: int,
    *,
    labels: np.ndarray | None = None,
    groups: Sequence[Any] | np.ndarray | None = None,
    chunk_size: int | None = None,
    shuffle: Shuffle = "block",
    window: int | None = None,
    seed: int = 0,
    epoch: int = 0,
) -> ShuffleReport:
    """Measure an epoch's ``order`` (sample indices) against a global shuffle.

    ``labels``, ``groups``: one value per store sample; ``chunk_size`` adds the chunks
    measure; the other arguments only label the report.
    """
    order = np.asarray(order, dtype=np.int64).reshape(-1)
    if batch_size < 1:
        raise InvalidInputError(f"batch_size must be >= 1, got {batch_size}")
    div = []
    kinds: list[tuple[str, Any]] = [("classes", labels), ("groups", groups)]
    if chunk_size:
        kinds.append(("chunks", np.arange(int(order.max(initial=-1)) + 1, dtype=np.int64) // int(chunk_size)))
    for name, values in kinds:
        if values is None:
            continue
        codes = _codes(values)
        if order.size and int(order.max()) >= len(codes):
            raise InvalidInputError(f"{name}: {len(codes)} values, but the order visits sample {int(order.max())}")
        div.append(
            Diversity(
                name,
                distinct_per_batch(codes, order, batch_size),
                expected_distinct_per_batch(codes[order], batch_size),
            )
        )
    d = displacement(order)
    mode = _check_shuffle(shuffle)
    return ShuffleReport(
        shuffle=mode if isinstance(mode, str) else "none",
        window=None if mode != "block" else window,
        seed=int(seed),
        epoch=int(epoch),
        batch_size=int(batch_size),
        length=len(order),
        chunk_size=int(chunk_size) if chunk_size else None,
        diversity=tuple(div),
        displacement_mean=float(d.mean()) if d.size else math.nan,
        displacement_median=float(np.median(d)) if d.size else math.nan,
        displacement_expected=expected_displacement(len(order)),
    )


def store_groups(store: Any) -> np.ndarray | None:
    """The store's per-sample groups (``Store.groups``, where the store has them), else None."""
    groups = getattr(store, "groups", None)
    if groups is None or callable(groups):
        return None
    try:
        if len(groups) != len(store):
            return None
    except TypeError:
        return None
    return _codes(groups)


def _open(store: Any) -> tuple[Any, bool]:
    if isinstance(store, (str, os.PathLike)):
        from carraystore.store.reader import open_store

        return open_store(store), True
    return store, False


def shuffle_report(
    store: Any,
    batch_size: int,
    *,
    window: int = DEFAULT_WINDOW,
    seed: int = 0,
    epoch: int = 0,
    shuffle: Shuffle = "block",
    rank: int = 0,
    world_size: int = 1,
    drop_remainder: bool = False,
) -> ShuffleReport:
    """Measure the epoch ``store.batches`` would serve against a global shuffle (reads metadata only)."""
    s, opened = _open(store)
    try:
        n, k = len(s), int(s.chunk_images)
        o = EpochOrder(shuffle, seed, epoch, window, rank, world_size, drop_remainder, batch_size=batch_size)
        plan = plan_epoch(n, k, o)
        return report_for_order(
            plan.items,
            batch_size,
            labels=s.labels,
            groups=store_groups(s),
            chunk_size=k,
            shuffle=o.shuffle,
            window=window,
            seed=seed,
            epoch=epoch,
        )
    finally:
        if opened:
            s.close()


def compare_windows(
    store: Any,
    batch_size: int,
    windows: Sequence[int] | None = None,
    *,
    seed: int = 0,
    epoch: int = 0,
) -> list[ShuffleReport]:
    """Reports for store order, block shuffle at each of ``windows`` (default 1, 4, 16, 64) and global."""
    s, opened = _open(store)
    try:
        nchunks = max(1, -(-len(s) // int(s.chunk_images)))
        if windows is None:
            windows = [min(w, nchunks) for w in (1, 4, DEFAULT_WINDOW, 64)]
        for w in windows:
            if int(w) < 1:
                raise InvalidInputError(f"window must be >= 1 chunk, got {w}")
        windows = sorted({int(w) for w in windows})
        rows = [shuffle_report(s, batch_size, shuffle=False, seed=seed, epoch=epoch)]
        rows += [shuffle_report(s, batch_size, window=int(w), seed=seed, epoch=epoch) for w in windows]
        rows.append(shuffle_report(s, batch_size, shuffle="global", seed=seed, epoch=epoch))
        return rows
    finally:
        if opened:
            s.close()


def _mib(nbytes: int) -> str:
    mib = nbytes / 2**20
    return f"{mib:,.0f}" if mib >= 10 else f"{mib:.2g}"


def shuffle_table(
    reports: Sequence[ShuffleReport], chunk_nbytes: int, nchunks: int, default_window: int = DEFAULT_WINDOW
) -> str:
    """A markdown table of ``reports`` (:func:`compare_windows`) with each order's decoded memory."""
    names = [d.name for d in reports[0].diversity] if reports else []
    head = ["order", "decoded MiB held"] + [f"{n} per batch (score)" for n in names]
    head.append("displacement mean / median (score)")
    lines = ["| " + " | ".join(head) + " |", "|---|---:|" + "---:|" * (len(names) + 1)]
    for r in reports:
        if r.shuffle == "block":
            label = f"block shuffle, window {r.window}" + (" (default)" if r.window == default_window else "")
            held = _mib(min(nchunks, 2 * int(r.window or default_window)) * chunk_nbytes)
        elif r.shuffle == "global":
            label, held = "global shuffle", _mib(nchunks * chunk_nbytes)
        else:
            label, held = "store order", "-"
        cells = [label, held]
        for n in names:
            d = r.diversity_of(n)
            cells.append("-" if d is None else f"{d.observed:.2f} ({d.score:.2f})")
        cells.append(f"{r.displacement_mean:.3f} / {r.displacement_median:.3f} ({r.displacement_score:.2f})")
        lines.append("| " + " | ".join(cells) + " |")
    if reports:
        ref = reports[0]
        expect = ", ".join(f"{d.name} {d.expected:.2f}" for d in ref.diversity)
        lines += [
            "",
            f"A global shuffle of these samples gives per batch: {expect or 'no labels'}; "
            f"displacement {ref.displacement_expected:.3f} / {GLOBAL_MEDIAN_DISPLACEMENT:.3f}.",
            "Scores are this order's value over a global shuffle's (1.00: as mixed as a global shuffle).",
            "Distinct chunks per batch is what the window buys: a batch of a window of w chunks holds at most w.",
            "Displacement: how far samples move from the store's order, as a share of the epoch.",
        ]
    return "\n".join(lines)
