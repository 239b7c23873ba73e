"""bcolz sources for the migration pipeline: one carray, two carrays (images + labels), a ctable."""

from __future__ import annotations

import numbers
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.errors import MigrationError
from carraystore.migrations.base import Block, Source, disk_size, labels_from_array
from carraystore.migrations.bcolz import CarrayReader, CtableReader

__all__ = ["CarraySource", "TwoArraySource", "CtableSource", "object_conversion"]

#: Column names taken as labels when a ctable's labels column is not given.
LABEL_NAMES = ("label", "labels", "y", "target", "targets", "class", "classes", "category")


def _bcolz_provenance(r: CarrayReader) -> dict[str, Any]:
    return {
        "dtype": str(r.dtype),
        "shape": list(r.shape),
        "chunklen": r.chunklen,
        "cparams": {k: v for k, v in r.cparams.items() if isinstance(v, (str, int, float, bool))},
    }


# -- object-dtype carrays ------------------------------------------------------------------


def object_conversion(
    reader: CarrayReader,
) -> tuple[np.dtype, tuple[int, ...], Callable[[np.ndarray], np.ndarray], str]:
    """Scan an object carray and pick a fixed-size dtype that holds every element exactly.

    All str -> unicode 'U<n>'; all bytes -> 'S<n>'; all bool -> bool; all int -> int64;
    ints and floats -> float64 (when every int is exact as a float); arrays of one shape and
    dtype -> stacked. Anything else is a MigrationError listing the element types.
    Returns (dtype, item_shape, convert(block) -> array, description).
    """
    types: Counter[str] = Counter()
    kinds: set[str] = set()
    maxlen = 0
    shapes: set[tuple[Any, ...]] = set()
    big_int = False
    for chunk in reader.iter_chunks():
        for x in chunk.reshape(-1):
            types[type(x).__name__] += 1
            if isinstance(x, (bool, np.bool_)):
                kinds.add("bool")
            elif isinstance(x, str):
                kinds.add("str")
                maxlen = max(maxlen, len(x))
            elif isinstance(x, bytes):
                kinds.add("bytes")
                maxlen = max(maxlen, len(x))
            elif isinstance(x, numbers.Integral):
                kinds.add("int")
                v = int(x)
                if not -(2**63) <= v < 2**63:
                    kinds.add("hugeint")
                if abs(v) > 2**53:
                    big_int = True
            elif isinstance(x, numbers.Real):
                kinds.add("float")
            elif isinstance(x, np.ndarray) and not x.dtype.hasobject:
                kinds.add("array")
                shapes.add((x.shape, x.dtype.str))
            else:
                kinds.add("other")
    what = ", ".join(f"{n} x {t}" for t, n in types.most_common())
    fail = MigrationError(
        f"{reader.rootdir}: an object-dtype carray whose elements ({what}) have no common fixed-size type; "
        "a store holds fixed-size items only (it never pickles). Convert them in Python first, e.g. "
        "carraystore.migrations.bcolz.CarrayReader.open(path, allow_pickle=True).read()"
    )
    if not kinds:  # empty carray
        return np.dtype("V1"), (), lambda b: np.empty((len(b),), "V1"), "empty object array"
    if (
        "other" in kinds
        or "hugeint" in kinds
        or len(kinds - {"int", "float"}) > 1
        or (kinds & {"int", "float"} and kinds - {"int", "float"})
    ):
        raise fail
    kind = next(iter(kinds)) if len(kinds) == 1 else "float"
    if kind == "float" and "int" in kinds and big_int:
        raise MigrationError(f"{reader.rootdir}: mixes floats with integers too large to be exact as float64 ({what})")
    item_shape: tuple[int, ...] = ()
    if kind == "str":
        dt = np.dtype(f"<U{max(1, maxlen)}")
    elif kind == "bytes":
        dt = np.dtype(f"S{max(1, maxlen)}")
    elif kind == "bool":
        dt = np.dtype(bool)
    elif kind == "int":
        dt = np.dtype("<i8")
    elif kind == "float":
        dt = np.dtype("<f8")
    else:
        if len(shapes) != 1:
            raise MigrationError(
                f"{reader.rootdir}: the arrays in this object carray differ in shape or dtype: {sorted(shapes)[:5]}"
            )
        shape, dts = next(iter(shapes))
        item_shape, dt = tuple(shape), np.dtype(dts)

    def convert(block: np.ndarray) -> np.ndarray:
        out = np.empty((len(block), *item_shape), dtype=dt)
        for i, x in enumerate(block.reshape(-1)):
            out[i] = x
        return out

    return dt, item_shape, convert, f"object elements ({what}) stored as {dt}{list(item_shape) if item_shape else ''}"


