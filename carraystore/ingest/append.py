"""Appending a folder to a store: the plan, made under the store's writer lock from the store itself.

The decode options are the store's (a differing one is refused by name); new classes go after
the store's own; a store written in order stays in order.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.base.errors import IngestError, InvalidInputError
from carraystore.format.encoded import Encoding
from carraystore.ingest.badfiles import allowed_skips
from carraystore.ingest.images import INGEST_DTYPES, DecodeOptions, list_images
from carraystore.ingest.manifest import FieldTable, read_manifest
from carraystore.ingest.plan import (
    Groups,
    StorePlan,
    check_group_column,
    float_labels,
    frame_like,
    infer_groups,
    plan_store,
    target_field,
)
from carraystore.store.options import WriteOptions
from carraystore.store.reader import is_url
from carraystore.store.writer import StoreWriter
from carraystore.store.writer import append as open_append

__all__ = ["plan_append", "check_append_args"]


def plan_append(
    directory: str | os.PathLike[str],
    output: str | os.PathLike[str],
    write: WriteOptions,
    decode: dict[str, Any],
    *,
    labels: Any,
    targets: str | os.PathLike[str] | None,
    layout: str | None,
    quality: int | None,
    groups: Groups,
    skip_existing: bool,
    shuffle: bool,
    seed: int,
    follow_links: bool,
    on_error: str,
    max_skipped: float | int,
) -> tuple[StorePlan, StoreWriter, DecodeOptions]:
    """``append=True``: the plan (no files: nothing new), the store's locked writer, the decode options."""
    root = Path(directory)
    allowed_skips(max_skipped, 1)
    out = str(output) if is_url(output) else Path(output)
    target_values = float_labels(labels)
    int_labels = None if target_values is not None else labels
    table = read_manifest(targets) if targets is not None else None
    check_group_column(table, groups, targets)
    rels, labs, names, ignored = list_images(root, int_labels, write.class_names, follow_links)
    fields = target_field(root, rels, target_values)
    writer = open_append(out, nthreads=1, options=write.replace(class_names=None, progress=False))
    try:
        meta = writer.meta
        opts = _store_decode_options(meta, str(out), **decode)
        _check_layout(meta, str(out), layout, quality)
        prefix = _folder_prefix(meta, root, rels, groups, table)
        if prefix:  # the folder is one session of the store's: keyed as if ingested with the others
            rels = [prefix + r for r in rels]
            root = root.parent
            if table is not None:
                table = table.prefixed(prefix)
            if fields is not None:
                fields = fields.prefixed(prefix)
        existing = set(meta.keys or ())
        if table is not None:  # every new file has a row; every row names a file of the folder or the store
            table.check_files([r for r in rels if r not in existing], str(directory), known=existing | set(rels))
        grp: list[str] | None
        if table is not None and table.groups is not None:
            rows = table.group_of() or {}
            grp = [rows.get(r, "") for r in rels]  # a file already in the store is left out below
        elif prefix:
            grp = [prefix.rstrip("/")] * len(rels)
        else:
            grp = infer_groups(rels, int_labels, groups, root)
        rels, labs, grp, notes = _append_plan(
            writer, root, rels, labs, names, grp, not isinstance(groups, str) and groups is not None, skip_existing
        )
        if prefix:
            notes.insert(0, f"the files sit right in {root / prefix.rstrip('/')}: keyed {prefix}<file> and grouped as "
                         f"{prefix.rstrip('/')!r}, as the store's other folders are")  # fmt: skip
        if fields is not None:  # the new files' rows only
            fields = FieldTable(rels, fields.take(rels), fields.source)
        if table is not None:
            part = FieldTable(rels, table.take(rels), table.source)
            fields = part if fields is None else fields.merged(part)
        _check_fields(meta, fields, str(out))
        if not rels:  # nothing new
            return StorePlan(root, out, [], None, meta.class_names, ignored, notes=notes), writer, opts
        plan = plan_store(
            root,
            out,
            rels,
            labs,
            writer.meta.class_names,
            ignored,
            shuffle=shuffle and meta.provenance.get("shuffled") is not False,  # a store written in order stays so
            seed=seed,
            on_error=on_error,
            max_skipped=max_skipped,
            class_folders=isinstance(labels, str) and labels == "inferred",
            groups=grp,
            fields=fields,
            notes=notes,
        )
        return plan, writer, opts
    except BaseException:
        writer.abort()
        raise


