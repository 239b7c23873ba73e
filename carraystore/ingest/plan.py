"""The plan of an ingest: which stores, which files in which order, their labels, groups and fields.

Decided from the listing, the arguments and a manifest, without decoding a pixel:
:func:`plan_folder` gives one :class:`StorePlan` per store.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.base.errors import FrameSplitWarning, GroupSplitError, IngestError, InvalidInputError
from carraystore.ingest.badfiles import DEFAULT_MAX_SKIPPED, allowed_skips, drop_bad_names
from carraystore.ingest.images import IMAGE_EXTENSIONS, list_images
from carraystore.ingest.manifest import TARGET_FIELD, FieldTable, read_manifest
from carraystore.store.reader import is_url

__all__ = [
    "Groups",
    "SPLIT_NAMES",
    "StorePlan",
    "plan_folder",
    "plan_store",
    "split_like_folders",
    "validation_split_indices",
    "group_split_indices",
    "infer_groups",
    "frame_like",
    "target_field",
    "check_group_column",
    "natural_order",
    "float_labels",
    "fields_for",
]

log = logging.getLogger("carraystore.ingest.plan")

#: Groups of the files: "inferred" (the folder below each class folder), None, one value per
#: file (sorted path order, as labels), a mapping relative path -> group, or a function of it.
Groups = str | Sequence[Any] | Mapping[str, Any] | Callable[[str], Any] | None

#: Folder names that mean a dataset split, not a class (compared in lower case).
SPLIT_NAMES = frozenset(
    {
        "train",
        "training",
        "val",
        "valid",
        "validation",
        "validate",
        "test",
        "testing",
        "dev",
        "eval",
        "evaluation",
        "holdout",
    }
)


def split_like_folders(root: str | os.PathLike[str]) -> list[str]:
    """Sub-folders of ``root`` that are probably splits: two or more split names, or one holding folders."""
    rootp = Path(root)
    subdirs = sorted(d for d in rootp.iterdir() if d.is_dir() and not d.name.startswith("."))
    splits = [d for d in subdirs if d.name.lower() in SPLIT_NAMES]
    if len(splits) >= 2 or any(any(c.is_dir() for c in d.iterdir()) for d in splits):
        return [d.name for d in splits]
    return []


def validation_split_indices(
    n: int, validation_split: float, shuffle: bool, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) positions in the sorted file list, as Keras picks them with the same seed.

    Keras shuffles with ``np.random.RandomState(seed)`` and keeps the last
    ``int(validation_split * n)`` files for validation.
    """
    _check_fraction(validation_split)
    n_val = int(validation_split * n)
    if n_val == 0 or n_val == n:
        raise IngestError(
            f"validation_split={validation_split} of {n} files leaves {'no file for validation' if n_val == 0 else 'no file for training'}"
        )
    order = np.arange(n)
    if shuffle:
        np.random.RandomState(seed).shuffle(order)
    return np.sort(order[: n - n_val]), np.sort(order[n - n_val :])


# -- groups and frame order -------------------------------------------------------------------

_DIGITS = re.compile(r"(\d+)")


def _natural(name: str) -> tuple[tuple[tuple[str, int], ...], str]:
    """``frame_2`` before ``frame_10``: text order, except that a run of digits compares as its number.

    A digit run sorts where its first digit would in text order, then by value; the name
    itself breaks ties (``frame_01`` and ``frame_1``).
    """
    tokens: list[tuple[str, int]] = []
    for i, part in enumerate(_DIGITS.split(name)):
        if i % 2:
            tokens.append(("0", int(part)))
        else:
            tokens.extend((c, 0) for c in part)
    return tuple(tokens), name


def natural_order(rels: Sequence[str], class_first: bool = False) -> np.ndarray:
    """Positions of ``rels`` in natural order, files before sub-folders; ``class_first`` keeps level 1's order."""
    first: dict[str, int] = {}

    def key(rel: str) -> tuple[Any, ...]:
        parts = rel.split("/")
        out: list[Any] = []
        for i, part in enumerate(parts):
            is_dir = i < len(parts) - 1
            if i == 0 and class_first and is_dir:
                out.append((1, (first.setdefault(part, len(first)),), ""))
            else:
                out.append((int(is_dir), *_natural(part)))
        return tuple(out)

    keys = [key(r) for r in rels]
    return np.asarray(sorted(range(len(rels)), key=keys.__getitem__), dtype=np.int64)


