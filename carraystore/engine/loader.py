"""Streaming (x, y) batches out of a store: ``batches(store, batch_size, ...)`` (also ``Store.batches``).

Arguments: :class:`carraystore.engine.options.LoaderOptions`. Holds ``window + prefetch``
decoded chunks and ``queue_size + assemblers + 2`` batches within ``memory_budget``
(docs/loading.md), the pool kept for the next epoch (of a store of that geometry) until ``release_buffers()``.
``close()``, leaving ``with``, dropping the iterator, an error or interpreter exit stop the threads.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from carraystore.base.errors import InvalidInputError
from carraystore.engine.decoder import (
    EpochDecoder,
    gather,
    give_back_batch_buffers,
    release_buffers,
    stop_all,
    take_batch_buffers,
)
from carraystore.engine.options import DEFAULT_WINDOW, Batch, LoaderKwargs, LoaderOptions, Transform, default_threads
from carraystore.engine.pipeline import MemoryPlan, OrderedBatches, assemblers_for, plan_memory
from carraystore.engine.sampling import EpochPlan
from carraystore.engine.shuffle_report import ShuffleReport, report_for_order, store_groups
from carraystore.engine.spec import LoaderSpec, make_spec

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "batches",
    "iterate",
    "release_buffers",
    "BatchIterator",
    "LoaderOptions",
    "LoaderSpec",
    "Transform",
    "make_spec",
    "gather",
    "default_threads",
    "DEFAULT_WINDOW",
    "THREAD_NAME_PREFIX",
]

#: Every loader thread's name starts with this (tests and debuggers look for it).
THREAD_NAME_PREFIX = "carraystore-loader"


class _Stream:
    """The threads and decoder; never references the BatchIterator, so dropping it stops them."""

    def __init__(self, spec: LoaderSpec, epoch: int, start_batch: int) -> None:
        opts = spec.options
        self.spec = spec
        self.epoch = epoch
        self.start_batch = start_batch
        self.nbatches = spec.epoch_batches(epoch)
        plan = spec.plan(epoch)
        window = plan.max_window_chunks
        # buffers: the queue, one per assembler, the batch the consumer holds and one spare
        self.memory = plan_memory(spec, plan, window + int(opts.prefetch or 0), 2, assemblers_for(spec), "batches()")
        self.decoder = EpochDecoder(
            spec, epoch, self.memory.slots, int(opts.num_threads or 1), THREAD_NAME_PREFIX, plan=plan
        )
        self.pool = take_batch_buffers(spec.store, self.memory.batch_buffers)
        dtype = spec.store.dtype

        def buffer(i: int) -> tuple[np.ndarray, None]:
            a, b = spec.batch_bounds(plan, i)
            return self.pool.get(spec.x_shape(b - a), dtype), None

        if self.nbatches:
            self.decoder.read_ahead(plan.window_of(start_batch * spec.batch_size) if start_batch < self.nbatches else 0)
        self.batches = OrderedBatches(
            self.decoder,
            range(start_batch, self.nbatches),
            buffer,
            opts.queue_size,
            self.memory.assemblers,
            THREAD_NAME_PREFIX,
        )

    def stop(self) -> None:
        """Stop and join every thread (idempotent; safe from any thread)."""
        if self.decoder.pid != os.getpid():
            return
        self.batches.stop()
        if not any(t.is_alive() for t in self.batches.threads):
            give_back_batch_buffers(self.spec.store, self.pool)


atexit.register(stop_all)


class BatchIterator:
    """Iterator of (x, y) numpy batches; returned by :func:`batches`.

    ``len()``: batches still to come. Stop early with ``close()`` or ``with`` (or by dropping it).
    """

    def __init__(self, stream: _Stream) -> None:
        self._s = stream
        self._next = stream.start_batch
        self._closed = False
        self._finalizer = weakref.finalize(self, stream.stop)

    # -- description ---------------------------------------------------------------------
    @property
    def plan(self) -> EpochPlan:
        """This rank's order for the epoch; batch ``i`` holds ``plan.samples(i*B, (i+1)*B)``."""
        return self._s.decoder.plan

    @property
    def epoch(self) -> int:
        return self._s.epoch

    @property
    def num_batches(self) -> int:
        """Batches in the whole epoch (for this rank)."""
        return self._s.nbatches

    @property
    def position(self) -> tuple[int, int]:
        """(epoch, next batch) for ``epoch=``, ``start_batch=`` (same world size; after ``resume=``, use state_dict)."""
        return self._s.epoch, self._next

    def state_dict(self) -> dict[str, Any]:
        """Where this rank is: pass it as ``resume=`` to any loader, at any world size (:mod:`carraystore.engine.resume`)."""
        return self._s.spec.state_dict(self._s.epoch, self._next)

    @property
    def pool_chunks(self) -> int:
        """Decoded chunk buffers the loader holds (window + prefetch, at most)."""
        return self._s.decoder.nslots

    @property
    def chunks_decoded(self) -> int:
        return self._s.decoder.chunks_decoded

    @property
    def threads(self) -> list[threading.Thread]:
        return [*self._s.decoder.threads, *self._s.batches.threads]

    @property
    def memory(self) -> MemoryPlan:
        """What this loader holds at most (slots, batch buffers, remote read-ahead) and its budget."""
        return self._s.memory

    def __len__(self) -> int:
        return max(0, self._s.nbatches - self._next)

    def shuffle_report(self) -> ShuffleReport:
        """How well this epoch's order (this rank's) is mixed, against a global shuffle (docs/loading.md)."""
        spec = self._s.spec
        groups = spec.options.groups if spec.options.groups is not None else store_groups(spec.store)
        return report_for_order(
            self.plan.items,
            spec.batch_size,
            labels=spec.store.labels,
            groups=groups,
            chunk_size=spec.store.chunk_images,
            shuffle=spec.shuffle,
            window=spec.window,
            seed=spec.seed,
            epoch=self.epoch,
        )

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._closed:
            raise StopIteration
        try:
            item, _ = self._s.batches.next()
        except BaseException:  # the end (StopIteration) or a failed batch
            self.close()
            raise
        self._next += 1
        return item

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
            f"<carraystore.engine.loader.BatchIterator epoch={self._s.epoch} next_batch={self._next} "
            f"of {self._s.nbatches} pool_chunks={self.pool_chunks}>"
        )


def batches(
    store: Any, batch_size: int, options: LoaderOptions | None = None, **kwargs: Unpack[LoaderKwargs]
) -> BatchIterator:
    """Iterate one epoch of (x, y) numpy batches from ``store`` (a Store, a path or a URL).

    Arguments: :class:`carraystore.engine.options.LoaderOptions`, as keywords or ``options``.
    """
    return iterate(make_spec(store, batch_size, options, **kwargs))


def iterate(spec: LoaderSpec, epoch: int | None = None, start_batch: int | None = None) -> BatchIterator:
    """Start the loader threads for one epoch of an already resolved :class:`LoaderSpec`."""
    opts = spec.options
    epoch = opts.epoch if epoch is None else LoaderOptions(epoch=epoch).epoch
    start_batch = opts.start_batch if start_batch is None else LoaderOptions(start_batch=start_batch).start_batch
    nb = spec.epoch_batches(epoch)
    if start_batch > nb:
        raise InvalidInputError(f"start_batch {start_batch} is past the epoch's {nb} batches")
    return BatchIterator(_Stream(spec, epoch, start_batch))
