"""Writing a store: create, append, temporary files and the atomic rename (layer 4).

carraystore compresses every chunk itself with the pinned codec (``blosc2.compress2``)
and puts it in place with ``update_chunk``, so the chunk headers carry exactly the
recorded parameters, whatever blosc2's defaults are. Until ``close()`` a store lives in
a temporary file beside its path (``.NAME.b2nd.partial-PID-RANDOM``); ``close()``
fsyncs it and renames it into place, so a store is never seen half-written.
:func:`temp_path`, :func:`remove_stale_temps` and :func:`publish` are the same steps
for other writers (migrations).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import blosc2
import numpy as np

from carraystore._version import __version__
from carraystore.errors import CorruptStoreError, InvalidInputError, StoreExistsError
from carraystore.format import (
    COLOR_MODES,
    DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    LAYOUTS,
    META_KEY,
    Codec,
    StoreMeta,
    StringTable,
    as_records,
    check_codec_against_header,
    chunk_crc_ok,
    crc32,
    default_chunk_images,
    dtype_to_record,
    parse_chunk_header,
    validate_key,
)
from carraystore.reader import open_store

__all__ = ["StoreWriter", "create", "append", "compress_chunk", "temp_path", "remove_stale_temps", "publish", "fsync_path"]

# ``.NAME.partial-PID-RANDOM`` (stores) and ``.NAME.migrating-PID-RANDOM.b2nd`` (migrations)
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?:partial|migrating)-(?P<pid>\d+)-[0-9a-f]+(?:\.b2nd)?$")


def temp_path(path: Path, kind: str = "partial") -> Path:
    """A fresh hidden temporary name beside ``path`` for a writer of this process."""
    suffix = ".b2nd" if kind != "partial" else ""
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}{suffix}")


def remove_stale_temps(path: Path) -> None:
    """Remove temporary files that writers killed mid-write left next to ``path``."""
    with contextlib.suppress(OSError):
        for p in path.parent.iterdir():
            m = _TEMP.match(p.name)
            if not m or m.group("name") != path.name:
                continue
            try:
                os.kill(int(m.group("pid")), 0)
            except ProcessLookupError:
                with contextlib.suppress(OSError):
                    p.unlink()
            except PermissionError:
                pass


def fsync_path(path: Path, directory: bool = False) -> None:
    """fsync a file (or a folder, so that a rename in it is durable); errors are ignored."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def publish(tmp: Path, path: Path) -> None:
    """Make the finished temporary file ``tmp`` the store at ``path``: fsync, rename, fsync the folder."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(path.parent, directory=True)


def _frame_cparams(codec: Codec, dtype: np.dtype) -> dict[str, Any]:
    """Frame-level cparams: what plain blosc2 would use if someone wrote into the array."""
    cp: dict[str, Any] = {
        "codec": blosc2.Codec[codec.codec.upper()],
        "clevel": codec.clevel,
        "splitmode": blosc2.SplitMode[f"{codec.splitmode.upper()}_SPLIT"],
        "nthreads": 1,
    }
    if codec.typesize == dtype.itemsize and codec.filters:
        cp["filters"] = [blosc2.Filter[f.upper()] for f in codec.filters]
        cp["filters_meta"] = list(codec.filters_meta)
    else:  # explicit, never blosc2's default SHUFFLE (the frame's typesize is the dtype's itemsize)
        cp["filters"] = [blosc2.Filter.NOFILTER]
        cp["filters_meta"] = [0]
    return cp


def _write_meta(array: Any, meta: StoreMeta) -> None:
    array.schunk.vlmeta[META_KEY] = meta.to_record()


class StoreWriter:
    """Writes a store; returned by ``carraystore.create``. Use as a context manager.

    Until ``close()`` the data lives in a temporary file beside ``path``; ``close()``
    renames it into place atomically. On an exception inside ``with``, or ``abort()``,
    the temporary file is removed and ``path`` is untouched.
    """

    def __init__(self, path: Path, tmp: Path, array: Any, meta: StoreMeta, nthreads: int) -> None:
        self.path = path
        self._tmp = tmp
        self._array = array
        self._meta = meta
        self._nthreads = nthreads
        self._closed = False
        k = meta.chunk_images
        self._buf = np.zeros((k, *meta.image_shape), dtype=meta.np_dtype)
        self._cparams = meta.codec.cparams(meta.blocksize, nthreads)
        self._crc = list(int(c) for c in meta.crc32)
        self._labels: list[np.ndarray] = [meta.labels] if meta.labels is not None else []
        self._keys: list[StringTable] = [meta.keys] if meta.keys is not None else []
        self._has_labels: bool | None = None if meta.nimages == 0 and meta.class_names is None else meta.labels is not None
        if meta.class_names is not None:
            self._has_labels = True
        self._has_keys: bool | None = None if meta.nimages == 0 else meta.keys is not None
        self._skipped: list[dict[str, str]] = list(meta.skipped)
        self._columns: dict[str, list[np.ndarray]] = {name: [col] for name, col in meta.columns.items()}
        # Images [chunk_start, chunk_start + fill) sit in the pending buffer.
        self._chunk_start = (meta.nimages // k) * k
        self._fill = meta.nimages - self._chunk_start
        self._stored = meta.nimages  # images the array already holds
        if self._fill:
            data = array.schunk.get_chunk(self._chunk_start // k)
            if not chunk_crc_ok(data, self._crc[self._chunk_start // k], k * meta.image_nbytes):
                raise CorruptStoreError(f"{path}: last chunk fails its CRC32 check; not appending to a damaged store")
            blosc2.decompress2(data, dst=self._buf)
            self._buf[self._fill :].view(np.uint8)[...] = 0

    # -- public --------------------------------------------------------------------------
    @property
    def nimages(self) -> int:
        """Images written so far (including any already in an appended-to store)."""
        return self._chunk_start + self._fill

    @property
    def meta(self) -> StoreMeta:
        return self._meta

    def append(
        self,
        images: np.ndarray,
        labels: Sequence[int] | np.ndarray | None = None,
        keys: Sequence[str] | None = None,
        columns: dict[str, np.ndarray] | None = None,
    ) -> None:
        """Append images of shape (n, H, W, C) (or one (H, W, C) image) with optional labels and keys.

        ``columns`` adds per-item metadata arrays (name -> array of n rows); a store that has
        columns needs the same names on every append.
        """
        self._check_open()
        meta = self._meta
        dt = meta.np_dtype
        images = np.asarray(images)
        if meta.layout == "NHWC":
            if images.shape == meta.image_shape:
                images = images[None]
            if images.ndim == 3 and meta.image_shape[2] == 1 and images.shape[1:] == meta.image_shape[:2]:
                images = images[..., None]
        if images.ndim == 0 or images.shape[1:] != meta.image_shape:
            raise InvalidInputError(
                f"{self.path}: items of shape {images.shape[1:]} do not fit a store of item shape {meta.image_shape}"
            )
        if images.dtype != dt:
            raise InvalidInputError(
                f"{self.path}: data is {images.dtype}, the store holds {dt}; convert it with .astype({str(dt)!r})"
            )
        n = len(images)
        lab = self._check_labels(labels, n)
        keytab = self._check_keys(keys, n)
        cols = self._check_columns(columns, n)
        # Only an append that passed every check fixes whether the store has labels and keys.
        if self._has_labels is None:
            self._has_labels = lab is not None
        if self._has_keys is None:
            self._has_keys = keytab is not None
        if lab is not None:
            self._labels.append(lab)
        if keytab is not None:
            self._keys.append(keytab)
        for name, col in cols.items():
            self._columns.setdefault(name, []).append(col)
        k = meta.chunk_images
        pos = 0
        while pos < n:
            take = min(k - self._fill, n - pos)
            as_records(self._buf[self._fill : self._fill + take])[...] = as_records(images[pos : pos + take])
            self._fill += take
            pos += take
            if self._fill == k:
                self._flush_chunk()

    def add_skipped(self, path: str, reason: str) -> None:
        """Record an input that was skipped (kept in the metadata; nothing is dropped silently)."""
        self._skipped.append({"path": path, "reason": reason})

    # -- chunks compressed elsewhere (carraystore.dask) ------------------------------------
    def append_compressed_chunk(
        self,
        data: bytes,
        nitems: int,
        crc: int,
        labels: Sequence[int] | np.ndarray | None = None,
        keys: Sequence[str] | None = None,
    ) -> None:
        """Append one chunk compressed elsewhere by :func:`compress_chunk` (``nitems`` items).

        The writer must stand at a chunk boundary. A full chunk goes into the file as it is; a
        shorter one is decompressed into the pending buffer (so that it can still be appended
        to, and is written at ``close()``, as ``append`` would). ``crc`` is checked against
        ``data``, and the chunk's header against the store's codec.
        """
        self._check_open()
        meta = self._meta
        k = meta.chunk_images
        where = f"{self.path}, chunk {self.nimages // k}"
        if self._fill:
            raise InvalidInputError(f"{where}: {self._fill} items are pending; a compressed chunk must start at a chunk boundary")
        if not 0 < int(nitems) <= k:
            raise InvalidInputError(f"{where}: a compressed chunk holds 1..{k} items, not {nitems}")
        data = bytes(data)
        if not chunk_crc_ok(data, int(crc), k * meta.image_nbytes):
            raise CorruptStoreError(f"{where}: the compressed chunk does not match its CRC32 {int(crc):08x}; it was damaged in transit")
        header = parse_chunk_header(data)
        check_codec_against_header(meta.codec, meta.blocksize, header, where)
        if header.nbytes != k * meta.image_nbytes:
            raise InvalidInputError(f"{where}: the compressed chunk holds {header.nbytes} bytes, a chunk is {k * meta.image_nbytes}")
        n = int(nitems)
        lab = self._check_labels(labels, n)
        keytab = self._check_keys(keys, n)
        self._check_columns(None, n)
        if self._has_labels is None:
            self._has_labels = lab is not None
        if self._has_keys is None:
            self._has_keys = keytab is not None
        if n < k:  # the last chunk so far: kept pending, exactly like a short append
            blosc2.decompress2(data, dst=self._buf)
            self._buf[n:].view(np.uint8)[...] = 0
        if lab is not None:
            self._labels.append(lab)
        if keytab is not None:
            self._keys.append(keytab)
        if n < k:
            self._fill = n
            return
        self._store_chunk(self._chunk_start // k, data, self._chunk_start + k)
        self._crc.append(int(crc))
        self._chunk_start += k

    def close(self) -> None:
        """Finish: write the last chunk and the metadata, fsync, rename into place."""
        if self._closed:
            return
        try:
            if self._fill:
                self._flush_chunk()
            labels = np.concatenate(self._labels).astype("<i8") if self._labels else None
            if labels is None and self._has_labels:
                labels = np.zeros(0, dtype="<i8")
            keys = StringTable.join(self._keys) if self._keys else None
            meta = dataclasses.replace(
                self._meta,
                nimages=self.nimages,
                labels=labels,
                keys=keys,
                crc32=np.asarray(self._crc, dtype="<u4"),
                skipped=tuple(self._skipped),
                columns={name: np.concatenate(parts) for name, parts in self._columns.items()},
                writer_version=__version__,
                blosc2_version=blosc2.__version__,
            )
            meta.validate(str(self.path))
            _write_meta(self._array, meta)
            self._meta = meta
            self._array = None
            publish(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        self._closed = True

    def abort(self) -> None:
        """Throw away everything written; ``path`` is left as it was."""
        self._closed = True
        self._array = None
        with contextlib.suppress(FileNotFoundError):
            self._tmp.unlink()

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            with contextlib.suppress(Exception):
                self.abort()

    # -- internals -----------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise InvalidInputError(f"{self.path}: writer is closed")

    def _check_labels(self, labels: Any, n: int) -> np.ndarray | None:
        has = labels is not None
        if self._has_labels is not None and has != self._has_labels:
            if self._has_labels:
                raise InvalidInputError(f"{self.path}: this store is labelled; pass labels= for every append")
            raise InvalidInputError(f"{self.path}: this store has no labels; pass labels for every image from the first append")
        if not has:
            return None
        lab = np.asarray(labels)
        if lab.shape != (n,):
            raise InvalidInputError(f"{self.path}: {lab.shape} labels for {n} images; give one integer label per image")
        if n and lab.dtype.kind not in "iu":
            if lab.dtype.kind == "f" and np.all(lab == np.round(lab)):
                lab = lab.astype(np.int64)
            else:
                raise InvalidInputError(f"{self.path}: labels must be integers, got {lab.dtype}")
        lab = lab.astype("<i8")
        names = self._meta.class_names
        if n and names is not None and (lab.min() < 0 or lab.max() >= len(names)):
            raise InvalidInputError(
                f"{self.path}: labels span {lab.min()}..{lab.max()} but there are {len(names)} class names"
            )
        if n and lab.min() < 0:
            raise InvalidInputError(f"{self.path}: labels must be >= 0, got {lab.min()}")
        return lab

    def _check_columns(self, columns: dict[str, np.ndarray] | None, n: int) -> dict[str, np.ndarray]:
        columns = dict(columns or {})
        if self.nimages and set(columns) != set(self._columns):
            raise InvalidInputError(
                f"{self.path}: columns {sorted(columns)} given, the store has columns {sorted(self._columns)}; "
                "give the same columns on every append"
            )
        out = {}
        for name, col in columns.items():
            arr = np.asarray(col)
            if arr.ndim == 0 or len(arr) != n:
                raise InvalidInputError(f"{self.path}: column {name!r} has {arr.shape} rows for {n} items")
            dtype_to_record(arr.dtype)  # refuses object dtypes
            if name in self._columns and self._columns[name]:
                prev = self._columns[name][0]
                if prev.dtype != arr.dtype or prev.shape[1:] != arr.shape[1:]:
                    raise InvalidInputError(
                        f"{self.path}: column {name!r} is {arr.dtype}{arr.shape[1:]}, earlier rows are {prev.dtype}{prev.shape[1:]}"
                    )
            out[name] = arr
        return out

    def _check_keys(self, keys: Any, n: int) -> StringTable | None:
        has = keys is not None
        if self._has_keys is not None and has != self._has_keys:
            if self._has_keys:
                raise InvalidInputError(f"{self.path}: this store has keys; pass keys= for every append")
            raise InvalidInputError(f"{self.path}: this store has no keys; pass keys for every image from the first append")
        if not has:
            return None
        keys = list(keys)
        if len(keys) != n:
            raise InvalidInputError(f"{self.path}: {len(keys)} keys for {n} images; give one key per image")
        return StringTable.from_strings(validate_key(k) for k in keys)

    def _flush_chunk(self) -> None:
        k = self._meta.chunk_images
        ic = self._chunk_start // k
        if self._fill < k:
            self._buf[self._fill :].view(np.uint8)[...] = 0  # deterministic padding
        data = blosc2.compress2(self._buf, **self._cparams)
        total = self._chunk_start + self._fill
        if self._stored == 0:
            # blosc2 < 4.1 cannot grow an array from length 0 (3.x miscounts its chunks,
            # 4.0 crashes), so the first chunk re-creates the still empty file at length total.
            self._array = None
            self._array = _new_array(self._tmp, self._meta, total)
            self._stored = total
        elif total != self._stored:
            self._array.resize((total, *self._meta.image_shape))
            self._stored = total
        self._array.schunk.update_chunk(ic, data)
        c = crc32(data)
        if ic < len(self._crc):
            self._crc[ic] = c
        else:
            self._crc.append(c)
        if self._fill == k:
            self._chunk_start += k
            self._fill = 0

    def _store_chunk(self, ic: int, data: bytes, total: int) -> None:
        """Put the compressed chunk ``ic`` into the file, the array then holding ``total`` items.

        (The steps of ``_flush_chunk``, for ``append_compressed_chunk``; the appends branch
        has a method of this name that ``_flush_chunk`` also uses: keep that one.)
        """
        if self._stored == 0:
            # blosc2 < 4.1 cannot grow an array from length 0 (3.x miscounts its chunks,
            # 4.0 crashes), so the first chunk re-creates the still empty file at length total.
            self._array = None
            self._array = _new_array(self._tmp, self._meta, total)
            self._stored = total
        elif total != self._stored:
            self._array.resize((total, *self._meta.image_shape))
            self._stored = total
        self._array.schunk.update_chunk(ic, data)


def create(
    path: str | os.PathLike[str],
    image_shape: Sequence[int] | None = None,
    dtype: str | np.dtype = "uint8",
    codec: Codec | str | None = None,
    chunk_images: int | None = None,
    class_names: Sequence[str] | None = None,
    attrs: dict[str, Any] | None = None,
    *,
    mode: str = "w",
    overwrite: bool = False,
    provenance: dict[str, Any] | None = None,
    nthreads: int | None = None,
    layout: str | None = None,
) -> StoreWriter:
    """Start writing a store at ``path``; returns a StoreWriter (a context manager).

    ``mode="w"`` creates a new store (``overwrite=True`` to replace an existing file at
    close); ``mode="a"`` appends to an existing store, keeping its pinned codec.
    ``codec`` is a Codec, a preset name, or None for the default (``balanced``).
    ``image_shape`` is the shape of one item: (H, W, C) for images (C = 1, 3 or 4; an
    (H, W) shape gets C = 1), or any shape with ``layout="array"`` (``()`` for scalars).
    ``layout=None`` picks "NHWC" for (H, W, C) pixel data and "array" otherwise.
    """
    p = Path(path)
    if p.suffix != ".b2nd":
        raise InvalidInputError(f"{p}: a store's file name must end in .b2nd")
    if nthreads is None:
        nthreads = max(1, min(8, os.cpu_count() or 1))
    remove_stale_temps(p)
    if mode == "a":
        return _open_for_append(p, image_shape, dtype, nthreads, codec)
    if mode != "w":
        raise InvalidInputError(f"mode must be 'w' or 'a', got {mode!r}")
    if p.exists() and not overwrite:
        raise StoreExistsError(f"{p} already exists; pass overwrite=True (CLI: --overwrite) to replace it, or mode='a' to append")
    if not p.parent.is_dir():
        raise InvalidInputError(f"{p}: folder {p.parent} does not exist")
    if image_shape is None:
        raise InvalidInputError("create(): image_shape (H, W, C) is required for a new store")
    shape = tuple(int(x) for x in image_shape)
    dt = np.dtype(dtype)
    dtype_to_record(dt)  # refuses object dtypes with a clear message
    is_pixels = dt.name in DTYPES and dt.isnative
    if layout is None:
        layout = "NHWC" if is_pixels and (len(shape) == 2 or (len(shape) == 3 and shape[2] in COLOR_MODES)) else "array"
    if layout not in LAYOUTS:
        raise InvalidInputError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "NHWC":
        if len(shape) == 2:
            shape = (*shape, 1)
        if len(shape) != 3 or shape[2] not in COLOR_MODES or min(shape) < 1:
            raise InvalidInputError(f"image_shape {tuple(image_shape)} must be (H, W, C) with C = 1, 3 or 4")
        if not is_pixels:
            raise InvalidInputError(f"dtype {dt} is not an image dtype; use one of {DTYPES} or layout='array'")
    elif shape and min(shape) < 1:
        raise InvalidInputError(f"item shape {shape} has an empty dimension")
    if codec is None:
        codec = Codec.preset("balanced")
    elif isinstance(codec, str):
        codec = Codec.preset(codec)
    elif not isinstance(codec, Codec):
        raise InvalidInputError(f"codec must be a Codec, a preset name or None, got {type(codec).__name__}")
    auto_block = codec.block_images is None
    codec = codec.resolve(dt, shape, layout)
    image_nbytes = max(1, math.prod(shape)) * dt.itemsize
    if auto_block and chunk_images is not None:
        # the largest divisor of chunk_images not above the automatic block size
        want = min(int(chunk_images), codec.block_images)  # type: ignore[type-var]
        codec = dataclasses.replace(codec, block_images=max(d for d in range(1, want + 1) if chunk_images % d == 0))
    if (image_nbytes * codec.block_images) % codec.typesize:
        raise InvalidInputError(
            f"codec typesize {codec.typesize} does not divide a block of {codec.block_images} image(s) "
            f"({image_nbytes * codec.block_images} bytes)"
        )
    if chunk_images is None:
        chunk_images = default_chunk_images(image_nbytes, codec.block_images, layout)  # type: ignore[arg-type]
    chunk_images = int(chunk_images)
    if codec.block_images > chunk_images:  # type: ignore[operator]
        codec = dataclasses.replace(codec, block_images=chunk_images)
    if chunk_images < 1 or chunk_images % codec.block_images:
        raise InvalidInputError(
            f"chunk_images {chunk_images} must be a positive multiple of the codec's block_images {codec.block_images}"
        )
    if image_nbytes * codec.block_images >= 2**31 or image_nbytes * chunk_images >= 2**31:
        raise InvalidInputError(f"chunks of {chunk_images} images of {image_nbytes} bytes exceed blosc2's 2 GiB limit")
    names = tuple(str(c) for c in class_names) if class_names is not None else None
    meta = StoreMeta(
        image_shape=shape,
        dtype=dtype_to_record(dt),
        codec=codec,
        chunk_images=chunk_images,
        layout=layout,
        color_mode=COLOR_MODES[shape[2]] if layout == "NHWC" else "",
        class_names=names,
        provenance=dict(provenance or {}),
        attrs=dict(attrs or {}),
        writer_version=__version__,
        blosc2_version=blosc2.__version__,
    )
    meta.validate(str(p))
    tmp = temp_path(p)
    try:
        array = _new_array(tmp, meta, 0)
    except Exception:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return StoreWriter(p, tmp, array, meta, nthreads)


def _new_array(tmp: Path, meta: StoreMeta, nimages: int) -> Any:
    """A fresh store file at ``tmp`` holding ``nimages`` unwritten items and ``meta``."""
    shape = meta.image_shape
    array = blosc2.empty(
        (nimages, *shape),
        dtype=meta.np_dtype,
        chunks=(meta.chunk_images, *shape),
        blocks=(meta.codec.block_images, *shape),
        urlpath=str(tmp),
        mode="w",
        meta={META_KEY: {"format": FORMAT_NAME, "format_version": FORMAT_VERSION}},
        cparams=_frame_cparams(meta.codec, meta.np_dtype),
    )
    _write_meta(array, meta)
    return array


def _open_for_append(
    p: Path, image_shape: Sequence[int] | None, dtype: Any, nthreads: int, codec: Codec | str | None = None
) -> StoreWriter:
    existing = open_store(p)  # validates format, codec and header
    meta = existing.meta
    existing.close()
    if codec is not None:
        asked = Codec.preset(codec) if isinstance(codec, str) else codec
        pinned = meta.codec
        same = all(
            getattr(asked, f) is None or getattr(asked, f) == getattr(pinned, f)
            for f in ("codec", "clevel", "filters", "typesize", "block_images", "splitmode")
        )
        if not same:
            raise InvalidInputError(
                f"{p}: the store's codec is pinned ({pinned.describe()}); appending keeps it, so a different codec "
                f"({asked.describe()}) cannot be used. Leave codec out, or write a new store"
            )
    if image_shape is not None:
        shape = tuple(int(x) for x in image_shape)
        if len(shape) == 2 and meta.layout == "NHWC":
            shape = (*shape, 1)
        if shape != meta.image_shape:
            raise InvalidInputError(f"{p}: appending images of shape {shape} to a store of image_shape {meta.image_shape}")
        if dtype is not None and np.dtype(dtype) != meta.np_dtype:
            raise InvalidInputError(f"{p}: appending {np.dtype(dtype)} images to a store of {meta.dtype}")
    tmp = temp_path(p)
    try:
        # Work on a copy so that a crash mid-append never touches the images already stored.
        shutil.copyfile(p, tmp)
        array = blosc2.open(str(tmp), mode="a")  # never pass cparams here
        return StoreWriter(p, tmp, array, meta, nthreads)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def append(path: str | os.PathLike[str], nthreads: int | None = None) -> StoreWriter:
    """Open an existing store to append images; same as ``create(path, mode="a")``."""
    return create(path, mode="a", dtype=None, nthreads=nthreads)  # type: ignore[arg-type]


# -- chunks compressed elsewhere (carraystore.dask: workers compress, one writer places) --------


def compress_chunk(meta: StoreMeta, items: np.ndarray) -> tuple[bytes, int]:
    """Compress up to ``meta.chunk_images`` items as one store chunk: (bytes, CRC32).

    The bytes are exactly what :class:`StoreWriter` writes for the same items (zero padding
    after the last item, the pinned codec); any process can run this and hand the result
    to :meth:`StoreWriter.append_compressed_chunk`.
    """
    k = meta.chunk_images
    items = np.asarray(items)
    if items.shape[1:] != meta.image_shape or items.dtype != meta.np_dtype or len(items) > k:
        raise InvalidInputError(
            f"compress_chunk: {items.dtype}{items.shape} is not up to {k} items of {meta.np_dtype}{meta.image_shape}"
        )
    if len(items) == k and items.flags.c_contiguous:
        buf = items
    else:
        buf = np.zeros((k, *meta.image_shape), dtype=meta.np_dtype)
        as_records(buf[: len(items)])[...] = as_records(items)
    data = blosc2.compress2(buf, **meta.codec.cparams(meta.blocksize, 1))
    return data, crc32(data)
