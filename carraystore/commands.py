"""CLI sub-commands for the store itself: ingest, info, meta, verify, preview, export, copy."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import stat
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from carraystore.errors import CarrayStoreError, InvalidInputError, MissingDependencyError, NotAStoreError
from carraystore.format import PRESETS, Codec

__all__ = [
    "register",
    "store_info",
    "make_contact_sheet",
    "export_images",
    "add_write_arguments",
    "storage_options_arg",
]


def _codec_from_args(args: argparse.Namespace) -> Codec | None:
    if getattr(args, "codec_config", None):
        try:
            return Codec.from_config(json.loads(args.codec_config))
        except json.JSONDecodeError as exc:
            raise InvalidInputError(f"--codec-config is not valid JSON: {exc}") from exc
    if getattr(args, "preset", None):
        return Codec.preset(args.preset)
    return None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a clear usage error otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def write_file_safely(target: Path, save: Callable[[BinaryIO], None]) -> None:
    """Write ``target`` through ``save(file)`` and a temporary file beside it, then rename it into place.

    The temporary file has a random name and is created exclusively (``O_EXCL``, ``O_NOFOLLOW``):
    a link or file planted in the folder is never followed or written through. A failed write
    (disk full, ...) raises a named error and leaves no temporary file.
    """
    from carraystore.writer import named_write_errors, temp_path

    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    with named_write_errors(target, target.name):
        for attempt in range(8):
            tmp = temp_path(target)
            try:
                fd = os.open(tmp, flags, 0o666)
                break
            except FileExistsError:
                if attempt == 7:
                    raise
        try:
            with os.fdopen(fd, "wb") as f:
                save(f)
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise


def add_codec_arguments(p: argparse.ArgumentParser) -> None:
    """--preset / --codec-config / --chunk-images, shared by ingest and migrate."""
    p.add_argument("--preset", choices=sorted(PRESETS), help="codec preset (default: balanced); see docs/codecs.md")
    p.add_argument("--codec-config", metavar="JSON", help='an explicit codec, e.g. \'{"codec": "zstd", "clevel": 3}\'')
    p.add_argument(
        "--chunk-images", type=positive_int, metavar="N", help="images per chunk (default: about 4 MiB per chunk)"
    )


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
    from carraystore.ingest import IMAGE_EXTENSIONS

    def entries(d: Path) -> list[os.DirEntry[str]]:
        with os.scandir(d) as it:
            return [e for _, e in zip(range(limit), it)]

    top = entries(folder)
    for e in top:
        if e.is_file() and e.name.lower().endswith(IMAGE_EXTENSIONS):
            return True
    for e in top:
        if e.is_dir() and any(f.is_file() and f.name.lower().endswith(IMAGE_EXTENSIONS) for f in entries(Path(e.path))):
            return True
    return False


def open_for_cli(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Any:
    """``open_store``, but a file that is something else (an image, HDF5, npz, bcolz) is named as such."""
    from carraystore.reader import open_store

    try:
        return open_store(path, storage_options)
    except CarrayStoreError as exc:
        what = describe_non_store(path)
        if what is not None:
            raise NotAStoreError(what) from exc
        raise


def storage_options_arg(text: str) -> dict[str, Any]:
    """Parse ``--storage-options`` (a JSON object)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError('must be a JSON object, e.g. \'{"endpoint_url": "http://127.0.0.1:8333"}\'')
    return value


def add_read_arguments(p: argparse.ArgumentParser) -> None:
    """--storage-options for commands that read a store that may be a URL."""
    p.add_argument(
        "--storage-options",
        type=storage_options_arg,
        metavar="JSON",
        help="options for an s3://, gs:// or http(s):// store, as pandas/zarr take them (the AWS_* environment works too)",
    )


