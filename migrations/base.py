"""What every migration source is: a description plus a re-readable stream of row blocks."""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import re
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.base.errors import InvalidInputError, MigrationError
from carraystore.format.codec import Codec
from carraystore.format.record import COLOR_MODES, DTYPES, dtype_to_record

__all__ = [
    "Block",
    "Source",
    "ArrayPlan",
    "OneHotLabelsError",
    "PickleNotAllowedError",
    "FIELD_MAX_ROW_BYTES",
    "FIELDS_MAX_ROW_BYTES",
    "onehot_to_class",
    "object_conversion_of",
    "fixed_from_objects",
    "plan_arrays",
    "MIGRATION_BLOCK_BYTES",
    "CLASS_NAME_DATASETS",
    "LABEL_NAMES",
    "disk_size",
    "infer_labels",
    "labels_from_array",
    "class_labels",
    "store_layout",
]

#: Uncompressed bytes per block read from a source (not the store's codec.TARGET_CHUNK_BYTES).
MIGRATION_BLOCK_BYTES = 8 * 1024 * 1024

#: Names (an HDF5 dataset's last path part, an npz member; lower case) read as class names.
CLASS_NAME_DATASETS = ("class_names", "classes", "label_names", "labelnames", "target_names")

#: Names (lower case) that pick the labels when several arrays could be them.
LABEL_NAMES = frozenset({"labels", "label", "y", "targets", "target", "class", "classes_idx"})


#: A per-row array is kept as a field when one row takes at most this many bytes; larger
#: ones (masks, second images) are named in a note (migrate them as a store of their own).
FIELD_MAX_ROW_BYTES = 4096
#: Bytes per row of all fields together (the record allows METADATA_BYTES_PER_ITEM per item, keys and labels included).
FIELDS_MAX_ROW_BYTES = 8192


#: Names (last path part, lower case) of ids and indices: integers one per row, but never inferred as labels.
_ID_NAME = re.compile(r"(^|_)(id|ids|index|idx|indices|uid|key)$")


class OneHotLabelsError(MigrationError):
    """``--onehot-to-class`` met rows that are not one-hot (exactly one 1, the rest 0)."""


class PickleNotAllowedError(MigrationError):
    """The source holds pickled Python objects and ``--allow-pickle`` was not given."""


def onehot_to_class(values: np.ndarray, where: str) -> np.ndarray:
    """Class indices of one-hot rows ``(N, K)``; OneHotLabelsError naming the first row that is not one-hot."""
    a = np.asarray(values)
    if a.ndim != 2 or a.shape[1] < 2 or a.dtype.kind not in "biuf":
        raise OneHotLabelsError(
            f"{where}: --onehot-to-class needs one-hot rows (N, K>=2) of numbers, got {a.dtype}{list(a.shape)}"
        )
    ones = a == 1
    bad = ~((ones.sum(axis=1) == 1) & np.all((a == 0) | ones, axis=1))
    if bool(bad.any()):
        rows = np.flatnonzero(bad)
        raise OneHotLabelsError(
            f"{where}: {len(rows)} of {len(a)} rows are not one-hot (exactly one 1, the rest 0), first row "
            f"{int(rows[0])}: {a[rows[0]].tolist()[:16]}; leave out --onehot-to-class to keep them as a target field"
        )
    return np.argmax(a, axis=1).astype("<i8") if len(a) else np.empty(0, "<i8")


@dataclass
class ArrayPlan:
    """What becomes of the named arrays beside the images: the labels, the fields, the rest (with why)."""

    labels: str | None
    #: the labels are one-hot rows to turn into class indices (``--onehot-to-class``)
    onehot: bool
    fields: list[str]
    #: arrays left out, each with the reason
    skipped: dict[str, str]


def _looks_onehot(shape: tuple[int, ...], dtype: np.dtype, nrows: int) -> bool:
    return len(shape) == 2 and shape[0] == nrows and shape[1] > 1 and dtype.kind in "biuf"


