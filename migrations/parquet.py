"""Parquet and Arrow tables with an image column, as Hugging Face ``datasets`` saves them, read with pyarrow
(an optional dependency: ``carraystore[migrate]``).

Files: one ``.parquet`` or ``.arrow`` file, or a folder: ``save_to_disk`` folders (``dataset_dict.json``
and one folder per split, or ``state.json`` and ``data-00000-of-00001.arrow``), the Hub's
``data/train-00000-of-00001.parquet`` (the split from the name), or split folders of Parquet files.
The image column is an ``Image`` feature (a struct of ``bytes`` and ``path``) or plain binary; a
``ClassLabel`` column's names (the ``huggingface`` key of the schema metadata) name the labels.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.base.errors import MigrationError, MissingDependencyError

from .npz import relative_keys
from .samples import (
    MixedTypesError,
    Sample,
    SampleReader,
    SourceFormatError,
    TruncatedSourceError,
    Unreadable,
)

__all__ = ["TableReader", "TableSet", "find_tables", "PARQUET_MAGIC", "ARROW_FILE_MAGIC", "ARROW_STREAM_MAGIC"]

PARQUET_MAGIC = b"PAR1"
ARROW_FILE_MAGIC = b"ARROW1"
#: An Arrow IPC stream (``save_to_disk`` writes these) starts with a continuation marker.
ARROW_STREAM_MAGIC = b"\xff\xff\xff\xff"
#: The Hub's names: ``train-00000-of-00003.parquet`` (older ones end in ``-<hash>``).
_HUB_NAME = re.compile(r"^(?P<split>[A-Za-z0-9_.]+?)-\d{5}-of-\d{5}(-[0-9a-f]+)?\.parquet$")
_BATCH_ROWS = 64
#: Hugging Face ``datasets`` info kept as the store's attrs.
_INFO_ATTRS = ("description", "citation", "homepage", "license", "dataset_name", "config_name")


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError as exc:
        raise MissingDependencyError(
            "reading Parquet and Arrow files needs pyarrow: pip install 'carraystore[migrate]'  (or: pip install pyarrow)"
        ) from exc
    return pyarrow


def _head(p: Path, n: int = 8) -> bytes:
    with open(p, "rb") as f:
        return f.read(n)


@dataclass
class TableSet:
    """The tables of a source: split name ("" when there is one) -> its files in order; the format."""

    splits: dict[str, list[Path]]
    kind: str  # "Parquet" or "Arrow"
    #: where the splits came from, for the notes
    how: str = ""


def _arrow_files(folder: Path) -> list[Path]:
    """A ``save_to_disk`` folder's Arrow files (``state.json``'s ``_data_files``, else every ``*.arrow`` but caches)."""
    state = folder / "state.json"
    if state.is_file():
        try:
            files = [folder / d["filename"] for d in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise SourceFormatError(f"{state}: not a datasets state.json ({exc})") from exc
        for f in files:
            if f.parent != folder or not f.is_file():
                raise SourceFormatError(f"{state}: names {f.name!r}, which is not a file in {folder}")
        return files
    return sorted(p for p in folder.glob("*.arrow") if not p.name.startswith("cache-"))


def find_tables(p: Path) -> TableSet | None:
    """The Parquet or Arrow tables at ``p`` (a file or a folder), by split; None when ``p`` holds none."""
    if p.is_file():
        head = _head(p)
        if head[:4] == PARQUET_MAGIC:
            return TableSet({"": [p]}, "Parquet")
        if head[:6] == ARROW_FILE_MAGIC or (head[:4] == ARROW_STREAM_MAGIC and p.suffix == ".arrow"):
            return TableSet({"": [p]}, "Arrow")
        return None
    if not p.is_dir():
        return None
    dd = p / "dataset_dict.json"
    if dd.is_file():
        try:
            names = json.loads(dd.read_text(encoding="utf-8"))["splits"]
            if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
                raise TypeError("splits is not a list of names")
        except (ValueError, KeyError, TypeError) as exc:
            raise SourceFormatError(f"{dd}: not a datasets dataset_dict.json ({exc})") from exc
        splits = {}
        for n in names:
            sub = p / n
            if "/" in n or n in (".", "..") or not sub.is_dir():
                raise SourceFormatError(f"{dd}: split {n!r} has no folder {sub}")
            files = _arrow_files(sub) or sorted(sub.glob("*.parquet"))
            if not files:
                raise SourceFormatError(f"{sub}: split {n!r} holds no .arrow or .parquet files")
            splits[n] = files
        kind = "Arrow" if all(f.suffix == ".arrow" for fs in splits.values() for f in fs) else "Parquet"
        return TableSet(splits, kind, "dataset_dict.json")
    if (p / "state.json").is_file() or (p / "dataset_info.json").is_file() and list(p.glob("*.arrow")):
        files = _arrow_files(p)
        return TableSet({"": files}, "Arrow") if files else None
    parquet = sorted(f for f in p.rglob("*.parquet") if f.is_file() and not any(x.startswith(".") for x in f.parts))
    if not parquet:
        return None
    by_name: dict[str, list[Path]] = {}
    for f in parquet:
        m = _HUB_NAME.match(f.name)
        if m is None:
            by_name = {}
            break
        by_name.setdefault(m.group("split"), []).append(f)
    if by_name:
        return TableSet(by_name, "Parquet", "file names (<split>-00000-of-00001.parquet)")
    by_folder: dict[str, list[Path]] = {}
    for f in parquet:
        by_folder.setdefault(f.parent.relative_to(p).as_posix(), []).append(f)
    if len(by_folder) > 1 and "." not in by_folder:
        return TableSet(by_folder, "Parquet", "folders")
    return TableSet({"": parquet}, "Parquet")


# -- reading ------------------------------------------------------------------------------------------


def _hf_features(schema: Any) -> dict[str, Any]:
    meta = schema.metadata or {}
    raw = meta.get(b"huggingface")
    if not raw:
        return {}
    try:
        doc = json.loads(raw)
    except ValueError:
        return {}
    info = doc.get("info", doc) if isinstance(doc, dict) else {}
    feats = info.get("features") if isinstance(info, dict) else None
    return feats if isinstance(feats, dict) else {}


def _hf_info(schema: Any) -> dict[str, Any]:
    try:
        doc = json.loads((schema.metadata or {}).get(b"huggingface") or b"{}")
    except ValueError:
        return {}
    info = doc.get("info", {}) if isinstance(doc, dict) else {}
    if not isinstance(info, dict):
        return {}
    return {k: info[k] for k in _INFO_ATTRS if isinstance(info.get(k), str) and info[k]}


def _is_image_struct(pa: Any, t: Any) -> bool:
    return bool(
        pa.types.is_struct(t)
        and {t.field(i).name for i in range(t.num_fields)} >= {"bytes"}
        and _is_binary(pa, t.field(t.get_field_index("bytes")).type)
    )


def _is_binary(pa: Any, t: Any) -> bool:
    return bool(pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t))


def _has_union(pa: Any, t: Any) -> bool:
    if pa.types.is_union(t):
        return True
    if pa.types.is_struct(t):
        return any(_has_union(pa, t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _has_union(pa, t.value_type)
    return False


class _Table:
    """One file's schema and record batches (Parquet, or an Arrow IPC file or stream)."""

    def __init__(self, pa: Any, path: Path) -> None:
        self.pa, self.path = pa, path
        try:
            if _head(path, 4) == PARQUET_MAGIC:
                self.kind = "Parquet"
                pf = pa.parquet.ParquetFile(str(path))
                self.schema = pf.schema_arrow
                pf.close()
            else:
                self.kind = "Arrow"
                with pa.memory_map(str(path)) as mm:
                    self.schema = self._ipc(mm).schema
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise _table_error(path, exc) from exc

    def _ipc(self, mm: Any) -> Any:
        pa = self.pa
        return pa.ipc.open_file(mm) if _head(self.path, 6) == ARROW_FILE_MAGIC else pa.ipc.open_stream(mm)

    def batches(self) -> Iterator[Any]:
        pa = self.pa
        try:
            if self.kind == "Parquet":
                pf = pa.parquet.ParquetFile(str(self.path))
                try:
                    yield from pf.iter_batches(batch_size=_BATCH_ROWS)
                finally:
                    pf.close()
            else:
                with pa.memory_map(str(self.path)) as mm:
                    r = self._ipc(mm)
                    if hasattr(r, "num_record_batches"):
                        for i in range(r.num_record_batches):
                            yield r.get_batch(i)
                    else:
                        yield from r
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise _table_error(self.path, exc) from exc


