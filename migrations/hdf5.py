"""HDF5 sources (h5py, an optional extra): one dataset of rows, read in blocks aligned to its HDF5 chunks."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.base.errors import MigrationError, MissingDependencyError

from .base import (
    CLASS_NAME_DATASETS,
    LABEL_NAMES,
    MIGRATION_BLOCK_BYTES,
    Block,
    Source,
    class_labels,
    plan_arrays,
)

__all__ = ["Hdf5Source", "hdf5_split_groups", "split_groups", "jsonable", "LABEL_NAMES", "CLASS_NAME_DATASETS"]


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


def _in_group(f: Any, prefix: str, name: str | None) -> str | None:
    """``name`` inside the group ``prefix`` when it is there, else as given (a path from the file's root)."""
    if name is None or name.startswith(prefix):
        return name
    return prefix + name if prefix + name in f or name not in f else name


def _parent(name: str) -> str:
    return name.rsplit("/", 1)[0] if "/" in name else ""


def _near(names: list[str], group: str | None) -> list[str]:
    """``names`` that belong to ``group`` (in it, or in a group above it); all of them when group is None."""
    if group is None:
        return list(names)
    return [
        n
        for n in names
        if (p := _parent(n)) == "" or group == p or group.startswith(p + "/") or p.startswith(group + "/")
    ]


def _is_text(h5py: Any, d: Any) -> bool:
    """Whether an HDF5 dataset holds strings (fixed-length bytes or variable-length text)."""
    return d.dtype.kind in "SU" or h5py.check_string_dtype(d.dtype) is not None


def _check_inside(path: Path, name: str, d: Any) -> None:
    """Refuse a dataset whose bytes live outside the file (external storage, virtual datasets)."""
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


def split_groups(h5py: Any, f: Any) -> list[str]:
    """The split groups (parents of 3+-D, else 2-D, datasets: two or more, none shared) of an HDF5 file, else []."""
    found: list[tuple[str, int]] = []
    f.visititems(
        lambda name, obj: (
            found.append((name, obj.ndim))
            if isinstance(obj, h5py.Dataset) and not _is_text(h5py, obj) and obj.ndim >= 2
            else None
        )
    )
    for dims in (3, 2):
        big = [n for n, nd in found if nd >= dims]
        if big:
            parents = [n.rsplit("/", 1)[0] if "/" in n else "" for n in big]
            if len(big) >= 2 and "" not in parents and len(set(parents)) == len(parents):
                return parents
            return []
    return []


def hdf5_split_groups(path: str | os.PathLike[str]) -> list[str]:
    """:func:`split_groups` of the HDF5 file at ``path`` ([] when it is not HDF5 or holds no splits)."""
    h5py = _h5py()
    try:
        with h5py.File(path, "r") as f:
            return split_groups(h5py, f)
    except OSError:
        return []


class Hdf5Source(Source):
    """One HDF5 dataset of rows, optional labels, other per-row datasets as fields; ``group``: one split."""

    kind = "HDF5 dataset"

    def __init__(
        self,
        path: Path,
        *,
        dataset: str | None = None,
        labels: str | None = None,
        no_labels: bool = False,
        group: str | None = None,
        onehot: bool = False,
    ) -> None:
        super().__init__()
        h5py = _h5py()
        self.path = path
        try:
            self._file = h5py.File(path, "r")
        except OSError as exc:
            raise MigrationError(f"{path}: cannot be opened as HDF5 ({exc}); it may be truncated or damaged") from exc
        f = self._file
        everything: list[str] = []
        f.visititems(lambda name, obj: everything.append(name) if isinstance(obj, h5py.Dataset) else None)
        if not everything:
            raise MigrationError(f"{path}: holds no datasets")
        prefix = ""
        if group is not None:
            group = group.strip("/")
            if group not in f or not isinstance(f[group], h5py.Group):
                groups = split_groups(h5py, f)
                raise MigrationError(f"{path}: no group {group!r}" + (f"; its splits are {groups}" if groups else ""))
            prefix = group + "/"
            dataset = _in_group(f, prefix, dataset)
            labels = _in_group(f, prefix, labels)
        found = [n for n in everything if n.startswith(prefix)]
        if not found:
            raise MigrationError(f"{path}: group {group!r} holds no datasets")
        self.group = group
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
                splits = split_groups(h5py, f) if group is None else []
                if splits:
                    raise MigrationError(
                        f"{path}: holds one split per group {splits}; migrate them all with OUT a folder or a "
                        "name with {group} (carraystore migrate data.h5 OUT/), or one with --group NAME"
                    )
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
        if labels is not None and f[labels].shape[:1] != (self.nrows,):
            raise MigrationError(
                f"{path}: dataset {labels!r} has shape {f[labels].shape} for {self.nrows} rows of {dataset!r}"
            )
        names_sets = [
            n
            for n in everything
            if n.rsplit("/", 1)[-1].lower() in CLASS_NAME_DATASETS and _is_text(h5py, f[n]) and f[n].ndim == 1
        ]
        heads: dict[str, tuple[tuple[int, ...], np.dtype | None]] = {}
        texts: dict[str, np.ndarray] = {}
        for n in found:
            if n in names_sets:
                continue
            obj = f[n]
            shape = tuple(int(x) for x in obj.shape)
            if n != dataset and (obj.external or obj.is_virtual):  # never read: it would read another file
                self.notes.append(f"not migrated: {n!r} (its data lies outside the file: external or virtual)")
                continue
            if h5py.check_string_dtype(obj.dtype) is not None and obj.dtype.kind == "O":
                if shape[:1] == (self.nrows,) and obj.ndim == 1:  # variable-length text: fixed width, exactly
                    texts[n] = np.array(obj.asstr()[...].tolist(), dtype=str)
                    heads[n] = (shape, texts[n].dtype)
                else:
                    heads[n] = (shape, None)
            elif obj.dtype.hasobject or h5py.check_vlen_dtype(obj.dtype) is not None:
                heads[n] = (shape, None)
            else:
                heads[n] = (shape, np.dtype(obj.dtype))
        plan = plan_arrays(
            heads,
            dataset,
            self.nrows,
            labels=labels,
            no_labels=no_labels,
            onehot=onehot,
            exclude=(),
            where=str(path),
            notes=self.notes,
        )
        labels = plan.labels
        self._labels = None
        if labels is not None:
            where = f"{path}, dataset {labels!r}"
            self._labels, self.class_names, how = class_labels(f[labels][...], where, plan.onehot)
            self.has_labels = True
            self.notes.append(f"labels from {labels!r}: {how}")
            if self.class_names is None:
                self.class_names = self._class_names_dataset(names_sets, labels)
                top = int(self._labels.max()) if len(self._labels) else -1
                if self.class_names is not None and top >= len(self.class_names):
                    raise MigrationError(
                        f"{path}: labels {labels!r} go up to {top} but the class names dataset holds {len(self.class_names)} "
                        "names; give the right ones with --class-names A,B,C"
                    )
        self._fields: dict[str, np.ndarray] = {}
        for n in plan.fields:
            self._fields[n[len(prefix) :]] = texts[n] if n in texts else f[n][...]
        for n, why in plan.skipped.items():
            self.notes.append(f"not migrated: {n!r} ({why})")
        #: bytes of the migrated datasets in the file (images, labels, fields), not the whole file
        self._cbytes = sum(
            int(f[n].id.get_storage_size()) for n in [dataset, *([labels] if labels else []), *plan.fields]
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
        if labels is None:
            self._unused_class_names(names_sets, prefix, attrs)
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
        if group is not None:
            self.provenance["hdf5"]["group"] = group
        if plan.fields:
            self.provenance["hdf5"]["fields"] = plan.fields

    def _unused_class_names(self, names_sets: list[str], prefix: str, attrs: dict[str, Any]) -> None:
        """Without labels, a class names dataset (of this group or above it) goes into attrs, with a note."""
        mine = _near(names_sets, self.group)
        if not mine:
            return
        n = mine[0]
        _check_inside(self.path, n, self._file[n])
        values = [str(v) for v in self._file[n].asstr()[...].tolist()]
        if "class_names" in attrs:
            self.notes.append(
                f"not migrated: {n!r} (class names, but there are no class labels and attrs['class_names'] is taken)"
            )
            return
        attrs["class_names"] = values
        self.notes.append(
            f"{n!r} kept as attrs['class_names'] (the store has no class labels to name; "
            "--onehot-to-class or --labels NAME gives them)"
        )

    def fields_block(self, a: int, b: int) -> dict[str, np.ndarray] | None:
        """The fields of rows ``a:b`` (None when there are none)."""
        return {n: c[a:b] for n, c in self._fields.items()} or None

    @property
    def cbytes(self) -> int:
        """Bytes the migrated datasets (images and labels) take in the file."""
        return self._cbytes

    def _class_names_dataset(self, candidates: list[str], labels: str) -> tuple[str, ...] | None:
        """Class names from a dataset named class_names / classes / label_names (beside the labels first)."""
        f = self._file
        group = _parent(labels)
        names = _near(candidates, self.group)
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
            yield Block(out, labels=lab, columns=self.fields_block(a, b))

    def close(self) -> None:
        try:
            self._file.close()
        except Exception:  # pragma: no cover - closing twice
            pass
