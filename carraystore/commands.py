"""CLI sub-commands for the store itself: ingest, info, verify, preview, export."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.errors import CarrayStoreError, InvalidInputError, MissingDependencyError
from carraystore.format import PRESETS, Codec

__all__ = ["register", "store_info", "make_contact_sheet", "export_images"]


def _codec_from_args(args: argparse.Namespace) -> Codec | None:
    if getattr(args, "codec_config", None):
        try:
            return Codec.from_config(json.loads(args.codec_config))
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"--codec-config is not valid JSON: {exc}") from exc
    if getattr(args, "preset", None):
        return Codec.preset(args.preset)
    return None


def add_codec_arguments(p: argparse.ArgumentParser) -> None:
    """--preset / --codec-config / --chunk-images, shared by ingest and migrate."""
    p.add_argument("--preset", choices=sorted(PRESETS), help="codec preset (default: balanced); see docs/codecs.md")
    p.add_argument("--codec-config", metavar="JSON", help='an explicit codec, e.g. \'{"codec": "zstd", "clevel": 3}\'')
    p.add_argument("--chunk-images", type=int, metavar="N", help="images per chunk (default: about 4 MiB per chunk)")


# -- ingest ----------------------------------------------------------------------------------


def _cmd_ingest(args: argparse.Namespace) -> int:
    from carraystore.ingest import from_directory

    if getattr(args, "dask_scheduler", None) and getattr(args, "client", None) is None:
        return _cmd_ingest_on_cluster(args)

    labels: Any = "inferred" if args.labels == "inferred" else None
    result = from_directory(
        args.src,
        args.out,
        labels=labels,
        class_names=args.class_names,
        image_size=tuple(args.image_size) if args.image_size else None,
        interpolation=args.interpolation,
        color_mode=args.color_mode,
        crop_to_aspect_ratio=args.crop_to_aspect_ratio,
        keep_order=args.keep_order,
        seed=args.seed,
        workers=args.workers,
        on_error=args.on_error,
        codec=_codec_from_args(args),
        chunk_images=args.chunk_images,
        split_dirs=args.split_dirs,
        follow_links=args.follow_links,
        overwrite=args.overwrite,
        progress=not args.quiet,
        client=getattr(args, "client", None),
    )
    results = result if isinstance(result, dict) else {"": result}
    for r in results.values():
        print(r.summary())
    return 0


def _cmd_ingest_on_cluster(args: argparse.Namespace) -> int:
    """``ingest --dask-scheduler ADDRESS``: the same ingest, decoded on a dask.distributed cluster."""
    try:
        from distributed import Client
    except ImportError as exc:
        raise MissingDependencyError("--dask-scheduler needs dask.distributed: pip install 'carraystore[dask]'") from exc
    try:
        client = Client(args.dask_scheduler, timeout=30)
    except (OSError, TimeoutError) as exc:
        raise InvalidInputError(
            f"cannot reach the dask scheduler at {args.dask_scheduler} ({exc}); start one (`dask scheduler`) "
            "or check the address (e.g. tcp://10.0.0.5:8786)"
        ) from exc
    with client:
        args.client = client
        return _cmd_ingest(args)


# -- info ------------------------------------------------------------------------------------


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
        "skipped": [dict(s) for s in store.skipped],
        "provenance": store.provenance,
        "attrs": store.attrs,
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


def _cmd_info(args: argparse.Namespace) -> int:
    from carraystore.reader import open_store

    status = 0
    for path in args.stores:
        with open_store(path) as store:
            info = store_info(store)
            if args.json:
                print(json.dumps(info, indent=2))
                continue
            codec = store.codec
            rows = [
                ("path", info["path"]),
                ("format", f"carraystore {info['format_version']} (written by carraystore {info['writer_version']}, blosc2 {info['blosc2_version']})"),
                ("items", f"{info['nimages']} x {'x'.join(map(str, info['image_shape'])) or 'scalar'} {info['dtype']}"
                 + (f" ({info['color_mode']})" if info["color_mode"] else f" (layout {info['layout']})")),
                ("chunks", f"{info['nchunks']} x {info['chunk_images']} items ({_fmt_bytes(info['chunk_images'] * store.meta.image_nbytes)} each, uncompressed)"),
                ("codec", f"{codec.codec} clevel {codec.clevel}, filters {'+'.join(codec.filters) or 'none'}, typesize {codec.typesize}, "
                 f"{codec.block_images} item(s)/block ({_fmt_bytes(info['blocksize'])}), split {codec.splitmode}"),
                ("size", f"{_fmt_bytes(info['nbytes'])} uncompressed -> {_fmt_bytes(info['cbytes'])} on disk"
                 + (f" (ratio {info['ratio']:.2f})" if info["ratio"] else "")),
            ]
            if info.get("label_counts"):
                counts = ", ".join(f"{k} ({v})" for k, v in info["label_counts"].items())
                rows.append(("labels", f"{len(info['class_names'] or info['label_counts'])} classes: {counts}"))
            else:
                rows.append(("labels", "yes" if info["labelled"] else "none"))
            rows.append(("keys", f"yes, e.g. {store.keys[0]}" if store.keys is not None and len(store.keys) else ("yes" if info["keys"] else "none")))
            if info["columns"]:
                rows.append(("columns", ", ".join(f"{k} ({v})" for k, v in info["columns"].items())))
            rows.append(("skipped", f"{len(info['skipped'])} file(s)" + "".join(f"\n{'':13}{s.get('path')}: {s.get('reason')}" for s in info["skipped"][:20])))
            if info["provenance"]:
                rows.append(("provenance", ", ".join(f"{k}={v}" for k, v in info["provenance"].items() if v is not None)))
            if info["attrs"]:
                rows.append(("attrs", json.dumps(info["attrs"])[:500]))
            for k, v in rows:
                print(f"{k:<12} {v}")
            if len(args.stores) > 1:
                print()
    return status


# -- verify ----------------------------------------------------------------------------------


def _cmd_verify(args: argparse.Namespace) -> int:
    from carraystore.reader import open_store

    bad = 0
    for path in args.stores:
        try:
            store = open_store(path)
        except CarrayStoreError as exc:
            print(f"FAILED {path}: {exc}")
            bad += 1
            continue
        with store:
            problems = store.verify(progress=not args.quiet)
        if problems:
            bad += 1
            print(f"FAILED {path}: {len(problems)} problem(s)")
            for p in problems:
                print(f"  {p}")
        else:
            print(f"OK {path}: {store.nchunks} chunks, {len(store)} items verified (CRC32, headers, decompression)")
    return 1 if bad else 0


# -- preview ---------------------------------------------------------------------------------


def make_contact_sheet(store: Any, n: int = 32, cols: int = 8, seed: int | None = 0, cell: int = 128) -> Any:
    """A PIL image: ``n`` images of the store (random when ``seed`` is not None) with their labels."""
    from PIL import Image, ImageDraw

    if store.layout != "NHWC":
        raise InvalidInputError(f"{store.path}: preview needs an image store (layout NHWC), not {store.layout!r}")
    n = min(n, len(store))
    if n == 0:
        raise InvalidInputError(f"{store.path}: the store is empty")
    idx = np.sort(np.random.default_rng(seed).choice(len(store), n, replace=False)) if seed is not None else np.arange(n)
    images = store.take(idx)
    cols = max(1, min(cols, n))
    rows = -(-n // cols)
    text_h = 14
    sheet = Image.new("RGB", (cols * cell, rows * (cell + text_h)), "white")
    draw = ImageDraw.Draw(sheet)
    for j, (i, img) in enumerate(zip(idx, images)):
        arr = img
        if arr.dtype != np.uint8:
            lo, hi = float(arr.min()), float(arr.max())
            arr = ((arr.astype(np.float64) - lo) / (hi - lo or 1) * 255).astype(np.uint8)
        mode = {1: "L", 3: "RGB", 4: "RGBA"}[arr.shape[2]]
        tile = Image.fromarray(arr[..., 0] if mode == "L" else arr, mode).convert("RGB")
        tile.thumbnail((cell, cell))
        x, y = (j % cols) * cell, (j // cols) * (cell + text_h)
        sheet.paste(tile, (x + (cell - tile.width) // 2, y + (cell - tile.height) // 2))
        label = f"#{int(i)}"
        if store.labels is not None:
            lab = int(store.labels[i])
            label += f" {store.class_names[lab] if store.class_names and lab < len(store.class_names) else lab}"
        draw.text((x + 2, y + cell), label[:22], fill="black")
    return sheet


def _cmd_preview(args: argparse.Namespace) -> int:
    from carraystore.reader import open_store

    with open_store(args.store) as store:
        sheet = make_contact_sheet(store, n=args.n, cols=args.cols, seed=None if args.first else args.seed, cell=args.cell)
    out = Path(args.out)
    tmp = out.with_name(f".{out.name}.partial")
    sheet.save(tmp, format="PNG")
    os.replace(tmp, out)
    print(f"wrote {out} ({sheet.width}x{sheet.height})")
    return 0


# -- export ----------------------------------------------------------------------------------


def export_images(store: Any, outdir: str | os.PathLike[str], fmt: str = "png", quality: int = 95, overwrite: bool = False) -> int:
    """Write every image as a file under ``outdir`` (keys as relative paths); returns the count.

    Refuses any key that would land outside ``outdir`` (absolute, ``..``, or through a link).
    """
    from PIL import Image

    if store.layout != "NHWC" or store.dtype != np.uint8:
        raise InvalidInputError(f"{store.path}: export writes uint8 image stores; this one is {store.layout} {store.dtype}")
    root = Path(outdir)
    root.mkdir(parents=True, exist_ok=True)
    root_resolved = root.resolve()
    ext = {"png": ".png", "jpeg": ".jpg"}[fmt]
    names: list[Path] = []
    for i in range(len(store)):
        if store.keys is not None:
            key = store.keys[i].replace("\\", "/")
            rel = Path(key).with_suffix(ext)
        else:
            lab = int(store.labels[i]) if store.labels is not None else None
            sub = (store.class_names[lab] if store.class_names and lab is not None else str(lab)) if lab is not None else ""
            rel = Path(sub) / f"{i:08d}{ext}"
        target = (root / rel).resolve()
        if rel.is_absolute() or ".." in rel.parts or not target.is_relative_to(root_resolved):
            raise InvalidInputError(
                f"{store.path}: key {store.keys[i] if store.keys is not None else rel!r} (item {i}) would be written outside "
                f"{root}; refusing to export this store"
            )
        names.append(target)
    if len(set(names)) != len(names):
        dup = next(p for p, c in Counter(names).items() if c > 1)
        raise InvalidInputError(f"{store.path}: two items would be written to the same file {dup}")
    if not overwrite:
        existing = [p for p in names if p.exists()]
        if existing:
            raise InvalidInputError(f"{existing[0]} already exists; pass --overwrite to replace files")
    count = 0
    for c in range(store.nchunks):
        start, _ = store.chunk_range(c)
        for j, img in enumerate(store.read_chunk(c)):
            target = names[start + j]
            target.parent.mkdir(parents=True, exist_ok=True)
            mode = {1: "L", 3: "RGB", 4: "RGBA"}[img.shape[2]]
            pil = Image.fromarray(img[..., 0] if mode == "L" else img, mode)
            if fmt == "jpeg" and mode == "RGBA":
                raise InvalidInputError(f"{store.path}: RGBA images cannot be written as JPEG; use --format png")
            tmp = target.with_name(f".{target.name}.partial")
            pil.save(tmp, format="PNG" if fmt == "png" else "JPEG", **({"quality": quality} if fmt == "jpeg" else {}))
            os.replace(tmp, target)
            count += 1
    return count


def _cmd_export(args: argparse.Namespace) -> int:
    from carraystore.reader import open_store

    with open_store(args.store) as store:
        n = export_images(store, args.outdir, fmt=args.format, quality=args.quality, overwrite=args.overwrite)
    print(f"wrote {n} images under {args.outdir}")
    return 0


# -- registration ------------------------------------------------------------------------------


def register(sub: Any) -> None:
    """Add ingest, info, verify, preview and export to the ``carraystore`` CLI."""
    p = sub.add_parser("ingest", help="turn a folder of images into a store", description=(
        "Ingest SRC (class sub-folders of images, as keras.utils.image_dataset_from_directory reads) into OUT.b2nd. "
        "With --split-dirs, every sub-folder of SRC (train/, validation/, test/) becomes OUT/<split>.b2nd."))
    p.add_argument("src", help="folder of images")
    p.add_argument("out", help="output store (.b2nd), or a folder with --split-dirs")
    p.add_argument("--labels", choices=["inferred", "none"], default="inferred", help="labels from class sub-folders, or none")
    p.add_argument("--class-names", nargs="+", metavar="NAME", help="class folders to use, in label order")
    p.add_argument("--image-size", nargs=2, type=int, metavar=("H", "W"), help="resize every image (default: keep size; all must agree)")
    from carraystore.ingest import INTERPOLATIONS

    p.add_argument("--interpolation", choices=sorted(INTERPOLATIONS), default="bilinear")
    p.add_argument("--color-mode", choices=["grayscale", "rgb", "rgba"], default="rgb")
    p.add_argument("--crop-to-aspect-ratio", action="store_true", help="centre-crop to the target aspect ratio before resizing")
    p.add_argument("--keep-order", action="store_true", help="keep sorted file order (video frames) instead of a seeded shuffle")
    p.add_argument("--seed", type=int, default=0, help="seed of the write order (default 0)")
    p.add_argument("--workers", type=int, default=None, help="decoding processes (default: all cores)")
    p.add_argument("--on-error", choices=["fail", "skip"], default="fail", help="what to do with files that do not decode")
    p.add_argument("--split-dirs", action="store_true", help="one store per split sub-folder")
    p.add_argument("--follow-links", action="store_true")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output store")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument("--dask-scheduler", metavar="ADDRESS", help=(
        "decode on a dask.distributed cluster (e.g. tcp://10.0.0.5:8786); SRC must be at the same path on every "
        "worker; the store is the same as a local ingest's (docs/dask.md)"))
    add_codec_arguments(p)
    p.set_defaults(func=_cmd_ingest)

    p = sub.add_parser("info", help="describe a store")
    p.add_argument("stores", nargs="+", metavar="STORE")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("verify", help="recompute checksums and decode every chunk (exit 1 on damage)")
    p.add_argument("stores", nargs="+", metavar="STORE")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser("preview", help="write a PNG contact sheet of images with their labels")
    p.add_argument("store")
    p.add_argument("out", help="output .png")
    p.add_argument("-n", type=int, default=32, help="number of images (default 32)")
    p.add_argument("--cols", type=int, default=8)
    p.add_argument("--cell", type=int, default=128, help="tile size in pixels")
    p.add_argument("--seed", type=int, default=0, help="seed of the random sample")
    p.add_argument("--first", action="store_true", help="the first N images instead of a random sample")
    p.set_defaults(func=_cmd_preview)

    p = sub.add_parser("export", help="write the images back as PNG/JPEG files under a folder")
    p.add_argument("store")
    p.add_argument("outdir")
    p.add_argument("--format", choices=["png", "jpeg"], default="png")
    p.add_argument("--quality", type=int, default=95, help="JPEG quality")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_cmd_export)


if __name__ == "__main__":  # pragma: no cover
    from carraystore.cli import main

    sys.exit(main())
