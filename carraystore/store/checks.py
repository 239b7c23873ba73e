"""A store file checked against its record (layer 3): frame vs metadata, header field by field, plain blosc2."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import blosc2
import msgpack
import numpy as np

from carraystore.base.errors import (
    CarrayStoreError,
    CodecMismatchError,
    CorruptStoreError,
    FormatError,
    FormatVersionError,
    NotAStoreError,
)
from carraystore.format.codec import CODECS, FILTERS, SPLITMODES
from carraystore.format.frame import PIPELINE_AT, Frame
from carraystore.format.frame import header_problems as frame_header_problems
from carraystore.format.record import FORMAT_NAME, MAX_FORMAT_VERSION, META_CRC_KEY, META_KEY, StoreMeta, metadata_limit
from carraystore.sources.journal import journal_path

__all__ = [
    "check_frame_against_meta",
    "header_problems",
    "plain_blosc2_problem",
    "check_header_for_write",
    "read_meta",
    "file_state",
]


def check_frame_against_meta(frame: Frame, meta: StoreMeta, location: str) -> None:
    """Compare the file's real parameters with the record; raise CodecMismatchError naming both."""
    shape, chunks, blocks = frame.b2nd()
    want_chunks = (meta.chunk_images, *meta.image_shape)
    want_blocks = (meta.codec.block_images, *meta.image_shape)
    if shape != (meta.nimages, *meta.image_shape):
        raise CorruptStoreError(
            f"{location}: array shape {shape} does not match the metadata ({meta.nimages}, "
            f"{', '.join(map(str, meta.image_shape))}); the file was damaged or written by another tool"
        )
    problems = []
    try:
        dt_text = msgpack.unpackb(frame.metalayers["b2nd"], raw=False, strict_map_key=False)[6]
    except Exception as exc:
        raise CorruptStoreError(
            f"{location}: the b2nd metalayer's dtype cannot be read ({exc}); the file is damaged"
        ) from exc
    try:
        file_dtype = np.dtype(ast.literal_eval(dt_text)) if str(dt_text)[:1] in "{[" else np.dtype(dt_text)
    except Exception:
        file_dtype = None
    if file_dtype != meta.np_dtype:
        problems.append(f"dtype {dt_text} in the file, {meta.dtype} recorded")
    # blosc2 < 4.1 does not keep an empty array's chunk and block shapes reliably
    if meta.nimages and chunks != want_chunks:
        problems.append(f"chunks {chunks} in the file, {want_chunks} recorded")
    if meta.nimages and blocks != want_blocks:
        problems.append(f"blocks {blocks} in the file, {want_blocks} recorded")
    if frame.codec_id >= 0 and frame.codec_id != blosc2.Codec[meta.codec.codec.upper()].value:
        try:
            name = blosc2.Codec(frame.codec_id).name
        except ValueError:
            name = f"id {frame.codec_id}"
        problems.append(f"codec {name} in the file header, {meta.codec.codec!r} recorded")
    if frame.clevel >= 0 and frame.clevel != meta.codec.clevel:
        problems.append(f"clevel {frame.clevel} in the file header, {meta.codec.clevel} recorded")
    if frame.nchunks != meta.nchunks:
        raise CorruptStoreError(
            f"{location}: file holds {frame.nchunks} chunks, metadata says {meta.nchunks}; the file is damaged"
        )
    odd = np.flatnonzero((frame.chunk_special != 0) & (frame.chunk_special != 1))
    if odd.size:  # only all-zero chunks are ever special in a complete store (FORMAT.md 5.2)
        i = int(odd[0])
        raise CorruptStoreError(
            f"{location}: the offsets index marks chunk {i} as special value {int(frame.chunk_special[i])} "
            "(NaNs, a repeated value or uninitialised), which a complete store never holds; the file is damaged"
        )
    if problems:
        raise CodecMismatchError(f"{location}: " + "; ".join(problems))


def _fixed_metalayers(version: int) -> tuple[bytes, ...]:
    """The fixed ``carraystore`` metalayers for ``version`` (FORMAT.md 3), checksum flag on and off."""
    return tuple(
        msgpack.packb({"format": FORMAT_NAME, "format_version": version, **extra})
        for extra in ({META_CRC_KEY: True}, {})
    )


