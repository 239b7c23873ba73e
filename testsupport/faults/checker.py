"""The checker of a fault run: the store (and every copy, every reader's view) against the log.

Run in a process of its own once the recovery writer is done. Violations, by category:

- **lost**: an acknowledged transaction (items, an attr, a converted or copied store) is
  missing, or a reader that opened the store after a commit did not see it;
- **dup**: a key twice in a store, or a class name twice;
- **wrong**: an item whose pixels, class, target or group is not its key's, an item or attr
  no transaction wrote, a transaction that failed (a ``CarrayStoreError``) but is there,
  or something a reader or a copy saw that the store does not hold in the end;
- **torn**: a transaction partly there, a store that does not open or fails ``verify``,
  a journal left after the recovery writer's append, a recovery append that failed, a
  reader that met an error reading;
- **crash**: an exception that is not a ``CarrayStoreError`` (a worker's, a reader's, the
  checker's), a worker that died other than by the planned kill, or hung.
"""

from __future__ import annotations

import json
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import carraystore
from carraystore.base.errors import CarrayStoreError
from testsupport.faults.truth import INIT_CLASSES, TxnState, expected, pixels, read_events, txn_states

__all__ = ["CATEGORIES", "Scan", "Violations", "judge", "scan_store"]

CATEGORIES = ("lost", "dup", "wrong", "torn", "crash")


@dataclass
class Violations:
    """Counts per category, and what each was (the first few of each)."""

    counts: Counter[str] = field(default_factory=Counter)
    details: list[str] = field(default_factory=list)

    def add(self, category: str, what: str, n: int = 1) -> None:
        assert category in CATEGORIES, category
        self.counts[category] += n
        if len(self.details) < 60:
            self.details.append(f"{category}: {what}")

    def merge(self, other: Violations) -> None:
        for k, v in other.counts.items():
            self.counts[k] += v
        self.details.extend(other.details[: max(0, 60 - len(self.details))])

    def to_json(self) -> dict[str, Any]:
        return {"counts": {c: self.counts.get(c, 0) for c in CATEGORIES}, "details": self.details}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Violations:
        v = cls()
        v.counts.update({k: n for k, n in d.get("counts", {}).items() if n})
        v.details = list(d.get("details", []))
        return v


@dataclass
class Scan:
    """One reading of a store: which items of which transaction it holds, and what was wrong with them."""

    nitems: int
    txns: dict[str, set[int]]  # the items of each transaction (their place j in it)
    attrs: dict[str, Any]
    class_names: tuple[str, ...]
    problems: list[tuple[str, str]]  # (category, what)
    keys: dict[str, set[str]] = field(default_factory=dict)  # each transaction's keys

    def summary(self) -> dict[str, Any]:
        """What a reader reports (short enough for one atomic pipe write)."""
        return {
            "txns": {t: len(js) for t, js in self.txns.items()},
            "attrs": sorted(k for k in self.attrs if k.startswith("m_")),
            "problems": [[c, w[:300]] for c, w in self.problems[:5]],
            "pcounts": dict(Counter(c for c, _w in self.problems)),
        }


def scan_store(location: Path | str, fields: bool, storage_options: dict[str, Any] | None = None) -> Scan:
    """Open the store and judge every item by its key (CarrayStoreError: it does not open or read)."""
    problems: list[tuple[str, str]] = []
    path = Path(str(location))  # (its name, in messages)
    with carraystore.open(location, storage_options=storage_options) as s:
        n = len(s)
        keys = list(s.keys[:]) if s.keys is not None else None
        labels = s.labels
        names = tuple(s.class_names or ())
        cols = s.columns
        groups, group_names = s.groups, s.group_names
        attrs = dict(s.attrs)
        images = s[:] if n else np.zeros((0,))
    txns: dict[str, set[int]] = {}
    keyset: dict[str, set[str]] = {}
    if keys is None or len(keys) != n:
        problems.append(("torn", f"{path.name}: {n} items but {None if keys is None else len(keys)} keys"))
        keys = (keys or [])[:n]
    for key, count in Counter(keys).items():
        if count > 1:
            problems.append(("dup", f"{path.name}: key {key!r} {count} times"))
    for c, count in Counter(names).items():
        if count > 1:
            problems.append(("dup", f"{path.name}: class name {c!r} {count} times"))
    if names[: len(INIT_CLASSES)] != INIT_CLASSES:
        problems.append(("wrong", f"{path.name}: class names {names} do not start with {INIT_CLASSES}"))
    for i, key in enumerate(keys):
        exp = expected(key)
        if exp is None:
            problems.append(("wrong", f"{path.name}: item {i} has key {key!r}, which no writer of the campaign writes"))
            continue
        txns.setdefault(exp.txn, set()).add(exp.j)
        keyset.setdefault(exp.txn, set()).add(key)
        what = []
        if not np.array_equal(images[i], pixels(key)):
            what.append("pixels")
        if labels is None or not 0 <= int(labels[i]) < len(names) or names[int(labels[i])] != exp.class_name:
            what.append(f"class ({None if labels is None else int(labels[i])} of {names}, want {exp.class_name})")
        if fields:
            angle = cols.get("angle")
            if angle is None or float(angle[i]) != exp.angle:
                what.append("target")
            if groups is None or group_names is None or group_names[int(groups[i])] != exp.group:
                what.append("group")
        if what:
            problems.append(("wrong", f"{path.name}: item {i} ({key}): {', '.join(what)}"))
    return Scan(n, txns, attrs, names, problems, keyset)


