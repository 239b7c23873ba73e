"""bcolz sources for the migration pipeline: one carray, two carrays (images + labels), a ctable."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.base.errors import MigrationError

from .base import (
    Block,
    OneHotLabelsError,
    Source,
    class_labels,
    disk_size,
    labels_from_array,
    object_conversion_of,
)
from .bcolz import CarrayReader, CtableReader, default_codec_for

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
    """:func:`carraystore.migrations.base.object_conversion_of` of an object carray."""
    return object_conversion_of(
        reader.iter_chunks,
        str(reader.rootdir),
        "carraystore.migrations.bcolz.CarrayReader.open(path, allow_pickle=True).read()",
    )


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
        self.default_codec = default_codec_for(r.cparams, self.dtype.itemsize)
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
        self.default_codec = self.images.default_codec
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
    """A bcolz ctable: the images column (given, or the one with 2+-D rows), labels and other
    columns as fields; without one, the whole table as a structured array (less the labels)."""

    kind = "bcolz ctable"

    def __init__(
        self,
        path: Path,
        *,
        images: str | None,
        labels: str | None,
        allow_pickle: bool = False,
        onehot: bool = False,
    ) -> None:
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
        inferred = False
        if images is not None and labels is None:
            named = [n for n in t.names if n.lower() in LABEL_NAMES and n != images]
            if len(named) == 1:
                labels, inferred = named[0], True
            else:
                self.notes.append("no labels column inferred (pass --labels NAME to choose one)")
        self.images_name = images
        self._labels: np.ndarray | None = None
        if labels is not None:
            where = f"{path}, column {labels!r}"
            values = t.columns[labels].read()
            try:
                self._labels, self.class_names, how = class_labels(values, where, onehot)
            except MigrationError as exc:
                if not inferred or isinstance(exc, OneHotLabelsError):
                    raise
                # a column named like labels that holds no class labels (floats, vectors): a target field
                self.notes.append(
                    f"column {labels!r} ({values.dtype}{list(values.shape[1:])}) is not integer class labels: kept as "
                    f"the target field {labels!r}"
                    + ("; --onehot-to-class makes class labels of one-hot rows" if values.ndim == 2 else "")
                )
                labels = None
        if labels is not None:
            if inferred:
                self.notes.append(f"labels column inferred: {labels!r}")
            self.has_labels = True
            self.notes.append(f"labels from column {labels!r}: {how}")
        self.labels_name = labels
        others = [n for n in t.names if n not in (images, labels)]
        if images is not None:
            col = t.columns[images]
            self.item_shape, self.dtype = col.item_shape, col.dtype
            self.default_codec = default_codec_for(col.cparams, self.dtype.itemsize)
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
