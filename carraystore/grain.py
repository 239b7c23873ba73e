"""Grain (JAX): a store as a random-access data source.

    source = StoreDataSource("train.b2nd")
    sampler = grain.IndexSampler(len(source), grain.NoSharding(), shuffle=True, num_epochs=1, seed=0)
    loader = grain.DataLoader(data_source=source, sampler=sampler, operations=[grain.Batch(32)])

:class:`StoreDataSource` follows Grain's ``RandomAccessDataSource`` protocol, so Grain's
samplers, sharding, workers and checkpointing apply. A record is one sample, served from a
per-process cache of decoded chunks; a global shuffle over a store larger than the cache
decodes about one chunk per record (for throughput, shuffle by chunk with
``carraystore.torch.StoreDataset`` or ``Store.batches``). Pickles as location + options.
Grain is not imported: the protocol is structural.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import numpy as np

from carraystore.api.store import open_store
from carraystore.base.errors import InvalidInputError
from carraystore.engine.options import LoaderOptions
from carraystore.engine.random_access import ProcessSpec
from carraystore.engine.spec import LoaderSpec, make_spec
from carraystore.store.reader import StoreReader

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from carraystore.engine.options import LoaderKwargs

__all__ = ["StoreDataSource"]

#: the loader options that say what one record is; the others order, shard or batch records
RECORD_OPTIONS = ("targets", "label_mode", "sample_weight", "verify", "retry_timeout", "image_size")


def _record_options(options: LoaderOptions | None, kwargs: dict[str, Any]) -> LoaderOptions:
    """The options, refusing by name those that do not apply to records asked for by index."""
    opts = LoaderOptions.from_kwargs(**kwargs) if options is None else options.replace(**kwargs)
    default = LoaderOptions()

    def same(a: Any, b: Any) -> bool:
        return a is b or (type(a) is type(b) and not isinstance(a, np.ndarray) and bool(a == b))

    odd = set(kwargs) | {
        f.name for f in dataclasses.fields(opts) if not same(getattr(opts, f.name), getattr(default, f.name))
    }
    odd -= set(RECORD_OPTIONS)
    if odd:
        raise InvalidInputError(
            f"StoreDataSource serves one record by index: {sorted(odd)} do not apply (Grain's sampler orders, "
            f"shards and epochs the records, its operations batch and transform them); it takes {list(RECORD_OPTIONS)}"
        )
    return opts


def _row(y: Any) -> Any:
    """Sample 0 of a batch's y (an array, a tuple or a dict of arrays)."""
    if isinstance(y, dict):
        return {k: v[0] for k, v in y.items()}
    if isinstance(y, tuple):
        return tuple(v[0] for v in y)
    return y[0]


class StoreDataSource:
    """Record ``i`` of a store as ``{"image": (H, W, C) array, "label": int64}`` (no label when unlabelled).

    - ``store_or_path``: a Store, a path or a URL (``storage_options`` for URLs).
    - ``cache_chunks``: decoded chunks kept per process (default 8).
    - ``with_key``: add ``"key"`` (the sample's source name) where the store has keys.
    - the loader options of :data:`RECORD_OPTIONS`, as keywords or one ``options``:
      ``image_size``, ``verify`` (default True), ``targets``/``label_mode`` (``"label"`` is y
      as the loaders give it), ``sample_weight`` (``"sample_weight"``, float32),
      ``retry_timeout``. Any other loader option is refused by name.
    """

    def __init__(
        self,
        store_or_path: Any,
        options: LoaderOptions | None = None,
        *,
        cache_chunks: int = 8,
        with_key: bool = False,
        storage_options: dict[str, Any] | None = None,
        **kwargs: Unpack[LoaderKwargs],
    ) -> None:
        if isinstance(store_or_path, (str, os.PathLike)):
            store_or_path = open_store(store_or_path, storage_options)
        self._source = ProcessSpec(make_spec(store_or_path, 1, _record_options(options, dict(kwargs))))
        self.cache_chunks = int(cache_chunks)
        if self.cache_chunks < 1:
            raise InvalidInputError(f"cache_chunks must be >= 1, got {cache_chunks}")
        self.with_key = bool(with_key)
        self._setup()

    def _setup(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()

    @property
    def options(self) -> LoaderOptions:
        return self._source.options

    @property
    def spec(self) -> LoaderSpec:
        """The options resolved against the store, opened again in each new process."""
        return self._source.get()

    @property
    def store(self) -> StoreReader:
        return self.spec.store

    def __len__(self) -> int:
        return len(self.store)

    def _chunk(self, c: int) -> np.ndarray:
        spec = self.spec
        if self._pid != os.getpid():  # a new process: a cache of its own
            self._setup()
        with self._lock:
            arr = self._cache.get(c)
            if arr is not None:
                self._cache.move_to_end(c)
                return arr
        # outside the lock: threads decode in parallel
        arr = spec.store.read_chunk(c, verify=spec.verify, scale=spec.scale)
        if spec.scale != 1:  # the reduced images, compact: the full-size buffer is let go
            arr = np.ascontiguousarray(arr)
        with self._lock:
            self._cache[c] = arr
            while len(self._cache) > self.cache_chunks:
                self._cache.popitem(last=False)
        return arr

    def __getitem__(self, record_key: int) -> dict[str, Any]:
        n = len(self)
        i = int(record_key)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"record {record_key} out of range for a store of {n} images")
        spec = self.spec
        k = spec.store.chunk_images
        image = self._chunk(i // k)[i % k].copy()  # a copy: the cached chunk may be dropped and reused
        out: dict[str, Any] = {"image": image}
        items = np.array([i], dtype=np.int64)
        if spec.has_y:
            out["label"] = _row(spec.y_for(items))
        w = spec.w_for(items)
        if w is not None:
            out["sample_weight"] = w[0]
        if self.with_key and spec.store.keys is not None:
            out["key"] = spec.store.keys[i]
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {"_source": self._source, "cache_chunks": self.cache_chunks, "with_key": self.with_key}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def __repr__(self) -> str:
        # Grain's checkpoints compare it: the location and the record count, nothing per process
        return f"StoreDataSource({self._source.location!r}, records={len(self)})"
