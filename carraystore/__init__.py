"""carraystore: compressed, single-file, version-stable image stores for Keras and tf.data."""

from __future__ import annotations

import inspect as _inspect
import os as _os
from collections.abc import Mapping as _Mapping
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any
from typing import cast as _cast

from carraystore.ingest import run as _ingest  # noqa: E402
from carraystore._version import __version__  # noqa: E402
from carraystore.format.codec import PRESETS, Codec  # noqa: E402
from carraystore.base.errors import *  # noqa: E402,F401,F403
from carraystore.base.errors import __all__ as _errors_all  # noqa: E402
from carraystore.format.record import FORMAT_VERSION  # noqa: E402
from carraystore.migrations import migrate  # noqa: E402
from carraystore.store.options import WriteOptions  # noqa: E402
from carraystore.store.reader import ChunkProblem  # noqa: E402
from carraystore.api.store import Store  # noqa: E402
from carraystore.api.store import open_store as open  # noqa: E402,A001
from carraystore.store.writer import StoreWriter, append, create, update_metadata  # noqa: E402

if _TYPE_CHECKING:  # transfer (and its upload layer) is imported only when copy is called
    from carraystore.store.transfer import CopyResult


def from_directory(
    directory: str | _os.PathLike[str], output: str | _os.PathLike[str], *, client: _Any = None, **options: _Any
) -> _ingest.IngestResult | dict[str, _ingest.IngestResult]:
    """Set below from ``carraystore.ingest.run.from_directory`` (its docstring and parameters) plus ``client``."""
    if client is not None:  # the dask adapter (and dask) only when asked for
        from carraystore.dask import from_directory as on_cluster

        return on_cluster(directory, output, client=client, **options)
    return _ingest.from_directory(directory, output, **options)


def _facade_of_ingest() -> None:
    """Give ``from_directory`` the ingest's real parameters and docstring, with ``client`` in place of ``runner``."""
    ingest_signature = _inspect.signature(_ingest.from_directory)
    params = [p for p in ingest_signature.parameters.values() if p.name != "runner"]
    client = _inspect.Parameter("client", _inspect.Parameter.KEYWORD_ONLY, default=None, annotation="Any")
    # functions take a __signature__ attribute (inspect reads it); their type does not declare one
    _cast(_Any, from_directory).__signature__ = ingest_signature.replace(parameters=[*params, client])
    doc = _inspect.getdoc(_ingest.from_directory) or ""
    doc = doc.partition("\n\n``runner``")[0]
    from_directory.__doc__ = doc + (
        "\n\n``client`` (a ``dask.distributed.Client``) decodes on its cluster instead of local\n"
        "processes (``workers`` is then unused; ``carraystore.dask.from_directory``); the store is\n"
        "byte for byte the one a local ingest writes (docs/dask.md). The workers read the files at\n"
        "the same path, so ``directory`` must be on a file system they all see."
    )


_facade_of_ingest()


def copy(
    src: str | _os.PathLike[str],
    dst: str | _os.PathLike[str],
    *,
    storage_options: _Mapping[str, _Any] | None = None,
    dst_storage_options: _Mapping[str, _Any] | None = None,
    overwrite: bool = False,
    verify: bool = True,
    progress: bool = False,
    options: WriteOptions | None = None,
) -> CopyResult:
    """Copy a store between two locations (paths or URLs), streamed and verified chunk by chunk.

    See ``carraystore.store.transfer.copy_store`` (``options``: a WriteOptions); returns a CopyResult.
    """
    from carraystore.store.transfer import copy_store

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
