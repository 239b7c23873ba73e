"""HDF5 sources (h5py, an optional extra): one dataset of rows, optionally a labels dataset.

The dataset is read a block of rows at a time, blocks aligned to the dataset's own HDF5
chunking when it has one, so memory stays at a few chunks whatever the file size.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.errors import MigrationError, MissingDependencyError
from carraystore.migrations.base import (
    CLASS_NAME_DATASETS,
    LABEL_NAMES,
    MIGRATION_BLOCK_BYTES,
    Block,
    Source,
    infer_labels,
    labels_from_array,
)

__all__ = ["Hdf5Source", "jsonable", "LABEL_NAMES", "CLASS_NAME_DATASETS"]


#: Dataset names (last path part, lower case) preferred as labels when several could be.
def _h5py() -> Any:
    try:
        import h5py
    except ImportError as exc:
        raise MissingDependencyError(
            "reading HDF5 files needs h5py: pip install 'carraystore[migrate]'  (or: pip install h5py)"
        ) from exc
    return h5py


def jsonable(value: Any) -> tuple[Any, bool]:
    """An HDF5 attribute as a JSON value: (value, exact). Non-representable values become their repr."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8"), True
        except UnicodeDecodeError:
            return value.decode("latin1"), False
    if isinstance(value, np.generic):
        value = value.item()
        if isinstance(value, bytes):
            return jsonable(value)
    if isinstance(value, np.ndarray):
        if value.dtype.kind in "biufU":
            return value.tolist(), value.dtype.kind != "f" or bool(np.all(np.isfinite(value)))
        if value.dtype.kind == "S":
            return [jsonable(v)[0] for v in value.reshape(-1).tolist()], True
        if value.dtype.kind == "O":
            items = [jsonable(v) for v in value.reshape(-1).tolist()]
            return [v for v, _ in items], all(ok for _, ok in items)
        return repr(value), False
    if isinstance(value, (str, bool, int)) or value is None:
        return value, True
    if isinstance(value, float):
        return value, bool(np.isfinite(value))
    return repr(value), False


def _is_text(h5py: Any, d: Any) -> bool:
    """Whether an HDF5 dataset holds strings (fixed-length bytes or variable-length text)."""
    return d.dtype.kind in "SU" or h5py.check_string_dtype(d.dtype) is not None


def _check_inside(path: Path, name: str, d: Any) -> None:
    """Refuse a dataset whose bytes live outside the file: external storage (raw bytes of any
    file the user can read) or a virtual dataset (mapped from other files). A migration reads
    only the file named on the command line."""
    if d.external:
        files = sorted({str(e[0]) for e in d.external})
        raise MigrationError(
            f"{path}, dataset {name!r}: its data is stored outside the file (HDF5 external storage in {files[:3]}); "
            "a migration reads only the file it is given, never other files it points at. Copy the data into the "
            "file (e.g. h5py: create a dataset from its values) and migrate that"
        )
    if d.is_virtual:
        raise MigrationError(
            f"{path}, dataset {name!r}: a virtual dataset (its data is mapped from other files or datasets); "
            "a migration reads only the file it is given. Copy the data into a regular dataset and migrate that"
        )


