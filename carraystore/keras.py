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
import weakref
from typing import Any

import keras

from carraystore.engine import EpochDecoder, LoaderOptions, LoaderSpec, make_spec, warn_out_of_order
from carraystore.errors import InvalidInputError
from carraystore.forksafe import at_fork_in_child
from carraystore.reader import open_store
from carraystore.sampling import EpochPlan

__all__ = ["StoreDataset", "KERAS_THREAD_PREFIX"]

#: Name prefix of the decoder threads a StoreDataset starts.
KERAS_THREAD_PREFIX = "carraystore-keras"


_DATASETS: "weakref.WeakSet[StoreDataset]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # a lock some parent thread held at fork time would stay locked forever in the child
    for ds in list(_DATASETS):
        ds._lock = threading.Lock()


at_fork_in_child(_after_fork_in_child)


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
        options: LoaderOptions | None = None,
        *,
        cache_windows: int = 3,
        workers: int = 1,
        use_multiprocessing: bool = False,
        max_queue_size: int = 10,
        **kwargs: Any,
    ) -> None:
        super().__init__(workers=workers, use_multiprocessing=use_multiprocessing, max_queue_size=max_queue_size)
        self._spec = make_spec(store_or_path, batch_size, options, **kwargs)
        self.epoch = self._spec.options.epoch
        self.cache_windows = int(cache_windows)
        if self.cache_windows < 1:
            raise InvalidInputError(f"cache_windows must be >= 1, got {cache_windows}")
        self.num_threads = int(self._spec.options.num_threads or 1)
        self._lock = threading.Lock()
        self._cache: EpochDecoder | None = None
        self._warned = False
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

    def _retire(self, c: EpochDecoder) -> None:
        c.close()
        self._decoded[c.epoch] = self._decoded.get(c.epoch, 0) + c.chunks_decoded

    def __len__(self) -> int:
        return self._spec.num_batches

    # -- batches ---------------------------------------------------------------------------------
    def _get_cache(self) -> EpochDecoder:
        with self._lock:
            if self._pid != os.getpid():  # a forked worker: fresh file handle and cache
                store = self._spec.store
                self._spec.store = open_store(store.location, store.storage_options or None)
                self._cache = None
                self._decoded = {}
                self._pid = os.getpid()
            c = self._cache
            if c is None or c.epoch != self.epoch:
                if c is not None:
                    self._retire(c)
                nslots = self.cache_windows * self._spec.plan(self.epoch).max_window_chunks
                c = self._cache = EpochDecoder(self._spec, self.epoch, nslots, self.num_threads, KERAS_THREAD_PREFIX)
            return c

    def __getitem__(self, index: int) -> Any:
        n = len(self)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"batch {index} out of range for an epoch of {n} batches")
        c = self._get_cache()
        x, y = c.batch(i)
        if c.out_of_order and not self._warned:
            self._warned = True
            warn_out_of_order(c, "StoreDataset")
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

        Only an epoch opened by ``on_epoch_begin`` moves on (and frees its cache): Keras
        also calls ``on_epoch_end`` once when ``fit``/``evaluate``/``predict`` start, and
        that must neither skip an epoch nor throw away windows its workers decoded. (The jax backend's first ``fit`` opens one epoch to build the model on a
        batch; that uses up one epoch number.) Outside Keras, call ``set_epoch`` (or
        ``on_epoch_begin``/``on_epoch_end``).
        """
        with self._lock:
            if not self._used:
                return  # the same epoch goes on: batches already decoded stay valid
            self.epoch += 1
            self._used = False
        self.close()

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