def _table_error(path: Path, exc: BaseException) -> MigrationError:
    text = str(exc)
    if any(
        s in text.lower()
        for s in ("magic bytes not found", "truncated", "unexpected end", "eof", "expected to be able to read")
    ):
        return TruncatedSourceError(
            f"{path}: cut short ({text.splitlines()[0] if text else type(exc).__name__}); copy it again"
        )
    return SourceFormatError(f"{path}: not a readable Parquet/Arrow file ({type(exc).__name__}: {text[:300]})")


class TableReader(SampleReader):
    """One split of Parquet or Arrow tables as samples: one per row, its columns by name."""

    value_word = "column"
    missing_label_hint = "; -1 means 'no label' in Hugging Face datasets"

    def __init__(self, files: Sequence[Path], kind: str, location: str, path: Path, split: str = "") -> None:
        super().__init__()
        pa = _pyarrow()
        self.pa = pa
        self.kind = kind
        self.location = location
        self.path = path
        self.files = list(files)
        self.locations = self.files
        self.codec = kind
        tables = [_Table(pa, f) for f in self.files]
        self.tables = tables
        first = tables[0].schema
        for t in tables[1:]:
            for fld in t.schema:
                i = first.get_field_index(fld.name)
                if i < 0 or first.field(i).type != fld.type:
                    other = "absent" if i < 0 else str(first.field(i).type)
                    raise MixedTypesError(
                        f"{location}: column {fld.name!r} is {fld.type} in {t.path.name} but {other} in "
                        f"{tables[0].path.name}; the files of one split must share one schema"
                    )
            if len(t.schema) != len(first):
                missing = [n for n in first.names if n not in t.schema.names]
                raise MixedTypesError(f"{location}: {t.path.name} lacks the columns {missing} of {tables[0].path.name}")
        for fld in first:
            if _has_union(pa, fld.type):
                raise MixedTypesError(
                    f"{location}: column {fld.name!r} is a union of types ({fld.type}); a field holds one type: "
                    "cast the column to one type first"
                )
        self.schema = first
        features = _hf_features(first)
        self.attrs = _hf_info(first)
        images = [n for n, f in features.items() if isinstance(f, dict) and f.get("_type") == "Image"]
        images += [f.name for f in first if _is_image_struct(pa, f.type) and f.name not in images]
        self._image_structs = {f.name for f in first if _is_image_struct(pa, f.type)}
        self.image_names = tuple(images)
        labels = [n for n, f in features.items() if isinstance(f, dict) and f.get("_type") == "ClassLabel"]
        for n in labels[:1]:
            names = features[n].get("names")
            if isinstance(names, list) and all(isinstance(x, str) for x in names):
                self.class_names, self.class_names_for = tuple(names), n
        self.label_names = (*labels, "label", "labels", "class", "target", "y")
        self.key_names = tuple(f"{n}.path" for n in images)
        self._rel: dict[str, dict[str, str]] | None = None
        self.provenance = {
            kind.lower(): {
                "files": len(self.files),
                "names": [f.name for f in self.files[:16]],
                "split": split or None,
                "features": features or None,
            }
        }
        if split:
            self.notes.append(f"split {split!r}")

    def _columns(self, batch: Any, where: str) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {}
        for name, col in zip(batch.schema.names, batch.columns, strict=True):
            self._convert(name, col, out, where)
        return out

    def _convert(self, name: str, col: Any, out: dict[str, list[Any]], where: str, depth: int = 0) -> None:
        """The column's values, one per row (None for a null), into ``out``; structs one level deep."""
        pa, t, n = self.pa, col.type, len(col)
        if pa.types.is_dictionary(t):
            col = col.dictionary_decode()
            t = col.type
        if name in self._image_structs and depth == 0:
            data = col.field("bytes").to_pylist()
            paths = col.field("path").to_pylist() if t.get_field_index("path") >= 0 else [None] * n
            nulls = col.is_null().to_pylist()
            vals: list[Any] = []
            for b, p, null in zip(data, paths, nulls, strict=True):
                if null or b is None:
                    vals.append(
                        Unreadable(
                            "not embedded: the row holds no image bytes"
                            + (f" but the path {p!r}; a migration reads only the files it is given" if p else "")
                        )
                    )
                else:
                    vals.append(b)
            out[name] = vals
            out[f"{name}.path"] = [p if not null else None for p, null in zip(paths, nulls, strict=True)]
            return
        if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t) or pa.types.is_temporal(t):
            if col.null_count:
                np_dt = t.to_pandas_dtype() if not pa.types.is_temporal(t) else None
                vals = [
                    None if v is None else (np.asarray(v, np_dt)[()] if np_dt is not None else v)
                    for v in col.to_pylist()
                ]
                if np_dt is None:
                    vals = [None if v is None else Unreadable(f"a {t} column with nulls") for v in vals]
                out[name] = vals
            else:
                arr = col.to_numpy(zero_copy_only=False)
                out[name] = [arr[i] for i in range(n)]
            return
        if pa.types.is_string(t) or pa.types.is_large_string(t) or _is_binary(pa, t):
            out[name] = col.to_pylist()
            return
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            vt = t.value_type
            if pa.types.is_integer(vt) or pa.types.is_floating(vt) or pa.types.is_boolean(vt):
                np_dt = np.dtype(vt.to_pandas_dtype())
                out[name] = [None if r is None else np.asarray(r, dtype=np_dt) for r in col.to_pylist()]
            elif depth == 0 and (pa.types.is_list(vt) or pa.types.is_fixed_size_list(vt)):
                out[name] = [None if r is None else _nested(r) for r in col.to_pylist()]
            else:
                out[name] = [
                    None
                    if r is None
                    else Unreadable(
                        f"a list of {vt} values; a field holds numbers, text or fixed-size lists of numbers"
                    )
                    for r in col.to_pylist()
                ]
            return
        if pa.types.is_struct(t) and depth == 0:
            nulls = col.is_null().to_pylist()
            for i in range(t.num_fields):
                child = col.field(i)
                sub: dict[str, list[Any]] = {}
                self._convert(f"{name}.{t.field(i).name}", child, sub, where, depth + 1)
                for k, v in sub.items():
                    out[k] = [None if null else x for x, null in zip(v, nulls, strict=True)]
            return
        if pa.types.is_null(t):
            out[name] = [None] * n
            return
        out[name] = [Unreadable(f"a {t} column; fields hold numbers, text or fixed-size lists")] * n

    def _relative_paths(self) -> dict[str, dict[str, str]]:
        """Per image ``path`` column: each path made relative to their common folder, as for .npz caches (so no
        absolute path of a machine enters the store); read once, from that column only."""
        if self._rel is None:
            self._rel = {}
            for k in self.key_names:
                paths = self._all_paths(k)
                if paths is None:
                    continue
                try:
                    keys, root = relative_keys(paths)
                except MigrationError:
                    continue
                self._rel[k] = dict(zip(paths, keys, strict=True))
                if root not in ("", "/"):
                    self.notes.append(f"image paths made relative to their common folder {root!r}")
        return self._rel

    def samples(self) -> Iterator[Sample]:
        rel = self._relative_paths()
        for table in self.tables:
            row = 0
            for batch in table.batches():
                cols = self._columns(batch, f"{table.path}: row")
                for k, m in rel.items():
                    if k in cols:
                        cols[k] = [m.get(p, p) if isinstance(p, str) else p for p in cols[k]]
                for i in range(batch.num_rows):
                    values = {k: v[i] for k, v in cols.items() if v[i] is not None}
                    yield Sample(f"{table.path.name}: row {row}", None, values)
                    row += 1

    def _all_paths(self, name: str) -> list[str] | None:
        """Every value of an image's ``path`` when all are text, else None (one pass over that column only)."""
        col = name.rsplit(".", 1)[0]
        out: list[str] = []
        for table in self.tables:
            for batch in _column_batches(self.pa, table, col):
                if batch.type.get_field_index("path") < 0:
                    return None
                for p in batch.field("path").to_pylist():
                    if not isinstance(p, str) or not p:
                        return None
                    out.append(p)
        return out or None


def _column_batches(pa: Any, table: _Table, column: str) -> Iterator[Any]:
    """The record batches of one struct column (Parquet reads that column only)."""
    if table.kind == "Parquet":
        pf = pa.parquet.ParquetFile(str(table.path))
        try:
            for b in pf.iter_batches(batch_size=4096, columns=[column]):
                yield b.column(0)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise _table_error(table.path, exc) from exc
        finally:
            pf.close()
    else:
        for b in table.batches():
            yield b.column(b.schema.get_field_index(column))


def _nested(rows: list[Any]) -> Any:
    try:
        a = np.asarray(rows)
    except ValueError:
        return Unreadable("nested lists of different lengths")
    return a if a.dtype.kind in "biuf" else Unreadable("nested lists of other than numbers")
