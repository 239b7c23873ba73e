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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run as a script: testsupport from the repository root

from testsupport.faults import CATEGORIES, KINDS, CampaignResult, run_campaign  # noqa: E402


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "describe", "--always", "--dirty"], cwd=HERE.parent, capture_output=True, text=True, timeout=30
        )
        return out.stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def markdown(result: CampaignResult, info: dict[str, object]) -> str:
    t = result.totals()
    lines = [
        "# Fault campaign",
        "",
        f"`make faults RUNS={len(result.runs)} SEED={result.seed}` on {info['date']}, commit {info['commit']}, "
        f"{info['cpus']} cores, {info['jobs']} runs at a time: {result.seconds:.0f} s "
        f"({result.seconds / max(1, len(result.runs)):.2f} s a run).",
        "",
        "Each run: a tiny store; one to four writers at once (API appends, `ingest --append`, `meta`, "
        "`convert`, `copy`) and up to two readers, the first writer meeting the run's fault; then a "
        "recovery append and a checker that holds every acknowledged transaction, key, label, target, "
        "group, pixel and attr against the ground-truth log, runs `verify` on the store and every "
        "copy, and checks what every reader saw (testsupport/faults).",
        "",
        "**Total: "
        + ", ".join(f"{c} {t[c]}" for c in CATEGORIES)
        + "**"
        + (" (every invariant held)" if result.clean else ""),
        "",
    ]
    for key, title in (("kind", "fault kind"), ("op", "faulted operation")):
        lines += [
            f"| {title} | runs | fault fired | ok | " + " | ".join(CATEGORIES) + " | skipped |",
            "| --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in CATEGORIES) + " | ---: |",
        ]
        for name, row in result.by(key).items():
            lines.append(
                f"| {name} | {row['runs']} | {row['fired']} | {row['ok']} | "
                + " | ".join(str(row[c]) for c in CATEGORIES)
                + f" | {row['skipped']} |"
            )
        lines.append("")
    lines += [
        "Counts are violations (an acknowledged transaction missing, a reader snapshot that failed, ...), "
        "several per run at times. *fault fired*: a planned kill happened, or the size limit or the full "
        "disk made a write fail (a K past an operation's last call, or a limit above what it writes, "
        "leaves it whole). *rollback*: a write killed while its journal exists, then one to three "
        "openers killed at the K-th call of their rollback.",
        "",
    ]
    skipped = [r for r in result.runs if r.get("skipped")]
    if skipped:
        lines += [f"Skipped: {len(skipped)} runs ({skipped[0]['skipped']}).", ""]
    bad = [r for r in result.runs if any(r["violations"]["counts"].values())]
    if bad:
        lines += ["## Runs that broke an invariant", ""]
        for r in bad[:60]:
            counts = ", ".join(f"{c} {n}" for c, n in r["violations"]["counts"].items() if n)
            first = r["violations"]["details"][0].splitlines()[0][:400] if r["violations"]["details"] else ""
            lines.append(
                f"- run {r['run']} ({r['kind']}, {r['op']}): {counts}. {first}  \n"
                f"  replay: `python -m testsupport.faults --seed {result.seed} --replay {r['run']}"
                + (f" --kinds {','.join(result.kinds)}" if result.kinds else "")
                + "`"
            )
        if len(bad) > 60:
            lines.append(f"- ... and {len(bad) - 60} more (faults.json)")
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
    p.add_argument("-q", "--quiet", action="store_true", help="no line per run")
    args = p.parse_args(argv)
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
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "faults.json").write_text(json.dumps({"info": info, **result.to_json()}, indent=1) + "\n")
    (args.results / "faults.md").write_text(markdown(result, info))
    print(f"wrote {args.results / 'faults.md'} and faults.json")
    return 0 if result.clean else 1


if __name__ == "__main__":
    sys.exit(main())
