"""carraystore: compressed, single-file, version-stable image stores for Keras and tf.data."""

from __future__ import annotations

import os as _os
from collections.abc import Mapping as _Mapping
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from carraystore._version import __version__
from carraystore.api.store import Store
from carraystore.api.store import open_store as open  # noqa: A001
from carraystore.base.errors import *  # noqa: F401,F403
from carraystore.base.errors import __all__ as _errors_all
from carraystore.format.codec import PRESETS, Codec
from carraystore.format.record import FORMAT_VERSION
from carraystore.ingest.run import from_directory
from carraystore.migrations import migrate
from carraystore.store.metadata import update_metadata
from carraystore.store.options import WriteOptions
from carraystore.store.reader import ChunkProblem
from carraystore.store.writer import StoreWriter, append, create

if _TYPE_CHECKING:  # transfer (and its upload layer) is imported only when copy is called
    from carraystore.store.transfer import CopyResult


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
    """Copy a store between paths or URLs, verified chunk by chunk (``store.transfer.copy_store``); a CopyResult."""
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
