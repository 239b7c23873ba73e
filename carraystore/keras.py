"""Keras 3: a store as a ``keras.utils.PyDataset``.

    model.fit(StoreDataset("train.b2nd", 32), epochs=10, shuffle=False,
              validation_data=StoreDataset("val.b2nd", 32, shuffle=False))

Batch ``i`` depends only on (arguments, epoch, i), so Keras may ask for batches from any thread
or process in any order; in order, each chunk decodes once per epoch. The dataset shuffles
itself: pass ``fit(shuffle=False)`` (it warns otherwise). :class:`TrainingPosition` records
where a ``fit`` is (docs/loading.md, Resuming). Only ``keras`` is imported, never ``tensorflow``.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any

import keras

from carraystore.base.atomic import write_text_atomically
from carraystore.base.errors import InvalidInputError
from carraystore.base.forksafe import at_fork_in_child
from carraystore.engine.options import LoaderOptions
from carraystore.engine.pipeline import MemoryPlan
from carraystore.engine.random_access import ProcessSpec, WindowCache, batch_index
from carraystore.engine.sampling import EpochPlan
from carraystore.engine.spec import LoaderSpec, make_spec

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from carraystore.engine.options import LoaderKwargs

__all__ = ["StoreDataset", "TrainingPosition", "KERAS_THREAD_PREFIX"]

#: Name prefix of the decoder threads a StoreDataset starts.
KERAS_THREAD_PREFIX = "carraystore-keras"


_DATASETS: weakref.WeakSet[StoreDataset] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # a lock some parent thread held at fork time would stay locked forever in the child
    for ds in list(_DATASETS):
        ds._lock = threading.Lock()


at_fork_in_child(_after_fork_in_child)


class StoreDataset(keras.utils.PyDataset):  # type: ignore[misc]  # keras ships no type information
    """A store as a Keras ``PyDataset`` of (x, y) batches (x alone for unlabelled stores).

    Takes every :class:`~carraystore.engine.options.LoaderOptions` field, as keywords or one
    ``options`` value, plus ``cache_windows`` (decoded windows kept per process) and Keras's
    ``workers``, ``use_multiprocessing``, ``max_queue_size`` (the default ``queue_size``).
    ``start_batch=b`` makes the first epoch ``num_batches - b`` long. The cache holds
    ``max(cache_windows * window chunks, window chunks + prefetch)`` chunks.

    Prefer threads: they share one cache and decompression releases the GIL, while each
    process of ``use_multiprocessing=True`` decodes the windows it needs itself.
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
        max_queue_size: int | None = None,
        **kwargs: Unpack[LoaderKwargs],
    ) -> None:
        spec = make_spec(store_or_path, batch_size, options, **kwargs)
        if max_queue_size is None:
            max_queue_size = spec.options.queue_size if "queue_size" in kwargs else 10
        super().__init__(workers=workers, use_multiprocessing=use_multiprocessing, max_queue_size=max_queue_size)
        self._source = ProcessSpec(spec)
        self.epoch = spec.options.epoch
        nb = self.spec.epoch_batches(self.epoch)
        #: (epoch, first batch) while the first epoch is being resumed at start_batch, else None
        self._resume: tuple[int, int] | None = None
        sb = self.spec.options.start_batch
        if sb > nb:
            raise InvalidInputError(f"start_batch {sb} is past the epoch's {nb} batches")
        if sb:
            self._resume = (self.epoch, sb)
        #: the length of the resumed epoch once it is over (TrainingPosition catches a fit going on with it)
        self._resumed_len: int | None = None
        self._windows = WindowCache(cache_windows, KERAS_THREAD_PREFIX, "StoreDataset", warn=True)
        self._lock = threading.Lock()
        self._used = False
        _DATASETS.add(self)

    # -- description ---------------------------------------------------------------------------
    @property
    def store(self) -> Any:
        return self.spec.store

    @property
    def batch_size(self) -> int:
        return self.spec.batch_size

    @property
    def spec(self) -> LoaderSpec:
        """The options resolved against the store (opened again in each new process)."""
        return self._source.get()

    def plan(self, epoch: int | None = None) -> EpochPlan:
        """The order of ``epoch`` (default: the current one)."""
        return self.spec.plan(self.epoch if epoch is None else epoch)

    @property
    def chunks_decoded(self) -> int:
        """Chunks this process decoded for the current epoch."""
        return self.decode_counts.get(self.epoch, 0)

    @property
    def decode_counts(self) -> dict[int, int]:
        """Epoch -> chunks this process decoded for it (an epoch has ``store.nchunks``)."""
        return self._windows.decode_counts

    @property
    def cache_windows(self) -> int:
        return self._windows.cache_windows

    @property
    def memory(self) -> MemoryPlan | None:
        """The decoder's slots and buffers, once it started."""
        return self._windows.memory

    @property
    def first_batch(self) -> int:
        """The epoch's batch that ``self[0]`` serves: ``start_batch`` while resuming, else 0."""
        r = self._resume
        return r[1] if r is not None and r[0] == self.epoch else 0

    def __len__(self) -> int:
        return self.spec.epoch_batches(self.epoch) - self.first_batch

    def state_dict(self, batch: int) -> dict[str, Any]:
        """The resume state when ``batch`` (counted as ``TrainingPosition.position`` counts) is next."""
        return self.spec.state_dict(self.epoch, batch)

    # -- batches ---------------------------------------------------------------------------------
    def __getitem__(self, index: int) -> Any:
        i = batch_index(index, len(self))
        out = self._windows.batch(self.spec, self.epoch, i + self.first_batch)
        return out[0] if out[1] is None else out

    # -- epochs ----------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Serve ``epoch`` from now on; the resumed epoch is always served from where it stopped."""
        if int(epoch) < 0:
            raise InvalidInputError(f"epoch must be >= 0, got {epoch}")
        with self._lock:
            self.epoch = int(epoch)
            self._used = False
            self._resumed_len = None

    def on_epoch_begin(self) -> None:
        """Keras calls this before each epoch; the epoch in use is ``self.epoch``."""
        self._used = True

    def on_epoch_end(self) -> None:
        """Keras calls this after each epoch: free the cache and move to the next epoch.

        Only an epoch opened by ``on_epoch_begin`` moves on: Keras also calls this once when
        ``fit``/``evaluate``/``predict`` start (the jax backend's first ``fit`` uses up one epoch
        number building the model). Outside Keras, call ``set_epoch``.
        """
        with self._lock:
            if not self._used:
                return  # the same epoch goes on: batches already decoded stay valid
            if self._resume is not None and self._resume[0] == self.epoch:
                self._resumed_len = self.spec.num_batches - self._resume[1]
            elif self.spec.resumes_epoch(self.epoch):
                self._resumed_len = self.spec.epoch_batches(self.epoch)
            else:
                self._resumed_len = None
            self.epoch += 1
            self._used = False
            self._resume = None
        self.close()

    def close(self) -> None:
        """Free the decoded windows and end the decoder threads (they restart on demand)."""
        self._windows.close()

    # -- pickling (use_multiprocessing with spawn/forkserver) ------------------------------
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        _DATASETS.add(self)

    def __repr__(self) -> str:
        s = self.spec
        return (
            f"<carraystore.keras.StoreDataset {str(s.store.path)!r} batch_size={s.batch_size} "
            f"shuffle={s.shuffle!r} epoch={self.epoch} batches={len(self)}>"
        )


