"""``carraystore.Store`` (the reader plus the loaders, defined above both) and ``open_store``."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from carraystore.engine.loader import BatchIterator
from carraystore.engine.loader import batches as _batches
from carraystore.engine.options import LoaderKwargs, LoaderOptions
from carraystore.store.reader import StoreReader
from carraystore.store.reader import open_store as _open_store

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Store", "open_store"]


class Store(StoreReader):
    """A read-only store (``carraystore.open``): a :class:`~carraystore.store.reader.StoreReader` plus loaders."""

    def batches(
        self, batch_size: int, options: LoaderOptions | None = None, **kwargs: Unpack[LoaderKwargs]
    ) -> BatchIterator:
        """Iterate one epoch of (x, y) batches; the arguments are :class:`~carraystore.engine.options.LoaderOptions`'
        fields (see ``carraystore.engine.loader.batches``)."""
        return _batches(self, batch_size, options, **kwargs)

    def to_dask(self) -> Any:
        """This store as a lazy ``dask.array.Array``, one dask chunk per store chunk (``carraystore.dask.to_dask``)."""
        from carraystore.api.daskview import to_dask  # dask only when asked for

        return to_dask(self)


def open_store(
    location: str | os.PathLike[str],
    storage_options: Mapping[str, Any] | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    cache_size: int | str | None = None,
) -> Store:
    """Open a store for reading from a path or URL; arguments: :func:`carraystore.store.reader.open_store`'s."""
    return _open_store(location, storage_options, cache_dir=cache_dir, cache_size=cache_size, cls=Store)
