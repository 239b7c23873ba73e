"""Migrations: turn other formats (legacy bcolz, npz caches, HDF5, older store versions) into stores.

This package is ``carraystore.migrations`` (the ``carraystore.migrate`` of the facade).

``migrate(src, out)`` detects the source, streams it into a store chunk by chunk, re-reads
the store and compares it bit for bit with the source, and only then renames it into
place. ``carraystore migrate SRC OUT.b2nd`` is the command line front end.

* ``carraystore.migrations.bcolz``: a pure bcolz carray/ctable reader (bcolz itself is
  never imported).
* ``carraystore.migrations.blosc1``: Blosc1 chunk decoding (pre-1.11 split flag, snappy).
* ``carraystore.migrations.npz`` / ``.hdf5``: ``.npz`` caches and HDF5 datasets.
* ``carraystore.migrations.versions``: the registry of store format-version upgrades.
"""

from __future__ import annotations

from carraystore.migrations.core import (
    Block,
    MigrationReport,
    MigrationVerifyError,
    Source,
    migrate,
    open_migration_source,
)

__all__ = ["migrate", "open_migration_source", "MigrationReport", "MigrationVerifyError", "Source", "Block"]
