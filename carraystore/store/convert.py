"""``carraystore convert``: a store rewritten in the other pixel layout (or another codec), streamed and verified.

Pixels -> encoded encodes as PNG (JPEG with ``quality``); encoded -> pixels decodes;
encoded -> encoded keeps entries byte for byte. Written under a temporary name beside ``dst``,
compared with the source chunk by chunk, then renamed into place.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.base.atomic import publish, temp_path
from carraystore.base.errors import CorruptStoreError, InvalidInputError, StoreExistsError
from carraystore.base.lock import WriterLock
from carraystore.format.codec import Codec
from carraystore.format.encoded import Encoding
from carraystore.sources.journal import rollback
from carraystore.store.reader import open_store
from carraystore.store.writer import create

__all__ = ["ConvertResult", "convert_store"]

LAYOUT_NAMES = {"pixels": "NHWC", "encoded": "encoded"}


@dataclasses.dataclass(frozen=True)
class ConvertResult:
    """What ``convert_store`` wrote: the layout, the image count and the bytes before and after."""

    path: str
    layout: str
    nimages: int
    src_bytes: int
    dst_bytes: int
    lossless: bool


def convert_store(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    layout: str,
    *,
    quality: int | None = None,
    codec: Codec | str | None = None,
    chunk_images: int | None = None,
    overwrite: bool = False,
    verify: bool = True,
    lock_timeout: float | None = 0.0,
) -> ConvertResult:
    """Write ``src`` (a local image store) as ``dst`` in ``layout`` (``"pixels"`` or ``"encoded"``).

    All per-item values and metadata are carried over (provenance records the conversion).
    ``quality`` (encoded only): lossy JPEG, so ``verify`` checks shapes and decodability only."""
    if layout not in LAYOUT_NAMES:
        raise InvalidInputError(f"layout must be 'pixels' or 'encoded', got {layout!r}")
    if quality is not None and layout != "encoded":
        raise InvalidInputError("--quality applies to --layout encoded only")
    out = Path(dst)
    if out.suffix != ".b2nd":
        raise InvalidInputError(f"{out}: a store's file name must end in .b2nd")
    # one writer at a time: a write to dst in progress is waited for, never replaced
    real = Path(os.path.realpath(out))
    with WriterLock(real, purpose="convert", timeout=lock_timeout):
        rollback(real)  # a write to dst that died half-way is undone first, as every writer does
        return _convert_locked(src, out, layout, quality, codec, chunk_images, overwrite, verify)


def _convert_locked(
    src: str | os.PathLike[str],
    out: Path,
    layout: str,
    quality: int | None,
    codec: Codec | str | None,
    chunk_images: int | None,
    overwrite: bool,
    verify: bool,
) -> ConvertResult:
    if out.exists() and not overwrite:
        raise StoreExistsError(f"{out} already exists; pass overwrite=True (CLI: --overwrite) to replace it")
    with open_store(src) as s:
        if s.layout not in ("NHWC", "encoded") or s.dtype != np.uint8:
            raise InvalidInputError(
                f"{s.location}: convert works on uint8 image stores; this one is {s.layout} {s.dtype}"
            )
        same_entries = layout == "encoded" and s.layout == "encoded" and quality is None
        encoding = None
        if layout == "encoded":
            encoding = s.meta.encoding if same_entries else Encoding.for_quality(quality)
            assert encoding is not None
            encoding = Encoding((), encoding.reencode, encoding.quality)
        provenance = dict(s.provenance)
        provenance["converted_from"] = {"layout": s.layout, "codec": s.codec.describe()}
        tmp = temp_path(out, "migrating")
        try:
            w = create(
                tmp,
                s.image_shape,
                dtype="uint8",
                codec=codec,
                chunk_images=chunk_images or s.chunk_images,
                class_names=s.class_names,
                attrs=s.attrs,
                provenance=provenance,
                layout=LAYOUT_NAMES[layout],
                encoding=encoding,
                nthreads=1,
            )
            with w:
                for c in range(s.nchunks):
                    a, b = s.chunk_range(c)
                    labels = s.labels[a:b] if s.labels is not None else None
                    keys = s.keys[a:b] if s.keys is not None else None
                    columns = {name: col[a:b] for name, col in s.columns.items()}
                    groups = (
                        [s.group_names[g] for g in s.groups[a:b]]
                        if s.groups is not None and s.group_names is not None
                        else None
                    )
                    if same_entries:
                        w.append_entries(s.chunk_entries(c), labels=labels, keys=keys, columns=columns, groups=groups)
                    else:
                        w.append(s.read_chunk(c), labels=labels, keys=keys, columns=columns, groups=groups)
                for item in s.skipped:
                    w.add_skipped(item.get("path", ""), item.get("reason", ""))
            if verify:
                _compare(s, tmp, lossless=quality is None)
            publish(tmp, out)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        src_bytes = s.cbytes
    return ConvertResult(str(out), layout, len(s), src_bytes, out.stat().st_size, quality is None)


def _compare(src: Any, tmp: Path, lossless: bool) -> None:
    """The new store against its source, chunk by chunk: same metadata, same pixels (when lossless)."""
    with open_store(tmp) as t:
        same = (
            len(t) == len(src)
            and t.image_shape == src.image_shape
            and _eq(t.labels, src.labels)
            and (t.keys is None) == (src.keys is None)
            and (t.keys is None or list(t.keys) == list(src.keys))
        )
        if not same:
            raise CorruptStoreError(
                f"{tmp}: the converted store's length, shape, labels or keys differ from {src.location}"
            )
        k = src.chunk_images
        for c in range(src.nchunks):
            a, b = src.chunk_range(c)
            got = t[a:b] if t.chunk_images != k else t.read_chunk(c)
            if lossless and not np.array_equal(got, src.read_chunk(c)):
                bad = int(np.flatnonzero((got != src.read_chunk(c)).reshape(b - a, -1).any(axis=1))[0])
                raise CorruptStoreError(
                    f"{tmp}: image {a + bad} decodes to other pixels than in {src.location}; nothing was published"
                )


def _eq(x: np.ndarray | None, y: np.ndarray | None) -> bool:
    return (x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y))
