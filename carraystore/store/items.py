"""The per-item values of a store being written: labels, keys, fields (columns) and groups.

:class:`ItemRecord` checks each append's values against the store's and records them all or none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from carraystore.base.errors import InvalidInputError
from carraystore.format.record import LABEL_LIMIT, StoreMeta, StringTable, dtype_to_record, validate_key

__all__ = ["ItemRecord", "CheckedItems", "check_class_names"]


def check_class_names(names: Sequence[str] | None, where: str) -> tuple[str, ...] | None:
    """``names`` as a tuple of strings; refuses duplicates and control characters (names become folders on export)."""
    if names is None:
        return None
    out = tuple(str(c) for c in names)
    seen: set[str] = set()
    for c in out:
        bad = next((ch for ch in c if ord(ch) < 32 or ord(ch) == 127), None)
        if bad is not None:
            raise InvalidInputError(
                f"{where}: class name {c!r} holds the control character {bad!r}; class names are printed and "
                "exported as folder names, so they may not hold NUL, newline, tab or other control characters"
            )
        if c in seen:
            raise InvalidInputError(
                f"{where}: class name {c!r} is listed twice in {list(out)}; class names must be unique"
            )
        seen.add(c)
    return out


@dataclass
class CheckedItems:
    """One append's per-item values, checked (labels as int64, keys as a table), not yet recorded."""

    n: int
    labels: np.ndarray | None
    keys: StringTable | None
    columns: dict[str, np.ndarray]
    groups: np.ndarray | None
    new_group_names: list[str]