def _verify(location: Path | str, v: Violations, storage_options: dict[str, Any] | None = None) -> None:
    path = Path(str(location))
    with carraystore.open(location, storage_options=storage_options) as s:
        for p in s.verify():
            v.add("torn", f"{path.name}: verify: {p}")


def _judge_items(scan: Scan, states: dict[str, TxnState], where: str, v: Violations) -> None:
    """Items against the log: partial transactions, phantoms, failed writes present."""
    for tid, js in scan.txns.items():
        st = states.get(tid)
        if st is None or not st.txn.adds_items:
            v.add("wrong", f"{where}: items of transaction {tid!r}, which no writer began")
            continue
        if js != set(range(st.txn.n)):
            v.add("torn", f"{where}: {len(js)} of the {st.txn.n} items of {tid} ({st.txn.op}, {st.outcome})")
        elif scan.keys.get(tid, set()) != set(st.txn.item_keys()):
            odd = sorted(scan.keys.get(tid, set()) - set(st.txn.item_keys()))
            v.add("wrong", f"{where}: {tid} holds keys its writer never wrote: {odd[:3]}")
        elif st.failed:
            v.add("wrong", f"{where}: {tid} ({st.txn.op}) failed ({st.error[:200]}) yet its items are there")


def _judge_main(store: Path, scan: Scan, states: dict[str, TxnState], v: Violations) -> None:
    for category, what in scan.problems:
        v.add(category, what)
    _judge_items(scan, states, store.name, v)
    for tid, st in states.items():
        t = st.txn
        if t.adds_items and st.acked and tid not in scan.txns:
            v.add("lost", f"{store.name}: acknowledged {t.op} {tid} ({t.n} items) is missing")
        if t.op == "meta":
            there = t.attr in scan.attrs
            if there and scan.attrs[t.attr] != t.attr_value:
                v.add("wrong", f"{store.name}: attr {t.attr} = {scan.attrs[t.attr]!r}, want {t.attr_value}")
            elif st.acked and not there:
                v.add("lost", f"{store.name}: acknowledged meta {tid} (attr {t.attr}) is missing")
            elif st.failed and there:
                v.add("wrong", f"{store.name}: meta {tid} failed ({st.error[:200]}) yet attr {t.attr} is set")
        if t.op == "ingest" and tid in scan.txns:
            for c in t.new_classes:
                if c not in scan.class_names:
                    v.add("torn", f"{store.name}: ingest {tid} is there but its new class {c} is not")
    for k in scan.attrs:
        if k.startswith("m_") and not (k[2:] in states and states[k[2:]].txn.op == "meta"):
            v.add("wrong", f"{store.name}: attr {k}, which no meta transaction set")
    for c in scan.class_names[len(INIT_CLASSES) :]:
        adder = states.get(c[1:]) if c.startswith("n") else None
        if adder is None or c not in adder.txn.new_classes:
            v.add("wrong", f"{store.name}: class name {c!r}, which no ingest added")
        elif c[1:] not in scan.txns:
            v.add("torn", f"{store.name}: class {c} of ingest {c[1:]} ({adder.outcome}), whose items are not there")


def _committed_before(states: dict[str, TxnState], seq: int) -> set[str]:
    return {tid for tid, st in states.items() if st.acked and st.end is not None and st.end < seq}


def _judge_copy(
    store_dir: Path, st: TxnState, final: Scan, states: dict[str, TxnState], fields: bool, v: Violations
) -> None:
    """A converted or copied store: absent, or a whole store of what the store held at some moment."""
    t = st.txn
    dst = store_dir / t.dst
    if not dst.exists():
        if st.acked:
            v.add("lost", f"acknowledged {t.op} {t.id} left no {t.dst}")
        return
    try:
        scan = scan_store(dst, fields)
        _verify(dst, v)
    except CarrayStoreError as exc:
        v.add("torn", f"{t.dst} ({t.op} {t.id}, {st.outcome}) does not open: {type(exc).__name__}: {exc}"[:400])
        return
    for category, what in scan.problems:
        v.add(category, what)
    _judge_items(scan, states, t.dst, v)
    for tid in scan.txns:
        if tid not in final.txns and tid in states:
            v.add("wrong", f"{t.dst} holds {tid}, which the store does not hold in the end (never committed)")
    for k in scan.attrs:
        if k.startswith("m_") and k not in final.attrs:
            v.add("wrong", f"{t.dst} holds attr {k}, which the store does not hold in the end")
    for tid in _committed_before(states, st.begun):
        s2 = states[tid]
        if s2.txn.adds_items and tid not in scan.txns:
            v.add("lost", f"{t.dst} ({t.op} begun after {tid} was acknowledged) lacks {tid}")
        if s2.txn.op == "meta" and s2.txn.attr not in scan.attrs:
            v.add("lost", f"{t.dst} ({t.op} begun after {tid} was acknowledged) lacks attr {s2.txn.attr}")


