"""A pure reader for bcolz carray and ctable directories (bcolz is never imported).

* ``meta/storage`` (JSON): ``dtype`` (text; structured dtypes are literals parsed with
  ``ast.literal_eval``, never ``eval``), ``chunklen`` (rows per chunk), ``cparams``, ``dflt``.
* ``meta/sizes`` (JSON, written by ``flush()``): ``shape``, ``nbytes``, ``cbytes``. The
  flushed length is authoritative; rows beyond it are stale (``trim()``) or unflushed.
* ``data/__N.blp``: ``b"blpk"`` + 12 header bytes, then one Blosc1 chunk with rows
  ``[N * chunklen, (N + 1) * chunklen)``; the last partial chunk is stored smaller.
* ``__attrs__``: JSON user attributes (may be missing, empty or a lone newline).
* Object-dtype carrays store one pickled element per ``.blp`` file.
* A ctable: ``__rootdirs__`` (``{"names": [...]}``) plus one carray rootdir per column.
"""

from __future__ import annotations

import ast
import json
import os
import pickle
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.base.errors import InvalidInputError, MigrationError
from carraystore.format.codec import PRESETS, Codec

from . import blosc1

__all__ = [
    "CarrayReader",
    "CtableReader",
    "open_bcolz",
    "is_carray",
    "is_ctable",
    "BLP_HEADER",
    "default_codec_for",
]

#: The 16 bytes that precede the Blosc chunk in every ``.blp`` file.
BLP_HEADER = b"blpk\x01\x00\x00\x00" + (1).to_bytes(8, "little")
_BLP_MAGIC = b"blpk"
#: codec family (as in Blosc headers) of each bcolz cname
_FAMILY = {"blosclz": "blosclz", "lz4": "lz4", "lz4hc": "lz4", "snappy": "snappy", "zlib": "zlib", "zstd": "zstd"}


