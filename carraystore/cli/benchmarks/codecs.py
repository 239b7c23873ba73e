"""The codec suite: ratio and speed of blosc2 codecs on real images, and preset advice (docs/codecs.md).

Each combination is measured as a store uses it: chunks of ``default_chunk_images`` images
compressed with the store's exact ``Codec.cparams``, decompressed into a preallocated buffer.
Speeds are MB/s of uncompressed pixels: compression on one thread, decompression on one and
two; random access is the µs to decompress one random image (its whole block).

Presets are chosen by a read-bound model: an image costs ``nbytes / (ratio * R)`` to read at
speed ``R`` plus ``nbytes / (D * cores)`` to decompress at per-core speed ``D``. ``fast``
takes ``R`` = memory-copy speed (the clevel 0 row), ``small`` ``R`` = 50 MB/s.

``carraystore bench codecs`` recommends one for the user's disk and cores from two short
measurements: the disk's cold sequential read speed (:func:`measure_read_mbs`: a probe file
written beside the data, evicted from the page cache, read back, removed) and each preset's
images through the loader from the page cache on these cores (:func:`measure_loader`: a
small store of the sample, ``Store.batches`` epochs). For a folder of image files or an
encoded store the encoded layout (FORMAT.md 10: the JPEG/PNG files kept) is measured the same
way on the same sample (:func:`measure_encoded_loader`) and is a candidate beside the presets.
Reading overlaps decoding, so each delivers ``min(R x ratio, loader rate)``
(:func:`carraystore.format.codec.choice_for_storage`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from carraystore.base.errors import InvalidInputError
from carraystore.format.codec import PRESETS, Codec, choice_for_storage, storage_delivers

__all__ = [
    "CODECS",
    "CLEVELS",
    "FILTERS",
    "BLOCKS",
    "REGIMES",
    "CodecResult",
    "codec_grid",
    "measure_codec",
    "run_suite",
    "pareto_front",
    "throughput",
    "choose_presets",
    "recommend_preset",
    "recommend_for_storage",
    "results_table",
    "block_table",
    "block_families",
    "write_results",
    "plot_results",
    "load_sample",
    "measure_read_mbs",
    "read_cold_s",
    "measure_loader",
    "measure_encoded_loader",
    "EncodedCandidate",
    "encoded_candidate",
    "PROBE_BYTES",
]

#: Codecs, levels, filter sets and block sizes of the full grid (see docs/codecs.md).
CODECS: tuple[str, ...] = ("blosclz", "lz4", "lz4hc", "zlib", "zstd")
CLEVELS: tuple[int, ...] = (0, 1, 3, 5, 9)
#: Filter sets by name; every one runs on the pixel view (typesize = channels x itemsize).
FILTERS: dict[str, tuple[str, ...]] = {
    "none": (),
    "shuffle": ("shuffle",),
    "bitshuffle": ("bitshuffle",),
    "shuffle+bytedelta": ("shuffle", "bytedelta"),
}
BLOCKS: tuple[int, ...] = (1, 4, 16)
#: Read speeds (MB/s of compressed bytes) presets are judged at; ``None``: the page cache.
REGIMES: dict[str, float | None] = {
    "warm page cache": None,
    "NVMe 2000 MB/s": 2000.0,
    "SSD 500 MB/s": 500.0,
    "disk/network 50 MB/s": 50.0,
}
#: Presets must compress at least this fast (MB/s, one thread) so that ingest stays practical.
MIN_COMPRESS_MBS = 20.0
#: ... and save at least this share of the bytes (otherwise: do not compress at all).
MIN_SAVING = 0.05
#: Modelled throughputs closer than this to the best count as a tie (timings vary by a few %).
TIE = 0.05


@dataclass(frozen=True)
class CodecResult:
    """One measured combination on one dataset."""

    dataset: str
    codec: str
    clevel: int
    filters: str
    typesize: int
    block_images: int
    chunk_images: int
    nbytes: int
    cbytes: int
    compress_mbs: float
    decompress_mbs_1t: float
    decompress_mbs_2t: float
    #: microseconds to decompress one image picked at random (NaN: not measured) ...
    random_image_us: float = math.nan
    #: ... by decompressing its ``"block"`` (getitem) or, where getitem cannot, its whole ``"chunk"``
    random_image_via: str = ""

    @property
    def ratio(self) -> float:
        return self.nbytes / max(1, self.cbytes)

    @property
    def label(self) -> str:
        if self.clevel == 0:
            return f"none (clevel 0) b{self.block_images}"
        ts = f" ts{self.typesize}" if self.filters not in ("none",) else ""
        return f"{self.codec}-{self.clevel} {self.filters}{ts} b{self.block_images}"

    def codec_obj(self) -> Codec:
        """The Codec this row measured."""
        filters = FILTERS.get(self.filters, ("shuffle",) if self.filters.startswith("shuffle") else ())
        return Codec(self.codec, self.clevel, filters=filters, typesize=self.typesize, block_images=self.block_images)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ratio"] = round(self.ratio, 4)
        d["label"] = self.label
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CodecResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def codec_grid(
    codecs: Sequence[str] = CODECS,
    clevels: Sequence[int] = CLEVELS,
    filters: Sequence[str] = tuple(FILTERS),
    blocks: Sequence[int] = BLOCKS,
    with_ts1_shuffle: bool = True,
) -> list[tuple[str, int, str, int | None, int]]:
    """The combinations to measure: (codec, clevel, filter name, typesize or None, block_images).

    clevel 0 is measured once per block size (as zstd, no filter). ``with_ts1_shuffle`` adds
    a zstd-1 row per block size with SHUFFLE at typesize 1.
    """
    grid: list[tuple[str, int, str, int | None, int]] = []
    for b in blocks:
        if 0 in clevels:
            grid.append(("zstd", 0, "none", None, b))
        for c in codecs:
            for lvl in clevels:
                if lvl == 0:
                    continue
                for f in filters:
                    grid.append((c, lvl, f, None, b))
        if with_ts1_shuffle:
            grid.append(("zstd", 1, "shuffle", 1, b))
    return grid


def _timeit(fn: Callable[[], Any], repeats: int, budget_s: float) -> float:
    """Median seconds of ``fn`` over up to ``repeats`` runs (fewer if one run exceeds the budget)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if sum(times) > budget_s:
            break
    return statistics.median(times)


