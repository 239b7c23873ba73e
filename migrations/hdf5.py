"""HDF5 sources (h5py, an optional extra): one dataset of rows, read in blocks aligned to its HDF5 chunks."""

from __future__ import annotations

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

__all__ = [
    "Hdf5Source",
    "hdf5_split_groups",
    "split_groups",
    "ATTR_MAX_BYTES",
    "LABEL_NAMES",
    "CLASS_NAME_DATASETS",
]


def _h5py() -> Any:
    try:
        import h5py
    except ImportError as exc:
        raise MissingDependencyError(
            "reading HDF5 files needs h5py: pip install 'carraystore[migrate]'  (or: pip install h5py)"
        ) from exc
    return h5py


#: An HDF5 attribute whose values take more bytes than this is left out, with a note (a store's whole
#: metadata record is bounded: FORMAT.md, Limits).
ATTR_MAX_BYTES = 1024 * 1024


class _LeftOut(Exception):
    """An HDF5 attribute value no store can keep (the message says why)."""


def _leaves(value: Any, fn: Any) -> Any:
    """``fn`` applied to every non-list element of nested lists (``ndarray.tolist()``'s shape kept)."""
    return [_leaves(v, fn) for v in value] if isinstance(value, list) else fn(value)


def _attribute_value(h5py: Any, value: Any) -> tuple[Any, str | None]:
    """An HDF5 attribute as a store keeps it: (value, None) when exact, (text, why) when kept as text.

    Integers, floats (NaN and infinities too), booleans and UTF-8 text are exact, arrays as nested
    lists; an empty attribute is None; complex, compound and other values become their text.
    Raises ``_LeftOut`` for what cannot be kept: references into the file, values over ATTR_MAX_BYTES.
    """
    if isinstance(value, h5py.Empty):
        return None, None
    if isinstance(value, (h5py.Reference, h5py.RegionReference)):
        raise _LeftOut(_reference(h5py, value))
    a = np.asarray(value)
    if a.nbytes > ATTR_MAX_BYTES:
        raise _LeftOut(f"{a.nbytes} bytes, more than an attribute kept in a store's metadata ({ATTR_MAX_BYTES})")
    kind = a.dtype.kind
    if kind in "biufU":
        return a.tolist(), None
    whys: set[str] = set()
    if kind == "S":
        return _leaves(a.tolist(), lambda b: _text(b, whys)), _why(whys)
    if kind == "O":
        return _leaves(a.tolist(), lambda v: _element(h5py, v, whys)), _why(whys)
    return str(a.tolist()), "complex numbers" if kind == "c" else f"{a.dtype} values"


def _reference(h5py: Any, value: Any, many: bool = False) -> str:
    region = isinstance(value, h5py.RegionReference)
    if many:
        return f"{'region' if region else 'object'} references: they point into the HDF5 file, which the store does not hold"
    return f"{'a region' if region else 'an object'} reference: it points into the HDF5 file, which the store does not hold"


def _why(whys: set[str]) -> str | None:
    return "; ".join(sorted(whys)) or None


def _text(b: bytes, whys: set[str]) -> str:
    try:
        return b.decode("utf-8")
    except UnicodeDecodeError:
        whys.add("bytes that are not UTF-8, decoded as Latin-1")
        return b.decode("latin1")


def _element(h5py: Any, v: Any, whys: set[str]) -> Any:
    """One element of an object array (variable-length text or sequences, references)."""
    if isinstance(v, (h5py.Reference, h5py.RegionReference)):
        raise _LeftOut(_reference(h5py, v, many=True))
    if isinstance(v, str):
        return v
    if isinstance(v, bytes):
        return _text(v, whys)
    if v is None or isinstance(v, (bool, int, float)):
        return v
    if not isinstance(v, np.ndarray):
        whys.add(f"{type(v).__name__} values")
        return str(v)
    value, why = _attribute_value(h5py, v)
    if why is not None:
        whys.add(why)
    return value


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


