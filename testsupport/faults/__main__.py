"""``python -m testsupport.faults``: run a seeded fault campaign, or replay one run of it."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from testsupport.faults.campaign import KINDS, replay, run_campaign
from testsupport.faults.checker import CATEGORIES
from testsupport.faults.inject import MUTANTS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testsupport.faults", description=__doc__)
    p.add_argument("--seed", type=int, default=0, help="the campaign's seed (default 0)")
    p.add_argument("--runs", type=int, default=100, help="how many runs (default 100)")
    p.add_argument("--first", type=int, default=0, help="the first run's number (default 0)")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    p.add_argument("--kinds", help=f"comma-separated fault kinds to draw from (default all: {','.join(KINDS)})")
    p.add_argument("--mutant", choices=sorted(MUTANTS), help="run under a seeded bug (the checker must see it)")
    p.add_argument("--replay", type=int, metavar="R", help="run R alone, showing everything it did")
    p.add_argument("--workdir", type=Path, help="where the runs work (default: a temporary folder)")
    p.add_argument("--json", type=Path, help="write the result as JSON to this file")
    p.add_argument("-q", "--quiet", action="store_true", help="no line per run")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",") if args.kinds else None
    if kinds and set(kinds) - set(KINDS):
        p.error(f"unknown kinds {sorted(set(kinds) - set(KINDS))}; known: {', '.join(KINDS)}")
    if args.replay is not None:
        r = replay(args.seed, args.replay, kinds=kinds, mutant=args.mutant, workdir=args.workdir)
        return 1 if any(r["violations"]["counts"].values()) else 0
    result = run_campaign(
        args.seed,
        args.runs,
        first=args.first,
        jobs=args.jobs,
        kinds=kinds,
        mutant=args.mutant,
        workdir=args.workdir,
        progress=not args.quiet,
    )
    print(result.report())
    if args.json:
        args.json.write_text(json.dumps(result.to_json(), indent=1) + "\n")
    return 0 if all(result.totals()[c] == 0 for c in CATEGORIES) else 1


if __name__ == "__main__":
    sys.exit(main())
