"""Stores back into image files: ``carraystore export`` (one file per image) and ``preview`` (a contact sheet)."""

from __future__ import annotations

import contextlib
import functools
import os
import stat
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from carraystore.base.errors import InvalidInputError

__all__ = [
    "MAX_PREVIEW_CELL",
    "MAX_PREVIEW_PIXELS",
    "write_file_safely",
    "check_sheet_size",
    "make_contact_sheet",
    "check_preview_output",
    "export_images",
]


def write_file_safely(target: Path, save: Callable[[BinaryIO], None]) -> None:
    """Write ``target`` through ``save(file)`` and a temporary file beside it, then rename it into place.

    The temporary file is created exclusively (``O_EXCL``, ``O_NOFOLLOW``), never through a
    planted link; a failed write raises a named error and leaves no temporary file."""
    from carraystore.base.atomic import named_write_errors, temp_path

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


# -- preview ----------------------------------------------------------------------------------


#: Bounds of a contact sheet: tile size (pixels), and the whole sheet (pixels, about 3 bytes each).
MAX_PREVIEW_CELL = 1024
MAX_PREVIEW_PIXELS = 64_000_000


def check_sheet_size(n: int, cols: int, cell: int, nimages: int | None = None, text_h: int = 14) -> None:
    """Refuse a contact sheet that is empty or too large (pixels counted when ``nimages`` is known)."""
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
    store: Any,
    n: int = 32,
    cols: int = 8,
    seed: int | None = 0,
    cell: int = 128,
    keys: bool = False,
    caption: str | None = None,
) -> Any:
    """A PIL image: ``n`` images of the store (random when ``seed`` is not None) with their labels.

    ``caption``: a field printed after the label; ``keys=True`` also prints each key.
    InvalidInputError for sizes below 1 or beyond ``MAX_PREVIEW_CELL`` / ``MAX_PREVIEW_PIXELS``."""
    from PIL import Image, ImageDraw

    if caption is not None and caption not in store.columns:
        raise InvalidInputError(
            f"{store.path}: no field {caption!r} to caption with; the store's fields are {sorted(store.columns)}"
        )
    line_h = 12
    text_h = 2 + line_h * (2 if keys and store.keys is not None else 1)
    check_sheet_size(n, cols, cell, len(store), text_h)
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
    for j, (i, img) in enumerate(zip(idx, images, strict=True)):
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
        if caption is not None:
            label += f" {caption}={_caption_value(store.columns[caption][int(i)])}"
        chars = max(8, cell // 6)
        draw.text((x + 2, y + cell), label[:chars], fill="black")
        if keys and store.keys is not None:
            key = store.keys[int(i)]
            draw.text(
                (x + 2, y + cell + line_h), key if len(key) <= chars else "..." + key[-(chars - 3) :], fill="black"
            )
    return sheet


def _caption_value(v: Any) -> str:
    a = np.asarray(v)
    if a.ndim == 0:
        return f"{a.item():.4g}" if a.dtype.kind == "f" else str(a.item())
    flat = a.reshape(-1)
    parts = [f"{x:.3g}" if a.dtype.kind == "f" else str(x) for x in flat[:4].tolist()]
    return "[" + ",".join(parts) + (",...]" if flat.size > 4 else "]")


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def check_preview_output(out: Path, store_path: Path) -> None:
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


# -- export -----------------------------------------------------------------------------------


def export_images(
    store: Any,
    outdir: str | os.PathLike[str],
    fmt: str = "png",
    quality: int = 95,
    overwrite: bool = False,
    original: bool | None = None,
) -> int:
    """Write every image as a file under ``outdir`` (keys as relative paths); returns the count.

    ``original`` (default for layout "encoded"): each stored entry byte for byte (raw
    pixels as PNG). Refuses keys landing outside ``outdir`` (absolute, ``..``, links) and an
    ``outdir`` that is not a folder. Files go through :func:`write_file_safely`."""
    from PIL import Image

    from carraystore.format.encoded import sniff

    if original is None:
        original = store.layout == "encoded"
    if original and store.layout != "encoded":
        raise InvalidInputError(f"{store.path}: only stores of layout 'encoded' keep original files; choose a format")
    if store.layout not in ("NHWC", "encoded") or store.dtype != np.uint8:
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
    entries: list[str] | None = None  # encoded stores: each entry's file suffix
    if original:
        assert store.meta.entry_sizes is not None
        nb = store.meta.image_nbytes
        exts = {"jpeg": ".jpg", "png": ".png", "webp": ".webp", "raw": ".png"}
        formats = [sniff(e, nb) for c in range(store.nchunks) for e in store.chunk_entries(c)]  # a first pass
        entries = [exts[f] for f in formats]
    names: list[Path] = []
    for i in range(len(store)):
        if store.keys is not None:
            key = store.keys[i]
            if "\\" in key and os.sep == "\\":
                raise InvalidInputError(
                    f"{store.path}: key {key!r} (item {i}) holds a backslash, which is part of the file name in a store "
                    "but a folder separator here; export it on a POSIX system"
                )
            rel = Path(key) if entries is not None and Path(key).suffix.lower() in _SUFFIXES[formats[i]] else (
                Path(key).with_suffix(entries[i] if entries is not None else ext)
            )  # fmt: skip
        else:
            lab = int(store.labels[i]) if store.labels is not None else None
            sub = (
                (store.class_names[lab] if store.class_names and lab is not None else str(lab))
                if lab is not None
                else ""
            )
            if "\x00" in sub:
                raise InvalidInputError(
                    f"{store.path}: class name {sub!r} (item {i}) holds a NUL byte and cannot be a folder name; "
                    "rename the class with `carraystore meta STORE --class-names ...`, then export again"
                )
            rel = Path(sub) / f"{i:08d}{entries[i] if entries is not None else ext}"
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
    if entries is not None:
        for c in range(store.nchunks):
            start, _ = store.chunk_range(c)
            for j, entry in enumerate(store.chunk_entries(c)):
                target = names[start + j]
                target.parent.mkdir(parents=True, exist_ok=True)
                if len(entry) == store.meta.image_nbytes:  # raw pixels: as a PNG
                    img = np.frombuffer(entry, dtype=np.uint8).reshape(store.image_shape)
                    pil = Image.fromarray(img[..., 0] if img.shape[2] == 1 else img)
                    write_file_safely(target, functools.partial(pil.save, format="PNG"))
                else:
                    write_file_safely(target, functools.partial(_write_bytes, entry))
                count += 1
        return count
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


_SUFFIXES = {"jpeg": (".jpg", ".jpeg", ".jpe", ".jfif"), "png": (".png",), "webp": (".webp",), "raw": (".png",)}


def _write_bytes(data: bytes, f: BinaryIO) -> None:
    f.write(data)
