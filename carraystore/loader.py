"""Streaming (x, y) batches out of a store with background threads.

``batches(store, batch_size, ...)`` (also ``Store.batches``) returns a :class:`BatchIterator`.
Decoder threads read whole compressed chunks in the epoch's order (see
:mod:`carraystore.sampling`) and decompress them, with the GIL released, into a pool
of preallocated chunk buffers; an assembler thread waits until a window's chunks are
all decoded, gathers the window's batches out of them in the shuffled order, applies
the ``transform`` and puts finished batches into a small bounded queue. The consumer
only takes batches off that queue.

Memory: the pool holds ``max chunks of a window + prefetch`` decoded chunks (by
default ``2 * window``); add one compressed chunk per decoder thread and
``queue_size + 2`` batches (docs/loading.md). Nothing is reallocated per chunk. ``shuffle="global"`` needs the whole shard decoded at once (one window). When an
epoch ends, its pool is kept for the next epoch on the same Store object (no new
allocation, no page faults); ``release_buffers()`` or dropping the Store frees it.

Stopping: ``close()``, leaving a ``with`` block, breaking out of a ``for`` loop (the
iterator is then garbage-collected), an error in a thread, and interpreter exit all
stop the threads and join them.
"""

from __future__ import annotations

import atexit
import os
import sys
import posixpath
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Tuple

import numpy as np

from carraystore.errors import CarrayStoreError, InvalidInputError, LoaderError
from carraystore.sampling import EpochPlan, Shuffle, _check_shuffle, clip_starts, group_runs, num_batches, plan_epoch, shard_length

__all__ = ["batches", "iterate", "release_buffers", "BatchIterator", "LoaderSpec", "make_spec", "gather", "default_threads", "DEFAULT_WINDOW", "THREAD_NAME_PREFIX"]

#: Default shuffle window, in chunks.
DEFAULT_WINDOW = 16
#: Every loader thread's name starts with this (tests and debuggers look for it).
THREAD_NAME_PREFIX = "carraystore-loader"

Batch = Tuple[np.ndarray, Optional[np.ndarray]]
Transform = Callable[[np.ndarray, Optional[np.ndarray]], Tuple[Any, Any]]

_LABEL_MODES = ("int", "categorical", None)


def _open(store_or_path: Any) -> Any:
    from carraystore.store import Store, open_store

    if isinstance(store_or_path, Store):
        return store_or_path
    if isinstance(store_or_path, (str, os.PathLike)):
        return open_store(store_or_path)
    raise InvalidInputError(f"expected a carraystore Store or a path to a .b2nd store, got {type(store_or_path).__name__}")


def _int_arg(name: str, value: Any, minimum: int) -> int:
    try:
        v = int(value)
    except (TypeError, ValueError):
        raise InvalidInputError(f"{name} must be an integer, got {value!r}") from None
    if v != value or v < minimum:
        raise InvalidInputError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return v


