"""Metadata updates in place: a store's class names and attrs changed without touching a data chunk."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from carraystore.base.atomic import named_write_errors, remove_stale_temps
from carraystore.base.errors import InvalidInputError
from carraystore.base.lock import WriterLock
from carraystore.format.record import StoreMeta, json_attrs
from carraystore.sources.journal import rollback
from carraystore.store.checks import check_header_for_write
from carraystore.store.inplace import _InPlaceWrite, refuse_hard_links
from carraystore.store.reader import check_local_store_path, is_url, open_unguarded

__all__ = ["update_metadata"]


def update_metadata(
    path: str | os.PathLike[str],
    class_names: Sequence[str] | None = None,
    attrs: dict[str, Any] | None = None,
    remove_attrs: Sequence[str] = (),
    *,
    lock_timeout: float | None = 0.0,
) -> StoreMeta:
    """Set a store's class names and/or attrs in place; the pixels are neither read nor rewritten.

    ``attrs`` are merged (``remove_attrs`` deletes keys). Holds the writer lock
    (``lock_timeout``, then :class:`~carraystore.base.errors.StoreLockedError`) and writes under
    the rollback journal, like an append (docs/appends.md). Returns the new metadata.
    """
    if is_url(path):
        raise InvalidInputError(
            f"{path}: metadata is changed in place on local stores only; copy the store here (carraystore copy), "
            "change it, and copy it back"
        )
    p = Path(path)
    check_local_store_path(p)  # a missing path, a folder or a FIFO is named as open names it
    real = Path(os.path.realpath(p))  # the lock and the journal sit beside the real file
    with WriterLock(real, purpose="meta", timeout=lock_timeout):
        rollback(real)  # a write that died half-way is undone first
        remove_stale_temps(p)
        refuse_hard_links(real)
        store = open_unguarded(real)
        meta, frame = store.meta, store._frame
        store.close()
        check_header_for_write(frame, meta, real)
        new = _updated_meta(p, meta, class_names, attrs, remove_attrs)
        inplace = _InPlaceWrite(real, frame, meta.nimages)
        try:
            with named_write_errors(real, "the metadata"):
                inplace.commit(new)
        except BaseException:
            inplace.abort()
            raise
    return new


def _updated_meta(
    p: Path,
    meta: StoreMeta,
    class_names: Sequence[str] | None,
    attrs: dict[str, Any] | None,
    remove_attrs: Sequence[str],
) -> StoreMeta:
    new_attrs = dict(meta.attrs)
    if attrs:
        new_attrs.update(json_attrs(attrs, str(p)))
    for key in remove_attrs:
        if key not in new_attrs:
            raise InvalidInputError(f"{p}: no attr {key!r} to remove; the attrs are {sorted(new_attrs)}")
        del new_attrs[key]
    names = meta.class_names
    if class_names is not None:
        names = tuple(str(c) for c in class_names)
        if len(set(names)) != len(names) or not all(names):
            raise InvalidInputError(f"{p}: class names must be distinct and non-empty, got {list(names)}")
        if meta.labels is None:
            raise InvalidInputError(
                f"{p}: the store has no labels; class names name label values, so there is nothing to name"
            )
        top = int(meta.labels.max()) if len(meta.labels) else -1
        if top >= len(names):
            raise InvalidInputError(
                f"{p}: labels go up to {top}, so {top + 1} class names are needed; {len(names)} given ({', '.join(names)})"
            )
    new = dataclasses.replace(meta, class_names=names, attrs=new_attrs)
    new.validate(str(p))
    return new
