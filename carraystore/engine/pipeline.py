"""Several batches in flight, handed out in order, inside a memory budget (layer 4).

:class:`OrderedBatches`: several threads assemble batches, so no single thread copies every
batch; the consumer takes them in index order. :func:`plan_memory` sizes slots and buffers to
``LoaderOptions.memory_budget`` before anything is allocated.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from carraystore.base.errors import InvalidInputError, LoaderError
from carraystore.base.resources import format_bytes
from carraystore.engine.decoder import EpochDecoder, LoaderClosed, decodes_direct
from carraystore.engine.sampling import EpochPlan
from carraystore.engine.spec import LoaderSpec
from carraystore.format.frame import ReadAheadSource

__all__ = ["MemoryPlan", "plan_memory", "assemblers_for", "chunks_in_flight", "OrderedBatches"]

#: most assembler threads per loader (each copies a batch at memory speed; more only contend)
MAX_ASSEMBLERS = 4


def assemblers_for(spec: LoaderSpec) -> int:
    """One assembler per four decoder threads (at most :data:`MAX_ASSEMBLERS`); one with a ``transform``.

    In direct mode (images decompressed straight into their batch) one per thread: each makes
    whole batches, so one's bookkeeping (holding the GIL) overlaps another's decompression.
    """
    opts = spec.options
    if opts.transform is not None:
        return 1
    threads = int(opts.num_threads or 1)
    if decodes_direct(spec, threads):
        return max(1, min(MAX_ASSEMBLERS, threads))
    return max(1, min(MAX_ASSEMBLERS, math.ceil(threads / 4)))


@dataclass(frozen=True)
class MemoryPlan:
    """What a loader holds, decided before it allocates: ``held <= budget`` always."""

    #: ``LoaderOptions.memory_budget``, bytes
    budget: int
    #: chunk slots (the current window, the next windows decoded ahead)
    slots: int
    #: bytes of one slot (a full-size decoded chunk, also with ``image_size``)
    slot_bytes: int
    #: batch buffers the loader keeps (finished, under way, reused)
    batch_buffers: int
    #: bytes of one batch's x
    batch_bytes: int
    #: bytes a remote source may fetch ahead of the decoder (its ``readahead_bytes``)
    source_bytes: int
    #: batches assembled at once
    assemblers: int

    @property
    def held(self) -> int:
        """The most the loader holds, bytes."""
        return self.slots * self.slot_bytes + self.batch_buffers * self.batch_bytes + self.source_bytes

    def describe(self) -> str:
        return (
            f"{self.slots} chunk slots of {format_bytes(self.slot_bytes)}, {self.batch_buffers} batch buffers of "
            f"{format_bytes(self.batch_bytes)}"
            + (f", {format_bytes(self.source_bytes)} of remote read-ahead" if self.source_bytes else "")
            + f": {format_bytes(self.held)} of a {format_bytes(self.budget)} budget"
        )


def _batch_bytes(spec: LoaderSpec) -> int:
    frames = int(spec.options.sequence_length or 1)
    return max(1, spec.batch_size * frames * spec.item_nbytes)  # image_size= applied


def _source_bytes(spec: LoaderSpec) -> int:
    src = spec.store.source
    return src.readahead_bytes if isinstance(src, ReadAheadSource) else 0


def chunks_in_flight(plan: EpochPlan, batch_size: int, batches: int) -> int:
    """The most chunks ``batches`` consecutive batches of ``plan`` may pin together."""
    n = len(plan.items)
    if n == 0 or plan.nwindows == 0:
        return 1
    starts = np.arange(0, n, batch_size, dtype=np.int64)
    ends = np.minimum(starts + batches * batch_size, n) - 1
    ws = np.asarray(plan.window_starts, dtype=np.int64)
    first = np.searchsorted(ws, starts, side="right") - 1
    last = np.searchsorted(ws, ends, side="right") - 1
    sizes = np.array([len(c) for c in plan.window_chunks], dtype=np.int64)
    cum = np.concatenate([[0], np.cumsum(sizes)])
    return max(1, int((cum[last + 1] - cum[first]).max()))


def plan_memory(
    spec: LoaderSpec,
    plan: EpochPlan,
    want_slots: int,
    spare_buffers: int,
    assemblers: int = 1,
    what: str = "the loader",
) -> MemoryPlan:
    """Slots and batch buffers shrunk to fit ``memory_budget`` (first spare slots, then
    assemblers); InvalidInputError when one window and the queue cannot fit."""
    opts = spec.options
    budget = int(opts.memory_budget or 0)
    slot = max(1, spec.store.chunk_images * int(spec.store.meta.image_nbytes))
    batch = _batch_bytes(spec)
    source = _source_bytes(spec)
    queue_size = int(opts.queue_size)
    need = max(1, plan.max_window_chunks)

    def make(slots: int, a: int) -> MemoryPlan:
        return MemoryPlan(budget, slots, slot, queue_size + a + spare_buffers, batch, source, a)

    smallest = make(need, 1)
    if smallest.held > budget:
        raise InvalidInputError(
            f"{spec.store.location}: memory_budget={format_bytes(budget)} is too small for {what}: one window of "
            f"{need} chunks ({format_bytes(need * slot)}) and {smallest.batch_buffers} batches of "
            f"{format_bytes(batch)} need {format_bytes(smallest.held)}"
            + (f" (with {format_bytes(source)} of remote read-ahead)" if source else "")
            + "; raise memory_budget, or lower window= (chunks per window), batch_size or queue_size"
        )
    if assemblers > 1:
        # fewer slots would evict windows whose batches are still to come
        floor = min(plan.total_chunks, chunks_in_flight(plan, spec.batch_size, assemblers) + need)
        fit = (budget - make(0, assemblers).held) // slot
        if fit >= floor:
            return make(int(min(max(floor, want_slots), fit, plan.total_chunks)), assemblers)
    fit = (budget - make(0, 1).held) // slot  # at least one window: ``smallest`` fits
    return make(int(min(max(need, want_slots), fit, plan.total_chunks)), 1)


class OrderedBatches:
    """Batches ``indices`` of ``decoder``'s epoch, assembled by threads, returned in order by :meth:`next`.

    ``make_buffer(i)`` (called under a lock) gives batch ``i``'s x array and an extra value.
    A thread's error ends the stream, raised as :class:`LoaderError` at that batch.
    """

    def __init__(
        self,
        decoder: EpochDecoder,
        indices: Sequence[int],
        make_buffer: Callable[[int], tuple[np.ndarray, Any]],
        depth: int,
        assemblers: int,
        thread_prefix: str,
    ) -> None:
        self.decoder = decoder
        self.indices = indices
        self.make_buffer = make_buffer
        self.depth = max(1, int(depth))
        lock = threading.RLock()  # (a Condition's default: owner checks in C)
        #: the consumer waits on it for the batch it is to return; ``_room`` (the same lock): the
        #: assemblers wait for room; each side wakes only the other, and only when it can go on
        self.cond = threading.Condition(lock)
        self._room = threading.Condition(lock)
        self.taken = 0  # positions handed to assemblers
        self.given = 0  # positions returned to the consumer
        self.ready: dict[int, Any] = {}
        self.stopped = False
        self._buffer_lock = threading.Lock()
        self.threads = [
            threading.Thread(target=self._loop, name=f"{thread_prefix}-{id(self):x}-assemble{i}", daemon=True)
            for i in range(max(1, int(assemblers)))
        ]
        for t in self.threads:
            t.start()

    def _loop(self) -> None:
        n = len(self.indices)
        limit = self.depth + len(self.threads)
        while True:
            with self.cond:
                while not self.stopped and self.taken < n and self.taken - self.given >= limit:
                    self._room.wait()
                if self.stopped or self.taken >= n:
                    return
                pos = self.taken
                self.taken += 1
                i = self.indices[pos]
                # under the lock: a later batch must not evict this one's windows
                self.decoder.claim(i)
            item: Any
            try:
                try:
                    with self._buffer_lock:
                        out, extra = self.make_buffer(i)
                except BaseException:
                    self.decoder.unclaim(i)
                    raise
                item = (self.decoder.batch(i, out), extra)
                del out
            except LoaderClosed:
                return
            except BaseException as exc:
                if self.stopped:
                    return
                if not isinstance(exc, LoaderError):
                    err = LoaderError(f"{self.decoder.spec.store.location}: loader failed: {type(exc).__name__}: {exc}")
                    err.__cause__ = exc
                    exc = err
                item = exc
            with self.cond:
                self.ready[pos] = item
                if isinstance(item, BaseException):
                    self.taken = max(self.taken, n)  # nothing after a failed batch is started
                    self._room.notify_all()  # assemblers waiting for room: nothing more to take
                if pos == self.given:  # (a later one: the consumer finds it when it gets there)
                    self.cond.notify_all()
            del item

    def next(self) -> tuple[tuple[Any, ...], Any]:
        """The next batch as ``(decoder.batch(i) result, extra)``; StopIteration at the end."""
        with self.cond:
            while self.given not in self.ready:
                if self.given >= len(self.indices) or self.stopped:
                    raise StopIteration
                # the threads' liveness checked when no batch came for a while, not before every wait
                if not self.cond.wait(0.5) and not any(t.is_alive() for t in self.threads):
                    if self.given in self.ready or self.stopped:
                        continue
                    raise LoaderError(f"{self.decoder.spec.store.location}: the loader threads ended without a result")
            item = self.ready.pop(self.given)
            self.given += 1
            self._room.notify()  # room for one more batch
        if isinstance(item, BaseException):
            self.stop()
            raise item
        return item  # type: ignore[no-any-return]

    @property
    def position(self) -> int:
        """Batches returned so far."""
        return self.given

    def stop(self) -> None:
        """Stop, close the decoder (waiting threads get LoaderClosed) and join the threads."""
        with self.cond:
            self.stopped = True
            self.ready.clear()
            self.cond.notify_all()
            self._room.notify_all()
        self.decoder.close()
        me = threading.current_thread()
        for t in self.threads:
            if t is not me and t.is_alive():
                t.join(timeout=30)
