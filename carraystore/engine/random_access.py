"""What the adapters share to serve batches from any thread or process.

Batch ``i`` is a pure function of (options, epoch, i). :class:`ProcessSpec` is a spec that
is re-made in each process; :class:`WindowCache` keeps one process's decoder so batches
asked for in order decode each chunk once.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

import numpy as np

from carraystore.base.errors import InvalidInputError
from carraystore.engine.decoder import EpochDecoder
from carraystore.engine.options import LoaderOptions
from carraystore.engine.pipeline import MemoryPlan, plan_memory
from carraystore.engine.spec import LoaderSpec, make_spec
from carraystore.store.reader import open_store

__all__ = ["ProcessSpec", "WindowCache", "batch_index"]


def batch_index(index: int, num_batches: int) -> int:
    """A batch ``index`` (negative counts from the end) checked against the epoch's ``num_batches``."""
    i = int(index)
    if i < 0:
        i += num_batches
    if not 0 <= i < num_batches:
        raise IndexError(f"batch {index} out of range for an epoch of {num_batches} batches")
    return i


class ProcessSpec:
    """A spec that pickles as location, options and batch size, and is re-made in each new process."""

    def __init__(self, spec: LoaderSpec) -> None:
        self._open_state: dict[str, Any] = spec.store.__getstate__()
        self._cls = type(spec.store)
        self.batch_size = spec.batch_size
        self.options = spec.options
        self._lock = threading.Lock()
        self._spec: LoaderSpec | None = spec
        self._pid = os.getpid()

    @property
    def location(self) -> str:
        return str(self._open_state["location"])

    def get(self) -> LoaderSpec:
        """This process's spec."""
        if self._pid != os.getpid():  # a forked child: a lock a parent thread held would stay locked here
            self._lock, self._spec, self._pid = threading.Lock(), None, os.getpid()
        with self._lock:
            if self._spec is None:
                st = self._open_state
                store = open_store(st["location"], st["storage_options"] or None, cls=self._cls, **st["open_kwargs"])
                self._spec = make_spec(store, self.batch_size, self.options)
            return self._spec

    def set_options(self, options: LoaderOptions) -> LoaderSpec:
        """Serve ``options`` from now on (checked against the store here); the new spec."""
        spec = make_spec(self.get().store, self.batch_size, options)
        with self._lock:
            self.options, self._spec = options, spec
        return spec

    def __getstate__(self) -> dict[str, Any]:
        return {k: self.__dict__[k] for k in ("_open_state", "_cls", "batch_size", "options")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock, self._spec, self._pid = threading.Lock(), None, os.getpid()


class WindowCache:
    """One process's decoder of an epoch, re-made for another epoch, spec or process.

    ``warn``: say once when batches come out of order. Pickles as its settings only.
    """

    def __init__(self, cache_windows: int, thread_prefix: str, what: str, warn: bool = False) -> None:
        self.cache_windows = int(cache_windows)
        if self.cache_windows < 1:
            raise InvalidInputError(f"cache_windows must be >= 1, got {cache_windows}")
        self.thread_prefix = thread_prefix
        self.what = what
        self.warn = warn
        self._reset()

    def _reset(self) -> None:
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self.decoder: EpochDecoder | None = None
        #: the slots and buffers of the last decoder made
        self.memory: MemoryPlan | None = None
        self._decoded: dict[int, int] = {}
        self._warned = False

    def get(self, spec: LoaderSpec, epoch: int) -> EpochDecoder:
        """This process's decoder of ``epoch``."""
        if self._pid != os.getpid():  # a forked child: the parent's decoder and lock are not ours
            self._reset()
        with self._lock:
            c = self.decoder
            if c is not None and c.epoch == epoch and c.spec is spec:
                return c
            self._retire()
            plan = spec.plan(epoch)
            mwc = plan.max_window_chunks
            want = max(self.cache_windows * mwc, mwc + int(spec.options.prefetch or 0))
            # the adapter's caller holds the batches: only the slots are the decoder's
            self.memory = plan_memory(spec, plan, want, 0, 1, self.what)
            threads = int(spec.options.num_threads or 1)
            c = self.decoder = EpochDecoder(spec, epoch, self.memory.slots, threads, self.thread_prefix, plan=plan)
            return c

    def batch(self, spec: LoaderSpec, epoch: int, i: int, out: np.ndarray | None = None) -> tuple[Any, ...]:
        """Batch ``i`` of ``epoch`` as the decoder gives it ((x, y) or (x, y, w)), x written into ``out``."""
        c = self.get(spec, epoch)
        got = c.batch(i, out)
        if self.warn and c.out_of_order and not self._warned:
            self._warned = True
            w = next((w for w, n in c.decode_count.items() if n > 1), None)
            warnings.warn(
                f"carraystore {self.what} ({spec.store.location}): window {w} of epoch {epoch} was decoded "
                f"{c.decode_count.get(w, 0) if w is not None else 0} times; batches are being asked for out of "
                "order. model.fit(shuffle=True), Keras's default, does that: StoreDataset already shuffles, so pass "
                "shuffle=False to fit (or raise cache_windows).",
                RuntimeWarning,
                stacklevel=4,
            )
        return got

    @property
    def decode_counts(self) -> dict[int, int]:
        """Epoch -> chunks this process decoded for it."""
        if self._pid != os.getpid():
            return {}
        out = dict(self._decoded)
        c = self.decoder
        if c is not None:
            out[c.epoch] = out.get(c.epoch, 0) + c.chunks_decoded
        return out

    def _retire(self) -> None:
        c, self.decoder = self.decoder, None
        if c is not None and c.pid == os.getpid():
            c.close()
            self._decoded[c.epoch] = self._decoded.get(c.epoch, 0) + c.chunks_decoded

    def close(self) -> None:
        """End the decoder threads and free the decoded windows (a new decoder starts on demand)."""
        if self._pid != os.getpid():
            self._reset()
            return
        with self._lock:
            self._retire()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __getstate__(self) -> dict[str, Any]:
        return {k: self.__dict__[k] for k in ("cache_windows", "thread_prefix", "what", "warn")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset()