# -- sources -------------------------------------------------------------------------------


class CarraySource(Source):
    """One bcolz carray: rows of any shape and dtype, kept exactly."""

    kind = "bcolz carray"

    def __init__(self, path: Path, *, allow_pickle: bool = False) -> None:
        super().__init__()
        self.path = path
        self.reader = CarrayReader.open(path, allow_pickle=allow_pickle)
        r = self.reader
        self.nrows = r.nrows
        self.attrs = r.attrs
        self.codec = r.codec
        self.provenance = {"bcolz": _bcolz_provenance(r)}
        self._convert: Callable[[np.ndarray], np.ndarray] | None = None
        if r.is_object:
            if len(r.shape) != 1:
                raise MigrationError(f"{path}: a multi-dimensional object carray {r.shape}; not supported")
            self.dtype, self.item_shape, self._convert, what = object_conversion(r)
            self.notes.append(what)
            self.provenance["bcolz"]["object_conversion"] = what
        else:
            self.dtype, self.item_shape = r.dtype, r.item_shape
        self.warnings += r.warnings
        self.notes += r.notes

    def blocks(self) -> Iterator[Block]:
        if self._convert is not None:
            for block in self.reader.iter_blocks(4096):
                yield Block(self._convert(block))
            return
        for chunk in self.reader.iter_chunks():
            yield Block(chunk)


class TwoArraySource(Source):
    """The common pattern of two carrays: images (N, ...) and labels (N,) or one-hot (N, K)."""

    kind = "bcolz carrays (images + labels)"

    def __init__(self, images: Path, labels: Path | None, *, allow_pickle: bool = False) -> None:
        super().__init__()
        self.path = images
        self.images = CarraySource(images, allow_pickle=allow_pickle)
        self.item_shape, self.dtype, self.nrows = self.images.item_shape, self.images.dtype, self.images.nrows
        self.attrs = self.images.attrs
        self.codec = self.images.codec
        self.provenance = {"bcolz": self.images.provenance["bcolz"]}
        self.warnings += self.images.warnings
        self.notes += self.images.notes
        self.labels_path = labels
        self._labels: np.ndarray | None = None
        if labels is not None:
            lab = CarrayReader.open(labels)
            if lab.nrows != self.nrows:
                raise MigrationError(
                    f"{labels}: {lab.nrows} labels for {self.nrows} images in {images}; they must match"
                )
            self._labels, self.class_names, how = labels_from_array(lab.read(), str(labels))
            self.has_labels = True
            self.notes.append(f"labels from {labels.name}: {how}")
            self.warnings += lab.warnings
            self.provenance["labels"] = {"name": labels.name, **_bcolz_provenance(lab), "attrs": lab.attrs}
            self.kind = "bcolz carrays (images + labels)"
        else:
            self.kind = "bcolz carray"

    @property
    def cbytes(self) -> int:
        return disk_size(self.path) + (disk_size(self.labels_path) if self.labels_path else 0)

    def blocks(self) -> Iterator[Block]:
        pos = 0
        for block in self.images.blocks():
            n = len(block.data)
            lab = self._labels[pos : pos + n] if self._labels is not None else None
            yield Block(block.data, labels=lab)
            pos += n


