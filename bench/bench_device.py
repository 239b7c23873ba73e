"""One short run on a lent GPU machine (16 cores, one H100): loader scaling, peers, GPU feeding, GPU JPEG decode.

Run by ``bench/device/run.sh`` (see bench/device/README.md); as a script::

    python3 bench/bench_device.py --out OUT [--images 24000] [--quick] [--budget 330]

Writes ``OUT/device.json`` (every number and the machine) and ``OUT/device.md`` (tables)
after every step, so a run cut short keeps what it measured. Each step is timed and
guarded: one that fails records its error and the run goes on; a step that would start
past ``--budget`` seconds is skipped. Steps that need CUDA are skipped without it.

1. data: ``--images`` crops of scikit-image's colour photos (``sample_data``), made and
   saved as JPEG files (quality 90) in a process pool; stores ``fast`` and ``balanced``
   written from the arrays with labels; an encoded-layout store of the JPEG folder.
2. loaders: ``store.batches(B, shuffle="block", num_threads=T)`` per T, warm page cache.
3. peers: numpy fancy-index gather of the loader's batch order (1 and N threads) and a
   PyTorch DataLoader over the JPEG files (Pillow, N workers).
4. gpu_decode: ``torchvision.io.decode_jpeg(..., device="cuda")`` on the stored JPEG bytes
   against Pillow (and simplejpeg, OpenCV when importable) in N threads; pixel differences.
5. gpu_feed: ResNet-50 (bf16 autocast, channels_last, SGD) on a constant GPU batch against
   one fed by ``carraystore.torch.StoreDataset(..., device="cuda")``; eager and compiled.
6. pytest: ``tests/test_torch.py`` (its CUDA paths run where CUDA is available).

Under pytest (``tests/test_bench_smoke.py``) the test below runs the whole script at a
tiny scale on the CPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import contextlib
import io
import json
import math
import mmap
import multiprocessing as mp
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: this checkout's carraystore
    sys.path.insert(0, str(REPO))

import carraystore  # noqa: E402
from carraystore.ingest.sample_data import PHOTOS, load_photo, photo_crops  # noqa: E402

T0 = time.perf_counter()
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # torch.cuda.is_available() then leaves fork usable


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------
# the machine
# ---------------------------------------------------------------------------------------


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def cgroup_limits() -> dict[str, Any]:
    """CPU and memory limits of this process's cgroup (v2, else v1), as the files say."""
    out: dict[str, Any] = {}
    for key, path in (
        ("cpu.max", "/sys/fs/cgroup/cpu.max"),
        ("memory.max", "/sys/fs/cgroup/memory.max"),
        ("cpuset.cpus.effective", "/sys/fs/cgroup/cpuset.cpus.effective"),
        ("v1.cpu.cfs_quota_us", "/sys/fs/cgroup/cpu/cpu.cfs_quota_us"),
        ("v1.cpu.cfs_period_us", "/sys/fs/cgroup/cpu/cpu.cfs_period_us"),
        ("v1.memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.limit_in_bytes"),
    ):
        v = _read(path)
        if v is not None:
            out[key] = v
    return out


def _version(name: str) -> str | None:
    try:
        mod = __import__(name)
        return str(getattr(mod, "__version__", "?"))
    except Exception as exc:  # not installed, or broken: say which
        return f"absent ({type(exc).__name__})"


def machine_info() -> dict[str, Any]:
    import blosc2

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "affinity_cpus": sorted(os.sched_getaffinity(0)),
        "cgroup": cgroup_limits(),
        "cpu_model": next(
            (ln.split(":", 1)[1].strip() for ln in (_read("/proc/cpuinfo") or "").splitlines() if "model name" in ln),
            None,
        ),
        "loadavg": os.getloadavg(),
        "carraystore": carraystore.__version__,
        "carraystore_file": carraystore.__file__,
        "blosc2": blosc2.__version__,
        "blosc2_nthreads": blosc2.nthreads,
        "numpy": np.__version__,
        "pillow": _version("PIL"),
        "simplejpeg": _version("simplejpeg"),
        "isal": _version("isal"),
        "cv2": _version("cv2"),
        "skimage": _version("skimage"),
    }
    try:  # not in the public API: the loaders' default thread count
        from carraystore.engine.options import default_threads

        info["default_threads"] = default_threads()
    except Exception as exc:
        info["default_threads"] = f"unknown ({exc})"
    try:
        import psutil

        vm = psutil.virtual_memory()
        info["mem_total_gb"] = round(vm.total / 1e9, 1)
        info["mem_available_gb"] = round(vm.available / 1e9, 1)
    except Exception:
        pass
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        info["commit"] = commit or None
    except Exception:
        info["commit"] = None
    try:
        import torch

        info["torch"] = torch.__version__
        info["torchvision"] = _version("torchvision")
        info["cuda"] = torch.cuda.is_available()  # the device's properties later: gpu_info()
        info["cuda_version"] = torch.version.cuda
    except Exception as exc:
        info["torch"] = f"absent ({type(exc).__name__}: {exc})"
        info["cuda"] = False
    return info


def gpu_info() -> dict[str, Any]:
    """The GPU's name and size; asked only after the steps that fork (data, peers) are done."""
    import torch

    if not torch.cuda.is_available():
        return {}
    p = torch.cuda.get_device_properties(0)
    return {"gpu": p.name, "gpu_mem_gb": round(p.total_memory / 2**30, 1), "gpu_sms": p.multi_processor_count}


