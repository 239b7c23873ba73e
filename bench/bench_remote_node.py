"""The remote 0 ms goal with the storage node on cores of its own.

Goal: "at 0 ms [an epoch] reaches at least 0.8x of the local warm rate". In
``bench_remote.py`` the 0 ms link puts SeaweedFS, the Python link proxy and the reader on
the same cores, so the reader gets what the server leaves (SeaweedFS's S3 gateway spends
4-6 CPU ms per MB of ranged reads here, ``bench_transport.py``): that measures the machine,
not the reader. Here a storage node
is emulated the way a second machine would be: a plain HTTP server (Range requests, bodies
by ``sendfile``) runs in a process pinned to the first half of the cores, the reader in a
process pinned to the other half, and the local warm rate (page cache warm) is measured in
a process pinned to that same half. The link is loopback: 0 ms, no cap.

Each preset runs twice: with glibc's malloc as it comes, and tuned by two environment
variables (``MALLOCS``) that keep large freed blocks in malloc's heap. Since chunk bodies
land in reused receive buffers the two should not differ; the tuned runs show that they do
not (docs/remote.md, "Receive buffers").

Reported per preset and malloc: images/s remote and local (median of every timed epoch over
alternating rounds, to spread the machine's drift over both), time to the first batch,
the reader's CPU per image (user + system of its timed epochs, all threads), and the
server's share of its core while the remote epochs ran (its process start aside). The goal
is reported, not asserted (shared machines).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchpaths import data_dir, write_json

import carraystore
from bench.benchdata import cached_photo_folder
from bench.procstats import cpu_seconds
from testsupport.malloc import TUNED_MALLOC_ENV

SCALE = os.environ.get("CARRAYSTORE_BENCH_SCALE", "default")
ROOT = Path(__file__).resolve().parent.parent
#: photos, their size, timed epochs per run, alternating rounds (remote, local) per preset
SCALES = {
    "tiny": dict(n=96, size=(64, 64), epochs=1, rounds=1),
    "default": dict(n=2000, size=(128, 128), epochs=4, rounds=3),
    "medium": dict(n=10000, size=(128, 128), epochs=3, rounds=3),
    "large": dict(n=10000, size=(256, 256), epochs=3, rounds=3),
}
CFG = SCALES[SCALE]
BATCH = 64
#: the library's default stores (4 MiB chunks; bench_remote.py uses 1 MiB chunks so that
#: its first batches, a whole shuffle window each, come sooner over a 20-50 ms link)
PRESETS = ("balanced", "fast")
#: glibc's malloc, as it comes, and tuned to keep large freed blocks in its heap (before the
#: receive buffers, every fetched chunk landed in freshly mapped pages that the kernel had to
#: fault in and zero: the tuning was the workaround)
MALLOCS = {"default": {}, "tuned": TUNED_MALLOC_ENV}  # tuned: what testsupport.malloc.tune_malloc() sets


def _cores() -> tuple[set[int], set[int]]:
    """(server cores, reader cores): the first and the second half of this process's cores."""
    cpus = sorted(os.sched_getaffinity(0))
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


def _stores() -> Path:
    work = data_dir().parent / "remote" / f"n{CFG['n']}-{CFG['size'][0]}x{CFG['size'][1]}-chunkdefault"
    work.mkdir(parents=True, exist_ok=True)
    folder = cached_photo_folder(data_dir(), CFG["n"], size=CFG["size"])
    for preset in PRESETS:
        if not (work / f"{preset}.b2nd").exists():
            carraystore.from_directory(folder, work / f"{preset}.b2nd", workers=1, codec=preset)
    return work


def _reader(location: str, local: bool, cores: set[int], env: dict[str, str]) -> list[dict[str, Any]]:
    """One reader process pinned to ``cores``, ``env`` added to its environment: its timed
    epochs, each with the process's CPU seconds (a local run first reads one untimed epoch:
    page cache warm)."""
    spec = {
        "kind": "carraystore_local" if local else "carraystore",
        "location": location,
        "epochs": CFG["epochs"],
        "batch_size": BATCH,
        "seed": 0,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "bench.remote_epochs", f.name],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
            preexec_fn=lambda: os.sched_setaffinity(0, cores),
            check=False,
            env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
        )
    finally:
        os.unlink(f.name)
    rows = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if not rows:
        raise RuntimeError(f"reader of {location} failed:\n{out.stderr[-3000:]}")
    return rows[0]


