"""``carraystore bench layout SRC``: pixels or encoded (FORMAT.md 10), for your images, cores and link.

    images/s = min(link bytes/s / bytes per image, cores x decoded images/s per core)

Both terms are measured on a sample written into one store of each layout, as ``carraystore
ingest`` writes it, in whole chunks: bytes per image is the compressed chunk bytes per
image; images/s per core is the images over one thread's CPU time (``time.thread_time``)
for CRC, decompression and entry decoding, chunks already in memory, median of the repeats.

``decode_size`` (``--decode-size H W``) also decodes as the loader's ``image_size`` does
(stored size / 2, 4 or 8); that rate is then the cores' limit in the report and break-even.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.base.errors import InvalidInputError

__all__ = [
    "LayoutResult",
    "LayoutReport",
    "available_cores",
    "break_even",
    "measure_layouts",
    "report_text",
    "sample_entries",
    "entry_formats",
]

#: Link rates (Mbit/s) the report shows when none is given: a slow network, 1 GbE, 10 GbE.
DEFAULT_LINKS_MBIT: tuple[float, ...] = (100.0, 1000.0, 10000.0)


def available_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def mbit_to_bytes(mbit: float) -> float:
    return mbit * 1e6 / 8


@dataclass(frozen=True)
class LayoutResult:
    """One layout measured on the sample."""

    layout: str  # "pixels" or "encoded"
    stored_as: str  # the codec (pixels) or the entries' formats (encoded)
    images: int
    raw_bytes_per_image: int  # H * W * C
    bytes_per_image: float  # compressed chunk bytes per image: what crosses the link
    decode_per_core: float  # images/s one core decodes (CRC, decompression, entries)
    #: images/s one core decodes at the report's ``decode_size`` (None: not measured)
    reduced_decode_per_core: float | None = None

    @property
    def rate(self) -> float:
        """Images/s one core delivers at the size the loader yields (``decode_size`` if given)."""
        return self.decode_per_core if self.reduced_decode_per_core is None else self.reduced_decode_per_core

    def capacity(self, cores: int) -> float:
        """Images/s ``cores`` cores decode when the link is no limit (at ``decode_size`` if given)."""
        return cores * self.rate

    def images_per_s(self, cores: int, link_bytes_per_s: float) -> float:
        """Images/s delivered: the link's and the cores' limit, whichever is lower."""
        return min(link_bytes_per_s / self.bytes_per_image, self.capacity(cores))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def break_even(pixels: LayoutResult, encoded: LayoutResult, cores: int) -> tuple[float | None, str, str]:
    """Where both layouts deliver the same images/s: ``(link bytes/s or None, wins below, wins above)``.

    None: one layout is never behind (it is named twice).
    """
    small, large = (encoded, pixels) if encoded.bytes_per_image <= pixels.bytes_per_image else (pixels, encoded)
    if small.bytes_per_image == large.bytes_per_image:
        best = max((encoded, pixels), key=lambda r: r.capacity(cores))
        return None, best.layout, best.layout
    if small.capacity(cores) >= large.capacity(cores):
        return None, small.layout, small.layout
    return small.capacity(cores) * large.bytes_per_image, small.layout, large.layout


@dataclass(frozen=True)
class LayoutReport:
    """Both layouts on one sample, and the machine they are judged for."""

    source: str
    image_shape: tuple[int, ...]
    cores: int
    links_mbit: tuple[float, ...]
    pixels: LayoutResult
    encoded: LayoutResult
    jpeg_decoder: str
    preset: str = "balanced"
    quality: int | None = None
    #: the size images were also decoded at (the loader's ``image_size``), or None
    decode_size: tuple[int, int] | None = None

    def ingest_command(self, layout: str) -> str:
        """The ``carraystore ingest`` that writes the measured ``layout``."""
        if layout == "pixels":
            return "carraystore ingest SRC OUT.b2nd" + (f" --preset {self.preset}" if self.preset != "balanced" else "")
        return "carraystore ingest SRC OUT.b2nd --layout encoded" + (
            f" --quality {self.quality}" if self.quality is not None else ""
        )

    def rows(self) -> list[dict[str, Any]]:
        """Per link rate: images/s of each layout and the one that feeds more."""
        out = []
        for mbit in self.links_mbit:
            bps = mbit_to_bytes(mbit)
            p = self.pixels.images_per_s(self.cores, bps)
            e = self.encoded.images_per_s(self.cores, bps)
            out.append({"link_mbit": mbit, "pixels": p, "encoded": e, "best": "encoded" if e > p else "pixels"})
        return out

    def break_even_mbit(self) -> tuple[float | None, str, str]:
        bps, below, above = break_even(self.pixels, self.encoded, self.cores)
        return (None if bps is None else bps * 8 / 1e6), below, above

    def to_dict(self) -> dict[str, Any]:
        mbit, below, above = self.break_even_mbit()
        return {
            "source": self.source,
            "image_shape": list(self.image_shape),
            "cores": self.cores,
            "preset": self.preset,
            "quality": self.quality,
            "decode_size": None if self.decode_size is None else list(self.decode_size),
            "jpeg_decoder": self.jpeg_decoder,
            "pixels": self.pixels.to_dict(),
            "encoded": self.encoded.to_dict(),
            "links": self.rows(),
            "break_even_mbit": mbit,
            "wins_below": below,
            "wins_above": above,
        }


# -- the sample --------------------------------------------------------------------------------


def sample_entries(
    src: str | os.PathLike[str],
    n: int,
    seed: int = 0,
    image_size: tuple[int, int] | None = None,
    color_mode: str = "rgb",
    quality: int | None = None,
) -> tuple[np.ndarray, list[bytes], Any]:
    """``n`` images of ``src`` as pixels and as the entries an encoded store would hold, and the encoding.

    A folder's files are kept where they are the pixels, as ``ingest --layout encoded`` keeps
    them; an encoded store's entries are its own (``quality`` None); the rest is encoded.
    """
    from carraystore.format.encoded import Encoding, entry_for_pixels, source_entry

    encoding = Encoding.for_quality(quality)
    p = Path(src)
    if p.is_dir():
        from carraystore.cli.benchmarks.datasets import decode_images, list_image_folder

        files = list_image_folder(p, limit=n, seed=seed).files
        pixels = decode_images(files, image_size, color_mode=color_mode)
        entries = []
        for f, arr in zip(files, pixels, strict=True):  # as ingest's encoded layout: the file, if it is the pixels
            kept = source_entry(f.read_bytes(), arr, color_mode) if quality is None else None
            entries.append(kept if kept is not None else entry_for_pixels(arr, encoding))
        return pixels, entries, encoding
    from carraystore.store.reader import StoreReader, open_store

    if image_size is not None:
        raise InvalidInputError("--image-size applies to a folder of images; a store's images keep their size")
    store: StoreReader
    with open_store(src) as store:
        if store.meta.layout not in ("NHWC", "encoded") or store.dtype != np.uint8:
            raise InvalidInputError(
                f"{src}: the encoded layout holds uint8 images; this store is {store.meta.layout} {store.dtype}"
            )
        total = len(store)
        if total == 0:
            raise InvalidInputError(f"{src}: the store holds no images")
        n = min(n, total)
        k = store.chunk_images
        starts = list(range(0, max(1, total - n + 1), k))
        start = starts[int(np.random.default_rng(seed).integers(len(starts)))]
        pixels = np.asarray(store[start : start + n])
        if store.meta.layout == "encoded":
            assert store.meta.encoding is not None
            encoding = store.meta.encoding if quality is None else encoding
            got: list[bytes] = []
            for c in range(start // k, (start + n - 1) // k + 1):
                a, _ = store.chunk_range(c)
                got.extend(e for i, e in enumerate(store.chunk_entries(c), start=a) if start <= i < start + n)
            entries = got if quality is None else [entry_for_pixels(x, encoding) for x in pixels]
        else:
            entries = [entry_for_pixels(x, encoding) for x in pixels]
        if color_mode != store.color_mode:
            raise InvalidInputError(
                f"{src}: the store's images are {store.color_mode}; --color-mode applies to folders"
            )
        return pixels, entries, encoding


# -- measuring ---------------------------------------------------------------------------------


def _decode_rate(path: Path, repeats: int, scale: int = 1) -> tuple[float, float, int]:
    """(bytes per image, images/s of one core, images) of the store at ``path``, decoded at size / ``scale``."""
    from carraystore.store.reader import StoreReader, open_store

    store: StoreReader
    with open_store(path) as store:
        chunks = [store.read_chunk_bytes(c) for c in range(store.nchunks)]
        n = len(store)
        buf = np.empty((store.chunk_images, *store.image_shape), dtype=store.dtype)
        times = []
        for _ in range(max(1, repeats)):
            t0 = time.thread_time()
            for c, data in enumerate(chunks):
                store.check_chunk_bytes(c, data)
                store.decompress_chunk(c, data, buf, nthreads=1, scale=scale)
            times.append(time.thread_time() - t0)
        cpu = max(statistics.median(times), 1e-9)
        return sum(len(d) for d in chunks) / n, n / cpu, n


def measure_layouts(
    src: str,
    sample: int = 64,
    *,
    seed: int = 0,
    image_size: tuple[int, int] | None = None,
    color_mode: str = "rgb",
    quality: int | None = None,
    preset: str = "balanced",
    cores: int | None = None,
    links_mbit: Sequence[float] = DEFAULT_LINKS_MBIT,
    repeats: int = 5,
    work: str | os.PathLike[str] | None = None,
    progress: Callable[[str], None] | None = None,
    decode_size: tuple[int, int] | None = None,
) -> LayoutReport:
    """Measure both layouts on ``sample`` images of ``src`` (a folder of images or a store)."""
    from carraystore.format.codec import PRESETS, default_chunk_images
    from carraystore.format.encoded import jpeg_decoder
    from carraystore.store.writer import create

    if sample < 1:
        raise InvalidInputError(f"--sample must be at least 1, got {sample}")
    if preset not in PRESETS:
        raise InvalidInputError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    cores = available_cores() if cores is None else cores
    if cores < 1:
        raise InvalidInputError(f"--cores must be at least 1, got {cores}")
    links = tuple(float(x) for x in links_mbit)
    if not links or any(not math.isfinite(x) or x <= 0 for x in links):
        raise InvalidInputError(f"link rates must be positive Mbit/s, got {list(links_mbit)}")
    say = progress or (lambda s: None)
    pixels, entries, encoding = sample_entries(src, sample, seed, image_size, color_mode, quality)
    shape = tuple(int(x) for x in pixels.shape[1:])
    nb = int(np.prod(shape))
    scale = _scale_of(shape, decode_size)
    # whole chunks only: a partial chunk still costs a whole chunk's decompression
    k = min(len(pixels), default_chunk_images(nb, 1, "encoded"), default_chunk_images(nb))
    n = len(pixels) // k * k
    pixels, entries = pixels[:n], entries[:n]
    say(f"sample: {n} images of {'x'.join(map(str, shape))} from {src}, chunks of {k}")
    tmp = tempfile.TemporaryDirectory(prefix="carraystore-layout-", dir=work)
    try:
        root = Path(tmp.name)
        with create(root / "pixels.b2nd", shape, codec=preset, chunk_images=k) as w:
            w.append(pixels)
        with create(root / "encoded.b2nd", shape, chunk_images=k, layout="encoded", encoding=encoding) as w:
            w.append_encoded(entries)
        say("measuring the pixel layout")
        pb, pr, _ = _decode_rate(root / "pixels.b2nd", repeats)
        prr = None if scale == 1 else _decode_rate(root / "pixels.b2nd", repeats, scale)[1]
        say("measuring the encoded layout")
        eb, er, _ = _decode_rate(root / "encoded.b2nd", repeats)
        err = None if scale == 1 else _decode_rate(root / "encoded.b2nd", repeats, scale)[1]
    finally:
        tmp.cleanup()
    from carraystore.format.codec import Codec

    dec = jpeg_decoder()
    return LayoutReport(
        source=str(src),
        image_shape=shape,
        cores=cores,
        links_mbit=links,
        pixels=LayoutResult("pixels", f"{preset} ({Codec.preset(preset).describe()})", n, nb, pb, pr, prr),
        encoded=LayoutResult("encoded", entry_formats(entries, nb), n, nb, eb, er, err),
        jpeg_decoder=f"{dec.name} {dec.version} ({dec.reason})",
        preset=preset,
        quality=quality,
        decode_size=None if scale == 1 else (shape[0] // scale, shape[1] // scale),
    )


def entry_formats(entries: Sequence[bytes], image_nbytes: int) -> str:
    """How many entries are in each format, e.g. ``64 jpeg`` or ``60 jpeg, 4 png``."""
    from carraystore.format.encoded import sniff

    formats = Counter(sniff(e, image_nbytes) for e in entries)
    return ", ".join(f"{c} {f}" for f, c in sorted(formats.items()))


def _scale_of(shape: tuple[int, ...], decode_size: tuple[int, int] | None) -> int:
    """The factor ``decode_size`` divides the sample's images by; InvalidInputError naming the allowed sizes."""
    from carraystore.format.encoded import SCALES, reduced_sizes

    if decode_size is None:
        return 1
    h, w = shape[:2]
    want = tuple(int(x) for x in decode_size)
    for k in SCALES:
        if h % k == 0 and w % k == 0 and (h // k, w // k) == want:
            return k
    shown = ", ".join(f"{a}x{b}" for a, b in reduced_sizes(h, w))
    raise InvalidInputError(
        f"--decode-size {want[0]} {want[1]}: the sample's {h}x{w} images decode at their size divided by 1, 2, 4 "
        f"or 8 exactly: {shown}"
    )


# -- the report --------------------------------------------------------------------------------


def _n(x: float) -> str:
    return f"{x:,.0f}"


def report_text(r: LayoutReport) -> str:
    """The markdown the command prints."""
    c = r.cores
    lines = [
        f"# Layout for {r.source}: {r.pixels.images} images of {'x'.join(map(str, r.image_shape))}, {c} cores",
        "",
        f"JPEG entries decoded by {r.jpeg_decoder}.",
        "",
    ]
    if r.decode_size is None:
        lines += [
            f"| layout | stored as | bytes/image | of raw | decoded images/s per core | images/s on {c} cores |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
        ]
    else:
        ds = "x".join(map(str, r.decode_size))
        lines += [
            f"Decoded at {ds} as well (the loader's image_size=({r.decode_size[0]}, {r.decode_size[1]})); the links "
            f"table and the break-even are at {ds}.",
            "",
            f"| layout | stored as | bytes/image | of raw | decoded images/s per core | at {ds} | "
            f"images/s on {c} cores at {ds} |",
            "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
        ]
    for x in (r.pixels, r.encoded):
        reduced = "" if x.reduced_decode_per_core is None else f" {_n(x.reduced_decode_per_core)} |"
        lines.append(
            f"| {x.layout} | {x.stored_as} | {_n(x.bytes_per_image)} | "
            f"{100 * x.bytes_per_image / x.raw_bytes_per_image:.1f}% | {_n(x.decode_per_core)} |{reduced} "
            f"{_n(x.capacity(c))} |"
        )
    lines += ["", "| link (Mbit/s) | pixels images/s | encoded images/s | feeds more |", "| ---: | ---: | ---: | --- |"]
    for row in r.rows():
        lines.append(f"| {row['link_mbit']:,g} | {_n(row['pixels'])} | {_n(row['encoded'])} | {row['best']} |")
    mbit, below, above = r.break_even_mbit()
    lines.append("")
    if mbit is None:
        lines.append(f"break-even link rate: none; {below} feeds at least as many images/s at every link rate")
    else:
        small = r.encoded if below == "encoded" else r.pixels
        large = r.pixels if below == "encoded" else r.encoded
        lines.append(
            f"break-even link rate: {mbit:,.0f} Mbit/s (= {_n(small.capacity(c))} images/s, what {below} decodes on "
            f"{c} cores, x {_n(large.bytes_per_image)} bytes/image of {above}): below it {below} feeds more images/s, "
            f"above it {above}"
        )
    for row in r.rows():
        lines.append(
            f"recommended for {c} cores at {row['link_mbit']:,g} Mbit/s: {row['best']} ({r.ingest_command(row['best'])})"
        )
    return "\n".join(lines)
