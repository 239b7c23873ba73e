"""Grain (JAX): a store as a random-access data source.

    import grain.python as grain
    from carraystore.grain import StoreDataSource

    source = StoreDataSource("train.b2nd")
    sampler = grain.IndexSampler(len(source), grain.NoSharding(), shuffle=True, num_epochs=1, seed=0)
    loader = grain.DataLoader(data_source=source, sampler=sampler, operations=[grain.Batch(32)])
    for batch in loader:            # {"image": (32, H, W, C) uint8, "label": (32,) int64}
        ...

:class:`StoreDataSource` follows Grain's ``RandomAccessDataSource`` protocol
(``__len__``, ``__getitem__`` by record index, a ``__repr__`` for checkpoints), so Grain's
samplers, sharding, workers and checkpointing all apply. A record is one sample, so a
chunk is decompressed to serve it: decoded chunks are kept in a small per-process cache
(``cache_chunks``). Grain's global shuffle visits chunks at random, which decodes about
one chunk per record once the store is larger than the cache; for throughput over large
stores, shuffle by chunk (``carraystore.torch.StoreDataset``, ``Store.batches``) or make the cache
hold the store. The source pickles as the store's location (each worker opens it). Grain
is not imported here: the protocol is structural.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from carraystore.engine.decoder import image_scale
from carraystore.base.errors import InvalidInputError
from carraystore.store.reader import StoreReader
from carraystore.api.store import open_store

__all__ = ["StoreDataSource"]


class StoreDataSource:
    """Record ``i`` of a store as ``{"image": (H, W, C) array, "label": int64}`` (no label when unlabelled).

    - ``store_or_path``: a Store, a path or a URL (``storage_options`` for URLs).
    - ``cache_chunks``: decoded chunks kept per process (default 8).
    - ``verify``: check each chunk's CRC32 before decoding it (default True).
    - ``with_key``: add ``"key"`` (the sample's source name) where the store has keys.
    - ``image_size``: (height, width) of the images returned, the stored size divided by 1,
      2, 4 or 8 (as the loaders' ``image_size``: JPEG entries decoded at that size, other
      images box-averaged); the cache holds the smaller images.
    """

    def __init__(
        self,
        store_or_path: Any,
        *,
        cache_chunks: int = 8,
        verify: bool = True,
        with_key: bool = False,
        storage_options: dict[str, Any] | None = None,
        image_size: tuple[int, int] | None = None,
    ) -> None:
        if isinstance(store_or_path, StoreReader):
            store = store_or_path
        elif isinstance(store_or_path, (str, os.PathLike)):
            store = open_store(store_or_path, storage_options)
        else:
            raise InvalidInputError(
                f"expected a carraystore Store, a path or a URL of a .b2nd store, got {type(store_or_path).__name__}"
            )
        self.cache_chunks = int(cache_chunks)
        if self.cache_chunks < 1:
            raise InvalidInputError(f"cache_chunks must be >= 1, got {cache_chunks}")
        self.verify = bool(verify)
        self.with_key = bool(with_key)
        self.scale = image_scale(store, image_size)
        self._open_state: dict[str, Any] = store.__getstate__()
        self._setup(store)

    def _setup(self, store: StoreReader | None) -> None:
        self._store = store
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._labels: np.ndarray | None = None if store is None else store.labels
        self._n = None if store is None else len(store)

    @property
    def store(self) -> StoreReader:
        """The store, opened again in each new process."""
        if self._store is None or self._pid != os.getpid():
            st = self._open_state
            self._setup(open_store(st["location"], st.get("storage_options") or None, **st.get("open_kwargs", {})))
        assert self._store is not None
        return self._store

    def __len__(self) -> int:
        return len(self.store) if self._n is None else self._n

    def _chunk(self, c: int) -> np.ndarray:
        store = self.store
        with self._lock:
            arr = self._cache.get(c)
            if arr is not None:
                self._cache.move_to_end(c)
                return arr
        arr = store.read_chunk(c, verify=self.verify, scale=self.scale)  # outside the lock: threads decode in parallel
        if self.scale != 1:  # the reduced images, compact: the full-size buffer is let go
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
        store = self.store
        k = store.chunk_images
        image = self._chunk(i // k)[i % k].copy()  # a copy: the cached chunk may be dropped and reused
        out: dict[str, Any] = {"image": image}
        if self._labels is not None:
            out["label"] = np.int64(self._labels[i])
        if self.with_key and store.keys is not None:
            out["key"] = store.keys[i]
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {
            "open_state": self._open_state,
            "cache_chunks": self.cache_chunks,
            "verify": self.verify,
            "with_key": self.with_key,
            "scale": self.scale,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._open_state = state["open_state"]
        self.cache_chunks = state["cache_chunks"]
        self.verify = state["verify"]
        self.with_key = state["with_key"]
        self.scale = state.get("scale", 1)
        self._setup(None)

    def __repr__(self) -> str:
        # Grain's checkpoints compare it: the location and the record count, nothing per process
        return f"StoreDataSource({self._open_state['location']!r}, records={len(self)})"