def plan_arrays(
    heads: Mapping[str, tuple[tuple[int, ...], np.dtype | None]],
    images: str,
    nrows: int,
    *,
    labels: str | None,
    no_labels: bool,
    onehot: bool,
    exclude: Sequence[str],
    where: str,
    notes: list[str],
    describe: Callable[[str], str] = repr,
) -> ArrayPlan:
    """Decide the labels and fields among ``heads`` (name -> (shape, dtype or None)) beside ``images``.

    Labels: those given; else the one integer array with a value per row; else, with
    ``onehot``, the one-hot array. Other per-row arrays become fields (non-integer label
    candidates with a note); the rest go to ``skipped`` with the reason. ``exclude``: already used.
    ``describe``: how a note names the field an array becomes (its name, quoted, by default).
    """
    others = [n for n in heads if n != images and n not in exclude]
    skipped: dict[str, str] = {}
    per_row = []
    for n in others:
        shape, _dt = heads[n]
        if not shape:
            skipped[n] = "a scalar, not one value per item"
        elif shape[0] != nrows:
            skipped[n] = f"not one row per item (shape {list(shape)}, {nrows} items)"
        else:
            per_row.append(n)
    is_onehot = False
    if labels is None and not no_labels:
        fits = [
            n
            for n in per_row
            if heads[n][0] in ((nrows,), (nrows, 1)) and (dt := heads[n][1]) is not None and dt.kind in "iub"
        ]
        ids = [
            n
            for n in fits
            if _ID_NAME.search(n.rsplit("/", 1)[-1].lower()) and n.rsplit("/", 1)[-1].lower() not in LABEL_NAMES
        ]
        named_elsewhere = [n for n in per_row if n not in fits and n.rsplit("/", 1)[-1].lower() in LABEL_NAMES]
        unnamed = [n for n in fits if n.rsplit("/", 1)[-1].lower() not in LABEL_NAMES]
        # ids alone are no labels (among other candidates they still make the choice ambiguous)
        drop = (set(ids) if len(ids) == len(fits) else set()) | (set(unnamed) if named_elsewhere else set())
        for n in sorted(drop):
            notes.append(
                f"{n!r} not taken as the labels ("
                + ("an id" if n in ids else f"{named_elsewhere[0]!r} is named like the labels")
                + f"): kept as the field {describe(n)}; --labels NAME takes it"
            )
        labels = infer_labels([n for n in fits if n not in drop], images, where, notes)
        if labels is None and onehot:
            hot = [n for n in per_row if (dt := heads[n][1]) is not None and _looks_onehot(heads[n][0], dt, nrows)]
            named = [n for n in hot if n.rsplit("/", 1)[-1].lower() in LABEL_NAMES]
            if len(hot) > 1 and len(named) == 1:
                hot = named
            if len(hot) != 1:
                raise OneHotLabelsError(
                    f"{where}: --onehot-to-class: "
                    + (
                        f"several arrays could be one-hot labels: {hot}; choose one with --labels NAME"
                        if hot
                        else f"no array of one-hot rows (N={nrows}, K>=2) beside {images!r}"
                    )
                )
            labels, is_onehot = hot[0], True
            notes.append(f"labels inferred: {labels!r} (one-hot rows, --onehot-to-class)")
    elif labels is not None and onehot:
        shape, dt = heads[labels]
        is_onehot = dt is not None and _looks_onehot(shape, dt, nrows)
    fields: list[str] = []
    budget = FIELDS_MAX_ROW_BYTES
    for n in per_row:
        if n == labels:
            continue
        shape, dt = heads[n]
        reason = _field_refusal(shape, dt)
        row = math.prod(shape[1:]) * (dt.itemsize if dt is not None else 0)
        if reason is None and row > FIELD_MAX_ROW_BYTES:
            reason = (
                f"{row} bytes per item, more than a field holds ({FIELD_MAX_ROW_BYTES}); "
                "migrate it as a store of its own (--dataset / --images NAME)"
            )
        elif reason is None and row > budget:
            reason = f"the fields before it already take {FIELDS_MAX_ROW_BYTES - budget} bytes per item (at most {FIELDS_MAX_ROW_BYTES})"
        if reason is not None:
            skipped[n] = reason
            continue
        budget -= row
        fields.append(n)
        assert dt is not None
        if (
            labels is None
            and n.rsplit("/", 1)[-1].lower() in LABEL_NAMES | {"label_onehot", "onehot"}
            or (labels is None and _looks_onehot(shape, dt, nrows) and dt.kind == "f")
        ):
            what = f"one-hot-shaped rows of {shape[1]}" if _looks_onehot(shape, dt, nrows) else f"{dt}{list(shape[1:])}"
            hint = "; --onehot-to-class makes class labels of one-hot rows" if _looks_onehot(shape, dt, nrows) else ""
            notes.append(
                f"{n!r} ({what}, {dt}) is not integer class labels: kept as the target field {describe(n)}{hint}"
            )
    return ArrayPlan(labels, is_onehot, fields, skipped)


