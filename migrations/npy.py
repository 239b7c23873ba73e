"""``.npy`` sources (labels: a second ``.npy``); pickled arrays only with ``allow_pickle`` (unpickling runs code)."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from carraystore.base.errors import MigrationError

from .base import (
    Block,
    PickleNotAllowedError,
    Source,
    class_labels,
    disk_size,
    fixed_from_objects,
)
from .npz import _read_exact, read_npy_header

__all__ = ["NpySource", "PickleSource", "NPY_MAGIC", "is_pickle"]

NPY_MAGIC = b"\x93NUMPY"
_PICKLE_SUFFIXES = {".pkl", ".pickle", ".pck"}


def is_pickle(path: Path, head: bytes) -> bool:
    """Whether ``path`` looks like a pickle: a pickle suffix, or the PROTO opcode of protocol 2 and later."""
    return path.suffix.lower() in _PICKLE_SUFFIXES or (len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5)


def _refuse_pickle(path: Path) -> None:
    raise PickleNotAllowedError(
        f"{path}: a pickle; unpickling runs code from the file. Only for a file you trust: pass --allow-pickle "
        "(allow_pickle=True); or save the arrays with np.save / np.savez, which need no pickle"
    )


class _ArraySource(Source):
    """Rows of one array (in memory or streamed), with optional labels from a second array file."""

    def _set_labels(self, labels: Path | None, allow_pickle: bool, onehot: bool) -> None:
        self._labels: np.ndarray | None = None
        self.labels_path = labels
        if labels is None:
            self.notes.append("no labels (one array; give a second .npy with --labels FILE)")
            return
        lab = _load_npy(labels, allow_pickle, self.notes)
        where = str(labels)
        if lab.shape[:1] != (self.nrows,):
            raise MigrationError(f"{labels}: {lab.shape} labels for {self.nrows} rows of {self.path}")
        self._labels, self.class_names, how = class_labels(lab, where, onehot)
        self.has_labels = True
        self.notes.append(f"labels from {labels.name}: {how}")

    @property
    def cbytes(self) -> int:
        return disk_size(self.path) + (disk_size(self.labels_path) if self.labels_path else 0)


def _load_npy(path: Path, allow_pickle: bool, notes: list[str]) -> np.ndarray:
    """A whole ``.npy`` file (a labels array); objects only with ``allow_pickle``."""
    with open(path, "rb") as f:
        if f.read(6) != NPY_MAGIC:
            raise MigrationError(f"{path}: labels for a .npy must be a .npy file too")
        f.seek(0)
        read_npy_header(f, str(path), allow_objects=allow_pickle)
        f.seek(0)
        return fixed_from_objects(np.lib.format.read_array(f, allow_pickle=allow_pickle), str(path), notes)


class NpySource(_ArraySource):
    """A ``.npy`` file's rows, a block at a time (Fortran-order or object arrays in one piece)."""

    kind = ".npy array"

    def __init__(
        self, path: Path, *, labels: Path | None = None, allow_pickle: bool = False, onehot: bool = False
    ) -> None:
        super().__init__()
        self.path = path
        self.attrs = {}
        self.codec = "uncompressed (np.save)"
        with open(path, "rb") as f:
            shape, self._fortran, dtype = read_npy_header(f, str(path), allow_objects=allow_pickle)
            self._offset = f.tell()
        self._whole: np.ndarray | None = None
        if dtype.hasobject:
            with open(path, "rb") as f:
                self._whole = fixed_from_objects(np.lib.format.read_array(f, allow_pickle=True), str(path), self.notes)
            shape, dtype = self._whole.shape, self._whole.dtype
            self.codec = "pickled objects (np.save of an object array)"
        elif self._fortran:
            self.warnings.append("the array is stored in Fortran order: it is read in one piece, not streamed")
        if not shape:
            raise MigrationError(f"{path}: a scalar; nothing to store row by row")
        self.dtype, self.nrows, self.item_shape = dtype, int(shape[0]), tuple(int(x) for x in shape[1:])
        self._set_labels(labels, allow_pickle, onehot)
        self.provenance = {"npy": {"shape": list(shape), "fortran_order": self._fortran}}

    def blocks(self) -> Iterator[Block]:
        rows = self.block_rows
        if self._whole is None and self._fortran:
            with open(self.path, "rb") as f:
                self._whole = np.ascontiguousarray(np.lib.format.read_array(f, allow_pickle=False))
        for a in range(0, self.nrows, rows):
            b = min(a + rows, self.nrows)
            lab = self._labels[a:b] if self._labels is not None else None
            if self._whole is not None:
                yield Block(self._whole[a:b], labels=lab)
                continue
            with open(self.path, "rb") as f:
                f.seek(self._offset + a * self.row_nbytes)
                data = _read_exact(f, (b - a) * self.row_nbytes, str(self.path))
            yield Block(np.frombuffer(data, dtype=self.dtype).reshape((b - a, *self.item_shape)), labels=lab)


class PickleSource(_ArraySource):
    """A pickled numpy array (``pickle.dump(a, f)``, ``a.dump(path)``), only with ``allow_pickle``."""

    kind = "pickled numpy array"

    def __init__(
        self, path: Path, *, labels: Path | None = None, allow_pickle: bool = False, onehot: bool = False
    ) -> None:
        super().__init__()
        self.path = path
        if not allow_pickle:
            _refuse_pickle(path)
        try:
            with open(path, "rb") as f:
                value = pickle.load(f)  # noqa: S301 - the user passed --allow-pickle for this file
        except Exception as exc:
            raise MigrationError(f"{path}: cannot be unpickled ({type(exc).__name__}: {exc})") from exc
        if not isinstance(value, np.ndarray):
            raise MigrationError(
                f"{path}: the pickle holds a {type(value).__name__}, not a numpy array; save its arrays with "
                "np.savez(path, x=..., y=...) and migrate that .npz"
            )
        self._whole = fixed_from_objects(value, str(path), self.notes)
        if not self._whole.shape:
            raise MigrationError(f"{path}: a scalar; nothing to store row by row")
        self.attrs = {}
        self.codec = "pickle"
        self.dtype, self.nrows = self._whole.dtype, int(self._whole.shape[0])
        self.item_shape = tuple(int(x) for x in self._whole.shape[1:])
        self._set_labels(labels, allow_pickle, onehot)
        self.provenance = {"pickle": {"shape": list(self._whole.shape)}}

    def blocks(self) -> Iterator[Block]:
        rows = self.block_rows
        for a in range(0, self.nrows, rows):
            b = min(a + rows, self.nrows)
            yield Block(self._whole[a:b], labels=self._labels[a:b] if self._labels is not None else None)
