"""JPEG entries of the encoded layout: Pillow against simplejpeg, images/s per thread.

Real-photo JPEGs (crops of the scikit-image photographs, saved by Pillow at quality 90,
4:2:0, as ``carraystore.ingest.sample_data`` makes them) at 128x128 and 256x256 are decoded the way
the reader decodes an encoded chunk's entries, by ``carraystore.format.encoded.decode_entry`` into
a preallocated (H, W, 3) buffer, with each decoder forced in turn:

* ``pillow``: ``Image.open`` + ``convert("RGB")`` + a copy into the buffer (FORMAT.md 10.2);
* ``simplejpeg``: libjpeg-turbo through simplejpeg, straight into the buffer (``buffer=``).

Each row runs T threads at once (1, 2 and, on a larger machine, 8), every thread decoding
the sample (repeated to at least ~1,200 images of 128x128 worth of pixels) into its own
buffer; images/s counts all threads' images, and the scaling column is images/s at T
threads over T times the 1-thread rate (1.00: nothing serialises the threads, the GIL
included). Rounds are interleaved (decoders alternate) and the median counts, the best
beside it. A second table gives the CPU time (``time.thread_time``, one thread) per image
of each step: ``decode_entry`` with either decoder, simplejpeg alone into the buffer,
simplejpeg returning a new array that is then copied (what ``buffer=`` saves), and the
header read that comes first. Before timing, every photo is decoded by both and compared:
the identity column counts photos whose pixels are equal, which must be all of them.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from datetime import date

import numpy as np
from benchpaths import data_dir, results_dir, write_json

import carraystore.format.encoded as E
from bench.benchdata import cached_photo_folder
from bench.loaders.machine import library_versions, machine_info

SCALE = os.environ.get("CARRAYSTORE_BENCH_SCALE", "default")
SCALES = {
    # tiny (the smoke test): a sample repeated to ~60 images of 128x128 worth, not ~1,200
    "tiny": dict(n=16, sizes=(32,), rounds=1, images_128=60),
    "small": dict(n=200, sizes=(128, 256), rounds=3),
    "default": dict(n=400, sizes=(128, 256), rounds=7),
    "large": dict(n=1000, sizes=(128, 256, 512), rounds=7),
}
if SCALE not in SCALES:
    raise ValueError(f"CARRAYSTORE_BENCH_SCALE={SCALE!r}: use one of {sorted(SCALES)}")
CFG = SCALES[SCALE]
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
THREADS = sorted({1, 2, *([min(8, CPUS)] if CPUS > 2 else [])})
DECODERS = ("pillow", "simplejpeg")
STEPS = ("decode_entry pillow", "decode_entry simplejpeg", "simplejpeg buffer=", "simplejpeg + copy", "header only")


_CHOSEN: dict[str, E.JpegDecoder] = {}


def _force(name: str) -> None:
    """Make decode_entry use ``name`` for JPEGs in this process."""
    import PIL

    if not _CHOSEN:
        E._jpeg_decoder = None
        _CHOSEN["simplejpeg"] = E.jpeg_decoder()
        assert _CHOSEN["simplejpeg"].name == "simplejpeg", _CHOSEN["simplejpeg"].reason
        _CHOSEN["pillow"] = E.JpegDecoder("pillow", PIL.__version__, "forced by the benchmark")
    E._jpeg_decoder = _CHOSEN[name]


def _worker(name: str, entries: list[bytes], out: np.ndarray) -> None:
    for e in entries:
        E.decode_entry(e, out, "rgb", ("jpeg",), str)


def cpu_us_per_image(step: str, entries: list[bytes], size: int) -> float:
    """CPU microseconds (this thread) per image of one step."""
    import simplejpeg

    out = np.empty((size, size, 3), np.uint8)
    if step.startswith("decode_entry"):
        _force(step.split()[1])
    t0 = time.thread_time()
    if step.startswith("decode_entry"):
        _worker("", entries, out)
    elif step == "simplejpeg buffer=":
        for e in entries:
            simplejpeg.decode_jpeg(e, "RGB", buffer=out)
    elif step == "simplejpeg + copy":
        for e in entries:
            out[...] = simplejpeg.decode_jpeg(e, "RGB")
    else:
        for e in entries:
            simplejpeg.decode_jpeg_header(e)
    return (time.thread_time() - t0) / len(entries) * 1e6


def images_per_s(name: str, entries: list[bytes], size: int, threads: int) -> float:
    """Images/s of ``threads`` threads each decoding all ``entries`` at once."""
    _force("pillow" if name == "pillow" else "simplejpeg")
    outs = [np.empty((size, size, 3), np.uint8) for _ in range(threads)]
    start = threading.Barrier(threads + 1)

    def run(out: np.ndarray) -> None:
        start.wait()
        _worker(name, entries, out)

    ts = [threading.Thread(target=run, args=(o,)) for o in outs]
    for t in ts:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in ts:
        t.join()
    return threads * len(entries) / (time.perf_counter() - t0)


def identical(entries: list[bytes], size: int) -> int:
    """How many entries decode to the same pixels through both decoders."""
    same = 0
    a = np.empty((size, size, 3), np.uint8)
    b = np.empty((size, size, 3), np.uint8)
    for e in entries:
        _force("pillow")
        E.decode_entry(e, a, "rgb", ("jpeg",), str)
        _force("simplejpeg")
        E.decode_entry(e, b, "rgb", ("jpeg",), str)
        same += bool(np.array_equal(a, b))
    return same


def test_jpeg_decode(benchmark) -> None:
    import simplejpeg
    from PIL import features

    rows = []
    cpu_rows = []
    try:
        for size in CFG["sizes"]:
            folder = cached_photo_folder(data_dir(), CFG["n"], size=(size, size))
            sample = [p.read_bytes() for p in sorted(folder.rglob("*.jpg"))]
            same = identical(sample, size)
            work = CFG.get("images_128", 1200)  # ~0.5 s of Pillow, 1 thread
            entries = sample * max(1, -(-int(work * (128 / size) ** 2) // len(sample)))
            cpu: dict[str, list[float]] = {k: [] for k in STEPS}
            for r in range(CFG["rounds"]):
                for k in STEPS if r % 2 == 0 else STEPS[::-1]:
                    cpu[k].append(cpu_us_per_image(k, sample, size))
            cpu_rows.append({"size": size, **{k: round(statistics.median(v), 1) for k, v in cpu.items()}})
            rates: dict[tuple[str, int], list[float]] = {(d, t): [] for d in DECODERS for t in THREADS}
            images_per_s("pillow", entries[:8], size, 1)  # warm-up: imports, the check, the page cache
            for r in range(CFG["rounds"]):
                for d in DECODERS if r % 2 == 0 else DECODERS[::-1]:
                    for t in THREADS:
                        rates[d, t].append(images_per_s(d, entries, size, t))
            for d in DECODERS:
                one = statistics.median(rates[d, 1])
                for t in THREADS:
                    med = statistics.median(rates[d, t])
                    rows.append(
                        {
                            "size": size,
                            "decoder": d,
                            "threads": t,
                            "images_per_s_median": round(med),
                            "images_per_s_best": round(max(rates[d, t])),
                            "per_thread_median": round(med / t),
                            "scaling": round(med / (t * one), 3),
                            "identical": f"{same}/{len(sample)}",
                            "mean_jpeg_kb": round(sum(map(len, sample)) / len(sample) / 1e3, 2),
                        }
                    )
            assert same == len(sample), f"{len(sample) - same} photos decode differently at {size}px"
    finally:
        E._jpeg_decoder = None
    small = CFG["sizes"][0]
    benchmark.pedantic(
        images_per_s,
        args=(
            "simplejpeg",
            [p.read_bytes() for p in cached_photo_folder(data_dir(), CFG["n"], size=(small, small)).rglob("*.jpg")],
            small,
            1,
        ),
        rounds=1,
        iterations=1,
    )

    by = {(r["size"], r["decoder"], r["threads"]): r for r in rows}
    speedup = {
        f"{s}px {t}t": round(
            by[s, "simplejpeg", t]["images_per_s_median"] / by[s, "pillow", t]["images_per_s_median"], 2
        )
        for s in CFG["sizes"]
        for t in THREADS
    }
    info = {
        "scale": SCALE,
        "date": date.today().isoformat(),
        "photos_per_size": CFG["n"],
        "rounds": CFG["rounds"],
        "threads": THREADS,
        "machine": machine_info(),
        "versions": {
            **library_versions(),
            "simplejpeg": simplejpeg.__version__,
            "libjpeg-turbo (Pillow)": features.version("libjpeg_turbo"),
        },
        "speedup_simplejpeg_over_pillow": speedup,
        "rows": rows,
        "cpu_us_per_image": cpu_rows,
    }
    benchmark.extra_info.update({"speedup": speedup})
    out = write_json(SCALE, "jpeg_decode.json", info)
    m = info["machine"]
    lines = [
        f"# JPEG entries: Pillow against simplejpeg ({SCALE})",
        "",
        f"{CFG['n']} real-photo JPEGs per size (quality 90, 4:2:0); `encoded.decode_entry` into a preallocated "
        f"buffer; {CFG['rounds']} interleaved rounds, median (best). Machine: {m['cpus']} cores ({m['cpu']}), "
        f"Python {m['python']}; Pillow {info['versions'].get('pillow')} (libjpeg-turbo "
        f"{info['versions']['libjpeg-turbo (Pillow)']}), simplejpeg {simplejpeg.__version__}; {info['date']}.",
        "",
        "| size | decoder | threads | images/s (best) | per thread | scaling | identical to Pillow |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
        *[
            f"| {r['size']} | {r['decoder']} | {r['threads']} | {r['images_per_s_median']:,} "
            f"({r['images_per_s_best']:,}) | {r['per_thread_median']:,} | {r['scaling']:.2f} | {r['identical']} |"
            for r in rows
        ],
        "",
        "simplejpeg over Pillow (median images/s): " + ", ".join(f"{k}: {v:.2f}x" for k, v in speedup.items()),
        "",
        "CPU microseconds per image, one thread (median of the rounds):",
        "",
        "| size | " + " | ".join(STEPS) + " |",
        "| ---: |" + " ---: |" * len(STEPS),
        *[f"| {c['size']} | " + " | ".join(f"{c[k]:.1f}" for k in STEPS) + " |" for c in cpu_rows],
        "",
    ]
    (out / "jpeg_decode.md").write_text("\n".join(lines))
    print("\n" + "\n".join(lines))


def test_layout_recommendation(benchmark) -> None:
    """``carraystore bench layout`` on the same photos at each size, for this machine's cores."""
    from carraystore.cli.benchmarks.layout import measure_layouts, report_text

    E._jpeg_decoder = None
    sample = min(CFG["n"], 256)
    reports = [
        measure_layouts(
            str(cached_photo_folder(data_dir(), CFG["n"], size=(s, s))), sample, preset=preset, repeats=CFG["rounds"]
        )
        for s in CFG["sizes"]
        for preset in ("balanced", "fast")
    ]
    benchmark.extra_info.update(
        {f"{r.image_shape[0]}px {r.preset} break-even Mbit/s": r.break_even_mbit()[0] for r in reports}
    )
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    out = results_dir(SCALE)
    out.mkdir(parents=True, exist_ok=True)
    info = {
        "scale": SCALE,
        "date": date.today().isoformat(),
        "machine": machine_info(),
        "reports": [r.to_dict() for r in reports],
    }
    (out / "layout.json").write_text(json.dumps(info, indent=2) + "\n")
    text = "\n\n".join(report_text(r).replace(str(data_dir()), "bench/out/data") for r in reports)
    m = info["machine"]
    head = (
        f"# `carraystore bench layout` on real photos ({SCALE})\n\n"
        f"Machine: {m['cpus']} cores ({m['cpu']}), Python {m['python']}; {info['date']}. "
        f"Real-photo JPEGs (quality 90, 4:2:0), {sample} per size, against the pixel layout with the balanced "
        "(default) and the fast preset.\n\n"
    )
    (out / "layout.md").write_text(head + text.replace("\n# ", "\n## ").replace("# Layout", "## Layout", 1) + "\n")
    print("\n" + text)
