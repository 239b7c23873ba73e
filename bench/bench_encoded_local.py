"""The encoded layout, local and warm, against a PyTorch ``DataLoader`` over the same JPEG files.

One folder of real-photo JPEGs (crops of the scikit-image photographs, as
``carraystore.ingest.sample_data`` makes them), side by side in one process, interleaved rounds,
the same number of cores for both:

* ``carraystore encoded``: ``from_directory(..., layout="encoded")`` keeps each file's bytes;
  ``store.batches(B, num_threads=T)`` block-shuffled epochs, decoded in the loader's threads
  (simplejpeg where checked against Pillow, else Pillow);
* ``torch DataLoader``: the dataset a PyTorch user writes (one file per item, ``PIL.Image.open``
  + ``convert("RGB")``, ``shuffle=True``, a numpy collate) with ``num_workers=W`` worker
  processes (``W = 0``: the main process), each epoch starting its workers as by default;
  its first-batch time is reported apart.

Goal: the encoded epoch at least 1.2x the DataLoader at the same number of
workers (threads; or the DataLoader in its main process, where that is faster), and the
store's bytes per image at most 5% over the source files'. The
machine's load average is recorded: other processes share it.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import date
from pathlib import Path
from typing import Any

from bench_device import jpeg_dataloader  # the DataLoader a PyTorch user writes (also the GPU machine's peer)
from benchpaths import data_dir, results_dir

import carraystore
from bench.benchdata import cached_photo_folder
from bench.loaders.machine import library_versions, machine_info

SCALE = os.environ.get("CARRAYSTORE_BENCH_SCALE", "default")
SCALES = {
    "tiny": dict(n=48, size=(32, 32), batch=8, rounds=1, workers=(1,)),
    "default": dict(n=2000, size=(256, 256), batch=32, rounds=5, workers=(1, 2)),
}
if SCALE not in SCALES:
    raise ValueError(f"CARRAYSTORE_BENCH_SCALE={SCALE!r}: use one of {sorted(SCALES)}")
CFG: dict[str, Any] = SCALES[SCALE]


def timed_epoch(batches: Callable[[], Iterable[Any]]) -> dict[str, float]:
    """Images, seconds and the first batch's wait of one pass over ``batches()`` (started in the timing)."""
    t0 = time.perf_counter()
    n, first = 0, None
    for x, _ in batches():
        n += len(x)
        if first is None:
            first = time.perf_counter() - t0
    return {"images": n, "seconds": time.perf_counter() - t0, "first_batch_s": first or 0.0}


def torch_epoch(files: list[Path], labels: list[int], batch: int, workers: int, epoch: int) -> dict[str, float]:
    loader = jpeg_dataloader(files, labels, batch, workers, seed=epoch)
    return timed_epoch(lambda: loader)


def store_epoch(path: Path, batch: int, threads: int, epoch: int) -> dict[str, float]:
    store = carraystore.open(path)
    return timed_epoch(lambda: store.batches(batch, epoch=epoch, num_threads=threads))


