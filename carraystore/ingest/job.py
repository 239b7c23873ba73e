"""An ingest's unit of work: a :class:`StoreJob` a runner takes, and the :class:`IngestResult` it returns."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.base.errors import IngestError
from carraystore.format.encoded import Encoding
from carraystore.ingest.badfiles import BadFiles
from carraystore.ingest.images import DecodeOptions, shown_name
from carraystore.ingest.plan import StorePlan
from carraystore.store.options import WriteOptions
from carraystore.store.writer import StoreWriter, create

__all__ = ["IngestResult", "StoreJob", "Runner"]


@dataclass
class IngestResult:
    """What an ingest did: output path, counts, class names, skipped files, speed."""

    #: the store's path, or its URL
    path: Path | str
    nimages: int
    image_shape: tuple[int, ...]
    class_names: tuple[str, ...] | None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    seconds: float = 0.0
    #: the pixel bytes and the file's bytes of the store (an append: of the whole store after it)
    nbytes: int = 0
    cbytes: int = 0
    #: number of groups (videos, sessions) among the written items, or None without groups
    ngroups: int | None = None
    #: what the ingest decided that the user should know (frame order, group split, ...)
    notes: list[str] = field(default_factory=list)
    #: for an append: the store's items after it (``nimages`` counts the added ones)
    total: int | None = None
    #: layout "encoded": how the written images became entries: ``kept`` (the file's own bytes),
    #: ``png``/``jpeg``/``webp`` (re-encoded as that), ``raw`` (pixels: no encoding was smaller); else None
    entries: dict[str, int] | None = None
    #: layout "encoded": the bytes of the source files written, to compare with the store's
    source_bytes: int = 0
    #: why files were re-encoded rather than kept (layout "encoded"), or ""
    reencode_reason: str = ""

    @property
    def images_per_s(self) -> float:
        return self.nimages / self.seconds if self.seconds > 0 else float("nan")

    def summary(self) -> str:
        ratio = self.nbytes / self.cbytes if self.cbytes else float("nan")
        what = (
            f"appended {self.nimages} images to {self.path} (now {self.total})"
            if self.total is not None
            else f"wrote {self.path}: {self.nimages} images"
        )
        lines = [
            f"{what} of {'x'.join(map(str, self.image_shape))} "
            f"in {self.seconds:.1f} s ({self.images_per_s:.0f} images/s); "
            f"{'the store: ' if self.total is not None else ''}"
            f"{self.nbytes / 1e6:.1f} MB -> {self.cbytes / 1e6:.1f} MB (ratio {ratio:.2f})"
        ]
        if self.entries is not None:
            lines.append(self._entries_line())
        if self.class_names is not None:
            lines.append(f"  classes: {', '.join(self.class_names)}")
        if self.ngroups is not None:
            lines.append(f"  groups: {self.ngroups} (whole videos/sessions: splits and clips never cut one)")
        lines.extend(f"  note: {n}" for n in self.notes)
        if self.ignored:
            lines.append(
                f"  ignored {len(self.ignored)} file(s) that are not in a class folder or not images, e.g. {shown_name(self.ignored[0])}"
            )
            lines.extend(
                f"    {shown_name(p)}" for p in self.ignored if p.endswith(")") and "/ (" in p
            )  # folders not entered
        if self.skipped:
            lines.append(f"  skipped {len(self.skipped)} file(s) that could not be decoded:")
            lines.extend(f"    {p}: {r}" for p, r in self.skipped)
        return "\n".join(lines)

    def _entries_line(self) -> str:
        """Layout "encoded": files kept as they were, re-encoded as what and why, against the source files."""
        e = self.entries or {}
        kept = e.get("kept", 0)
        parts = [f"{kept} file(s) kept byte for byte"]
        re = {f: e[f] for f in ("png", "jpeg", "webp") if e.get(f)}
        if re:
            parts.append(
                ", ".join(f"{n} re-encoded as {f.upper()}" for f, n in re.items())
                + (f" ({self.reencode_reason})" if self.reencode_reason else "")
            )
        if e.get("raw"):
            parts.append(f"{e['raw']} kept as raw pixels (no encoding was smaller)")
        line = "  entries: " + "; ".join(parts)
        if self.source_bytes:
            line += f"; from {self.source_bytes / 1e6:.1f} MB of source files"
        if re.get("png") and re["png"] > kept:
            line += "\n  note: PNG is lossless and larger than a JPEG; --quality Q (1-100) encodes JPEG instead"
        return line


@dataclass
class StoreJob:
    """One store of an ingest: its :class:`~carraystore.ingest.plan.StorePlan` and how to decode and write it.

    A runner decodes ``plan.rels`` with ``opts``, hands unusable files to ``bad``, writes the
    good ones in order through :meth:`open_writer`, records ``bad.skipped`` and returns :meth:`result`.
    """

    plan: StorePlan
    opts: DecodeOptions
    #: the write options of a new store (its class names are the plan's)
    write: WriteOptions
    workers: int
    on_error: str
    max_skipped: float | int
    #: layout "encoded": the pinned encoding of the pixels kept that are not a file's own bytes
    encoding: Encoding | None = None
    #: an append: the store's writer, opened (and locked) before planning
    appender: StoreWriter | None = None
    t0: float = field(default_factory=time.perf_counter)
    bad: BadFiles = field(init=False)
    #: the items in the store before this job (an append's)
    before: int = field(init=False, default=0)
    #: layout "encoded": how the images became entries (see IngestResult.entries)
    entry_counts: dict[str, int] = field(init=False, default_factory=dict)
    #: layout "encoded": the bytes of the source files written
    source_bytes: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        p = self.plan
        self.bad = BadFiles(p.root, len(p.rels), self.on_error, self.max_skipped, p.allowed, list(p.skipped))
        self.before = self.appender.nimages if self.appender is not None else 0

    @property
    def store_shape(self) -> tuple[int, ...] | None:
        """The item shape fixed before decoding: an appended-to store's, else None."""
        return self.appender.meta.image_shape if self.appender is not None else None

    def open_writer(self, shape: tuple[int, ...]) -> StoreWriter:
        """The store's writer, with one blosc2 thread so that the same ingest always gives the same bytes."""
        if self.appender is not None:
            if tuple(shape) != self.appender.meta.image_shape:
                raise IngestError(
                    f"{self.plan.output}: the store holds {self.appender.meta.image_shape} images, "
                    f"these decode to {shape}"
                )
            return self.appender
        return create(
            self.plan.output,
            shape,
            dtype=self.opts.dtype,
            nthreads=1,
            provenance=self.plan.provenance,
            layout="encoded" if self.encoding is not None else None,
            encoding=self.encoding,
            options=self.write.replace(class_names=self.plan.class_names, progress=False),
        )

    def progress_bar(self, initial: int = 0) -> Any:
        """A tqdm bar over the files on stderr, or None without ``write.progress``."""
        if not self.write.progress:
            return None
        from tqdm import tqdm

        name = str(self.plan.output).rsplit("/", 1)[-1]  # a path or a URL
        return tqdm(
            total=len(self.plan.rels),
            initial=initial,
            desc=f"ingest {name}",
            unit="img",
            file=sys.stderr,
            dynamic_ncols=True,
        )

    def result(self, writer: StoreWriter, shape: tuple[int, ...]) -> IngestResult:
        """What the ingest of this store did, once ``writer`` is closed."""
        p, total = self.plan, writer.nimages
        n = total - self.before
        appended = self.appender is not None
        return IngestResult(
            path=p.output,
            nimages=n,
            image_shape=shape,
            class_names=writer.meta.class_names if appended else p.class_names,
            skipped=self.bad.skipped,
            ignored=p.ignored,
            seconds=time.perf_counter() - self.t0,
            # the whole store's pixels against its file (an append's file holds every item, not only the new)
            nbytes=(total if appended else n) * int(np.prod(shape)) * np.dtype(self.opts.dtype).itemsize,
            cbytes=writer.file_size or 0,
            ngroups=len(set(p.groups)) if p.groups is not None and writer.meta.group_names is not None else None,
            notes=list(p.notes),
            total=total if appended else None,
            entries=dict(self.entry_counts) if writer.meta.layout == "encoded" else None,
            source_bytes=self.source_bytes,
            reencode_reason=self.reencode_reason() if writer.meta.layout == "encoded" else "",
        )

    def reencode_reason(self) -> str:
        """Why an encoded ingest re-encodes files rather than keeping them."""
        enc = self.appender.meta.encoding if self.appender is not None else self.encoding
        if enc is not None and enc.quality is not None:
            return f"quality {enc.quality} was asked for every image"
        if self.opts.image_size is not None:
            return "resized to the store's size: a resized image is not its file"
        return "their pixels are not the file's own decode: another size, colour mode or bit depth"


#: Decodes and writes one planned store: ``run_locally`` (the default) or ``run_on_cluster``.
Runner = Callable[[StoreJob], IngestResult]
