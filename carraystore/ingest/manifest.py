"""Per-file fields for an ingest: a targets manifest (CSV or JSON lines), or values in file order.

A manifest row per image file, keyed by its relative path (column ``file`` or ``path``); every
other column becomes a field (docs/targets.md): whole numbers -> int64, other numbers ->
float64 (exact), a JSON array -> a vector field of one shape. Every file needs a row and every
row a file; an empty cell, text or a ragged vector is a :class:`ManifestError` naming the line.
"""

from __future__ import annotations

import csv
import io
import json
import os
import posixpath
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.base.errors import IngestError, ManifestError

__all__ = ["FieldTable", "read_manifest", "KEY_COLUMNS", "TARGET_FIELD", "GROUP_COLUMN"]

#: The columns that name the file of a row (exactly one of them; ``filename`` is Keras' ``flow_from_dataframe`` default).
KEY_COLUMNS = ("file", "path", "filename")
#: The field that floats (or vectors) given as ``labels=`` become.
TARGET_FIELD = "target"
#: The column that names each file's group (video, session, patient): text, not a field.
GROUP_COLUMN = "group"
#: A field may not take the name loaders give the class labels.
_RESERVED = ("label",)
#: Names shown in an error before "... and N more".
_SHOWN = 5


def _few(names: Sequence[str]) -> str:
    head = ", ".join(names[:_SHOWN])
    return head + (f", ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _norm_key(key: str) -> str:
    k = key.strip().replace("\\", "/")
    k = posixpath.normpath(k) if k else k
    return k[2:] if k.startswith("./") else k


class FieldTable:
    """Fields (name -> array, one row per file) keyed by relative file path."""

    def __init__(
        self, keys: Sequence[str], fields: dict[str, np.ndarray], source: str, groups: Sequence[str] | None = None
    ) -> None:
        self.keys = list(keys)
        self.fields = fields
        self.source = source
        self.index = {k: i for i, k in enumerate(self.keys)}
        #: each row's group (the manifest's ``group`` column), or None
        self.groups = list(groups) if groups is not None else None

    def group_of(self) -> dict[str, str] | None:
        """``relative path -> group`` from the ``group`` column (``from_directory(groups=)``), or None."""
        return None if self.groups is None else dict(zip(self.keys, self.groups, strict=True))

    @classmethod
    def from_values(cls, rels: Sequence[str], name: str, values: Any, source: str = "labels") -> FieldTable:
        """One field given in file order (e.g. float ``labels=``)."""
        arr = np.asarray(values)
        if arr.dtype.kind not in "biuf":
            raise ManifestError(f"{source}: values of {arr.dtype} cannot be a field; give numbers")
        return cls(rels, {name: arr}, source)

    def __len__(self) -> int:
        return len(self.keys)

    def merged(self, other: FieldTable) -> FieldTable:
        """The fields of both tables (same files): a name in both is an error."""
        both = sorted(set(self.fields) & set(other.fields))
        if both:
            raise ManifestError(f"{other.source}: field(s) {both} are also given by {self.source}; rename one")
        order = [other.index[k] for k in self.keys]
        return FieldTable(
            self.keys,
            {**self.fields, **{n: a[order] for n, a in other.fields.items()}},
            f"{self.source}, {other.source}",
        )

    def under(self, prefix: str) -> FieldTable:
        """The rows of files under folder ``prefix`` (a split), keyed relative to it."""
        p = prefix.rstrip("/") + "/"
        rows = [i for i, k in enumerate(self.keys) if k.startswith(p)]
        return FieldTable(
            [self.keys[i][len(p) :] for i in rows],
            {n: a[rows] for n, a in self.fields.items()},
            self.source,
            [self.groups[i] for i in rows] if self.groups is not None else None,
        )

    def check_files(self, rels: Sequence[str], where: str, known: set[str] | None = None) -> None:
        """Every file of ``rels`` has a row and every row a file, or a ManifestError naming them.

        ``known``: an append's files (the folder's and the store's): ``rels`` are the new ones, and
        rows of files already in the store are allowed (one manifest may grow with the store).
        """
        files = set(rels) if known is None else known
        missing = [r for r in rels if r not in self.index]
        extra = [k for k in self.keys if k not in files]
        if not missing and not extra:
            return
        new, found = ("", "image file found") if known is None else ("new ", "file of the folder or the store")
        parts = []
        if missing:
            parts.append(f"{len(missing)} of the {len(rels)} {new}image files have no row ({_few(missing)})")
        if extra:
            parts.append(f"{len(extra)} of its {len(self.keys)} rows name no {found} ({_few(extra)})")
        files_of = "the files of" if known is None else "the files appended from"
        advice = "; give every image file a row and no other rows" if known is None else ""
        raise ManifestError(
            f"{self.source} does not match {files_of} {where}: {'; '.join(parts)}. Rows are keyed by the path "
            f"relative to {where} (column {' or '.join(KEY_COLUMNS)}){advice}"
        )

    def prefixed(self, prefix: str) -> FieldTable:
        """The same rows keyed ``prefix + key`` (a folder appended as one of the store's sub-folders)."""
        return FieldTable([prefix + k for k in self.keys], self.fields, self.source, self.groups)

    def take(self, rels: Sequence[str]) -> dict[str, np.ndarray]:
        """The fields' rows of ``rels`` (files written together), in that order."""
        try:
            rows = np.fromiter((self.index[r] for r in rels), dtype=np.int64, count=len(rels))
        except KeyError as exc:  # the ingest checked the files first: a bug if reached
            raise IngestError(f"{self.source}: no row for {exc.args[0]!r}") from None
        return {n: a[rows] for n, a in self.fields.items()}


# -- parsing ------------------------------------------------------------------------------------


def _cell(text: str, where: str) -> Any:
    t = text.strip()
    if not t:
        raise ManifestError(f"{where}: empty value; every file needs a value in every column")
    if t.startswith("["):
        try:
            return json.loads(t)
        except json.JSONDecodeError as exc:
            raise ManifestError(f"{where}: {t[:40]!r} is not a JSON array ({exc.msg})") from None
    try:
        return int(t)
    except ValueError:
        pass
    try:
        return float(t)
    except ValueError:
        raise ManifestError(
            f"{where}: {t[:40]!r} is not a number; fields are numbers or JSON arrays of numbers "
            "(text columns are not fields: leave them out of the manifest)"
        ) from None


def _column(name: str, values: list[Any], lines: list[int], source: str) -> np.ndarray:
    """One column's values as an int64 or float64 array (vectors: one shape for every row)."""
    first_shape: tuple[int, ...] | None = None
    first_line = 0
    anyfloat = False
    for v, line in zip(values, lines, strict=True):
        where = f"{source}, line {line}, column {name!r}"
        if v is None or isinstance(v, (str, dict)):
            raise ManifestError(
                f"{where}: {v!r} is not a number; fields are numbers or arrays of numbers (every file needs a value)"
            )
        try:
            a = np.asarray(v)
        except ValueError:
            raise ManifestError(f"{where}: the array is ragged; a vector field has one shape for every row") from None
        if a.dtype.kind not in "biuf":
            raise ManifestError(f"{where}: {json.dumps(v)[:60]} holds something other than numbers")
        if first_shape is None:
            first_shape, first_line = a.shape, line
        elif a.shape != first_shape:
            raise ManifestError(
                f"{where}: shape {a.shape} but line {first_line} has {first_shape}; a field has one shape for every row"
            )
        anyfloat = anyfloat or a.dtype.kind == "f"
    return np.asarray(values, dtype=np.float64 if anyfloat else np.int64)


def _rows_csv(text: str, source: str) -> tuple[list[str], list[dict[str, Any]], list[int]]:
    reader = csv.reader(io.StringIO(text))
    try:
        header = next(reader)
    except StopIteration:
        raise ManifestError(f"{source}: the manifest is empty; it needs a header row (file,NAME,...)") from None
    header = [h.strip() for h in header]
    _key_column(header, source)  # before any cell is read
    rows: list[dict[str, Any]] = []
    lines: list[int] = []
    for row in reader:
        line = reader.line_num
        if not any(c.strip() for c in row):
            continue
        if len(row) != len(header):
            raise ManifestError(f"{source}, line {line}: {len(row)} values for the {len(header)} columns {header}")
        rows.append(
            {
                h: (c if h in (*KEY_COLUMNS, GROUP_COLUMN) else _cell(c, f"{source}, line {line}, column {h!r}"))
                for h, c in zip(header, row, strict=True)
            }
        )
        lines.append(line)
    return header, rows, lines


def _rows_jsonl(text: str, source: str) -> tuple[list[str], list[dict[str, Any]], list[int]]:
    header: list[str] | None = None
    rows: list[dict[str, Any]] = []
    lines: list[int] = []
    for line, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ManifestError(
                f"{source}, line {line}: not JSON ({exc.msg}); JSON lines hold one object a line"
            ) from None
        if not isinstance(rec, dict):
            raise ManifestError(f"{source}, line {line}: a line must be a JSON object, got {type(rec).__name__}")
        if header is None:
            header = list(rec)
        elif set(rec) != set(header):
            diff = sorted(set(header) ^ set(rec))
            raise ManifestError(
                f"{source}, line {line}: keys differ from the first line's ({diff}); every line has the same keys"
            )
        rows.append(rec)
        lines.append(line)
    if header is None:
        raise ManifestError(f"{source}: the manifest is empty")
    return header, rows, lines


def _key_column(header: list[str], source: str) -> str:
    keycols = [h for h in header if h in KEY_COLUMNS]
    if len(keycols) != 1:
        raise ManifestError(
            f"{source}: a manifest names each row's file in one column {' or '.join(map(repr, KEY_COLUMNS))}; its "
            f"columns are {header}"
        )
    return keycols[0]


def read_manifest(path: str | os.PathLike[str]) -> FieldTable:
    """A manifest as a :class:`FieldTable`: CSV with a header, or JSON lines (``.jsonl``, ``.ndjson``, ``{...``)."""
    p = Path(path)
    source = str(p)
    try:
        text = p.read_text(encoding="utf-8-sig")
    except FileNotFoundError:
        raise ManifestError(f"{source}: no such targets manifest") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{source}: cannot read the targets manifest ({exc})") from exc
    jsonl = p.suffix.lower() in (".jsonl", ".ndjson", ".json") or text.lstrip().startswith("{")
    header, rows, lines = (_rows_jsonl if jsonl else _rows_csv)(text, source)
    keycol = _key_column(header, source)
    names = [h for h in header if h not in (keycol, GROUP_COLUMN)]
    if not names and GROUP_COLUMN not in header:
        raise ManifestError(f"{source}: no column besides {keycol!r}; every other column becomes a field")
    for n in names:
        if not n or n in _RESERVED:
            raise ManifestError(
                f"{source}: column {n!r} cannot be a field name ('label' is what loaders call the class labels, "
                "which come from the class folders); rename it, e.g. 'class_id'"
            )
    keys: list[str] = []
    seen: dict[str, int] = {}
    for rec, line in zip(rows, lines, strict=True):
        k = rec[keycol]
        if not isinstance(k, str) or not _norm_key(k):
            raise ManifestError(f"{source}, line {line}: column {keycol!r} must name a file, got {k!r}")
        k = _norm_key(k)
        if k in seen:
            raise ManifestError(f"{source}, line {line}: {k!r} has a row already (line {seen[k]}); one row per file")
        seen[k] = line
        keys.append(k)
    if jsonl:  # cells of JSON lines are values already; in CSV _cell parsed them
        for rec in rows:
            for n in names:
                if isinstance(rec[n], bool):
                    rec[n] = int(rec[n])
    fields = {n: _column(n, [r[n] for r in rows], lines, source) for n in names}
    groups = None
    if GROUP_COLUMN in header:  # a file's group: any text (a video, session or patient id), never empty
        groups = []
        for rec, line in zip(rows, lines, strict=True):
            g = rec[GROUP_COLUMN]
            g = str(g).strip() if isinstance(g, (str, int)) and not isinstance(g, bool) else ""
            if not g:
                raise ManifestError(
                    f"{source}, line {line}: column {GROUP_COLUMN!r} must name the file's group (text or a whole "
                    f"number), got {rec[GROUP_COLUMN]!r}"
                )
            groups.append(g)
    return FieldTable(keys, fields, source, groups)