def test_remote_node(benchmark) -> None:  # type: ignore[no-untyped-def]
    server_cores, reader_cores = _cores()
    if not server_cores:
        import pytest

        pytest.skip("needs 2 cores or more: one half for the storage node, the other for the reader")
    work = _stores()
    srv = subprocess.Popen(
        [sys.executable, "-m", "testsupport.servers", str(work)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, server_cores),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        assert srv.stdout is not None
        port = int(srv.stdout.readline().split()[1])
        results: dict[str, Any] = {}
        for preset in PRESETS:
            path = work / f"{preset}.b2nd"
            url = f"http://127.0.0.1:{port}/{path.name}"
            for malloc, env in MALLOCS.items():
                runs: dict[str, list[list[dict[str, Any]]]] = {"remote": [], "local": []}
                server_cpu = remote_wall = 0.0
                for _ in range(CFG["rounds"]):
                    c0 = cpu_seconds(srv.pid)
                    r = _reader(url, False, reader_cores, env)
                    server_cpu += cpu_seconds(srv.pid) - c0
                    remote_wall += sum(e["seconds"] for e in r)
                    runs["remote"].append(r)
                    runs["local"].append(_reader(str(path), True, reader_cores, env))
                results[f"{preset}/{malloc}"] = {
                    "preset": preset,
                    "malloc": malloc,
                    **_summary(runs, server_cpu, remote_wall),
                }
    finally:
        if srv.stdin:
            srv.stdin.close()
        try:
            srv.wait(10)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
    benchmark.pedantic(lambda: None, rounds=1)
    info = {
        "scale": SCALE,
        "images": CFG["n"],
        "image_shape": [*CFG["size"], 3],
        "batch_size": BATCH,
        "epochs_per_run": CFG["epochs"],
        "rounds": CFG["rounds"],
        "server_cores": sorted(server_cores),
        "reader_cores": sorted(reader_cores),
        "load_average": os.getloadavg(),
        "malloc_tuned_env": MALLOCS["tuned"],
        "presets": results,
    }
    out = write_json(SCALE, "remote_node.json", info)
    md = _markdown(info)
    (out / "remote_node.md").write_text(md)
    print(md)


def _summary(runs: dict[str, list[list[dict[str, Any]]]], server_cpu: float, remote_wall: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, rs in runs.items():
        epochs = [e for r in rs for e in r]
        out[kind] = {
            "images_per_s": statistics.median(e["images_per_s"] for e in epochs),
            "epoch_rates": [round(e["images_per_s"]) for e in epochs],
            "epoch_images": [e["images"] for e in epochs],
            "first_batch_s": statistics.median(e["first_batch_s"] for e in epochs),
            "cpu_us_per_image": statistics.median(e["cpu_s"] / e["images"] for e in epochs) * 1e6,
        }
    out["ratio"] = out["remote"]["images_per_s"] / out["local"]["images_per_s"]
    # the same without each run's first epoch (start-up: connections, first touch of buffers)
    steady = {kind: [e["images_per_s"] for r in rs for e in r[1:]] for kind, rs in runs.items()}
    out["steady_ratio"] = (
        statistics.median(steady["remote"]) / statistics.median(steady["local"]) if all(steady.values()) else None
    )
    out["server_core_share"] = server_cpu / remote_wall if remote_wall else None
    return out


def _markdown(info: dict[str, Any]) -> str:
    lines = [
        f"# Remote epochs at 0 ms from a storage node on cores of its own ({info['images']} photos "
        f"{info['image_shape'][0]}x{info['image_shape'][1]}, batches of {info['batch_size']}, load average "
        f"{info['load_average'][0]:.1f})",
        "",
        f"HTTP server (Range, sendfile) pinned to cores {info['server_cores']}; every reader pinned to cores "
        f"{info['reader_cores']}; {info['rounds']} alternating rounds of {info['epochs_per_run']} timed epochs each "
        "(local runs read one untimed epoch first: page cache warm). Rates are the median epoch; CPU is the reader "
        "process's user + system time per image in its timed epochs (median epoch), all its threads. glibc malloc "
        "`tuned`: the reader (remote and local alike) ran with "
        + " ".join(f"{k}={v}" for k, v in info["malloc_tuned_env"].items())
        + ".",
        "",
        "| store preset | glibc malloc | remote images/s | local warm images/s | remote / local (goal 0.8) | "
        "same, runs' first epochs aside | first batch remote / local (s) | reader CPU per image remote / local (µs) "
        "| server core share |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in info["presets"].values():
        lines.append(
            f"| {r['preset']} | {r['malloc']} | {r['remote']['images_per_s']:,.0f} | {r['local']['images_per_s']:,.0f} | **{r['ratio']:.2f}** | "
            f"{'-' if r['steady_ratio'] is None else format(r['steady_ratio'], '.2f')} | "
            f"{r['remote']['first_batch_s']:.3f} / {r['local']['first_batch_s']:.3f} | "
            f"{r['remote']['cpu_us_per_image']:.0f} / {r['local']['cpu_us_per_image']:.0f} | {r['server_core_share']:.2f} |"
        )
    lines += [
        "",
        "Epoch rates (images/s): "
        + "; ".join(
            f"{k} remote {r['remote']['epoch_rates']}, local {r['local']['epoch_rates']}"
            for k, r in info["presets"].items()
        ),
        "",
    ]
    return "\n".join(lines)