class CtableSource(Source):
    """A bcolz ctable. With an images column (given or inferred: the one column whose rows
    have 2+ dimensions) the store holds that column, labels come from the labels column
    (given or inferred by name), and every other column is kept as a metadata column.
    Without one, the store holds the whole table as one structured array, fields in
    column order (minus the labels column if one was given)."""

    kind = "bcolz ctable"

    def __init__(self, path: Path, *, images: str | None, labels: str | None, allow_pickle: bool = False) -> None:
        super().__init__()
        self.path = path
        self.table = t = CtableReader.open(path, allow_pickle=allow_pickle)
        self.nrows = t.nrows
        self.attrs = t.attrs
        for name in (images, labels):
            if name is not None and name not in t.names:
                raise MigrationError(f"{path}: no column {name!r}; the ctable's columns are {t.names}")
        if images is not None and images == labels:
            raise MigrationError(f"{path}: --images and --labels name the same column {images!r}")
        for name, col in t.columns.items():
            if col.is_object:
                raise MigrationError(f"{path}: column {name!r} holds Python objects; a store cannot keep them")
        if images is None:
            multi = [n for n in t.names if len(t.columns[n].item_shape) >= 2 and n != labels]
            if len(multi) > 1:
                raise MigrationError(
                    f"{path}: several columns could be the images ({multi}); choose one with --images NAME"
                )
            if multi:
                images = multi[0]
                self.notes.append(f"images column inferred: {images!r} (the only column with 2+ dimensions per row)")
        if images is not None and labels is None:
            named = [n for n in t.names if n.lower() in LABEL_NAMES and n != images]
            if len(named) == 1:
                labels = named[0]
                self.notes.append(f"labels column inferred: {labels!r}")
            else:
                self.notes.append("no labels column inferred (pass --labels NAME to choose one)")
        self.images_name, self.labels_name = images, labels
        self._labels: np.ndarray | None = None
        if labels is not None:
            self._labels, self.class_names, how = labels_from_array(
                t.columns[labels].read(), f"{path}, column {labels!r}"
            )
            self.has_labels = True
            self.notes.append(f"labels from column {labels!r}: {how}")
        others = [n for n in t.names if n not in (images, labels)]
        if images is not None:
            col = t.columns[images]
            self.item_shape, self.dtype = col.item_shape, col.dtype
            self.data_names = [images]
            self.column_names = others
            if others:
                self.notes.append(f"columns kept as per-item metadata: {others}")
        else:
            if not others:
                raise MigrationError(f"{path}: nothing left to store besides the labels column {labels!r}")
            self.item_shape = ()
            self.dtype = np.dtype(
                [
                    (n, t.columns[n].dtype, t.columns[n].item_shape)
                    if t.columns[n].item_shape
                    else (n, t.columns[n].dtype)
                    for n in others
                ]
            )
            self.data_names = others
            self.column_names = []
            self.notes.append(f"no images column: the store holds the table as one structured array of fields {others}")
        codecs = sorted({c.codec for c in t.columns.values()})
        self.codec = ", ".join(codecs)
        self.warnings += t.warnings
        self.notes += t.notes
        self.provenance = {
            "bcolz": {
                "columns": {n: _bcolz_provenance(c) for n, c in t.columns.items()},
                "images_column": images,
                "labels_column": labels,
            }
        }
        col_attrs = {n: c.attrs for n, c in t.columns.items() if c.attrs}
        if col_attrs:
            self.provenance["bcolz"]["column_attrs"] = col_attrs

    def blocks(self) -> Iterator[Block]:
        rows = self.block_rows
        pos = 0
        names = self.data_names + self.column_names
        for cols in self.table.iter_blocks(rows, names):
            if self.images_name is not None:
                data = cols[self.images_name]
            else:
                n = len(cols[self.data_names[0]])
                data = np.empty(n, dtype=self.dtype)
                for name in self.data_names:
                    data[name] = cols[name]
            n = len(data)
            lab = self._labels[pos : pos + n] if self._labels is not None else None
            extra = {name: cols[name] for name in self.column_names} or None
            yield Block(data, labels=lab, columns=extra)
            pos += n
