"""Keras 3: a store as a ``keras.utils.PyDataset``.

    from carraystore.keras import StoreDataset
    model.fit(StoreDataset("train.b2nd", 32), epochs=10, shuffle=False,
              validation_data=StoreDataset("val.b2nd", 32, shuffle=False))

Batch ``i`` of an epoch is a pure function of (arguments, epoch, i), so Keras may ask for
batches from several threads or processes in any order. Decoded windows of chunks are
kept in a small per-process cache (``cache_windows``, default 3) and the next window is
decoded in the background, so batches asked in order decode every chunk once per epoch.
``on_epoch_end`` after ``on_epoch_begin`` (what Keras does around each epoch) moves to the
next epoch: a new order. Outside Keras, use ``set_epoch``.

``model.fit(shuffle=True)`` (Keras's default) asks for the batches in a random order,
which makes every batch decode its window again unless the whole epoch fits in the
cache; StoreDataset warns when it sees that. It already shuffles: pass ``shuffle=False``.

Only ``keras`` is imported here, never ``tensorflow``, so another Keras backend works.
"""

from __future__ import annotations

import os
import threading
import warnings
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import keras
import numpy as np

from carraystore.errors import InvalidInputError, LoaderError
from carraystore.loader import LoaderSpec, Transform, default_threads, gather, make_spec
from carraystore.sampling import EpochPlan, Shuffle

__all__ = ["StoreDataset", "KERAS_THREAD_PREFIX"]

#: Name prefix of the decoder threads a StoreDataset starts.
KERAS_THREAD_PREFIX = "carraystore-keras"


class _Entry:
    __slots__ = ("arena", "chunks", "slots", "done", "error", "pins", "left", "unserved")

    def __init__(self, arena: np.ndarray, chunks: np.ndarray, batches: range) -> None:
        self.arena = arena
        self.chunks = chunks
        self.slots = np.arange(len(chunks), dtype=np.int64)
        self.done = threading.Event()
        self.error: BaseException | None = None
        self.pins = 0
        self.left = len(chunks)
        self.unserved = set(batches)  # batches of this window not handed out yet


