"""Image files: the one lister (:func:`image_files`, :func:`list_images`) and the one decoder (:func:`decode_image`)."""

from __future__ import annotations

import dataclasses
import io
import os
import stat
import unicodedata
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
from PIL import Image, UnidentifiedImageError

from carraystore.base.errors import ImageDecodeError, IngestError, InvalidInputError
from carraystore.store.items import check_class_names

__all__ = [
    "DecodeKwargs",
    "DECODE_OPTION_FIELDS",
    "IMAGE_EXTENSIONS",
    "INTERPOLATIONS",
    "MODES",
    "INGEST_DTYPES",
    "DEPTH_RULE",
    "DecodeOptions",
    "shown_name",
    "image_files",
    "list_images",
    "decode_image",
    "decode_bytes",
    "decode_stream",
    "decode_files",
]

#: The one list: ingest, ``carraystore bench`` and bench/ all find images with :func:`image_files`.
IMAGE_EXTENSIONS = (".jpeg", ".jpg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")

#: Keras interpolation names that Pillow can do, and Pillow's filter for each.
INTERPOLATIONS = {
    "bilinear": Image.Resampling.BILINEAR,
    "nearest": Image.Resampling.NEAREST,
    "bicubic": Image.Resampling.BICUBIC,
    "area": Image.Resampling.BOX,
    "lanczos3": Image.Resampling.LANCZOS,
    "hamming": Image.Resampling.HAMMING,
}
#: Colour modes: the Pillow mode and the number of channels of each.
MODES = {"grayscale": ("L", 1), "rgb": ("RGB", 3), "rgba": ("RGBA", 4)}
#: Pixel types of an ingested store: 8-bit (the default, as Keras) or 16-bit.
INGEST_DTYPES = ("uint8", "uint16")
#: Pillow modes of 16-bit grayscale images (the only 16-bit PNGs Pillow decodes at full depth).
_DEEP_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "I")
#: How each store dtype treats files of the other bit depth (recorded in the provenance).
DEPTH_RULE = {
    "uint8": "16-bit files reduced to 8 bits by their high byte (value >> 8), as Pillow and tf.image decode them",
    "uint16": "8-bit files scaled to 16 bits (value * 257); 16-bit colour PNGs are refused (Pillow decodes them to 8 bits)",
}


@dataclass(frozen=True)
class DecodeOptions:
    """How each file becomes an array, checked once here (picklable: sent to cluster workers)."""

    color_mode: str = "rgb"
    #: (height, width) to resize to, or None: the file's own size
    image_size: tuple[int, int] | None = None
    interpolation: str = "bilinear"
    crop_to_aspect_ratio: bool = False
    dtype: str = "uint8"

    def __post_init__(self) -> None:
        if self.color_mode not in MODES:
            raise InvalidInputError(f"color_mode must be one of {sorted(MODES)}, got {self.color_mode!r}")
        if self.interpolation not in INTERPOLATIONS:
            raise InvalidInputError(
                f"interpolation {self.interpolation!r} is not available; choose one of {sorted(INTERPOLATIONS)} "
                "(Keras' gaussian, lanczos5 and mitchellcubic have no Pillow equivalent)"
            )
        if self.image_size is not None:
            size = tuple(int(x) for x in self.image_size)
            if len(size) != 2 or min(size) < 1:
                raise InvalidInputError(f"image_size must be (height, width), got {self.image_size!r}")
            object.__setattr__(self, "image_size", size)
        if self.dtype not in INGEST_DTYPES:
            raise InvalidInputError(f"dtype must be one of {INGEST_DTYPES}, got {self.dtype!r}")
        object.__setattr__(self, "crop_to_aspect_ratio", bool(self.crop_to_aspect_ratio))


class DecodeKwargs(TypedDict, total=False):
    """:class:`DecodeOptions`' fields as keywords (None: the default, or the store's own on an append); a test keeps them equal."""

    color_mode: str | None
    image_size: tuple[int, int] | None
    interpolation: str | None
    crop_to_aspect_ratio: bool | None
    dtype: str | None


#: the names of the decode options (the fields of DecodeOptions)
DECODE_OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(DecodeOptions))


# -- listing ---------------------------------------------------------------------------------


def shown_name(name: str) -> str:
    """A file name as text that can be printed and stored: undecodable bytes as ``\\xNN``, control characters escaped."""
    text = os.fsencode(name).decode("utf-8", "backslashreplace")
    return "".join(repr(c)[1:-1] if unicodedata.category(c) == "Cc" else c for c in text)