class _ForkGate:
    """Keeps ``fork()`` (Keras's ``use_multiprocessing``, multiprocessing pools) from
    happening while a thread is inside a chunk read or decompression, whose library
    state a child process would inherit half-way."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0

    def __enter__(self) -> None:
        with self._cond:
            self._active += 1

    def __exit__(self, *exc: Any) -> None:
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()

    def before_fork(self) -> None:
        self._cond.acquire()  # held across fork: no thread can enter meanwhile
        self._cond.wait_for(lambda: self._active == 0, timeout=30)

    def after_fork_in_parent(self) -> None:
        self._cond.release()

    def after_fork_in_child(self) -> None:
        self._cond = threading.Condition()
        self._active = 0


#: Held (shared) by every chunk read + decompression; see _ForkGate.
FORK_GATE = _ForkGate()


def _after_fork_in_child() -> None:
    FORK_GATE.after_fork_in_child()
    # (Store.decompress_chunk itself decompresses serially in a forked child: blosc2's
    # threads hang there when the parent was decompressing in other threads.)
    # the parent's loader threads do not exist here: forget their pipelines
    global _LIVE_LOCK, _ARENA_LOCK
    _LIVE_LOCK = threading.Lock()
    _ARENA_LOCK = threading.Lock()
    _LIVE.clear()


@dataclass
class LoaderSpec:
    """Resolved loader arguments shared by ``batches``, the Keras and the tf.data adapters."""

    store: Any
    batch_size: int
    shuffle: str | bool
    seed: int
    window: int
    rank: int
    world_size: int
    drop_remainder: bool
    label_mode: str | None
    num_classes: int
    items: np.ndarray | None  # clip starts for sequences, None for every sample
    span: int
    transform: Transform | None
    verify: bool

    # -- sizes ----------------------------------------------------------------------------
    @property
    def n_items(self) -> int:
        return len(self.store) if self.items is None else len(self.items)

    @property
    def shard_length(self) -> int:
        """Items per rank per epoch."""
        return shard_length(self.n_items, self.world_size, self.drop_remainder)

    @property
    def num_batches(self) -> int:
        """Batches per rank per epoch (the same every epoch)."""
        return num_batches(self.shard_length, self.batch_size, self.drop_remainder)

    @property
    def labelled(self) -> bool:
        return self.label_mode is not None and self.store.labels is not None

    def x_shape(self, n: int) -> tuple[int, ...]:
        item = tuple(self.store.image_shape)
        return (n, *item) if self.span == 1 else (n, self.span, *item)

    def y_shape(self, n: int | None) -> tuple[int | None, ...]:
        return (n, self.num_classes) if self.label_mode == "categorical" else (n,)

    # -- per epoch --------------------------------------------------------------------------
    def plan(self, epoch: int) -> EpochPlan:
        return plan_epoch(
            len(self.store),
            self.store.chunk_images,
            shuffle=self.shuffle,
            seed=self.seed,
            epoch=epoch,
            window=self.window,
            rank=self.rank,
            world_size=self.world_size,
            drop_remainder=self.drop_remainder,
            items=self.items,
            span=self.span,
        )

    def batch_bounds(self, plan: EpochPlan, i: int) -> tuple[int, int]:
        a = i * self.batch_size
        return a, min(a + self.batch_size, len(plan))

    def labels_for(self, items: np.ndarray) -> np.ndarray | None:
        """The batch's labels (a clip takes its first frame's label)."""
        if not self.labelled:
            return None
        y = np.asarray(self.store.labels)[items]
        if self.label_mode == "categorical":
            if y.size and int(y.max()) >= self.num_classes:
                raise LoaderError(f"{self.store.path}: label {int(y.max())} is outside the {self.num_classes} classes")
            return np.eye(self.num_classes, dtype=np.float32)[y]
        return y

    def finish(self, x: np.ndarray, y: np.ndarray | None, batch: int, epoch: int, plan: EpochPlan) -> tuple[Any, Any]:
        """Apply the transform; a failure becomes a LoaderError naming the batch and its chunks."""
        if self.transform is None:
            return x, y
        try:
            out = self.transform(x, y)
            if not isinstance(out, tuple) or len(out) != 2:
                raise TypeError(f"a transform must return a pair (x, y), got {type(out).__name__}")
            return out
        except Exception as exc:
            a, b = self.batch_bounds(plan, batch)
            chunks = np.unique(plan.samples(a, b) // self.store.chunk_images).tolist()
            err = LoaderError(
                f"{self.store.path}: transform {getattr(self.transform, '__name__', self.transform)!r} failed on "
                f"batch {batch} of epoch {epoch} (chunks {chunks[:8]}{'...' if len(chunks) > 8 else ''}): "
                f"{type(exc).__name__}: {exc}"
            )
            err.batch = batch  # type: ignore[attr-defined]
            err.chunk = chunks[0] if chunks else None  # type: ignore[attr-defined]
            raise err from exc

    def decode_chunk(self, chunk: int, out: np.ndarray) -> None:
        """Read and decompress one chunk into ``out``; errors become LoaderError naming the chunk."""
        store = self.store
        try:
            with FORK_GATE:
                data = store.read_chunk_bytes(chunk)
                if self.verify:
                    store.check_chunk_bytes(chunk, data)
            # one blosc2 thread per decoder thread: the decoders already run in parallel, and
            # blosc2's own threads on top would oversubscribe the cores (measured: lz4 chunks
            # came 1.8x faster this way on 2 cores)
            store.decompress_chunk(chunk, data, out, nthreads=1)
        except Exception as exc:
            hint = "; run `carraystore verify` on it" if isinstance(exc, CarrayStoreError) else ""
            err = LoaderError(f"{store.path}: loading chunk {chunk} failed: {type(exc).__name__}: {exc}{hint}")
            err.chunk = chunk  # type: ignore[attr-defined]
            raise err from exc


def make_spec(
    store_or_path: Any,
    batch_size: int,
    shuffle: Shuffle = "block",
    seed: int = 0,
    window: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    drop_remainder: bool = False,
    transform: Transform | None = None,
    label_mode: str | None = "int",
    sequence_length: int | None = None,
    sequence_stride: int | None = None,
    groups: Sequence[Any] | np.ndarray | None = None,
    verify: bool = False,
) -> LoaderSpec:
    """Check and resolve the loader arguments (see :func:`batches`)."""
    store = _open(store_or_path)
    batch_size = _int_arg("batch_size", batch_size, 1)
    shuffle = _check_shuffle(shuffle)
    seed = _int_arg("seed", seed, 0)
    window = DEFAULT_WINDOW if window is None else _int_arg("window", window, 1)
    world_size = _int_arg("world_size", world_size, 1)
    rank = _int_arg("rank", rank, 0)
    if rank >= world_size:
        raise InvalidInputError(f"rank {rank} must be below world_size {world_size}")
    if label_mode not in _LABEL_MODES:
        raise InvalidInputError(f"label_mode must be 'int', 'categorical' or None, got {label_mode!r}")
    if transform is not None and not callable(transform):
        raise InvalidInputError("transform must be a function (x, y) -> (x, y)")
    labels = store.labels
    if store.class_names:
        ncls = len(store.class_names)
    elif labels is not None and len(labels):
        ncls = int(np.max(labels)) + 1
    else:
        ncls = 0
    items = None
    span = 1
    if sequence_length is not None:
        span = _int_arg("sequence_length", sequence_length, 1)
        n = len(store)
        if groups is None:
            keys = store.keys
            groups = [posixpath.dirname(k) for k in keys] if keys is not None else np.zeros(n, dtype=np.int8)
        elif len(groups) != n:
            raise InvalidInputError(f"{store.path}: groups has {len(groups)} entries for {n} samples; give one per sample")
        items = clip_starts(group_runs(groups), span, sequence_stride)
    elif groups is not None or sequence_stride is not None:
        raise InvalidInputError("groups= and sequence_stride= only apply with sequence_length=")
    return LoaderSpec(
        store=store,
        batch_size=batch_size,
        shuffle=shuffle,
        seed=seed,
        window=window,
        rank=rank,
        world_size=world_size,
        drop_remainder=bool(drop_remainder),
        label_mode=label_mode,
        num_classes=ncls,
        items=items,
        span=span,
        transform=transform,
        verify=bool(verify),
    )


def gather(
    samples: np.ndarray,
    chunks: np.ndarray,
    slots: np.ndarray,
    arena: np.ndarray,
    chunk_size: int,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The items at ``samples`` (any shape) out of decoded chunks.

    Chunk ``chunks[j]`` (sorted) sits in ``arena[slots[j]]``, an array of shape
    (slots, chunk_size, *item_shape). The result has shape ``samples.shape + item_shape``;
    it is written into ``out`` (C-contiguous, that shape) when given, else a new array.
    """
    s = samples.reshape(-1)
    c = s // chunk_size
    slot = slots[np.searchsorted(chunks, c)]
    flat = slot * chunk_size + (s - c * chunk_size)
    item = arena.shape[2:]
    if out is None:
        out = np.empty((*samples.shape, *item), dtype=arena.dtype)
    # mode="clip" (the indices are valid) lets take() write straight into out, unbuffered
    np.take(arena.reshape(-1, *item), flat, axis=0, out=out.reshape(-1, *item), mode="clip")
    return out