class ItemRecord:
    """The labels, keys, columns and groups of a store so far (an appended-to store's first)."""

    def __init__(self, meta: StoreMeta, where: Any) -> None:
        self.where = where
        self.labels: list[np.ndarray] = [meta.labels] if meta.labels is not None else []
        self.keys: list[StringTable] = [meta.keys] if meta.keys is not None else []
        # FORMAT.md 4.4; an empty store with neither is undecided until its first append
        self.has_labels: bool | None = (
            True if meta.labels is not None or meta.class_names is not None else (None if meta.nimages == 0 else False)
        )
        self.has_keys: bool | None = True if meta.keys is not None else (None if meta.nimages == 0 else False)
        self.columns: dict[str, list[np.ndarray]] = {name: [col] for name, col in meta.columns.items()}
        self.group_names: list[str] = list(meta.group_names or ())
        self.groups: list[np.ndarray] = [meta.groups] if meta.groups is not None else []
        self.has_groups: bool | None = (
            None if meta.nimages == 0 and meta.group_names is None else meta.group_names is not None
        )

    def check(
        self,
        n: int,
        labels: Any,
        keys: Any,
        columns: dict[str, np.ndarray] | None,
        groups: Any,
        *,
        class_names: tuple[str, ...] | None,
        nimages: int,
    ) -> CheckedItems:
        """The values of an append of ``n`` items to a store of ``nimages`` items, checked; nothing changes."""
        lab = self._check_labels(labels, n, class_names)
        keytab = self._check_keys(keys, n)
        cols = self._check_columns(columns, n, nimages)
        grp, new_names = self._check_groups(groups, n)
        return CheckedItems(n, lab, keytab, cols, grp, new_names)

    def record(self, items: CheckedItems) -> None:
        """Add checked values: the first append decides whether the store has labels, keys and groups."""
        if self.has_labels is None:
            self.has_labels = items.labels is not None
        if self.has_keys is None:
            self.has_keys = items.keys is not None
        if self.has_groups is None:
            self.has_groups = items.groups is not None
        if items.groups is not None:
            self.group_names.extend(items.new_group_names)
            self.groups.append(items.groups)
        if items.labels is not None:
            self.labels.append(items.labels)
        if items.keys is not None:
            self.keys.append(items.keys)
        for name, col in items.columns.items():
            self.columns.setdefault(name, []).append(col)

    def finished(self) -> dict[str, Any]:
        """The record's fields for the store's metadata at close."""
        labels = np.concatenate(self.labels).astype("<i8") if self.labels else None
        if labels is None and self.has_labels:
            labels = np.zeros(0, dtype="<i8")
        groups = np.concatenate(self.groups).astype("<i4") if self.groups else np.zeros(0, dtype="<i4")
        return dict(
            labels=labels,
            keys=StringTable.join(self.keys) if self.keys else None,
            columns={name: np.concatenate(parts) for name, parts in self.columns.items()},
            group_names=tuple(self.group_names) if self.has_groups else None,
            groups=groups if self.has_groups else None,
        )

    def _check_labels(self, labels: Any, n: int, names: tuple[str, ...] | None) -> np.ndarray | None:
        where, has = self.where, labels is not None
        if self.has_labels is not None and has != self.has_labels:
            if self.has_labels:
                raise InvalidInputError(f"{where}: this store is labelled; pass labels= for every append")
            raise InvalidInputError(
                f"{where}: this store has no labels; pass labels for every image from the first append"
            )
        if not has:
            return None
        lab = np.asarray(labels)
        if lab.shape != (n,):
            raise InvalidInputError(f"{where}: {lab.shape} labels for {n} images; give one integer label per image")
        if n and lab.dtype.kind not in "iu":
            if lab.dtype.kind == "f" and np.all(lab == np.round(lab)):
                lab = lab.astype(np.int64)
            else:
                raise InvalidInputError(
                    f"{where}: labels must be integers (class indices), got {lab.dtype}; for a float "
                    "target (regression) pass columns={'target': values} and load it with targets='target' "
                    "(docs/targets.md)"
                )
        lab = lab.astype("<i8")
        if n and names is not None and (lab.min() < 0 or lab.max() >= len(names)):
            raise InvalidInputError(
                f"{where}: labels span {lab.min()}..{lab.max()} but there are {len(names)} class names"
            )
        if n and (lab.min() < 0 or lab.max() >= LABEL_LIMIT):
            raise InvalidInputError(
                f"{where}: labels must lie in 0..{LABEL_LIMIT - 1}, got {lab.min()}..{lab.max()} "
                "(a store has no 'missing' label: leave unlabelled items out, or give them a class of their own)"
            )
        return lab

    def _check_columns(self, columns: dict[str, np.ndarray] | None, n: int, nimages: int) -> dict[str, np.ndarray]:
        where, columns = self.where, dict(columns or {})
        if nimages and set(columns) != set(self.columns):
            raise InvalidInputError(
                f"{where}: columns {sorted(columns)} given, the store has columns {sorted(self.columns)}; "
                "give the same columns on every append"
            )
        out = {}
        for name, col in columns.items():
            if not isinstance(name, str) or not name:
                raise InvalidInputError(f"{where}: a column (field) name must be a non-empty string, got {name!r}")
            arr = np.asarray(col)
            if arr.ndim == 0 or len(arr) != n:
                raise InvalidInputError(f"{where}: column {name!r} has {arr.shape} rows for {n} items")
            dtype_to_record(arr.dtype)  # refuses object dtypes
            if name in self.columns and self.columns[name]:
                prev = self.columns[name][0]
                if prev.dtype != arr.dtype or prev.shape[1:] != arr.shape[1:]:
                    raise InvalidInputError(
                        f"{where}: column {name!r} is {arr.dtype}{arr.shape[1:]}, earlier rows are {prev.dtype}{prev.shape[1:]}"
                    )
            out[name] = arr
        return out

    def _check_groups(self, groups: Any, n: int) -> tuple[np.ndarray | None, list[str]]:
        """(the items' group indices, the names they add) for ``groups``."""
        where, has = self.where, groups is not None
        if self.has_groups is not None and has != self.has_groups:
            if self.has_groups:
                raise InvalidInputError(
                    f"{where}: this store records groups (videos, sessions, ...); pass groups= for every append"
                )
            raise InvalidInputError(
                f"{where}: this store has no groups; its items were written without them, so groups= cannot "
                "start now (write a new store with groups from the first append)"
            )
        if not has:
            return None, []
        values = list(groups.tolist() if isinstance(groups, np.ndarray) else groups)
        if len(values) != n:
            raise InvalidInputError(f"{where}: {len(values)} groups for {n} items; give one group per item")
        index = {name: i for i, name in enumerate(self.group_names)}
        new: list[str] = []
        out = np.empty(n, dtype="<i4")
        for j, v in enumerate(values):
            name = v if isinstance(v, str) else str(v)
            i = index.get(name)
            if i is None:
                if not name or isinstance(v, (bytes, float)) or v is None:
                    raise InvalidInputError(
                        f"{where}: group {v!r} of item {j}: a group is a non-empty name or an integer"
                    )
                i = index[name] = len(index)
                new.append(name)
            out[j] = i
        if len(index) >= LABEL_LIMIT:
            raise InvalidInputError(f"{where}: more than {LABEL_LIMIT - 1} groups")
        return out, new

    def _check_keys(self, keys: Any, n: int) -> StringTable | None:
        where, has = self.where, keys is not None
        if self.has_keys is not None and has != self.has_keys:
            if self.has_keys:
                raise InvalidInputError(f"{where}: this store has keys; pass keys= for every append")
            raise InvalidInputError(f"{where}: this store has no keys; pass keys for every image from the first append")
        if not has:
            return None
        keys = list(keys)
        if len(keys) != n:
            raise InvalidInputError(f"{where}: {len(keys)} keys for {n} images; give one key per image")
        return StringTable.from_strings(validate_key(k) for k in keys)