def add_write_arguments(p: argparse.ArgumentParser) -> None:
    """--storage-options / --tmp-dir for commands that write a store that may be a URL."""
    p.add_argument(
        "--storage-options",
        type=storage_options_arg,
        metavar="JSON",
        help="options for an s3:// or gs:// output, as pandas/zarr take them (the AWS_* environment works too)",
    )
    p.add_argument(
        "--tmp-dir", metavar="DIR", help="where a store bound for a URL is staged before its upload (default: $TMPDIR)"
    )


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
        dtype=args.dtype,
        progress=not args.quiet,
        max_skipped=args.max_skipped,
        allow_split_names=args.allow_split_names,
        validation_split=args.validation_split,
        subset=args.subset,
        lock_timeout=args.wait,
        storage_options=args.storage_options,
        tmp_dir=args.tmp_dir,
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
        raise MissingDependencyError(
            "--dask-scheduler needs dask.distributed: pip install 'carraystore[dask]'"
        ) from exc
    try:
        client = Client(args.dask_scheduler, timeout=args.dask_timeout)
    except (OSError, TimeoutError) as exc:
        raise InvalidInputError(
            f"cannot reach the dask scheduler at {args.dask_scheduler} ({exc}); start one (`dask scheduler`) "
            "or check the address (e.g. tcp://10.0.0.5:8786)"
        ) from exc
    with client:
        args.client = client
        return _cmd_ingest(args)


def _max_skipped(text: str) -> float | int:
    """--max-skipped: ``20`` (files), ``5%`` or ``0.05`` (a share of the files)."""
    try:
        if text.endswith("%"):
            value = float(text[:-1]) / 100
            if not 0 <= value < 1:
                raise ValueError
            return value
        if text.isdigit():
            return int(text)
        value = float(text)
        if not 0 <= value < 1:
            raise ValueError
        return value
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a count (20), a percentage (5%) or a fraction below 1 (0.05)"
        ) from None


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
    """Describe every store given; one that cannot be opened is an error line (exit 2), the rest go on.
    With --json: one object for one store, a list of objects for several."""
    status = 0
    documents = []
    for path in args.stores:
        try:
            store = open_for_cli(path, args.storage_options)
        except (CarrayStoreError, OSError) as exc:
            if len(args.stores) == 1:
                raise
            print(f"carraystore info: error: {exc}", file=sys.stderr)
            status = 2
            continue
        with store:
            info = store_info(store)
            if args.json:
                documents.append(info)
                continue
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
            if info.get("label_counts"):
                counts = ", ".join(f"{k} ({v})" for k, v in info["label_counts"].items())
                rows.append(("labels", f"{len(info['class_names'] or info['label_counts'])} classes: {counts}"))
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
            if info["columns"]:
                rows.append(("columns", ", ".join(f"{k} ({v})" for k, v in info["columns"].items())))
            rows.append(
                (
                    "skipped",
                    f"{len(info['skipped'])} file(s)"
                    + "".join(f"\n{'':13}{s.get('path')}: {s.get('reason')}" for s in info["skipped"][:20]),
                )
            )
            if info["provenance"]:
                rows.append(
                    ("provenance", ", ".join(f"{k}={v}" for k, v in info["provenance"].items() if v is not None))
                )
            if info["attrs"]:
                rows.append(("attrs", json.dumps(info["attrs"])[:500]))
            for k, v in rows:
                print(f"{k:<12} {v}")
            if len(args.stores) > 1:
                print()
    if args.json and documents:
        print(json.dumps(documents[0] if len(args.stores) == 1 else documents, indent=2))
    return status


# -- meta ------------------------------------------------------------------------------------


