"""Copying a store between two locations: local paths, object storage, HTTP (read-only source).

The file is streamed byte for byte in bounded memory, every chunk's CRC32 checked as it
passes, so a damaged chunk stops the copy before anything is published. The destination
appears only when complete (a renamed temporary file, or one multipart upload).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from carraystore.base.atomic import named_write_errors, publish, refuse_folder_target, remove_stale_temps, temp_path
from carraystore.base.errors import ChecksumError, CorruptStoreError, InvalidInputError, StoreExistsError
from carraystore.base.lock import WriterLock
from carraystore.format.codec import chunk_crc_ok, crc32
from carraystore.sources.journal import rollback
from carraystore.sources.upload import check_writable, delete_remote, put_stream, remote_exists
from carraystore.store.options import WriteOptions
from carraystore.store.reader import StoreReader, is_url, open_store

__all__ = ["copy_store", "stream_verified", "CopyResult", "COPY_READ_BYTES", "COPY_READS_IN_FLIGHT"]

#: Bytes per ranged read while copying (whole chunks; a larger chunk is read alone).
COPY_READ_BYTES = 16 * 1024 * 1024
#: Reads in flight at once: the memory a copy holds is about this times COPY_READ_BYTES.
COPY_READS_IN_FLIGHT = 4


@dataclass(frozen=True)
class CopyResult:
    """What a copy did."""

    src: str
    dst: str
    nbytes: int
    nchunks: int
    nimages: int
    seconds: float
    verified: bool

    def summary(self) -> str:
        rate = self.nbytes / self.seconds / 1e6 if self.seconds > 0 else float("nan")
        check = "; every chunk's CRC32 and the metadata verified at the destination" if self.verified else ""
        return (
            f"copied {self.src} -> {self.dst}: {self.nimages} items, {self.nchunks} chunks, "
            f"{self.nbytes / 1e6:.1f} MB in {self.seconds:.1f} s ({rate:.0f} MB/s){check}"
        )


def _pieces(store: StoreReader) -> list[tuple[int, int, int | None]]:
    """The file cut into (offset, length, chunk index or None) pieces, in file order."""
    size = store.source.size()
    chunks = sorted(
        (off, length, i)
        for i in range(store.nchunks)
        for off, length in [store.chunk_byte_range(i)]
        if off >= 0 and length > 0
    )
    out: list[tuple[int, int, int | None]] = []
    pos = 0
    for off, length, i in chunks:
        if off < pos:
            raise CorruptStoreError(
                f"{store.location}: chunk {i} overlaps the bytes before it; run `carraystore verify` on it"
            )
        if off > pos:
            out.append((pos, off - pos, None))
        out.append((off, length, i))
        pos = off + length
    if pos < size:
        out.append((pos, size - pos, None))
    return out


def _requests(pieces: list[tuple[int, int, int | None]]) -> list[list[tuple[int, int, int | None]]]:
    """Group consecutive pieces into reads of about COPY_READ_BYTES."""
    groups: list[list[tuple[int, int, int | None]]] = []
    cur: list[tuple[int, int, int | None]] = []
    nbytes = 0
    for p in pieces:
        if cur and nbytes + p[1] > COPY_READ_BYTES:
            groups.append(cur)
            cur, nbytes = [], 0
        cur.append(p)
        nbytes += p[1]
    if cur:
        groups.append(cur)
    return groups


def _check_piece(store: StoreReader, i: int, data: memoryview, offset: int) -> None:
    cbytes = int.from_bytes(bytes(data[12:16]), "little") if len(data) >= 16 else -1
    if not 0 < cbytes <= len(data):
        raise ChecksumError(
            f"{store.location}: chunk {i} (bytes {offset}-{offset + len(data)}) has a damaged header; "
            f"run `carraystore verify {store.location}`"
        )
    want = int(store.meta.crc32[i])
    if not chunk_crc_ok(data[:cbytes], want, store.codec, store.meta.blocksize, store.chunk_nbytes):
        raise ChecksumError(
            f"{store.location}: chunk {i} (bytes {offset}-{offset + cbytes}) fails its CRC32 check (recorded {want:08x}, "
            f"read {crc32(bytes(data[:cbytes])):08x}); nothing was copied. Run `carraystore verify {store.location}`"
        )


def stream_verified(store: StoreReader, progress: Any = None) -> Iterator[memoryview]:
    """The store's file as consecutive blocks, every chunk's CRC32 checked on the way."""
    groups = _requests(_pieces(store))
    for w in range(0, len(groups), COPY_READS_IN_FLIGHT):
        window = groups[w : w + COPY_READS_IN_FLIGHT]
        ranges = [(g[0][0], sum(p[1] for p in g)) for g in window]
        blocks = store.source.read_many(ranges)
        for g, (start, length), block in zip(window, ranges, blocks, strict=True):
            if len(block) != length:
                raise CorruptStoreError(f"{store.location}: {len(block)} of {length} bytes readable at offset {start}")
            view = memoryview(block)
            for off, n, i in g:
                if i is not None:
                    _check_piece(store, i, view[off - start : off - start + n], off)
            if progress is not None:
                progress.update(length)
            yield view


def _compare(src: StoreReader, dst: StoreReader, dst_name: str) -> None:
    """The copy's metadata and geometry must equal the source's (chunk CRCs are checked by streaming it)."""
    problems = []
    if dst.source.size() != src.source.size():
        problems.append(f"{dst.source.size()} bytes, the source has {src.source.size()}")
    if dst.meta.to_record() != src.meta.to_record():
        problems.append("its metadata differs from the source's")
    if [dst.chunk_byte_range(i) for i in range(dst.nchunks)] != [src.chunk_byte_range(i) for i in range(src.nchunks)]:
        problems.append("its chunk index differs from the source's")
    if problems:
        raise CorruptStoreError(f"{dst_name}: the copy of {src.location} is not identical: " + "; ".join(problems))
    for _ in stream_verified(dst):
        pass


def copy_store(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
    dst_storage_options: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    verify: bool = True,
    progress: bool = False,
    lock_timeout: float | None = 0.0,
    options: WriteOptions | None = None,
) -> CopyResult:
    """Copy the store at ``src`` to ``dst`` (each a path or URL), streamed and verified.

    ``dst_storage_options`` default to ``storage_options``. A damaged chunk raises
    ChecksumError naming it; nothing appears at ``dst``. ``verify`` compares the published
    copy with the source. ``options``' ``storage_options`` are the destination's; codec,
    chunk size, class names and attrs are refused (a copy is byte for byte). A local ``dst``
    is written under its writer lock (``lock_timeout``; then :class:`~carraystore.base.errors.StoreLockedError`).
    """
    t0 = time.perf_counter()
    src_s, dst_s = str(src), str(dst)
    opts = WriteOptions.merged(
        options,
        dst_s,
        overwrite=overwrite,
        progress=progress,
        storage_options=dst_storage_options,
        lock_timeout=lock_timeout,
    )
    opts.refuse(
        ("codec", "chunk_images", "class_names", "attrs"),
        dst_s,
        "a copy is the source byte for byte; to change the codec or chunk size use migrate or create, "
        "to change class names or attrs use update_metadata (CLI: carraystore meta) on the copy",
    )
    overwrite, progress, dst_storage_options = opts.overwrite, opts.progress, opts.storage_options
    lock_timeout = opts.lock_timeout
    if dst_storage_options is None and is_url(src_s) and is_url(dst_s):
        dst_storage_options = storage_options
    dst_remote = is_url(dst_s)
    if dst_remote:
        check_writable(dst_s)
    elif dst_storage_options:
        raise InvalidInputError(f"{dst_s}: dst_storage_options apply to URLs only, not to local paths")
    if not dst_s.rstrip("/").endswith(".b2nd"):
        raise InvalidInputError(f"{dst_s}: a store's name must end in .b2nd")
    store = open_store(src_s, storage_options)
    bar = None
    try:
        if progress:
            from tqdm import tqdm

            bar = tqdm(
                total=store.source.size(),
                desc=f"copy {dst_s.rsplit('/', 1)[-1]}",
                unit="B",
                unit_scale=True,
                file=sys.stderr,
            )
        if dst_remote:
            if src_s == dst_s:
                raise InvalidInputError(f"{dst_s}: the copy would replace its source")
            if not overwrite and remote_exists(dst_s, dst_storage_options):
                raise StoreExistsError(f"{dst_s} already exists; pass overwrite=True (CLI: --overwrite) to replace it")
            put_stream(dst_s, stream_verified(store, bar), dst_storage_options, size_hint=store.source.size())
            if verify:
                try:
                    with open_store(dst_s, dst_storage_options) as copy:
                        _compare(store, copy, dst_s)
                except BaseException:
                    with contextlib.suppress(Exception):
                        delete_remote(dst_s, dst_storage_options)
                    raise
        else:
            _copy_to_local(store, Path(dst_s.removeprefix("file://")), overwrite, verify, bar, lock_timeout)
        return CopyResult(
            src_s, dst_s, store.source.size(), store.nchunks, len(store), time.perf_counter() - t0, verify
        )
    finally:
        if bar is not None:
            bar.close()
        store.close()


def _copy_to_local(
    store: StoreReader, out: Path, overwrite: bool, verify: bool, bar: Any, lock_timeout: float | None = 0.0
) -> None:
    if not out.parent.is_dir():
        raise InvalidInputError(f"{out}: folder {out.parent} does not exist")
    refuse_folder_target(out)
    # one writer at a time: a write to ``out`` in progress is waited for, never broken
    real = Path(os.path.realpath(out))
    with WriterLock(real, purpose="copy", timeout=lock_timeout):
        rollback(real)  # a write to out that died half-way is undone first, as every writer does
        _copy_locked(store, out, overwrite, verify, bar)


def _copy_locked(store: StoreReader, out: Path, overwrite: bool, verify: bool, bar: Any) -> None:
    if out.exists() and not overwrite:
        raise StoreExistsError(f"{out} already exists; pass overwrite=True (CLI: --overwrite) to replace it")
    if not is_url(store.location) and out.exists() and out.resolve() == Path(store.location).resolve():
        raise InvalidInputError(f"{out}: the copy would replace its source")
    remove_stale_temps(out)
    tmp = temp_path(out)
    try:
        with named_write_errors(out, f"the copy of {store.location}", store.source.size()), open(tmp, "wb") as f:
            for block in stream_verified(store, bar):
                f.write(block)
        if verify:
            with open_store(tmp) as copy:
                _compare(store, copy, str(out))
        with named_write_errors(out, f"the copy of {store.location}"):
            publish(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