def measure_codec(
    images: np.ndarray,
    codec: Codec,
    dataset: str = "",
    filters_name: str | None = None,
    repeats: int = 3,
    budget_s: float = 0.5,
) -> CodecResult:
    """Compress ``images`` (N, H, W, C) chunk by chunk with ``codec`` as a store would; time both ways."""
    import blosc2

    from carraystore.format.codec import default_chunk_images

    images = np.ascontiguousarray(images)
    if images.ndim != 4:
        raise InvalidInputError(f"measure_codec needs (N, H, W, C) images, got shape {images.shape}")
    resolved = codec.resolve(images.dtype, images.shape[1:])
    if codec.typesize is not None and codec.filters and resolved.filters != codec.filters:
        # resolve() drops useless filters (shuffle on 1-byte items); measure them anyway when asked
        resolved = dataclasses.replace(resolved, filters=codec.filters, filters_meta=codec.filters_meta)
    if resolved.block_images > len(images):  # type: ignore[operator]
        # a sample smaller than one block (small images, automatic blocks): the largest block that fits
        resolved = dataclasses.replace(resolved, block_images=len(images))
    image_nbytes = int(math.prod(images.shape[1:])) * images.dtype.itemsize
    k = default_chunk_images(image_nbytes, resolved.block_images)  # type: ignore[arg-type]
    nchunks = max(1, len(images) // k)
    if len(images) < k:
        # a sample smaller than one chunk is one chunk, its last block short if need be
        k = len(images)
    chunks = [images[i * k : (i + 1) * k] for i in range(nchunks)]
    blocksize = image_nbytes * resolved.block_images  # type: ignore[operator]
    cp = resolved.cparams(blocksize, nthreads=1)
    compressed: list[bytes] = []

    def compress() -> None:
        compressed.clear()
        compressed.extend(blosc2.compress2(c, **cp) for c in chunks)

    t_c = _timeit(compress, repeats, budget_s)
    buf = np.empty_like(chunks[0])
    nbytes = sum(c.nbytes for c in chunks)

    def decompress(nthreads: int) -> Callable[[], None]:
        def run() -> None:
            for data in compressed:
                blosc2.decompress2(data, dst=buf, nthreads=nthreads)

        return run

    t_d1 = _timeit(decompress(1), repeats, budget_s)
    t_d2 = _timeit(decompress(2), repeats, budget_s)
    t_one, via = _random_image_s(compressed, k, image_nbytes, int(resolved.typesize), buf, repeats, budget_s)  # type: ignore[arg-type]
    check = np.empty_like(chunks[0])
    blosc2.decompress2(compressed[0], dst=check)
    if not np.array_equal(check, chunks[0]):  # pragma: no cover - a blosc2 bug
        raise RuntimeError(f"{resolved.describe()}: round trip changed the pixels")
    name = filters_name if filters_name is not None else ("+".join(resolved.filters) or "none")
    return CodecResult(
        dataset=dataset,
        codec=resolved.codec,
        clevel=resolved.clevel,
        filters=name,
        typesize=int(resolved.typesize),  # type: ignore[arg-type]
        block_images=int(resolved.block_images),  # type: ignore[arg-type]
        chunk_images=k,
        nbytes=nbytes,
        cbytes=sum(len(c) for c in compressed),
        compress_mbs=nbytes / t_c / 1e6,
        decompress_mbs_1t=nbytes / t_d1 / 1e6,
        decompress_mbs_2t=nbytes / t_d2 / 1e6,
        random_image_us=t_one * 1e6,
        random_image_via=via,
    )


#: Random images decompressed one by one to time random access.
RANDOM_PICKS = 32


def _random_image_s(
    compressed: Sequence[bytes],
    k: int,
    image_nbytes: int,
    typesize: int,
    buf: np.ndarray,
    repeats: int,
    budget_s: float,
) -> tuple[float, str]:
    """Median seconds to decompress one random image out of ``compressed``, and how.

    ``"block"``: getitem decompresses the block holding it; ``"chunk"`` where getitem cannot
    (libblosc2 missing, bytedelta chunks): the whole chunk into ``buf``.
    """
    import blosc2

    from carraystore.format import blocks

    rng = np.random.default_rng(0)
    chunks = rng.integers(len(compressed), size=RANDOM_PICKS)
    items = rng.integers(k, size=RANDOM_PICKS)
    picks = [(compressed[int(c)], int(i)) for c, i in zip(chunks, items, strict=True)]
    lib = blocks.library()
    if lib is not None and image_nbytes % typesize == 0:
        reader = blocks.BlockReader(lib, typesize, image_nbytes)
        dest = np.empty(image_nbytes, dtype=np.uint8)
        addr = dest.ctypes.data

        def one_block() -> None:
            for data, i in picks:
                reader.get(data, len(data), i, addr)

        try:
            one_block()
        except ValueError:  # getitem refuses this chunk (bytedelta: filter pipeline error -18)
            pass
        else:
            return _timeit(one_block, repeats, budget_s) / len(picks), "block"

    def whole_chunk() -> None:
        for data, _i in picks:
            blosc2.decompress2(data, dst=buf, nthreads=1)

    return _timeit(whole_chunk, repeats, budget_s) / len(picks), "chunk"


def run_suite(
    samples: dict[str, np.ndarray],
    grid: Iterable[tuple[str, int, str, int | None, int]] | None = None,
    repeats: int = 3,
    progress: Callable[[str], None] | None = None,
) -> list[CodecResult]:
    """Measure every combination of ``grid`` (default: the full grid) on every sample."""
    combos = list(grid) if grid is not None else codec_grid()
    out = []
    for name, images in samples.items():
        for codec, lvl, fname, ts, b in combos:
            label = "shuffle-ts1" if ts == 1 and fname == "shuffle" else fname
            c = Codec(codec, lvl, filters=FILTERS[fname], typesize=ts, block_images=b)
            if ts is None and c.filters and not c.resolve(images.dtype, images.shape[1:]).filters:
                continue  # 1-byte pixels (grayscale uint8): resolve() drops the filters, the row would repeat "none"
            r = measure_codec(images, c, dataset=name, filters_name=label, repeats=repeats)
            out.append(r)
            if progress:
                progress(
                    f"{name}: {r.label} ratio {r.ratio:.3f} c {r.compress_mbs:.0f} d {r.decompress_mbs_1t:.0f} MB/s"
                )
    return out


# -- analysis ----------------------------------------------------------------------------


def pareto_front(results: Sequence[CodecResult], speed: str = "decompress_mbs_1t") -> list[CodecResult]:
    """Rows not beaten on both ratio and ``speed`` by another row, by falling speed."""
    rows = sorted(results, key=lambda r: (-getattr(r, speed), -r.ratio))
    front: list[CodecResult] = []
    best_ratio = -1.0
    for r in rows:
        if r.ratio > best_ratio:
            front.append(r)
            best_ratio = r.ratio
    return front


def memory_speed(results: Sequence[CodecResult]) -> float:
    """Memory-copy speed (MB/s) seen in the suite: the fastest clevel 0 decompression."""
    zero = [r.decompress_mbs_1t for r in results if r.clevel == 0]
    return max(zero) if zero else max(r.decompress_mbs_1t for r in results)


def throughput(r: CodecResult, read_mbs: float, cores: int = 2) -> float:
    """Modelled MB/s of images delivered when compressed bytes arrive at ``read_mbs``."""
    return 1.0 / (1.0 / (r.ratio * read_mbs) + 1.0 / (r.decompress_mbs_1t * cores))


def _regime_speed(results: Sequence[CodecResult], read: float | None) -> float:
    return memory_speed(results) if read is None else read


def _eligible(results: Sequence[CodecResult]) -> list[CodecResult]:
    return [
        r
        for r in results
        if r.clevel > 0
        and r.compress_mbs >= MIN_COMPRESS_MBS
        and r.filters != "shuffle-ts1"
        and r.ratio >= 1 / (1 - MIN_SAVING)
    ]


def _mean_by_combo(results: Sequence[CodecResult]) -> list[CodecResult]:
    """Average ratio and speeds of each combination over the datasets (harmonic for speeds)."""
    groups: dict[tuple[Any, ...], list[CodecResult]] = {}
    for r in results:
        groups.setdefault((r.codec, r.clevel, r.filters, r.typesize, r.block_images), []).append(r)
    out = []
    for rows in groups.values():
        nb = sum(r.nbytes for r in rows)
        cb = sum(r.cbytes for r in rows)

        def hmean(attr: str, rows: list[CodecResult] = rows, nb: int = nb) -> float:
            total: float = sum(r.nbytes / getattr(r, attr) for r in rows)
            return nb / total

        out.append(
            dataclasses.replace(
                rows[0],
                dataset="+".join(sorted({r.dataset for r in rows})),
                nbytes=nb,
                cbytes=cb,
                compress_mbs=hmean("compress_mbs"),
                decompress_mbs_1t=hmean("decompress_mbs_1t"),
                decompress_mbs_2t=hmean("decompress_mbs_2t"),
            )
        )
    return out


def choose_presets(
    results: Sequence[CodecResult], cores: int = 2, dataset: str | None = None
) -> dict[str, CodecResult]:
    """Pick ``fast``, ``balanced`` and ``small`` from measured rows.

    Best modelled throughput from the page cache, at 500 MB/s and at 50 MB/s. Within ``TIE``
    of the best, fast and small take the highest ratio, balanced the fastest compression.
    Rows of ``dataset`` if given, else averaged over datasets. Only rows with clevel > 0,
    pixel-view typesize, compression >= MIN_COMPRESS_MBS and MIN_SAVING saved qualify.
    """
    pool = [r for r in results if r.dataset == dataset] if dataset is not None else _mean_by_combo(results)
    rows = _eligible(pool)
    if not rows:
        raise InvalidInputError("no eligible codec rows to choose presets from")
    mem = memory_speed(pool)

    def best(read: float, prefer: Callable[[CodecResult], float]) -> CodecResult:
        # rows within TIE of the best modelled throughput are a tie (timing noise): ``prefer`` decides
        top = max(throughput(r, read, cores) for r in rows)
        return max((r for r in rows if throughput(r, read, cores) >= (1 - TIE) * top), key=prefer)

    return {
        "fast": best(mem, lambda r: r.ratio),
        "balanced": best(500.0, lambda r: r.compress_mbs),
        "small": best(50.0, lambda r: r.ratio),
    }


def recommend_preset(
    results: Sequence[CodecResult], read_mbs: float | None = None, cores: int | None = None
) -> tuple[str, dict[str, dict[str, float]]]:
    """The preset for ``results`` (``measure_presets``) at ``read_mbs`` (None: page cache), and each one's MB/s."""
    cores = cores or min(8, os.cpu_count() or 1)
    by_name = {r.dataset: r for r in results}
    mem = max(r.decompress_mbs_1t for r in results if r.dataset == "none") if "none" in by_name else 10000.0
    table: dict[str, dict[str, float]] = {}
    for name in PRESETS:
        r = by_name[name]
        table[name] = {regime: throughput(r, mem if read is None else read, cores) for regime, read in REGIMES.items()}
        if read_mbs is not None:
            table[name]["yours"] = throughput(r, read_mbs, cores)
    key = "yours" if read_mbs is not None else "warm page cache"
    best = max(PRESETS, key=lambda n: table[n][key])
    return best, table


def recommend_for_storage(
    results: Sequence[CodecResult],
    loader_mbs: dict[str, float],
    read_mbs: float | None = None,
    encoded: tuple[float, float] | None = None,
) -> tuple[str, str, dict[str, dict[str, float]]]:
    """The choice for data in the page cache, the one for storage read at ``read_mbs`` MB/s, and each
    candidate's modelled MB/s of images at every :data:`REGIMES` speed (and ``"yours"``).

    ``loader_mbs``: each preset's MB/s of pixels through the loader from the page cache on
    these cores (:func:`measure_loader`); a candidate delivers ``min(R x ratio, loader_mbs)``
    (:func:`~carraystore.format.codec.choice_for_storage`, ties to the fewer bytes).
    ``encoded``: the encoded layout's (ratio, loader MB/s) (:func:`measure_encoded_loader`),
    a candidate named ``"encoded"`` beside the presets; None: presets only.
    """
    by_name = {r.dataset: r for r in results}
    rates = {name: (by_name[name].ratio, loader_mbs[name]) for name in PRESETS if name in loader_mbs}
    if encoded is not None:
        rates["encoded"] = encoded
    table: dict[str, dict[str, float]] = {}
    for name, (ratio, mbs) in rates.items():
        table[name] = {regime: storage_delivers(read, ratio, mbs) for regime, read in REGIMES.items()}
        if read_mbs is not None:
            table[name]["yours"] = storage_delivers(read_mbs, ratio, mbs)
    warm = choice_for_storage(None, rates)
    cold = choice_for_storage(read_mbs, rates) if read_mbs is not None else warm
    return warm, cold, table


def measure_presets(images: np.ndarray, repeats: int = 3) -> list[CodecResult]:
    """Each preset (plus uncompressed, for the memory speed) on ``images``; ``dataset`` = preset name."""
    rows = [measure_codec(images, Codec("zstd", 0), dataset="none", repeats=repeats)]
    for name, codec in PRESETS.items():
        rows.append(measure_codec(images, codec, dataset=name, repeats=repeats))
    return rows


#: Bytes of the probe file :func:`measure_read_mbs` writes beside the data.
PROBE_BYTES = 64 << 20
#: Uncompressed bytes (at least four chunks) of the store :func:`measure_loader` reads.
LOADER_SAMPLE_BYTES = 16 << 20


def read_cold_s(path: str | os.PathLike[str], limit: int | None = None) -> tuple[float, int]:
    """Seconds to read ``path`` (its first ``limit`` bytes) from the disk, evicted from the page cache first,
    and the bytes read. (Pages another process holds mapped stay cached.)"""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        want = limit if limit is not None else os.fstat(fd).st_size
        got = 0
        t = time.perf_counter()
        while got < want:
            piece = os.read(fd, min(8 << 20, want - got))
            if not piece:
                break
            got += len(piece)
        return time.perf_counter() - t, got
    finally:
        os.close(fd)


def measure_read_mbs(path: str | os.PathLike[str], nbytes: int = PROBE_BYTES) -> tuple[float, str]:
    """The cold sequential read speed (MB/s) of the disk holding ``path``, and how it was measured.

    A probe file of ``nbytes`` is written in ``path`` (a folder) or beside it (a file),
    synced, evicted from the page cache, read back and removed. Where that folder cannot be
    written, a store file of at least ``nbytes`` is read instead (nothing written); else
    InvalidInputError asks for ``--read-mbs``.
    """
    if not hasattr(os, "posix_fadvise"):
        raise InvalidInputError("this OS has no posix_fadvise to read a file cold: give --read-mbs")
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    probe = folder / f".carraystore-read-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            block = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
            for _ in range(max(1, nbytes >> 20)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        seconds, got = read_cold_s(probe)
        how = f"a {got >> 20} MiB probe file written in {folder}, evicted from the page cache, read back, removed"
    except OSError as exc:
        if not (p.is_file() and p.stat().st_size >= nbytes):
            raise InvalidInputError(
                f"cannot measure the read speed of {folder} ({exc.strerror or exc}): give --read-mbs"
            ) from exc
        seconds, got = read_cold_s(p, nbytes)
        how = f"the first {got >> 20} MiB of {p.name}, evicted from the page cache, read back"
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
    return got / max(seconds, 1e-9) / 1e6, how


def _loader_sample_size(count: int, image_nbytes: int, chunk: int) -> int:
    """Images the loader measurement reads: :data:`LOADER_SAMPLE_BYTES` of pixels, at least four chunks."""
    return max(4 * chunk, LOADER_SAMPLE_BYTES // max(1, image_nbytes), count)


def _repeated(items: Sequence[Any], n: int) -> list[Any]:
    """``items`` repeated to ``n``."""
    return [items[i % len(items)] for i in range(n)]


def _loader_mbs(path: Path, image_nbytes: int, repeats: int) -> float:
    """MB/s of pixels ``Store.batches`` delivers from the store at ``path``: after one untimed epoch, the median
    of ``repeats`` block-shuffled epochs."""
    from carraystore.api.store import open_store

    with open_store(path) as store:
        n = len(store)
        batch = max(1, min(32, n // 4))
        times = []
        for e in range(repeats + 1):
            t = time.perf_counter()
            for _x, _y in store.batches(batch, seed=0, epoch=e):
                pass
            times.append(time.perf_counter() - t)
    return float(n * image_nbytes / statistics.median(times[1:]) / 1e6)


def measure_loader(images: np.ndarray, codec: Codec | str, repeats: int = 3) -> float:
    """MB/s of pixels ``Store.batches`` delivers from the page cache on this machine's cores.

    The sample, repeated to :data:`LOADER_SAMPLE_BYTES` (at least four chunks), is written
    as a store with ``codec`` in a temporary folder; after one untimed epoch, the median of
    ``repeats`` block-shuffled epochs counts.
    """
    import tempfile

    from carraystore.format.codec import default_chunk_images
    from carraystore.store.writer import create

    images = np.ascontiguousarray(images)
    image_nbytes = max(1, images[0].nbytes)
    codec = Codec.preset(codec) if isinstance(codec, str) else codec
    resolved = codec.resolve(images.dtype, images.shape[1:])
    chunk = default_chunk_images(image_nbytes, int(resolved.block_images or 1))
    n = _loader_sample_size(len(images), image_nbytes, chunk)
    reps = -(-n // len(images))
    sample = np.concatenate([images] * reps)[:n] if reps > 1 else images[:n]
    with tempfile.TemporaryDirectory(prefix="carraystore-bench-") as d:
        path = Path(d) / "sample.b2nd"
        with create(path, sample.shape[1:], dtype=sample.dtype, codec=codec) as w:
            w.append(sample)
        return _loader_mbs(path, image_nbytes, repeats)


def measure_encoded_loader(
    entries: Sequence[bytes], encoding: Any, image_shape: Sequence[int], repeats: int = 3
) -> tuple[float, float]:
    """The encoded layout (FORMAT.md 10) through the loader, as :func:`measure_loader` measures a preset:
    (ratio of pixel bytes to its chunk bytes, MB/s of pixels ``Store.batches`` delivers from the page cache).

    ``entries`` (the JPEG/PNG files as ``ingest --layout encoded`` keeps them,
    :func:`carraystore.cli.benchmarks.layout.sample_entries`), repeated to
    :data:`LOADER_SAMPLE_BYTES` of pixels, are written as an encoded store in a temporary folder.
    """
    import tempfile

    from carraystore.format.codec import default_chunk_images
    from carraystore.store.writer import create

    if not entries:
        raise InvalidInputError("measure_encoded_loader needs at least one entry")
    shape = tuple(int(x) for x in image_shape)
    image_nbytes = max(1, math.prod(shape))
    n = _loader_sample_size(len(entries), image_nbytes, default_chunk_images(image_nbytes, 1, "encoded"))
    from carraystore.store.reader import StoreReader, open_store

    with tempfile.TemporaryDirectory(prefix="carraystore-bench-") as d:
        # the ratio from the sample as it is (repeated entries would compress into each other), the speed repeated
        for name, items in (("ratio.b2nd", list(entries)), ("sample.b2nd", _repeated(entries, n))):
            with create(Path(d) / name, shape, layout="encoded", encoding=encoding) as w:
                w.append_encoded(items)
        store: StoreReader
        with open_store(Path(d) / "ratio.b2nd") as store:
            stored = sum(store.chunk_byte_range(c)[1] for c in range(store.nchunks))
        return len(entries) * image_nbytes / max(1, stored), _loader_mbs(Path(d) / "sample.b2nd", image_nbytes, repeats)


@dataclass(frozen=True)
class EncodedCandidate:
    """The sample of ``bench codecs`` and, where the encoded layout can hold it, its entries."""

    images: np.ndarray
    #: the entries ``ingest --layout encoded`` would store (None: the encoded layout is not a candidate)
    entries: list[bytes] | None
    encoding: Any
    #: the entries' formats (e.g. ``32 jpeg``), or why the encoded layout is not a candidate
    note: str


def encoded_candidate(
    path: str | os.PathLike[str], n: int = 128, seed: int = 0, image_size: tuple[int, int] | None = None
) -> EncodedCandidate:
    """:func:`load_sample`'s images of ``path`` and, for a folder of image files or an encoded store, the same
    images' entries in the encoded layout; a store of pixels gives no entries (a note says why)."""
    p = Path(path)
    encoded_store = False
    if p.suffix == ".b2nd" and p.is_file():
        from carraystore.store.reader import StoreReader, open_store

        store: StoreReader
        with open_store(p) as store:
            encoded_store = store.meta.layout == "encoded"
    if p.is_dir() or encoded_store:
        from carraystore.cli.benchmarks.layout import entry_formats, sample_entries

        images, entries, encoding = sample_entries(p, n, seed, image_size)
        whose = "the store's entries" if encoded_store else "the files as ingest --layout encoded keeps them"
        return EncodedCandidate(images, entries, encoding, f"{entry_formats(entries, images[0].nbytes)}, {whose}")
    images = load_sample(p, n, seed, image_size)
    return EncodedCandidate(
        images, None, None, f"{p.name} holds pixels, not JPEG/PNG files the encoded layout would keep"
    )


# -- output ------------------------------------------------------------------------------


def _us(value: float, via: str = "") -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:,.0f}" + (" (whole chunk)" if via == "chunk" else "")


def block_table(results: Sequence[CodecResult], families: Iterable[tuple[str, int, str, int]] | None = None) -> str:
    """Per (codec, clevel, filters, typesize) family, each block size: ratio, chunk MB/s, random image µs."""
    groups: dict[tuple[str, int, str, int], dict[int, CodecResult]] = {}
    for r in results:
        if r.clevel > 0:
            groups.setdefault((r.codec, r.clevel, r.filters, r.typesize), {})[r.block_images] = r
    if families is None:
        keys = [k for k, g in groups.items() if len(g) > 1]
        keys.sort(key=lambda k: -groups[k][max(groups[k])].ratio)
    else:
        keys = [k for k in families if k in groups]
    sizes = sorted({b for k in keys for b in groups[k]})
    head = "| combination | " + " | ".join(f"b{b}: ratio | b{b}: chunk MB/s | b{b}: 1 image µs" for b in sizes) + " |"
    lines = [head, "|---|" + "---:|" * (3 * len(sizes))]
    for key in keys:
        codec, clevel, filters, ts = key
        ts_label = f" ts{ts}" if filters != "none" else ""
        cells = [f"{codec}-{clevel} {filters}{ts_label}"]
        for b in sizes:
            row = groups[key].get(b)
            cells += (
                ["-", "-", "-"]
                if row is None
                else [
                    f"{row.ratio:.3f}",
                    f"{row.decompress_mbs_1t:,.0f}",
                    _us(row.random_image_us, row.random_image_via),
                ]
            )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def block_families(
    results: Sequence[CodecResult], front: Iterable[CodecResult] = ()
) -> list[tuple[str, int, str, int]]:
    """The combinations worth a block-size comparison: those of ``front`` rows, then the presets' codecs."""
    keys: list[tuple[str, int, str, int]] = []
    preset_codecs = {(c.codec, c.clevel, c.filters) for c in PRESETS.values()}
    picked = list(front) + [r for r in results if (r.codec, r.clevel, FILTERS.get(r.filters)) in preset_codecs]
    for r in picked:
        key = (r.codec, r.clevel, r.filters, r.typesize)
        if r.clevel > 0 and key not in keys:
            keys.append(key)
    return keys


def results_table(results: Sequence[CodecResult], front: Iterable[CodecResult] = ()) -> str:
    """A markdown table of the rows (Pareto-front rows marked with *)."""
    marks = {id(r) for r in front}
    lines = [
        "| dataset | codec | clevel | filters | typesize | block imgs | ratio | compress MB/s | decompress MB/s 1t | decompress MB/s 2t | 1 random image µs | Pareto |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in results:
        codec = "none" if r.clevel == 0 else r.codec
        lines.append(
            f"| {r.dataset} | {codec} | {r.clevel} | {r.filters} | {r.typesize} | {r.block_images} | {r.ratio:.3f} | "
            f"{r.compress_mbs:.0f} | {r.decompress_mbs_1t:.0f} | {r.decompress_mbs_2t:.0f} | {_us(r.random_image_us, r.random_image_via)} | "
            f"{'*' if id(r) in marks else ''} |"
        )
    return "\n".join(lines) + "\n"


def plot_results(results: Sequence[CodecResult], path: str | os.PathLike[str], title: str = "") -> Path | None:
    """Ratio against decompression speed, one panel per dataset; the PNG path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    datasets = sorted({r.dataset for r in results})
    fig, axes = plt.subplots(1, len(datasets), figsize=(6.5 * len(datasets), 5.2), squeeze=False)
    colors = {"blosclz": "tab:blue", "lz4": "tab:orange", "lz4hc": "tab:green", "zlib": "tab:red", "zstd": "tab:purple"}
    markers = {"none": "o", "shuffle": "s", "bitshuffle": "^", "shuffle+bytedelta": "D", "shuffle-ts1": "x"}
    for ax, ds in zip(axes[0], datasets, strict=True):
        rows = [r for r in results if r.dataset == ds]
        for r in rows:
            color = "black" if r.clevel == 0 else colors.get(r.codec, "gray")
            ax.scatter(
                r.decompress_mbs_1t,
                r.ratio,
                c=color,
                marker=markers.get(r.filters, "o"),
                s=12 + 6 * r.block_images**0.5,
                alpha=0.6,
            )
        front = pareto_front(rows)
        ax.plot([r.decompress_mbs_1t for r in front], [r.ratio for r in front], "k--", lw=1, label="Pareto front")
        span = max(r.ratio for r in rows) - min(r.ratio for r in rows) or 1.0
        last: tuple[float, float] | None = None
        for r in front:  # label front points that do not crowd the previous label
            x, y = math.log10(r.decompress_mbs_1t), r.ratio
            if last is None or abs(x - last[0]) > 0.12 or abs(y - last[1]) > 0.06 * span:
                ax.annotate(
                    r.label, (r.decompress_mbs_1t, r.ratio), fontsize=6, xytext=(3, 3), textcoords="offset points"
                )
                last = (x, y)
        smallest_block = min(r.block_images for r in rows)
        for name, codec in PRESETS.items():  # the pinned presets (automatic blocks: shown at the smallest block size)
            hit = [
                r
                for r in rows
                if (r.codec, r.clevel, FILTERS.get(r.filters)) == (codec.codec, codec.clevel, codec.filters)
                and r.block_images == smallest_block
            ]
            for r in hit:
                ax.scatter(
                    r.decompress_mbs_1t,
                    r.ratio,
                    marker="*",
                    s=220,
                    facecolors="none",
                    edgecolors="black",
                    linewidths=1.2,
                )
                offset = {"small": (-30, 10), "balanced": (-20, -16)}.get(name, (-10, -14))
                ax.annotate(
                    f"preset {name}",
                    (r.decompress_mbs_1t, r.ratio),
                    fontsize=8,
                    fontweight="bold",
                    xytext=offset,
                    textcoords="offset points",
                )
        ax.set_xscale("log")
        ax.set_xlabel("decompression MB/s (1 thread, log)")
        ax.set_ylabel("compression ratio")
        ax.set_title(f"{ds}")
        ax.grid(True, alpha=0.3)
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, marker="o", ls="", label=n) for n, c in colors.items()]
    handles += [Line2D([], [], color="gray", marker=m, ls="", label=f) for f, m in markers.items()]
    handles.append(Line2D([], [], color="black", marker="o", ls="", label="no compression"))
    handles.append(Line2D([], [], color="black", ls="--", label="Pareto front"))
    axes[0][-1].legend(handles=handles, fontsize=7, loc="best")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_results(
    results: Sequence[CodecResult],
    out_dir: str | os.PathLike[str],
    info: dict[str, Any] | None = None,
    stem: str = "codecs",
) -> dict[str, Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` under ``out_dir``; return their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fronts = {ds: pareto_front([r for r in results if r.dataset == ds]) for ds in sorted({r.dataset for r in results})}
    all_front = [r for f in fronts.values() for r in f]
    basis = "photos" if any(r.dataset == "photos" for r in results) else None
    chosen = choose_presets(results, dataset=basis)
    payload = {
        "info": info or {},
        "results": [r.to_dict() for r in results],
        "pareto": {ds: [r.label for r in f] for ds, f in fronts.items()},
        "chosen_presets": {k: v.codec_obj().to_config() | {"label": v.label} for k, v in chosen.items()},
        "chosen_from": basis or "all datasets, averaged",
        "memory_speed_mbs": memory_speed(results),
    }
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, paths["json"])
    md = [f"# Codec suite{(' — ' + info['title']) if info and info.get('title') else ''}", ""]
    if info:
        md += [f"- {k}: {v}" for k, v in info.items() if k != "title"] + [""]
    md += ["Rows on a dataset's Pareto front (ratio against 1-thread decompression) are marked *.", ""]
    md.append(results_table(results, all_front))
    md += ["", f"## Presets chosen from these rows ({basis or 'all datasets, averaged'})", ""]
    md += [f"- `{k}`: {v.label}" for k, v in chosen.items()]
    paths["md"].write_text("\n".join(md) + "\n")
    png = plot_results(results, out / f"{stem}.png", title=(info or {}).get("title", ""))
    if png is not None:
        paths["png"] = png
    return paths


# -- samples -----------------------------------------------------------------------------


def load_sample(
    path: str | os.PathLike[str], n: int = 128, seed: int = 0, image_size: tuple[int, int] | None = None
) -> np.ndarray:
    """Up to ``n`` images (n, H, W, C): a seeded subset of a folder, or consecutive ones of a ``.b2nd`` store."""
    from carraystore.cli.benchmarks.datasets import decode_images, list_image_folder

    p = Path(path)
    if p.is_dir():
        folder = list_image_folder(p, limit=n, seed=seed)
        return decode_images(folder.files, image_size)
    if p.suffix == ".b2nd" and p.is_file():
        from carraystore.store.reader import StoreReader, open_store

        store: StoreReader = open_store(p)
        if store.meta.layout != "NHWC":
            raise InvalidInputError(
                f"{p}: the codec suite needs an image store (layout NHWC), this one is {store.meta.layout!r}"
            )
        total = len(store)
        n = min(n, total)
        k = store.chunk_images
        starts = list(range(0, max(1, total - n + 1), k))
        start = starts[int(np.random.default_rng(seed).integers(len(starts)))]
        images: np.ndarray = store[start : start + n]
        return images
    raise InvalidInputError(f"{p}: give a folder of images or a .b2nd store")