def run(folder: Path, work: Path) -> dict[str, Any]:
    files = sorted(folder.rglob("*.jpg"))
    classes = sorted({f.parent.name for f in files})
    labels = [classes.index(f.parent.name) for f in files]
    store_path = work / "encoded.b2nd"
    if not store_path.exists():
        carraystore.from_directory(folder, store_path, layout="encoded", workers=1)
    store = carraystore.open(store_path)
    assert len(store) == len(files)
    src_bytes = sum(f.stat().st_size for f in files)
    store_bytes = store_path.stat().st_size
    from carraystore.format.encoded import jpeg_decoder

    res: dict[str, Any] = {
        "scale": SCALE,
        "images": len(files),
        "image_size": list(CFG["size"]),
        "batch": CFG["batch"],
        "rounds": CFG["rounds"],
        "source_bytes_per_image": src_bytes / len(files),
        "store_bytes_per_image": store_bytes / len(files),
        "bytes_ratio": store_bytes / src_bytes,
        "jpeg_decoder": jpeg_decoder().name,
        "load_before": os.getloadavg()[0],
        "machine": machine_info(),
        "versions": library_versions(),
        "date": date.today().isoformat(),
        "contenders": {},
    }
    contenders: dict[str, Any] = {"torch DataLoader, 0 workers": (torch_epoch, (files, labels, CFG["batch"], 0))}
    for w in CFG["workers"]:
        contenders[f"carraystore encoded, {w} threads"] = (store_epoch, (store_path, CFG["batch"], w))
        contenders[f"torch DataLoader, {w} workers"] = (torch_epoch, (files, labels, CFG["batch"], w))
    # warm the page cache and the imports
    store_epoch(store_path, CFG["batch"], 1, 99)
    torch_epoch(files[: CFG["batch"] * 2], labels, CFG["batch"], 0, 99)
    runs: dict[str, list[dict[str, float]]] = {k: [] for k in contenders}
    for r in range(CFG["rounds"]):
        for name, (fn, args) in contenders.items():
            runs[name].append(fn(*args, epoch=r))
            assert runs[name][-1]["images"] == len(files), (name, runs[name][-1])
    for name, rs in runs.items():
        rates = [x["images"] / x["seconds"] for x in rs]
        steady = [(x["images"] - CFG["batch"]) / max(1e-9, x["seconds"] - x["first_batch_s"]) for x in rs]
        res["contenders"][name] = {
            "images_per_s": statistics.median(rates),
            "min": min(rates),
            "max": max(rates),
            "after_first_batch": statistics.median(steady),
            "first_batch_s": statistics.median(x["first_batch_s"] for x in rs),
        }
    res["load_after"] = os.getloadavg()[0]
    c = res["contenders"]
    # against the DataLoader at the same number of workers, or in the main process if that is faster
    res["ratios"] = {
        str(w): c[f"carraystore encoded, {w} threads"]["images_per_s"]
        / max(c[f"torch DataLoader, {w} workers"]["images_per_s"], c["torch DataLoader, 0 workers"]["images_per_s"])
        for w in CFG["workers"]
    }
    return res


def markdown(res: dict[str, Any]) -> str:
    h, w = res["image_size"]
    lines = [
        "# Encoded layout, local and warm, against a PyTorch DataLoader over the same JPEGs",
        "",
        f"{res['images']} real-photo JPEGs of {h}x{w} (`sample_data` crops of the scikit-image photos), "
        f"block-shuffled epochs of batches of {res['batch']}, warm page cache, {res['rounds']} interleaved rounds "
        f"(median, min-max). JPEG entries decoded by {res['jpeg_decoder']}. Machine: {res['machine']}; "
        f"1-minute load average {res['load_before']:.2f} before, {res['load_after']:.2f} after; {res['date']}. "
        "Script: `bench/bench_encoded_local.py`.",
        "",
        "| contender | images/s (median) | min-max | after the first batch | first batch s |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name, r in res["contenders"].items():
        lines.append(
            f"| {name} | {r['images_per_s']:,.0f} | {r['min']:,.0f}-{r['max']:,.0f} | "
            f"{r['after_first_batch']:,.0f} | {r['first_batch_s']:.3f} |"
        )
    lines += [""]
    for t, ratio in res["ratios"].items():
        verdict = "met" if ratio >= 1.2 else "NOT met"
        lines.append(
            f"- {t} thread(s) against the DataLoader with as many workers (or none, if faster): **{ratio:.2f}x** "
            f"(goal >= 1.2x: {verdict})"
        )
    br = res["bytes_ratio"]
    lines.append(
        f"- bytes per image: store {res['store_bytes_per_image']:,.0f} against the files' "
        f"{res['source_bytes_per_image']:,.0f}: **{br:.3f}x** (goal at most 5% more: {'met' if br <= 1.05 else 'NOT met'}; "
        "lz4 over a chunk of entries shrinks the JPEG headers they share)"
    )
    return "\n".join(lines) + "\n"


def test_encoded_local(benchmark) -> None:  # type: ignore[no-untyped-def]
    folder = cached_photo_folder(data_dir(), CFG["n"], size=CFG["size"])
    with tempfile.TemporaryDirectory() as tmp:
        res = benchmark.pedantic(run, args=(folder, Path(tmp)), rounds=1, iterations=1)
    out = results_dir(SCALE)
    out.mkdir(parents=True, exist_ok=True)
    (out / "encoded_local.json").write_text(json.dumps(res, indent=1, default=str))
    md = markdown(res)
    (out / "encoded_local.md").write_text(md)
    print(md)
    assert all(v > 0 for v in res["ratios"].values())
