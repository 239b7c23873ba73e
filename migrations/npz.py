"""``.npz`` sources: caches of ``{path: image}`` and archives of whole arrays (``x=images, y=labels``).

Members are streamed from the zip; nothing is unpickled. Cache keys become relative to their
common root; paths like ``.../<class>/<file>`` give the labels.
"""

from __future__ import annotations

import posixpath
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import numpy as np

from carraystore.base.errors import MigrationError

from .base import (
    CLASS_NAME_DATASETS,
    Block,
    PickleNotAllowedError,
    Source,
    class_labels,
    fixed_from_objects,
    plan_arrays,
)

__all__ = ["NpzSource", "relative_keys", "read_npy_header"]

_IMAGE_EXTS = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm", ".npy", ".jp2"}
_DRIVE = re.compile(r"^[A-Za-z]:")


def read_npy_header(f: IO[bytes], where: str, *, allow_objects: bool = False) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran_order, dtype) of an ``.npy`` stream; objects: PickleNotAllowedError unless ``allow_objects``."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = fmt.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = fmt.read_array_header_2_0(f)
        else:
            # 3.0: utf-8 field names; numpy's stubs leave out its private reader
            shape, fortran, dtype = fmt._read_array_header(f, version)  # type: ignore[attr-defined]
    except (ValueError, OSError, EOFError) as exc:
        raise MigrationError(f"{where}: not a valid .npy member ({exc})") from exc
    if dtype.hasobject and not allow_objects:
        raise PickleNotAllowedError(
            f"{where}: holds Python objects (pickled); unpickling runs code from the file. Only for a file you "
            "trust: pass --allow-pickle (allow_pickle=True), and the objects become a fixed-size array when they "
            "have one common type"
        )
    return tuple(shape), bool(fortran), dtype


def _read_exact(f: IO[bytes], n: int, where: str) -> bytes:
    parts = []
    got = 0
    while got < n:
        b = f.read(n - got)
        if not b:
            raise MigrationError(f"{where}: truncated: {n - got} bytes missing")
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def relative_keys(names: list[str]) -> tuple[list[str], str]:
    """Keys relative to their common root folder (and the root, for the report).

    Backslashes become ``/`` and drive letters go: ``C:\\data\\cats\\1.jpg`` -> ``cats/1.jpg``.
    """
    norm = []
    for n in names:
        k = _DRIVE.sub("", n.replace("\\", "/"))
        if k.startswith("~"):
            k = "/" + k  # a home-relative path is as absolute as any other
        k = posixpath.normpath(k)
        norm.append(k)
    absolute = {k.startswith("/") for k in norm}
    if len(absolute) > 1:
        raise MigrationError("the .npz mixes absolute and relative paths as keys; cannot find their common root")
    dirs = [posixpath.dirname(k) for k in norm]
    root = posixpath.commonpath(dirs) if dirs and all(dirs) else ("/" if absolute == {True} else "")
    if root in ("", "."):
        out = [k.lstrip("/") for k in norm]
    else:
        out = [posixpath.relpath(k, root) for k in norm]
    if any(k.startswith("..") or k.startswith("/") for k in out):
        raise MigrationError("could not make the .npz keys relative to a common folder")
    return out, root


