"""Decoding at a smaller size (the loader's ``image_size=``): images/s per core at 1, 1/2, 1/4, 1/8.

Real-photo JPEGs (crops of the scikit-image photographs, quality 90, 4:2:0, as
``carraystore.ingest.sample_data`` makes them) are decoded the way the reader decodes an encoded
chunk's entries, by ``carraystore.format.encoded.decode_entry`` into a preallocated buffer of the
reduced size, with each decoder forced in turn:

* ``simplejpeg``: libjpeg-turbo's scaled IDCT through simplejpeg (``min_height``/``min_width``),
  straight into the buffer;
* ``pillow``: ``Image.draft`` (the same scaled IDCT in Pillow's libjpeg-turbo) + ``convert``
  + a copy.

The first table is CPU time of one thread (``time.thread_time``) turned into images/s per
core, the median of interleaved rounds; the identity column counts photos whose reduced
pixels are the same through both decoders (it must be all of them). The second table is
the whole chunk path as the loader's decoder threads run it (CRC, decompression, entries
decoded in place, or the pixel store's box average), per core, for an encoded store of the
same files and a pixel store (``balanced``) of their pixels: what ``carraystore bench layout
--decode-size`` reports. The load average is recorded: other processes share the machine.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from datetime import date
from pathlib import Path

import numpy as np
from benchpaths import data_dir, write_json

import carraystore.format.encoded as E
from bench.benchdata import cached_photo_folder
from bench.loaders.machine import library_versions, machine_info

SCALE = os.environ.get("CARRAYSTORE_BENCH_SCALE", "default")
SCALES = {
    "tiny": dict(n=16, sizes=(64,), rounds=1, factors=(1, 2, 4, 8)),
    "small": dict(n=100, sizes=(256, 512), rounds=5, factors=(1, 2, 4, 8)),
    "default": dict(n=200, sizes=(256, 512), rounds=5, factors=(1, 2, 4, 8)),
    "large": dict(n=400, sizes=(256, 512, 1024), rounds=7, factors=(1, 2, 4, 8)),
}
if SCALE not in SCALES:
    raise ValueError(f"CARRAYSTORE_BENCH_SCALE={SCALE!r}: use one of {sorted(SCALES)}")
CFG = SCALES[SCALE]
DECODERS = ("simplejpeg", "pillow")

_CHOSEN: dict[str, E.JpegDecoder] = {}


def _force(name: str) -> None:
    """Make decode_entry use ``name`` for JPEGs (at every size) in this process."""
    import PIL

    if not _CHOSEN:
        E._jpeg_decoder = None
        _CHOSEN["simplejpeg"] = E.jpeg_decoder()
        assert _CHOSEN["simplejpeg"].name == "simplejpeg" and _CHOSEN["simplejpeg"].scaled, _CHOSEN["simplejpeg"]
        _CHOSEN["pillow"] = E.JpegDecoder("pillow", PIL.__version__, "forced by the benchmark")
    E._jpeg_decoder = _CHOSEN[name]


def cpu_us_per_image(decoder: str, entries: list[bytes], size: int, k: int) -> float:
    """CPU microseconds (this thread) per image of decode_entry at 1/k."""
    _force(decoder)
    out = np.empty((size // k, size // k, 3), np.uint8)
    t0 = time.thread_time()
    for e in entries:
        E.decode_entry(e, out, "rgb", ("jpeg",), str, k)
    return (time.thread_time() - t0) / len(entries) * 1e6


def identical(entries: list[bytes], size: int, k: int) -> int:
    same = 0
    a = np.empty((size // k, size // k, 3), np.uint8)
    b = np.empty_like(a)
    for e in entries:
        _force("pillow")
        E.decode_entry(e, a, "rgb", ("jpeg",), str, k)
        _force("simplejpeg")
        E.decode_entry(e, b, "rgb", ("jpeg",), str, k)
        same += bool(np.array_equal(a, b))
    return same


def chunk_rates(folder: Path, size: int, factors: tuple[int, ...], rounds: int) -> list[dict[str, object]]:
    """Per core images/s of the loader's chunk path at each factor, encoded and pixel stores."""
    from carraystore.cli.benchmarks.datasets import decode_images, list_image_folder
    from carraystore.cli.benchmarks.layout import _decode_rate
    from carraystore.format.codec import default_chunk_images
    from carraystore.store.writer import create

    files = list_image_folder(folder).files
    pixels = decode_images(files)
    nb = size * size * 3
    k = min(len(files), default_chunk_images(nb, 1, "encoded"), default_chunk_images(nb))
    n = len(files) // k * k
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="carraystore-reduced-") as tmp:
        root = Path(tmp)
        with create(root / "e.b2nd", (size, size, 3), chunk_images=k, layout="encoded") as w:
            w.append_encoded([f.read_bytes() for f in files[:n]])
        with create(root / "p.b2nd", (size, size, 3), codec="balanced", chunk_images=k) as w:
            w.append(pixels[:n])
        for layout, path in (("encoded", root / "e.b2nd"), ("pixels (balanced)", root / "p.b2nd")):
            for f in factors:
                rate = _decode_rate(path, rounds, f)[1]
                rows.append({"size": size, "layout": layout, "factor": f, "images_per_s_per_core": round(rate)})
    return rows


