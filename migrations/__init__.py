"""Migrations: turn other formats (legacy bcolz, npz caches, HDF5, older store versions) into stores.

This package is ``carraystore.migrations`` (the ``carraystore.migrate`` of the facade).

``migrate(src, out)`` detects the source, streams it into a store chunk by chunk, re-reads
the store and compares it bit for bit with the source, and only then renames it into
place. ``carraystore migrate SRC OUT.b2nd`` is the command line front end.

* ``carraystore.migrations.bcolz``: a pure bcolz carray/ctable reader (bcolz itself is
  never imported) and ``write_carray`` (real c-blosc 1.x chunks, for tests and benchmarks).
* ``carraystore.migrations.blosc1``: Blosc1 chunk decoding (pre-1.11 split flag, snappy).
* ``carraystore.migrations.npz`` / ``.hdf5``: ``.npz`` caches and HDF5 datasets.
* ``carraystore.migrations.versions``: the registry of store format-version upgrades.
"""

from __future__ import annotations

import warnings
from typing import Any

from carraystore.migrations.core import (
    Block,
    MigrationReport,
    MigrationVerifyError,
    Source,
    migrate,
    open_migration_source,
)

__all__ = ["migrate", "open_migration_source", "MigrationReport", "MigrationVerifyError", "Source", "Block"]

#: Old names kept working for one minor version (removed in 0.2), each with its new name.
_DEPRECATED = {"open_source": "open_migration_source"}


def __getattr__(name: str) -> Any:
    """``carraystore.migrations.open_source``: the old name of :func:`open_migration_source`, with a warning."""
    new = _DEPRECATED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"carraystore.migrations.{name} is renamed carraystore.migrations.{new} (reader.open_source opens a "
        f"store's bytes, a different thing); the old name goes in carraystore 0.2: use {new}",
        DeprecationWarning,
        stacklevel=2,
    )
    return globals()[new]
