"""The child process: one round of one peer (untimed warm-up, a cold epoch, a throttled cold epoch, a warm epoch), its peak RSS."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from bench.benchdata import evict_from_page_cache
from bench.loaders.peer import Batch, Context, Peer
from bench.loaders.registry import PEER_BY_NAME
from bench.loaders.throttle import join, leave
from bench.procstats import peak_rss_mb

__all__ = ["CHILD_MODULE", "child_main"]

#: ``python -m CHILD_MODULE --child SPEC`` runs one round in a fresh process.
CHILD_MODULE = "bench.loaders"


def _run_epoch(read: Callable[[int], Iterator[Batch]], e: int, batch_size: int) -> tuple[float, int, list[int]]:
    t = time.perf_counter()
    n = 0
    distinct = []
    for x, y in read(e):
        m = len(y)
        n += m
        if m == batch_size:
            distinct.append(len(np.unique(np.asarray(y))))
        del x
    return time.perf_counter() - t, n, distinct


def _evicted(
    peer: Peer, ctx: Context, dest: Path, read: Callable[[int], Iterator[Batch]], files: list[Path]
) -> Callable[[int], Iterator[Batch]]:
    """Evict the peer's files from the page cache; a reader that holds a memory map is closed first and opened anew."""
    close = getattr(read, "close", None)
    if close is None:
        evict_from_page_cache(files)
        return read
    close()
    del read
    gc.collect()
    evict_from_page_cache(files)
    return peer.reader(ctx, dest)


def child_main(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one round of one peer as described by ``spec`` (called in the child process).

    A round: two untimed batches (imports, thread pools, graph tracing), then with
    ``cold``: evict the peer's files and time a cold epoch, which also fills the page
    cache, then time a warm epoch; without ``cold``: one untimed epoch, one timed warm epoch.
    With ``throttle`` (``{"procs": cgroup.procs of a blkio cgroup}``) and ``cold``, after the
    cold epoch the files are evicted again and one more cold epoch is timed inside that
    cgroup (reads of the disk at its limit), the process leaving it before the warm epoch.
    """
    ctx = Context(**spec["ctx"])
    if ctx.image_size is not None:
        ctx.image_size = tuple(ctx.image_size)  # type: ignore[assignment]
    peer = PEER_BY_NAME[spec["peer"]]
    dest = Path(spec["dest"])
    read = peer.reader(ctx, dest)
    files = peer.files(ctx, dest)
    base = 3 * int(spec.get("round", 0))  # a different shuffle every epoch of every round
    for i, _ in enumerate(read(base)):
        if i >= 1:
            break
    cold_t = throttled_t = None
    if spec["cold"] and files:
        read = _evicted(peer, ctx, dest, read, files)
        cold_t, _, _ = _run_epoch(read, base + 1, ctx.batch_size)
        throttle = spec.get("throttle")
        if throttle:
            home = join(throttle["procs"])
            try:
                read = _evicted(peer, ctx, dest, read, files)
                throttled_t, _, _ = _run_epoch(read, base + 1, ctx.batch_size)
            finally:
                leave(home)
    else:
        _run_epoch(read, base + 1, ctx.batch_size)
    warm_t, n, diversity = _run_epoch(read, base + 2, ctx.batch_size)
    return {
        "n": n,
        "warm_s": warm_t,
        "cold_s": cold_t,
        "throttled_s": throttled_t,
        "diversity": float(np.mean(diversity)) if diversity else None,
        "peak_rss_mb": peak_rss_mb(),
    }