def _walk_images(root: Path, follow_links: bool) -> tuple[list[Path], list[Path]]:
    """All image files under ``root`` (sorted, files before sub-folders) and the ignored others, with reasons."""
    images: list[Path] = []
    other: list[Path] = []
    seen: set[tuple[int, int]] = set()

    def walk(folder: Path) -> None:
        try:
            st = os.stat(folder)
            if (st.st_dev, st.st_ino) in seen:
                link = f"link to {os.readlink(folder)}, " if folder.is_symlink() else ""
                other.append(Path(f"{folder}/ ({link}a folder already listed: not entered again)"))
                return
            seen.add((st.st_dev, st.st_ino))
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError as exc:
            other.append(Path(f"{folder}/ (cannot be listed: {exc.strerror})"))
            return
        subdirs: list[Path] = []
        for e in entries:
            p = Path(e.path)
            try:
                is_dir = e.is_dir()
            except OSError:
                is_dir = False
            if not is_dir:
                (images if p.suffix.lower() in IMAGE_EXTENSIONS else other).append(p)
            elif not e.is_symlink() or follow_links:
                subdirs.append(p)
            else:
                other.append(
                    Path(f"{p}/ (a link to a folder: not followed; pass follow_links=True, CLI --follow-links)")
                )
        for d in subdirs:
            walk(d)

    walk(root)
    return images, other


def image_files(root: str | os.PathLike[str], follow_links: bool = False) -> list[Path]:
    """Every image file under ``root`` (any depth), in sorted path order."""
    return _walk_images(Path(root), follow_links)[0]


def list_images(
    directory: str | os.PathLike[str],
    labels: str | Sequence[int] | None = "inferred",
    class_names: Sequence[str] | None = None,
    follow_links: bool = False,
) -> tuple[list[str], np.ndarray | None, tuple[str, ...] | None, list[str]]:
    """Index a folder as Keras does: (relative paths, labels or None, class names, ignored files)."""
    root = Path(directory)
    if not root.is_dir():
        raise IngestError(f"{root}: not a folder of images")
    class_names = check_class_names(class_names, str(root))
    ignored: list[str] = []
    if labels == "inferred":
        subdirs = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
        if class_names is not None:
            missing = [c for c in class_names if c not in subdirs]
            if missing:
                raise IngestError(
                    f"{root}: class_names {list(class_names)} name folders that do not exist: {missing}; "
                    f"the sub-folders are {subdirs}"
                )
            names = tuple(class_names)
        else:
            names = tuple(subdirs)
        if not names:
            raise IngestError(
                f"{root}: no class sub-folders found; pass labels=None (CLI: --labels none) for an unlabelled folder"
            )
        for cls in names:
            if os.fsencode(cls).decode("utf-8", "replace") != cls:
                raise IngestError(
                    f"{root / shown_name(cls)}: a class folder's name must be valid UTF-8 (it becomes a class name); "
                    "rename the folder, or leave it out with class_names (CLI: --class-names)"
                )
        rels: list[str] = []
        labs: list[int] = []
        for i, cls in enumerate(names):
            files, other = _walk_images(root / cls, follow_links)
            rels.extend(p.relative_to(root).as_posix() for p in files)
            labs.extend([i] * len(files))
            ignored.extend(p.relative_to(root).as_posix() for p in other)
        ignored.extend(p.name for p in root.iterdir() if p.is_file())
        unlisted = sorted(set(subdirs) - set(names))
        ignored.extend(f"{d}/" for d in unlisted)
        return rels, np.asarray(labs, dtype=np.int64), names, ignored
    files, other = _walk_images(root, follow_links)
    rels = [p.relative_to(root).as_posix() for p in files]
    ignored.extend(p.relative_to(root).as_posix() for p in other)
    if labels is None:
        return rels, None, tuple(class_names) if class_names is not None else None, ignored
    if isinstance(labels, str):
        raise InvalidInputError(f"labels must be 'inferred', None or a list of integers, got {labels!r}")
    lab = np.asarray(labels, dtype=np.int64)
    if lab.shape != (len(rels),):
        raise IngestError(
            f"{root}: {len(lab)} labels given for {len(rels)} image files (labels follow the sorted file paths, as in Keras)"
        )
    return rels, lab, tuple(class_names) if class_names is not None else None, ignored


# -- decoding --------------------------------------------------------------------------------


def _crop_box(w: int, h: int, target_h: int, target_w: int) -> tuple[int, int, int, int]:
    """The largest centred window of the target aspect ratio (as Keras' crop_to_aspect_ratio)."""
    crop_h = min(h, int(round(w * target_h / target_w)))
    crop_w = min(w, int(round(h * target_w / target_h)))
    x = (w - crop_w) // 2
    y = (h - crop_h) // 2
    return x, y, x + crop_w, y + crop_h


def _open_regular_file(path: str | os.PathLike[str]) -> Any:
    """Open ``path`` for reading, refusing anything but a regular file (a FIFO would block forever)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ImageDecodeError(f"{path}: not a regular file (a FIFO, socket or device); only image files are read")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError as exc:
        raise ImageDecodeError(f"{path}: file not found") from exc
    except OSError as exc:
        raise ImageDecodeError(f"{path}: cannot be read ({exc.strerror})") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced after the check above
        os.close(fd)
        raise ImageDecodeError(f"{path}: not a regular file (a FIFO, socket or device); only image files are read")
    return os.fdopen(fd, "rb")


def _png_bit_depth(f: Any) -> int | None:
    """The bit depth of a PNG's colour channels from its IHDR chunk, or None for other files."""
    f.seek(0)
    head = f.read(26)
    f.seek(0)
    if len(head) == 26 and head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR":
        return int(head[24])
    return None