# ---------------------------------------------------------------------------------------
# results, saved after every step
# ---------------------------------------------------------------------------------------


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.res: dict[str, Any] = {"args": vars(args), "steps": {}}
        self.ncpu = len(os.sched_getaffinity(0))

    def left(self) -> float:
        return self.args.budget - (time.perf_counter() - T0)

    def save(self) -> None:
        self.res["elapsed_s"] = round(time.perf_counter() - T0, 1)
        for name, text in (
            ("device.json", json.dumps(self.res, indent=1, default=str)),
            ("device.md", markdown(self.res)),
        ):
            tmp = self.out / (name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.out / name)

    def step(self, name: str, fn: Callable[[dict[str, Any]], None], need_s: float = 5.0) -> None:
        section: dict[str, Any] = {}
        self.res[name] = section
        st: dict[str, Any] = {}
        self.res["steps"][name] = st
        if self.left() < need_s:
            st.update(status="skipped", reason=f"time budget: {self.left():.0f} s left, the step needs {need_s:.0f}")
            log(f"== {name}: skipped ({st['reason']})")
            self.save()
            return
        log(f"== {name}")
        t = time.perf_counter()
        try:
            fn(section)
            st["status"] = "ok"
        except Exception as exc:
            st.update(status="error", error=f"{type(exc).__name__}: {exc}")
            log(f"!! {name} failed: {st['error']}")
            traceback.print_exc()
            sys.stderr.flush()
        st["seconds"] = round(time.perf_counter() - t, 2)
        log(f"== {name}: {st['status']} in {st['seconds']} s")
        self.save()


