"""What every migration source is: a description plus a re-readable stream of row blocks.

The source modules (bcolz, npz, HDF5, older store versions) build on this module only;
:mod:`carraystore.migrations.core` runs the pipeline over them.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.codec import Codec
from carraystore.errors import MigrationError
from carraystore.format import COLOR_MODES, DTYPES

__all__ = [
    "Block",
    "Source",
    "MIGRATION_BLOCK_BYTES",
    "CLASS_NAME_DATASETS",
    "LABEL_NAMES",
    "disk_size",
    "infer_labels",
    "labels_from_array",
    "store_layout",
]

#: Rows per block read from a source aim at about this many uncompressed bytes (a few
#: store chunks at most; not the store's chunk size, see codec.TARGET_CHUNK_BYTES).
MIGRATION_BLOCK_BYTES = 8 * 1024 * 1024

#: Names (an HDF5 dataset's last path part, an npz member; lower case) read as class names.
CLASS_NAME_DATASETS = ("class_names", "classes", "label_names", "labelnames", "target_names")

#: Names (an HDF5 dataset's last path part, an npz member; lower case) that pick the labels
#: when several arrays could be them.
LABEL_NAMES = frozenset({"labels", "label", "y", "targets", "target", "class", "classes_idx"})


def infer_labels(fits: Sequence[str], images: str, where: str, notes: list[str]) -> str | None:
    """The labels among ``fits`` (integer arrays, one value per row of ``images``): the only one,
    or the only one with a label name; none fitting gives None; else MigrationError listing them."""
    if not fits:
        return None
    if len(fits) > 1:
        named = [n for n in fits if n.rsplit("/", 1)[-1].lower() in LABEL_NAMES]
        if len(named) != 1:
            raise MigrationError(
                f"{where}: several datasets could be the labels of {images!r} (integers, one per row): {list(fits)}; "
                "choose one with --labels NAME, or pass --no-labels to migrate without labels"
            )
        fits = named
    notes.append(f"labels inferred: {fits[0]!r} (integers, one per row of {images!r}; --no-labels leaves them out)")
    return fits[0]


@dataclass
class Block:
    """Consecutive rows of a source: the items, and optional labels, keys and metadata columns."""

    data: np.ndarray
    labels: np.ndarray | None = None
    keys: Sequence[str] | None = None
    columns: dict[str, np.ndarray] | None = None


class Source:
    """Something that can be migrated: a description plus a re-readable stream of blocks."""

    kind: str = "source"
    #: what the user pointed at (for messages and the summary)
    path: Path
    item_shape: tuple[int, ...]
    dtype: np.dtype
    nrows: int
    attrs: dict[str, Any]
    class_names: tuple[str, ...] | None = None
    #: compression of the source as text, e.g. ``lz4-5 shuffle``
    codec: str = ""
    #: whether blocks carry labels
    has_labels: bool = False
    #: the store codec used when the caller picks none (None: the ``balanced`` preset)
    default_codec: Codec | None = None

    def __init__(self) -> None:
        self.warnings: list[str] = []
        self.notes: list[str] = []
        self.provenance: dict[str, Any] = {}

    @property
    def cbytes(self) -> int:
        """Bytes the source takes on disk."""
        return disk_size(self.path)

    @property
    def row_nbytes(self) -> int:
        return int(math.prod(self.item_shape)) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.nrows * self.row_nbytes

    @property
    def block_rows(self) -> int:
        return max(1, MIGRATION_BLOCK_BYTES // max(1, self.row_nbytes))

    def blocks(self) -> Iterator[Block]:
        """Row blocks in order, read from disk; may be called again (verification re-reads)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release open files."""


def disk_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, f))
    return total


def store_layout(item_shape: Sequence[int], dtype: np.dtype) -> str:
    """ "NHWC" for (H, W, C) images (C in 1/3/4, an image dtype), else "array" (shape kept exactly)."""
    dt = np.dtype(dtype)
    shape = tuple(item_shape)
    if len(shape) == 3 and shape[2] in COLOR_MODES and dt.name in DTYPES and dt.isnative and min(shape) >= 1:
        return "NHWC"
    return "array"


def labels_from_array(values: np.ndarray, where: str) -> tuple[np.ndarray, tuple[str, ...] | None, str]:
    """Integer class labels from a labels array: (labels, class_names or None, what was done).

    Accepts non-negative integers (any integer dtype, bool, or integral floats), strings
    (class names: sorted, labels index them) and one-hot rows (N, K). Anything else is a
    MigrationError that says how to keep the array instead.
    """
    a = np.asarray(values)
    n = len(a)
    hint = "; leave it out of --labels to keep it as a metadata column instead"
    if a.dtype.kind in "SU" and a.ndim == 1:
        text = (
            a.astype(str)
            if a.dtype.kind == "U"
            else np.array([s.decode("utf-8", "replace") for s in a.tolist()], dtype=str)
        )
        names, inv = np.unique(text, return_inverse=True)
        return (
            inv.astype("<i8").reshape(-1),
            tuple(str(s) for s in names),
            f"class names {list(names)[:10]}{' ...' if len(names) > 10 else ''} from strings",
        )
    if a.ndim == 2 and a.shape[1] > 1 and a.dtype.kind in "biuf":
        ones = a == 1
        if n and bool(np.all(ones.sum(axis=1) == 1)) and bool(np.all((a == 0) | ones)):
            return (
                np.argmax(a, axis=1).astype("<i8"),
                None,
                f"one-hot labels ({a.shape[1]} classes) turned into class indices",
            )
        raise MigrationError(f"{where}: labels of shape {a.shape} are not one-hot rows{hint}")
    if a.ndim == 2 and a.shape[1] == 1:
        a = a[:, 0]
    if a.ndim != 1:
        raise MigrationError(f"{where}: labels must be one per row, got shape {a.shape}{hint}")
    if a.dtype.kind == "b":
        return a.astype("<i8"), None, "boolean labels as 0/1"
    if a.dtype.kind == "f":
        if n and not (np.all(np.isfinite(a)) and np.all(a == np.round(a))):
            raise MigrationError(f"{where}: labels are {a.dtype} with non-integer values{hint}")
        a = a.astype(np.int64)
    elif a.dtype.kind not in "iu":
        raise MigrationError(f"{where}: labels of dtype {a.dtype} are not class labels{hint}")
    if n and a.dtype.kind == "u" and a.dtype.itemsize == 8 and int(a.max()) > np.iinfo(np.int64).max:
        raise MigrationError(f"{where}: labels do not fit int64{hint}")
    if n and int(a.min()) < 0:
        raise MigrationError(f"{where}: labels include negative values ({int(a.min())}){hint}")
    return a.astype("<i8"), None, f"{a.dtype} labels"