def _groups_above(names: list[str]) -> set[str]:
    """The groups that hold the objects ``names`` (paths without the leading /), the file's root "" included."""
    return {""} | {n.rsplit("/", i)[0] for n in names for i in range(1, n.count("/") + 1)}


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
        #: where the store's class names come from: a class names dataset, or the labels' text
        self._names_used: str | None = None
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
            describe=lambda n: repr(n[len(prefix) :]) + (f" (from /{n})" if prefix else ""),
        )
        labels = plan.labels
        self._labels = None
        if labels is not None:
            where = f"{path}, dataset {labels!r}"
            self._labels, self.class_names, how = class_labels(f[labels][...], where, plan.onehot)
            self.has_labels = True
            self.notes.append(f"labels from {labels!r}: {how}")
            if self.class_names is not None:
                self._names_used = "the labels' text"
            else:
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
        text: list[str] = []  # attributes kept as text, each with why
        attrs = self._attributes(h5py, d, "/" + dataset, text)
        if labels is None:
            self._unused_class_names(names_sets, prefix, attrs)
        self._other_class_names(names_sets)
        migrated = [*([labels] if labels else []), *plan.fields]
        if self._names_used is not None and self._names_used in names_sets:
            migrated.append(self._names_used)
        self._path_attributes(h5py, everything, dataset, migrated, attrs, text)
        if text:
            self.warnings.append("HDF5 attribute(s) kept as text, not as their exact values: " + "; ".join(text))
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
        self._names_used = n
        self.notes.append(
            f"{n!r} kept as attrs['class_names'] (the store has no class labels to name; "
            "--onehot-to-class or --labels NAME gives them)"
        )

    def _other_class_names(self, names_sets: list[str]) -> None:
        """A note for each class names dataset (of this group or above it) the store's class names do not come from."""
        near = _near(names_sets, self.group)
        used = self._names_used
        for n in near if self.has_labels else near[1:]:  # without labels _unused_class_names took or named the first
            if n == used:
                continue
            if not self.has_labels:
                why = (
                    f"attrs['class_names'] holds those of {used!r}" if used else "the store has no class labels to name"
                )
            else:
                why = "the store's come from " + (used if used == "the labels' text" else repr(used))
            self.notes.append(f"not migrated: {n!r} (class names; {why})")

    def _attributes(self, h5py: Any, obj: Any, where: str, text: list[str]) -> dict[str, Any]:
        """The attributes of the HDF5 object at ``where`` a store can keep; a note names each left out."""
        kept: dict[str, Any] = {}
        for k in obj.attrs:
            try:
                raw = obj.attrs[k]
            except (OSError, KeyError, TypeError, ValueError) as exc:  # a type h5py cannot read
                self.notes.append(f"not migrated: HDF5 attribute {k!r} of {where} (h5py cannot read it: {exc})")
                continue
            try:
                value, why = _attribute_value(h5py, raw)
            except _LeftOut as exc:
                self.notes.append(f"not migrated: HDF5 attribute {k!r} of {where} ({exc})")
                continue
            kept[k] = value
            if why is not None:
                text.append(f"{k!r} of {where} ({why})")
        return kept

    def _path_attributes(
        self, h5py: Any, everything: list[str], images: str, migrated: list[str], attrs: dict[str, Any], text: list[str]
    ) -> None:
        """Into ``attrs``, each under its HDF5 path ("/", "/train", "/train/labels"): the attributes of the
        file, of every group above a migrated dataset, of groups holding no datasets, and of the migrated
        datasets besides the images (whose attributes are ``attrs`` itself). Notes name the rest."""
        f = self._file
        groups = [""]
        f.visititems(lambda name, obj: groups.append(name) if isinstance(obj, h5py.Group) else None)
        above, holding = _groups_above([images, *migrated]), _groups_above(everything)
        keep = list(migrated)
        for g in groups:
            # the nearest group holding datasets, g or above it (the root counts: it is always kept)
            near = next(a for a in [g, *(g.rsplit("/", i)[0] for i in range(1, g.count("/") + 1)), ""] if a in holding)
            if near in above:
                keep.append(g)
            elif len(f[g].attrs) and (self.group is None or g == self.group or g.startswith(self.group + "/")):
                inside = "a group" if near == g else f"a group of attributes only, inside /{near}:"
                self.notes.append(f"not migrated: the attributes of /{g} ({inside} none of whose datasets is migrated)")
        for name in sorted(keep, key=lambda n: "/" + n):
            where = "/" + name
            values = self._attributes(h5py, f[where], where, text)
            if not values:
                continue
            if where in attrs:
                self.notes.append(
                    f"not migrated: the attributes of {where} (attrs[{where!r}] is taken by an attribute of {images!r})"
                )
                continue
            attrs[where] = values

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
        self._names_used = names[0]
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
