"""What the forked worker processes of a fault run do: writers, readers, the recovery writer.

Each runs in a child that :mod:`testsupport.faults.campaign` forked; what it does to the store
goes through the public API (``carraystore.append``, ``carraystore.open``) or the CLI's own
command functions (``carraystore ingest --append``, ``meta``, ``convert``, ``copy``; called as
``main`` calls them, so that an exception which is not a ``CarrayStoreError`` is seen as one
instead of being printed and turned into an exit status).
"""

from __future__ import annotations

import json
import os
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

import carraystore
from carraystore.base.errors import CarrayStoreError, RemoteReadError
from testsupport.faults import inject
from testsupport.faults.truth import CHUNK_IMAGES, INIT_CLASSES, SHAPE, TruthWriter, Txn, expected, pixels

__all__ = ["Ctx", "Fault", "LOCK_WAIT", "make_template", "reader_main", "writer_main"]

#: Seconds a writer waits for the writer lock (the campaign's writers take turns).
LOCK_WAIT = 30.0
STORE = "s.b2nd"


@dataclass
class Ctx:
    """A worker's view of its run."""

    store_dir: Path  # the folder of the store (a tmpfs in the ENOSPC runs)
    flavour: str  # "fields" (a target field and groups) or "plain" (labels and keys only: ingest --append)
    log: TruthWriter
    verbose: bool = False
    gate: int | None = None  # a pipe's read end: the workers of a run start together, one byte each
    url: str | None = None  # a remote run: the store is this object (s3://), reached through a faulty link
    storage_options: dict[str, Any] | None = None

    @property
    def location(self) -> str:
        return self.url if self.url is not None else str(self.store)

    def wait_gate(self) -> None:
        if self.gate is not None:
            os.read(self.gate, 1)

    @property
    def store(self) -> Path:
        return self.store_dir / STORE


@dataclass(frozen=True)
class Fault:
    """The fault a writer meets at one of its transactions."""

    #: kill-syscall, kill-journal (a kill while the journal exists), kill-random, efbig, enospc; remote
    #: runs: net-503, net-cut, net-stall, weed-restart (armed by the driver when the op begins)
    kind: str
    k: int = 0  # kill-*: the counted call to die at; net-503: requests answered 503; net-cut/stall: bytes first
    frac: float = 0.0  # efbig: the size limit as a fraction of what the op may write; enospc: pages left
    delay: float = 0.0  # kill-random, weed-restart: seconds after "begun"

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "k": self.k, "frac": round(self.frac, 4), "delay": round(self.delay, 4)}


class _CliFailed(Exception):
    pass


_PARSER: list[Any] = []


def cli_parser() -> Any:
    """The CLI's parser, built once (before the forks: each worker parses with its copy)."""
    if not _PARSER:
        from carraystore.cli.main import build_parser

        _PARSER.append(build_parser())
    return _PARSER[0]


def _cli(argv: list[str]) -> None:
    """A CLI command as ``carraystore.cli.main.main`` runs it, but with exceptions left to the caller."""
    args = cli_parser().parse_args(argv)
    status = int(args.func(args) or 0)
    if status:
        raise _CliFailed(f"carraystore {argv[0]} exited with status {status}")


def items_of(ctx: Ctx, txn: Txn) -> tuple[np.ndarray, list[int], list[str], dict[str, Any]]:
    """A transaction's items as an API append takes them: images, labels, keys, {columns, groups}."""
    keys = txn.item_keys()
    exp = [expected(k) for k in keys]
    assert all(e is not None for e in exp)
    labels = [INIT_CLASSES.index(e.class_name) for e in exp if e is not None]
    extra: dict[str, Any] = {}
    if ctx.flavour == "fields":
        extra = {
            "columns": {"angle": np.array([e.angle for e in exp if e is not None], dtype=np.float64)},
            "groups": [e.group for e in exp if e is not None],
        }
    return np.stack([pixels(k) for k in keys]), labels, keys, extra


def make_template(path: Path, flavour: str, log: TruthWriter | None = None) -> Txn:
    """The initial store of every run: 6 items (the transaction "init")."""
    txn = Txn("init", "init", 6)
    ctx = Ctx(path.parent, flavour, log or TruthWriter(-1, "template"))
    images, labels, keys, extra = items_of(ctx, txn)
    with carraystore.create(path, SHAPE, class_names=list(INIT_CLASSES), chunk_images=CHUNK_IMAGES, nthreads=1) as w:
        w.append(images, labels=labels, keys=keys, **extra)
    return txn


def _prepare(ctx: Ctx, txn: Txn) -> Path | None:
    """Inputs an op needs, written before any fault is armed (ingest: its folder of PNGs)."""
    if txn.op != "ingest":
        return None
    from PIL import Image

    src = ctx.store_dir.parent / f"src-{txn.id}"
    for key in txn.item_keys():
        f = src / key
        f.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels(key)).save(f, format="PNG")
    return src


