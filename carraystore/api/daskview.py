"""Stores as dask arrays: a lazy, read-only view, re-exported by ``carraystore.dask`` (docs/dask.md).

:func:`to_dask` is the pixels, one task per store chunk; :func:`labels`, :func:`fields` and
:func:`targets` the per-sample values as numpy arrays. Needs ``pip install 'carraystore[dask]'``.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.base.errors import InvalidInputError, MissingDependencyError, StoreChangedError
from carraystore.engine.options import LABEL, Targets
from carraystore.engine.spec import make_spec
from carraystore.store.reader import StoreReader, is_url, open_store

try:
    import dask.array as da
    from dask.base import tokenize
except ImportError as exc:  # pragma: no cover - the dask extra is not installed
    raise MissingDependencyError("carraystore.dask needs dask: pip install 'carraystore[dask]'") from exc

# dask.array.from_array carries no annotations: called through this typed name
_from_array: Callable[..., da.Array] = da.from_array

__all__ = ["to_dask", "labels", "Labels", "fields", "targets"]


def _as_store(
    store_or_url: StoreReader | str | os.PathLike[str], storage_options: dict[str, Any] | None
) -> StoreReader:
    """An open store whose location means the same in every process (absolute for a local file)."""
    if isinstance(store_or_url, StoreReader):
        if storage_options:
            raise InvalidInputError("storage_options apply when a path or URL is given, not an open Store")
        if isinstance(store_or_url.path, Path) and not store_or_url.path.is_absolute():
            return open_store(store_or_url.path.absolute())
        return store_or_url
    if not is_url(store_or_url):
        path = str(store_or_url)
        return open_store(
            Path(path[len("file://") :] if path.startswith("file://") else path).absolute(), storage_options
        )
    return open_store(store_or_url, storage_options)


class _ChunkReader:
    """What ``da.from_array`` slices: a slice reads only the chunks it needs.

    Pickles as location, options and a fingerprint (shape, chunk CRCs); opens the store at the
    first read (the scheduler need not reach the data), raising if it changed since.
    """

    def __init__(self, store: StoreReader) -> None:
        self._store: StoreReader | None = store
        self._reopen: dict[str, Any] = store.__getstate__()  # location, storage_options, open kwargs
        self._lock = threading.Lock()
        self.shape = store.shape
        self.dtype = store.dtype
        self.ndim = len(self.shape)
        self.fingerprint = _fingerprint(store)

    def __getstate__(self) -> dict[str, Any]:
        state = {k: v for k, v in self.__dict__.items() if k not in ("_store", "_lock")}
        return {**state, "_store": None}  # opened again where it is read

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def store(self) -> StoreReader:
        """The store, opened on first use in this process and checked against the fingerprint."""
        if self._store is None:
            with self._lock:
                if self._store is None:
                    r = self._reopen
                    store = open_store(r["location"], r.get("storage_options") or None, **r.get("open_kwargs", {}))
                    if _fingerprint(store) != self.fingerprint:
                        store.close()
                        raise StoreChangedError(
                            f"{store.location}: the store changed since to_dask was called on it (replaced or appended "
                            "to) and this graph describes the old one; call to_dask again (or Store.to_dask) to build "
                            "the graph on the store as it is now"
                        )
                    self._store = store
        return self._store

    def __getitem__(self, key: Any) -> np.ndarray:
        store = self.store
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis or k is None for k in key):
            whole: np.ndarray = store.take(np.arange(len(store)))[key]
            return whole
        first, rest = (key[0], key[1:]) if key else (slice(None), ())
        if isinstance(first, slice):
            start, stop, step = first.indices(len(store))
            k = store.chunk_images
            if step == 1 and stop > start and start % k == 0 and stop == min(start + k, len(store)):
                block = store.read_chunk(start // k)
            else:
                block = store.take(np.arange(start, stop, step))
            index = (slice(None), *rest)  # built apart: mypy takes a star inside [] for 3.11 syntax
            return block[index] if rest else block
        block = store[first]
        return block[rest] if rest else block


def _fingerprint(store: StoreReader) -> str:
    return tokenize(store.shape, str(store.dtype), np.asarray(store.meta.crc32).tobytes())


def to_dask(
    store_or_url: StoreReader | str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> da.Array:
    """A lazy dask array of a store (a Store, path or URL), one task per store chunk, any scheduler."""
    store = _as_store(store_or_url, storage_options)
    n, k = len(store), store.chunk_images
    axis0 = tuple(min(k, n - s) for s in range(0, n, k)) or (0,)
    chunks = (axis0, *((d,) for d in store.item_shape))
    crcs = np.asarray(store.meta.crc32).tobytes()
    name = "carraystore-" + tokenize(str(store.location), store.storage_options, store.shape, str(store.dtype), crcs)
    meta = np.empty((0,) * len(store.shape), dtype=store.dtype)
    return _from_array(_ChunkReader(store), chunks=chunks, name=name, meta=meta, lock=False, inline_array=False)


class Labels(np.ndarray):
    """int64 labels carrying the store's ``class_names``, so ``from_dask(x, out, labels=labels(path))`` keeps them.

    Slices keep the names; arithmetic and comparison results are plain arrays."""

    class_names: tuple[str, ...] | None

    def __new__(cls, values: np.ndarray, class_names: tuple[str, ...] | None) -> Labels:
        out = np.asarray(values, dtype=np.int64).view(cls)
        out.class_names = class_names
        return out

    def __array_finalize__(self, obj: Any) -> None:
        self.class_names = getattr(obj, "class_names", None)

    def __array_wrap__(self, arr: np.ndarray, context: Any = None, return_scalar: bool = False) -> Any:
        out = np.asarray(arr)  # ufunc results (labels == 3, labels + 1) are plain arrays: no names to carry
        return out[()] if return_scalar else out


def labels(store_or_url: StoreReader | str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Labels:
    """The labels as a numpy int64 :class:`Labels` (``x[labels(s) == 3]``); InvalidInputError if unlabelled."""
    store = _as_store(store_or_url, storage_options)
    if store.labels is None:
        fields = sorted(store.columns)
        hint = (
            f"; its per-sample fields are {fields} (e.g. one-hot labels kept as a field): "
            "read them with carraystore.dask.fields() or carraystore.dask.targets(store, name)"
            if fields
            else ""
        )
        raise InvalidInputError(f"{store.location}: the store has no class labels{hint}")
    return Labels(np.array(store.labels, dtype=np.int64), store.class_names)


def fields(
    store_or_url: StoreReader | str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> dict[str, np.ndarray]:
    """The per-sample fields as numpy arrays, name -> (N, *shape): ``x[fields(s)["angle"] > 0.1]``."""
    store = _as_store(store_or_url, storage_options)
    return {name: np.array(col) for name, col in store.columns.items()}


def targets(
    store_or_url: StoreReader | str | os.PathLike[str],
    targets: Targets = LABEL,
    *,
    label_mode: str | None = "int",
    sample_weight: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """Every sample's y (numpy, first axis N) as the loaders give it, same arguments (docs/targets.md).

    Returns y (an array, tuple or dict), or ``(y, w)`` with ``sample_weight``; pair it with
    :func:`to_dask`. InvalidInputError when there is no y.
    """
    store = _as_store(store_or_url, storage_options)
    spec = make_spec(store, 1, shuffle=False, targets=targets, label_mode=label_mode, sample_weight=sample_weight)
    if not spec.has_y:
        raise InvalidInputError(
            f"{store.location}: the store has no labels; name a field with targets= ({sorted(store.columns)})"
        )
    items = np.arange(len(store), dtype=np.int64)
    y = spec.y_for(items)
    return y if sample_weight is None else (y, spec.w_for(items))