def guarded(section: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    """``section[key] = fn()``, or the error, so one failing measurement leaves the rest."""
    try:
        section[key] = fn()
    except Exception as exc:
        section[key] = {"error": f"{type(exc).__name__}: {exc}"}
        log(f"!! {key}: {section[key]['error']}")
        traceback.print_exc()
        sys.stderr.flush()
    return section[key]


# ---------------------------------------------------------------------------------------
# 1. data
# ---------------------------------------------------------------------------------------

_G: dict[str, Any] = {}  # what the forked data workers inherit


def _make_slice(bounds: tuple[int, int]) -> int:
    """Crops for images [a, b) into the shared array; their JPEG files when asked for."""
    from PIL import Image

    a, b = bounds
    arr, labels, photos, size = _G["arr"], _G["labels"], _G["photos"], _G["size"]
    rng = np.random.default_rng([_G["seed"], a])
    idx = np.arange(a, b)
    for c in np.unique(labels[a:b]):
        mine = idx[labels[a:b] == c]
        for i, crop in zip(mine, photo_crops(photos[c], len(mine), size, rng), strict=True):
            arr[i] = crop
            if _G["jpeg_dir"] is not None:
                Image.fromarray(crop).save(_G["jpeg_dir"] / PHOTOS[c] / f"{i:06d}.jpg", quality=_G["quality"])
    return b - a


def make_data(run: Run, sec: dict[str, Any]) -> None:
    a = run.args
    n, size = a.images, (a.size, a.size)
    work = Path(a.workdir) / "bench-device-data"  # only this folder is emptied first
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    jpeg_dir = work / "jpeg"
    for name in PHOTOS:
        (jpeg_dir / name).mkdir(parents=True)
    t = time.perf_counter()
    photos = [load_photo(p) for p in PHOTOS]
    labels = np.random.default_rng(a.seed).permutation(np.arange(n) % len(PHOTOS)).astype(np.int64)
    nbytes = n * size[0] * size[1] * 3
    shared = mmap.mmap(-1, nbytes)  # anonymous shared memory: the forked workers write into it
    arr = np.frombuffer(shared, dtype=np.uint8).reshape(n, *size, 3)
    _G.update(arr=arr, labels=labels, photos=photos, size=size, seed=a.seed, jpeg_dir=jpeg_dir, quality=90)
    sec["load_photos_s"] = round(time.perf_counter() - t, 2)
    t = time.perf_counter()
    step = max(1, math.ceil(n / (run.ncpu * 4)))
    slices = [(i, min(n, i + step)) for i in range(0, n, step)]
    with mp.get_context("fork").Pool(run.ncpu) as pool:
        done = sum(pool.map(_make_slice, slices))
    assert done == n
    sec["crops_and_jpegs_s"] = round(time.perf_counter() - t, 2)
    sec["processes"] = run.ncpu
    sec["images"] = n
    sec["image_shape"] = [*size, 3]
    sec["raw_mb"] = round(nbytes / 1e6, 1)
    sec["jpeg_mb"] = round(sum(f.stat().st_size for f in jpeg_dir.rglob("*.jpg")) / 1e6, 1)
    log(f"{n} crops and JPEG files in {sec['crops_and_jpegs_s']} s ({sec['jpeg_mb']} MB of JPEG)")
    run.arr, run.labels = arr, labels  # type: ignore[attr-defined]
    run.stores = {}  # type: ignore[attr-defined]
    for preset in ("fast", "balanced"):
        path = work / f"{preset}.b2nd"
        t = time.perf_counter()
        with carraystore.create(
            path, (*size, 3), codec=preset, class_names=PHOTOS, overwrite=True, nthreads=run.ncpu
        ) as w:
            for s in range(0, n, 4096):
                w.append(arr[s : s + 4096], labels=labels[s : s + 4096])
        dt = time.perf_counter() - t
        mb = path.stat().st_size / 1e6
        sec[f"store_{preset}"] = {
            "write_s": round(dt, 2),
            "write_mb_per_s": round(nbytes / 1e6 / dt),
            "mb": round(mb, 1),
            "ratio": round(nbytes / 1e6 / mb, 3),
        }
        run.stores[preset] = path  # type: ignore[attr-defined]
        log(f"store {preset}: {sec[f'store_{preset}']}")
    path = work / "encoded.b2nd"
    t = time.perf_counter()
    carraystore.from_directory(jpeg_dir, path, layout="encoded", workers=run.ncpu, overwrite=True)
    dt = time.perf_counter() - t
    sec["store_encoded"] = {"ingest_s": round(dt, 2), "mb": round(path.stat().st_size / 1e6, 1)}
    with carraystore.open(path) as s:
        sec["store_encoded"]["images"] = len(s)
        sec["store_encoded"]["layout"] = s.layout
    run.stores["encoded"] = path  # type: ignore[attr-defined]
    run.jpeg_dir = jpeg_dir  # type: ignore[attr-defined]
    log(f"store encoded: {sec['store_encoded']}")


# ---------------------------------------------------------------------------------------
# 2. loader scaling
# ---------------------------------------------------------------------------------------


def _drain(it: Iterator[Any], cap_s: float, t0: float) -> tuple[int, int, bool]:
    """Images and batches taken from ``it`` until it ends or ``cap_s`` passed; (n, batches, whole epoch)."""
    n = nb = 0
    for batch in it:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        n += len(x)
        nb += 1
        if time.perf_counter() - t0 > cap_s:
            return n, nb, False
    return n, nb, True


def time_store_epoch(path: Path, batch: int, threads: int | None, cap_s: float, mb_per_image: float) -> dict[str, Any]:
    store = carraystore.open(path)
    try:
        with store.batches(batch, shuffle="block", num_threads=threads, epoch=0) as it:  # warm-up: threads, caches
            for _ in zip(range(3), it, strict=False):
                pass
        best: dict[str, Any] | None = None
        runs = []
        for epoch in (1, 2):
            t0 = time.perf_counter()
            with store.batches(batch, shuffle="block", num_threads=threads, epoch=epoch) as it:
                n, nb, whole = _drain(it, cap_s, t0)
            dt = time.perf_counter() - t0
            r = {"images": n, "batches": nb, "seconds": round(dt, 3), "whole_epoch": whole, "images_per_s": n / dt}
            runs.append(round(r["images_per_s"]))
            if best is None or r["images_per_s"] > best["images_per_s"]:
                best = r
            if not whole or dt > 1.5:  # a second epoch only where one is short (noisy)
                break
        assert best is not None
        best["images_per_s"] = round(best["images_per_s"])
        best["mb_per_s"] = round(best["images_per_s"] * mb_per_image)
        best["epochs_images_per_s"] = runs
        return best
    finally:
        store.close()


def loaders(run: Run, sec: dict[str, Any]) -> None:
    a = run.args
    sec["affinity"] = len(os.sched_getaffinity(0))
    mb_per_image = a.size * a.size * 3 / 1e6
    threads: list[int | None] = [*a.threads, None]
    for name in ("fast", "balanced", "encoded"):
        rows: dict[str, Any] = {}
        sec[name] = rows
        for t in threads:
            key = f"T={t if t is not None else 'default'}"
            if run.left() < 20:
                rows[key] = {"skipped": "time budget"}
                continue
            r = guarded(
                rows, key, lambda t=t, name=name: time_store_epoch(run.stores[name], a.batch, t, a.cap, mb_per_image)
            )
            log(f"{name} {key}: {r}")
        run.save()


def loaders_before(run: Run, sec: dict[str, Any]) -> None:
    """The same loader epochs with another carraystore (``--old-package``, e.g. the last
    release's engine), in a subprocess, side by side with this one in the same run."""
    a = run.args
    stores = {k: str(run.stores[k]) for k in ("fast", "balanced")}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(a.old_package).resolve()), *env.get("PYTHONPATH", "").split(os.pathsep)]
    )
    cmd = [sys.executable, str(Path(__file__).resolve()), "--out", str(run.out), "--loaders-only", json.dumps(stores)]
    cmd += ["--threads", a.old_threads, "--cap", str(a.cap), "--batch", str(a.batch), "--size", str(a.size)]
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=max(10.0, run.left() - 5))
    sec["seconds"] = round(time.perf_counter() - t, 1)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        raise RuntimeError(f"old package run failed ({p.returncode}): {p.stderr[-1500:]}")
    sec.update(json.loads(lines[-1]))
    log(f"loaders with {a.old_package}: {sec}")


