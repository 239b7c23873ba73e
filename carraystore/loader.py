"""Streaming (x, y) batches out of a store: ``batches(store, batch_size, ...)`` (also ``Store.batches``).

A thin adapter over the decoding engine (:mod:`carraystore.engine`): an assembler thread
asks the engine for batch after batch, in order, writes each into a reused buffer and
puts finished batches into a small bounded queue; the consumer only takes batches off
that queue. The arguments are :class:`carraystore.engine.LoaderOptions`.

Memory: the slot pool holds ``max chunks of a window + prefetch`` decoded chunks (by
default ``2 * window``), plus ``queue_size + 3`` batches (docs/loading.md). Nothing is
reallocated per chunk. ``shuffle="global"`` needs the whole shard decoded at once (one
window). When an epoch ends its pool is kept for the next epoch on the same Store object;
``release_buffers()`` or dropping the Store frees it.

Stopping: ``close()``, leaving a ``with`` block, breaking out of a ``for`` loop (the
iterator is then garbage-collected), an error in a thread, and interpreter exit all stop
the threads and join them.
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from carraystore.engine import (
    DEFAULT_WINDOW,
    Batch,
    BatchBuffers,
    EpochDecoder,
    LoaderClosed,
    LoaderKwargs,
    LoaderOptions,
    LoaderSpec,
    Transform,
    default_threads,
    gather,
    make_spec,
    release_buffers,
    stop_all,
)
from carraystore.errors import InvalidInputError, LoaderError
from carraystore.sampling import EpochPlan
from carraystore.shuffle_report import ShuffleReport, report_for_order, store_groups

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

_END = object()


class _Stream:
    """The assembler thread and its queue. It never references the BatchIterator, so the
    consumer dropping the iterator garbage-collects it and stops the threads."""

    def __init__(self, spec: LoaderSpec, epoch: int, start_batch: int) -> None:
        opts = spec.options
        self.spec = spec
        self.epoch = epoch
        self.start_batch = start_batch
        self.nbatches = spec.num_batches
        plan_chunks = spec.plan(epoch).max_window_chunks
        self.decoder = EpochDecoder(
            spec, epoch, plan_chunks + int(opts.prefetch or 0), int(opts.num_threads or 1), THREAD_NAME_PREFIX
        )
        self.out: queue.Queue[Any] = queue.Queue(maxsize=opts.queue_size)
        self.stopped = False
        self.assembler = threading.Thread(
            target=self._assemble_loop, name=f"{THREAD_NAME_PREFIX}-{id(self):x}-assemble", daemon=True
        )
        self.assembler.start()

    def _put(self, item: Any) -> bool:
        while not self.stopped:
            try:
                self.out.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _assemble_loop(self) -> None:
        spec, dec = self.spec, self.decoder
        pool = BatchBuffers(self.out.maxsize + 3)
        dtype = spec.store.dtype
        try:
            dec.read_ahead(dec.plan.window_of(self.start_batch * spec.batch_size) if self.nbatches else 0)
            for bi in range(self.start_batch, self.nbatches):
                a, b = spec.batch_bounds(dec.plan, bi)
                out = dec.batch(bi, pool.get(spec.x_shape(b - a), dtype))
                del a, b
                if not self._put(out):
                    return
                del out
            self._put(_END)
        except LoaderClosed:
            return
        except BaseException as exc:
            if self.stopped:
                return
            if not isinstance(exc, LoaderError):
                err = LoaderError(f"{spec.store.location}: loader failed: {type(exc).__name__}: {exc}")
                err.__cause__ = exc
                exc = err
            self._put(exc)

    def stop(self) -> None:
        """Stop and join every thread (idempotent; safe from any thread)."""
        if self.decoder.pid != os.getpid():
            return
        self.stopped = True
        self.decoder.close()
        if self.assembler is not threading.current_thread() and self.assembler.is_alive():
            self.assembler.join(timeout=30)
        try:
            while True:
                self.out.get_nowait()
        except queue.Empty:
            pass


atexit.register(stop_all)


class BatchIterator:
    """Iterator of (x, y) numpy batches; returned by :func:`batches`.

    ``len()`` is the number of batches still to come; ``position`` is (epoch, next batch),
    which ``batches(..., epoch=, start_batch=)`` resumes from. Use ``close()`` or a ``with``
    block to stop the threads early (dropping the iterator does it too).
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
        """(epoch, index of the next batch): pass them as ``epoch=``, ``start_batch=`` to resume."""
        return self._s.epoch, self._next

    @property
    def pool_chunks(self) -> int:
        """Decoded chunk buffers the loader holds (window + prefetch, at most)."""
        return self._s.decoder.nslots

    @property
    def chunks_decoded(self) -> int:
        return self._s.decoder.chunks_decoded

    @property
    def threads(self) -> list[threading.Thread]:
        return [*self._s.decoder.threads, self._s.assembler]

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
        s = self._s
        while True:
            try:
                item = s.out.get(timeout=0.5)
                break
            except queue.Empty:
                if not s.assembler.is_alive() and s.out.empty():
                    self.close()
                    raise LoaderError(f"{s.spec.store.location}: the loader thread ended without a result") from None
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
            f"<carraystore.loader.BatchIterator epoch={self._s.epoch} next_batch={self._next} "
            f"of {self._s.nbatches} pool_chunks={self.pool_chunks}>"
        )


def batches(
    store: Any, batch_size: int, options: LoaderOptions | None = None, **kwargs: Unpack[LoaderKwargs]
) -> BatchIterator:
    """Iterate one epoch of (x, y) numpy batches from ``store`` (a Store, a path or a URL).

    The arguments are the fields of :class:`carraystore.engine.LoaderOptions`, documented
    there once, as keywords or as one ``options`` value.
    """
    return iterate(make_spec(store, batch_size, options, **kwargs))


def iterate(spec: LoaderSpec, epoch: int | None = None, start_batch: int | None = None) -> BatchIterator:
    """Start the loader threads for one epoch of an already resolved :class:`LoaderSpec`."""
    opts = spec.options
    epoch = opts.epoch if epoch is None else LoaderOptions(epoch=epoch).epoch
    start_batch = opts.start_batch if start_batch is None else LoaderOptions(start_batch=start_batch).start_batch
    nb = spec.num_batches
    if start_batch > nb:
        raise InvalidInputError(f"start_batch {start_batch} is past the epoch's {nb} batches")
    return BatchIterator(_Stream(spec, epoch, start_batch))