_NUMBERED = re.compile(r"\d+$")


def frame_like(rels: Sequence[str]) -> bool:
    """Whether the files look like frames of sequences: every name (less its extension) ends in a
    number, and some folder holds two or more of them (``session_03/frame_000123.jpg``)."""
    if not rels or not all(_NUMBERED.search(r.rsplit("/", 1)[-1].rsplit(".", 1)[0]) for r in rels):
        return False
    folders = [r.rsplit("/", 1)[0] if "/" in r else "" for r in rels]
    return len(set(folders)) < len(folders)


def infer_groups(rels: Sequence[str], labels: Any, groups: Groups, root: Path) -> list[str] | None:
    """Each file's group name, or None when the files have no groups.

    ``"inferred"`` with class folders: the folder below the class folder, with its class
    (``walk/video_0001/frame_1.jpg`` -> ``walk/video_0001``; files right in a class folder:
    that folder). Without class folders, files that all sit in sub-folders and look like frames
    (:func:`frame_like`) take the folder that holds them as their group
    (``session_03/frame_000123.jpg`` -> ``session_03``); otherwise no groups. Otherwise
    :data:`Groups`.
    """
    if groups is None:
        return None
    if isinstance(groups, str):
        if groups != "inferred":
            raise InvalidInputError(
                f"groups must be 'inferred', None, one group per file, a mapping or a function, got {groups!r}"
            )
        if labels != "inferred":
            if rels and all("/" in r for r in rels) and frame_like(rels):
                return [r.rsplit("/", 1)[0] for r in rels]  # each sequence's folder
            return None
        if not any(r.count("/") >= 2 for r in rels):
            return None
        return ["/".join(r.split("/")[:2]) if r.count("/") >= 2 else r.split("/")[0] for r in rels]
    if isinstance(groups, Mapping):
        missing = [r for r in rels if r not in groups]
        extra = sorted(set(groups) - set(rels))
        if missing or extra:
            what = []
            if missing:
                what.append(f"{len(missing)} file(s) have no group, e.g. {', '.join(missing[:3])}")
            if extra:
                what.append(f"{len(extra)} group entr(ies) name no file, e.g. {', '.join(map(str, extra[:3]))}")
            raise IngestError(f"{root}: groups: {'; '.join(what)} (keys are paths relative to the folder)")
        values = [groups[r] for r in rels]
    elif callable(groups):
        values = [groups(r) for r in rels]
    else:
        values = list(groups)
        if len(values) != len(rels):
            raise IngestError(
                f"{root}: {len(values)} groups given for {len(rels)} image files "
                "(groups follow the sorted file paths, as labels do)"
            )
    out = []
    for rel, v in zip(rels, values, strict=True):
        if v is None or isinstance(v, (float, bytes)) or str(v) == "":
            raise IngestError(f"{root / rel}: group {v!r}; a group is a non-empty name or an integer")
        out.append(v if isinstance(v, str) else str(v))
    return out