class Hdf5Source(Source):
    """One HDF5 dataset (rows along the first axis) with optional labels from another dataset."""

    kind = "HDF5 dataset"

    def __init__(
        self, path: Path, *, dataset: str | None = None, labels: str | None = None, no_labels: bool = False
    ) -> None:
        super().__init__()
        h5py = _h5py()
        self.path = path
        try:
            self._file = h5py.File(path, "r")
        except OSError as exc:
            raise MigrationError(f"{path}: cannot be opened as HDF5 ({exc}); it may be truncated or damaged") from exc
        f = self._file
        found: list[str] = []
        f.visititems(lambda name, obj: found.append(name) if isinstance(obj, h5py.Dataset) else None)
        if not found:
            raise MigrationError(f"{path}: holds no datasets")
        if dataset is None:
            candidates = [n for n in found if n != labels and f[n].ndim >= 1 and not _is_text(h5py, f[n])]
            big = [n for n in candidates if f[n].ndim >= 3]
            two = [n for n in candidates if f[n].ndim >= 2]
            if len(candidates) == 1:
                dataset = candidates[0]
            elif len(big) == 1:
                dataset = big[0]
                self.notes.append(f"dataset inferred: {dataset!r} (the only one with 3+ dimensions)")
            elif not big and len(two) == 1:
                dataset = two[0]
                self.notes.append(f"dataset inferred: {dataset!r} (the only one with 2+ dimensions)")
            else:
                raise MigrationError(
                    f"{path}: holds datasets {found[:20]}; choose one with --dataset NAME (and --labels NAME)"
                )
        for name in (dataset, labels):
            if name is not None and (name not in f or not isinstance(f[name], h5py.Dataset)):
                raise MigrationError(f"{path}: no dataset {name!r}; the file holds {found[:20]}")
        for name in (dataset, labels):
            if name is not None:
                _check_inside(path, name, f[name])
        d = f[dataset]
        self._dataset = d
        self.dataset_name = dataset
        if d.ndim == 0:
            raise MigrationError(f"{path}, dataset {dataset!r}: a scalar; nothing to store row by row")
        if d.dtype.hasobject or h5py.check_vlen_dtype(d.dtype) is not None:
            raise MigrationError(
                f"{path}, dataset {dataset!r}: variable-length data ({d.dtype}); a store holds fixed-size items only"
            )
        self.dtype = np.dtype(d.dtype)
        self.nrows, self.item_shape = int(d.shape[0]), tuple(int(x) for x in d.shape[1:])
        self._labels = None
        if labels is None and not no_labels:
            labels = self._infer_labels(found, dataset)
        if labels is not None:
            lab = f[labels]
            if lab.shape[:1] != (self.nrows,):
                raise MigrationError(
                    f"{path}: dataset {labels!r} has shape {lab.shape} for {self.nrows} rows of {dataset!r}"
                )
            self._labels, self.class_names, how = labels_from_array(lab[...], f"{path}, dataset {labels!r}")
            self.has_labels = True
            self.notes.append(f"labels from {labels!r}: {how}")
            if self.class_names is None:
                self.class_names = self._class_names_dataset(found, labels)
                top = int(self._labels.max()) if len(self._labels) else -1
                if self.class_names is not None and top >= len(self.class_names):
                    raise MigrationError(
                        f"{path}: labels {labels!r} go up to {top} but the class names dataset holds {len(self.class_names)} "
                        "names; give the right ones with --class-names A,B,C"
                    )
        #: bytes of the migrated datasets in the file (the images and the labels), not the whole file
        self._cbytes = int(d.id.get_storage_size()) + (
            int(f[labels].id.get_storage_size()) if labels is not None else 0
        )
        attrs: dict[str, Any] = {}
        inexact = []
        for k, v in d.attrs.items():
            attrs[k], ok = jsonable(v)
            if not ok:
                inexact.append(k)
        try:
            json.dumps(attrs)
        except (TypeError, ValueError):  # pragma: no cover - jsonable covers h5py's types
            attrs = {k: repr(v) for k, v in attrs.items()}
        if inexact:
            self.warnings.append(f"HDF5 attribute(s) {inexact} are not exact in JSON; stored as text")
        self.attrs = attrs
        comp = d.compression or "uncompressed"
        if d.compression_opts is not None:
            comp += f"-{d.compression_opts}"
        if d.shuffle:
            comp += " shuffle"
        self.codec = f"hdf5 {comp}" + (f" chunks {list(d.chunks)}" if d.chunks else " contiguous")
        self.provenance = {
            "hdf5": {"dataset": dataset, "labels": labels, "chunks": list(d.chunks) if d.chunks else None}
        }

    @property
    def cbytes(self) -> int:
        """Bytes the migrated datasets (images and labels) take in the file."""
        return self._cbytes

    def _infer_labels(self, found: list[str], dataset: str) -> str | None:
        """The labels dataset beside ``dataset`` when exactly one fits (1-D integers, one per row); else stop."""
        f = self._file
        fits = [
            n
            for n in found
            if n != dataset and f[n].shape in ((self.nrows,), (self.nrows, 1)) and f[n].dtype.kind in "iub"
        ]
        return infer_labels(fits, dataset, str(self.path), self.notes)

    def _class_names_dataset(self, found: list[str], labels: str) -> tuple[str, ...] | None:
        """Class names from a dataset named class_names / classes / label_names (beside the labels first)."""
        h5py = _h5py()
        f = self._file
        group = labels.rsplit("/", 1)[0] if "/" in labels else ""
        names = [
            n
            for n in found
            if n.rsplit("/", 1)[-1].lower() in CLASS_NAME_DATASETS and _is_text(h5py, f[n]) and f[n].ndim == 1
        ]
        if not names:
            return None
        names.sort(key=lambda n: (n.rsplit("/", 1)[0] if "/" in n else "") != group)
        _check_inside(self.path, names[0], f[names[0]])
        values = tuple(str(v) for v in f[names[0]].asstr()[...].tolist())
        self.notes.append(
            f"class names from dataset {names[0]!r}: {list(values)[:10]}{' ...' if len(values) > 10 else ''}"
        )
        return values

    @property
    def block_rows(self) -> int:
        rows = max(1, MIGRATION_BLOCK_BYTES // max(1, self.row_nbytes))
        chunks = self._dataset.chunks
        if chunks:  # whole HDF5 chunks per block: each is decompressed once
            rows = max(chunks[0], rows - rows % chunks[0])
        return rows

    def blocks(self) -> Iterator[Block]:
        d = self._dataset
        rows = self.block_rows
        for a in range(0, self.nrows, rows):
            b = min(a + rows, self.nrows)
            out = np.empty((b - a, *self.item_shape), dtype=self.dtype)
            if b > a:
                d.read_direct(out, np.s_[a:b])
            lab = self._labels[a:b] if self._labels is not None else None
            yield Block(out, labels=lab)

    def close(self) -> None:
        try:
            self._file.close()
        except Exception:  # pragma: no cover - closing twice
            pass
