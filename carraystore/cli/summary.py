"""What a store holds (``carraystore info``, ``meta``), and what a file is when it is not a store."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["store_info", "info_rows", "describe_non_store", "field_summary", "class_counts_text"]

#: Classes listed by name in ``info`` and ``meta``; beyond that a summary of the rest.
SHOWN_CLASSES = 20
#: An integer field with at most this many distinct values is summarised by counts.
SMALL_INT_VALUES = 10


def field_summary(col: np.ndarray) -> dict[str, Any]:
    """dtype, per-sample shape and a summary of one field: counts of few integer values, else min/mean/max."""
    out: dict[str, Any] = {"dtype": str(col.dtype), "shape": list(col.shape[1:])}
    if col.dtype.kind not in "biuf" or not col.size:
        return out
    if col.dtype.kind in "biu" and col.ndim == 1:
        values, counts = np.unique(col, return_counts=True)
        if len(values) <= SMALL_INT_VALUES:
            out["counts"] = {str(int(v)): int(c) for v, c in zip(values, counts, strict=True)}
            return out
    a = col.astype(np.float64, copy=False)
    nan = int(np.isnan(a).sum()) if col.dtype.kind == "f" else 0
    if nan == a.size:
        out["nan"] = nan
        return out
    out.update(min=float(np.nanmin(a)), mean=float(np.nanmean(a)), max=float(np.nanmax(a)))
    if nan:
        out["nan"] = nan
    return out


def _num(v: float) -> str:
    return f"{v:.6g}"


def _field_text(name: str, f: dict[str, Any]) -> str:
    shape = "x".join(map(str, f["shape"]))
    head = f"{name}: {f['dtype']}" + (f" ({shape})" if shape else "")
    if "counts" in f:
        return f"{head}, counts " + ", ".join(f"{k} ({v})" for k, v in f["counts"].items())
    if "min" in f:
        return f"{head}, min {_num(f['min'])} mean {_num(f['mean'])} max {_num(f['max'])}" + (
            f", {f['nan']} NaN" if f.get("nan") else ""
        )
    return head + (f", all {f['nan']} NaN" if f.get("nan") else "")


def class_counts_text(label_counts: dict[str, int], nclasses: int | None = None, head: bool = True) -> str:
    """``N classes: a (n), b (n), ...``; beyond ``SHOWN_CLASSES`` the first ones and a summary of the rest."""
    n = nclasses or len(label_counts)
    items = list(label_counts.items())
    shown = ", ".join(f"{k} ({v})" for k, v in items[:SHOWN_CLASSES])
    lead = f"{n} classes: " if head else ""
    if len(items) <= SHOWN_CLASSES:
        return lead + shown
    counts = np.array([v for _, v in items])
    return (
        f"{lead}{shown}, ... and {len(items) - SHOWN_CLASSES} more; {int(counts.min())} to "
        f"{int(counts.max())} items per class (info --json lists them all)"
    )


def store_info(store: Any) -> dict[str, Any]:
    """A JSON-able description of a store (what ``carraystore info --json`` prints)."""
    meta = store.meta
    info: dict[str, Any] = {
        "path": str(store.path),
        "format_version": meta.format_version,
        "writer_version": meta.writer_version,
        "blosc2_version": meta.blosc2_version,
        "layout": meta.layout,
        "nimages": len(store),
        "image_shape": list(store.image_shape),
        "dtype": str(store.dtype),
        "color_mode": meta.color_mode,
        "nchunks": store.nchunks,
        "chunk_images": store.chunk_images,
        "codec": store.codec.to_config(),
        "blocksize": meta.blocksize,
        "nbytes": store.nbytes,
        "cbytes": store.cbytes,
        "ratio": round(store.nbytes / store.cbytes, 3) if store.cbytes else None,
        "class_names": list(store.class_names) if store.class_names is not None else None,
        "labelled": store.labels is not None,
        "keys": store.keys is not None,
        "columns": {k: str(v.dtype) for k, v in store.columns.items()},
        "fields": {k: field_summary(v) for k, v in store.columns.items()},
        "skipped": [dict(s) for s in store.skipped],
        "provenance": store.provenance,
        "attrs": store.attrs,
    }
    if meta.layout == "encoded" and meta.encoding is not None:
        enc = meta.encoding
        sizes = np.asarray(meta.entry_sizes if meta.entry_sizes is not None else (), dtype=np.int64)
        info["entries"] = {
            "formats": list(enc.formats),
            "raw": int((sizes == meta.image_nbytes).sum()),
            "reencode": enc.reencode,
            "quality": enc.quality,
            "bytes": int(sizes.sum()),
        }
    if store.group_names is not None:
        info["groups"] = {
            "count": len(store.group_names),
            "names": list(store.group_names[:5]),
            "sizes": {"min": int(np.bincount(store.groups).min()), "max": int(np.bincount(store.groups).max())}
            if len(store.groups)
            else None,
        }
    if store.labels is not None and len(store.labels):
        counts = np.bincount(store.labels)
        info["label_counts"] = {
            (store.class_names[i] if store.class_names and i < len(store.class_names) else str(i)): int(c)
            for i, c in enumerate(counts)
        }
    return info


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def info_rows(store: Any, info: dict[str, Any]) -> list[tuple[str, str]]:
    """The lines of ``carraystore info`` as (name, text) pairs, from a store and its :func:`store_info`."""
    codec = store.codec
    rows = [
        ("path", info["path"]),
        (
            "format",
            f"carraystore {info['format_version']} (written by carraystore {info['writer_version']}, blosc2 {info['blosc2_version']})",
        ),
        (
            "items",
            f"{info['nimages']} x {'x'.join(map(str, info['image_shape'])) or 'scalar'} {info['dtype']}"
            + (f" ({info['color_mode']})" if info["color_mode"] else f" (layout {info['layout']})"),
        ),
        (
            "chunks",
            f"{info['nchunks']} x {info['chunk_images']} items ({_fmt_bytes(info['chunk_images'] * store.meta.image_nbytes)} each, uncompressed)",
        ),
        (
            "codec",
            f"{codec.codec} clevel {codec.clevel}, filters {'+'.join(codec.filters) or 'none'}, typesize {codec.typesize}, "
            f"{codec.block_images} item(s)/block ({_fmt_bytes(info['blocksize'])}), split {codec.splitmode}",
        ),
        (
            "size",
            f"{_fmt_bytes(info['nbytes'])} uncompressed -> {_fmt_bytes(info['cbytes'])} on disk"
            + (f" (ratio {info['ratio']:.2f})" if info["ratio"] else ""),
        ),
    ]
    if info.get("entries"):
        e = info["entries"]
        how = "PNG (lossless)" if e["quality"] is None and e["reencode"] == "png" else e["reencode"].upper()
        how += f" at quality {e['quality']}" if e["quality"] is not None else ""
        rows.append(
            (
                "entries",
                f"{', '.join(f.upper() for f in e['formats'] if f != 'raw') or 'none'} files"
                + (f", {e['raw']} raw pixels" if e["raw"] else "")
                + f"; {_fmt_bytes(e['bytes'])} in all; pixels the writer encodes become {how}",
            )
        )
    if info.get("label_counts"):
        rows.append(
            ("labels", class_counts_text(info["label_counts"], len(info["class_names"] or info["label_counts"])))
        )
    else:
        rows.append(("labels", "yes" if info["labelled"] else "none"))
    rows.append(
        (
            "keys",
            f"yes, e.g. {store.keys[0]}"
            if store.keys is not None and len(store.keys)
            else ("yes" if info["keys"] else "none"),
        )
    )
    if info.get("groups"):
        g = info["groups"]
        sizes = f", {g['sizes']['min']} to {g['sizes']['max']} items each" if g["sizes"] else ""
        more = ", ..." if g["count"] > len(g["names"]) else ""
        rows.append(("groups", f"{g['count']}{sizes}: {', '.join(g['names'])}{more}"))
    if info["fields"]:
        rows.append(("fields", f"\n{'':13}".join(_field_text(k, f) for k, f in info["fields"].items())))
    rows.append(
        (
            "skipped",
            f"{len(info['skipped'])} file(s)"
            + "".join(f"\n{'':13}{s.get('path')}: {s.get('reason')}" for s in info["skipped"][:20]),
        )
    )
    if info["provenance"]:
        rows.append(("provenance", ", ".join(f"{k}={v}" for k, v in info["provenance"].items() if v is not None)))
    if info["attrs"]:
        rows.append(("attrs", json.dumps(info["attrs"])[:500]))
    return rows


# -- what a file is, when it is not a store ---------------------------------------------------

#: Leading bytes of the files people point ``carraystore info`` at by mistake, and what to do.
_MAGIC: tuple[tuple[bytes, str, str], ...] = (
    (b"\xff\xd8\xff", "a JPEG image", "to make a store from image files use `carraystore ingest FOLDER OUT.b2nd`"),
    (b"\x89PNG\r\n\x1a\n", "a PNG image", "to make a store from image files use `carraystore ingest FOLDER OUT.b2nd`"),
    (b"GIF8", "a GIF image", "to make a store from image files use `carraystore ingest FOLDER OUT.b2nd`"),
    (b"BM", "a BMP image", "to make a store from image files use `carraystore ingest FOLDER OUT.b2nd`"),
    (
        b"\x89HDF\r\n\x1a\n",
        "an HDF5 file",
        "convert it with `carraystore migrate FILE OUT.b2nd` (see --dataset, --labels)",
    ),
    (b"PK\x03\x04", "a zip file (an .npz?)", "convert an .npz with `carraystore migrate FILE OUT.b2nd`"),
    (
        b"\x93NUMPY",
        "a NumPy .npy file",
        "load it with numpy and write it with carraystore.create, or save it in an .npz and migrate that",
    ),
)


def describe_non_store(path: str | os.PathLike[str]) -> str | None:
    """What ``path`` is when it is a file people confuse with a store (by magic bytes), and what to do; else None."""
    p = Path(path)
    try:
        if p.is_dir():
            if (p / "meta").is_dir() and (p / "data").is_dir() or (p / "__rootdirs__").exists():
                return f"{p} is a bcolz folder, not a store; convert it with `carraystore migrate {p} OUT.b2nd`"
            if _holds_images(p):
                return f"{p} is a folder of images, not a store; make one with `carraystore ingest {p} OUT.b2nd`"
            return None
        if not p.is_file():  # never open a FIFO or a device: it could block
            return None
        with open(p, "rb") as f:
            head = f.read(16)
    except OSError:
        return None
    for magic, what, todo in _MAGIC:
        if head.startswith(magic):
            return f"{p} is {what}, not a carraystore store; {todo}"
    if head[4:12] in (b"ftypheic", b"ftypavif") or head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return f"{p} is an image, not a carraystore store; to make a store from image files use `carraystore ingest FOLDER OUT.b2nd`"
    return None


def _holds_images(folder: Path, limit: int = 200) -> bool:
    """Whether image files sit in ``folder`` or its sub-folders (looks at ``limit`` entries of each at most)."""
    from carraystore.ingest.images import IMAGE_EXTENSIONS  # Pillow only when a folder is described

    def entries(d: Path) -> list[os.DirEntry[str]]:
        with os.scandir(d) as it:
            return [e for _, e in zip(range(limit), it, strict=False)]

    top = entries(folder)
    for e in top:
        if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS):
            return True
    for e in top:
        if e.is_dir() and any(f.is_file() and f.name.lower().endswith(IMAGE_EXTENSIONS) for f in entries(Path(e.path))):
            return True
    return False
