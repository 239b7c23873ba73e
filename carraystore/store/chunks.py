"""Store chunks: compressed with the pinned codec in any process, round-trip checked; the array they go into."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import blosc2
import numpy as np

from carraystore.base.errors import CodecRoundTripError, InvalidInputError
from carraystore.format.codec import Codec, chunk_crc, is_preset
from carraystore.format.record import FORMAT_NAME, META_CRC_KEY, META_KEY, StoreMeta, as_records
from carraystore.store.inplace import _write_meta

__all__ = ["compress_chunk", "check_round_trip", "new_array"]


def compress_chunk(meta: StoreMeta, items: np.ndarray) -> tuple[bytes, int]:
    """Compress up to ``meta.chunk_images`` items as one store chunk: (bytes, its recorded CRC-32),
    exactly as :class:`StoreWriter` would; for :meth:`StoreWriter.append_compressed_chunk`."""
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
    if not is_preset(meta.codec, meta.np_dtype, meta.image_shape, meta.layout):  # see StoreWriter._round_trip
        check_round_trip(data, buf, np.empty_like(buf), meta.codec, "compress_chunk", nthreads=1)
    return data, chunk_crc(data, meta.codec, meta.blocksize)


def check_round_trip(
    data: bytes, items: np.ndarray, scratch: np.ndarray, codec: Codec, where: str, nthreads: int | None = None
) -> None:
    """Raise CodecRoundTripError unless ``data`` decompresses (into ``scratch``) to exactly ``items``
    (blosc2 4.x mis-decodes some custom filter chains, unseen by the CRC and ``verify``)."""
    try:
        if nthreads is None:
            blosc2.decompress2(data, dst=scratch)
        else:
            blosc2.decompress2(data, dst=scratch, nthreads=nthreads)
        same = np.array_equal(scratch.reshape(-1).view(np.uint8), items.reshape(-1).view(np.uint8))
    except Exception as exc:  # blosc2 refusing its own chunk is the same defect
        raise _round_trip_error(codec, where, f"it does not decompress ({exc})") from exc
    if not same:
        raise _round_trip_error(codec, where, "it decompresses to other bytes than were compressed")


def _round_trip_error(codec: Codec, where: str, what: str) -> CodecRoundTripError:
    return CodecRoundTripError(
        f"{where}: codec {codec.codec!r} clevel {codec.clevel} with filter chain {list(codec.filters)} "
        f"(meta {list(codec.filters_meta)}) made a chunk that blosc2 {blosc2.__version__} cannot restore: {what}. "
        "Nothing was written; choose another filter chain (or a preset: 'fast', 'balanced', 'small')"
    )


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


def new_array(tmp: Path, meta: StoreMeta, nimages: int) -> Any:
    """A fresh store file at ``tmp`` holding ``nimages`` unwritten items and ``meta``."""
    shape = meta.image_shape
    array = blosc2.empty(
        (nimages, *shape),
        dtype=meta.np_dtype,
        chunks=(meta.chunk_images, *shape),
        blocks=(meta.codec.block_images, *shape),
        urlpath=str(tmp),
        mode="w",
        meta={META_KEY: {"format": FORMAT_NAME, "format_version": meta.format_version, META_CRC_KEY: True}},
        cparams=_frame_cparams(meta.codec, meta.np_dtype),
    )
    _write_meta(array, meta)
    return array