def _judge_readers(events: list[dict[str, Any]], final: Scan | None, states: dict[str, TxnState], v: Violations) -> int:
    began: dict[tuple[str, int], int] = {}
    snaps = 0
    for e in events:
        if e["ev"] == "snap-begin":
            began[(e["who"], e["n"])] = e["seq"]
        elif e["ev"] == "snap":
            snaps += 1
            who = f"reader {e['who']} snapshot {e['n']}"
            if "error" in e:
                v.add("torn" if e.get("named") else "crash", f"{who}: {e['error'][:600]}")
                continue
            if "unavailable" in e:  # a remote store out of reach: a named failure, nothing seen
                continue
            for category, count in e.get("pcounts", {}).items():
                first = next((w for c, w in e.get("problems", []) if c == category), "")
                v.add(category, f"{who}: {first}" + (f" (and {count - 1} more)" if count > 1 else ""), count)
            seen: dict[str, int] = e.get("txns", {})
            for tid, count in seen.items():
                st = states.get(tid)
                if st is None:
                    v.add("wrong", f"{who}: items of {tid}, which no writer began")
                    continue
                if count != st.txn.n:
                    v.add("torn", f"{who}: {count} of the {st.txn.n} items of {tid}")
                if final is not None and tid not in final.txns:
                    v.add("wrong", f"{who}: saw {tid} ({st.outcome}), which the store does not hold in the end")
            attrs = set(e.get("attrs", []))
            if final is not None:
                for a in attrs - set(final.attrs):
                    v.add("wrong", f"{who}: saw attr {a}, which the store does not hold in the end")
            start = began.get((e["who"], e["n"]), e["seq"])
            for tid in _committed_before(states, start):
                t = states[tid].txn
                if t.adds_items and tid not in seen:
                    v.add("lost", f"{who}: opened after {t.op} {tid} was acknowledged, did not see it")
                if t.op == "meta" and t.attr not in attrs:
                    v.add("lost", f"{who}: opened after meta {tid} was acknowledged, did not see attr {t.attr}")
    return snaps


def judge(
    store_dir: Path,
    events: list[dict[str, Any]],
    fields: bool,
    url: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> tuple[Violations, dict[str, Any]]:
    """Every check of a finished run; the violations and a few facts (items, snapshots). ``url``:
    the store of a remote run (read with ``storage_options``, straight from the server)."""
    from carraystore.sources.journal import journal_path

    v = Violations()
    states = txn_states(events)
    store = store_dir / "s.b2nd"
    location: Path | str = url if url is not None else store
    facts: dict[str, Any] = {}
    for e in events:
        if e["ev"] == "crash":
            v.add("crash", f"{e.get('who')}: {e.get('id')}: {e.get('error', '')[:1000]}")
    rec = states.get("rec")
    if rec is None or not rec.acked:
        if rec is not None and rec.outcome == "crashed":
            pass  # counted above
        else:
            v.add(
                "torn",
                f"the recovery append {'never began' if rec is None else rec.outcome}: "
                f"{'' if rec is None else rec.error[:500]}",
            )
    if url is None and journal_path(store).exists():
        v.add("torn", f"{journal_path(store).name} is left after the recovery writer's append")
    final: Scan | None = None
    try:
        final = scan_store(location, fields, storage_options)
        _verify(location, v, storage_options)
    except CarrayStoreError as exc:
        v.add("torn", f"the store does not open after recovery: {type(exc).__name__}: {exc}"[:600])
    if final is not None:
        facts.update(items=final.nitems, txns=len(final.txns), attrs=len([a for a in final.attrs if a[:2] == "m_"]))
        _judge_main(store, final, states, v)
        for st in states.values():
            if st.txn.op in ("convert", "copy"):
                _judge_copy(store_dir, st, final, states, fields, v)
    facts["snapshots"] = _judge_readers(events, final, states, v)
    facts["outcomes"] = dict(Counter(st.outcome for st in states.values()))
    return v, facts


def checker_main(
    store_dir: Path,
    truth: Path,
    out: Path,
    fields: bool,
    url: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """The checker process: judge, write the result as JSON to ``out``."""
    try:
        v, facts = judge(store_dir, read_events(truth), fields, url, storage_options)
    except Exception as exc:
        v, facts = Violations(), {}
        v.add("crash", f"checker: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"[-1500:])
    out.write_text(json.dumps({"violations": v.to_json(), "facts": facts}))