def _check_layout(meta: Any, where: str, layout: str | None, quality: int | None) -> None:
    """An append keeps the store's layout and encoding: a different one given is refused by name."""
    own = "encoded" if meta.layout == "encoded" else "pixels"
    if layout is not None and layout != own:
        raise InvalidInputError(
            f"{where}: layout={layout!r}, but the store's layout is {own!r}; an append keeps it: leave layout out "
            f"(CLI: --layout), or convert the store first (carraystore convert --layout {layout})"
        )
    if own == "pixels":
        if quality is not None:
            raise InvalidInputError(f"{where}: quality= applies to stores of layout 'encoded'; this one holds pixels")
        return
    enc: Encoding = meta.encoding
    if quality is not None and quality != enc.quality:
        raise InvalidInputError(
            f"{where}: quality={quality}, but the store encodes at "
            f"{'PNG (lossless)' if enc.quality is None else f'{enc.reencode.upper()} quality {enc.quality}'}; an "
            "append keeps the store's encoding: leave quality out (CLI: --quality)"
        )


def _folder_prefix(meta: Any, root: Path, rels: list[str], groups: Groups, table: Any) -> str:
    """``"session_07/"`` when ``root`` is one more session of a store keyed ``<session>/<file>`` with groups:
    its files (frames, right in it) then take the folder's name as key prefix and group; else ``""``."""
    if not (meta.nimages and meta.group_names is not None and meta.keys is not None):
        return ""
    if not (isinstance(groups, str) and groups == "inferred") or not rels or any("/" in r for r in rels):
        return ""
    if not all(k.count("/") == 1 for k in meta.keys) or not frame_like(rels):
        return ""
    name = root.resolve().name
    return f"{name}/" if name else ""


def _check_fields(meta: Any, fields: FieldTable | None, where: str) -> None:
    """The new files' fields must be the store's (names); refused by name before any decoding."""
    have = sorted(meta.columns)
    given = sorted(fields.fields) if fields is not None else []
    if meta.nimages and have != given:
        raise InvalidInputError(
            f"{where}: the store has the fields {have or 'none'}, the append gives {given or 'none'}; give the new "
            "files the same fields (a targets manifest with those columns, CLI: --targets FILE)"
        )


def check_append_args(
    output: Any, overwrite: bool, split_dirs: bool, subset: str | None, chunk_images: int | None, attrs: Any
) -> None:
    """Arguments that an append cannot take, refused by name."""
    if overwrite:
        raise InvalidInputError(f"{output}: append=True adds to the store and overwrite=True replaces it; choose one")
    if split_dirs or subset is not None:
        raise InvalidInputError(
            f"{output}: append=True adds one folder to one store; leave out split_dirs / validation_split and subset "
            "(append each split's folder to its own store)"
        )
    if chunk_images is not None or attrs is not None:
        raise InvalidInputError(
            f"{output}: an append keeps the store's chunk size and attrs; leave chunk_images and attrs out "
            "(attrs change with update_metadata, CLI: carraystore meta)"
        )


