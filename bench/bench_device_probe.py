"""What limits the loader on many cores: a short probe for a lent 16-core machine (no GPU needed).

After bench_device.py showed ``fast`` flat past 4 threads and ``balanced`` short of 50k
images/s at 16, this run measures, on the same data (24,000 photo crops of 192x192):
``fast`` decompressed image by image (direct mode) against whole chunks (gather mode),
with and without the CRC check; ``balanced`` with 1 to 8 batches assembled at once; and
samples every loader thread's Python stack (every 2 ms) to show where the time goes.

    python3 bench/bench_device_probe.py --out OUT [--images 24000]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import mmap
import multiprocessing as mp
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import bench_device as bd  # noqa: E402

import carraystore  # noqa: E402
from carraystore.engine import decoder as engine  # noqa: E402
from carraystore.engine import loader  # noqa: E402
from carraystore.ingest.sample_data import PHOTOS, load_photo  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


T0 = time.perf_counter()


def make_stores(work: Path, n: int, size: int, encoded: bool = False) -> dict[str, Path]:
    photos = [load_photo(p) for p in PHOTOS]
    jpeg_dir = work / "jpeg" if encoded else None
    if jpeg_dir is not None:
        for name in PHOTOS:
            (jpeg_dir / name).mkdir(parents=True, exist_ok=True)
    labels = np.random.default_rng(0).permutation(np.arange(n) % len(PHOTOS)).astype(np.int64)
    shared = mmap.mmap(-1, n * size * size * 3)
    arr = np.frombuffer(shared, dtype=np.uint8).reshape(n, size, size, 3)
    bd._G.update(arr=arr, labels=labels, photos=photos, size=(size, size), seed=0, jpeg_dir=jpeg_dir, quality=90)
    ncpu = len(os.sched_getaffinity(0))
    step = max(1, math.ceil(n / (ncpu * 4)))
    with mp.get_context("fork").Pool(ncpu) as pool:
        assert sum(pool.map(bd._make_slice, [(i, min(n, i + step)) for i in range(0, n, step)])) == n
    work.mkdir(parents=True, exist_ok=True)
    out = {}
    for preset in ("fast", "balanced"):
        path = work / f"{preset}.b2nd"
        with carraystore.create(path, (size, size, 3), codec=preset, overwrite=True, nthreads=ncpu) as w:
            for s in range(0, n, 4096):
                w.append(arr[s : s + 4096], labels=labels[s : s + 4096])
        out[preset] = path
    if jpeg_dir is not None:
        path = work / "encoded.b2nd"
        carraystore.from_directory(jpeg_dir, path, layout="encoded", workers=ncpu, overwrite=True)
        out["encoded"] = path
    return out


class Sampler:
    """Every loader thread's innermost frames, every ``interval`` s."""

    def __init__(self, interval: float = 0.002) -> None:
        self.interval = interval
        self.counts: collections.Counter[str] = collections.Counter()
        self.stop = threading.Event()
        self.t = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        names = {}
        while not self.stop.wait(self.interval):
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                name = names.get(ident, "?")
                if "carraystore" not in name:
                    role = "consumer" if name == "MainThread" else None
                    if role is None:
                        continue
                else:
                    role = "assemble" if "assemble" in name else "decode"
                f, where = frame, []
                while f is not None and len(where) < 3:
                    where.append(f"{Path(f.f_code.co_filename).stem}.{f.f_code.co_name}:{f.f_lineno}")
                    f = f.f_back
                self.counts[f"{role} | {' < '.join(where)}"] += 1

    def __enter__(self) -> Sampler:
        self.t.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.t.join()

    def top(self, k: int = 14) -> list[tuple[str, int]]:
        return self.counts.most_common(k)