def _field_refusal(shape: tuple[int, ...], dt: np.dtype | None) -> str | None:
    """Why an array of this dtype cannot be a field, or None."""
    if dt is None:
        return "a type a store does not hold (object references, variable-length data)"
    try:
        dtype_to_record(dt)
    except InvalidInputError as exc:
        return str(exc)
    return None


def infer_labels(fits: Sequence[str], images: str, where: str, notes: list[str]) -> str | None:
    """The only one of ``fits``, or the only one with a label name; None if none, MigrationError if ambiguous."""
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
    #: each row's group (a video, a session), or None
    groups: Sequence[str] | None = None
    #: each row's encoded source bytes (a JPEG, PNG, ... file), kept by the encoded layout where they decode to the row
    encoded: Sequence[bytes] | None = None


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

    Accepts non-negative integers (integer, bool or integral float dtype), strings (class names,
    sorted) and one-hot rows (N, K); else a MigrationError saying how to keep the array instead.
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
            f"class names {[str(s) for s in names[:10]]}{' ...' if len(names) > 10 else ''} from strings",
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


def class_labels(values: np.ndarray, where: str, onehot: bool) -> tuple[np.ndarray, tuple[str, ...] | None, str]:
    """:func:`labels_from_array`, or strict one-hot rows with ``onehot`` (``--onehot-to-class``)."""
    if onehot:
        a = onehot_to_class(values, where)
        return a, None, f"one-hot rows ({np.shape(values)[1]} classes) turned into class indices"
    return labels_from_array(values, where)


def object_conversion_of(
    chunks: Callable[[], Iterable[np.ndarray]], where: str, how: str = "numpy.load(path, allow_pickle=True)"
) -> tuple[np.dtype, tuple[int, ...], Callable[[np.ndarray], np.ndarray], str]:
    """Scan an object array (its ``chunks()``) and pick a fixed-size dtype that holds every element exactly.

    str -> 'U<n>'; bytes -> 'S<n>'; bool; int -> int64; ints and floats -> float64 (if exact);
    arrays of one shape and dtype -> stacked; else a MigrationError listing the element types.
    Returns (dtype, item_shape, convert(block) -> array, description).
    """
    types: Counter[str] = Counter()
    kinds: set[str] = set()
    maxlen = 0
    shapes: set[tuple[Any, ...]] = set()
    big_int = False
    for chunk in chunks():
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
        f"{where}: an object array whose elements ({what}) have no common fixed-size type; "
        "a store holds fixed-size items only (it never pickles). Convert them in Python first, e.g. "
        f"{how}"
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
        raise MigrationError(f"{where}: mixes floats with integers too large to be exact as float64 ({what})")
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
                f"{where}: the arrays in this object array differ in shape or dtype: {sorted(shapes)[:5]}"
            )
        shape, dts = next(iter(shapes))
        item_shape, dt = tuple(shape), np.dtype(dts)

    def convert(block: np.ndarray) -> np.ndarray:
        out = np.empty((len(block), *item_shape), dtype=dt)
        for i, x in enumerate(block.reshape(-1)):
            out[i] = x
        return out

    return dt, item_shape, convert, f"object elements ({what}) stored as {dt}{list(item_shape) if item_shape else ''}"


def fixed_from_objects(a: np.ndarray, where: str, notes: list[str]) -> np.ndarray:
    """An unpickled array as a fixed-size one: 1-d object arrays via :func:`object_conversion_of`."""
    if not a.dtype.hasobject:
        return a
    if a.ndim != 1 or a.dtype.fields is not None:
        raise MigrationError(
            f"{where}: a {a.ndim}-d array of Python objects ({a.dtype}); only 1-d object arrays are converted "
            "to fixed-size ones: convert it in Python first"
        )
    _dtype, _shape, convert, what = object_conversion_of(lambda: [a], where)
    notes.append(f"{where}: unpickled (--allow-pickle); {what}")
    return convert(a)