def _store_decode_options(
    meta: Any,
    where: str,
    image_size: tuple[int, int] | None,
    color_mode: str | None,
    interpolation: str | None,
    crop_to_aspect_ratio: bool | None,
    dtype: str | None,
) -> DecodeOptions:
    """An append's decode options: the store's; an option given that differs is refused by name."""
    if meta.layout not in ("NHWC", "encoded") or meta.np_dtype.name not in INGEST_DTYPES:
        raise InvalidInputError(
            f"{where}: the store holds {meta.layout} items of {meta.np_dtype}, not images an ingest writes "
            f"({'/'.join(INGEST_DTYPES)}, height x width x channels); images cannot be appended to it"
        )
    prov = meta.provenance or {}
    h, w = meta.image_shape[:2]
    size = image_size

    def same(name: str, given: Any, stored: Any, cli: str) -> Any:
        if given is not None and stored is not None and given != stored:
            raise InvalidInputError(
                f"{where}: {name}={given!r}, but the store was written with {name}={stored!r}; an append takes "
                f"the store's decode options: leave {name} out (CLI: {cli})"
            )
        return stored if given is None else given

    mode = same("color_mode", color_mode, meta.color_mode, "--color-mode")
    dt = same("dtype", dtype, meta.np_dtype.name, "--dtype")
    if size is not None and tuple(size) != (h, w):
        raise InvalidInputError(
            f"{where}: image_size={tuple(size)}, but the store holds {h}x{w} images; an append resizes to the "
            f"store's size: leave image_size out (CLI: --image-size) or pass ({h}, {w})"
        )
    from_folder = prov.get("source_kind") == "image_folder"
    if size is None and not (from_folder and prov.get("image_size") is None):
        size = (h, w)  # the store was resized (or is not from a folder): resize to its size
    interp = same("interpolation", interpolation, prov.get("interpolation") if from_folder else None, "--interpolation")
    crop = same(
        "crop_to_aspect_ratio",
        crop_to_aspect_ratio,
        prov.get("crop_to_aspect_ratio") if from_folder else None,
        "--crop-to-aspect-ratio",
    )
    return DecodeOptions(mode, size, interp or "bilinear", bool(crop), dt)


def _append_plan(
    writer: StoreWriter,
    root: Path,
    rels: list[str],
    labs: np.ndarray | None,
    names: tuple[str, ...] | None,
    groups: list[str] | None,
    groups_given: bool,
    skip_existing: bool,
) -> tuple[list[str], np.ndarray | None, list[str] | None, list[str]]:
    """An append's files, labels (indexing the store's class list, new classes added at its end) and groups."""
    meta, where = writer.meta, str(writer.path)
    notes: list[str] = []
    if meta.nimages and meta.keys is None:
        raise IngestError(
            f"{where}: the store has no keys; an ingest names every item by its file path, so it cannot append "
            "to this store (append with carraystore.append and keys= of your own)"
        )
    if meta.nimages and (labs is not None) != (meta.labels is not None):
        raise IngestError(
            f"{where}: the store is {'labelled' if meta.labels is not None else 'unlabelled'} and the folder "
            f"{'is' if labs is not None else 'is not'}; pass labels={'None' if labs is not None else repr('inferred')} "
            f"(CLI: --labels {'none' if labs is not None else 'inferred'}) to match the store"
        )
    existing = set(meta.keys) if meta.keys is not None else set()
    dup = [i for i, r in enumerate(rels) if r in existing]
    if dup and not skip_existing:
        raise IngestError(
            f"{where}: {len(dup)} of the {len(rels)} files are already in the store (same key), e.g. "
            f"{', '.join(rels[i] for i in dup[:3])}; pass skip_existing=True (CLI: --skip-existing) to add only "
            "the new files"
        )
    if dup:
        keep = np.setdiff1d(np.arange(len(rels)), dup)
        rels = [rels[i] for i in keep]
        labs = labs[keep] if labs is not None else None
        groups = [groups[i] for i in keep] if groups is not None else None
        notes.append(f"skipped {len(dup)} file(s) already in the store (skip_existing)")
    if labs is not None and names is not None:
        full = writer.extend_class_names(names)
        added = [c for c in full if c not in (meta.class_names or ())]
        if added:
            notes.append(f"new classes added after the store's: {', '.join(added)}")
        index = {c: i for i, c in enumerate(full)}
        labs = np.asarray([index[names[int(v)]] for v in labs], dtype=np.int64)
    if groups is not None and meta.nimages and meta.group_names is None:
        if groups_given:
            raise IngestError(
                f"{where}: the store has no groups (its items were written without them), so groups= cannot be "
                "recorded for the new ones; leave groups out"
            )
        notes.append("the store records no groups, so the new files' group folders are not recorded either")
        groups = None
    if groups is None and meta.group_names is not None and meta.nimages:
        raise IngestError(
            f"{where}: the store records groups (videos, sessions), but {root} has no group folders "
            "(class/group/file) and no groups= were given; pass groups= (one per file) to append"
        )
    return rels, labs, groups, notes