def test_reduced_decode(benchmark) -> None:
    import simplejpeg
    from PIL import features

    load_before = os.getloadavg()
    rows = []
    chunk_rows: list[dict[str, object]] = []
    try:
        for size in CFG["sizes"]:
            folder = cached_photo_folder(data_dir(), CFG["n"], size=(size, size))
            sample = [p.read_bytes() for p in sorted(folder.rglob("*.jpg"))]
            same = {k: identical(sample, size, k) for k in CFG["factors"]}
            cpu: dict[tuple[str, int], list[float]] = {(d, k): [] for d in DECODERS for k in CFG["factors"]}
            for r in range(CFG["rounds"]):
                for d in DECODERS if r % 2 == 0 else DECODERS[::-1]:
                    for k in CFG["factors"]:
                        cpu[d, k].append(cpu_us_per_image(d, sample, size, k))
            for d in DECODERS:
                full = statistics.median(cpu[d, 1])
                for k in CFG["factors"]:
                    us = statistics.median(cpu[d, k])
                    rows.append(
                        {
                            "size": size,
                            "decoder": d,
                            "factor": k,
                            "out": f"{size // k}x{size // k}",
                            "us_per_image": round(us, 1),
                            "images_per_s_per_core": round(1e6 / us),
                            "speedup_over_full": round(full / us, 2),
                            "identical": f"{same[k]}/{len(sample)}",
                        }
                    )
            assert all(v == len(sample) for v in same.values()), same
            E._jpeg_decoder = None
            E.jpeg_decoder()  # decided (and checked) before the timing starts
            chunk_rows += chunk_rates(folder, size, CFG["factors"], CFG["rounds"])
    finally:
        E._jpeg_decoder = None
    load_after = os.getloadavg()
    small = CFG["sizes"][0]
    entries = [p.read_bytes() for p in cached_photo_folder(data_dir(), CFG["n"], size=(small, small)).rglob("*.jpg")]
    benchmark.pedantic(cpu_us_per_image, args=("simplejpeg", entries, small, 2), rounds=1, iterations=1)
    E._jpeg_decoder = None

    info = {
        "scale": SCALE,
        "date": date.today().isoformat(),
        "photos_per_size": CFG["n"],
        "rounds": CFG["rounds"],
        "machine": machine_info(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "versions": {
            **library_versions(),
            "simplejpeg": simplejpeg.__version__,
            "libjpeg-turbo (Pillow)": features.version("libjpeg_turbo"),
        },
        "rows": rows,
        "chunk_rows": chunk_rows,
    }
    out = write_json(SCALE, "reduced_decode.json", info)
    m = info["machine"]
    lines = [
        f"# Decoding at a smaller size: images/s per core ({SCALE})",
        "",
        f"{CFG['n']} real-photo JPEGs per size (quality 90, 4:2:0); `encoded.decode_entry(..., scale)` into a "
        f"preallocated buffer of the reduced size; CPU time of one thread, median of {CFG['rounds']} interleaved "
        f"rounds. Machine: {m['cpus']} cores ({m['cpu']}), Python {m['python']}; Pillow "
        f"{info['versions'].get('pillow')} (libjpeg-turbo {info['versions']['libjpeg-turbo (Pillow)']}), "
        f"simplejpeg {simplejpeg.__version__}; {info['date']}. Load average (1, 5, 15 min) "
        f"{info['load_average_before']} before, {info['load_average_after']} after: other processes shared the "
        "machine, so absolute rates are low by as much; the ratios between rows of one run are what to read.",
        "",
        "| size | decoder | output | µs/image | images/s per core | vs full size | identical to Pillow's draft |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
        *[
            f"| {r['size']} | {r['decoder']} | {r['out']} | {r['us_per_image']:,} | {r['images_per_s_per_core']:,} | "
            f"{r['speedup_over_full']:.2f}x | {r['identical']} |"
            for r in rows
        ],
        "",
        "The loader's chunk path, one core (CRC, decompression, entries decoded in place or the pixels "
        "box-averaged): images/s per core by output size.",
        "",
        "| size | layout | " + " | ".join(f"1/{k}" for k in CFG["factors"]) + " |",
        "| ---: | --- |" + " ---: |" * len(CFG["factors"]),
    ]
    for size in CFG["sizes"]:
        for layout in ("encoded", "pixels (balanced)"):
            got = {
                r["factor"]: r["images_per_s_per_core"]
                for r in chunk_rows
                if r["size"] == size and r["layout"] == layout
            }
            lines.append(f"| {size} | {layout} | " + " | ".join(f"{got[k]:,}" for k in CFG["factors"]) + " |")
    lines.append("")
    (out / "reduced_decode.md").write_text("\n".join(lines))
    print("\n" + "\n".join(lines))
