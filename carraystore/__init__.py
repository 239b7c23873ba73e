"""carraystore: compressed, single-file, version-stable image stores for Keras and tf.data."""

from __future__ import annotations

from carraystore import loader as _loader  # noqa: E402,F401  (gives Store.batches its implementation)
from carraystore import reader as _reader  # noqa: E402
from carraystore._version import __version__  # noqa: E402
from carraystore.codec import PRESETS, Codec  # noqa: E402
from carraystore.errors import *  # noqa: E402,F401,F403
from carraystore.errors import __all__ as _errors_all  # noqa: E402
from carraystore.format import FORMAT_VERSION  # noqa: E402
from carraystore.ingest import from_directory  # noqa: E402  (the real signature, for help() and IDEs)
from carraystore.migrations import migrate  # noqa: E402
from carraystore.options import WriteOptions  # noqa: E402
from carraystore.reader import ChunkProblem, Store  # noqa: E402
from carraystore.reader import open_store as open  # noqa: E402,A001
from carraystore.writer import StoreWriter, append, create, update_metadata  # noqa: E402


def _store_to_dask(store: Store):  # type: ignore[no-untyped-def]
    """``Store.to_dask``: imports the dask adapter (and dask) only when called."""
    from carraystore.dask import to_dask

    return to_dask(store)


_reader.TO_DASK = _store_to_dask


def copy(  # type: ignore[no-untyped-def]
    src,
    dst,
    *,
    storage_options=None,
    dst_storage_options=None,
    overwrite=False,
    verify=True,
    progress=False,
    options=None,
):
    """Copy a store between two locations (paths or URLs), streamed and verified chunk by chunk.

    See ``carraystore.transfer.copy_store`` (``options``: a WriteOptions); returns a CopyResult.
    """
    from carraystore.transfer import copy_store

    return copy_store(
        src,
        dst,
        storage_options=storage_options,
        dst_storage_options=dst_storage_options,
        overwrite=overwrite,
        verify=verify,
        progress=progress,
        options=options,
    )


__all__ = [
    "__version__",
    "FORMAT_VERSION",
    "PRESETS",
    "Codec",
    "Store",
    "StoreWriter",
    "ChunkProblem",
    "create",
    "append",
    "update_metadata",
    "open",
    "from_directory",
    "migrate",
    "copy",
    "WriteOptions",
    *_errors_all,
]
