"""``carraystore.migrations``: other formats (bcolz, npz, HDF5, npy, older store versions; WebDataset shards,
TFRecord files, Parquet/Arrow image tables) into stores.

``migrate(src, out)`` (CLI: ``carraystore migrate SRC OUT.b2nd``) streams the source into a
store, verifies it bit for bit, then renames it into place (:mod:`.core`).
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
from carraystore.migrations.samples import (
    MixedTypesError,
    SourceChecksumError,
    SourceFormatError,
    SourceImageError,
    TruncatedSourceError,
)

__all__ = [
    "migrate",
    "open_migration_source",
    "MigrationReport",
    "MigrationVerifyError",
    "Source",
    "Block",
    "SourceFormatError",
    "TruncatedSourceError",
    "SourceChecksumError",
    "MixedTypesError",
    "SourceImageError",
]