def epoch(path: Path, threads: int, sample: bool = False, **kw: Any) -> dict[str, Any]:
    store = carraystore.open(path)
    best: dict[str, Any] = {}
    rates = []
    for ep in (0, 1, 2):
        t0 = time.perf_counter()
        n = 0
        s = Sampler() if (sample and ep == 2) else None
        if s:
            s.t.start()
        with store.batches(256, num_threads=threads, epoch=ep, **kw) as it:
            for x, _ in it:
                n += len(x)
            mem = it.memory
        dt = time.perf_counter() - t0
        if s:
            s.stop.set()
            s.t.join()
            best["stacks"] = s.top()
        if ep:
            rates.append(round(n / dt))
    best.update(images_per_s=max(rates), epochs=rates, assemblers=mem.assemblers, slots=mem.slots)
    store.close()
    return best


def feed(stores: dict[str, Path], res: dict[str, Any], save: Any, steps: int = 60, warm: int = 8) -> None:
    """ResNet-50 (bf16, channels_last, torch.compile) from a constant GPU batch, then fed by
    carraystore.torch.StoreDataset(device="cuda") with several thread counts and GIL switch
    intervals: what the feeding costs the training loop."""
    import torch
    import torch.nn.functional as F
    import torchvision

    from carraystore.torch import StoreDataset

    if not torch.cuda.is_available():
        res["feed"] = {"skipped": "no CUDA"}
        return
    B, size = 256, 192
    dev = torch.device("cuda")
    torch.backends.cudnn.benchmark = True
    model = torchvision.models.resnet50(num_classes=10).to(dev).to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    mean = torch.tensor([0.485, 0.456, 0.406], device=dev).view(1, 3, 1, 1) * 255
    std = torch.tensor([0.229, 0.224, 0.225], device=dev).view(1, 3, 1, 1) * 255
    cm = torch.compile(model)

    def step(x: Any, y: Any) -> None:
        x = x.permute(0, 3, 1, 2).float().sub_(mean).div_(std).contiguous(memory_format=torch.channels_last)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(cm(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    xc = torch.randint(0, 256, (B, size, size, 3), device=dev, dtype=torch.uint8)
    yc = torch.randint(0, 10, (B,), device=dev)
    t = time.perf_counter()
    for _ in range(3):
        step(xc, yc)
    torch.cuda.synchronize()
    out: dict[str, Any] = {"compile_s": round(time.perf_counter() - t, 1)}
    res["feed"] = out
    log(f"compiled in {out['compile_s']} s")

    def constant() -> float:
        for _ in range(warm):
            step(xc, yc)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            step(xc, yc)
        torch.cuda.synchronize()
        return steps * B / (time.perf_counter() - t0)

    def fed(path: Path, threads: int) -> float:
        ds = StoreDataset(str(path), B, device="cuda", num_threads=threads, drop_remainder=True)
        it = iter(ds)
        try:
            for _ in range(warm):
                x, y = next(it)
                step(x, y)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(steps):
                x, y = next(it)
                step(x, y)
            torch.cuda.synchronize()
            return steps * B / (time.perf_counter() - t0)
        finally:
            it.close()  # type: ignore[attr-defined]

    base = round(constant())
    out["constant"] = base
    log(f"compiled constant: {base} images/s")
    default_si = sys.getswitchinterval()
    for name, preset, threads, si in (
        ("balanced T=4", "balanced", 4, None),
        ("balanced T=8", "balanced", 8, None),
        ("balanced T=14", "balanced", 14, None),
        ("fast T=4", "fast", 4, None),
        ("fast T=14", "fast", 14, None),
        ("balanced T=8 switchinterval=0.5ms", "balanced", 8, 0.0005),
        ("balanced T=14 switchinterval=0.5ms", "balanced", 14, 0.0005),
    ):
        sys.setswitchinterval(si or default_si)
        try:
            r = round(fed(stores[preset], threads))
            out[name] = {"images_per_s": r, "ratio": round(r / base, 3)}
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        finally:
            sys.setswitchinterval(default_si)
        log(f"compiled fed {name}: {out[name]}")
        save()
    out["constant_again"] = round(constant())
    log(f"compiled constant again: {out['constant_again']} images/s")
    save()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--images", type=int, default=24000)
    ap.add_argument("--size", type=int, default=192)
    ap.add_argument("--workdir", default="/tmp/probe")
    ap.add_argument("--threads", default="4,8,16")
    ap.add_argument("--feed", action="store_true", help="then ResNet-50 fed by carraystore.torch (CUDA)")
    ap.add_argument("--no-probe", action="store_true", help="skip the direct/gather/assembler runs")
    ap.add_argument("--encoded", action="store_true", help="also an encoded store (JPEG q90) in the scaling runs")
    a = ap.parse_args(argv)
    T = [int(t) for t in a.threads.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"cpus": len(os.sched_getaffinity(0)), "carraystore": carraystore.__file__}

    def save() -> None:
        (out / "probe.json").write_text(json.dumps(res, indent=1))

    stores = make_stores(Path(a.workdir), a.images, a.size, a.encoded)
    log("stores made")
    real_min = engine.DIRECT_MIN_ITEM_BYTES
    real_asm = loader.assemblers_for
    runs: list[tuple[str, Path, int, dict[str, Any], Any]] = []
    for t in T:
        runs.append((f"fast direct T={t}", stores["fast"], t, {}, None))
        runs.append((f"fast gather T={t}", stores["fast"], t, {}, "gather"))
    top = max(T)
    runs.append((f"fast direct verify=False T={top}", stores["fast"], top, {"verify": False}, None))
    runs.append((f"fast gather verify=False T={top}", stores["fast"], top, {"verify": False}, "gather"))
    for asm in (1, 2, 4, 8):
        runs.append((f"balanced T={top} assemblers={asm}", stores["balanced"], top, {}, asm))
    runs.append((f"balanced T={top} verify=False", stores["balanced"], top, {"verify": False}, None))
    if a.no_probe:
        runs = [(f"{p} T={t}", stores[p], t, {}, None) for p in stores for t in T]
    for name, path, t, kw, mode in runs:
        engine.DIRECT_MIN_ITEM_BYTES = 1 << 40 if mode == "gather" else real_min
        loader.assemblers_for = (lambda spec, k=mode: k) if isinstance(mode, int) else real_asm  # type: ignore[misc]
        sample = (
            name == f"encoded T={top}"
            or not a.no_probe
            and name
            in (
                f"fast direct T={top}",
                f"fast gather T={top}",
                f"balanced T={top} assemblers=4",
            )
        )
        try:
            r = epoch(path, t, sample=sample, **kw)
        except Exception as exc:
            r = {"error": f"{type(exc).__name__}: {exc}"}
        res[name] = r
        log(f"{name}: { ({k: v for k, v in r.items() if k != 'stacks'}) }")
        for line, c in r.get("stacks", []):
            log(f"    {c:6d}  {line}")
        save()
    engine.DIRECT_MIN_ITEM_BYTES = real_min
    loader.assemblers_for = real_asm  # type: ignore[misc]
    if a.feed:
        try:
            feed(stores, res, save)
        except Exception as exc:
            res["feed_error"] = f"{type(exc).__name__}: {exc}"[:1000]
            log(res["feed_error"])
        save()
    log("done")
    return res


def test_probe_tiny(tmp_path: Path) -> None:
    """The probe at a tiny scale on the CPU (no feeding): every run gives a rate, the stacks sampled."""
    res = main(
        ["--out", str(tmp_path / "out"), "--images", "96", "--size", "32", "--threads", "1,2"]
        + ["--workdir", str(tmp_path / "work"), "--encoded"]
    )
    runs = {k: v for k, v in res.items() if isinstance(v, dict)}
    assert "fast direct T=2" in runs and "balanced T=2 assemblers=8" in runs
    assert all(v.get("images_per_s", 0) > 0 for v in runs.values()), runs
    assert isinstance(runs["fast direct T=2"]["stacks"], list)  # a tiny epoch may end before the first sample
    assert (tmp_path / "out" / "probe.json").is_file()


if __name__ == "__main__":
    main()
