"""The ground truth of a fault run: what every item must hold, and the log of transactions.

Every item's content follows from its key alone (:func:`expected`): its pixels, its class,
its target and its group, so a reader or the checker can judge any item it meets without
knowing who wrote it. A key names its transaction: ``TXN-J`` (an API append, J the item's
place in it) or ``CLASS/TXN-J.png`` (a folder appended by ``ingest --append``).

The log is a stream of JSON events, one a line, that the workers write to one pipe
(:class:`TruthWriter`, each event shorter than ``PIPE_BUF``, so writes of several
processes never interleave) and the driver numbers in the order it reads them
(``seq``): an event of one process before an event of another in that order happened
before it. A writer logs a transaction ``begun`` before its API call and ``ack`` only
after the call returned (``fail``: it raised a ``CarrayStoreError``; ``crash``: any other
exception).
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "SHAPE",
    "CHUNK_IMAGES",
    "INIT_CLASSES",
    "Expected",
    "Txn",
    "TxnState",
    "TruthWriter",
    "expected",
    "item_keys",
    "parse_key",
    "pixels",
    "read_events",
    "txn_states",
]

#: Every store of the campaign holds 8x8 RGB uint8 images, four to a chunk (appends span chunks).
SHAPE = (8, 8, 3)
CHUNK_IMAGES = 4
#: The initial store's class names; API appends label their items with these.
INIT_CLASSES = ("a", "b", "c")
#: The write of ``PIPE_BUF`` bytes or fewer to a pipe is atomic (POSIX: at least 512; Linux 4096).
_PIPE_BUF = 4096
_REAL_WRITE = os.write  # the log never counts as a write of the work (see inject.kill_at_call)

_KEY = re.compile(r"^(?:(?P<cls>[A-Za-z0-9_]+)/)?(?P<txn>[A-Za-z0-9]+)-(?P<j>\d+)(?P<png>\.png)?$")


def _crc(key: str) -> int:
    return zlib.crc32(key.encode())


def pixels(key: str) -> np.ndarray:
    """The item's image: random pixels seeded by its key."""
    return np.random.default_rng(_crc(key)).integers(0, 256, SHAPE, dtype=np.uint8)


@dataclass(frozen=True)
class Expected:
    """What an item with a given key holds."""

    txn: str
    j: int
    class_name: str
    angle: float  # the target field "angle" (stores with fields)
    group: str  # its group (stores with fields)


def parse_key(key: str) -> tuple[str, int, str | None] | None:
    """``(txn, j, class folder or None)`` of a key the campaign wrote, or None for any other key."""
    m = _KEY.match(key)
    if m is None or (m.group("cls") is None) != (m.group("png") is None):
        return None
    return m.group("txn"), int(m.group("j")), m.group("cls")


def expected(key: str) -> Expected | None:
    """The content of the item with this key (None: not a key the campaign writes)."""
    parsed = parse_key(key)
    if parsed is None:
        return None
    txn, j, folder = parsed
    crc = _crc(key)
    name = folder if folder is not None else INIT_CLASSES[crc % len(INIT_CLASSES)]
    return Expected(txn, j, name, crc / 1024.0, f"g{crc % 4}")


