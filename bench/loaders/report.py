"""The comparison as a markdown table, sentences about the goals, a bar chart, and files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from bench.loaders.results import Comparison, check_goals

__all__ = ["results_table", "goals_text", "plot_results", "write_results", "markdown_report"]


def _fmt(v: float | None, digits: int = 0) -> str:
    return "—" if v is None else f"{v:,.{digits}f}"


def _throttle_mbs(cmp: Comparison) -> float | None:
    """The throttled regime's read limit, when it was measured."""
    t = cmp.info.get("throttle") or {}
    if "skipped" in t or not any(r.images_per_s_throttled for r in cmp.rows):
        return None
    return float(t["mbs"])


def results_table(cmp: Comparison) -> str:
    """The comparison as a markdown table (a column for the throttled disk when it was measured)."""
    mbs = _throttle_mbs(cmp)
    extra = f" images/s cold, {mbs:g} MB/s disk |" if mbs else ""
    lines = [
        "| loader | images/s warm | images/s cold |" + extra + " MB/s warm | MB/s cold | on disk MB | peak RSS MB "
        "| labels/batch | build s |",
        "|---|---:|---:|" + ("---:|" if mbs else "") + "---:|---:|---:|---:|---:|---:|",
    ]
    for r in cmp.rows:
        if r.status != "ok":
            lines.append(f"| {r.label} | {r.status}: {r.reason} | | | | | | | |" + (" |" if mbs else ""))
            continue
        disk = _fmt(r.bytes_on_disk / 1e6, 1) if r.bytes_on_disk is not None else "—"
        throttled = f" {_fmt(r.images_per_s_throttled)} |" if mbs else ""
        lines.append(
            f"| {r.label} | {_fmt(r.images_per_s_warm)} | {_fmt(r.images_per_s_cold)} |{throttled} "
            f"{_fmt(r.mb_per_s_warm)} | {_fmt(r.mb_per_s_cold)} | {disk} | {_fmt(r.peak_rss_mb)} | "
            f"{_fmt(r.diversity, 1)} | {_fmt(r.build_s, 1)} |"
        )
    return "\n".join(lines) + "\n"


def goals_text(cmp: Comparison) -> str:
    """The goals as plain sentences with the numbers."""
    g = check_goals(cmp)
    out = []
    if "warm_fast_2x" in g:
        x = g["warm_fast_2x"]
        out.append(
            f"- Warm cache, `fast` preset, block shuffle: {x['carraystore']:,.0f} images/s vs {x['best_peer_images_per_s']:,.0f} "
            f"for the fastest on-disk peer ({x['best_peer']}): {x['ratio']:.2f}x — goal >= 2x **{'met' if x['met'] else 'NOT met'}**."
        )
    if "warm_fast_half_numpy" in g:
        x = g["warm_fast_half_numpy"]
        out.append(
            f"- Warm cache, `fast` preset, block shuffle: {x['carraystore']:,.0f} images/s vs {x['numpy_images_per_s']:,.0f} "
            f"for in-memory numpy: {x['ratio']:.2f}x — goal >= 0.5x **{'met' if x['met'] else 'NOT met'}**."
        )
    mbs = _throttle_mbs(cmp)
    for key, where in (
        ("cold_default_beats_all", "Cold cache"),
        ("throttled_default_beats_all", f"Cold, disk at {mbs or 0:g} MB/s"),
    ):
        if key in g:
            x = g[key]
            held = "the disk holds the default back" if x["disk_bound"] else "the codec sets the pace"
            out.append(
                f"- {where}, default preset for this disk (`{x['preset']}`), block shuffle: {x['carraystore']:,.0f} images/s "
                f"vs {x['best_peer_images_per_s']:,.0f} for the fastest on-disk peer ({x['best_peer']}): {x['ratio']:.2f}x "
                f"— {held}, goal >= {x['goal']:g}x **{'met' if x['met'] else 'NOT met'}**."
            )
    if "small_not_larger_than_npz" in g:
        x = g["small_not_larger_than_npz"]
        out.append(
            f"- `small` store {x['carraystore_small_bytes'] / 1e6:,.1f} MB vs `.npz` cache {x['npz_bytes'] / 1e6:,.1f} MB "
            f"({x['ratio']:.2f}x) — goal <= 1x **{'met' if x['met'] else 'NOT met'}**."
        )
    return "\n".join(out) + ("\n" if out else "")


