"""The seeded fault campaign (testsupport/faults) as part of the suite.

A short fixed-seed campaign: kills at the K-th file-system call and at random moments of
appends, ``ingest --append``, ``meta``, ``convert``, ``copy`` and of rollbacks, EFBIG through
``RLIMIT_FSIZE``, ENOSPC on a small tmpfs (where this machine lets the test mount one),
concurrent writers and readers; then a recovery append and the checker. (The remote faults,
SeaweedFS killed and restarted, 503s, cut and stalled connections, killed uploads, need a
server that takes seconds to start: they run in the long campaign only.) Every acknowledged
transaction must be there, whole and right; nothing else may be (docs/appends.md). And the
checker must see seeded bugs: the same campaign under each of them reports violations.

The campaign runs in its own process (``python -m testsupport.faults``), which forks its
workers from a parent that starts no thread (a pytest-xdist worker has some).
``make faults`` runs the long campaign (1,000 runs).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import carraystore
from testsupport.faults import CATEGORIES, LOCAL_KINDS, MUTANTS, draw_plan
from testsupport.faults.checker import judge
from testsupport.faults.truth import TruthWriter, Txn
from testsupport.faults.workers import Ctx, items_of, make_template

pytestmark = pytest.mark.skipif(not hasattr(os, "fork") or sys.platform == "darwin", reason="forks workers (Linux)")

ROOT = Path(__file__).resolve().parents[2]
#: The short campaign's seed: its runs meet every local fault kind and every faulted operation.
SEED = 17
RUNS = 36


def _campaign(tmp_path: Path, *args: str, timeout: float = 300) -> tuple[dict[str, Any], str]:
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, "-m", "testsupport.faults", *args, "--json", str(out), "-q"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    text = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert out.exists(), f"the campaign wrote no result (status {proc.returncode}):\n{text}"
    return json.loads(out.read_text()), text


def test_a_run_is_determined_by_seed_and_number() -> None:
    assert draw_plan(SEED, 5).to_json() == draw_plan(SEED, 5).to_json()
    plans = [draw_plan(SEED, r, LOCAL_KINDS) for r in range(RUNS)]
    assert len({json.dumps(p.to_json()) for p in plans}) == RUNS
    # the short campaign meets every local fault kind and every faulted operation
    assert {p.kind for p in plans} == set(LOCAL_KINDS)
    assert {p.faulted_op for p in plans} >= {"append", "ingest", "meta", "convert", "copy", "rollback"}


@pytest.mark.slow
def test_a_short_seeded_campaign_finds_no_violation(tmp_path: Path) -> None:
    result, text = _campaign(tmp_path, "--seed", str(SEED), "--runs", str(RUNS), "--kinds", ",".join(LOCAL_KINDS))
    assert result["runs"] == RUNS
    assert result["totals"] == {c: 0 for c in CATEGORIES}, text
    by_kind = result["by_kind"]
    for kind in ("kill-syscall", "kill-random", "kill-rollback", "efbig"):
        assert by_kind[kind]["fired"] > 0, (kind, text)  # the faults happened: kills, failed writes
    if by_kind["enospc"]["skipped"] < by_kind["enospc"]["runs"]:
        assert by_kind["enospc"]["fired"] > 0, text


#: Each seeded bug, the fault kinds (and seed, runs) that meet it, and what the checker must report.
SEEDED = [
    ("rollback-no-truncate", "kill-rollback", SEED, 5, ("torn",)),  # a rolled-back file keeps the write's bytes
    ("journal-kept", "clean", SEED, 2, ("lost",)),  # a commit that leaves its journal: the next opener undoes it
    # writers at once (seed 69: two to four writers in each of its first runs)
    ("no-flock", "clean", 69, 5, ("lost", "dup", "wrong", "torn")),
    ("wrong-pixel", "clean", SEED, 1, ("wrong",)),  # one bit of each chunk's first pixel
]


def test_every_seeded_bug_is_tested() -> None:
    assert {name for name, *_ in SEEDED} == set(MUTANTS)


@pytest.mark.slow
@pytest.mark.parametrize(("mutant", "kinds", "seed", "runs", "expect"), SEEDED, ids=[s[0] for s in SEEDED])
def test_the_checker_reports_a_seeded_bug(
    tmp_path: Path, mutant: str, kinds: str, seed: int, runs: int, expect: tuple[str, ...]
) -> None:
    args = ("--seed", str(seed), "--runs", str(runs), "--kinds", kinds, "--mutant", mutant)
    result, text = _campaign(tmp_path, *args)
    assert sum(result["totals"][c] for c in expect) > 0, text
    assert result["violating_runs"], text


def _log(*events: tuple[str, Txn | str]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for ev, what in events:
        e: dict[str, Any] = {"ev": ev, "who": "test", "seq": len(out)}
        if isinstance(what, Txn):
            e["txn"] = what.to_json()
        else:
            e["id"] = what
        if ev == "fail":
            e["error"] = "WriteError: a full disk"
        out.append(e)
    return out


def test_the_checker_names_each_violation(tmp_path: Path) -> None:
    """The checker alone, on a store written by hand: one violation of each kind, each named."""
    ctx = Ctx(tmp_path, "fields", TruthWriter(-1, "test"))
    make_template(ctx.store, "fields")
    ok, wrong, torn, lost, failed, dup, rec = (
        Txn("a1", "append", 2),
        Txn("a2", "append", 2),
        Txn("a3", "append", 3),
        Txn("a4", "append", 1),
        Txn("a5", "append", 1),
        Txn("a6", "append", 2),
        Txn("rec", "recover", 1),
    )
    with carraystore.append(ctx.store) as w:
        for txn, keep in ((ok, 2), (wrong, 2), (torn, 2), (failed, 1), (dup, 1), (rec, 1)):
            images, labels, keys, extra = items_of(ctx, txn)
            if txn is wrong:
                images[1, 0, 0, 0] ^= 1
            w.append(
                images[:keep],
                labels[:keep],
                keys[:keep],
                {"angle": extra["columns"]["angle"][:keep]},
                extra["groups"][:keep],
            )
        images, labels, keys, extra = items_of(ctx, dup)  # the key of a6's first item, twice
        w.append(images[:1], labels[:1], keys[:1], {"angle": extra["columns"]["angle"][:1]}, extra["groups"][:1])
    events = _log(
        ("begun", Txn("init", "init", 6)), ("ack", "init"),
        *[("begun", t) for t in (ok, wrong, torn, lost, failed, dup, rec)],
        ("ack", "a1"), ("ack", "a2"), ("ack", "a4"), ("fail", "a5"), ("ack", "a6"), ("ack", "rec"),
    )  # fmt: skip
    v, _facts = judge(tmp_path, events, fields=True)
    text = "\n".join(v.details)
    assert v.counts == {"wrong": 2, "torn": 2, "lost": 1, "dup": 1}, text
    assert "item 9 (a2-1): pixels" in text  # the wrong pixel (after init-0..5, a1-0, a1-1, a2-0)
    assert "2 of the 3 items of a3" in text and "1 of the 2 items of a6" in text  # a3 partly there; a6 too
    assert "acknowledged append a4 (1 items) is missing" in text
    assert "a5 (append) failed (WriteError: a full disk) yet its items are there" in text
    assert "key 'a6-0' 2 times" in text