def group_split_indices(
    groups: Sequence[str], labels: np.ndarray | None, validation_split: float, seed: int
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """(training, validation) positions that keep every group whole, and notes on what was reached.

    Per class (its files' majority label), groups in a seeded order go to validation while that
    brings the class closer to ``validation_split``; each class keeps a training group.
    :class:`~carraystore.base.errors.GroupSplitError` when a part would be empty; the notes
    give the share reached and classes missing from a part.
    """
    _check_fraction(validation_split)
    n = len(groups)
    names, inv = np.unique(np.asarray(groups, dtype=object).astype(str), return_inverse=True)
    g_count = len(names)
    sizes = np.bincount(inv, minlength=g_count)
    if labels is not None and n:
        lab = np.asarray(labels, dtype=np.int64)
        pairs, counts = np.unique(inv * (int(lab.max()) + 1) + lab, return_counts=True)
        best = np.full(g_count, -1, dtype=np.int64)
        most = np.zeros(g_count, dtype=np.int64)
        for pair, c in zip(pairs.tolist(), counts.tolist(), strict=True):
            g, label = divmod(pair, int(lab.max()) + 1)
            if c > most[g]:
                most[g], best[g] = c, label
        group_class = best
    else:
        lab = None
        group_class = np.zeros(g_count, dtype=np.int64)
    order = np.random.RandomState(seed).permutation(g_count)
    chosen = np.zeros(g_count, dtype=bool)
    for c in np.unique(group_class):
        members = [g for g in order.tolist() if group_class[g] == c]
        target = validation_split * int(sizes[members].sum())
        count = 0
        for g in members[:-1] if len(members) > 1 else []:  # a class's last group stays in training
            if count + sizes[g] / 2 <= target:
                chosen[g] = True
                count += int(sizes[g])
    if not chosen.any() and g_count >= 2:
        chosen[min(order.tolist(), key=lambda g: sizes[g])] = True
    val = chosen[inv]
    n_val = int(val.sum())
    if n_val == 0 or n_val == n:
        raise GroupSplitError(
            f"validation_split={validation_split} by groups: the {n} files form {g_count} group(s) "
            f"(videos, sessions: sizes {sorted(sizes.tolist())[:10]}), and a split never cuts a group, so "
            f"{'validation' if n_val == 0 else 'training'} would be empty. Ingest more groups, change "
            "validation_split, or split the folders yourself (split_dirs=True, CLI --split-dirs)"
        )
    notes = [
        f"validation_split={validation_split} keeps groups whole: {int(chosen.sum())} of {g_count} groups, "
        f"{n_val} of {n} files ({n_val / n:.1%}) in validation"
    ]
    if lab is not None:
        in_val, in_train = set(np.unique(lab[val]).tolist()), set(np.unique(lab[~val]).tolist())
        if in_val != in_train:
            notes.append(
                f"class coverage: {len(in_val)} class(es) in validation, {len(in_train)} in training; "
                f"label(s) {sorted(in_train - in_val)} not in validation, {sorted(in_val - in_train)} not in training "
                "(a class with one group can be in one part only)"
            )
        else:
            notes.append(f"class coverage: all {len(in_val)} classes in both parts")
    return np.flatnonzero(~val), np.flatnonzero(val), notes


def _check_fraction(validation_split: Any) -> None:
    if (
        not isinstance(validation_split, (int, float))
        or isinstance(validation_split, bool)
        or not 0 < validation_split < 1
    ):
        raise InvalidInputError(f"validation_split must be a fraction between 0 and 1, got {validation_split!r}")


def float_labels(labels: Any) -> np.ndarray | None:
    """``labels`` given as floats or vectors (a regression target), else None (class labels, "inferred", None)."""
    if labels is None or isinstance(labels, str):
        return None
    arr = np.asarray(labels)
    if arr.dtype.kind == "f" or arr.ndim > 1:
        if arr.dtype.kind not in "biuf":
            raise InvalidInputError(f"labels must be numbers, got {arr.dtype}")
        return arr
    return None


def target_field(root: Path, rels: list[str], target_values: np.ndarray | None) -> FieldTable | None:
    """Float ``labels`` (one per file, in sorted path order) as the field "target", or None."""
    if target_values is None:
        return None
    if len(target_values) != len(rels):
        raise IngestError(
            f"{root}: {len(target_values)} labels given for {len(rels)} image files (labels follow the sorted "
            "file paths, as in Keras)"
        )
    return FieldTable.from_values(rels, TARGET_FIELD, target_values)


def check_group_column(table: FieldTable | None, groups: Groups, targets: Any) -> None:
    """A manifest's ``group`` column and ``groups=`` both given is refused by name."""
    if table is not None and table.groups is not None and not (isinstance(groups, str) and groups == "inferred"):
        raise InvalidInputError(
            f"{targets}: the manifest's 'group' column and groups= both give the files' groups; give one"
        )


def fields_for(
    root: Path, rels: list[str], target_values: np.ndarray | None, table: FieldTable | None
) -> FieldTable | None:
    """The per-file fields of an ingest: float ``labels`` as the field "target", and a manifest's."""
    fields = target_field(root, rels, target_values)
    if table is not None:
        table.check_files(rels, str(root))
        fields = table if fields is None else fields.merged(table)
    return fields


def output_folder(path: Path) -> None:
    """Make the folder that receives one store per split; a file in the way is a named error."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError) as exc:
        raise InvalidInputError(
            f"{path} is a file (or under one); with several splits the output is a folder that receives one store "
            "per split: choose a folder name"
        ) from exc


# -- the stores of a folder -------------------------------------------------------------------


@dataclass
class StorePlan:
    """One store of an ingest, planned without decoding a pixel: its files in write order and what goes with them."""

    root: Path
    output: Path | str
    #: the files, relative to ``root``, in write order
    rels: list[str]
    #: each file's class label (aligned with ``rels``), or None
    labels: np.ndarray | None
    class_names: tuple[str, ...] | None
    #: files found that are not images or not in a class folder
    ignored: list[str] = field(default_factory=list)
    #: each file's group name (aligned with ``rels``), or None
    groups: list[str] | None = None
    #: per-file fields (a targets manifest, float labels), looked up by key: ``fields.take(keys)``
    fields: FieldTable | None = None
    #: what the store records about its source
    provenance: dict[str, Any] = field(default_factory=dict)
    #: what the ingest decided that the user should know (frame order, group split, ...)
    notes: list[str] = field(default_factory=list)
    #: files left out for their names before any decoding: (printable name, reason)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    #: how many files may fail to decode (``max_skipped`` of the files found)
    allowed: int = 0

    def columns_for(self, keys: Sequence[str]) -> dict[str, np.ndarray] | None:
        """The ``columns=`` of an append of the files ``keys`` (None without fields)."""
        return None if self.fields is None else self.fields.take(keys)


def plan_store(
    root: Path,
    output: Path | str,
    rels: list[str],
    labels: np.ndarray | None,
    class_names: tuple[str, ...] | None,
    ignored: list[str],
    *,
    shuffle: bool,
    seed: int,
    on_error: str,
    max_skipped: float | int = DEFAULT_MAX_SKIPPED,
    class_folders: bool = False,
    groups: list[str] | None = None,
    fields: FieldTable | None = None,
    provenance: dict[str, Any] | None = None,
    notes: Sequence[str] = (),
) -> StorePlan:
    """One store's plan: names that cannot be keys dropped, then a seeded or natural write order."""
    if not rels:
        raise IngestError(f"{root}: no image files found (looked for {', '.join(IMAGE_EXTENSIONS)})")
    allowed = allowed_skips(max_skipped, len(rels))
    group_of = dict(zip(rels, groups, strict=True)) if groups is not None else None
    rels, labels, skipped = drop_bad_names(root, rels, labels, on_error)
    notes = list(notes)
    if shuffle:
        order = np.random.default_rng(seed).permutation(len(rels))
    else:
        order = natural_order(rels, class_first=class_folders)
        differ = np.flatnonzero(order != np.arange(len(rels)))
        if len(differ):
            i = int(differ[0])
            note = (
                f"file names are numbered without leading zeros: written in natural order ({rels[order[i]]} "
                f"before {rels[i]}, as frame_2 before frame_10), not in text order"
            )
            notes.append(note)
            log.info("%s: %s", root, note)
    rels = [rels[i] for i in order]
    return StorePlan(
        root,
        output,
        rels,
        labels[order] if labels is not None else None,
        class_names,
        ignored,
        groups=[group_of[r] for r in rels] if group_of is not None else None,
        fields=fields,
        provenance=dict(provenance or {}),
        notes=notes,
        skipped=skipped,
        allowed=allowed,
    )


def plan_folder(
    directory: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    labels: Any = "inferred",
    class_names: Sequence[str] | None = None,
    targets: str | os.PathLike[str] | None = None,
    groups: Groups = "inferred",
    shuffle: bool = True,
    seed: int = 0,
    follow_links: bool = False,
    split_dirs: bool = False,
    allow_split_names: bool = False,
    validation_split: float | None = None,
    subset: str | None = None,
    on_error: str = "fail",
    max_skipped: float | int = DEFAULT_MAX_SKIPPED,
    decoding: Mapping[str, Any] | None = None,
) -> dict[str, StorePlan]:
    """The stores of an ingest (``from_directory``'s arguments), keyed ``""``, split names or the subsets."""
    root = Path(directory)
    inferred = isinstance(labels, str) and labels == "inferred"
    target_values = float_labels(labels)
    table = read_manifest(targets) if targets is not None else None
    check_group_column(table, groups, targets)
    if table is not None and table.groups is not None:  # the manifest's "group" column
        if split_dirs:
            raise InvalidInputError(
                f"{targets}: a 'group' column with split_dirs is not supported yet; groups come from the folders there"
            )
        groups = table.group_of()
    if (validation_split is None) != (subset is None):
        raise InvalidInputError(
            "validation_split and subset go together (as in Keras): e.g. validation_split=0.2, subset='both' "
            "(CLI: --validation-split 0.2 --subset both)"
        )
    if subset is not None and subset not in ("training", "validation", "both"):
        raise InvalidInputError(f"subset must be 'training', 'validation' or 'both', got {subset!r}")
    if subset is not None and split_dirs:
        raise InvalidInputError(
            "split_dirs already gives one store per split folder; leave out validation_split and subset"
        )
    what = "none" if labels is None else "given" if target_values is None else f"given as field {TARGET_FIELD!r}"

    def provenance(name: str) -> dict[str, Any]:
        return {
            "source": name,  # a folder name, never an absolute path
            "source_kind": "image_folder",
            "labels": "inferred" if inferred else what,
            **(decoding or {}),
            "shuffled": shuffle,
            "seed": seed if shuffle else None,
        } | ({"targets": Path(targets).name} if targets is not None else {})

    common: dict[str, Any] = dict(
        shuffle=shuffle, seed=seed, on_error=on_error, max_skipped=max_skipped, class_folders=inferred
    )
    allowed_skips(max_skipped, 1)  # a bad value fails before any work
    if split_dirs:
        if not (labels is None or inferred):
            raise InvalidInputError(
                "with split_dirs, labels must be 'inferred' or None (per-file values: a manifest, targets=FILE)"
            )
        return _plan_split_dirs(root, output, inferred, class_names, table, groups, follow_links, provenance, common)
    if root.is_dir() and not allow_split_names and (labels is None or inferred) and class_names is None:
        splits = split_like_folders(root)
        if splits:
            raise IngestError(
                f"{root}: its sub-folders {', '.join(s + '/' for s in splits)} look like dataset splits, not classes; "
                f"ingesting them as one store would make the classes {', '.join(splits)} and mix the splits. "
                f"Pass split_dirs=True (CLI: --split-dirs) for one store per split, or ingest one split "
                f"(e.g. {root / splits[0]}); if they really are classes pass allow_split_names=True "
                "(CLI: --allow-split-names)"
            )
    out = str(output) if is_url(output) else Path(output)
    int_labels = None if target_values is not None else labels
    rels, labs, names, ignored = list_images(root, int_labels, class_names, follow_links)
    fields = fields_for(root, rels, target_values, table)
    grp = infer_groups(rels, int_labels, groups, root)
    if subset is None:
        return {"": plan_store(root, out, rels, labs, names, ignored, groups=grp, fields=fields,
                               provenance=provenance(root.name), **common)}  # fmt: skip
    if not rels:
        raise IngestError(f"{root}: no image files found (looked for {', '.join(IMAGE_EXTENSIONS)})")
    assert validation_split is not None
    notes: list[str] = []
    if grp is not None:
        train_idx, val_idx, notes = group_split_indices(grp, labs, validation_split, seed)
    else:
        train_idx, val_idx = validation_split_indices(len(rels), validation_split, shuffle, seed)
        if not inferred and frame_like(rels):
            leak = (
                f"{root}: the files look like frames of sequences (numbered names, several per folder, e.g. "
                f"{rels[0]}), but they have no groups, so validation_split={validation_split} puts neighbouring "
                "frames of one sequence in both parts. Give each file its group (groups=, or a 'group' column in "
                "the targets manifest), or put each sequence in its own sub-folder"
            )
            warnings.warn(FrameSplitWarning(leak), stacklevel=2)
            notes.append("warning: " + leak.split(": ", 1)[1])
    parts = {"training": train_idx, "validation": val_idx}
    if subset == "both":
        if str(out).rstrip("/").endswith(".b2nd"):
            raise InvalidInputError(
                f"{out}: with subset='both' the output is a folder that receives training.b2nd and validation.b2nd"
            )
        if isinstance(out, Path):
            output_folder(out)
    plans: dict[str, StorePlan] = {}
    for part in ("training", "validation") if subset == "both" else (subset,):
        idx = parts[part]
        prov = provenance(root.name) | {
            "validation_split": validation_split,
            "subset": part,
            "split_seed": seed if shuffle or grp is not None else None,
        }
        if grp is not None:
            prov["split_by"] = "groups"
            prov["validation_share"] = round(len(val_idx) / len(rels), 6)
        plans[part] = plan_store(
            root,
            _inside(out, part) if subset == "both" else out,
            [rels[i] for i in idx],
            labs[idx] if labs is not None else None,
            names,
            ignored,
            groups=[grp[i] for i in idx] if grp is not None else None,
            fields=fields,
            provenance=prov,
            notes=notes,
            **common,
        )
    return plans


def _inside(out: Path | str, name: str) -> Path | str:
    """The store ``name``.b2nd inside the output folder (or URL prefix) ``out``."""
    return f"{out.rstrip('/')}/{name}.b2nd" if isinstance(out, str) else out / f"{name}.b2nd"


def _plan_split_dirs(
    root: Path,
    output: str | os.PathLike[str],
    inferred: bool,
    class_names: Sequence[str] | None,
    table: FieldTable | None,
    groups: Groups,
    follow_links: bool,
    provenance: Callable[[str], dict[str, Any]],
    common: dict[str, Any],
) -> dict[str, StorePlan]:
    """``split_dirs=True``: one store per sub-folder, the class names shared by all of them."""
    if not root.is_dir():
        raise IngestError(f"{root}: not a folder")
    splits = sorted(d.name for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not splits:
        raise IngestError(f"{root}: --split-dirs expects split sub-folders such as train/ and validation/")
    if str(output).rstrip("/").endswith(".b2nd"):
        raise InvalidInputError(f"{output}: with split_dirs the output is a folder that receives <split>.b2nd files")
    out: Path | str = str(output) if is_url(output) else Path(output)
    if isinstance(out, Path):
        output_folder(out)
    names_all: tuple[str, ...] | None = None
    if inferred:
        names_all = tuple(class_names) if class_names is not None else tuple(
            sorted({d.name for s in splits for d in (root / s).iterdir() if d.is_dir() and not d.name.startswith(".")})
        )  # fmt: skip
    class_index = {c: i for i, c in enumerate(names_all or ())}
    listed: dict[str, tuple[list[str], np.ndarray | None, tuple[str, ...] | None, list[str], list[str] | None]] = {}
    for split in splits:
        src = root / split
        if inferred:
            present = [c for c in names_all or () if (src / c).is_dir()]
            rels, _, _, ignored = list_images(src, "inferred", present, follow_links)
            # labels index the shared class list, not the split's own
            labs: np.ndarray | None = np.asarray([class_index[r.split("/", 1)[0]] for r in rels], dtype=np.int64)
            names = names_all
        else:
            rels, labs, names, ignored = list_images(src, None, None, follow_links)
        # the user's split folders are the splits: left as they are, groups recorded inside each
        grp = infer_groups(
            rels, "inferred" if inferred else None, groups if isinstance(groups, str) or groups is None else None, src
        )
        listed[split] = (rels, labs, names, ignored, grp)
    if table is not None:  # rows keyed relative to the top folder: every split's files at once
        table.check_files([f"{split}/{r}" for split, (rels, *_) in listed.items() for r in rels], str(root))
    return {
        split: plan_store(
            root / split,
            _inside(out, split),
            rels,
            labs,
            names,
            ignored,
            groups=grp,
            fields=table.under(split) if table is not None else None,
            provenance=provenance(f"{root.name}/{split}"),
            **common,
        )
        for split, (rels, labs, names, ignored, grp) in listed.items()
    }