def _parse_attr(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``: VALUE as JSON when it parses (3, 0.5, true, [1,2], {"a":1}), else as text."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise InvalidInputError(f"--attr {text!r}: expected KEY=VALUE")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _cmd_meta(args: argparse.Namespace) -> int:
    from carraystore.writer import update_metadata

    path = Path(args.store)
    names = None
    if args.class_names is not None:
        names = [c.strip() for c in args.class_names.split(",")]
    attrs = dict(_parse_attr(a) for a in args.attr)
    if names is not None or attrs or args.remove_attr:
        update_metadata(
            path, class_names=names, attrs=attrs or None, remove_attrs=args.remove_attr, lock_timeout=args.wait
        )
    with open_for_cli(path) as store:
        info = store_info(store)
    shown = {
        k: info[k] for k in ("class_names", "attrs", "provenance", "labelled", "label_counts", "nimages") if k in info
    }
    if args.json:
        print(json.dumps(shown, indent=2))
        return 0
    print(f"{'store':<12} {path} ({info['nimages']} items)")
    print(f"{'class_names':<12} {', '.join(info['class_names']) if info['class_names'] else 'none'}")
    if info.get("label_counts"):
        print(f"{'labels':<12} " + ", ".join(f"{k} ({v})" for k, v in info["label_counts"].items()))
    else:
        print(f"{'labels':<12} {'yes' if info['labelled'] else 'none'}")
    print(f"{'attrs':<12} {json.dumps(info['attrs'])}")
    if info["provenance"]:
        print(f"{'provenance':<12} {json.dumps(info['provenance'])}")
    return 0


# -- verify ----------------------------------------------------------------------------------


def _cmd_verify(args: argparse.Namespace) -> int:
    bad = 0
    for path in args.stores:
        try:
            store = open_for_cli(path, args.storage_options)
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


#: Bounds of a contact sheet: tile size (pixels), and the whole sheet (pixels, about 3 bytes each).
MAX_PREVIEW_CELL = 1024
MAX_PREVIEW_PIXELS = 64_000_000


def _check_sheet_size(n: int, cols: int, cell: int, nimages: int | None = None, text_h: int = 14) -> None:
    """Refuse a contact sheet that is empty or would be too large to hold in memory.

    The sheet's pixels are counted when ``nimages`` (the store's length) is known.
    """
    for name, value in (("n", n), ("cols", cols), ("cell", cell)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise InvalidInputError(f"preview: {name} must be a positive integer, got {value!r}")
    if cell > MAX_PREVIEW_CELL:
        raise InvalidInputError(f"preview: cell {cell} is larger than the limit of {MAX_PREVIEW_CELL} pixels per tile")
    if nimages is None:
        return
    n = max(1, min(n, nimages))
    cols = min(cols, n)
    pixels = cols * cell * -(-n // cols) * (cell + text_h)
    if pixels > MAX_PREVIEW_PIXELS:
        raise InvalidInputError(
            f"preview: {n} images in {cols} columns of {cell}-pixel tiles make a sheet of {pixels:,} pixels, over the "
            f"limit of {MAX_PREVIEW_PIXELS:,}; use a smaller -n or --cell"
        )


def make_contact_sheet(
    store: Any, n: int = 32, cols: int = 8, seed: int | None = 0, cell: int = 128, keys: bool = False
) -> Any:
    """A PIL image: ``n`` images of the store (random when ``seed`` is not None) with their labels.

    Every image is scaled to fill its ``cell`` (small images enlarged by whole pixels, so a
    32 px image stays sharp; large ones shrunk). ``keys=True`` prints each image's key
    (its file path) under the tile as well.

    Raises InvalidInputError for sizes below 1 or beyond ``MAX_PREVIEW_CELL`` / ``MAX_PREVIEW_PIXELS``.
    """
    from PIL import Image, ImageDraw

    line_h = 12
    text_h = 2 + line_h * (2 if keys and store.keys is not None else 1)
    _check_sheet_size(n, cols, cell, len(store), text_h)
    if store.layout != "NHWC":
        raise InvalidInputError(f"{store.path}: preview needs an image store (layout NHWC), not {store.layout!r}")
    n = min(n, len(store))
    if n == 0:
        raise InvalidInputError(f"{store.path}: the store is empty")
    idx = (
        np.sort(np.random.default_rng(seed).choice(len(store), n, replace=False)) if seed is not None else np.arange(n)
    )
    images = store.take(idx)
    cols = max(1, min(cols, n))
    rows = -(-n // cols)
    sheet = Image.new("RGB", (cols * cell, rows * (cell + text_h)), "white")
    draw = ImageDraw.Draw(sheet)
    for j, (i, img) in enumerate(zip(idx, images)):
        arr = img
        if arr.dtype != np.uint8:
            lo, hi = float(arr.min()), float(arr.max())
            arr = ((arr.astype(np.float64) - lo) / (hi - lo or 1) * 255).astype(np.uint8)
        mode = {1: "L", 3: "RGB", 4: "RGBA"}[arr.shape[2]]
        tile = Image.fromarray(arr[..., 0] if mode == "L" else arr, mode).convert("RGB")
        scale = min(cell / tile.width, cell / tile.height)
        if scale >= 2:  # enlarge small images by whole pixels (sharp, each pixel a block)
            f = int(scale)
            tile = tile.resize((tile.width * f, tile.height * f), Image.Resampling.NEAREST)
        elif scale != 1:
            size = (max(1, round(tile.width * scale)), max(1, round(tile.height * scale)))
            tile = tile.resize(size, Image.Resampling.LANCZOS if scale < 1 else Image.Resampling.BICUBIC)
        x, y = (j % cols) * cell, (j // cols) * (cell + text_h)
        sheet.paste(tile, (x + (cell - tile.width) // 2, y + (cell - tile.height) // 2))
        label = f"#{int(i)}"
        if store.labels is not None:
            lab = int(store.labels[i])
            label += f" {store.class_names[lab] if store.class_names and lab < len(store.class_names) else lab}"
        chars = max(8, cell // 6)
        draw.text((x + 2, y + cell), label[:chars], fill="black")
        if keys and store.keys is not None:
            key = store.keys[int(i)]
            draw.text(
                (x + 2, y + cell + line_h), key if len(key) <= chars else "..." + key[-(chars - 3) :], fill="black"
            )
    return sheet


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _check_preview_output(out: Path, store_path: Path) -> None:
    """Preview replaces only a regular PNG file (never a store, a link, a folder or a FIFO)."""
    try:
        st = os.lstat(out)
    except FileNotFoundError:
        return
    what = "the store itself" if store_path.exists() and os.path.samefile(out, store_path) else None
    if stat.S_ISLNK(st.st_mode):
        raise InvalidInputError(f"{out} is a symbolic link; preview does not replace links: choose another output name")
    if not stat.S_ISREG(st.st_mode):
        raise InvalidInputError(
            f"{out} exists and is not a regular file (a folder, FIFO or device); choose another output name"
        )
    fd = os.open(out, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        head = f.read(len(_PNG_SIGNATURE))
    if head != _PNG_SIGNATURE:
        raise InvalidInputError(
            f"{out} exists and is {what or 'not a PNG file'}; preview replaces only an earlier PNG: "
            "choose another output name (e.g. sheet.png)"
        )


def _cmd_preview(args: argparse.Namespace) -> int:
    _check_sheet_size(args.n, args.cols, args.cell)
    out = Path(args.out)
    if not out.parent.is_dir():
        raise InvalidInputError(
            f"{out}: folder {out.parent} does not exist; create it first or write the preview elsewhere"
        )
    _check_preview_output(out, Path(args.store))
    with open_for_cli(args.store, args.storage_options) as store:
        sheet = make_contact_sheet(
            store, n=args.n, cols=args.cols, seed=None if args.first else args.seed, cell=args.cell, keys=args.keys
        )
    _check_preview_output(out, Path(args.store))
    write_file_safely(out, functools.partial(sheet.save, format="PNG"))
    print(f"wrote {out} ({sheet.width}x{sheet.height})")
    return 0


# -- export ----------------------------------------------------------------------------------


def export_images(
    store: Any, outdir: str | os.PathLike[str], fmt: str = "png", quality: int = 95, overwrite: bool = False
) -> int:
    """Write every image as a file under ``outdir`` (keys as relative paths); returns the count.

    Refuses any key that would land outside ``outdir`` (absolute, ``..``, or through a link),
    and an ``outdir`` that exists but is not a folder. Each file is written through a fresh
    temporary file (see :func:`write_file_safely`).
    """
    from PIL import Image

    if store.layout != "NHWC" or store.dtype != np.uint8:
        raise InvalidInputError(
            f"{store.path}: export writes uint8 image stores; this one is {store.layout} {store.dtype}"
        )
    root = Path(outdir)
    if (root.exists() or root.is_symlink()) and not root.is_dir():
        raise InvalidInputError(
            f"{root} exists and is not a folder; export writes one file per image under a folder: give a folder"
        )
    root.mkdir(parents=True, exist_ok=True)
    root_resolved = root.resolve()
    ext = {"png": ".png", "jpeg": ".jpg"}[fmt]
    names: list[Path] = []
    for i in range(len(store)):
        if store.keys is not None:
            key = store.keys[i]
            if "\\" in key and os.sep == "\\":
                raise InvalidInputError(
                    f"{store.path}: key {key!r} (item {i}) holds a backslash, which is part of the file name in a store "
                    "but a folder separator here; export it on a POSIX system"
                )
            rel = Path(key).with_suffix(ext)
        else:
            lab = int(store.labels[i]) if store.labels is not None else None
            sub = (
                (store.class_names[lab] if store.class_names and lab is not None else str(lab))
                if lab is not None
                else ""
            )
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
    folders = {q for p in names for q in p.parents if q != root_resolved and q.is_relative_to(root_resolved)}
    clash = next((p for p in names if p in folders), None)
    if clash is not None:  # keys "a.png" and "a.png/b.png"
        raise InvalidInputError(
            f"{store.path}: {clash} would be both an item's file and the folder of another item's file"
        )
    if not overwrite:
        existing = [p for p in names if p.exists()]
        if existing:
            raise InvalidInputError(f"{existing[0]} already exists; pass --overwrite to replace files")
    count = 0
    for c in range(store.nchunks):
        start, _ = store.chunk_range(c)
        for j, img in enumerate(store.read_chunk(c)):
            target = names[start + j]
            try:
                target.parent.mkdir(parents=True, exist_ok=True)
            except (FileExistsError, NotADirectoryError) as exc:  # a file already there where a folder goes
                raise InvalidInputError(
                    f"{target.parent}: cannot be made a folder for {target.name} ({exc.strerror}): a file is in the way; "
                    "export into an empty folder"
                ) from exc
            mode = {1: "L", 3: "RGB", 4: "RGBA"}[img.shape[2]]
            pil = Image.fromarray(img[..., 0] if mode == "L" else img, mode)
            if fmt == "jpeg" and mode == "RGBA":
                raise InvalidInputError(f"{store.path}: RGBA images cannot be written as JPEG; use --format png")
            options: dict[str, Any] = {"quality": quality} if fmt == "jpeg" else {}
            write_file_safely(target, functools.partial(pil.save, format="PNG" if fmt == "png" else "JPEG", **options))
            count += 1
    return count


def _cmd_export(args: argparse.Namespace) -> int:
    with open_for_cli(args.store, args.storage_options) as store:
        n = export_images(store, args.outdir, fmt=args.format, quality=args.quality, overwrite=args.overwrite)
    print(f"wrote {n} images under {args.outdir}")
    return 0


# -- copy ------------------------------------------------------------------------------------


def _cmd_copy(args: argparse.Namespace) -> int:
    from carraystore.transfer import copy_store

    result = copy_store(
        args.src,
        args.dst,
        storage_options=args.storage_options,
        dst_storage_options=args.dst_storage_options,
        overwrite=args.overwrite,
        verify=args.verify,
        progress=not args.quiet and sys.stderr.isatty(),
        lock_timeout=args.wait,
    )
    print(result.summary())
    return 0


# -- registration ------------------------------------------------------------------------------


def register(sub: Any) -> None:
    """Add ingest, info, meta, verify, preview and export to the ``carraystore`` CLI."""
    p = sub.add_parser(
        "ingest",
        help="turn a folder of images into a store",
        description=(
            "Ingest SRC (class sub-folders of images, as keras.utils.image_dataset_from_directory reads) into OUT.b2nd. "
            "With --split-dirs, every sub-folder of SRC (train/, validation/, test/) becomes OUT/<split>.b2nd; "
            "with --validation-split F --subset both, OUT/training.b2nd and OUT/validation.b2nd hold Keras' split."
        ),
    )
    p.add_argument("src", help="folder of images")
    p.add_argument(
        "out",
        help="output store (.b2nd path or s3:// / gs:// URL), or a folder or URL prefix with --split-dirs or --subset both",
    )
    p.add_argument(
        "--labels", choices=["inferred", "none"], default="inferred", help="labels from class sub-folders, or none"
    )
    p.add_argument("--class-names", nargs="+", metavar="NAME", help="class folders to use, in label order")
    p.add_argument(
        "--image-size",
        nargs=2,
        type=int,
        metavar=("H", "W"),
        help="resize every image (default: keep size; all must agree)",
    )
    from carraystore.ingest import INTERPOLATIONS

    p.add_argument(
        "--interpolation",
        choices=sorted(INTERPOLATIONS),
        default="bilinear",
        help="resampling filter of --image-size (default bilinear)",
    )
    p.add_argument(
        "--color-mode",
        choices=["grayscale", "rgb", "rgba"],
        default="rgb",
        help="channels of the stored images (default rgb)",
    )
    p.add_argument(
        "--dtype",
        choices=["uint8", "uint16"],
        default="uint8",
        help=(
            "pixel type: uint8 (16-bit files keep their high byte) or uint16 (16-bit grayscale PNGs kept exactly, "
            "8-bit files scaled by 257, 16-bit colour PNGs refused)"
        ),
    )
    p.add_argument(
        "--crop-to-aspect-ratio", action="store_true", help="centre-crop to the target aspect ratio before resizing"
    )
    p.add_argument(
        "--keep-order", action="store_true", help="keep sorted file order (video frames) instead of a seeded shuffle"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the write order and of --validation-split (default 0)")
    p.add_argument(
        "--validation-split",
        type=float,
        metavar="F",
        help="keep a fraction F of the files apart for validation, the same files as Keras picks with the same --seed",
    )
    p.add_argument(
        "--subset",
        choices=["training", "validation", "both"],
        help="with --validation-split: write the training part, the validation part, or both (OUT is then a "
        "folder receiving training.b2nd and validation.b2nd)",
    )
    p.add_argument("--workers", type=int, default=None, help="decoding processes (default: all cores)")
    p.add_argument(
        "--on-error", choices=["fail", "skip"], default="fail", help="what to do with files that do not decode"
    )
    p.add_argument(
        "--max-skipped",
        type=_max_skipped,
        default=0.01,
        metavar="N|P%",
        help="with --on-error skip, stop (writing nothing) when more files fail than this: a count (20), "
        "a percentage (5%%) or a fraction (0.05); default 1%%",
    )
    p.add_argument(
        "--split-dirs", action="store_true", help="one store per split sub-folder (train/, validation/, test/)"
    )
    p.add_argument(
        "--allow-split-names",
        action="store_true",
        help="ingest sub-folders named like splits (train/, test/, ...) as classes instead of refusing",
    )
    p.add_argument("--follow-links", action="store_true", help="descend into symbolic links to folders")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output store")
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="while another writer holds the output store, wait up to SECONDS (default: fail at once)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--dask-scheduler",
        metavar="ADDRESS",
        help=(
            "decode on a dask.distributed cluster (e.g. tcp://10.0.0.5:8786); SRC must be at the same path on every "
            "worker; the store is the same as a local ingest's (docs/dask.md)"
        ),
    )
    p.add_argument(
        "--dask-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="how long to try reaching the --dask-scheduler before giving up (default 30)",
    )
    add_codec_arguments(p)
    add_write_arguments(p)
    p.set_defaults(func=_cmd_ingest)

    p = sub.add_parser(
        "info",
        help="describe a store",
        description=(
            "Print what a store holds: items, shape and dtype, chunks, codec, sizes, class names and label counts, "
            "keys, skipped files, provenance and attrs."
        ),
    )
    p.add_argument("stores", nargs="+", metavar="STORE", help="one or more .b2nd stores")
    p.add_argument("--json", action="store_true", help="print JSON")
    add_read_arguments(p)
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser(
        "meta",
        help="show or set a store's class names and attrs (in place, pixels untouched)",
        description=(
            "Print STORE's class names, label counts, attrs and provenance; with --class-names / --attr / --remove-attr, "
            "change them first. The change is written in place into the store's metadata (the image chunks are neither "
            "read nor rewritten), journaled like an append (a crash leaves the old metadata) and under the store's "
            "writer lock (--wait to wait for another writer)."
        ),
    )
    p.add_argument("store", metavar="STORE", help="the .b2nd store")
    p.add_argument("--class-names", metavar="A,B,C", help="comma-separated class names, in label order (label 0 first)")
    p.add_argument(
        "--attr",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set an attr (repeatable); VALUE is read as JSON when it parses (3, true, [1,2]), else as text",
    )
    p.add_argument("--remove-attr", action="append", default=[], metavar="KEY", help="delete an attr (repeatable)")
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="while another writer holds the store, wait up to SECONDS (default: fail at once)",
    )
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_meta)

    p = sub.add_parser(
        "verify",
        help="recompute checksums and decode every chunk (exit 1 on damage)",
        description=(
            "Check every chunk of each STORE: its CRC32, its header against the pinned codec, and that it decompresses. "
            "Exits 1 and names the damaged chunks when any check fails."
        ),
    )
    p.add_argument("stores", nargs="+", metavar="STORE", help="one or more .b2nd stores")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    add_read_arguments(p)
    p.set_defaults(func=_cmd_verify)

    p = sub.add_parser(
        "preview",
        help="write a PNG contact sheet of images with their labels",
        description=(
            "Write a PNG grid of N images of STORE (a seeded random sample, or the first N) with their index and label "
            "under each tile (and their key with --keys). Small images are enlarged to fill the tile."
        ),
    )
    p.add_argument("store", help="the .b2nd store")
    p.add_argument("out", help="output .png (its folder must exist)")
    p.add_argument("-n", type=int, default=32, help="number of images (default 32)")
    p.add_argument("--cols", type=int, default=8, help="tiles per row (default 8)")
    p.add_argument(
        "--cell", type=int, default=128, help="tile size in pixels; images are scaled to fill it (default 128)"
    )
    p.add_argument("--keys", action="store_true", help="print each image's key (its file path) under the tile")
    p.add_argument("--seed", type=int, default=0, help="seed of the random sample")
    p.add_argument("--first", action="store_true", help="the first N images instead of a random sample")
    add_read_arguments(p)
    p.set_defaults(func=_cmd_preview)

    p = sub.add_parser(
        "export",
        help="write the images back as PNG/JPEG files under a folder",
        description=(
            "Write every image of STORE as a file under OUTDIR, named by its key (or <class>/<index> without keys)."
        ),
    )
    p.add_argument("store", help="the .b2nd store")
    p.add_argument("outdir", help="folder to write into (created if missing)")
    p.add_argument("--format", choices=["png", "jpeg"], default="png", help="file format (default png, lossless)")
    p.add_argument("--quality", type=int, default=95, help="JPEG quality (default 95)")
    p.add_argument("--overwrite", action="store_true", help="replace files that already exist")
    add_read_arguments(p)
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser(
        "copy",
        help="copy a store between local paths, s3:// / gs:// and http(s):// (verified)",
        description=(
            "Copy the store SRC to DST (each a path or URL; http(s) only as SRC), streamed with a bounded amount of memory. "
            "Every chunk's CRC32 is checked as it is read, the copy appears at DST only when complete, and it is then "
            "re-read and compared with SRC (metadata and every chunk)."
        ),
    )
    p.add_argument("src", help="source store: path or URL")
    p.add_argument("dst", help="destination store: path, s3://bucket/key.b2nd or gs://...")
    p.add_argument(
        "--storage-options",
        type=storage_options_arg,
        metavar="JSON",
        help="options for SRC (and DST when both are URLs)",
    )
    p.add_argument(
        "--dst-storage-options",
        type=storage_options_arg,
        metavar="JSON",
        help="options for DST when they differ from SRC's",
    )
    p.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip re-reading the published copy")
    p.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="while another writer holds a local DST, wait up to SECONDS (default: fail at once)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_copy)


if __name__ == "__main__":  # pragma: no cover
    from carraystore.cli import main

    sys.exit(main())
