"""The bad-file policy of an ingest: which files it may drop, and when it stops instead.

A file is bad when its name cannot be a key, it does not decode, or its size differs from the
first image's. Shared by the local and cluster ingests: same file, same message.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from carraystore.base.errors import IngestError, InvalidInputError
from carraystore.format.record import key_problem
from carraystore.ingest.images import shown_name

__all__ = [
    "DEFAULT_MAX_SKIPPED",
    "BadFiles",
    "allowed_skips",
    "describe_limit",
    "drop_bad_names",
    "shape_error",
]

#: The default of ``max_skipped``: an ingest that skips more than 1% of the files stops.
DEFAULT_MAX_SKIPPED = 0.01

_SIZE_MISMATCH = "but earlier images are"


def shape_error(arr: np.ndarray | None, first_shape: tuple[int, ...] | None, first_rel: str) -> str | None:
    """Why a decoded image cannot join the store (its shape differs from the first one), or None."""
    if arr is None or first_shape is None or arr.shape == first_shape:
        return None
    return (
        f"decoded to {arr.shape[0]}x{arr.shape[1]}x{arr.shape[2]} {_SIZE_MISMATCH} "
        f"{'x'.join(map(str, first_shape))} (e.g. {first_rel}); pass image_size (CLI: --image-size H W) to resize"
    )


class BadFiles:
    """The files an ingest cannot use: ``'fail'`` stops at the first; ``'skip'`` lists them until ``max_skipped``."""

    def __init__(
        self,
        root: Path,
        total: int,
        on_error: str,
        max_skipped: float | int,
        allowed: int,
        skipped: list[tuple[str, str]],
    ):
        self.root, self.total, self.on_error = root, total, on_error
        self.max_skipped, self.allowed, self.skipped = max_skipped, allowed, skipped
        self.named = len(skipped)  # skipped for their names before decoding: not among the ``total``

    def add(self, pos: int, rel: str, err: str, first_shape: tuple[int, ...] | None, first_rel: str) -> None:
        """File ``rel`` (position ``pos`` of ``total`` in the write order) cannot be used because of ``err``."""
        root = self.root
        if self.on_error == "fail" and _SIZE_MISMATCH in err:
            # never suggest skipping here: in a folder of mixed sizes it would drop most images
            raise IngestError(
                f"{root / rel}: {err} them all to one size (e.g. --image-size "
                f"{first_shape[0] if first_shape else 256} {first_shape[1] if first_shape else 256})"
            )
        if self.on_error == "fail":
            raise IngestError(
                f"{root / rel}: {err}. Fix or remove the file, or pass on_error='skip' (CLI: --on-error skip) "
                "to skip bad files (they are listed in the output and in the store's metadata)"
            )
        skipped = self.skipped
        skipped.append((shown_name(rel), err))
        if len(skipped) <= self.allowed:
            return
        n_size = sum(_SIZE_MISMATCH in r for _, r in skipped)
        if n_size:  # raising the limit would only drop more of them: point to resizing
            todo = (
                f"{n_size} of them differ in size from the first image ({first_rel}): pass image_size "
                f"(CLI: --image-size H W) to resize every image instead of skipping them"
            )
        else:
            todo = (
                "fix or remove the files, or, if losing them is fine, raise the limit "
                "(max_skipped=0.05 or a count; CLI: --max-skipped 5% or --max-skipped 20)"
            )
        raise IngestError(
            f"{root}: {len(skipped)} of the first {pos + 1} of {self.total} image files could not be used, more "
            f"than max_skipped (CLI: --max-skipped) allows ({describe_limit(self.max_skipped)} = {self.allowed} of "
            f"{self.total}); nothing was written. First: {skipped[0][0]}: {skipped[0][1]}. To go on, {todo}"
        )

    def none_decoded(self) -> IngestError:
        """The error when not one of the files decodes (and skipping them all was allowed)."""
        first = self.skipped[0]
        return IngestError(
            f"{self.root}: none of the {self.total + self.named} image files could be decoded; first failure: {first[0]}: {first[1]}"
        )


def allowed_skips(max_skipped: float | int, total: int) -> int:
    """How many of ``total`` files may be skipped: a fraction below 1 (0.01 = 1%) or a count."""
    if isinstance(max_skipped, bool) or not isinstance(max_skipped, (int, float)) or max_skipped < 0:
        raise InvalidInputError(f"max_skipped must be a fraction in [0, 1) or a count of files, got {max_skipped!r}")
    if isinstance(max_skipped, float) and max_skipped < 1:
        return int(max_skipped * total + 1e-9)
    if float(max_skipped) != int(max_skipped):
        raise InvalidInputError(
            f"max_skipped must be a fraction in [0, 1) or a whole count of files, got {max_skipped!r}"
        )
    return int(max_skipped)


def describe_limit(max_skipped: float | int) -> str:
    """``max_skipped`` as the messages show it: ``1%`` or ``20 file(s)``."""
    if isinstance(max_skipped, float) and max_skipped < 1:
        return f"{max_skipped * 100:g}%"
    return f"{int(max_skipped)} file(s)"


def drop_bad_names(
    root: Path, rels: list[str], labels: np.ndarray | None, on_error: str
) -> tuple[list[str], np.ndarray | None, list[tuple[str, str]]]:
    """(files, labels, skipped) without names that cannot be keys; raises for them unless ``on_error='skip'``."""
    keep: list[int] = []
    skipped: list[tuple[str, str]] = []
    for i, rel in enumerate(rels):
        problem = key_problem(rel)
        if problem is not None:
            reason = f"file name {problem.split(';')[0]}, so it cannot be a key (FORMAT.md, keys)"
            if on_error == "fail":
                raise IngestError(
                    f"{root / shown_name(rel)}: {reason} (non-ASCII bytes shown as \\xNN). Rename the file, or pass "
                    "on_error='skip' (CLI: --on-error skip) to skip it (it is listed in the output and the store's metadata)"
                ) from None
            skipped.append((shown_name(rel), reason))
            continue
        keep.append(i)
    if not skipped:
        return rels, labels, skipped
    return [rels[i] for i in keep], (labels[keep] if labels is not None else None), skipped
