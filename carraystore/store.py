"""The names of carraystore 0.1.0's ``carraystore.store`` module, kept for existing code.

The reader lives in :mod:`carraystore.reader`, the writer in :mod:`carraystore.writer`.
"""

from __future__ import annotations

from carraystore.codec import TARGET_CHUNK_BYTES, default_chunk_images
from carraystore.reader import ChunkProblem, Store, open_store
from carraystore.writer import StoreWriter, append, create

__all__ = [
    "Store",
    "StoreWriter",
    "ChunkProblem",
    "create",
    "append",
    "open_store",
    "default_chunk_images",
    "TARGET_CHUNK_BYTES",
]