def plot_results(cmp: Comparison, path: str | os.PathLike[str]) -> Path | None:
    """A horizontal bar chart of images/s, warm and cold; None when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = [r for r in cmp.rows if r.status == "ok"]
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(rows) + 1.5))
    y = np.arange(len(rows))
    warm = [r.images_per_s_warm or 0 for r in rows]
    cold = [r.images_per_s_cold or 0 for r in rows]
    colors = [
        "tab:purple" if r.name.startswith("carraystore") else ("tab:gray" if not r.on_disk else "tab:blue")
        for r in rows
    ]
    ax.barh(y - 0.2, warm, height=0.4, color=colors, label="warm page cache")
    ax.barh(y + 0.2, cold, height=0.4, color=colors, alpha=0.45, label="cold (evicted before each epoch)")
    mbs = _throttle_mbs(cmp)
    if mbs:
        throttled = [r.images_per_s_throttled or 0 for r in rows]
        ax.scatter(throttled, y + 0.2, marker="|", s=90, color="black", label=f"cold, disk at {mbs:g} MB/s")
    for yi, w in zip(y, warm, strict=True):
        ax.text(w, yi - 0.2, f" {w:,.0f}", va="center", fontsize=7)
    ax.set_yticks(y, [r.label for r in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("images/s (log scale; higher is better)")
    shape = "x".join(str(s) for s in cmp.info.get("image_shape", []))
    ax.set_title(
        f"{cmp.info.get('images')} images of {shape}, batch {cmp.info.get('batch_size')}, "
        f"median of {cmp.info.get('epochs')} rounds, {cmp.info.get('machine', {}).get('cpus')} cores",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_results(cmp: Comparison, out_dir: str | os.PathLike[str], stem: str = "loaders") -> dict[str, Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    tmp = paths["json"].with_suffix(".json.tmp")
    tmp.write_text(json.dumps(cmp.to_json(), indent=1))
    os.replace(tmp, paths["json"])
    paths["md"].write_text(markdown_report(cmp))
    png = plot_results(cmp, out / f"{stem}.png")
    if png is not None:
        paths["png"] = png
    return paths


def _regime_lines(cmp: Comparison) -> list[str]:
    """What the throttled regime and the disk probe were (nothing when neither ran)."""
    t = cmp.info.get("throttle")
    d = cmp.info.get("disk") or {}
    out = []
    if t and "skipped" in t:
        out.append(f"The throttled disk ({t['mbs']:g} MB/s) was not measured: {t['skipped']}.")
    elif t:
        out.append(
            f"Throttled column: one more cold epoch per round with reads of the disk ({t['device']}) limited to "
            f"{t['mbs']:g} MB/s by a cgroup-v1 blkio throttle, as an HDD or a network file system serves them."
        )
    if d:
        speeds = f"{d['cold_read_mbs']:,.0f} MB/s"
        if d.get("throttled_read_mbs"):
            speeds += f" ({d['throttled_read_mbs']:,.0f} MB/s throttled)"
        out.append(f"The disk's cold sequential read (a {d.get('probe_mib', 128)} MiB probe file): {speeds}.")
    return [" ".join(out), ""] if out else []


def markdown_report(cmp: Comparison, heading: str = "# Loader comparison") -> str:
    """Heading, what it ran on, the table and the goals."""
    i = cmp.info
    m = i.get("machine", {})
    shape = "x".join(str(s) for s in i.get("image_shape", []))
    vers = ", ".join(f"{k} {v}" for k, v in i.get("versions", {}).items())
    lines = [
        heading,
        "",
        f"{i.get('images')} images of {shape} (uint8) from `{Path(str(i.get('source', ''))).name}`, batch {i.get('batch_size')}, "
        f"median of {i.get('epochs')} rounds; "
        + (
            "in each round every loader runs in a fresh process (peak RSS is its own, imports included)"
            if i.get("fresh_process", True)
            else "every loader ran in one process (a smoke run: peak RSS is that process's, not each loader's)"
        )
        + ": a cold epoch (every file of the loader evicted from the page cache first), then a warm epoch. "
        "On-disk copies are written in class-sorted folder order (the worst case for chunk-level shuffles: see labels/batch).",
        "",
        f"Machine: {m.get('cpus')} cores ({m.get('cpu')}), {m.get('memory_gb')} GB RAM, {m.get('system')}, Python {m.get('python')}; "
        f"measured {i.get('date')}"
        + (
            f"; 1-minute load average {i['load_average_before_after'][0]} before, {i['load_average_before_after'][1]} after "
            "(the machine was shared: loads above the core count slow every row)"
            if i.get("load_average_before_after")
            else ""
        )
        + ".",
        "",
        f"Libraries: {vers}.",
        "",
        *_regime_lines(cmp),
        results_table(cmp),
        goals_text(cmp),
    ]
    skipped = [r for r in cmp.rows if r.status != "ok"]
    if skipped:
        lines += ["Not measured:", ""] + [f"- {r.label}: {r.status} ({r.reason})" for r in skipped] + [""]
    return "\n".join(lines)