@dataclass(frozen=True)
class Txn:
    """One transaction a worker attempts.

    ``op``: append (API), ingest (``carraystore ingest --append``), meta (``carraystore meta
    --attr``), convert, copy (a new store ``dst`` from the store), init (the initial store),
    recover (the recovery writer's append), open (a reader that may roll back).
    """

    id: str
    op: str
    n: int = 0  # items added (append, ingest, init, recover)
    classes: tuple[str, ...] = ()  # ingest: each item's class folder (a new class is named "n" + id)
    dst: str = ""  # convert, copy: the new store's file name
    layout: str = ""  # convert: the layout written

    def item_keys(self) -> list[str]:
        return item_keys(self)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "op": self.op,
            "n": self.n,
            "classes": list(self.classes),
            "dst": self.dst,
            "layout": self.layout,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Txn:
        return cls(d["id"], d["op"], d.get("n", 0), tuple(d.get("classes", ())), d.get("dst", ""), d.get("layout", ""))

    @property
    def adds_items(self) -> bool:
        return self.op in ("append", "ingest", "init", "recover")

    @property
    def new_classes(self) -> tuple[str, ...]:
        """The classes this ingest adds to the store (in order of first use)."""
        seen: list[str] = []
        for c in self.classes:
            if c not in INIT_CLASSES and c not in seen:
                seen.append(c)
        return tuple(seen)

    @property
    def attr(self) -> str:
        """The attr a meta transaction sets (to :attr:`attr_value`)."""
        return f"m_{self.id}"

    @property
    def attr_value(self) -> int:
        return _crc(self.id) % 100_000


def item_keys(txn: Txn) -> list[str]:
    if txn.op == "ingest":
        return [f"{c}/{txn.id}-{j}.png" for j, c in enumerate(txn.classes)]
    if txn.adds_items:
        return [f"{txn.id}-{j}" for j in range(txn.n)]
    return []


class TruthWriter:
    """A worker's side of the log: events written to the log pipe ``fd`` (one ``write`` each)."""

    def __init__(self, fd: int, who: str) -> None:
        self.fd = fd
        self.who = who

    def event(self, ev: str, **kw: Any) -> None:
        line = json.dumps({"ev": ev, "who": self.who, "pid": os.getpid(), **kw}, separators=(",", ":"))
        data = (line + "\n").encode()
        if len(data) > _PIPE_BUF:  # keep it atomic: cut what is cut-able
            kw = {k: (v[:200] if isinstance(v, str) else v) for k, v in kw.items()}
            kw.pop("txns", None)
            kw["cut"] = True
            data = (json.dumps({"ev": ev, "who": self.who, "pid": os.getpid(), **kw}) + "\n").encode()[:_PIPE_BUF]
        _REAL_WRITE(self.fd, data)

    def begun(self, txn: Txn, **kw: Any) -> None:
        self.event("begun", txn=txn.to_json(), **kw)

    def ack(self, txn: Txn) -> None:
        self.event("ack", id=txn.id)

    def fail(self, txn: Txn, error: str) -> None:
        self.event("fail", id=txn.id, error=error[:600])

    def crash(self, txn: Txn, error: str) -> None:
        """``error``: the exception's line, then its traceback (kept: the line and the traceback's end)."""
        head, _, tb = error.partition("\n")
        self.event("crash", id=txn.id, error=f"{head[:400]}\n{tb[-1200:]}")


def read_events(path: Path) -> list[dict[str, Any]]:
    """The events of a run's ``truth.jsonl``, in the driver's order."""
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out


@dataclass
class TxnState:
    """What the log says about one transaction."""

    txn: Txn
    begun: int  # seq of its "begun"
    end: int | None = None  # seq of its ack/fail/crash
    outcome: str = "unknown"  # acked, failed, crashed, unknown (killed, or cut off)
    error: str = ""
    who: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def acked(self) -> bool:
        return self.outcome == "acked"

    @property
    def failed(self) -> bool:
        return self.outcome == "failed"


def txn_states(events: Iterable[dict[str, Any]]) -> dict[str, TxnState]:
    """Each transaction's state, keyed by its id."""
    states: dict[str, TxnState] = {}
    for e in events:
        if e["ev"] == "begun":
            t = Txn.from_json(e["txn"])
            states[t.id] = TxnState(t, e["seq"], who=e.get("who", ""), extra={k: e[k] for k in ("fault",) if k in e})
        elif e["ev"] in ("ack", "fail", "crash") and e.get("id") in states:
            s = states[e["id"]]
            s.end = e["seq"]
            s.outcome = {"ack": "acked", "fail": "failed", "crash": "crashed"}[e["ev"]]
            s.error = e.get("error", "")
    return states
