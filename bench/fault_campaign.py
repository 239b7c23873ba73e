"""The long seeded fault campaign (``make faults``): results to bench/results/faults.md and .json.

    python bench/fault_campaign.py [--seed S] [--runs N] [--jobs J] [--kinds K1,K2] [--results DIR]

Runs ``testsupport.faults`` (kills at the K-th file-system call and at random moments of appends,
``ingest --append``, ``meta``, ``convert``, ``copy`` and rollbacks; EFBIG; ENOSPC on a small tmpfs
where this machine can mount one; concurrent writers and readers; then a recovery append and the
checker) and writes the counts per fault kind, per faulted operation and per outcome, with the runs
that broke an invariant and how to replay each. ``tests/faults/test_campaign.py`` runs a short
campaign of the same code in ``make test``. Exit status 1 when any invariant was broken.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run as a script: testsupport from the repository root

from testsupport.faults import CATEGORIES, KINDS, run_campaign  # noqa: E402


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=HERE.parent, capture_output=True, text=True, timeout=30
        )
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def _table(rows: dict[str, dict[str, int]], title: str) -> list[str]:
    lines = [
        f"| {title} | runs | fault fired | ok | " + " | ".join(CATEGORIES) + " | skipped |",
        "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in CATEGORIES) + " | ---: |",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {row['runs']} | {row['fired']} | {row['ok']} | "
            + " | ".join(str(row[c]) for c in CATEGORIES)
            + f" | {row['skipped']} |"
        )
    return [*lines, ""]


def _total(data: dict[str, Any]) -> str:
    t = data["totals"]
    return ", ".join(f"{c} {t[c]}" for c in CATEGORIES)


def _replay(data: dict[str, Any], run: int) -> str:
    kinds = f" --kinds {','.join(data['kinds'])}" if data.get("kinds") else ""
    return f"`python -m testsupport.faults --seed {data['seed']} --replay {run}{kinds}`"


def markdown(data: dict[str, Any], baseline: dict[str, Any] | None = None) -> str:
    """faults.md from faults.json (and the faults.json of an earlier campaign to compare with)."""
    info = data["info"]
    runs, seconds = data["runs"], data["seconds"]
    clean = not any(data["totals"].values())
    lines = [
        "# Fault campaign",
        "",
        f"`make faults RUNS={runs} SEED={data['seed']}` on {info['date']}, commit {info['commit']}, "
        f"{info['cpus']} cores, {info['jobs']} runs at a time: {seconds:.0f} s ({seconds / max(1, runs):.2f} s a run).",
        "",
        "Each run: a tiny store; one to four writers at once (API appends, `ingest --append`, `meta`, "
        "`convert`, `copy`) and up to two readers, the first writer meeting the run's fault; then a "
        "recovery append and a checker that holds every acknowledged transaction, key, label, target, "
        "group, pixel and attr against the ground-truth log, runs `verify` on the store and every "
        "copy, and checks what every reader saw (testsupport/faults).",
        "",
        f"**Total: {_total(data)}**" + (" (every invariant held)" if clean else ""),
        "",
        *_table(data["by_kind"], "fault kind"),
        *_table(data["by_op"], "faulted operation"),
        "Counts are violations (an acknowledged transaction missing, a reader snapshot that failed, ...), "
        "several per run at times. *fault fired*: a planned kill happened, the size limit or the full disk "
        "made a write fail, a link fault was armed or the server restarted (a K past an operation's last "
        "call, or a limit above what it writes, leaves it whole). *rollback*: a write killed while its "
        "journal exists, then one to three openers killed at the K-th call of their rollback.",
        "",
    ]
    if data.get("skipped"):
        skipped = sum(row["skipped"] for row in data["by_kind"].values())
        lines += [f"Skipped: {skipped} runs ({data['skipped']}).", ""]
    bad = data.get("violations", [])
    if bad:
        lines += ["## Runs that broke an invariant", ""]
        for r in bad[:60]:
            counts = ", ".join(f"{c} {n}" for c, n in r["counts"].items() if n)
            first = r["details"][0].splitlines()[0][:400] if r["details"] else ""
            lines.append(
                f"- run {r['run']} ({r['kind']}, {r['op']}): {counts}. {first}  \n  replay: {_replay(data, r['run'])}"
            )
        if len(bad) > 60:
            lines.append(f"- ... and {len(bad) - 60} more (faults.json)")
        lines.append("")
    if baseline is not None:
        b = baseline["info"]
        lines += [
            f"## The same campaign on commit {b['commit']}",
            "",
            f"{baseline['runs']} runs, seed {baseline['seed']}, {baseline['seconds']:.0f} s: **{_total(baseline)}**. "
            f"Its runs replay on that commit with this campaign's testsupport/faults: "
            f"`python -m testsupport.faults --seed {baseline['seed']} --replay R`.",
            "",
            *_table(baseline["by_kind"], "fault kind"),
        ]
        for c, numbers in baseline["violating_runs"].items():
            if numbers:
                lines.append(f"- {c}: runs {', '.join(map(str, numbers))}")
        for r in baseline.get("violations", [])[:1] + [
            next((v for v in baseline.get("violations", []) if v["counts"].get("torn")), None)
        ]:
            if r is not None and r["details"]:
                lines.append(f"- run {r['run']} ({r['kind']}, {r['op']}): {r['details'][0].splitlines()[0][:300]}")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--runs", type=int, default=1000)
    p.add_argument("--jobs", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--kinds", help=f"comma-separated fault kinds (default all: {','.join(KINDS)})")
    p.add_argument("--results", type=Path, default=HERE / "results", help="where faults.md and faults.json go")
    p.add_argument("--commit", help="what to call the code tested (default: git describe of this checkout)")
    p.add_argument("--baseline", type=Path, help="the faults.json of an earlier campaign, shown beside this one")
    p.add_argument("--render", action="store_true", help="run nothing: write faults.md again from faults.json")
    p.add_argument("-q", "--quiet", action="store_true", help="no line per run")
    args = p.parse_args(argv)
    baseline = json.loads(args.baseline.read_text()) if args.baseline else None
    out_json, out_md = args.results / "faults.json", args.results / "faults.md"
    if args.render:
        data = json.loads(out_json.read_text())
        out_md.write_text(markdown(data, baseline))
        print(f"wrote {out_md}")
        return 0 if not any(data["totals"].values()) else 1
    kinds = args.kinds.split(",") if args.kinds else None
    result = run_campaign(args.seed, args.runs, jobs=args.jobs, kinds=kinds, progress=not args.quiet)
    print(result.report())
    info = {
        "date": datetime.date.today().isoformat(),
        "commit": args.commit or _commit(),
        "cpus": len(os.sched_getaffinity(0)),
        "jobs": args.jobs,
        "python": platform.python_version(),
    }
    data = {"info": info, **result.to_json()}
    args.results.mkdir(parents=True, exist_ok=True)
    out_json.write_text(json.dumps(data, indent=1) + "\n")
    out_md.write_text(markdown(data, baseline))
    print(f"wrote {out_md} and faults.json")
    return 0 if result.clean else 1


if __name__ == "__main__":
    sys.exit(main())