def is_carray(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a bcolz carray rootdir (it has ``meta/storage``)."""
    p = Path(path)
    return p.is_dir() and (p / "meta" / "storage").is_file()


def is_ctable(path: str | os.PathLike[str]) -> bool:
    """True if ``path`` is a bcolz ctable rootdir (it has ``__rootdirs__``)."""
    p = Path(path)
    return p.is_dir() and (p / "__rootdirs__").is_file()


def parse_dtype(text: str, where: str) -> np.dtype:
    """The dtype written in ``meta/storage`` (a name, or a Python literal for structured dtypes)."""
    try:
        return np.dtype(text)
    except (TypeError, ValueError):
        pass
    try:
        spec = ast.literal_eval(text)  # literals only: nothing is executed
        parsed: np.dtype = np.dtype(spec)
        return parsed
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
        raise MigrationError(
            f"{where}: meta/storage has a dtype that numpy does not understand: {text!r} ({exc})"
        ) from exc


def read_attrs(rootdir: Path) -> dict[str, Any]:
    """``__attrs__`` as a dict; missing, empty or whitespace-only gives ``{}``."""
    p = rootdir / "__attrs__"
    if not p.is_file():
        return {}
    text = p.read_text(encoding="utf-8", errors="strict").strip()
    if not text:
        return {}
    try:
        attrs = json.loads(text)
    except json.JSONDecodeError as exc:
        raise MigrationError(
            f"{p}: not valid JSON ({exc}); fix or delete this file (it only holds user attributes)"
        ) from exc
    if not isinstance(attrs, dict):
        raise MigrationError(f"{p}: holds a {type(attrs).__name__}, not a JSON object")
    return attrs


def describe_cparams(cparams: dict[str, Any]) -> str:
    """bcolz cparams as text, e.g. ``lz4-5 shuffle``."""
    cname = cparams.get("cname", "blosclz")  # bcolz < 0.7.1 had no cname: always blosclz
    shuffle = cparams.get("shuffle", 1)
    # a bool shuffle (True/False) hashes as 1/0: the same entries
    mode = {0: "noshuffle", 1: "shuffle", 2: "bitshuffle"}.get(shuffle, str(shuffle))
    text = f"{cname}-{cparams.get('clevel', 5)} {mode}"
    if cparams.get("quantize"):
        text += f" quantize={cparams['quantize']}"
    return text


#: bcolz cnames whose chunks a store writes with the same blosc2 codec (snappy: lz4, its nearest; zlib: below)
_SAME_FAMILY = {"blosclz": "blosclz", "lz4": "lz4", "lz4hc": "lz4hc", "snappy": "lz4", "zstd": "zstd"}


def default_codec_for(cparams: dict[str, Any], itemsize: int = 1) -> Codec:
    """The store codec a migration uses when none is given: one that reads at least as fast as the carray did.

    The source's own codec and level, and its shuffle on records of the source's item size
    (bcolz shuffles items of ``dtype.itemsize`` bytes: for uint8 pixels the identity, which
    the codec then leaves out): the same bytes for the same decompression work, so no regime
    reads the store slower than it read the carray (snappy, which blosc2 lacks, becomes lz4).
    zlib becomes ``balanced`` (zstd-1 + shuffle + bytedelta), which decompresses faster and
    stores fewer bytes. Blocks are the store's automatic ones.
    """
    cname = str(cparams.get("cname", "blosclz"))  # bcolz < 0.7.1 had no cname: always blosclz
    try:
        clevel = int(cparams.get("clevel", 5))
    except (TypeError, ValueError):
        clevel = 5
    try:
        mode = int(cparams.get("shuffle", 1) or 0)
    except (TypeError, ValueError):
        mode = 0
    if cname not in _SAME_FAMILY or not 0 <= clevel <= 9:
        return PRESETS["balanced"]
    shuffle = {1: ("shuffle",), 2: ("bitshuffle",)}.get(mode, ())
    return Codec(_SAME_FAMILY[cname], clevel, filters=shuffle, typesize=int(itemsize) if 1 <= itemsize <= 255 else 1)


def refuse_links_inside(root: Path) -> None:
    """Refuse a bcolz folder holding a symlink or special file (``data/__0.blp -> /etc/passwd``)."""
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in [*dirs, *files]:
            p = Path(folder, name)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode) or not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
                what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else "not a regular file"
                raise MigrationError(
                    f"{p}: {what} inside the bcolz folder {root}; a migration reads only the folder it is given, "
                    "never what a link points at. Copy the folder with the links resolved (cp -rL) and migrate the copy"
                )


@dataclass
class CarrayReader:
    """A bcolz carray read chunk by chunk (``CarrayReader.open(rootdir)``); ``warnings``: what lies past ``nrows``."""

    rootdir: Path
    dtype: np.dtype
    shape: tuple[int, ...]
    chunklen: int
    cparams: dict[str, Any]
    attrs: dict[str, Any]
    allow_pickle: bool = False
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: chunk files on disk beyond the flushed length
    extra_files: list[str] = field(default_factory=list)

    # -- opening -----------------------------------------------------------------------
    @classmethod
    def open(cls, rootdir: str | os.PathLike[str], *, allow_pickle: bool = False) -> CarrayReader:
        """Read a carray's metadata and check that its chunk files are all there."""
        root = Path(rootdir)
        storage = root / "meta" / "storage"
        if not root.is_dir():
            raise MigrationError(f"{root}: no such bcolz rootdir (a bcolz carray is a folder)")
        refuse_links_inside(root)
        if not storage.is_file():
            raise MigrationError(f"{root}: not a bcolz carray (no meta/storage file)")
        text = storage.read_text(encoding="utf-8").strip()
        if not text:
            raise MigrationError(
                f"{root}: meta/storage is empty: the bcolz writer failed before it wrote its metadata "
                "(bcolz itself cannot open this folder); there is nothing to migrate - re-create the array from its source"
            )
        try:
            st = json.loads(text)
            dtype = parse_dtype(st["dtype"], str(root))
            chunklen = int(st["chunklen"])
            cparams = dict(st.get("cparams") or {})
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, MigrationError):
                raise
            raise MigrationError(f"{storage}: malformed bcolz metadata ({exc!r})") from exc
        if chunklen < 1:
            raise MigrationError(f"{storage}: chunklen {chunklen} must be positive")
        sizes = root / "meta" / "sizes"
        if not sizes.is_file() or not sizes.read_text(encoding="utf-8").strip():
            raise MigrationError(
                f"{root}: meta/sizes is missing or empty: this carray was never flushed (the writer failed or was "
                "killed), so its length is unknown; bcolz itself cannot open it"
            )
        try:
            sz = json.loads(sizes.read_text(encoding="utf-8"))
            shape = tuple(int(x) for x in sz["shape"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise MigrationError(f"{sizes}: malformed bcolz metadata ({exc!r})") from exc
        if not shape or min(shape) < 0:
            raise MigrationError(f"{sizes}: bad shape {list(shape)}")
        reader = cls(root, dtype, shape, chunklen, cparams, read_attrs(root), allow_pickle=allow_pickle)
        if dtype.hasobject and not allow_pickle:
            raise MigrationError(
                f"{root}: an object-dtype carray: each element is a Python pickle, and unpickling runs code from the file. "
                "Only if you trust where it came from, pass --allow-pickle (Python: allow_pickle=True)"
            )
        reader._check_files()
        return reader

    # -- description -------------------------------------------------------------------
    @property
    def nrows(self) -> int:
        """Rows in the flushed state."""
        return self.shape[0]

    @property
    def item_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def row_nbytes(self) -> int:
        return int(np.prod(self.item_shape, dtype=np.int64)) * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Uncompressed size of the flushed rows."""
        return self.nrows * self.row_nbytes

    @property
    def is_object(self) -> bool:
        return bool(self.dtype.hasobject)

    @property
    def rows_per_file(self) -> int:
        """Rows in one ``.blp`` file: ``chunklen``, or 1 for object carrays (one pickle per file)."""
        return 1 if self.is_object else self.chunklen

    @property
    def nchunks(self) -> int:
        return -(-self.nrows // self.rows_per_file)

    @property
    def codec(self) -> str:
        """The compression as text, e.g. ``lz4-5 shuffle``, from the first chunk header (the truth)."""
        cp = self.cparams
        level = cp.get("clevel", 5)
        first = None
        for i in range(min(self.nchunks, 8)):
            try:
                with open(self.chunk_path(i), "rb") as f:
                    head = f.read(len(BLP_HEADER) + blosc1.HEADER_SIZE)
                h = blosc1.parse_header(head[len(BLP_HEADER) :], str(self.chunk_path(i)), complete=False)
            except (OSError, MigrationError):
                break
            first = first or h
            if not h.memcpyed:
                name = cp.get("cname") if cp.get("cname") in _FAMILY and _FAMILY[cp["cname"]] == h.codec else h.codec
                return f"{name}-{level} {h.shuffle}"
        if first is not None and "cname" not in cp:  # bcolz < 0.7.1 did not record it
            return describe_cparams({**cp, "cname": first.codec}) + " (chunks stored uncompressed)"
        return describe_cparams(cp)

    def chunk_path(self, i: int) -> Path:
        return self.rootdir / "data" / f"__{i}.blp"

    @property
    def cbytes(self) -> int:
        """Bytes on disk of the chunk files the flushed rows use."""
        return sum(self.chunk_path(i).stat().st_size for i in range(self.nchunks))

    def __repr__(self) -> str:
        return f"<bcolz carray {str(self.rootdir)!r} shape={self.shape} dtype={self.dtype} chunklen={self.chunklen}>"

    # -- checks ------------------------------------------------------------------------
    def _check_files(self) -> None:
        data = self.rootdir / "data"
        on_disk: set[int] = set()
        if data.is_dir():
            for p in data.iterdir():
                if p.name.startswith("__") and p.name.endswith(".blp") and p.name[2:-4].isdigit():
                    on_disk.add(int(p.name[2:-4]))
        need = self.nchunks
        for i in range(need):
            if i not in on_disk:
                raise MigrationError(
                    f"{self.chunk_path(i)}: chunk file missing (rows {i * self.rows_per_file}.."
                    f"{min((i + 1) * self.rows_per_file, self.nrows) - 1} of {self.nrows}); the carray is incomplete - "
                    "restore this file from a backup"
                )
        extra = sorted(i for i in on_disk if i >= need)
        if self.nrows == 0 and extra:
            raise MigrationError(
                f"{self.rootdir}: meta/sizes records 0 rows, but {len(extra)} chunk file(s) exist "
                f"({', '.join(f'__{i}.blp' for i in extra[:5])}{', ...' if len(extra) > 5 else ''}): the writer was killed "
                "or never flushed, so which rows are complete is unknown. Refusing to produce a silently empty store"
            )
        self.extra_files = [f"__{i}.blp" for i in extra]
        # beyond the flushed length: full chunks (or extra rows in the last) are unflushed
        # appends; a partial chunk file is trim()'s stale leftover
        unflushed = 0
        stale = []
        if self.nrows % self.rows_per_file and need:
            got = self._rows_in_file(need - 1)
            unflushed += max(0, got - self.nrows % self.rows_per_file)
        for i in extra:
            got = self._rows_in_file(i)
            if got >= self.rows_per_file:
                unflushed += got
            else:
                stale.append(f"__{i}.blp")
        if unflushed:
            self.warnings.append(
                f"{self.rootdir}: {unflushed} row(s) on disk were appended but never flushed (bcolz's flush() was not "
                f"called); migrated the last flushed state ({self.nrows} rows), as bcolz itself reads it"
            )
        if stale:
            self.notes.append(
                f"{self.rootdir}: ignored stale file(s) beyond the flushed rows (left by trim()): {', '.join(stale)}"
            )

    def _rows_in_file(self, i: int) -> int:
        """Rows a chunk file holds according to its Blosc header (0 if unreadable)."""
        try:
            with open(self.chunk_path(i), "rb") as f:
                head = f.read(len(BLP_HEADER) + blosc1.HEADER_SIZE)
            h = blosc1.parse_header(head[len(BLP_HEADER) :], str(self.chunk_path(i)), complete=False)
        except (OSError, MigrationError):
            return 0
        if self.is_object:
            return 1
        return h.nbytes // max(1, self.row_nbytes)

    # -- reading -----------------------------------------------------------------------
    def _chunk_bytes(self, i: int) -> bytes:
        p = self.chunk_path(i)
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            raise MigrationError(f"{p}: chunk file missing; restore it from a backup") from None
        if not raw:
            raise MigrationError(
                f"{p}: the chunk file is empty (0 bytes); the write was interrupted - restore it from a backup"
            )
        if raw[:4] != _BLP_MAGIC:
            raise MigrationError(f"{p}: not a bcolz chunk file (it does not start with b'blpk')")
        if len(raw) < len(BLP_HEADER) + blosc1.HEADER_SIZE:
            raise MigrationError(f"{p}: truncated chunk file ({len(raw)} bytes); restore it from a backup")
        return raw[len(BLP_HEADER) :]

    def chunk_rows(self, i: int) -> tuple[int, int]:
        """Row range [start, stop) of chunk ``i`` within the flushed rows."""
        k = self.rows_per_file
        return i * k, min((i + 1) * k, self.nrows)

    def read_chunk(self, i: int, out: np.ndarray | None = None) -> np.ndarray:
        """Rows of chunk ``i`` (shape (n, *item_shape)); a view of ``out`` if given."""
        start, stop = self.chunk_rows(i)
        n = stop - start
        p = self.chunk_path(i)
        data = self._chunk_bytes(i)
        h = blosc1.parse_header(data, str(p))
        if self.is_object:
            return self._read_object(i, data, h)
        need = n * self.row_nbytes
        if h.nbytes < need:
            raise MigrationError(
                f"{p}: holds {h.nbytes} bytes, but rows {start}..{stop - 1} need {need}; the chunk is truncated or damaged"
            )
        full = self.chunklen * self.row_nbytes
        if h.nbytes > full:
            raise MigrationError(f"{p}: holds {h.nbytes} bytes, more than a chunk of {self.chunklen} rows ({full})")
        if out is None or out.shape[1:] != self.item_shape or out.dtype != self.dtype or len(out) < self.chunklen:
            out = np.empty((self.chunklen, *self.item_shape), dtype=self.dtype)
        blosc1.decompress_into(data, out.reshape(-1).view(np.uint8), str(p), header=h)
        return out[:n]

    def _read_object(self, i: int, data: bytes, h: blosc1.Blosc1Header) -> np.ndarray:
        p = self.chunk_path(i)
        raw = blosc1.decompress(data, str(p))
        try:
            obj = pickle.loads(raw, encoding="latin1")  # noqa: S301 - only with allow_pickle, see open()
        except Exception as exc:
            raise MigrationError(f"{p}: the pickled element does not load ({type(exc).__name__}: {exc})") from exc
        out = np.empty(1, dtype=object)
        out[0] = obj
        return out

    def iter_chunks(self) -> Iterator[np.ndarray]:
        """Every chunk's rows in order, decoded into one reused buffer (copy what you keep)."""
        buf = None if self.is_object else np.empty((self.chunklen, *self.item_shape), dtype=self.dtype)
        for i in range(self.nchunks):
            yield self.read_chunk(i, buf)

    def iter_blocks(self, rows: int) -> Iterator[np.ndarray]:
        """Fresh arrays of exactly ``rows`` rows each (the last may be shorter), in order."""
        return _rebatch(self.iter_chunks(), rows, self.item_shape, self.dtype)

    def read(self) -> np.ndarray:
        """The whole flushed array in memory (small arrays and tests)."""
        out = np.empty(self.shape, dtype=self.dtype)
        for i, chunk in enumerate(self.iter_chunks()):
            a, b = self.chunk_rows(i)
            _records(out[a:b])[...] = _records(chunk)
        return out


def _records(a: np.ndarray) -> np.ndarray:
    """``a`` as raw records, so that assignment copies every byte (structured padding too)."""
    return a.view(np.dtype((np.void, a.dtype.itemsize))) if a.dtype.fields is not None else a


def _rebatch(
    chunks: Iterator[np.ndarray], rows: int, item_shape: tuple[int, ...], dtype: np.dtype
) -> Iterator[np.ndarray]:
    """Copy a stream of row chunks into fresh blocks of exactly ``rows`` rows (last shorter)."""
    if rows < 1:
        raise InvalidInputError(f"rows must be positive, got {rows}")
    block = np.empty((rows, *item_shape), dtype=dtype)
    fill = 0
    for chunk in chunks:
        pos = 0
        while pos < len(chunk):
            take = min(rows - fill, len(chunk) - pos)
            _records(block[fill : fill + take])[...] = _records(chunk[pos : pos + take])
            fill += take
            pos += take
            if fill == rows:
                yield block
                block = np.empty((rows, *item_shape), dtype=dtype)
                fill = 0
    if fill:
        yield block[:fill]


@dataclass
class CtableReader:
    """A bcolz ctable: one CarrayReader per column, in ``__rootdirs__`` order."""

    rootdir: Path
    names: list[str]
    columns: dict[str, CarrayReader]
    attrs: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, rootdir: str | os.PathLike[str], *, allow_pickle: bool = False) -> CtableReader:
        root = Path(rootdir)
        if root.is_dir():
            refuse_links_inside(root)
        spec = root / "__rootdirs__"
        try:
            names = json.loads(spec.read_text(encoding="utf-8"))["names"]
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                raise TypeError("names must be a list of strings")
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise MigrationError(f"{spec}: malformed ctable metadata ({exc!r})") from exc
        if not names:
            raise MigrationError(f"{spec}: the ctable has no columns")
        cols = {}
        for name in names:
            col = root / name
            if not is_carray(col):
                raise MigrationError(f"{root}: column {name!r} is listed in __rootdirs__ but {col} is not a carray")
            cols[name] = CarrayReader.open(col, allow_pickle=allow_pickle)
        lengths = {n: c.nrows for n, c in cols.items()}
        if len(set(lengths.values())) > 1:
            raise MigrationError(f"{root}: the columns disagree in length: {lengths}; the ctable is damaged")
        table = cls(root, list(names), cols, read_attrs(root))
        ignored = sorted(p.name for p in root.iterdir() if p.is_dir() and p.name not in names)
        if ignored:
            table.notes.append(
                f"{root}: ignored folder(s) not listed in __rootdirs__ (deleted columns): {', '.join(ignored)}"
            )
        return table

    @property
    def nrows(self) -> int:
        return self.columns[self.names[0]].nrows

    @property
    def warnings(self) -> list[str]:
        return [w for c in self.columns.values() for w in c.warnings]

    @property
    def cbytes(self) -> int:
        return sum(c.cbytes for c in self.columns.values())

    @property
    def dtype(self) -> np.dtype:
        """The table as one structured dtype (fields in column order)."""
        return np.dtype([(n, c.dtype, c.item_shape) if c.item_shape else (n, c.dtype) for n, c in self.columns.items()])

    def __repr__(self) -> str:
        return f"<bcolz ctable {str(self.rootdir)!r} rows={self.nrows} columns={self.names}>"

    def iter_blocks(self, rows: int, names: Sequence[str] | None = None) -> Iterator[dict[str, np.ndarray]]:
        """{name: block} for blocks of exactly ``rows`` rows (last shorter), columns read in step."""
        names = list(names if names is not None else self.names)
        iters = [self.columns[n].iter_blocks(rows) for n in names]
        for blocks in zip(*iters, strict=True):  # open() checked that the columns agree in length
            yield dict(zip(names, blocks, strict=True))

    def read(self) -> np.ndarray:
        """The whole table as a structured array (small tables and tests)."""
        out = np.empty(self.nrows, dtype=self.dtype)
        for n in self.names:
            out[n] = self.columns[n].read()
        return out


def open_bcolz(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> CarrayReader | CtableReader:
    """Open a bcolz carray or ctable rootdir for reading."""
    p = Path(path)
    if is_ctable(p):
        return CtableReader.open(p, allow_pickle=allow_pickle)
    if (p / "meta" / "storage").exists():
        return CarrayReader.open(p, allow_pickle=allow_pickle)
    raise MigrationError(f"{p}: not a bcolz carray or ctable (no meta/storage or __rootdirs__)")