def loaders_only(args: argparse.Namespace) -> None:
    stores = json.loads(args.loaders_only)
    mb = args.size * args.size * 3 / 1e6
    res: dict[str, Any] = {"carraystore": carraystore.__file__}
    for name, path in stores.items():
        res[name] = {}
        for t in args.threads:
            try:
                res[name][f"T={t}"] = time_store_epoch(Path(path), args.batch, t, args.cap, mb)
            except Exception as exc:
                res[name][f"T={t}"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    print(json.dumps(res), flush=True)


# ---------------------------------------------------------------------------------------
# 3. peers
# ---------------------------------------------------------------------------------------


def _epoch_order(run: Run) -> list[np.ndarray]:
    """The batches of the balanced store's block-shuffled epoch 1 (``BatchIterator.plan``)."""
    with carraystore.open(run.stores["balanced"]) as store, store.batches(run.args.batch, epoch=1) as it:
        items = np.asarray(it.plan.items)
    b = run.args.batch
    return [items[i : i + b] for i in range(0, len(items), b)]


def numpy_gather(arr: np.ndarray, labels: np.ndarray, order: list[np.ndarray], threads: int, cap_s: float) -> dict:
    def one(idx: np.ndarray) -> int:
        x, _ = arr[idx], labels[idx]  # a new batch array, as a loader over an in-memory array makes
        return len(x)

    t0 = time.perf_counter()
    n = nb = 0
    whole = True
    if threads == 1:
        for idx in order:
            n += one(idx)
            nb += 1
            if time.perf_counter() - t0 > cap_s:
                whole = False
                break
    else:
        with cf.ThreadPoolExecutor(threads) as ex:
            for k in ex.map(one, order):
                n += k
                nb += 1
    dt = time.perf_counter() - t0
    return {"images": n, "batches": nb, "seconds": round(dt, 3), "whole_epoch": whole, "images_per_s": round(n / dt)}


class JpegFiles:
    """A map-style dataset of JPEG files decoded with Pillow: (H, W, 3) uint8, label."""

    def __init__(self, files: list[Path], labels: list[int]) -> None:
        self.files, self.labels = files, labels

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        from PIL import Image

        with Image.open(self.files[i]) as im:
            return np.asarray(im.convert("RGB")), self.labels[i]


def collate(items: list[tuple[np.ndarray, int]]) -> Any:
    import torch

    return torch.from_numpy(np.stack([x for x, _ in items])), torch.tensor([y for _, y in items])


def jpeg_dataloader(files: list[Path], labels: list[int], batch: int, workers: int, seed: int | None = None) -> Any:
    """The shuffling ``DataLoader`` a PyTorch user writes over JPEG files (``seed``: its order)."""
    import torch
    from torch.utils.data import DataLoader

    return DataLoader(
        JpegFiles(files, labels),
        batch_size=batch,
        shuffle=True,
        generator=None if seed is None else torch.Generator().manual_seed(seed),
        num_workers=workers,
        collate_fn=collate,
        multiprocessing_context="fork" if workers else None,
    )


def torch_jpeg_loader(jpeg_dir: Path, batch: int, workers: int, cap_s: float) -> dict[str, Any]:
    files = sorted(jpeg_dir.rglob("*.jpg"))
    labels = [PHOTOS.index(f.parent.name) for f in files]
    dl = jpeg_dataloader(files, labels, batch, workers)
    t0 = time.perf_counter()
    it = iter(dl)
    first = next(it)
    t_first = time.perf_counter() - t0
    n, nb = len(first[0]), 1
    whole = True
    for x, _ in it:
        n += len(x)
        nb += 1
        if time.perf_counter() - t0 > cap_s:
            whole = False
            break
    dt = time.perf_counter() - t0
    del it
    return {
        "images": n,
        "batches": nb,
        "seconds": round(dt, 3),
        "whole_epoch": whole,
        "first_batch_s": round(t_first, 3),
        "images_per_s": round(n / dt),
        "images_per_s_after_first": round((n - len(first[0])) / max(1e-9, dt - t_first)) if nb > 1 else None,
    }


def peers(run: Run, sec: dict[str, Any]) -> None:
    a = run.args
    order = _epoch_order(run)
    sec["order"] = "balanced store, block shuffle, epoch 1 (BatchIterator.plan)"
    for t in (1, run.ncpu):
        r = guarded(sec, f"numpy_gather_T={t}", lambda t=t: numpy_gather(run.arr, run.labels, order, t, a.cap))
        log(f"numpy gather T={t}: {r}")
    r = guarded(
        sec,
        f"torch_dataloader_pillow_W={run.ncpu}",
        lambda: torch_jpeg_loader(run.jpeg_dir, a.batch, run.ncpu, max(a.cap, 4.0)),
    )
    log(f"torch DataLoader (Pillow, {run.ncpu} workers): {r}")


# ---------------------------------------------------------------------------------------
# 4. GPU JPEG decode
# ---------------------------------------------------------------------------------------


def _stored_jpegs(path: Path, n: int) -> list[bytes]:
    out: list[bytes] = []
    with carraystore.open(path) as store:
        for c in range(store.nchunks):
            out.extend(store.chunk_entries(c))
            if len(out) >= n:
                break
    return out[:n]


def _pillow_decode(b: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(b)) as im:
        return np.asarray(im.convert("RGB"))


def _cpu_decode(fn: Callable[[bytes], np.ndarray], data: list[bytes], threads: int) -> tuple[dict, list[np.ndarray]]:
    t0 = time.perf_counter()
    if threads == 1:
        out = [fn(b) for b in data]
    else:
        with cf.ThreadPoolExecutor(threads) as ex:
            out = list(ex.map(fn, data, chunksize=32))
    dt = time.perf_counter() - t0
    return {"images": len(out), "seconds": round(dt, 3), "images_per_s": round(len(out) / dt)}, out


def gpu_decode(run: Run, sec: dict[str, Any]) -> None:
    a = run.args
    data = _stored_jpegs(run.stores["encoded"], a.decode_images)
    sec["images"] = len(data)
    sec["jpeg_kb_mean"] = round(sum(map(len, data)) / len(data) / 1e3, 1)
    assert data[0][:2] == b"\xff\xd8", "the encoded store did not keep the JPEG files' bytes"
    r, ref = _cpu_decode(_pillow_decode, data, run.ncpu)
    sec[f"pillow_T={run.ncpu}"] = r
    log(f"Pillow decode, {run.ncpu} threads: {r}")
    guarded(sec, "pillow_T=1", lambda: _cpu_decode(_pillow_decode, data[: max(1, len(data) // 5)], 1)[0])
    try:
        import simplejpeg

        guarded(
            sec,
            f"simplejpeg_T={run.ncpu}",
            lambda: _cpu_decode(lambda b: simplejpeg.decode_jpeg(b, colorspace="RGB"), data, run.ncpu)[0],
        )
    except ImportError:
        sec["simplejpeg"] = "not installed"
    try:
        import cv2

        def cv(b: bytes) -> np.ndarray:
            return cv2.cvtColor(cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)

        cv2.setNumThreads(1)
        guarded(sec, f"opencv_T={run.ncpu}", lambda: _cpu_decode(cv, data, run.ncpu)[0])
    except ImportError:
        sec["opencv"] = "not installed"
    try:
        import torch
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError as exc:
        sec["gpu"] = f"skipped: {exc}"
        return
    if a.device == "cuda" and not torch.cuda.is_available():
        sec["gpu"] = "skipped: no CUDA"
        return

    def sync() -> None:
        if a.device == "cuda":
            torch.cuda.synchronize()

    tensors = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in data]
    B = a.batch
    for _ in range(2):  # warm-up: nvjpeg handles, allocations
        decode_jpeg(tensors[:B], mode=ImageReadMode.RGB, device=a.device)
    sync()
    t0 = time.perf_counter()
    gpu: list[Any] = []
    for i in range(0, len(tensors), B):
        gpu.extend(decode_jpeg(tensors[i : i + B], mode=ImageReadMode.RGB, device=a.device))
    sync()
    dt = time.perf_counter() - t0
    sec[f"torchvision_{a.device}_batch{B}"] = {
        "images": len(gpu),
        "seconds": round(dt, 3),
        "images_per_s": round(len(gpu) / dt),
    }
    log(f"torchvision decode_jpeg on {a.device}: {sec[f'torchvision_{a.device}_batch{B}']}")
    g = np.stack([t.permute(1, 2, 0).cpu().numpy() for t in gpu])
    p = np.stack(ref)
    d = np.abs(g.astype(np.int16) - p.astype(np.int16))
    sec["gpu_vs_pillow"] = {
        "shape_equal": g.shape == p.shape,
        "max_abs_diff": int(d.max()),
        "mean_abs_diff": round(float(d.mean()), 4),
        "fraction_equal": round(float((d == 0).mean()), 4),
        "fraction_within_1": round(float((d <= 1).mean()), 4),
    }
    log(f"GPU vs Pillow pixels: {sec['gpu_vs_pillow']}")


# ---------------------------------------------------------------------------------------
# 5. GPU feeding
# ---------------------------------------------------------------------------------------


class _Timeout(BaseException):
    """Raised by ``alarm``; a BaseException so that no ``except Exception`` inside torch swallows it."""


@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    def fire(signum: int, frame: Any) -> None:
        raise _Timeout(f"over {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(1.0, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def gpu_feed(run: Run, sec: dict[str, Any]) -> None:
    try:
        import torch
    except ImportError as exc:
        sec["skipped"] = str(exc)
        return
    a = run.args
    if a.device == "cuda" and not torch.cuda.is_available():
        sec["skipped"] = "no CUDA"
        return
    import torch.nn.functional as F

    from carraystore.torch import StoreDataset

    B, S, W = a.batch, a.gpu_steps, a.gpu_warmup
    fed_threads = a.feed_threads or max(2, run.ncpu - 2)
    sec.update(
        device=a.device, batch=B, timed_steps=S, warmup_steps=W, feed_threads=fed_threads, image=[a.size, a.size, 3]
    )
    torch.backends.cudnn.benchmark = True
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    try:
        import torchvision

        model = torchvision.models.resnet50(num_classes=10)
        sec["model"] = "resnet50"
    except ImportError:
        if cuda:
            raise
        model = torch.nn.Sequential(  # --device cpu without torchvision: a check of the loop, not of ResNet-50
            torch.nn.Conv2d(3, 8, 3, stride=2),
            torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(8, 10),
        )
        sec["model"] = "a tiny stand-in (no torchvision here)"
    model = model.to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mean = torch.tensor([0.485, 0.456, 0.406], device=dev).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=dev).view(1, 3, 1, 1) * 255

    def prep(x: Any) -> Any:  # (B, H, W, C) uint8 on the GPU -> normalised NCHW float, channels_last
        x = x.permute(0, 3, 1, 2).float().sub_(mean).div_(std)
        return x.contiguous(memory_format=torch.channels_last)

    def make_step(m: Any) -> Callable[[Any, Any], Any]:
        def step(x: Any, y: Any) -> Any:
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                loss = F.cross_entropy(m(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss

        return step

    gen = torch.Generator(device=dev).manual_seed(0)
    xc = prep(torch.randint(0, 256, (B, a.size, a.size, 3), device=dev, dtype=torch.uint8, generator=gen))
    yc = torch.randint(0, 10, (B,), device=dev, generator=gen)

    def constant(step: Callable[[Any, Any], Any], warm: int) -> dict[str, Any]:
        for _ in range(warm):
            step(xc, yc)
        sync()
        t0 = time.perf_counter()
        for _ in range(S):
            step(xc, yc)
        sync()
        dt = time.perf_counter() - t0
        return {"steps": S, "seconds": round(dt, 3), "steps_per_s": round(S / dt, 2), "images_per_s": round(S * B / dt)}

    def batches(path: Path, threads: int | None) -> Iterator[Any]:
        ds = StoreDataset(str(path), B, device=a.device, num_threads=threads, shuffle="block", drop_remainder=True)
        epoch = 0
        while True:
            ds.set_epoch(epoch)
            yield from ds  # (x, y); closing this generator closes the epoch's decoder too
            epoch += 1

    def fed(step: Callable[[Any, Any], Any] | None, path: Path, threads: int | None) -> dict[str, Any]:
        it = batches(path, threads)
        try:
            for _ in range(W):
                x, y = next(it)
                if step is not None:
                    step(prep(x), y.to(dev, non_blocking=True))
            sync()
            t0 = time.perf_counter()
            for _ in range(S):
                x, y = next(it)
                assert x.device.type == dev.type and x.dtype == torch.uint8 and tuple(x.shape) == (B, a.size, a.size, 3)
                xp = prep(x)
                if step is not None:
                    step(xp, y.to(dev, non_blocking=True))
            sync()
            dt = time.perf_counter() - t0
        finally:
            it.close()
        return {"steps": S, "seconds": round(dt, 3), "steps_per_s": round(S / dt, 2), "images_per_s": round(S * B / dt)}

    def ratio(key_fed: str, key_const: str) -> None:
        f, c = sec.get(key_fed), sec.get(key_const)
        if isinstance(f, dict) and isinstance(c, dict) and "images_per_s" in f and "images_per_s" in c:
            sec[f"ratio_{key_fed}"] = round(f["images_per_s"] / c["images_per_s"], 3)

    bal, fast = run.stores["balanced"], run.stores["fast"]
    # the loader alone, to the GPU (decode, pinned staging, host-to-device copy, uint8 -> float)
    for name, t in ((f"loader_only_balanced_T={fed_threads}", fed_threads), ("loader_only_balanced_T=default", None)):
        log(f"{name}: {guarded(sec, name, lambda t=t: fed(None, bal, t))}")
    log(
        f"loader_only_fast_T={fed_threads}: {guarded(sec, f'loader_only_fast_T={fed_threads}', lambda: fed(None, fast, fed_threads))}"
    )
    eager = make_step(model)
    log(f"eager constant: {guarded(sec, 'eager_constant', lambda: constant(eager, W))}")
    log(f"eager fed balanced: {guarded(sec, 'eager_fed_balanced', lambda: fed(eager, bal, fed_threads))}")
    ratio("eager_fed_balanced", "eager_constant")
    run.save()
    compiled_runs(run, sec, model, make_step, constant, fed, xc, yc, sync)
    ratio("compiled_fed_balanced", "compiled_constant")
    ratio("compiled_fed_fast", "compiled_constant")
    if run.left() > 20:
        log(f"eager fed fast: {guarded(sec, 'eager_fed_fast', lambda: fed(eager, fast, fed_threads))}")
        ratio("eager_fed_fast", "eager_constant")


def compiled_runs(
    run: Run,
    sec: dict[str, Any],
    model: Any,
    make_step: Callable[[Any], Any],
    constant: Callable[..., Any],
    fed: Callable[..., Any],
    xc: Any,
    yc: Any,
    sync: Callable[[], None],
) -> None:
    """``torch.compile(model)``: its warm-up stopped after ``--compile-timeout`` s, then (a), (b), (c)."""
    import torch

    a = run.args
    if a.no_compile:
        sec["compiled"] = "skipped: --no-compile"
        return
    limit = min(a.compile_timeout, run.left() - 45)
    if limit < 30:
        sec["compiled"] = f"skipped: time budget ({run.left():.0f} s left)"
        return
    compiled = make_step(torch.compile(model))
    t0 = time.perf_counter()
    try:
        with alarm(limit):
            for _ in range(3):
                compiled(xc, yc)
            sync()
    except (_Timeout, Exception) as exc:
        sec["compile"] = {"error": f"compile (3 warm-up steps) failed: {type(exc).__name__}: {exc}"[:2000]}
        log(f"!! {sec['compile']['error']}")
        return
    sec["compile"] = {"seconds": round(time.perf_counter() - t0, 1)}
    log(f"compiled in {sec['compile']['seconds']} s")
    bal, fast, threads = run.stores["balanced"], run.stores["fast"], sec["feed_threads"]
    log(f"compiled constant: {guarded(sec, 'compiled_constant', lambda: constant(compiled, 2))}")
    log(f"compiled fed balanced: {guarded(sec, 'compiled_fed_balanced', lambda: fed(compiled, bal, threads))}")
    log(f"compiled fed fast: {guarded(sec, 'compiled_fed_fast', lambda: fed(compiled, fast, threads))}")


# ---------------------------------------------------------------------------------------
# 6. pytest
# ---------------------------------------------------------------------------------------


def run_pytest(run: Run, sec: dict[str, Any]) -> None:
    limit = max(10, min(run.args.pytest_timeout, run.left()))
    cmd = [sys.executable, "-m", "pytest", "tests/test_torch.py", "-q", "-x", "-p", "no:cacheprovider", "-rs"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    sec["command"] = " ".join(cmd[1:])
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=limit)
        out, sec["returncode"] = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        sec["returncode"] = f"timeout after {limit:.0f} s"
    sec["seconds"] = round(time.perf_counter() - t0, 1)
    lines = [ln for ln in out.splitlines() if ln.strip()]
    sec["summary"] = lines[-1] if lines else ""
    sec["tail"] = lines[-15:]
    print(out, flush=True)
    log(f"pytest: {sec['summary']} (rc {sec['returncode']})")


# ---------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------


def _table(head: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] + ["---:"] * (len(head) - 1)) + " |"]
    out += [
        "| " + " | ".join("" if v is None else (f"{v:,}" if isinstance(v, int) else str(v)) for v in r) + " |"
        for r in rows
    ]
    return out


def _ips(r: Any) -> Any:
    if not isinstance(r, dict):
        return r
    if "error" in r:
        return "error: " + r["error"][:80]
    if "skipped" in r:
        return "skipped"
    v = r.get("images_per_s")
    return f"{v:,}*" if isinstance(v, int) and r.get("whole_epoch") is False else v


def markdown(res: dict[str, Any]) -> str:
    m = res.get("machine", {})
    L = [
        "# Device run (bench/bench_device.py)",
        "",
        f"{m.get('gpu', 'no GPU')}, {m.get('affinity')} cores (cpu_count {m.get('cpu_count')}), "
        f"{m.get('mem_total_gb')} GB; cgroup {m.get('cgroup')}; torch {m.get('torch')}, "
        f"torchvision {m.get('torchvision')}, blosc2 {m.get('blosc2')}, numpy {m.get('numpy')}, "
        f"Python {m.get('python')}; carraystore {m.get('carraystore')} ({m.get('commit')}); "
        f"default_threads() = {m.get('default_threads')}. Elapsed {res.get('elapsed_s')} s.",
        "",
        "## Steps",
        "",
    ]
    L += _table(
        ["step", "status", "seconds", "note"],
        [
            [k, v.get("status"), v.get("seconds"), v.get("error") or v.get("reason") or ""]
            for k, v in res["steps"].items()
        ],
    )
    d = res.get("data") or {}
    if d:
        L += ["", "## Data", ""]
        L.append(
            f"{d.get('images')} images {d.get('image_shape')}, {d.get('raw_mb')} MB raw; crops and JPEG files (q90) "
            f"in {d.get('crops_and_jpegs_s')} s with {d.get('processes')} processes; JPEG {d.get('jpeg_mb')} MB."
        )
        L.append("")
        rows = []
        for k in ("fast", "balanced", "encoded"):
            s = d.get(f"store_{k}") or {}
            rows.append([k, s.get("mb"), s.get("ratio"), s.get("write_s", s.get("ingest_s")), s.get("write_mb_per_s")])
        L += _table(["store", "MB", "ratio", "write s", "write MB/s"], rows)
    lo = res.get("loaders") or {}
    stores = [k for k in ("fast", "balanced", "encoded") if isinstance(lo.get(k), dict)]
    if stores:
        L += ["", f"## Loader scaling: images/s, batch {res['args']['batch']}, block shuffle, warm page cache", ""]
        keys = list(dict.fromkeys(k for s in stores for k in lo[s]))
        L += _table(["num_threads", *stores], [[k, *[_ips(lo[s].get(k)) for s in stores]] for k in keys])
        L.append("")
        L.append(
            f"One whole epoch (best of two where one took under 1.5 s); * the epoch stopped at --cap {res['args']['cap']} s."
        )
    ob = res.get("loaders_before") or {}
    old = [k for k in ("fast", "balanced") if isinstance(ob.get(k), dict)]
    if old:
        L += ["", f"## The same epochs with the previous engine ({ob.get('carraystore')}), same run", ""]
        keys = list(dict.fromkeys(k for s in old for k in ob[s]))
        L += _table(
            ["num_threads", *[f"{s} before" for s in old], *[f"{s} now" for s in old]],
            [[k, *[_ips(ob[s].get(k)) for s in old], *[_ips(lo.get(s, {}).get(k)) for s in old]] for k in keys],
        )
    p = res.get("peers") or {}
    if any(isinstance(v, dict) for v in p.values()):
        L += ["", "## Peers on the same machine", ""]
        L += _table(
            ["peer", "images/s", "images/s after the first batch"],
            [[k, _ips(v), v.get("images_per_s_after_first")] for k, v in p.items() if isinstance(v, dict)],
        )
    g = res.get("gpu_decode") or {}
    if g:
        L += ["", f"## JPEG decode of {g.get('images')} stored JPEGs ({g.get('jpeg_kb_mean')} kB each)", ""]
        L += _table(
            ["decoder", "images/s"],
            [[k, _ips(v)] for k, v in g.items() if isinstance(v, dict) and k != "gpu_vs_pillow"],
        )
        if "gpu_vs_pillow" in g:
            L += ["", f"GPU vs Pillow pixels: {g['gpu_vs_pillow']}"]
        if isinstance(g.get("gpu"), str):
            L += ["", f"GPU: {g['gpu']}"]
    f = res.get("gpu_feed") or {}
    if f:
        L += [
            "",
            f"## GPU feeding: {f.get('model', 'ResNet-50')}, bf16 autocast, channels_last, SGD, on {f.get('device')}",
            "",
        ]
        if "skipped" in f:
            L.append(f"skipped: {f['skipped']}")
        else:
            rows = []
            for k, v in f.items():
                if isinstance(v, dict) and "steps" in v:
                    rows.append([k, v.get("steps_per_s"), v.get("images_per_s"), f.get(f"ratio_{k}")])
                elif isinstance(v, dict) and "error" in v:
                    rows.append([k, None, "error: " + v["error"][:80], None])
            L += _table(["run", "steps/s", "images/s", "fed / constant"], rows)
            L += [
                "",
                f"Batch {f.get('batch')} of {f.get('image')} images, {f.get('timed_steps')} timed steps after "
                f"{f.get('warmup_steps')} warm-up steps; StoreDataset(device={f.get('device')!r}, num_threads={f.get('feed_threads')}) "
                "unless the row says T=; loader_only rows: the loader and the uint8 -> float step alone. "
                f"Compile: {f.get('compile', f.get('compiled'))}.",
            ]
    t = res.get("pytest") or {}
    if t:
        L += ["", "## tests/test_torch.py", "", f"`{t.get('summary')}` (return code {t.get('returncode')})"]
    return "\n".join(L) + "\n"


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for device.json and device.md")
    ap.add_argument("--images", type=int, default=24000)
    ap.add_argument("--size", type=int, default=192, help="images are size x size x 3")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--threads", default="1,2,4,8,16", help="num_threads to measure (the default is added)")
    ap.add_argument("--cap", type=float, default=4.0, help="seconds at most per timed loader epoch")
    ap.add_argument("--budget", type=float, default=330.0, help="no step starts after this many seconds")
    ap.add_argument("--decode-images", type=int, default=5000)
    ap.add_argument("--gpu-steps", type=int, default=60)
    ap.add_argument("--gpu-warmup", type=int, default=8)
    ap.add_argument("--feed-threads", type=int, default=None, help="StoreDataset num_threads (default cores - 2)")
    ap.add_argument("--compile-timeout", type=float, default=150.0)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument(
        "--device",
        default="cuda",
        choices=["cuda", "cpu"],
        help="cpu: the GPU steps on the CPU (a check of the script)",
    )
    ap.add_argument("--pytest-timeout", type=float, default=90.0)
    ap.add_argument("--no-pytest", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--workdir",
        default=None,
        help="the data goes in WORKDIR/bench-device-data (default: a temporary folder, removed)",
    )
    ap.add_argument("--old-package", default=None, help="a folder holding another carraystore/ to compare loaders with")
    ap.add_argument("--old-threads", default="1,4,16", help="num_threads for the --old-package loaders")
    ap.add_argument("--loaders-only", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="short caps and few steps (a check of the script)")
    args = ap.parse_args(argv)
    args.threads = [int(t) for t in str(args.threads).split(",") if t.strip()]
    if args.quick:
        args.cap = min(args.cap, 1.0)
        args.gpu_steps = min(args.gpu_steps, 10)
        args.gpu_warmup = min(args.gpu_warmup, 3)
        args.decode_images = min(args.decode_images, 500)
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.loaders_only:
        loaders_only(args)
        return {}
    own_workdir = args.workdir is None
    if own_workdir:
        args.workdir = tempfile.mkdtemp(prefix="carraystore-device-")
    run = Run(args)
    log(f"bench_device: {vars(args)}")
    try:
        run.res["machine"] = machine_info()
    except Exception as exc:
        run.res["machine"] = {"error": f"{type(exc).__name__}: {exc}"}
    log(f"machine: {run.res['machine']}")
    run.save()
    run.step("data", lambda s: make_data(run, s), need_s=0)
    if run.res["steps"]["data"]["status"] == "ok":
        run.step("loaders", lambda s: loaders(run, s), need_s=20)
        if args.old_package:
            run.step("loaders_before", lambda s: loaders_before(run, s), need_s=25)
        run.step("peers", lambda s: peers(run, s), need_s=15)
        try:  # CUDA is set up only now, after the steps that fork worker processes
            run.res["machine"].update(gpu_info())
        except Exception as exc:
            run.res["machine"]["gpu"] = f"unknown ({type(exc).__name__}: {exc})"
        run.step("gpu_decode", lambda s: gpu_decode(run, s), need_s=15)
    if not args.no_pytest:  # before the feeding runs, whose compile may take what time is left
        run.step("pytest", lambda s: run_pytest(run, s), need_s=15)
    if run.res["steps"]["data"]["status"] == "ok":
        run.step("gpu_feed", lambda s: gpu_feed(run, s), need_s=30)
    if own_workdir:
        shutil.rmtree(args.workdir, ignore_errors=True)
    run.save()
    log(f"done in {time.perf_counter() - T0:.1f} s: {run.out / 'device.json'}, {run.out / 'device.md'}")
    return run.res


def test_device_bench_tiny(tmp_path: Path) -> None:
    """The whole script at a tiny scale (CPU; the GPU steps say they were skipped without CUDA)."""
    res = main(
        ["--out", str(tmp_path / "out"), "--images", "160", "--size", "32", "--batch", "16", "--threads", "1,2"]
        + ["--quick", "--no-pytest", "--decode-images", "64", "--workdir", str(tmp_path / "work")]
        + ["--device", "cpu", "--no-compile", "--gpu-steps", "4", "--gpu-warmup", "2"]
    )
    assert {k: v["status"] for k, v in res["steps"].items()} == {
        k: "ok" for k in ("data", "loaders", "peers", "gpu_decode", "gpu_feed")
    }, res["steps"]
    assert res["data"]["store_encoded"]["images"] == 160
    for name in ("fast", "balanced", "encoded"):
        assert [r["images"] for r in res["loaders"][name].values()] == [160] * 3, res["loaders"][name]
    assert res["peers"]["numpy_gather_T=1"]["images"] == 160
    assert res["gpu_decode"]["pillow_T=1"]["images"] >= 1
    try:  # the feeding loop ran on the CPU (with a stand-in model where torchvision is absent)
        import torch  # noqa: F401

        feed = res["gpu_feed"]
        for key in ("loader_only_balanced_T=default", "eager_constant", "eager_fed_balanced", "eager_fed_fast"):
            assert feed[key]["steps"] == 4 and feed[key]["images_per_s"] > 0, (key, feed[key])
    except ImportError:
        assert "skipped" in res["gpu_feed"]
    saved = json.loads((tmp_path / "out" / "device.json").read_text())
    assert saved["loaders"] == res["loaders"]
    assert "| fast |" in (tmp_path / "out" / "device.md").read_text()


if __name__ == "__main__":
    main()
