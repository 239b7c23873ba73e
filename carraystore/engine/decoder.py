"""The decoding engine: one epoch's chunks read, checked and decompressed by threads (layer 4).

:class:`EpochDecoder` serves batch ``i`` of an epoch to every loader and adapter. Decoded chunks
live in slots allocated once; windows ahead are decoded while slots allow, announced first as
:mod:`carraystore.engine.link` says. Threads, locks and a window's life: docs/engine.md.
"""

from __future__ import annotations

import collections
import functools
import os
import queue
import sys
import threading
import time
import weakref
from collections import OrderedDict
from typing import Any

import numpy as np

from carraystore.base.errors import LoaderError
from carraystore.base.forksafe import at_fork_in_child
from carraystore.engine.link import LinkPolicy
from carraystore.engine.sampling import EpochPlan
from carraystore.engine.spec import LoaderSpec
from carraystore.format import blocks
from carraystore.store.reader import StoreReader

__all__ = [
    "EpochDecoder",
    "BatchBuffers",
    "gather",
    "release_buffers",
    "take_batch_buffers",
    "give_back_batch_buffers",
    "idle_arena",
    "idle_batch_buffers",
]


# -- gathering items out of decoded chunks -------------------------------------------------


def gather(
    samples: np.ndarray,
    chunks: np.ndarray,
    slots: np.ndarray,
    arena: np.ndarray,
    chunk_size: int,
    out: np.ndarray | None = None,
    scale: int = 1,
) -> np.ndarray:
    """The items at ``samples`` (any shape) out of decoded chunks.

    Chunk ``chunks[j]`` (sorted) sits in ``arena[slots[j]]``; result ``samples.shape +
    item_shape``, into ``out`` (C-contiguous) when given. ``scale`` > 1: reduced images at
    the start of each slot (:func:`carraystore.format.encoded.reduced_view`).
    """
    s = samples.reshape(-1)
    c = s // chunk_size
    slot = slots[np.searchsorted(chunks, c)]
    flat = slot * chunk_size + (s - c * chunk_size)
    item = arena.shape[2:]
    if scale != 1:
        h, w, *rest = item
        small = (h // scale, w // scale, *rest)
        if out is None:
            out = np.empty((*samples.shape, *small), dtype=arena.dtype)
        rows = arena.reshape(len(arena) * chunk_size, -1)
        m = int(np.prod(small))
        # take() would copy the whole strided arena: index it instead
        out.reshape(len(s), m)[...] = rows[flat, :m]
        return out
    if out is None:
        out = np.empty((*samples.shape, *item), dtype=arena.dtype)
    # mode="clip" (the indices are valid) lets take() write straight into out, unbuffered
    np.take(arena.reshape(-1, *item), flat, axis=0, out=out.reshape(-1, *item), mode="clip")
    return out


class BatchBuffers:
    """Batch arrays reused once the consumer has let go of them.

    Reused only once its reference count is back to the pool's own, so kept batches are
    never overwritten (fresh memory costs a page fault per 4 KiB).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffers: list[np.ndarray] = []

    def get(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        for buf in self.buffers:
            # references: the list, the loop variable and getrefcount's own argument
            if sys.getrefcount(buf) <= 3 and buf.shape == shape and buf.dtype == dtype:
                return buf
        buf = np.empty(shape, dtype=dtype)
        if len(self.buffers) >= self.capacity:
            self.buffers.pop(0)
        self.buffers.append(buf)
        return buf


# -- the slot pool and batch buffers, kept across epochs --------------------------------------

#: Idle pools kept per kind (decoded-chunk slots, batch buffers): those of the stores whose epochs
#: ended last, by geometry, so a store opened again (or another of the same image shape) reuses them.
MAX_IDLE_POOLS = 2


class _IdlePools:
    """Buffers an epoch gave back for the next one, by geometry, the :data:`MAX_IDLE_POOLS` newest."""

    def __init__(self) -> None:
        self.pools: OrderedDict[tuple[Any, ...], Any] = OrderedDict()

    def take(self, key: tuple[Any, ...]) -> Any:
        return self.pools.pop(key, None)

    def peek(self, key: tuple[Any, ...]) -> Any:
        return self.pools.get(key)

    def give(self, key: tuple[Any, ...], pool: Any) -> None:
        self.pools[key] = pool
        self.pools.move_to_end(key)
        while len(self.pools) > MAX_IDLE_POOLS:
            self.pools.popitem(last=False)

    def clear(self, key: tuple[Any, ...] | None = None) -> None:
        if key is None:
            self.pools.clear()
        else:
            self.pools.pop(key, None)


_IDLE_ARENAS = _IdlePools()
_IDLE_BATCHES = _IdlePools()
_ARENA_LOCK = threading.Lock()


def _arena_key(store: StoreReader) -> tuple[Any, ...]:
    return (store.chunk_images, tuple(store.image_shape), np.dtype(store.dtype).str)


def _batches_key(store: StoreReader) -> tuple[Any, ...]:
    return (tuple(store.image_shape), np.dtype(store.dtype).str)


def idle_arena(store: StoreReader) -> np.ndarray | None:
    """The decoded-chunk slots kept for the next epoch of a store like ``store`` (None: none kept)."""
    with _ARENA_LOCK:
        return _IDLE_ARENAS.peek(_arena_key(store))  # type: ignore[no-any-return]


def idle_batch_buffers(store: StoreReader) -> BatchBuffers | None:
    """The batch buffers kept for the next epoch of a store like ``store`` (None: none kept)."""
    with _ARENA_LOCK:
        return _IDLE_BATCHES.peek(_batches_key(store))  # type: ignore[no-any-return]


def _take_arena(store: StoreReader, nslots: int) -> np.ndarray:
    shape = (store.chunk_images, *store.image_shape)
    with _ARENA_LOCK:
        idle = _IDLE_ARENAS.take(_arena_key(store))
    # exactly this size: a larger one would exceed the memory plan (memory_budget)
    if idle is not None and idle.shape[0] == nslots and idle.shape[1:] == shape and idle.dtype == store.dtype:
        return idle  # type: ignore[no-any-return]
    return np.empty((nslots, *shape), dtype=store.dtype)


def _give_back_arena(store: StoreReader, arena: np.ndarray) -> None:
    base = arena.base if arena.base is not None else arena
    key = _arena_key(store)
    with _ARENA_LOCK:
        idle = _IDLE_ARENAS.peek(key)
        if idle is None or idle.shape[0] < base.shape[0]:
            _IDLE_ARENAS.give(key, base)


def take_batch_buffers(store: StoreReader, capacity: int) -> BatchBuffers:
    """The batch buffers the last epoch of a store like this kept (fresh memory costs a page fault per
    4 KiB), or new ones."""
    with _ARENA_LOCK:
        pool = _IDLE_BATCHES.take(_batches_key(store))
    if pool is None:
        return BatchBuffers(capacity)
    pool.capacity = capacity
    del pool.buffers[: max(0, len(pool.buffers) - capacity)]
    return pool  # type: ignore[no-any-return]


def give_back_batch_buffers(store: StoreReader, pool: BatchBuffers) -> None:
    """Keep ``pool`` for the next epoch of a store like ``store`` (a buffer still held outside is never reused)."""
    with _ARENA_LOCK:
        _IDLE_BATCHES.give(_batches_key(store), pool)


def release_buffers(store: StoreReader | None = None) -> None:
    """Free the decoded-chunk and batch buffers kept for the next epoch (of stores like ``store``, or all)."""
    with _ARENA_LOCK:
        _IDLE_ARENAS.clear(None if store is None else _arena_key(store))
        _IDLE_BATCHES.clear(None if store is None else _batches_key(store))


# -- the decoder ---------------------------------------------------------------------------

_LIVE: weakref.WeakSet[EpochDecoder] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    # the parent's decoder threads do not exist here: forget them, and the locks they held
    global _LIVE_LOCK, _ARENA_LOCK
    _LIVE_LOCK = threading.Lock()
    _ARENA_LOCK = threading.Lock()
    _LIVE.clear()


at_fork_in_child(_after_fork_in_child)


#: Smaller items are gathered from decoded chunks (per-item calls cost more than the copy).
DIRECT_MIN_ITEM_BYTES = 64 * 1024
#: Direct mode by default only up to this many threads (past them per-image calls contend).
DIRECT_MAX_THREADS = 4
#: Direct mode: windows of at most this many items keep every item's getitem arguments once made.
CALLS_CACHED_ITEMS = 1 << 16


def direct_possible(store: StoreReader) -> bool:
    """Whether batches can be decompressed image by image, straight into their slots.

    Needs one-item blocks (``fast`` over 64 KiB, or ``Codec(block_images=1)``), no bytedelta
    and c-blosc2's getitem (:mod:`carraystore.format.blocks`).
    """
    codec = store.codec
    return (
        store.meta.layout != "encoded"  # entries are decoded chunk by chunk (FORMAT.md 10)
        and codec.block_images == 1
        # libblosc2's getitem fails on bytedelta chunks
        and "bytedelta" not in codec.filters
        and codec.typesize is not None
        and store.meta.image_nbytes % codec.typesize == 0
        and blocks.available()
    )


def direct_ok(store: StoreReader) -> bool:
    """Whether the engine uses direct mode by default: possible, and items large enough."""
    return store.meta.image_nbytes >= DIRECT_MIN_ITEM_BYTES and direct_possible(store)


def decodes_direct(spec: LoaderSpec, num_threads: int) -> bool:
    """Whether an :class:`EpochDecoder` of ``spec`` with ``num_threads`` threads uses direct mode by default."""
    return spec.scale == 1 and num_threads <= DIRECT_MAX_THREADS and direct_ok(spec.store)


class _Window:
    """One window of chunks (decoded, or compressed in direct mode): slots, progress, users."""

    __slots__ = (
        "chunks", "slots", "left", "done", "error", "pins", "unserved", "data", "addrs", "sizes", "calls", "touched",
    )  # fmt: skip

    def __init__(self, chunks: np.ndarray, slots: np.ndarray, batches: range) -> None:
        self.chunks = chunks
        self.slots = slots
        self.left = len(chunks)
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.pins = 0
        self.unserved = set(batches)
        #: whether a batch asked for this window yet (windows decoded ahead are not touched)
        self.touched = False
        #: direct mode: each chunk's compressed bytes (uint8 arrays), their addresses and sizes
        self.data: list[Any] = [None] * len(chunks)
        self.addrs = np.zeros(len(chunks), dtype=np.int64)
        self.sizes = np.zeros(len(chunks), dtype=np.int64)
        #: direct mode: the getitem arguments of the window's items, once decoded (``EpochDecoder._calls``)
        self.calls: tuple[list[int], list[int], list[int]] | None = None
        if not self.left:
            self.done.set()


class LoaderClosed(Exception):
    """Raised inside the engine when a decoder was closed while a batch waited for it."""


#: seconds a batch waits for a partly served earlier window before evicting it (for a claimed
#: batch, counted from the loader's last progress)
EVICT_PATIENCE_S = 2.0


class EpochDecoder:
    """Batches of one epoch of a :class:`LoaderSpec`, by index, from any thread.

    ``nslots`` beyond ``plan.max_window_chunks`` is how far ahead threads may decode.
    ``plan`` replaces the epoch's plan (resumed); ``serves=(k, n)``: only batches
    ``b % n == k`` are asked for (one of ``n`` workers).
    """

    def __init__(
        self,
        spec: LoaderSpec,
        epoch: int,
        nslots: int,
        num_threads: int,
        thread_prefix: str,
        direct: bool | None = None,
        plan: EpochPlan | None = None,
        serves: tuple[int, int] = (0, 1),
    ) -> None:
        self.spec = spec
        self.epoch = epoch
        self.plan: EpochPlan = spec.plan(epoch) if plan is None else plan
        self.serves = (int(serves[0]), max(1, int(serves[1])))
        self.k = spec.store.chunk_images
        self.pid = os.getpid()
        self.nslots = max(1, min(max(nslots, self.plan.max_window_chunks), self.plan.total_chunks))
        #: direct mode: slots hold compressed chunks and batches are decompressed image by image
        self.direct = (
            decodes_direct(spec, num_threads)
            if direct is None
            else spec.scale == 1 and bool(direct and direct_possible(spec.store))  # reduced: from decoded chunks
        )
        #: batches being made now (direct mode: the decoder threads help with a batch made alone)
        self._in_batch = 0
        #: slots freed, windows finished or decoded so far; (that count, first window, window) when
        #: :meth:`read_ahead` last found no room: it does not try again until the count moves
        self._changes = 0
        self._ahead_blocked: tuple[int, int, int] | None = None
        #: bytes of one item (direct mode's stride in a batch)
        self._item_nbytes = int(spec.store.meta.image_nbytes)
        self.arena: np.ndarray | None = None if self.direct else _take_arena(spec.store, self.nslots)
        self._readers = threading.local()
        self.cond = threading.Condition()
        self.free: list[int] = list(range(self.nslots - 1, -1, -1))
        self.windows: OrderedDict[int, _Window] = OrderedDict()
        #: windows whose batches were all served: read-ahead never decodes them again
        self.finished: set[int] = set()
        self.decode_count: dict[int, int] = {}
        #: batches a thread took on and will ask for (:meth:`claim`), until :meth:`batch` returns
        self.claimed: dict[int, int] = {}
        self._progress_at = time.monotonic()  # the last batch served or window decoded
        self.chunks_decoded = 0
        self.out_of_order = False
        self.closed = False
        self._tasks: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._announced = -1  # the last window whose byte ranges the source was told about
        #: the lead window, the announce distance and the next epoch's hint (:mod:`carraystore.engine.link`)
        self.link = LinkPolicy(spec, epoch, self.plan, self.serves, self.cond)
        self.threads = [
            threading.Thread(target=self._decode_loop, name=f"{thread_prefix}-{id(self):x}-decode{i}", daemon=True)
            for i in range(max(1, num_threads))
        ]
        with _LIVE_LOCK:
            _LIVE.add(self)
        for t in self.threads:
            t.start()
        self.link.start_hint(self._unread)

    # -- decoder threads -------------------------------------------------------------------
    def _decode_loop(self) -> None:
        while True:
            task = self._tasks.get()
            if task is None:
                return
            if callable(task):  # a share of a batch to decompress (direct mode)
                task()
                continue
            win, j = task
            lead = win is self.link.lead
            if not lead:
                self.link.lead_in.wait()
            fetched = functools.partial(self._lead_fetched, j) if lead else None
            err: BaseException | None = None
            if win.error is None and not self.closed:
                try:
                    if self.direct:
                        data = win.data[j] = self.spec.fetch_chunk(int(win.chunks[j]))
                        win.addrs[j], win.sizes[j] = data.ctypes.data, len(data)
                        del data
                    else:
                        assert self.arena is not None
                        self.spec.decode_chunk(int(win.chunks[j]), self.arena[int(win.slots[j])], fetched=fetched)
                except BaseException as exc:  # reported to whoever waits for the window
                    err = exc if isinstance(exc, LoaderError) else LoaderError(f"chunk {int(win.chunks[j])}: {exc!r}")
                    if err is not exc:
                        err.__cause__ = exc
            if lead:  # (in direct mode, after a failure or once closed: decode_chunk did not say)
                self._lead_fetched(j)
            with self.cond:
                if err is not None and win.error is None:
                    win.error = err
                self.chunks_decoded += 1
                win.left -= 1
                if win.left == 0:
                    win.done.set()
                    self._changes += 1
                    self._progress_at = time.monotonic()
                    self.cond.notify_all()

    def _lead_fetched(self, j: int) -> None:
        """The lead window's chunk ``j`` is in (or failed); after its last, announce the rest."""
        with self.cond:
            if self.link.lead_fetched(j):
                for v in sorted({self.link.lead_w, *self.windows}):
                    self._announce(v)

    def _unread(self) -> set[int]:
        """The chunks of the windows this epoch has yet to read (lock held)."""
        done = {v for v, e in self.windows.items() if e.done.is_set()} | self.finished
        return {int(c) for v in range(self.plan.nwindows) if v not in done for c in self.plan.window_chunks[v]}

    # -- windows ------------------------------------------------------------------------------
    def _batches_of(self, w: int) -> range:
        """The batches this decoder serves that draw from window ``w``."""
        return self.plan.batches_of(w, self.spec.batch_size, self.serves)

    def _evictable(self, keep_unserved: bool) -> int | None:
        """A resident window whose slots may be taken (lock held): a served one, else (unless
        ``keep_unserved``) the furthest untouched read-ahead one, else the least recently used."""
        idle = [(w, e) for w, e in self.windows.items() if e.pins == 0 and e.done.is_set()]
        for w, e in idle:
            if not e.unserved:
                return w
        if keep_unserved or not idle:
            return None
        ahead = [w for w, e in idle if not e.touched]
        if ahead:
            return max(ahead)
        return idle[0][0]

    def _drop(self, w: int) -> None:
        e = self.windows.pop(w)
        self.free.extend(int(s) for s in e.slots)
        self._changes += 1
        self.cond.notify_all()

    def _start(self, w: int, wait: bool) -> _Window | None:
        """Reserve slots for window ``w`` and queue its chunks (lock held); ``wait``: evict and
        wait for slots, else start only if slots are free now (evicting only served windows)."""
        chunks = self.plan.window_chunks[w]
        need = len(chunks)
        deadline: float | None = None
        while len(self.free) < need:
            if self.closed:
                raise LoaderClosed
            if w in self.windows:  # started by another thread while this one waited for slots
                return self.windows[w] if wait else None
            victim = self._evictable(keep_unserved=not wait)
            unserved = self.windows[victim].unserved if victim is not None else set()
            claimed = any(b in self.claimed for b in unserved)  # a thread will ask for one of them
            busy = claimed or any(e.pins for e in self.windows.values())  # other threads serve batches
            if victim is not None and victim < w and unserved and busy:
                # its batches come first: give their threads time rather than decode it twice
                now = time.monotonic()
                deadline = now + EVICT_PATIENCE_S if deadline is None else deadline
                if claimed:
                    deadline = max(deadline, self._progress_at + EVICT_PATIENCE_S)
                if now < deadline:
                    self.cond.wait(deadline - now)
                    continue
            if victim is not None:
                self._drop(victim)
                continue
            if not wait:
                return None
            self.cond.wait()
        slots = np.array([self.free.pop() for _ in range(need)], dtype=np.int64)
        win = _Window(chunks, slots, self._batches_of(w))
        self.windows[w] = win
        self.link.take_lead(win, w, chunks)
        n = self.decode_count[w] = self.decode_count.get(w, 0) + 1
        if n > 1:
            self.out_of_order = True
        self._announce(w)
        for j in range(need):
            self._tasks.put((win, j))
        return win

    def _announce(self, w: int) -> None:
        """Announce the chunks after ``w``: one window, or (remote) two and ``max_inflight`` chunks."""
        want = self.link.want
        if not self.link.lead_in.is_set():  # the lead window alone until its bytes are in
            if w != self.link.lead_w or self._announced >= w:
                return
            want, last = 0, w
        else:
            last = min(self.plan.nwindows - 1, w + (2 if want else 1))
        # only the windows this decoder reads: another worker's are fetched by that worker
        mine = self._batches_of
        n = sum(len(self.plan.window_chunks[v]) for v in range(w + 1, last + 1) if mine(v))
        while n < want and last + 1 < self.plan.nwindows:
            last += 1
            n += len(self.plan.window_chunks[last]) if mine(last) else 0
        if last <= self._announced and w <= self._announced:
            return
        first = max(w, self._announced + 1)
        chunks = [c for v in range(first, last + 1) if mine(v) for c in self.plan.window_chunks[v]]
        self._announced = max(self._announced, last)
        if chunks:
            try:
                self.spec.store.prefetch_chunks(chunks)
                self.link.announced(chunks)
            except Exception:  # a hint only
                pass
        if last == self.plan.nwindows - 1:  # every chunk announced
            self.link.all_announced([c for v in range(w, last + 1) for c in self.plan.window_chunks[v]])

    def _acquire(self, w: int) -> _Window:
        with self.cond:
            if self.closed:
                raise LoaderClosed
            win = self.windows.get(w)
            if win is None:
                win = self._start(w, wait=True)
                assert win is not None
            self.windows.move_to_end(w)
            win.pins += 1
            win.touched = True
        win.done.wait()
        if win.error is not None:
            with self.cond:
                win.pins -= 1
                if self.windows.get(w) is win and win.pins == 0:
                    self._drop(w)
            err = win.error
            if isinstance(err, LoaderError):
                raise err
            raise LoaderError(f"{self.spec.store.location}: decoding window {w} failed: {err!r}") from err
        return win

    def claim(self, i: int) -> None:
        """A thread will ask for batch ``i``: its windows are not evicted for later batches."""
        with self.cond:
            self.claimed[i] = self.claimed.get(i, 0) + 1

    def unclaim(self, i: int) -> None:
        """Take back :meth:`claim` (:meth:`batch` does once it returns)."""
        with self.cond:
            n = self.claimed.pop(i, 0) - 1
            if n > 0:
                self.claimed[i] = n
            self._progress_at = time.monotonic()
            self.cond.notify_all()

    def _release(self, w: int, win: _Window, batch: int) -> None:
        with self.cond:
            win.pins -= 1
            win.unserved.discard(batch)
            if not win.unserved and win.pins == 0 and self.windows.get(w) is win:
                # kept until its slots are needed: a batch asked for again is not re-decoded
                self.finished.add(w)
                self._changes += 1
                self.cond.notify_all()

    def read_ahead(self, w: int) -> None:
        """Start decoding windows from ``w`` on while slots are free (never evicting unserved ones)."""
        with self.cond:
            blocked = self._ahead_blocked
            if blocked is not None and blocked[0] == self._changes and blocked[1] <= w <= blocked[2]:
                return  # no slot freed and no window finished since this found no room for window blocked[2]
            start, nwindows = w, len(self.plan.window_starts) - 1
            while 0 <= w < nwindows and not self.closed:
                if (
                    w not in self.windows
                    and w not in self.finished
                    and len(self._batches_of(w))  # a window none of this decoder's batches needs
                    and self._start(w, wait=False) is None
                ):
                    self._ahead_blocked = (self._changes, start, w)
                    return
                w += 1

    # -- batches --------------------------------------------------------------------------------
    def batch(self, i: int, out: np.ndarray | None = None) -> tuple[Any, ...]:
        """Batch ``i`` as ``(x, y)`` (``(x, y, w)`` with ``sample_weight``), x written into ``out``."""
        with self.cond:
            self._in_batch += 1
        try:
            return self._batch(i, out)
        finally:
            with self.cond:
                self._in_batch -= 1
            self.unclaim(i)

    def _batch(self, i: int, out: np.ndarray | None) -> tuple[Any, ...]:
        spec, plan = self.spec, self.plan
        a, b = spec.batch_bounds(plan, i)
        if out is None:
            out = np.empty(spec.x_shape(b - a), dtype=spec.store.dtype)
        pos = a
        w = plan.window_of(a)
        while pos < b:
            end = min(b, int(plan.window_starts[w + 1]))
            win = self._acquire(w)
            try:
                if self.direct:
                    self._gather_direct(w, win, pos, end, out[pos - a : end - a])
                else:
                    assert self.arena is not None
                    gather(
                        plan.samples(pos, end),
                        win.chunks,
                        win.slots,
                        self.arena,
                        self.k,
                        out=out[pos - a : end - a],
                        scale=spec.scale,
                    )
            finally:
                self._release(w, win, i)
            pos = end
            w += 1
        self.read_ahead(plan.window_of(b - 1) + 1 if b > a else 0)
        items = plan.items[a:b]
        return spec.finish(out, spec.y_for(items), i, self.epoch, plan, spec.w_for(items))

    # -- direct mode -------------------------------------------------------------------------------
    def _block_reader(self) -> blocks.BlockReader:
        r = getattr(self._readers, "r", None)
        if r is None:
            codec = self.spec.store.codec
            r = self._readers.r = blocks.BlockReader(
                blocks.library(), int(codec.typesize or 1), self.spec.store.meta.image_nbytes
            )
        return r

    def _calls(self, w: int, win: _Window, first: int, n: int) -> tuple[list[int], list[int], list[int]]:
        """Items ``first:first + n`` of window ``w`` (in the plan's order, frames of clips one by one):
        their chunk's address and size and their start in it (in units of the typesize), the arguments
        of one getitem call each; made once per window unless the window is larger than
        :data:`CALLS_CACHED_ITEMS`."""
        calls = win.calls
        if calls is None:
            plan = self.plan
            lo, hi = int(plan.window_starts[w]), int(plan.window_starts[w + 1])
            whole = (hi - lo) * plan.span <= CALLS_CACHED_ITEMS
            if not whole:
                lo, hi = lo + first // plan.span, lo + (first + n) // plan.span
            s = plan.samples(lo, hi).reshape(-1)
            c = s // self.k
            where = win.chunks.searchsorted(c)
            units = self._block_reader().units
            calls = (win.addrs[where].tolist(), win.sizes[where].tolist(), ((s - c * self.k) * units).tolist())
            if not whole:
                return calls
            win.calls = calls
        addrs, sizes, starts = calls
        return addrs[first : first + n], sizes[first : first + n], starts[first : first + n]

    def _gather_direct(self, w: int, win: _Window, pos: int, end: int, out: np.ndarray) -> None:
        """Decompress the items at positions [pos, end) of window ``w`` into ``out``, shared with the
        decoder threads.

        Made alone, the batch is cut into parts: this thread takes them one by one, and so does each
        decoder thread handed a share, until none is left; then this thread waits for the parts under
        way. Beside other batches (several assemblers), this thread decompresses the whole batch.
        """
        if not out.flags.c_contiguous:
            tmp = np.empty(out.shape, dtype=out.dtype)
            self._gather_direct(w, win, pos, end, tmp)
            out[...] = tmp
            return
        span = self.plan.span
        n = (end - pos) * span  # clips: every frame is an item of its own
        if not n:
            return
        addrs, sizes, starts = self._calls(w, win, (pos - int(self.plan.window_starts[w])) * span, n)
        stride = self._item_nbytes  # out is C-contiguous
        base = out.ctypes.data
        dests = range(base, base + n * stride, stride)
        reader = self._block_reader()
        # the decoder threads help only a batch made alone: beside another one, waking them costs more
        helpers = 0 if self.closed or self._in_batch > 1 else min(len(self.threads), n // 8)
        if helpers <= 0:
            reader.get_many(addrs, sizes, starts, dests)
            return
        # more parts than threads: whoever is free first takes the next
        nparts = min(2 * (helpers + 1), n // 4)
        parts = collections.deque((n * p // nparts, n * (p + 1) // nparts) for p in range(nparts))
        errors: list[BaseException] = []
        lock = threading.Lock()
        running = [0]
        idle = threading.Event()

        def work() -> None:
            reader = self._block_reader()
            while True:
                with lock:
                    if not parts:
                        return
                    lo, hi = parts.popleft()
                    running[0] += 1
                try:
                    reader.get_many(addrs[lo:hi], sizes[lo:hi], starts[lo:hi], dests[lo:hi])
                except BaseException as exc:
                    errors.append(exc)
                with lock:
                    running[0] -= 1
                    if not running[0] and not parts:
                        idle.set()

        for _ in range(helpers):
            self._tasks.put(work)
        try:
            work()
        finally:
            with lock:
                parts.clear()  # (after an error here) nothing more is started
                done = not running[0]
            if not done:
                idle.wait()
        if errors:
            raise LoaderError(f"{self.spec.store.location}: decompressing a batch failed: {errors[0]!r}") from errors[0]

    # -- lifetime --------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop and join the decoder threads; keep the slots for the Store's next epoch."""
        if os.getpid() != self.pid:  # a forked child: these threads are the parent's
            return
        with self.cond:
            if self.closed:
                return
            self.closed = True
            self.link.close()
            for win in self.windows.values():
                if not win.done.is_set():
                    win.error = win.error or LoaderError(
                        f"{self.spec.store.location}: the loader was closed while decoding"
                    )
            self.cond.notify_all()
        for _ in self.threads:
            self._tasks.put(None)
        me = threading.current_thread()
        for t in self.threads:
            if t is not me and t.is_alive():
                t.join(timeout=30)
        with self.cond:
            for win in self.windows.values():
                win.done.set()
            self.windows.clear()
        arena, self.arena = self.arena, None
        if arena is not None and not any(t.is_alive() for t in self.threads):
            _give_back_arena(self.spec.store, arena)
        with _LIVE_LOCK:
            _LIVE.discard(self)


def stop_all() -> None:
    """Stop every decoder of this process (at interpreter exit)."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for d in live:
        d.close()