class _WindowCache:
    """Decoded windows of one epoch, for one process; thread-safe."""

    def __init__(self, spec: LoaderSpec, epoch: int, capacity: int, num_threads: int) -> None:
        self.spec = spec
        self.epoch = epoch
        self.plan: EpochPlan = spec.plan(epoch)
        self.k = spec.store.chunk_images
        self.capacity = max(2, capacity)
        self.lock = threading.Lock()
        self.entries: OrderedDict[int, _Entry] = OrderedDict()
        self.spare: list[np.ndarray] = []
        self.slots = self.plan.max_window_chunks
        self.executor = ThreadPoolExecutor(max(1, num_threads), thread_name_prefix=KERAS_THREAD_PREFIX)
        self.decoded_windows: dict[int, int] = {}
        self.chunks_decoded = 0
        self.warned = False
        self.closed = False

    # -- decoding ----------------------------------------------------------------------------
    def _decode_one(self, entry: _Entry, j: int) -> None:
        try:
            if entry.error is None:
                self.spec.decode_chunk(int(entry.chunks[j]), entry.arena[j])
        except BaseException as exc:
            entry.error = exc
        with self.lock:
            self.chunks_decoded += 1
            entry.left -= 1
            last = entry.left == 0
        if last:
            entry.done.set()

    def _start(self, w: int) -> _Entry:
        """Begin decoding window ``w`` (lock held)."""
        if self.closed:
            raise LoaderError(f"{self.spec.store.path}: the dataset's decoder was shut down")
        arena = self.spare.pop() if self.spare else np.empty((self.slots, self.k, *self.spec.store.image_shape), self.spec.store.dtype)
        b = self.spec.batch_size
        lo, hi = int(self.plan.window_starts[w]), int(self.plan.window_starts[w + 1])
        entry = _Entry(arena, self.plan.window_chunks[w], range(lo // b, (hi - 1) // b + 1))
        self.entries[w] = entry
        n = self.decoded_windows[w] = self.decoded_windows.get(w, 0) + 1
        if n > 1 and not self.warned:
            self.warned = True
            warnings.warn(
                f"carraystore StoreDataset ({self.spec.store.path}): window {w} of epoch {self.epoch} was decoded "
                f"{n} times; batches are being asked for out of order. model.fit(shuffle=True), Keras's default, "
                "does that: StoreDataset already shuffles, so pass shuffle=False to fit (or raise cache_windows).",
                RuntimeWarning,
                stacklevel=4,
            )
        if not len(entry.chunks):
            entry.done.set()
        for j in range(len(entry.chunks)):
            self.executor.submit(self._decode_one, entry, j)
        self._evict()
        return entry

    def _evict(self) -> None:
        while len(self.entries) > self.capacity:
            # first a window whose batches were all handed out, else the least recently used
            idle = [(w, e) for w, e in self.entries.items() if e.pins == 0 and e.done.is_set()]
            victim = next((w for w, e in idle if not e.unserved), idle[0][0] if idle else None)
            if victim is None:
                return
            e = self.entries.pop(victim)
            if len(self.spare) < self.capacity:
                self.spare.append(e.arena)

    # -- access ------------------------------------------------------------------------------
    def acquire(self, w: int) -> _Entry:
        with self.lock:
            e = self.entries.get(w)
            if e is None:
                e = self._start(w)
            self.entries.move_to_end(w)
            e.pins += 1
        e.done.wait()
        if e.error is not None:
            self.release(e)
            with self.lock:
                if self.entries.get(w) is e:
                    del self.entries[w]
            err = e.error
            if isinstance(err, LoaderError):
                raise err
            raise LoaderError(f"{self.spec.store.path}: decoding window {w} failed: {err!r}") from err
        return e

    def release(self, e: _Entry) -> None:
        with self.lock:
            e.pins -= 1

    def prefetch(self, w: int) -> None:
        """Start decoding window ``w`` ahead of need, unless that would evict a window still in use."""
        if 0 <= w < self.plan.nwindows:
            with self.lock:
                if w in self.entries or self.closed:
                    return
                room = len(self.entries) < self.capacity or any(
                    not e.unserved and e.pins == 0 and e.done.is_set() for e in self.entries.values()
                )
                if room:
                    self._start(w)

    def batch(self, i: int) -> tuple[np.ndarray, np.ndarray | None]:
        spec, plan = self.spec, self.plan
        a, b = spec.batch_bounds(plan, i)
        w0, w1 = plan.window_of(a), plan.window_of(b - 1)
        parts = []
        for w in range(w0, w1 + 1):
            lo, hi = max(a, int(plan.window_starts[w])), min(b, int(plan.window_starts[w + 1]))
            e = self.acquire(w)
            try:
                parts.append(gather(plan.samples(lo, hi), e.chunks, e.slots, e.arena, self.k))
            finally:
                with self.lock:
                    e.unserved.discard(i)
                    e.pins -= 1
        self.prefetch(w1 + 1)
        x = parts[0] if len(parts) == 1 else np.concatenate(parts)
        y = spec.labels_for(plan.items[a:b])
        return spec.finish(x, y, i, self.epoch, plan)  # type: ignore[no-any-return]

    def close(self) -> None:
        with self.lock:
            self.closed = True
            entries = list(self.entries.values())
            self.entries.clear()
            self.spare.clear()
        self.executor.shutdown(wait=True, cancel_futures=True)
        for e in entries:  # wake anyone still waiting on a window whose decoding was cancelled
            if not e.done.is_set():
                e.error = LoaderError(f"{self.spec.store.path}: the dataset was closed while decoding")
                e.done.set()


_DATASETS: "weakref.WeakSet[StoreDataset]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # a lock some parent thread held at fork time would stay locked forever in the child
    for ds in list(_DATASETS):
        ds._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class StoreDataset(keras.utils.PyDataset):
    """A store as a Keras ``PyDataset`` of (x, y) batches (x alone for unlabelled stores).

    Arguments as for :func:`carraystore.loader.batches` (``shuffle``, ``seed``, ``epoch``,
    ``window``, ``rank``, ``world_size``, ``drop_remainder``, ``transform``,
    ``label_mode``, ``sequence_length``, ...), plus ``cache_windows`` (decoded windows
    kept per process) and Keras's ``workers``, ``use_multiprocessing``,
    ``max_queue_size``. With ``use_multiprocessing=True`` every worker process decodes
    the windows it needs itself (up to ``workers`` times the decoding work); threads
    share one cache, and decompression runs without the GIL, so threads are the better
    choice.
    """

    def __init__(
        self,
        store_or_path: Any,
        batch_size: int,
        shuffle: Shuffle = "block",
        seed: int = 0,
        epoch: int = 0,
        window: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        drop_remainder: bool = False,
        transform: Transform | None = None,
        label_mode: str | None = "int",
        sequence_length: int | None = None,
        sequence_stride: int | None = None,
        groups: Any = None,
        verify: bool = False,
        num_threads: int | None = None,
        cache_windows: int = 3,
        workers: int = 1,
        use_multiprocessing: bool = False,
        max_queue_size: int = 10,
    ) -> None:
        super().__init__(workers=workers, use_multiprocessing=use_multiprocessing, max_queue_size=max_queue_size)
        self._spec = make_spec(
            store_or_path,
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
        if int(epoch) < 0:
            raise InvalidInputError(f"epoch must be >= 0, got {epoch}")
        self.epoch = int(epoch)
        self.cache_windows = int(cache_windows)
        self.num_threads = default_threads() if num_threads is None else int(num_threads)
        self._lock = threading.Lock()
        self._cache: _WindowCache | None = None
        self._pid = os.getpid()
        self._used = False
        self._decoded: dict[int, int] = {}
        _DATASETS.add(self)

    # -- description ---------------------------------------------------------------------------
    @property
    def store(self) -> Any:
        return self._spec.store

    @property
    def batch_size(self) -> int:
        return self._spec.batch_size

    @property
    def spec(self) -> LoaderSpec:
        return self._spec

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """The order of ``epoch`` (default: the current one)."""
        return self._spec.plan(self.epoch if epoch is None else epoch)

    @property
    def chunks_decoded(self) -> int:
        """Chunks this process decoded for the current epoch."""
        return self.decode_counts.get(self.epoch, 0)

    @property
    def decode_counts(self) -> dict[int, int]:
        """Epoch -> chunks this process decoded for it (an epoch has ``store.nchunks``)."""
        out = dict(self._decoded)
        c = self._cache
        if c is not None:
            out[c.epoch] = out.get(c.epoch, 0) + c.chunks_decoded
        return out

    def _retire(self, c: _WindowCache) -> None:
        c.close()
        self._decoded[c.epoch] = self._decoded.get(c.epoch, 0) + c.chunks_decoded

    def __len__(self) -> int:
        return self._spec.num_batches

    # -- batches ---------------------------------------------------------------------------------
    def _get_cache(self) -> _WindowCache:
        with self._lock:
            if self._pid != os.getpid():  # a forked worker: fresh file handle and cache
                from carraystore.store import open_store

                self._spec.store = open_store(self._spec.store.path)
                self._cache = None
                self._decoded = {}
                self._pid = os.getpid()
            c = self._cache
            if c is None or c.epoch != self.epoch:
                if c is not None:
                    self._retire(c)
                c = self._cache = _WindowCache(self._spec, self.epoch, self.cache_windows, self.num_threads)
            return c

    def __getitem__(self, index: int) -> Any:
        n = len(self)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"batch {index} out of range for an epoch of {n} batches")
        x, y = self._get_cache().batch(i)
        return x if y is None else (x, y)

    # -- epochs ----------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Serve ``epoch`` from now on (a new order)."""
        if int(epoch) < 0:
            raise InvalidInputError(f"epoch must be >= 0, got {epoch}")
        with self._lock:
            self.epoch = int(epoch)
            self._used = False

    def on_epoch_begin(self) -> None:
        """Keras calls this before each epoch; the epoch in use is ``self.epoch``."""
        self._used = True

    def on_epoch_end(self) -> None:
        """Keras calls this after each epoch: free the cache and move to the next epoch.

        Only an epoch opened by ``on_epoch_begin`` moves on: Keras also calls
        ``on_epoch_end`` once when ``fit``/``evaluate`` start, and that must not skip an
        epoch. (The jax backend's first ``fit`` opens one epoch to build the model on a
        batch; that uses up one epoch number.) Outside Keras, call ``set_epoch`` (or
        ``on_epoch_begin``/``on_epoch_end``).
        """
        self.close()
        with self._lock:
            if self._used:
                self.epoch += 1
                self._used = False

    def close(self) -> None:
        """Free the decoded windows and end the decoder threads (they restart on demand)."""
        with self._lock:
            c, self._cache = self._cache, None
            if c is not None and self._pid == os.getpid():
                self._retire(c)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # -- pickling (use_multiprocessing with spawn/forkserver) ------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = None
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._cache = None
        self._decoded = {}
        self._pid = os.getpid()
        _DATASETS.add(self)

    def __repr__(self) -> str:
        s = self._spec
        return (
            f"<carraystore.keras.StoreDataset {str(s.store.path)!r} batch_size={s.batch_size} "
            f"shuffle={s.shuffle!r} epoch={self.epoch} batches={len(self)}>"
        )
