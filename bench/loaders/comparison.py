"""Running the comparison: build every peer's copy, then rounds of one fresh process per peer."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.benchdata import path_size
from bench.loaders.artifacts import build_artifact
from bench.loaders.child import CHILD_MODULE, child_main
from bench.loaders.machine import library_versions, machine_info
from bench.loaders.peer import Context, Peer
from bench.loaders.registry import PEER_BY_NAME, available_peers
from bench.loaders.results import Comparison, PeerResult
from bench.loaders.throttle import Throttle, cold_read_mbs, open_throttle
from carraystore.base.errors import InvalidInputError
from carraystore.cli.benchmarks.datasets import decode_images

__all__ = ["run_comparison"]

#: the repository root: ``bench`` is importable from it (the child runs ``python -m bench.loaders``)
ROOT = Path(__file__).resolve().parents[2]


def run_comparison(
    root: str | os.PathLike[str],
    work: str | os.PathLike[str],
    *,
    limit: int | None = None,
    image_size: tuple[int, int] | None = None,
    color_mode: str = "rgb",
    batch_size: int = 32,
    epochs: int = 3,
    cold: bool = True,
    seed: int = 0,
    peers: Sequence[str] | None = None,
    timeout_s: float = 600.0,
    progress: Callable[[str], None] | None = None,
    fresh_process: bool = True,
    throttle_mbs: float | None = None,
    probe_disk: bool = False,
    probe_mb: int = 128,
) -> Comparison:
    """Build every available peer's copy of the images under ``work`` and time each in a fresh process.

    ``throttle_mbs``: also time a cold epoch with reads of ``work``'s disk limited to this
    many MB/s (a blkio cgroup, :mod:`bench.loaders.throttle`); where that cannot be done
    here the regime is skipped and ``info["throttle"]["skipped"]`` says why. ``probe_disk``:
    measure the disk's cold sequential read speed (and the throttled one) with a probe file
    of ``probe_mb`` MiB, recorded in ``info["disk"]``.

    ``fresh_process=False`` runs every round in this process instead (the benchmark's smoke
    test at its tiny scale: one import of each library, not one per peer and round); the
    timings then exclude imports and the peak RSS is this process's, so the numbers are
    not comparable and the report says so.
    """
    say = progress or (lambda s: None)
    if color_mode not in ("grayscale", "rgb", "rgba"):
        raise InvalidInputError(f"color_mode must be grayscale, rgb or rgba, got {color_mode!r}")
    ctx = Context(str(Path(root).resolve()), limit, image_size, batch_size, seed, color_mode)
    folder = ctx.folder
    n = len(folder)
    if n < batch_size:
        raise InvalidInputError(f"{root}: {n} images is fewer than one batch of {batch_size}")
    ok, skipped = available_peers(peers)
    load_before = _loadavg()
    workp = Path(work)
    workp.mkdir(parents=True, exist_ok=True)
    image_nbytes = _image_nbytes(ctx)
    jpeg_bytes = sum(p.stat().st_size for p in folder.files)
    results: dict[str, PeerResult] = {}
    settings = dict(
        epochs=epochs,
        cold=cold,
        say=say,
        fresh_process=fresh_process,
        timeout_s=timeout_s,
        image_nbytes=image_nbytes,
        jpeg_bytes=jpeg_bytes,
        probe_disk=probe_disk,
        probe_bytes=probe_mb << 20,
        load_before=load_before,
        root=root,
        color_mode=color_mode,
        batch_size=batch_size,
        seed=seed,
    )
    throttle: Throttle | None = None
    throttle_info: dict[str, Any] | None = None
    if throttle_mbs is not None:
        if not cold:
            throttle_info = {"mbs": throttle_mbs, "skipped": "no cold epochs (--no-cold)"}
        else:
            got = open_throttle(workp, throttle_mbs)
            if isinstance(got, str):
                throttle_info = {"mbs": throttle_mbs, "skipped": got}
                say(f"throttled regime skipped: {got}")
            else:
                throttle = got
                throttle_info = got.to_json()
    try:
        return _measure(ctx, workp, peers, skipped, results, throttle, throttle_info, settings)
    finally:
        if throttle is not None:
            throttle.close()


def _measure(
    ctx: Context,
    workp: Path,
    peers: Sequence[str] | None,
    skipped: dict[str, str],
    results: dict[str, PeerResult],
    throttle: Throttle | None,
    throttle_info: dict[str, Any] | None,
    settings: dict[str, Any],
) -> Comparison:
    """Build the peers' copies and run the rounds (:func:`run_comparison`'s body, inside its throttle)."""
    n, epochs, cold = len(ctx.folder), settings["epochs"], settings["cold"]
    say, fresh_process, timeout_s = settings["say"], settings["fresh_process"], settings["timeout_s"]
    image_nbytes, jpeg_bytes = settings["image_nbytes"], settings["jpeg_bytes"]
    runnable: list[tuple[Peer, Path, float]] = []
    for peer in (PEER_BY_NAME[x] for x in (peers or PEER_BY_NAME)):
        if peer.name in skipped:
            results[peer.name] = PeerResult(peer.name, peer.label, "skipped", skipped[peer.name], on_disk=peer.on_disk)
            say(f"{peer.name}: skipped ({skipped[peer.name]})")
            continue
        try:
            say(f"{peer.name}: building")
            dest, build_s = build_artifact(peer, ctx, workp)
        except Exception as exc:  # a broken peer must not stop the comparison
            results[peer.name] = PeerResult(
                peer.name, peer.label, "error", f"build failed: {exc!r}"[:500], on_disk=peer.on_disk
            )
            say(f"{peer.name}: build failed: {exc!r}")
            continue
        size = jpeg_bytes if not peer.builds else (path_size(dest) if peer.on_disk else path_size(dest / "x.npy"))
        results[peer.name] = PeerResult(
            peer.name,
            peer.label,
            "ok",
            n_images=n,
            bytes_on_disk=size,
            build_s=build_s if peer.builds else None,
            on_disk=peer.on_disk,
            peak_rss_mb=0.0,
        )
        runnable.append((peer, dest, build_s))
    # Rounds: every peer once per round, so that other work on the machine falls on all alike.
    for rnd in range(epochs):
        for peer, dest, _ in runnable:
            row = results[peer.name]
            if row.status != "ok":
                continue
            spec = {
                "peer": peer.name,
                "dest": str(dest),
                "ctx": ctx.to_json(),
                "round": rnd,
                "cold": cold,
                "throttle": {"procs": str(throttle.procs)} if throttle is not None else None,
            }
            try:
                res = _spawn(spec, timeout_s) if fresh_process else child_main(spec)
            except Exception as exc:
                row.status, row.reason = "error", str(exc)[:500]
                say(f"{peer.name}: failed: {str(exc)[:300]}")
                continue
            if res["n"] != n:
                row.status, row.reason = "error", f"delivered {res['n']} images of {n}"
                continue
            row.warm_s.append(res["warm_s"])
            if res["cold_s"] is not None:
                row.cold_s.append(res["cold_s"])
            if res.get("throttled_s") is not None:
                row.throttled_s.append(res["throttled_s"])
            row.peak_rss_mb = max(row.peak_rss_mb or 0.0, res["peak_rss_mb"])
            if rnd == 0:
                row.diversity = res["diversity"]
            cold_txt = f", {n / res['cold_s']:.0f} cold" if res["cold_s"] else ""
            if res.get("throttled_s"):
                cold_txt += f", {n / res['throttled_s']:.0f} cold at {throttle.mbs:g} MB/s" if throttle else ""
            say(f"round {rnd + 1}/{epochs} {peer.name}: {n / res['warm_s']:.0f} img/s warm{cold_txt}")
    rows = []
    for name in peers or PEER_BY_NAME:
        row = results[name]
        if row.status == "ok":
            wm = statistics.median(row.warm_s)
            cm = statistics.median(row.cold_s) if row.cold_s else None
            row.images_per_s_warm = n / wm
            row.mb_per_s_warm = n / wm * image_nbytes / 1e6
            row.images_per_s_cold = n / cm if cm else None
            row.mb_per_s_cold = n / cm * image_nbytes / 1e6 if cm else None
            tm = statistics.median(row.throttled_s) if row.throttled_s else None
            row.images_per_s_throttled = n / tm if tm else None
            row.mb_per_s_throttled = n / tm * image_nbytes / 1e6 if tm else None
        else:
            row.warm_s, row.cold_s, row.throttled_s = [], [], []
        rows.append(row)
    info = {
        "images": n,
        "image_shape": list(_image_shape(ctx)),
        "color_mode": settings["color_mode"],
        "source": str(settings["root"]),
        "source_bytes": jpeg_bytes,
        "batch_size": settings["batch_size"],
        "epochs": epochs,
        "cold": cold,
        "seed": settings["seed"],
        "fresh_process": fresh_process,
        "machine": machine_info(),
        "versions": library_versions(),
        "date": time.strftime("%Y-%m-%d"),
        "load_average_before_after": [settings["load_before"], _loadavg()],
    }
    if throttle_info is not None:
        info["throttle"] = throttle_info
    if settings["probe_disk"]:
        size = settings["probe_bytes"]
        info["disk"] = {"cold_read_mbs": round(cold_read_mbs(workp, size), 1), "probe_mib": size >> 20}
        if throttle is not None:
            info["disk"]["throttled_read_mbs"] = round(cold_read_mbs(workp, size, throttle=throttle), 1)
    return Comparison(rows, info)


def _loadavg() -> float | None:
    """The 1-minute load average (other work on the machine skews timings), or None."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


def _image_shape(ctx: Context) -> tuple[int, ...]:
    if ctx._images is not None:
        return tuple(ctx._images.shape[1:])
    return tuple(decode_images(ctx.folder.files[:1], ctx.image_size, color_mode=ctx.color_mode).shape[1:])


def _image_nbytes(ctx: Context) -> int:
    return int(math.prod(_image_shape(ctx)))


def _spawn(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("KERAS_BACKEND", "tensorflow")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", CHILD_MODULE, "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"exit status {proc.returncode}: " + " | ".join(tail))
    result: dict[str, Any] = json.loads(lines[-1])
    return result