class _BatchBuffers:
    """Batch arrays reused once the consumer has let go of them.

    Writing every batch into fresh memory costs a page fault per 4 KiB, which for large
    images is slower than the copy itself. A buffer is handed out again only when nothing
    outside this pool refers to it (its reference count, which views, the output queue and
    buffer-protocol exports all raise, is back to the pool's own), so a consumer that
    keeps batches always gets new arrays and never sees one overwritten.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffers: list[np.ndarray] = []

    def get(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        for i in range(len(self.buffers)):
            # references: the list, and getrefcount's own argument
            if sys.getrefcount(self.buffers[i]) <= 2 and self.buffers[i].shape == shape and self.buffers[i].dtype == dtype:
                return self.buffers[i]
        buf = np.empty(shape, dtype=dtype)
        if len(self.buffers) >= self.capacity:
            self.buffers.pop(0)
        self.buffers.append(buf)
        return buf


# ---------------------------------------------------------------------------------------
# the threaded pipeline
# ---------------------------------------------------------------------------------------

_END = object()

# Decoded-chunk buffers outlive a pipeline: the next epoch on the same Store object takes
# them back instead of allocating (and page-faulting) the whole pool again. One idle pool
# per Store, freed with the Store (weak keys) or by release_buffers().
_IDLE_ARENAS: "weakref.WeakKeyDictionary[Any, np.ndarray]" = weakref.WeakKeyDictionary()
_ARENA_LOCK = threading.Lock()


def _take_arena(store: Any, nslots: int) -> np.ndarray:
    shape = (store.chunk_images, *store.image_shape)
    with _ARENA_LOCK:
        idle = _IDLE_ARENAS.get(store)
        if idle is not None and idle.shape[0] >= nslots and idle.shape[1:] == shape and idle.dtype == store.dtype:
            del _IDLE_ARENAS[store]
            return idle[:nslots]
    return np.empty((nslots, *shape), dtype=store.dtype)


def _give_back_arena(store: Any, arena: np.ndarray) -> None:
    base = arena.base if arena.base is not None else arena
    with _ARENA_LOCK:
        try:
            idle = _IDLE_ARENAS.get(store)
            if idle is None or idle.shape[0] < base.shape[0]:
                _IDLE_ARENAS[store] = base
        except TypeError:  # an object that cannot be weakly referenced: just free
            pass


def release_buffers(store: Any = None) -> None:
    """Free the decoded-chunk buffers kept for the next epoch (of ``store``, or of every store)."""
    with _ARENA_LOCK:
        if store is None:
            _IDLE_ARENAS.clear()
        else:
            _IDLE_ARENAS.pop(store, None)

_LIVE: "weakref.WeakSet[_Pipeline]" = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


class _Stopped(Exception):
    pass


class _Pipeline:
    """State the threads share. Threads never reference the BatchIterator itself, so the
    consumer dropping the iterator garbage-collects it and stops them."""

    def __init__(self, spec: LoaderSpec, epoch: int, start_batch: int, prefetch: int, num_threads: int, queue_size: int) -> None:
        self.spec = spec
        self.pid = os.getpid()
        self.epoch = epoch
        self.plan = plan = spec.plan(epoch)
        self.start_batch = start_batch
        self.nbatches = spec.num_batches
        store = spec.store
        self.k = store.chunk_images
        first_pos = start_batch * spec.batch_size
        first_window = plan.window_of(first_pos) if first_pos < len(plan) else plan.nwindows
        self.window_task0: dict[int, int] = {}
        chunks: list[np.ndarray] = []
        ntasks = 0
        for w in range(first_window, plan.nwindows):
            self.window_task0[w] = ntasks
            chunks.append(plan.window_chunks[w])
            ntasks += len(plan.window_chunks[w])
        self.task_chunk = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int64)
        self.ntasks = ntasks
        need = max((len(plan.window_chunks[w]) for w in self.window_task0), default=0)
        self.nslots = min(need + prefetch, ntasks)
        self.arena: np.ndarray | None = _take_arena(store, self.nslots)
        self.cond = threading.Condition()
        self.free = list(range(self.nslots - 1, -1, -1))
        self.next_task = 0
        self.advised = 0
        self.readahead = 2 * max(1, min(num_threads, ntasks))
        self.results: list[Any] = [None] * ntasks
        self.stopped = False
        self.chunks_decoded = 0
        self.out: queue.Queue[Any] = queue.Queue(maxsize=queue_size)
        ndec = max(1, min(num_threads, ntasks))
        name = f"{THREAD_NAME_PREFIX}-{id(self):x}"
        self.threads = [threading.Thread(target=self._decode_loop, name=f"{name}-decode{i}", daemon=True) for i in range(ndec)]
        self.threads.append(threading.Thread(target=self._assemble_loop, name=f"{name}-assemble", daemon=True))
        with _LIVE_LOCK:
            _LIVE.add(self)
        for t in self.threads:
            t.start()

    # -- decoder threads -------------------------------------------------------------------
    def _decode_loop(self) -> None:
        spec = self.spec
        while True:
            with self.cond:
                while not self.stopped and self.next_task < self.ntasks and not self.free:
                    self.cond.wait()
                if self.stopped or self.next_task >= self.ntasks:
                    return
                slot = self.free.pop()
                t = self.next_task
                self.next_task += 1
                arena = self.arena
                # ask the kernel to start reading the chunks the decoders need next, so that
                # reading overlaps decompression on a cold cache (a hint; no memory of ours)
                ahead_to = min(self.ntasks, t + 1 + self.readahead)
                ahead = self.task_chunk[max(self.advised, t + 1) : ahead_to]
                self.advised = max(self.advised, ahead_to)
            assert arena is not None
            if len(ahead):
                spec.store.advise_willneed(ahead)
            res: Any = slot
            try:
                spec.decode_chunk(int(self.task_chunk[t]), arena[slot])
            except BaseException as exc:  # reported to the consumer, never lost
                res = exc if isinstance(exc, LoaderError) else LoaderError(f"chunk {int(self.task_chunk[t])}: {exc!r}")
                if res is not exc:
                    res.__cause__ = exc
            with self.cond:
                if not isinstance(res, int):
                    self.free.append(slot)
                self.results[t] = res
                self.chunks_decoded += 1
                self.cond.notify_all()

    # -- assembler thread ------------------------------------------------------------------
    def _wait_window(self, w: int) -> tuple[np.ndarray, np.ndarray]:
        t0 = self.window_task0[w]
        chunks = self.plan.window_chunks[w]
        slots = np.empty(len(chunks), dtype=np.int64)
        with self.cond:
            for j in range(len(chunks)):
                while self.results[t0 + j] is None and not self.stopped:
                    self.cond.wait()
                if self.stopped:
                    raise _Stopped
                r = self.results[t0 + j]
                if isinstance(r, BaseException):
                    raise r
                slots[j] = r
        return chunks, slots

    def _release(self, slots: np.ndarray) -> None:
        with self.cond:
            self.free.extend(int(s) for s in slots)
            self.cond.notify_all()

    def _put(self, item: Any) -> bool:
        while not self.stopped:
            try:
                self.out.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _assemble_loop(self) -> None:
        spec, plan = self.spec, self.plan
        bounds = plan.window_starts
        resident: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        pool = _BatchBuffers(self.out.maxsize + 3)
        dtype = spec.store.dtype
        try:
            for bi in range(self.start_batch, self.nbatches):
                a, b = spec.batch_bounds(plan, bi)
                x = pool.get(spec.x_shape(b - a), dtype)
                w = plan.window_of(a)
                pos = a
                while pos < b:
                    if w not in resident:
                        resident[w] = self._wait_window(w)
                    end = min(b, int(bounds[w + 1]))
                    chunks, slots = resident[w]
                    assert self.arena is not None
                    gather(plan.samples(pos, end), chunks, slots, self.arena, self.k, out=x[pos - a : end - a])
                    if end == bounds[w + 1]:
                        self._release(resident.pop(w)[1])
                        w += 1
                    pos = end
                y = spec.labels_for(plan.items[a:b])
                out = spec.finish(x, y, bi, self.epoch, plan)
                if not self._put(out):
                    return
            self._put(_END)
        except _Stopped:
            return
        except BaseException as exc:
            if not isinstance(exc, LoaderError):
                err = LoaderError(f"{spec.store.path}: loader failed: {type(exc).__name__}: {exc}")
                err.__cause__ = exc
                exc = err
            self._put(exc)

    # -- control -------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop and join every thread (idempotent; safe from any thread)."""
        if os.getpid() != self.pid:  # a forked child: these threads are the parent's
            return
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        me = threading.current_thread()
        for t in self.threads:
            if t is not me and t.is_alive():
                t.join(timeout=30)
        # drop what is queued and the buffers
        try:
            while True:
                self.out.get_nowait()
        except queue.Empty:
            pass
        arena, self.arena = self.arena, None
        if arena is not None and not any(t.is_alive() for t in self.threads):
            _give_back_arena(self.spec.store, arena)
        with _LIVE_LOCK:
            _LIVE.discard(self)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=FORK_GATE.before_fork,
        after_in_parent=FORK_GATE.after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )


@atexit.register
def _stop_all() -> None:  # pragma: no cover - exercised through a subprocess test
    with _LIVE_LOCK:
        live = list(_LIVE)
    for p in live:
        p.stop()


class BatchIterator:
    """Iterator of (x, y) numpy batches; returned by :func:`batches`.

    ``len()`` is the number of batches still to come; ``position`` is (epoch, next batch),
    which ``batches(..., epoch=, start_batch=)`` resumes from. Use ``close()`` or a ``with``
    block to stop the threads early (dropping the iterator does it too).
    """

    def __init__(self, pipeline: _Pipeline) -> None:
        self._p = pipeline
        self._next = pipeline.start_batch
        self._closed = False
        self._finalizer = weakref.finalize(self, pipeline.stop)

    # -- description ---------------------------------------------------------------------
    @property
    def plan(self) -> EpochPlan:
        """This rank's order for the epoch; batch ``i`` holds ``plan.samples(i*B, (i+1)*B)``."""
        return self._p.plan

    @property
    def epoch(self) -> int:
        return self._p.epoch

    @property
    def num_batches(self) -> int:
        """Batches in the whole epoch (for this rank)."""
        return self._p.nbatches

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, index of the next batch): pass them as ``epoch=``, ``start_batch=`` to resume."""
        return self._p.epoch, self._next

    @property
    def pool_chunks(self) -> int:
        """Decoded chunk buffers the loader holds (window + prefetch, at most)."""
        return self._p.nslots

    @property
    def chunks_decoded(self) -> int:
        return self._p.chunks_decoded

    @property
    def threads(self) -> list[threading.Thread]:
        return list(self._p.threads)

    def __len__(self) -> int:
        return max(0, self._p.nbatches - self._next)

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise StopIteration
        p = self._p
        while True:
            try:
                item = p.out.get(timeout=0.5)
                break
            except queue.Empty:
                if not p.threads[-1].is_alive() and p.out.empty():
                    self.close()
                    raise LoaderError(f"{p.spec.store.path}: the loader thread ended without a result") from None
        if item is _END:
            self.close()
            raise StopIteration
        if isinstance(item, BaseException):
            self.close()
            raise item
        self._next += 1
        return item  # type: ignore[no-any-return]

    def close(self) -> None:
        """Stop the loader threads and wait for them to end."""
        self._closed = True
        self._finalizer()

    def __enter__(self) -> BatchIterator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<carraystore.loader.BatchIterator epoch={self._p.epoch} next_batch={self._next} "
            f"of {self._p.nbatches} pool_chunks={self._p.nslots}>"
        )


def batches(
    store: Any,
    batch_size: int,
    shuffle: Shuffle = "block",
    seed: int = 0,
    epoch: int = 0,
    window: int | None = None,
    rank: int = 0,
    world_size: int = 1,
    drop_remainder: bool = False,
    start_batch: int = 0,
    transform: Transform | None = None,
    prefetch: int | None = None,
    num_threads: int | None = None,
    label_mode: str | None = "int",
    sequence_length: int | None = None,
    sequence_stride: int | None = None,
    groups: Sequence[Any] | np.ndarray | None = None,
    verify: bool = False,
    queue_size: int = 2,
) -> BatchIterator:
    """Iterate one epoch of (x, y) numpy batches from ``store`` (a Store or a path).

    - ``shuffle``: ``"block"`` (chunks in a random order, samples shuffled inside windows
      of ``window`` chunks), ``"global"`` (a full permutation: the whole shard is decoded
      at once; small stores), or False (store order).
    - ``seed``, ``epoch``: the order depends on them only; use a new ``epoch`` every epoch.
    - ``rank``, ``world_size``: this rank's shard; shards are disjoint, of equal length and
      cover every sample (``drop_remainder=False`` pads a shard by wrapping around,
      ``True`` drops the few samples over and also the last short batch).
    - ``start_batch``: resume inside an epoch; yields exactly the batches from that index.
    - ``transform(x, y) -> (x, y)``: a per-batch numpy function, run in the loader thread.
    - ``prefetch``: decoded chunks held beyond the current window (default ``window``).
    - ``num_threads``: decoder threads (default: the cpu count, 2 to 8), each
      decompressing whole chunks with one blosc2 thread.
    - ``label_mode``: ``"int"`` (int64 labels), ``"categorical"`` (float32 one-hot) or None.
      Unlabelled stores give ``y = None``.
    - ``sequence_length=L``: x is (B, L, *item) clips of consecutive samples that never
      cross a group (the key's parent folder, or ``groups``, one value per sample);
      clips step by ``sequence_stride`` (default L); y is the first frame's label.
    - ``verify``: check every chunk's CRC32 before decoding it.
    """
    spec = make_spec(
        store,
        batch_size,
        shuffle=shuffle,
        seed=seed,
        window=window,
        rank=rank,
        world_size=world_size,
        drop_remainder=drop_remainder,
        transform=transform,
        label_mode=label_mode,
        sequence_length=sequence_length,
        sequence_stride=sequence_stride,
        groups=groups,
        verify=verify,
    )
    return iterate(spec, epoch=epoch, start_batch=start_batch, prefetch=prefetch, num_threads=num_threads, queue_size=queue_size)


def iterate(
    spec: LoaderSpec,
    epoch: int = 0,
    start_batch: int = 0,
    prefetch: int | None = None,
    num_threads: int | None = None,
    queue_size: int = 2,
) -> BatchIterator:
    """Start the loader threads for one epoch of an already resolved :class:`LoaderSpec`."""
    epoch = _int_arg("epoch", epoch, 0)
    nb = spec.num_batches
    start_batch = _int_arg("start_batch", start_batch, 0)
    if start_batch > nb:
        raise InvalidInputError(f"start_batch {start_batch} is past the epoch's {nb} batches")
    prefetch = spec.window if prefetch is None else _int_arg("prefetch", prefetch, 0)
    num_threads = default_threads() if num_threads is None else _int_arg("num_threads", num_threads, 1)
    queue_size = _int_arg("queue_size", queue_size, 1)
    return BatchIterator(_Pipeline(spec, epoch, start_batch, prefetch, num_threads, queue_size))


def default_threads() -> int:
    """Decoder threads used when ``num_threads`` is not given: the cpu count (2 to 8)."""
    return max(2, min(8, os.cpu_count() or 1))