def header_problems(frame: Frame, meta: StoreMeta) -> list[str]:
    """Every field of the frame header against ``meta`` (FORMAT.md A.1, A.2, 3, 6), also those open
    skips but blosc2 and in-place writers need: problems prefixed "frame header: ", or []."""
    out = frame_header_problems(frame)
    dt = meta.np_dtype
    chunk_nbytes = meta.chunk_images * meta.image_nbytes
    want = [("typesize", frame.typesize, dt.itemsize), ("nbytes", frame.nbytes, meta.nchunks * chunk_nbytes)]
    if meta.nimages:  # an empty array's are not kept by blosc2 < 4.1 (as its chunk and block shapes)
        want += [("blocksize", frame.blocksize, meta.blocksize), ("chunksize", frame.chunksize, chunk_nbytes)]
    out += [f"{name} is {got}, the metadata makes it {expected}" for name, got, expected in want if got != expected]
    h = frame.header
    codec = meta.codec
    if len(h) > PIPELINE_AT + 16:
        if h[28] != SPLITMODES[codec.splitmode] - 1:
            out.append(
                f"the split mode flags are {h[28]}, splitmode {codec.splitmode!r} makes them {SPLITMODES[codec.splitmode] - 1}"
            )
        pipe = bytearray(16)  # the codec's filters where its typesize is the itemsize, else none (FORMAT.md 6)
        if codec.typesize == dt.itemsize:
            for slot, (f, m) in enumerate(zip(codec.filters, codec.filters_meta, strict=True)):
                pipe[slot], pipe[8 + slot] = FILTERS[f], m
        pipe[6] = CODECS[codec.codec]
        got = h[PIPELINE_AT : PIPELINE_AT + 16]
        if got != pipe:
            out.append(f"the filter pipeline is {got.hex()}, the codec makes it {pipe.hex()}")
    if frame.metalayers.get(META_KEY) not in _fixed_metalayers(meta.format_version):
        out.append(f"the fixed {META_KEY!r} metalayer is not the one a store holds (FORMAT.md 3)")
    if isinstance(meta.dtype, str):
        try:
            text = msgpack.unpackb(frame.metalayers["b2nd"], raw=False)[6]
        except Exception:
            text = None
        if text != meta.dtype:
            out.append(f"the b2nd dtype is {text!r}, the record's {meta.dtype!r}")
    return [f"frame header: {p}" for p in out]


def plain_blosc2_problem(
    path: str | os.PathLike[str], frame: Frame, meta: StoreMeta, quiet_if_changed: bool = False
) -> str | None:
    """Open the local store with plain ``blosc2.open`` and read its first item; why that fails, or None.

    Call only once :func:`header_problems` found nothing. ``quiet_if_changed``: None for a
    file being written or changed since ``frame`` was read."""
    real = Path(os.path.realpath(path))
    before = file_state(real)
    if quiet_if_changed and (before[0] is None or before[1] is not None or before[0][1] != frame.frame_len):
        return None
    try:
        array = blosc2.open(str(path), mode="r")
        if meta.nimages:
            array[:1]
        del array
    except Exception as exc:
        if quiet_if_changed and file_state(real) != before:
            return None
        return f"frame header: plain blosc2 cannot read the file ({type(exc).__name__}: {exc})"
    return None


def check_header_for_write(frame: Frame, meta: StoreMeta, path: str | os.PathLike[str]) -> None:
    """Raise CorruptStoreError when the frame header is damaged: a writer must not write into it."""
    problems = header_problems(frame, meta)
    if not problems:
        bad = plain_blosc2_problem(path, frame, meta)
        problems = [bad] if bad is not None else []
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CorruptStoreError(
            f"{path}: the store's frame header is damaged ({problems[0]}{more}); nothing was written. "
            f"Run `carraystore verify {path}` and restore the store from a copy"
        )


def read_meta(frame: Frame, location: str) -> StoreMeta:
    fixed = frame.metalayers.get(META_KEY)
    if fixed is None:
        raise NotAStoreError(
            f"{location}: a blosc2 file, but not a carraystore store (no {META_KEY!r} meta layer); "
            "create stores with carraystore.create() or `carraystore ingest`"
        )
    try:
        fixed_rec = StoreMeta.unpack_record(fixed, location)
        fixed_version = fixed_rec.get("format_version") if isinstance(fixed_rec, dict) else None
        fixed_name = fixed_rec.get("format") if isinstance(fixed_rec, dict) else None
    except CarrayStoreError:
        raise
    except Exception as exc:
        raise CorruptStoreError(f"{location}: the {META_KEY!r} meta layer cannot be read ({exc})") from exc
    if fixed_name != FORMAT_NAME or not isinstance(fixed_version, int) or isinstance(fixed_version, bool):
        raise FormatError(f"{location}: the {META_KEY!r} meta layer is not a carraystore header ({fixed_rec!r})")
    if fixed_version > MAX_FORMAT_VERSION:
        raise FormatVersionError(
            f"{location}: format version {fixed_version} is newer than this carraystore reads ({MAX_FORMAT_VERSION}); "
            "upgrade carraystore (pip install -U carraystore)"
        )
    shape, chunks, _ = frame.b2nd()
    n = shape[0] if shape else 0
    # bound N by the frame's chunks first: a damaged first dimension must not raise the record cap
    rows = chunks[0] if chunks else 0
    if n < 0 or (n > frame.nchunks * max(rows, 0)):
        raise CorruptStoreError(
            f"{location}: the array's first dimension {n} does not fit its {frame.nchunks} chunks of {rows} items; "
            "the file is damaged"
        )
    raw = frame.vlmeta(META_KEY, metadata_limit(n))
    if raw is None:
        raise FormatError(f"{location}: the {META_KEY!r} variable-length metadata is missing")
    rec = StoreMeta.unpack_record(raw, location, require_crc=fixed_rec.get(META_CRC_KEY) is True)
    del raw  # the packed bytes go before the record is checked: lower peak memory on open
    meta = StoreMeta.from_record(rec, location)
    if meta.format_version != fixed_version:
        raise FormatError(
            f"{location}: the fixed meta layer says format version {fixed_version}, the metadata says "
            f"{meta.format_version}; the file is damaged or was written by another tool"
        )
    return meta


def file_state(real: Path) -> tuple[Any, ...]:
    """What changes when a writer touches a store: the file's and its journal's identity, size, time."""
    out: list[Any] = []
    for p in (real, journal_path(real)):
        try:
            st = os.stat(p)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append(None)
    return tuple(out)
