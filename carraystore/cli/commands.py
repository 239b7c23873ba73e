"""CLI sub-commands for the store itself: ingest, info, meta, verify, preview, export, copy (handlers only)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from carraystore.base.errors import CarrayStoreError, InvalidInputError, MissingDependencyError, NotAStoreError
from carraystore.cli.summary import class_counts_text, describe_non_store, info_rows, store_info
from carraystore.store.export import (
    check_preview_output,
    check_sheet_size,
    export_images,
    make_contact_sheet,
    write_file_safely,
)
from carraystore.store.options import WriteOptions, json_object_arg

__all__ = [
    "register",
]


def open_for_cli(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> Any:
    """``open_store``, but a file that is something else (an image, HDF5, npz, bcolz) is named as such."""
    from carraystore.store.reader import open_store

    try:
        return open_store(path, storage_options)
    except CarrayStoreError as exc:
        what = describe_non_store(path)
        if what is not None:
            raise NotAStoreError(what) from exc
        raise


def add_read_arguments(p: argparse.ArgumentParser) -> None:
    """--storage-options for commands that read a store that may be a URL."""
    p.add_argument(
        "--storage-options",
        type=json_object_arg,
        metavar="JSON",
        help="options for an s3://, gs:// or http(s):// store, as pandas/zarr take them (the AWS_* environment works too)",
    )


#: ``carraystore ingest`` flags passed to ``from_directory`` as they are
_INGEST_FLAGS = (
    "targets", "interpolation", "color_mode", "dtype", "layout", "quality", "keep_order", "seed", "split_dirs",
    "allow_split_names", "validation_split", "subset", "follow_links", "on_error", "max_skipped", "append",
    "skip_existing", "workers",
)  # fmt: skip


def _cmd_ingest(args: argparse.Namespace) -> int:
    from carraystore.ingest.run import from_directory

    options: dict[str, Any] = {name: getattr(args, name) for name in _INGEST_FLAGS}
    options.update(
        labels="inferred" if args.labels == "inferred" else None,
        image_size=tuple(args.image_size) if args.image_size else None,
        crop_to_aspect_ratio=args.crop_to_aspect_ratio or None,
        # codec, chunk size, class names, attrs, overwrite, lock timeout, storage options, staging folder: one value
        options=WriteOptions.from_args(args, progress=not args.quiet),
    )
    with _dask_client(args) as client:
        result = from_directory(args.src, args.out, client=client, **options)
    results = result if isinstance(result, dict) else {"": result}
    for r in results.values():
        print(r.summary())
    return 0


def _dask_client(args: argparse.Namespace) -> Any:
    """``ingest --dask-scheduler ADDRESS``: a client of that cluster (a context manager); else none."""
    if not args.dask_scheduler:
        return contextlib.nullcontext()
    try:
        from distributed import Client
    except ImportError as exc:
        raise MissingDependencyError(
            "--dask-scheduler needs dask.distributed: pip install 'carraystore[dask]'"
        ) from exc
    connect: Callable[..., Any] = Client  # distributed.Client.__init__ carries no annotations
    try:
        return connect(args.dask_scheduler, timeout=args.dask_timeout)
    except (OSError, TimeoutError) as exc:
        raise InvalidInputError(
            f"cannot reach the dask scheduler at {args.dask_scheduler} ({exc}); start one (`dask scheduler`) "
            "or check the address (e.g. tcp://10.0.0.5:8786)"
        ) from exc


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


def _cmd_info(args: argparse.Namespace) -> int:
    """Describe every store given (one that cannot be opened: an error line, exit 2); --json: an object or a list."""
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
            rows = info_rows(store, info)
            for k, v in rows:
                print(f"{k:<12} {v}")
            if len(args.stores) > 1:
                print()
    if args.json and documents:
        print(json.dumps(documents[0] if len(args.stores) == 1 else documents, indent=2))
    return status


def _cmd_meta(args: argparse.Namespace) -> int:
    from carraystore.store.metadata import update_metadata

    path, names, attrs = Path(args.store), args.class_names, dict(args.attrs or ())
    if names is not None or attrs or args.remove_attr:
        update_metadata(
            path, class_names=names, attrs=attrs or None, remove_attrs=args.remove_attr, lock_timeout=args.lock_timeout
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
        print(f"{'labels':<12} " + class_counts_text(info["label_counts"], head=False))
    else:
        print(f"{'labels':<12} {'yes' if info['labelled'] else 'none'}")
    print(f"{'attrs':<12} {json.dumps(info['attrs'])}")
    if info["provenance"]:
        print(f"{'provenance':<12} {json.dumps(info['provenance'])}")
    return 0


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


def _cmd_preview(args: argparse.Namespace) -> int:
    check_sheet_size(args.n, args.cols, args.cell)
    out = Path(args.out)
    if not out.parent.is_dir():
        raise InvalidInputError(
            f"{out}: folder {out.parent} does not exist; create it first or write the preview elsewhere"
        )
    check_preview_output(out, Path(args.store))
    with open_for_cli(args.store, args.storage_options) as store:
        sheet = make_contact_sheet(
            store,
            n=args.n,
            cols=args.cols,
            seed=None if args.first else args.seed,
            cell=args.cell,
            keys=args.keys,
            caption=args.caption,
        )
    check_preview_output(out, Path(args.store))
    write_file_safely(out, functools.partial(sheet.save, format="PNG"))
    print(f"wrote {out} ({sheet.width}x{sheet.height})")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    with open_for_cli(args.store, args.storage_options) as store:
        n = export_images(
            store, args.outdir, fmt=args.format or "png", quality=args.quality, overwrite=args.overwrite,
            original=None if args.format is None else False,
        )  # fmt: skip
    print(f"wrote {n} images under {args.outdir}")
    return 0


def _cmd_copy(args: argparse.Namespace) -> int:
    from carraystore.store.transfer import copy_store

    # --storage-options is SRC's here; the written store's is --dst-storage-options
    options = WriteOptions.from_args(args, storage_options=args.dst_storage_options)
    result = copy_store(args.src, args.dst, storage_options=args.storage_options, verify=args.verify, options=options)
    print(result.summary())
    return 0


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
    p.add_argument(
        "--targets",
        metavar="FILE",
        help=(
            "per-file fields (regression targets, boxes, weights): a CSV with a header, or JSON lines, keyed by the "
            "path relative to SRC in a column 'file', 'path' or 'filename'; a column 'group' names each file's group (a session, "
            "a video); every other column becomes a field (docs/targets.md). Every image file needs a row and every "
            "row a file"
        ),
    )
    p.add_argument(
        "--image-size",
        nargs=2,
        type=int,
        metavar=("H", "W"),
        help="resize every image (default: keep size; all must agree)",
    )
    from carraystore.ingest.images import INTERPOLATIONS

    p.add_argument(
        "--interpolation",
        choices=sorted(INTERPOLATIONS),
        default=None,
        help="resampling filter of --image-size (default bilinear; with --append, the store's)",
    )
    p.add_argument(
        "--color-mode",
        choices=["grayscale", "rgb", "rgba"],
        default=None,
        help="channels of the stored images (default rgb; with --append, the store's)",
    )
    p.add_argument(
        "--dtype",
        choices=["uint8", "uint16"],
        default=None,
        help=(
            "pixel type: uint8 (the default; 16-bit files keep their high byte) or uint16 (16-bit grayscale PNGs "
            "kept exactly, 8-bit files scaled by 257, 16-bit colour PNGs refused); with --append, the store's"
        ),
    )
    p.add_argument(
        "--crop-to-aspect-ratio", action="store_true", help="centre-crop to the target aspect ratio before resizing"
    )
    p.add_argument(
        "--keep-order",
        action="store_true",
        help="keep file order (video frames: natural order, frame_2 before frame_10) instead of a seeded shuffle",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the write order and of --validation-split (default 0)")
    p.add_argument(
        "--validation-split",
        type=float,
        metavar="F",
        help="keep a fraction F of the files apart for validation, the same files as Keras picks with the same "
        "--seed; with groups (class/video/frame folders) whole groups, never a part of one",
    )
    p.add_argument(
        "--subset",
        choices=["training", "validation", "both"],
        help="with --validation-split: write the training part, the validation part, or both (OUT is then a "
        "folder receiving training.b2nd and validation.b2nd)",
    )
    p.add_argument("--workers", type=int, default=None, help="decoding threads (default: all cores)")
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
    p.add_argument(
        "--append",
        action="store_true",
        help="add SRC's images to the existing store OUT (in place, crash-safe, locked): decode options from the "
        "store, new classes after its own, files already in it refused",
    )
    p.add_argument(
        "--skip-existing", action="store_true", help="with --append: leave out files whose key is already in the store"
    )
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
    p.add_argument(
        "--layout",
        choices=["pixels", "encoded"],
        default=None,
        help="pixels (default; with --append: the store's own): decoded pixels; encoded: each image as its "
        "JPEG/PNG/WebP bytes (FORMAT.md 10)",
    )
    p.add_argument(
        "--quality",
        type=int,
        default=None,
        help="--layout encoded: encode every image as JPEG at this quality (default: keep files, else PNG)",
    )
    # the write options: every flag of carraystore.WriteOptions, as migrate, copy and meta have them
    WriteOptions.add_arguments(
        p,
        helps={
            "overwrite": "replace an existing output store",
            "class_names": "comma-separated class folders to use, in label order (label 0 first)",
        },
    )
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
    p.add_argument("--remove-attr", action="append", default=[], metavar="KEY", help="delete an attr (repeatable)")
    WriteOptions.add_arguments(
        p,
        ("class_names", "attrs", "lock_timeout"),
        helps={
            "lock_timeout": "while another writer holds the store, wait up to SECONDS (default: fail at once); "
            "--wait is the same flag"
        },
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
    p.add_argument("--caption", metavar="FIELD", help="print a field's value (e.g. a steering angle) under each tile")
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
    p.add_argument(
        "--format",
        choices=["png", "jpeg"],
        default=None,
        help="file format (default png, lossless; an encoded store's images are written as stored, byte for byte)",
    )
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
        type=json_object_arg,
        metavar="JSON",
        help="options for SRC (and DST when both are URLs)",
    )
    p.add_argument(
        "--dst-storage-options",
        type=json_object_arg,
        metavar="JSON",
        help="options for DST when they differ from SRC's",
    )
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip re-reading the published copy")
    WriteOptions.add_arguments(
        p, ("overwrite", "lock_timeout", "progress"), helps={"overwrite": "replace DST if it exists"}
    )
    p.set_defaults(func=_cmd_copy)

    p = sub.add_parser(
        "convert",
        help="rewrite a store in the other pixel layout (pixels <-> encoded) or with another codec (verified)",
        description=(
            "Write SRC as DST in --layout pixels or encoded (FORMAT.md 10), chunk by chunk. pixels -> encoded encodes "
            "each image once as PNG (lossless) unless --quality asks for JPEG; encoded -> encoded keeps every entry. "
            "DST is compared with SRC (the same pixels when lossless) before it appears."
        ),
    )
    p.add_argument("src", help="the source store (a local .b2nd path)")
    p.add_argument("dst", help="the new store (a local .b2nd path)")
    p.add_argument("--layout", choices=["pixels", "encoded"], required=True, help="the layout of DST")
    p.add_argument("--quality", type=int, default=None, help="encoded: JPEG at this quality (1-100) instead of PNG")
    p.add_argument("--no-verify", dest="verify", action="store_false", help="skip comparing DST with SRC")
    WriteOptions.add_arguments(
        p, ("codec", "chunk_images", "overwrite", "lock_timeout"), helps={"overwrite": "replace DST if it exists"}
    )
    p.set_defaults(func=_cmd_convert)


def _cmd_convert(args: argparse.Namespace) -> int:
    from carraystore.store.convert import convert_store

    w = WriteOptions.from_args(args)
    r = convert_store(
        args.src,
        args.dst,
        args.layout,
        quality=args.quality,
        codec=w.codec,
        chunk_images=w.chunk_images,
        overwrite=w.overwrite,
        verify=args.verify,
        lock_timeout=w.lock_timeout,
    )
    kind = "verified pixel for pixel" if r.lossless and args.verify else ("lossy" if not r.lossless else "not verified")
    print(
        f"{r.path}: {r.nimages} images, layout {r.layout}, {r.src_bytes} -> {r.dst_bytes} bytes "
        f"({r.dst_bytes / max(1, r.nimages):.0f} per image; {kind})"
    )
    return 0


if __name__ == "__main__":  # pragma: no cover
    from carraystore.cli.main import main

    sys.exit(main())