def _do(ctx: Ctx, txn: Txn, src: Path | None) -> None:
    store = ctx.location
    wait = str(LOCK_WAIT)
    remote: dict[str, Any] = {}
    remote_args: list[str] = []
    if ctx.url is not None:
        remote = {"storage_options": ctx.storage_options, "tmp_dir": str(ctx.store_dir.parent / "staging")}
        remote_args = ["--storage-options", json.dumps(ctx.storage_options)]
    if txn.op in ("append", "recover"):
        images, labels, keys, extra = items_of(ctx, txn)
        with carraystore.append(store, nthreads=1, lock_timeout=LOCK_WAIT, **remote) as w:
            half = (len(keys) + 1) // 2 if len(keys) > 2 else len(keys)  # two calls: a partial chunk filled up
            cols = extra.get("columns")
            groups = extra.get("groups")
            for lo, hi in ((0, half), (half, len(keys))):
                if lo < hi:
                    w.append(
                        images[lo:hi],
                        labels=labels[lo:hi],
                        keys=keys[lo:hi],
                        columns={k: v[lo:hi] for k, v in cols.items()} if cols else None,
                        groups=groups[lo:hi] if groups else None,
                    )
    elif txn.op == "ingest":
        assert src is not None
        _cli(["ingest", str(src), store, "--append", "--wait", wait, "--workers", "1", "-q"])
    elif txn.op == "meta":
        _cli(["meta", store, "--attr", f"{txn.attr}={txn.attr_value}", "--wait", wait])
    elif txn.op == "convert":
        extra_args = ["--chunk-images", "2", "--preset", "fast"] if txn.layout == "pixels" else []
        _cli(["convert", store, str(ctx.store_dir / txn.dst), "--layout", txn.layout, "--wait", wait, *extra_args])
    elif txn.op == "copy":
        _cli(["copy", store, str(ctx.store_dir / txn.dst), "-q", "--wait", wait, *remote_args])
    elif txn.op == "open":  # a reader: it rolls back a journal nobody holds the lock of
        with carraystore.open(store, storage_options=ctx.storage_options) as s:
            s[:]
    else:
        raise ValueError(f"unknown op {txn.op!r}")


def _growth(ctx: Ctx, txn: Txn) -> int:  # (local runs only)
    """About the size of the largest file the op writes, for the size limit of an EFBIG fault (a
    fraction 0..1.1 of it: most limits fall inside the op's writes, some past them)."""
    size = ctx.store.stat().st_size
    if txn.op in ("convert", "copy"):
        return size
    return size + 300 * max(txn.n, 1) + 100


def _arm(ctx: Ctx, txn: Txn, fault: Fault) -> None:
    trace = (lambda s: print(f"[{txn.id}] {s}", flush=True)) if ctx.verbose else None
    if fault.kind == "kill-syscall":
        inject.kill_at_call(fault.k, trace=trace)
    elif fault.kind == "kill-journal":
        from carraystore.sources.journal import journal_path

        inject.kill_at_call(fault.k, while_exists=journal_path(ctx.store), trace=trace)
    elif fault.kind == "efbig":
        limit = int(fault.frac * _growth(ctx, txn))
        if ctx.verbose:
            print(f"[{txn.id}] RLIMIT_FSIZE {limit} bytes (store {ctx.store.stat().st_size})", flush=True)
        inject.limit_file_size(limit)
    elif fault.kind == "enospc":
        leave = int(fault.frac * 4096)
        inject.fill(ctx.store_dir, leave)
        if ctx.verbose:
            print(f"[{txn.id}] disk filled: {inject.free_bytes(ctx.store_dir)} bytes free", flush=True)
    if fault.kind in ("efbig", "enospc") and fault.k:  # and killed at the K-th call, failing or not
        inject.kill_at_call(fault.k, trace=trace)


def _disarm(fault: Fault) -> None:
    inject.disarm()
    if fault.kind == "efbig":
        inject.restore_file_size()


def run_txn(ctx: Ctx, txn: Txn, fault: Fault | None = None) -> str:
    """Log ``begun``, run the op (under ``fault``), log ``ack``/``fail``/``crash``; returns the outcome."""
    src = _prepare(ctx, txn)
    if fault is not None:
        _arm(ctx, txn, fault)
    ctx.log.begun(txn, **({"fault": fault.to_json()} if fault is not None else {}))
    try:
        _do(ctx, txn, src)
    except (CarrayStoreError, _CliFailed) as exc:
        if fault is not None:
            _disarm(fault)
        ctx.log.fail(txn, f"{type(exc).__name__}: {exc}")
        if ctx.verbose:
            print(f"[{txn.id}] failed: {type(exc).__name__}: {exc}", flush=True)
        return "failed"
    except Exception as exc:
        if fault is not None:
            _disarm(fault)
        ctx.log.crash(txn, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        if ctx.verbose:
            traceback.print_exc()
        return "crashed"
    if fault is not None:
        _disarm(fault)
    ctx.log.ack(txn)
    return "acked"


def writer_main(ctx: Ctx, txns: list[Txn], faults: dict[int, Fault]) -> None:
    """A writer: its transactions one after the other (``faults[i]``: the fault its i-th meets)."""
    ctx.wait_gate()
    for i, txn in enumerate(txns):
        run_txn(ctx, txn, faults.get(i))


def reader_main(ctx: Ctx, stop: Path, pause: float = 0.01, most: int = 200) -> None:
    """A reader: snapshots of the store (every item judged by its key) until ``stop`` exists."""
    from testsupport.faults.checker import scan_store

    ctx.wait_gate()
    for n in range(most):
        done = stop.exists()
        ctx.log.event("snap-begin", n=n)
        try:
            scan = scan_store(ctx.location, ctx.flavour == "fields", ctx.storage_options)
        except RemoteReadError as exc:  # the link or the server is down: a named failure, nothing read
            ctx.log.event("snap", n=n, unavailable=f"{type(exc).__name__}: {exc}"[:400])
        except CarrayStoreError as exc:
            ctx.log.event("snap", n=n, error=f"{type(exc).__name__}: {exc}"[:1500], named=True)
        except Exception as exc:
            ctx.log.event(
                "snap", n=n, error=f"{type(exc).__name__}: {exc}"[:400] + "\n" + traceback.format_exc()[-1000:]
            )
        else:
            ctx.log.event("snap", n=n, **scan.summary())
        if done:
            return
        time.sleep(pause)