def _resized(img: Any, opts: DecodeOptions) -> Any:
    if opts.image_size is None:
        return img
    h, w = opts.image_size
    box = _crop_box(img.width, img.height, h, w) if opts.crop_to_aspect_ratio else None
    if (img.height, img.width) != (h, w) or box is not None:
        img = img.resize((w, h), resample=INTERPOLATIONS[opts.interpolation], box=box)
    return img


def _pixels16(img: Any, opts: DecodeOptions, channels: int) -> np.ndarray:
    """A 16-bit grayscale image as (H, W, C) uint16 at full depth (resized in float32 when asked)."""
    gray = np.asarray(img).astype(np.float32)
    if opts.image_size is not None:
        gray = np.asarray(_resized(Image.fromarray(gray, "F"), opts))
    gray = np.clip(np.rint(gray), 0, 65535).astype(np.uint16)
    planes = [gray] * min(channels, 3) + ([np.full_like(gray, 65535)] if channels == 4 else [])
    return np.stack(planes, axis=-1)


def decode_image(path: str | os.PathLike[str], opts: DecodeOptions = DecodeOptions()) -> np.ndarray:
    """Decode one file into an (H, W, C) array of ``opts.dtype``; raise ImageDecodeError naming the file.

    Bit depth is converted, never clipped: into uint8, 16-bit grayscale keeps its high byte;
    into uint16, 16-bit grayscale keeps every bit, 8-bit images are scaled by 257 and 16-bit
    colour PNGs are refused (Pillow decodes those to 8 bits only).
    """
    with _open_regular_file(path) as f:
        return decode_stream(f, str(path), opts)


def decode_bytes(
    data: bytes, where: str, opts: DecodeOptions = DecodeOptions(), formats: Sequence[str] | None = None
) -> np.ndarray:
    """:func:`decode_image` of an encoded file held in memory (a tar member, a record); ``where`` names it in errors.
    ``formats``: the Pillow format names accepted (None: any Pillow identifies)."""
    return decode_stream(io.BytesIO(data), where, opts, formats)


def decode_stream(
    f: Any, where: str, opts: DecodeOptions = DecodeOptions(), formats: Sequence[str] | None = None
) -> np.ndarray:
    """:func:`decode_image` of an open binary file ``f`` (seekable); ``where`` names it in errors."""
    mode, channels = MODES[opts.color_mode]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            depth = _png_bit_depth(f)
            with Image.open(f, formats=None if formats is None else list(formats)) as img:
                img.load()
                deep = img.mode in _DEEP_MODES
                if opts.dtype == "uint16" and deep:
                    return _pixels16(img, opts, channels)
                if opts.dtype == "uint16" and depth == 16:
                    raise ImageDecodeError(
                        f"{where}: a 16-bit colour PNG, which Pillow decodes to 8 bits only; a uint16 store cannot hold "
                        "its full depth. Ingest it with dtype='uint8' (CLI: --dtype uint8), or convert it to 16-bit grayscale"
                    )
                if deep:  # 16 bits -> 8: the high byte, never a clip at 255
                    img = Image.fromarray((np.asarray(img).astype(np.uint32) >> 8).clip(0, 255).astype(np.uint8), "L")
                arr = np.asarray(_resized(img.convert(mode), opts), dtype=np.uint8)
                if opts.dtype == "uint16":
                    arr = arr.astype(np.uint16) * np.uint16(257)
    except ImageDecodeError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageDecodeError(f"{where}: refused as a decompression bomb ({exc})") from exc
    except FileNotFoundError as exc:
        raise ImageDecodeError(f"{where}: file not found") from exc
    except Exception as exc:  # PIL raises many types for bad data
        reason = str(exc) or type(exc).__name__
        if isinstance(exc, UnidentifiedImageError):  # its text names the file object, whose fd number varies
            reason = "not an image format Pillow can identify"
        if _stream_size(f) == 0:
            reason = "empty file"
        raise ImageDecodeError(f"{where}: cannot decode ({reason})") from exc
    if arr.ndim == 2:
        arr = arr[..., None]
    if arr.shape[2] != channels:  # pragma: no cover - Pillow's convert guarantees it
        raise ImageDecodeError(f"{where}: decoded to {arr.shape[2]} channels, expected {channels}")
    return arr


def _stream_size(f: Any) -> int | None:
    """The size of an open file, or None when it cannot be told."""
    try:
        return int(f.seek(0, io.SEEK_END))
    except (OSError, ValueError):
        return None


def decode_files(root: str, rels: list[str], opts: DecodeOptions) -> list[tuple[np.ndarray | None, str | None]]:
    """Decode the files ``rels``: (array, None) or (None, reason) for each, never raising."""
    out: list[tuple[np.ndarray | None, str | None]] = []
    for rel in rels:
        try:
            out.append((decode_image(os.path.join(root, rel), opts), None))
        except ImageDecodeError as exc:
            msg = str(exc)
            prefix = f"{os.path.join(root, rel)}: "
            out.append((None, msg[len(prefix) :] if msg.startswith(prefix) else msg))
    return out