class TrainingPosition(keras.callbacks.Callback):  # type: ignore[misc]  # keras ships no type information
    """Records where a ``model.fit`` over a :class:`StoreDataset` is: (epoch, next batch) and the resume state.

    ``position`` is (epoch, next batch), batches counted from the epoch's start or from the
    resumed point; after an epoch's last batch it is (epoch + 1, 0). ``state`` is the same place
    as a resume state, for ``resume=`` of any loader at any world size. With ``path`` both are
    written there atomically as JSON every ``every`` batches and at each epoch's end::

        state = TrainingPosition.load_state("pos.json")     # None: from the start
        ds = StoreDataset("train.b2nd", 32, resume=state)
        model.fit(ds, initial_epoch=ds.epoch, epochs=10, shuffle=False,
                  callbacks=[TrainingPosition(ds, "pos.json")])

    ``load(path)`` gives (epoch, batch) for ``epoch=, start_batch=`` (same world size only).
    Use ``fit(initial_epoch=ds.epoch)``. A fit going on past a resumed epoch (Keras would keep
    its shorter length, losing batches) raises, saying what to do.
    """

    def __init__(self, dataset: StoreDataset, path: str | os.PathLike[str] | None = None, every: int = 1) -> None:
        super().__init__()
        if not isinstance(dataset, StoreDataset):
            raise InvalidInputError(f"TrainingPosition follows a StoreDataset, got {type(dataset).__name__}")
        self.dataset = dataset
        self.path = None if path is None else Path(path)
        self.every = int(every)
        if self.every < 1:
            raise InvalidInputError(f"every must be >= 1, got {every}")
        self.position: tuple[int, int] = (dataset.epoch, dataset.first_batch)
        self._first = dataset.first_batch
        self._epoch = dataset.epoch
        self._end = dataset.first_batch + len(dataset)
        self._count = 0

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        ds = self.dataset
        steps = (self.params or {}).get("steps")
        if ds._resumed_len is not None and steps == ds._resumed_len and steps < len(ds):
            # one fit keeps its first epoch's step count: this whole epoch would lose its first batches
            raise InvalidInputError(
                f"{ds.store.location}: this fit would run epoch {ds.epoch} for {steps} of its {len(ds)} batches, the "
                "length of the resumed epoch before it (Keras keeps one step count per fit). Fit the resumed epoch on "
                "its own (initial_epoch=e, epochs=e + 1), then fit the whole epochs (docs/loading.md, Resuming)"
            )
        self._epoch = ds.epoch
        self._first = ds.first_batch
        self._end = ds.first_batch + len(ds)
        self.position = (self._epoch, self._first)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.position = (self._epoch, self._first + int(batch) + 1)
        self._count += 1
        if self.path is not None and self._count % self.every == 0:
            self.save()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if self.position[1] >= self._end:  # not after a fit stopped inside the epoch (stop_training)
            self.position = (self._epoch + 1, 0)
        if self.path is not None:
            self.save()

    @property
    def state(self) -> dict[str, Any]:
        """``position`` as a resume state: ``StoreDataset(..., resume=state)`` continues there, at any world size."""
        return self.dataset.spec.state_dict(*self.position)

    def save(self) -> None:
        """Write the position and the state to ``path``: a temporary file, fsynced and renamed over it."""
        assert self.path is not None
        epoch, batch = self.position
        # a batch index of an epoch resumed from a state counts from the resumed point: no start_batch
        shown = None if self.dataset.spec.resumes_epoch(epoch) else batch
        write_text_atomically(self.path, json.dumps({"epoch": epoch, "batch": shown, "state": self.state}))

    @staticmethod
    def load(path: str | os.PathLike[str]) -> tuple[int, int]:
        """(epoch, batch) from a file ``save`` wrote, for ``epoch=, start_batch=``; (0, 0) when there is none yet."""
        p = Path(path)
        if not p.exists():
            return (0, 0)
        rec = json.loads(p.read_text())
        if rec.get("batch") is None:
            raise InvalidInputError(
                f"{p}: this position is inside an epoch that was itself resumed from a state, so it has no "
                "start_batch; resume with StoreDataset(..., resume=TrainingPosition.load_state(path))"
            )
        return int(rec["epoch"]), int(rec["batch"])

    @staticmethod
    def load_state(path: str | os.PathLike[str]) -> dict[str, Any] | None:
        """The resume state from a file ``save`` wrote (``resume=`` of any loader); None when there is none yet."""
        p = Path(path)
        if not p.exists():
            return None
        rec = json.loads(p.read_text())
        if "state" not in rec:
            raise InvalidInputError(
                f"{p} was written by an older carraystore (epoch and batch only); resume with "
                "StoreDataset(..., epoch=e, start_batch=b) from TrainingPosition.load(path)"
            )
        state: dict[str, Any] = rec["state"]
        return state
