"""Writing a store: ``create``, ``append`` and the StoreWriter they return.

Chunks are compressed with the pinned codec and placed with ``update_chunk``, so their headers
carry exactly the recorded parameters. A new store is published atomically at ``close()``
(:mod:`carraystore.base.atomic`; URLs: :mod:`carraystore.sources.upload`); appends write in
place under a rollback journal (:mod:`carraystore.store.inplace`). Every writer holds the
store's writer lock (:mod:`carraystore.base.lock`) until ``close``/``abort`` (docs/appends.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blosc2
import numpy as np

from carraystore._version import __version__
from carraystore.base.atomic import named_write_errors, publish, refuse_folder_target, remove_stale_temps, temp_path
from carraystore.base.errors import (
    CodecRoundTripError,
    CorruptStoreError,
    EncodedImageError,
    InvalidInputError,
    StoreExistsError,
)
from carraystore.base.lock import WriterLock
from carraystore.format.codec import (
    Codec,
    check_codec_against_header,
    chunk_crc,
    chunk_crc_ok,
    default_chunk_images,
    is_preset,
    parse_chunk_header,
)
from carraystore.format.encoded import (
    FORMAT_VERSION_ENCODED,
    Encoding,
    decode_file,
    default_codec,
    entry_for_pixels,
    file_format,
    sniff,
)
from carraystore.format.record import (
    COLOR_MODES,
    DTYPES,
    FORMAT_VERSION,
    LAYOUTS,
    StoreMeta,
    as_records,
    dtype_to_record,
    json_attrs,
)
from carraystore.sources.journal import rollback
from carraystore.sources.upload import RemoteTarget
from carraystore.store.checks import check_header_for_write
from carraystore.store.chunks import check_round_trip, new_array
from carraystore.store.inplace import _InPlaceWrite, _write_meta, refuse_hard_links
from carraystore.store.items import CheckedItems, ItemRecord, check_class_names
from carraystore.store.options import WriteKwargs, WriteOptions
from carraystore.store.reader import is_url, open_store

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "StoreWriter",
    "create",
    "append",
]


class StoreWriter:
    """Writes a store; returned by ``carraystore.create``. Use as a context manager.

    ``close()`` publishes atomically (uploading for a URL); an exception inside ``with``,
    or ``abort()``, leaves ``path`` untouched.
    """

    def __init__(
        self,
        path: Path,
        tmp: Path,
        array: Any,
        meta: StoreMeta,
        nthreads: int,
        *,
        lock: WriterLock | None = None,
        inplace: _InPlaceWrite | None = None,
    ) -> None:
        #: the store's path, or its URL when it is uploaded at close
        self.path: Any = path
        #: the local file that close() publishes (a staging file for a URL)
        self._dest = path
        #: set by ``create`` for a URL: the upload that ``close()`` makes
        self._target: RemoteTarget | None = None
        #: size in bytes of the published store (set by ``close()``)
        self.file_size: int | None = None
        self._tmp = tmp
        self._array = array
        self._lock = lock
        self._inplace = inplace
        self._meta = meta
        self._nthreads = nthreads
        self._closed = False
        k = meta.chunk_images
        self._buf = np.zeros((k, *meta.image_shape), dtype=meta.np_dtype)
        self._cparams = meta.codec.cparams(meta.blocksize, nthreads)
        #: a custom codec's chunks are round-tripped here (blosc2 mis-decodes some filter
        #: chains); None for the tested presets
        self._round_trip: np.ndarray | None = (
            None if is_preset(meta.codec, meta.np_dtype, meta.image_shape, meta.layout) else np.empty_like(self._buf)
        )
        self._crc = list(int(c) for c in meta.crc32)
        self._items = ItemRecord(meta, path)
        self._skipped: list[dict[str, str]] = list(meta.skipped)
        # Images [chunk_start, chunk_start + fill) sit in the pending buffer.
        self._chunk_start = (meta.nimages // k) * k
        self._fill = meta.nimages - self._chunk_start
        self._stored = meta.nimages  # images the array already holds
        #: layout "encoded": each entry's size, and where the next entry goes in the pending chunk
        self._sizes: list[np.ndarray] = [meta.entry_sizes] if meta.entry_sizes is not None else []
        self._encoding = meta.encoding
        self._pos = int(meta.entry_sizes[self._chunk_start :].sum()) if meta.entry_sizes is not None else 0
        if self._fill:
            ic = self._chunk_start // k
            data = inplace.read_chunk(ic) if inplace is not None else array.schunk.get_chunk(ic)
            if not chunk_crc_ok(data, self._crc[ic], meta.codec, meta.blocksize, k * meta.image_nbytes):
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
        groups: Sequence[Any] | np.ndarray | None = None,
    ) -> None:
        """Append images of shape (n, H, W, C) (or one (H, W, C) image) with optional labels and keys.

        ``columns``: name -> n rows; ``groups``: each item's group (recorded as text). A store
        with columns or groups needs the same on every append.
        """
        self._check_open()
        meta = self._meta
        dt = meta.np_dtype
        images = np.asarray(images)
        if meta.layout in ("NHWC", "encoded"):
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
        if meta.layout == "encoded":
            assert self._encoding is not None
            entries = [entry_for_pixels(img, self._encoding) for img in images]
            self.append_entries(entries, labels, keys, columns, groups)
            return
        n = len(images)
        self._record_items(n, labels, keys, columns, groups)
        k = meta.chunk_images
        pos = 0
        while pos < n:
            take = min(k - self._fill, n - pos)
            as_records(self._buf[self._fill : self._fill + take])[...] = as_records(images[pos : pos + take])
            self._fill += take
            pos += take
            if self._fill == k:
                self._flush_chunk()

    def extend_class_names(self, names: Sequence[str]) -> tuple[str, ...]:
        """Add new class names at the end; return the whole list (written at ``close()``)."""
        self._check_open()
        old = self._meta.class_names
        if old is None and self._items.has_labels and self.nimages:
            raise InvalidInputError(
                f"{self.path}: the store has labels without class names; name them first "
                "(update_metadata, CLI: carraystore meta --class-names) before adding classes"
            )
        if self._items.has_labels is False:
            raise InvalidInputError(f"{self.path}: the store has no labels, so there are no classes to name")
        current = list(old or ())
        for name in names:
            if not isinstance(name, str) or not name:
                raise InvalidInputError(f"{self.path}: class names must be non-empty strings, got {name!r}")
            if name not in current:
                current.append(name)
        self._meta = dataclasses.replace(self._meta, class_names=tuple(current))
        if self._items.has_labels is None:
            self._items.has_labels = True
        return tuple(current)

    @property
    def group_names(self) -> tuple[str, ...] | None:
        """The group names so far (None while the store has no groups)."""
        return tuple(self._items.group_names) if self._items.has_groups else None

    def append_encoded(
        self,
        files: Sequence[bytes],
        labels: Sequence[int] | np.ndarray | None = None,
        keys: Sequence[str] | None = None,
        columns: dict[str, np.ndarray] | None = None,
        groups: Sequence[Any] | np.ndarray | None = None,
    ) -> None:
        """Append images of a store of layout "encoded" as their JPEG, PNG or WebP files (FORMAT.md 10.1).

        A file shorter than the image's ``H*W*C`` pixel bytes is kept byte for byte (not decoded
        here; ``verify`` does). A file of that length or longer is decoded and kept as its raw
        pixels, since the format reads an entry of exactly ``H*W*C`` bytes as pixels. Pixels go
        in with :meth:`append`; entries copied from another store with :meth:`append_entries`.
        """
        self._check_open()
        meta = self._meta
        if meta.layout != "encoded":
            raise InvalidInputError(
                f"{self.path}: append_encoded() is for stores of layout 'encoded' (this one: {meta.layout})"
            )
        nb = meta.image_nbytes
        entries: list[bytes] = []
        for j, f in enumerate(files):
            data = bytes(f)
            fmt = file_format(data)
            if fmt == "unknown":
                raise InvalidInputError(
                    f"{self.path}: file {j} ({len(data)} bytes) is not a JPEG, PNG or WebP file; append pixels with "
                    "append(), a store's own entries with append_entries()"
                )
            if len(data) >= nb:  # not shorter than its pixels: kept as those (an entry of nb bytes is raw)
                out = np.empty(meta.image_shape, dtype=np.uint8)
                try:
                    decode_file(data, out, functools.partial(str, f"{self.path}: file {j}"))
                except EncodedImageError as exc:
                    raise InvalidInputError(
                        f"{self.path}: file {j} ({len(data)} bytes, {fmt.upper()}) does not decode to an image of "
                        f"the store's shape {meta.image_shape}: {exc}"
                    ) from exc
                data = out.tobytes()
            entries.append(data)
        self.append_entries(entries, labels, keys, columns, groups)

    def append_entries(
        self,
        entries: Sequence[bytes],
        labels: Sequence[int] | np.ndarray | None = None,
        keys: Sequence[str] | None = None,
        columns: dict[str, np.ndarray] | None = None,
        groups: Sequence[Any] | np.ndarray | None = None,
    ) -> None:
        """Append entries as FORMAT.md 10.1 defines them, kept byte for byte: exactly ``H*W*C`` bytes are
        raw pixels, anything else a JPEG, PNG or WebP file shorter than that (a store's own
        ``chunk_entries``). Image files as a user has them go in with :meth:`append_encoded`."""
        self._check_open()
        meta = self._meta
        if meta.layout != "encoded":
            raise InvalidInputError(
                f"{self.path}: append_entries() is for stores of layout 'encoded' (this one: {meta.layout})"
            )
        nb = meta.image_nbytes
        entries = [bytes(e) for e in entries]
        n = len(entries)
        formats = []
        for j, e in enumerate(entries):
            fmt = sniff(e, nb)
            if fmt == "unknown" or len(e) > nb or not e:
                raise InvalidInputError(
                    f"{self.path}: entry {j} ({len(e)} bytes) is neither a JPEG, PNG or WebP file shorter than the "
                    f"image's {nb} pixel bytes nor exactly those pixel bytes"
                )
            formats.append(fmt)
        self._record_items(n, labels, keys, columns, groups)
        assert self._encoding is not None
        self._encoding = self._encoding.with_formats(formats)
        self._sizes.append(np.array([len(e) for e in entries], dtype="<u4"))
        flat = self._buf.reshape(-1).view(np.uint8)
        k = meta.chunk_images
        for e in entries:
            if self._fill == 0:
                flat[...] = 0  # deterministic padding after the entries
                self._pos = 0
            flat[self._pos : self._pos + len(e)] = np.frombuffer(e, dtype=np.uint8)
            self._pos += len(e)
            self._fill += 1
            if self._fill == k:
                self._flush_chunk()

    def add_skipped(self, path: str, reason: str) -> None:
        """Record an input that was skipped (kept in the metadata; nothing is dropped silently)."""
        self._skipped.append({"path": path, "reason": reason})

    # -- chunks compressed elsewhere (the cluster ingest, from_dask) ----------------------------
    def append_compressed_chunk(
        self,
        data: bytes,
        nitems: int,
        crc: int,
        labels: Sequence[int] | np.ndarray | None = None,
        keys: Sequence[str] | None = None,
        columns: dict[str, np.ndarray] | None = None,
        groups: Sequence[Any] | np.ndarray | None = None,
    ) -> None:
        """Append one chunk compressed elsewhere by ``store.chunks.compress_chunk`` (``nitems`` items).

        The writer must stand at a chunk boundary; a short chunk stays pending, as after
        ``append``. ``crc`` and the chunk header are checked against ``data`` and the codec.
        """
        self._check_open()
        meta = self._meta
        k = meta.chunk_images
        where = f"{self.path}, chunk {self.nimages // k}"
        if meta.layout == "encoded":
            raise InvalidInputError(f"{where}: compressed chunks cannot be appended to a store of layout 'encoded'")
        if self._fill:
            raise InvalidInputError(
                f"{where}: {self._fill} items are pending; a compressed chunk must start at a chunk boundary"
            )
        if not 0 < int(nitems) <= k:
            raise InvalidInputError(f"{where}: a compressed chunk holds 1..{k} items, not {nitems}")
        data = bytes(data)
        if not chunk_crc_ok(data, int(crc), meta.codec, meta.blocksize, k * meta.image_nbytes):
            raise CorruptStoreError(
                f"{where}: the compressed chunk does not match its CRC32 {int(crc):08x}; it was damaged in transit"
            )
        header = parse_chunk_header(data)
        check_codec_against_header(meta.codec, meta.blocksize, header, where)
        if header.nbytes != k * meta.image_nbytes:
            raise InvalidInputError(
                f"{where}: the compressed chunk holds {header.nbytes} bytes, a chunk is {k * meta.image_nbytes}"
            )
        n = int(nitems)
        self._record_items(n, labels, keys, columns, groups)
        if n < k:  # the last chunk so far: kept pending, exactly like a short append
            blosc2.decompress2(data, dst=self._buf)
            self._buf[n:].view(np.uint8)[...] = 0
        if n < k:
            self._fill = n
            return
        ic = self._chunk_start // k
        with named_write_errors(self._written_file, f"chunk {ic}", len(data)):
            self._store_chunk(ic, data, self._chunk_start + k)
        self._crc.append(chunk_crc(data, meta.codec, meta.blocksize))
        self._chunk_start += k

    def close(self) -> None:
        """Finish: write the last chunk and the metadata, fsync, rename into place."""
        if self._closed:
            return
        try:
            if self._fill and self.nimages != self._stored:  # an append of nothing rewrites no chunk
                self._flush_chunk()
            meta = dataclasses.replace(
                self._meta,
                nimages=self.nimages,
                crc32=np.asarray(self._crc, dtype="<u4"),
                skipped=tuple(self._skipped),
                **self._items.finished(),
                encoding=self._encoding,
                entry_sizes=np.concatenate(self._sizes).astype("<u4") if self._sizes else self._meta.entry_sizes,
                writer_version=__version__,
                blosc2_version=blosc2.__version__,
            )
            meta.validate(str(self.path))
            with named_write_errors(self._written_file, "the metadata"):
                if self._inplace is not None:
                    self._inplace.commit(meta)
                    self._inplace = None
                else:
                    _write_meta(self._array, meta)
                    self._array = None
                    publish(self._tmp, self._dest)
            self._meta = meta
            self.file_size = self._dest.stat().st_size
            if self._target is not None:
                self._target.upload(self._dest)
                self._target.cleanup()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        self._release()

    def abort(self) -> None:
        """Throw away everything written; ``path`` is left as it was (nothing, once closed)."""
        if self._closed:  # closed or aborted already: an in-place writer's _tmp is the store itself
            return
        self._closed = True
        self._array = None
        try:
            if self._inplace is not None:
                inplace, self._inplace = self._inplace, None
                inplace.abort()
            else:
                with contextlib.suppress(FileNotFoundError):
                    self._tmp.unlink()
            if self._target is not None:
                self._target.cleanup()
        finally:
            self._release()

    @property
    def _written_file(self) -> Path:
        """The local file written: the temporary file, or the store itself in place (never a URL)."""
        return self._tmp if self._inplace is None else self._dest

    def _release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

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

    def _record_items(
        self,
        n: int,
        labels: Sequence[int] | np.ndarray | None,
        keys: Sequence[str] | None,
        columns: dict[str, np.ndarray] | None,
        groups: Sequence[Any] | np.ndarray | None,
    ) -> None:
        """Check the per-item values of an append of ``n`` items, then record them (all or none)."""
        self._items.record(self.check_items(n, labels, keys, columns, groups))

    def check_items(
        self,
        n: int,
        labels: Sequence[int] | np.ndarray | None = None,
        keys: Sequence[str] | None = None,
        columns: dict[str, np.ndarray] | None = None,
        groups: Sequence[Any] | np.ndarray | None = None,
    ) -> CheckedItems:
        """The per-item values of an append of ``n`` items, checked as ``append`` checks them; nothing is recorded."""
        return self._items.check(
            n, labels, keys, columns, groups, class_names=self._meta.class_names, nimages=self.nimages
        )

    def _flush_chunk(self) -> None:
        k = self._meta.chunk_images
        ic = self._chunk_start // k
        if self._fill < k and self._meta.layout != "encoded":  # (entries: zeroed when the chunk began)
            self._buf[self._fill :].view(np.uint8)[...] = 0  # deterministic padding
        data = blosc2.compress2(self._buf, **self._cparams)
        if self._round_trip is not None:
            try:
                check_round_trip(data, self._buf, self._round_trip, self._meta.codec, f"{self.path}: chunk {ic}")
            except CodecRoundTripError:
                self.abort()  # nothing of this write is published, even by a later close()
                raise
        with named_write_errors(self._written_file, f"chunk {ic}", len(data)):
            self._store_chunk(ic, data, self._chunk_start + self._fill)
        c = chunk_crc(data, self._meta.codec, self._meta.blocksize)
        if ic < len(self._crc):
            self._crc[ic] = c
        else:
            self._crc.append(c)
        if self._fill == k:
            self._chunk_start += k
            self._fill = 0

    def _store_chunk(self, ic: int, data: bytes, total: int) -> None:
        """Put compressed chunk ``ic`` into the file (the only place that does); ``total``: items after."""
        if self._inplace is not None:
            self._inplace.put_chunk(ic, data)
            self._stored = total
        else:
            if self._stored == 0:
                # blosc2 < 4.1 cannot grow an array from length 0: re-create it at length total
                self._array = None
                self._array = new_array(self._tmp, self._meta, total)
                self._stored = total
            elif total != self._stored:
                self._array.resize((total, *self._meta.image_shape))
                self._stored = total
            self._array.schunk.update_chunk(ic, data)


def create(
    path: str | os.PathLike[str],
    image_shape: Sequence[int] | None = None,
    dtype: str | np.dtype | None = "uint8",
    *,
    mode: str = "w",
    provenance: dict[str, Any] | None = None,
    nthreads: int | None = None,
    layout: str | None = None,
    encoding: Encoding | None = None,
    options: WriteOptions | None = None,
    **write: Unpack[WriteKwargs],
) -> StoreWriter:
    """Start writing a store at ``path``; returns a StoreWriter (a context manager).

    ``mode="w"``: a new store (``overwrite=True`` replaces one at close); ``mode="a"``: append,
    keeping the pinned codec. ``image_shape``: (H, W, C) for images (C = 1, 3 or 4; (H, W)
    gets C = 1), or any shape with ``layout="array"``. ``layout=None``: "NHWC" (also
    called ``"pixels"``) for pixel data, else "array"; ``"encoded"``: uint8 images as encoded files (FORMAT.md 10), pixels encoded
    with ``encoding`` (default PNG). Write options: keywords or ``options``
    (:class:`~carraystore.store.options.WriteOptions`). A URL is staged under ``tmp_dir`` and
    appears only when complete; appending to one downloads, appends and uploads again.
    """
    opts = WriteOptions.merged(options, str(path), **write)
    if is_url(path):
        return _create_remote(
            str(path),
            opts,
            mode=mode,
            image_shape=image_shape,
            dtype=dtype,
            provenance=provenance,
            nthreads=nthreads,
            layout=layout,
            encoding=encoding,
        )
    if opts.storage_options:
        raise InvalidInputError(f"{path}: storage_options apply to URLs only, not to local paths")
    if isinstance(path, str) and path.startswith("file://"):
        path = path[len("file://") :]
    p = Path(path)
    if p.suffix != ".b2nd":
        raise InvalidInputError(f"{p}: a store's file name must end in .b2nd")
    if nthreads is None:
        nthreads = max(1, min(8, os.cpu_count() or 1))
    if mode not in ("w", "a"):
        raise InvalidInputError(f"mode must be 'w' or 'a', got {mode!r}")
    if not p.parent.is_dir():
        raise InvalidInputError(f"{p}: folder {p.parent} does not exist")
    # One writer at a time; lock and journal sit beside the real file (links share them).
    real = Path(os.path.realpath(p))
    lock = WriterLock(real, purpose="append" if mode == "a" else "create", timeout=opts.lock_timeout)
    lock.acquire()
    try:
        rollback(real)  # an append that died half-way is undone first (nothing happens without a journal)
        remove_stale_temps(p)  # dead: we hold the lock every writer of p holds
        if mode == "a":
            return _open_for_append(real, image_shape, dtype, nthreads, opts.codec, lock)
        return _create_new(p, image_shape, dtype, opts, provenance, nthreads, layout, lock, encoding)
    except BaseException:
        lock.release()
        raise


def _create_new(
    p: Path,
    image_shape: Sequence[int] | None,
    dtype: Any,
    opts: WriteOptions,
    provenance: dict[str, Any] | None,
    nthreads: int,
    layout: str | None,
    lock: WriterLock,
    encoding: Encoding | None,
) -> StoreWriter:
    refuse_folder_target(p)
    codec, chunk_images = opts.codec, opts.chunk_images
    if p.exists() and not opts.overwrite:
        raise StoreExistsError(
            f"{p} already exists; pass overwrite=True (CLI: --overwrite) to replace it, or mode='a' to append"
        )
    if image_shape is None:
        raise InvalidInputError("create(): image_shape (H, W, C) is required for a new store")
    class_names = check_class_names(opts.class_names, str(p))
    shape = tuple(int(x) for x in image_shape)
    dt = np.dtype(dtype)
    dtype_to_record(dt)  # refuses object dtypes with a clear message
    is_pixels = dt.name in DTYPES and dt.isnative
    if layout == "pixels":  # the CLI's name for it (--layout pixels)
        layout = "NHWC"
    if layout is None:
        layout = "NHWC" if is_pixels and (len(shape) == 2 or (len(shape) == 3 and shape[2] in COLOR_MODES)) else "array"
    if layout not in LAYOUTS:
        raise InvalidInputError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if encoding is not None and layout != "encoded":
        raise InvalidInputError(f"encoding= applies to layout='encoded' only, not {layout!r}")
    if layout == "encoded":
        if dt != np.uint8:
            raise InvalidInputError(f"a store of layout 'encoded' holds uint8 images, not {dt}")
        encoding = encoding or Encoding()
        if codec is None:
            codec = default_codec()
    if layout in ("NHWC", "encoded"):
        if len(shape) == 2:
            shape = (*shape, 1)
        if len(shape) != 3 or shape[2] not in COLOR_MODES or min(shape) < 1:
            raise InvalidInputError(f"image_shape {tuple(image_shape)} must be (H, W, C) with C = 1, 3 or 4")
        if not is_pixels:
            raise InvalidInputError(f"dtype {dt} is not an image dtype; use one of {DTYPES} or layout='array'")
    elif shape and min(shape) < 1:
        raise InvalidInputError(f"item shape {shape} has an empty dimension")
    codec = Codec.preset(codec if isinstance(codec, str) else "balanced") if not isinstance(codec, Codec) else codec
    auto_block = codec.block_images is None
    codec = codec.resolve(dt, shape, layout)
    block_images, typesize = codec.block_images, codec.typesize
    assert block_images is not None and typesize is not None  # resolve() pins both
    image_nbytes = max(1, math.prod(shape)) * dt.itemsize
    if auto_block and chunk_images is not None:
        # the largest divisor of chunk_images not above the automatic block size
        want = min(int(chunk_images), block_images)
        block_images = max(d for d in range(1, want + 1) if chunk_images % d == 0)
        codec = dataclasses.replace(codec, block_images=block_images)
    if (image_nbytes * block_images) % typesize:
        raise InvalidInputError(
            f"codec typesize {typesize} does not divide a block of {block_images} image(s) "
            f"({image_nbytes * block_images} bytes)"
        )
    if chunk_images is None:
        chunk_images = default_chunk_images(image_nbytes, block_images, layout)
    chunk_images = int(chunk_images)
    if block_images > chunk_images:
        block_images = chunk_images
        codec = dataclasses.replace(codec, block_images=block_images)
    if chunk_images < 1 or chunk_images % block_images:
        raise InvalidInputError(
            f"chunk_images {chunk_images} must be a positive multiple of the codec's block_images {block_images}"
        )
    if image_nbytes * block_images >= 2**31 or image_nbytes * chunk_images >= 2**31:
        raise InvalidInputError(f"chunks of {chunk_images} images of {image_nbytes} bytes exceed blosc2's 2 GiB limit")
    meta = StoreMeta(
        image_shape=shape,
        dtype=dtype_to_record(dt),
        codec=codec,
        chunk_images=chunk_images,
        layout=layout,
        color_mode=COLOR_MODES[shape[2]] if layout in ("NHWC", "encoded") else "",
        format_version=FORMAT_VERSION_ENCODED if layout == "encoded" else FORMAT_VERSION,
        encoding=encoding if layout == "encoded" else None,
        entry_sizes=np.zeros(0, dtype="<u4") if layout == "encoded" else None,
        class_names=class_names,
        provenance=dict(provenance or {}),
        attrs=json_attrs(opts.attrs, str(p)),
        writer_version=__version__,
        blosc2_version=blosc2.__version__,
    )
    meta.validate(str(p))
    tmp = temp_path(p)
    try:
        with named_write_errors(tmp, "a new store"):
            array = new_array(tmp, meta, 0)
    except Exception:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return StoreWriter(p, tmp, array, meta, nthreads, lock=lock)


def _create_remote(url: str, opts: WriteOptions, *, mode: str, **kwargs: Any) -> StoreWriter:
    """``create`` for a URL: the local writer on a staging file, uploaded at close."""
    if mode not in ("w", "a"):
        raise InvalidInputError(f"mode must be 'w' or 'a', got {mode!r}")
    target = RemoteTarget(
        url, opts.storage_options, overwrite=opts.overwrite, tmp_dir=opts.tmp_dir, must_exist=mode == "a"
    )
    try:
        if mode == "a":
            target.download()
        staged = opts.replace(overwrite=True, lock_timeout=0.0, storage_options=None, tmp_dir=None)
        writer = create(target.local_path, mode=mode, options=staged, **kwargs)
    except BaseException:
        target.cleanup()
        raise
    writer.path, writer._target = url, target  # close() uploads; error messages name the URL
    writer._items.where = url
    return writer


def _open_for_append(
    p: Path, image_shape: Sequence[int] | None, dtype: Any, nthreads: int, codec: Codec | str | None, lock: WriterLock
) -> StoreWriter:
    refuse_hard_links(p)  # before reading: through another name, an unfinished write's journal is not seen
    existing = open_store(p)  # validates format, codec and header
    meta = existing.meta
    frame = existing._frame
    existing.close()
    check_header_for_write(frame, meta, p)  # every header field: blosc2 and the in-place write rely on them
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
        if len(shape) == 2 and meta.layout in ("NHWC", "encoded"):
            shape = (*shape, 1)
        if shape != meta.image_shape:
            raise InvalidInputError(
                f"{p}: appending images of shape {shape} to a store of image_shape {meta.image_shape}"
            )
        if dtype is not None and np.dtype(dtype) != meta.np_dtype:
            raise InvalidInputError(f"{p}: appending {np.dtype(dtype)} images to a store of {meta.dtype}")
    if meta.nimages:
        # In place: new chunks after the old ones, guarded by the rollback journal.
        inplace = _InPlaceWrite(p, frame, meta.nimages)
        try:
            return StoreWriter(p, p, None, meta, nthreads, lock=lock, inplace=inplace)
        except BaseException:
            inplace.close()
            raise
    # An empty store (a header and metadata, no chunk) is rewritten whole: work on a copy.
    tmp = temp_path(p)
    try:
        with named_write_errors(p, "a copy of the empty store", p.stat().st_size):
            shutil.copyfile(p, tmp)
        array = blosc2.open(str(tmp), mode="a")  # never pass cparams here
        return StoreWriter(p, tmp, array, meta, nthreads, lock=lock)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def append(
    path: str | os.PathLike[str],
    nthreads: int | None = None,
    *,
    options: WriteOptions | None = None,
    **write: Unpack[WriteKwargs],
) -> StoreWriter:
    """Open an existing store (a path or URL) to append images; same as ``create(path, mode="a")``.

    Extends in place, costing what it adds (docs/appends.md). ``lock_timeout``: seconds to
    wait for another writer (None: for ever), then
    :class:`~carraystore.base.errors.StoreLockedError` names the holder. ``codec`` must match
    the pinned one; ``chunk_images``, ``class_names`` and ``attrs`` are refused.
    """
    where = str(path)
    opts = WriteOptions.merged(options, where, **write)
    opts.refuse(
        ("chunk_images", "class_names", "attrs"),
        where,
        "an append keeps the store's chunk size, class names and attrs; leave them out of the options "
        "(class names and attrs change with update_metadata, CLI: carraystore meta)",
    )
    return create(path, mode="a", dtype=None, nthreads=nthreads, options=opts.replace(overwrite=False))