class NpzSource(Source):
    """An ``.npz`` file: a cache of one image per member keyed by path, or named arrays."""

    kind = ".npz"

    def __init__(
        self,
        path: Path,
        *,
        images: str | None = None,
        labels: str | None = None,
        no_labels: bool = False,
        allow_pickle: bool = False,
        onehot: bool = False,
    ) -> None:
        super().__init__()
        self.path = path
        self.allow_pickle = allow_pickle
        self.onehot = onehot
        try:
            self._zip = zipfile.ZipFile(path)
        except zipfile.BadZipFile as exc:
            raise MigrationError(f"{path}: not a valid .npz (zip) file ({exc}); it may be truncated") from exc
        infos = [i for i in self._zip.infolist() if not i.is_dir()]
        npy = [i for i in infos if i.filename.endswith(".npy")]
        other = [i.filename for i in infos if not i.filename.endswith(".npy")]
        if other:
            self.notes.append(f"ignored non-.npy member(s): {other[:5]}")
        if not npy:
            raise MigrationError(f"{path}: the .npz holds no arrays")
        self._members = {i.filename[:-4]: i for i in npy}
        compressed = any(i.compress_type != zipfile.ZIP_STORED for i in npy)
        self.codec = "zip deflate (np.savez_compressed)" if compressed else "zip stored (np.savez)"
        self.attrs = {}
        names = list(self._members)
        pathlike = all("/" in n or "\\" in n or posixpath.splitext(n)[1].lower() in _IMAGE_EXTS for n in names)
        if images is not None or not pathlike:
            self._init_arrays(images, labels, no_labels)
        else:
            if labels is not None:
                raise MigrationError(
                    f"{path}: a cache of images keyed by path takes its labels from the class folders; drop --labels"
                )
            self._init_cache()

    # -- a cache {path: image} -------------------------------------------------------------
    def _init_cache(self) -> None:
        self.kind = ".npz cache"
        self.mode = "cache"
        names = list(self._members)
        shape = dtype = None
        for name in names:
            with self._zip.open(self._members[name]) as f:
                s, _fortran, dt = read_npy_header(f, f"{self.path}, member {name!r}")
            if shape is None:
                shape, dtype = s, dt
            elif s != shape or dt != dtype:
                raise MigrationError(
                    f"{self.path}: member {name!r} is {dt}{list(s)}, the first member is {dtype}{list(shape)}; "
                    "a store holds items of one shape and dtype - resize them to one size first"
                )
        assert shape is not None and dtype is not None
        self.item_shape, self.dtype, self.nrows = shape, dtype, len(names)
        self.keys, root = relative_keys(names)
        if root not in ("", "/"):
            self.notes.append(f"keys made relative to their common folder {root!r}")
        parents = [posixpath.dirname(k) for k in self.keys]
        classes = sorted({posixpath.basename(p) for p in parents})
        self._labels = None
        if all(parents) and 2 <= len(classes) < len(names):
            index = {c: i for i, c in enumerate(classes)}
            self._labels = np.array([index[posixpath.basename(p)] for p in parents], dtype="<i8")
            self.class_names = tuple(classes)
            self.has_labels = True
            self.notes.append(
                f"labels from the parent folder of each path: {len(classes)} classes {classes[:10]}{' ...' if len(classes) > 10 else ''}"
            )
        else:
            self.notes.append("no labels: the paths do not look like class folders (<class>/<file>)")
        self.provenance = {"npz": {"mode": "cache", "members": len(names), "member_dtype": str(dtype)}}

    # -- named arrays ------------------------------------------------------------------------
    def _init_arrays(self, images: str | None, labels: str | None, no_labels: bool = False) -> None:
        """Named arrays: images given or inferred (the only one, or the only 3+-D one), labels as in HDF5."""
        self.kind = ".npz arrays"
        self.mode = "arrays"
        names = list(self._members)
        for n in (images, labels):
            if n is not None and n not in self._members:
                raise MigrationError(f"{self.path}: no array named {n!r}; it holds {names}")
        heads: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        for n in names:
            with self._zip.open(self._members[n]) as f:
                shape, _, dtype = read_npy_header(f, f"{self.path}, member {n!r}", allow_objects=self.allow_pickle)
            heads[n] = (shape, dtype)
        self._objects: dict[str, np.ndarray] = {}
        for n, (_shape, dtype) in heads.items():  # --allow-pickle: objects as a fixed-size array, or not at all
            if dtype.hasobject:
                self._objects[n] = self._unpickled(n)
                heads[n] = (self._objects[n].shape, self._objects[n].dtype)
        if images is None:
            candidates = [n for n in names if n != labels and heads[n][0] and heads[n][1].kind not in "USO"]
            big = [n for n in candidates if len(heads[n][0]) >= 3]
            if len(candidates) == 1:
                images = candidates[0]
            elif len(big) == 1:
                images = big[0]
                self.notes.append(f"images inferred: {images!r} (the only array with 3+ dimensions)")
            else:
                raise MigrationError(
                    f"{self.path}: holds arrays named {names[:10]}; say which one holds the images with --images NAME "
                    "(and the labels with --labels NAME)"
                )
        shape, self.dtype = heads[images]
        if not shape:
            raise MigrationError(f"{self.path}: array {images!r} is a scalar; nothing to store row by row")
        self._fortran = False
        if images not in self._objects:
            with self._zip.open(self._members[images]) as f:
                _, self._fortran, _ = read_npy_header(f, f"{self.path}, member {images!r}")
        self.images_name = images
        self.nrows, self.item_shape = shape[0], tuple(shape[1:])
        if self._fortran:
            self.warnings.append(f"array {images!r} is stored in Fortran order: it is read in one piece, not streamed")
        if labels is not None and heads[labels][0][:1] != (self.nrows,):
            raise MigrationError(
                f"{self.path}: {heads[labels][0][0] if heads[labels][0] else 0} labels in {labels!r} "
                f"for {self.nrows} rows in {images!r}"
            )
        names_members = [
            n
            for n in names
            if n not in (images, labels)
            and n.lower() in CLASS_NAME_DATASETS
            and len(heads[n][0]) == 1
            and heads[n][1].kind in "US"
        ]
        plan = plan_arrays(
            heads,
            images,
            self.nrows,
            labels=labels,
            no_labels=no_labels,
            onehot=self.onehot,
            exclude=names_members,
            where=str(self.path),
            notes=self.notes,
        )
        labels = plan.labels
        self._labels = None
        if labels is not None:
            lab = self._load(labels)
            where = f"{self.path}, array {labels!r}"
            self._labels, self.class_names, how = class_labels(lab, where, plan.onehot)
            self.has_labels = True
            self.notes.append(f"labels from {labels!r}: {how}")
        names_member = self._class_names_member(names_members, images, labels)
        self._columns: list[str] = plan.fields
        if self._columns:
            self.notes.append(f"arrays kept as per-item metadata columns (fields): {self._columns}")
        for n, why in plan.skipped.items():
            self.notes.append(f"not migrated: {n!r} ({why})")
        for n in names_members:
            if n != names_member:
                self.notes.append(f"not migrated: {n!r} (class names, but another member gave them)")
        self.provenance = {"npz": {"mode": "arrays", "images": images, "labels": labels}}

    def _unpickled(self, name: str) -> np.ndarray:
        """An object member, unpickled (``allow_pickle`` was given) and made a fixed-size array."""
        where = f"{self.path}, member {name!r}"
        with self._zip.open(self._members[name]) as f:
            a = np.lib.format.read_array(f, allow_pickle=True)
        return fixed_from_objects(a, where, self.notes)

    def _class_names_member(self, names: list[str], images: str, labels: str | None) -> str | None:
        """Take class names from a member named class_names / classes / label_names (strings), if any."""
        for n in names:
            if self._labels is None:
                self.notes.append(
                    f"not migrated: {n!r} (looks like class names, but there are no class labels to name: "
                    "--labels NAME, or --onehot-to-class for one-hot rows)"
                )
                return n
            values = self._load(n)
            text = tuple(v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values.tolist())
            top = int(self._labels.max()) if len(self._labels) else -1
            if top >= len(text):
                raise MigrationError(
                    f"{self.path}: labels go up to {top} but member {n!r} holds {len(text)} class names; "
                    "give the right ones with --class-names A,B,C"
                )
            if self.class_names is None:
                self.class_names = text
                self.notes.append(f"class names from member {n!r}: {list(text)[:10]}{' ...' if len(text) > 10 else ''}")
            return n
        return None

    def _load(self, name: str) -> np.ndarray:
        if name in self._objects:
            return self._objects[name]
        where = f"{self.path}, member {name!r}"
        with self._zip.open(self._members[name]) as f:
            shape, fortran, dtype = read_npy_header(f, where)
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            data = _read_exact(f, n, where)
        return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C")

    # -- reading -------------------------------------------------------------------------------
    def blocks(self) -> Iterator[Block]:
        if self.mode == "cache":
            yield from self._cache_blocks()
        else:
            yield from self._array_blocks()

    def _cache_blocks(self) -> Iterator[Block]:
        rows = self.block_rows
        names = list(self._members)
        n_item = self.row_nbytes
        for start in range(0, len(names), rows):
            part = names[start : start + rows]
            block = np.empty((len(part), *self.item_shape), dtype=self.dtype)
            flat = block.reshape(len(part), -1).view(np.uint8) if n_item else None
            for j, name in enumerate(part):
                where = f"{self.path}, member {name!r}"
                with self._zip.open(self._members[name]) as f:
                    shape, fortran, dtype = read_npy_header(f, where)
                    if shape != self.item_shape or dtype != self.dtype:
                        raise MigrationError(f"{where}: changed while reading ({dtype}{list(shape)})")
                    data = _read_exact(f, n_item, where)
                if fortran:
                    block[j] = np.frombuffer(data, dtype=dtype).reshape(shape, order="F")
                elif flat is not None:
                    flat[j] = np.frombuffer(data, dtype=np.uint8)
            lab = self._labels[start : start + len(part)] if self._labels is not None else None
            yield Block(block, labels=lab, keys=self.keys[start : start + len(part)])

    def _array_blocks(self) -> Iterator[Block]:
        where = f"{self.path}, member {self.images_name!r}"
        cols = {n: self._load(n) for n in self._columns}
        rows = self.block_rows
        if self._fortran or self.images_name in self._objects:
            whole = np.ascontiguousarray(self._load(self.images_name))
            for a in range(0, self.nrows, rows):
                b = min(a + rows, self.nrows)
                yield self._array_block(whole[a:b], a, cols)
            return
        with self._zip.open(self._members[self.images_name]) as f:
            read_npy_header(f, where)
            for a in range(0, self.nrows, rows):
                b = min(a + rows, self.nrows)
                data = _read_exact(f, (b - a) * self.row_nbytes, where)
                block = np.frombuffer(data, dtype=self.dtype).reshape((b - a, *self.item_shape))
                yield self._array_block(block, a, cols)

    def _array_block(self, block: np.ndarray, a: int, cols: dict[str, np.ndarray]) -> Block:
        b = a + len(block)
        lab = self._labels[a:b] if self._labels is not None else None
        return Block(block, labels=lab, columns={n: c[a:b] for n, c in cols.items()} or None)

    def close(self) -> None:
        self._zip.close()
