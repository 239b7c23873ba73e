"""A seeded fault campaign: plans drawn from (seed, run), a driver that runs each plan, the tally.

One run (:class:`RunPlan`, drawn by :func:`draw_plan` from ``(seed, run)`` alone):

1. a fresh copy of a tiny store (6 items, 8x8 RGB, 4 to a chunk; ``fields``: a target
   field and groups too; ``plain``: labels and keys, so that ``ingest --append`` works);
2. for ``kill-rollback``: a write killed while its journal exists (a hot journal), then one
   to three openers (a reader, an append, a ``meta``) each killed at the K-th file-system
   call of their rollback;
3. one to four writers at once (API appends, ``ingest --append``, ``meta``, ``convert``,
   ``copy``; they take turns through the writer lock) and up to two readers; the first
   writer meets the run's fault at one of its transactions: SIGKILL at its K-th file-system
   call or at a random moment, ``RLIMIT_FSIZE`` (EFBIG) or a full tmpfs (ENOSPC);
4. the recovery writer appends once more (it must succeed);
5. the checker (:mod:`testsupport.faults.checker`) judges the store, every copy and every
   reader's snapshots against the log.

Every worker is a child forked from the driver, which imports the library once and
starts no thread, so a run of a dozen processes takes a fraction of a second.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import selectors
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from testsupport.faults import inject
from testsupport.faults.checker import CATEGORIES, Violations, checker_main
from testsupport.faults.remote import BUCKET, RemoteLab, remote_unavailable
from testsupport.faults.truth import TruthWriter, Txn
from testsupport.faults.workers import STORE, Ctx, Fault, cli_parser, make_template, reader_main, writer_main

__all__ = ["KINDS", "LOCAL_KINDS", "RunPlan", "draw_plan", "run_campaign", "run_one", "CampaignResult"]

#: Fault kinds and how often a run draws each.
KINDS: dict[str, int] = {
    "clean": 1,  # concurrent writers and readers, no fault
    "kill-syscall": 4,
    "kill-random": 2,
    "kill-rollback": 3,
    "efbig": 3,
    "enospc": 2,
    "remote": 1,  # SeaweedFS behind a faulty link (503s, cuts, stalls), killed and restarted; a killed upload
}
#: The kinds that need nothing but this machine (``make test`` runs these; ``remote`` starts SeaweedFS).
LOCAL_KINDS = [k for k in KINDS if k != "remote"]
#: Remote faults: the next requests answered 503, a connection cut or stalled after N more bytes,
#: the writer killed at a random moment (an upload or a download cut short), SeaweedFS killed and restarted.
REMOTE_FAULTS = ("net-503", "net-cut", "net-stall", "kill-random", "weed-restart")
_OPS = {"append": 4, "ingest": 2, "meta": 2, "convert": 1, "copy": 1}
#: A kill at call K draws K from 1..K_MAX[op]: the counted calls the op makes (lock, journal, marker, data,
#: commit, unlock; appends 17-18, ingest 17, meta 16, convert 14, copy 7) and two more (a K past the
#: op's last call kills nothing). "open": a rollback by an opener (lock 2, rollback 4, commit 2).
K_MAX = {"append": 20, "ingest": 19, "meta": 18, "convert": 16, "copy": 9, "open": 8}
#: A kill at a random moment comes within about this many seconds of the op's start.
DURATION = {"append": 0.06, "ingest": 0.15, "meta": 0.06, "convert": 0.06, "copy": 0.05, "open": 0.02}
#: Seconds after which a worker counts as hung.
HANG_S = 120.0


@dataclass
class RunPlan:
    """Everything a run does, drawn from (seed, run)."""

    seed: int
    run: int
    kind: str
    flavour: str
    writers: list[list[Txn]]
    faults: dict[int, Fault]  # the first writer's transaction index -> its fault
    readers: int
    prep: list[tuple[Txn, Fault]]  # kill-rollback: the killed write, then the killed rollbacks
    recover: Txn

    @property
    def faulted_op(self) -> str:
        if self.prep:
            return "rollback"
        if self.faults:
            i = next(iter(self.faults))
            return self.writers[0][i].op
        return "-"

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "run": self.run,
            "kind": self.kind,
            "flavour": self.flavour,
            "writers": [[t.to_json() for t in w] for w in self.writers],
            "faults": {str(i): f.to_json() for i, f in self.faults.items()},
            "readers": self.readers,
            "prep": [[t.to_json(), f.to_json()] for t, f in self.prep],
            "recover": self.recover.to_json(),
        }

    def describe(self) -> str:
        lines = [f"run {self.run} (seed {self.seed}): {self.kind}, {self.flavour} store, {self.readers} reader(s)"]
        for t, f in self.prep:
            lines.append(f"  before: {t.op} {t.id} under {f.to_json()}")
        for w, txns in enumerate(self.writers):
            ops = []
            for i, t in enumerate(txns):
                fault = self.faults.get(i) if w == 0 else None
                ops.append(
                    f"{t.op} {t.id}"
                    + (f" [{t.n} items]" if t.n else "")
                    + (f" under {fault.to_json()}" if fault else "")
                )
            lines.append(f"  writer {w}: " + "; ".join(ops))
        lines.append(f"  then: recovery append {self.recover.id} [{self.recover.n} items]")
        return "\n".join(lines)


def _weighted(rng: random.Random, weights: dict[str, int]) -> str:
    names = sorted(weights)
    return rng.choices(names, weights=[weights[n] for n in names])[0]


def _txn(rng: random.Random, op: str, tid: str) -> Txn:
    if op == "append":
        return Txn(tid, op, rng.randint(1, 6))
    if op == "ingest":
        n = rng.randint(1, 5)
        pool = ["a", "b", "c"] + ([f"n{tid}"] if rng.random() < 0.4 else [])
        return Txn(tid, op, n, tuple(rng.choice(pool) for _ in range(n)))
    if op == "convert":
        return Txn(tid, op, dst=f"conv-{tid}.b2nd", layout=rng.choice(["encoded", "pixels"]))
    if op == "copy":
        return Txn(tid, op, dst=f"copy-{tid}.b2nd")
    return Txn(tid, op)


def _fault(rng: random.Random, kind: str, op: str) -> Fault:
    if kind == "kill-syscall":
        return Fault(kind, k=rng.randint(1, K_MAX[op]))
    if kind == "kill-random":
        return Fault(kind, delay=rng.uniform(0.0, DURATION[op]))
    # a full disk or size limit, and in 2 runs of 5 also a kill at the K-th call: a write failing and
    # undoing itself, killed as it undoes (the rollback in abort(), the removal of its temporary file)
    if kind == "efbig":
        frac = rng.uniform(0.0, 1.1)
        return Fault(kind, k=rng.randint(1, K_MAX[op]) if rng.random() < 0.4 else 0, frac=frac)
    if kind == "enospc":
        frac = rng.uniform(0.0, 4.0)
        return Fault(kind, k=rng.randint(1, K_MAX[op]) if rng.random() < 0.4 else 0, frac=frac)
    raise ValueError(kind)


def draw_plan(seed: int, run: int, kinds: Iterable[str] | None = None) -> RunPlan:
    """The plan of run ``run`` of the campaign ``seed`` (``kinds``: draw only among these)."""
    rng = random.Random(f"carraystore-faults:{seed}:{run}")
    weights = {k: w for k, w in KINDS.items() if kinds is None or k in set(kinds)}
    kind = _weighted(rng, weights)
    flavour = rng.choice(["fields", "plain"])
    ops = {k: w for k, w in _OPS.items() if flavour == "plain" or k != "ingest"}
    nwriters = rng.choice([1, 1, 2, 2, 3, 4]) if kind != "kill-rollback" else rng.choice([0, 1, 1, 2])
    writers = []
    for w in range(nwriters):
        writers.append([_txn(rng, _weighted(rng, ops), f"w{w}s{i}") for i in range(rng.choice([1, 1, 2]))])
    faults: dict[int, Fault] = {}
    prep: list[tuple[Txn, Fault]] = []
    if kind == "kill-rollback":
        op = rng.choice(["append", "meta"] + (["ingest"] if flavour == "plain" else []))
        prep.append((_txn(rng, op, "p0"), Fault("kill-journal", k=rng.randint(1, 14))))
        for i in range(rng.choice([1, 1, 2, 3])):
            actor = rng.choice(["open", "append", "meta"])
            prep.append((_txn(rng, actor, f"r{i}"), Fault("kill-syscall", k=rng.randint(1, K_MAX["open"]))))
    elif kind == "remote":  # one writer: an object store has no lock (the last put wins, docs/appends.md)
        writers = [[_txn(rng, rng.choice(["append", "append", "copy"]), f"w0s{i}") for i in range(rng.randint(1, 3))]]
        i = rng.randrange(len(writers[0]))
        rk = rng.choice(REMOTE_FAULTS)
        k = rng.randint(1, 4) if rk == "net-503" else rng.randint(0, 3000)
        faults[i] = Fault(rk, k=k, delay=rng.uniform(0.0, 0.5 if rk == "kill-random" else 0.3))
    elif kind != "clean":
        i = rng.randrange(len(writers[0]))
        faults[i] = _fault(rng, kind, writers[0][i].op)
    readers = rng.choice([0, 1, 1, 2]) if kind != "remote" else rng.choice([0, 1])
    return RunPlan(seed, run, kind, flavour, writers, faults, readers, prep, Txn("rec", "recover", rng.randint(1, 4)))


# -- the driver -----------------------------------------------------------------------------------


@dataclass
class _Child:
    name: str
    pid: int
    out: int
    may_be_killed: bool
    deadline: float
    status: int | None = None
    output: bytearray = field(default_factory=bytearray)
    kill_at: float | None = None
    hung: bool = False

    @property
    def killed(self) -> bool:
        return self.status is not None and os.WIFSIGNALED(self.status) and os.WTERMSIG(self.status) == signal.SIGKILL


class RunDriver:
    """Runs one plan in ``workdir/run-NNNNN`` and returns its result (a dict)."""

    def __init__(
        self,
        plan: RunPlan,
        workdir: Path,
        templates: dict[str, Path],
        *,
        mutant: str | None = None,
        verbose: bool = False,
        keep: bool = False,
        lab: Callable[[], RemoteLab] | None = None,
    ) -> None:
        self.plan = plan
        self._lab_of = lab
        self.lab: RemoteLab | None = None
        self.url: str | None = None
        self._restart_at: float | None = None
        self.dir = workdir / f"run-{plan.run:05d}"
        self.store_dir = self.dir / "store"
        self.templates = templates
        self.mutant = mutant
        self.verbose = verbose
        self.keep = keep
        self.events: list[dict[str, Any]] = []
        self.problems = Violations()
        self._sel = selectors.DefaultSelector()
        self._logbuf = b""
        self._t0 = time.monotonic()
        self._children: dict[int, _Child] = {}
        self.fired = False

    # -- the log --------------------------------------------------------------------------------
    def _event(self, e: dict[str, Any]) -> None:
        e["seq"] = len(self.events)
        e["t"] = round(time.monotonic() - self._t0, 4)
        self.events.append(e)
        self._truth.write(json.dumps(e) + "\n")
        if self.verbose:
            print(f"  {e['t']:7.3f}s  {json.dumps({k: v for k, v in e.items() if k not in ('seq', 't')})[:300]}")
        fault = e.get("fault", {}) if e["ev"] == "begun" else {}
        if fault.get("kind") == "kill-random":
            child = self._children.get(e.get("pid", -1))
            if child is not None:
                child.kill_at = time.monotonic() + float(fault["delay"])
        elif fault.get("kind") in ("net-503", "net-cut", "net-stall") and self.lab is not None:
            self.lab.call(fault["kind"][4:], n=int(fault["k"]))  # armed as the op starts: its next requests
            self.fired = True
        elif fault.get("kind") == "weed-restart":
            self._restart_at = time.monotonic() + float(fault["delay"])

    def _read_log(self) -> None:
        while True:
            try:
                data = os.read(self._log_r, 1 << 16)
            except BlockingIOError:
                break
            if not data:
                break
            self._logbuf += data
        *lines, self._logbuf = self._logbuf.split(b"\n")
        for line in lines:
            if line.strip():
                self._event(json.loads(line))

    # -- children -------------------------------------------------------------------------------
    def _ctx(self, who: str, gate: int | None = None, retry_timeout: float = 10.0) -> Ctx:
        ctx = Ctx(self.store_dir, self.plan.flavour, TruthWriter(self._log_w, who), self.verbose, gate)
        if self.lab is not None:  # through the faulty link: short timeouts, so that a stall fails soon
            ctx.url = self.url
            ctx.storage_options = self.lab.storage_options(timeout=3, connect_timeout=2, retry_timeout=retry_timeout)
        return ctx

    def _spawn(
        self, name: str, target: Callable[[], None], *, may_be_killed: bool = False, mutate: bool = True
    ) -> _Child:
        sys.stdout.flush()
        sys.stderr.flush()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            code = 0
            try:
                os.close(r)
                os.close(self._log_r)
                os.dup2(w, 1)
                os.dup2(w, 2)
                os.close(w)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                if mutate:
                    inject.apply_mutant(self.mutant)
                target()
            except BaseException:
                traceback.print_exc()
                code = 70
            finally:
                with contextlib.suppress(BaseException):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        os.close(w)
        os.set_blocking(r, False)
        child = _Child(name, pid, r, may_be_killed, time.monotonic() + HANG_S)
        self._children[pid] = child
        self._sel.register(r, selectors.EVENT_READ, child)
        return child

    def _drain(self, child: _Child) -> None:
        while True:
            try:
                data = os.read(child.out, 1 << 16)
            except BlockingIOError:
                return
            if not data:
                return
            if len(child.output) < 1 << 18:
                child.output += data

    def _wait(self, children: list[_Child]) -> None:
        while True:
            alive = [c for c in children if c.status is None]
            if not alive:
                break
            for key, _ in self._sel.select(timeout=0.005):
                if key.fd == self._log_r:
                    self._read_log()
                else:
                    self._drain(key.data)
            now = time.monotonic()
            if self._restart_at is not None and now >= self._restart_at and self.lab is not None:
                self.lab.call("restart")  # SeaweedFS killed now, started again in the background
                self._restart_at = None
                self.fired = True
            for c in alive:
                pid, status = os.waitpid(c.pid, os.WNOHANG)
                if pid:
                    c.status = status
                elif c.kill_at is not None and now >= c.kill_at:
                    os.kill(c.pid, signal.SIGKILL)
                    c.kill_at = None
                elif now > c.deadline:
                    os.kill(c.pid, signal.SIGKILL)
                    c.hung = True
        self._read_log()
        for c in children:
            self._drain(c)
            self._sel.unregister(c.out)
            os.close(c.out)
            self._judge_child(c)

    def _judge_child(self, c: _Child) -> None:
        assert c.status is not None
        tail = c.output.decode(errors="replace")[-1200:]
        if self.verbose and c.output:
            print(f"  --- output of {c.name} ---\n" + c.output.decode(errors="replace")[-6000:].rstrip())
        if c.hung:
            self.problems.add("crash", f"{c.name} hung (killed after {HANG_S:g} s): {tail}")
        elif os.WIFSIGNALED(c.status):
            sig = os.WTERMSIG(c.status)
            if sig == signal.SIGKILL and c.may_be_killed:
                self.fired = True
            else:
                self.problems.add("crash", f"{c.name} died of signal {signal.Signals(sig).name}: {tail}")
        elif os.WEXITSTATUS(c.status):
            self.problems.add("crash", f"{c.name} exited with status {os.WEXITSTATUS(c.status)}: {tail}")

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        plan = self.plan
        result: dict[str, Any] = {
            "run": plan.run,
            "seed": plan.seed,
            "kind": plan.kind,
            "op": plan.faulted_op,
            "flavour": plan.flavour,
            "skipped": None,
        }
        if self.verbose:
            print(plan.describe())
        tmpfs: inject.Tmpfs | None = None
        if self.dir.exists():
            shutil.rmtree(self.dir)
        self.store_dir.mkdir(parents=True)
        if plan.kind == "enospc":
            why = inject.tmpfs_available()
            if why is not None:
                shutil.rmtree(self.dir)
                result.update(skipped=why, violations=Violations().to_json(), seconds=0.0, fired=False)
                return result
            tmpfs = inject.Tmpfs(self.store_dir)
            tmpfs.mount()
        if plan.kind == "remote":
            why = remote_unavailable()
            if why is None and self._lab_of is not None:
                try:
                    self.lab = self._lab_of()
                except (OSError, RuntimeError) as exc:
                    why = f"SeaweedFS did not start: {exc}"
            elif why is None:
                why = "no remote lab given"
            if why is not None:
                shutil.rmtree(self.dir)
                result.update(skipped=why, violations=Violations().to_json(), seconds=0.0, fired=False)
                return result
        self._log_r, self._log_w = os.pipe()
        os.set_blocking(self._log_r, False)
        self._sel.register(self._log_r, selectors.EVENT_READ, None)
        self._truth = open(self.dir / "truth.jsonl", "w")  # noqa: SIM115 (closed in finally)
        try:
            self._run(result)
        finally:
            self._truth.close()
            self._sel.close()
            os.close(self._log_r)
            os.close(self._log_w)
            if tmpfs is not None:
                tmpfs.unmount()
            if not self.keep:
                shutil.rmtree(self.dir, ignore_errors=True)
        result["seconds"] = round(time.monotonic() - self._t0, 3)
        return result

    def _run(self, result: dict[str, Any]) -> None:
        plan = self.plan
        if self.lab is not None:
            key = f"seed{plan.seed}-run{plan.run}.b2nd"
            self.lab.call("clear")
            self.lab.call("upload", src=str(self.templates[plan.flavour]), key=key)
            self.url = f"s3://{BUCKET}/{key}"
            (self.dir / "staging").mkdir()  # where remote appends stage their copy
        else:
            shutil.copyfile(self.templates[plan.flavour], self.store_dir / STORE)
        init = Txn("init", "init", 6)
        self._event({"ev": "begun", "who": "driver", "pid": os.getpid(), "txn": init.to_json()})
        self._event({"ev": "ack", "who": "driver", "pid": os.getpid(), "id": "init"})
        for i, (txn, fault) in enumerate(plan.prep):
            who = f"prep{i}"
            ctx = self._ctx(who)
            self._wait([self._spawn(who, partial(writer_main, ctx, [txn], {0: fault}), may_be_killed=True)])
        self._truth.flush()
        stop = self.dir / "stop-readers"
        gate_r, gate_w = os.pipe()  # the writers and readers start at one moment: they contend
        writers = []
        for w, txns in enumerate(plan.writers):
            ctx = self._ctx(f"w{w}", gate_r)
            faults = plan.faults if w == 0 else {}
            writers.append(
                self._spawn(f"writer {w}", partial(writer_main, ctx, txns, faults), may_be_killed=bool(faults))
            )
        readers = []
        for r in range(plan.readers):
            ctx = self._ctx(f"r{r}", gate_r)
            readers.append(self._spawn(f"reader {r}", partial(reader_main, ctx, stop)))
        os.write(gate_w, b"x" * (len(writers) + len(readers)))
        os.close(gate_w)
        os.close(gate_r)
        self._wait(writers)
        stop.touch()
        self._wait(readers)
        for filler in self.store_dir.glob("filler.bin"):
            filler.unlink()  # the disk has room again for the recovery writer
        if self.lab is not None:  # the link is sound and the server up again for the recovery writer
            self._restart_at = None
            self.lab.call("clear")
            self.lab.call("wait")
        ctx = self._ctx("recovery", retry_timeout=60.0)
        self._wait([self._spawn("recovery", partial(writer_main, ctx, [plan.recover], {}))])
        self._truth.flush()
        out = self.dir / "check.json"
        fields = plan.flavour == "fields"
        self._wait(
            [
                self._spawn(
                    "checker",
                    partial(
                        checker_main,
                        self.store_dir,
                        self.dir / "truth.jsonl",
                        out,
                        fields,
                        self.url,
                        self.lab.storage_options(direct=True, retry_timeout=30) if self.lab is not None else None,
                    ),
                    mutate=False,
                )
            ]
        )
        v = Violations()
        if out.exists():
            got = json.loads(out.read_text())
            v = Violations.from_json(got["violations"])
            result["facts"] = got.get("facts", {})
        else:
            v.add("crash", "the checker wrote no result")
        v.merge(self.problems)
        states = Counter(e["ev"] for e in self.events if e["ev"] in ("ack", "fail", "crash"))
        result["acked"], result["failed"] = states.get("ack", 0), states.get("fail", 0)
        # a fault "fired": a planned kill happened, a size limit / full disk made a write fail, a link fault
        # was armed, the server restarted
        fail_ids = {e.get("id") for e in self.events if e["ev"] in ("fail", "crash")}
        faulted = {e["txn"]["id"] for e in self.events if e["ev"] == "begun" and "fault" in e}
        result["fired"] = self.fired or bool(fail_ids & faulted and plan.kind in ("efbig", "enospc"))
        result["violations"] = v.to_json()
        if self.verbose:
            print(f"  violations: {v.to_json()['counts']}")
            for d in v.details:
                print(f"    {d}")


# -- campaigns ------------------------------------------------------------------------------------


def _preload() -> None:
    """Import what the workers use, once, before any fork."""
    import numpy.random  # noqa: F401
    import PIL.Image
    import PIL.PngImagePlugin  # noqa: F401

    import carraystore.cli.commands  # noqa: F401
    import carraystore.cli.main  # noqa: F401
    import carraystore.store.convert  # noqa: F401
    import carraystore.store.transfer  # noqa: F401

    PIL.Image.init()
    cli_parser()


def default_workdir(prefix: str) -> Path:
    """A new folder for the runs: on /dev/shm where there is one (a kill is not a power cut, so
    fsync's cost buys nothing here), else in the temporary folder."""
    shm = Path("/dev/shm")
    base = str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else None
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def make_templates(workdir: Path) -> dict[str, Path]:
    """The initial store of each flavour, written in a forked child (the driver starts no library thread)."""
    out = {f: workdir / "templates" / f / STORE for f in ("fields", "plain")}
    pid = os.fork()
    if pid == 0:  # pragma: no cover (the child)
        code = 0
        try:
            for flavour, path in out.items():
                path.parent.mkdir(parents=True, exist_ok=True)
                make_template(path, flavour)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    if status:
        raise RuntimeError("could not write the template stores")
    return out


def run_one(
    seed: int,
    run: int,
    workdir: Path,
    templates: dict[str, Path],
    *,
    kinds: Iterable[str] | None = None,
    mutant: str | None = None,
    verbose: bool = False,
    keep: bool = False,
    lab: Callable[[], RemoteLab] | None = None,
) -> dict[str, Any]:
    plan = draw_plan(seed, run, kinds)
    return RunDriver(plan, workdir, templates, mutant=mutant, verbose=verbose, keep=keep, lab=lab).run()


class LazyLab:
    """The remote lab of a job, started at its first remote run (SeaweedFS takes seconds to start)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.lab: RemoteLab | None = None
        self.error: str | None = None

    def __call__(self) -> RemoteLab:
        if self.error is not None:
            raise RuntimeError(self.error)
        if self.lab is None:
            try:
                self.lab = RemoteLab(self.workdir)
            except (OSError, RuntimeError) as exc:
                self.error = str(exc)
                raise RuntimeError(self.error) from exc
        return self.lab

    def close(self) -> None:
        if self.lab is not None:
            self.lab.close()
            self.lab = None


@dataclass
class CampaignResult:
    seed: int
    runs: list[dict[str, Any]]
    seconds: float
    mutant: str | None = None
    kinds: list[str] | None = None

    def totals(self) -> dict[str, int]:
        t: Counter[str] = Counter()
        for r in self.runs:
            t.update(r["violations"]["counts"])
        return {c: t.get(c, 0) for c in CATEGORIES}

    @property
    def clean(self) -> bool:
        return not any(self.totals().values())

    def by(self, key: str) -> dict[str, dict[str, Any]]:
        """Per fault kind (``key="kind"``) or per faulted op (``"op"``): runs, fired, skipped, ok, counts."""
        rows: dict[str, dict[str, Any]] = {}
        for r in self.runs:
            row = rows.setdefault(r[key], {"runs": 0, "fired": 0, "skipped": 0, "ok": 0, **{c: 0 for c in CATEGORIES}})
            row["runs"] += 1
            if r.get("skipped"):
                row["skipped"] += 1
                continue
            row["fired"] += bool(r.get("fired"))
            counts = r["violations"]["counts"]
            row["ok"] += not any(counts.values())
            for c in CATEGORIES:
                row[c] += counts.get(c, 0)
        return dict(sorted(rows.items()))

    def violating_runs(self) -> dict[str, list[int]]:
        out: dict[str, list[int]] = {c: [] for c in CATEGORIES}
        for r in self.runs:
            for c in CATEGORIES:
                if r["violations"]["counts"].get(c):
                    out[c].append(r["run"])
        return out

    def report(self) -> str:
        lines = [
            f"fault campaign: seed {self.seed}, {len(self.runs)} runs, {self.seconds:.1f} s"
            + (f", mutant {self.mutant}" if self.mutant else "")
        ]
        for key, title in (("kind", "fault kind"), ("op", "faulted op")):
            rows = self.by(key)
            lines.append("")
            lines.append(
                f"{title:<14} {'runs':>5} {'fired':>5} {'ok':>5} "
                + " ".join(f"{c:>5}" for c in CATEGORIES)
                + "  skipped"
            )
            for name, row in rows.items():
                lines.append(
                    f"{name:<14} {row['runs']:>5} {row['fired']:>5} {row['ok']:>5} "
                    + " ".join(f"{row[c]:>5}" for c in CATEGORIES)
                    + (f"  {row['skipped']}" if row["skipped"] else "")
                )
        t = self.totals()
        ok = sum(1 for r in self.runs if not r.get("skipped") and not any(r["violations"]["counts"].values()))
        lines.append("")
        lines.append("total: ok " + str(ok) + ", " + ", ".join(f"{c} {t[c]}" for c in CATEGORIES))
        skipped = [r for r in self.runs if r.get("skipped")]
        if skipped:
            lines.append(f"skipped {len(skipped)} runs: {skipped[0]['skipped']}")
        for c, runs in self.violating_runs().items():
            if runs:
                lines.append(f"{c}: runs {', '.join(map(str, runs[:40]))}" + (" ..." if len(runs) > 40 else ""))
        first = next((r for r in self.runs if any(r["violations"]["counts"].values())), None)
        if first is not None:
            lines.append(
                f"first violation, run {first['run']} ({first['kind']}, {first['op']}): "
                f"{first['violations']['details'][0][:300]}"
            )
            lines.append(
                f"replay: python -m testsupport.faults --seed {self.seed} --replay {first['run']}"
                + (f" --mutant {self.mutant}" if self.mutant else "")
                + (f" --kinds {','.join(self.kinds)}" if self.kinds else "")
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "runs": len(self.runs),
            "seconds": round(self.seconds, 1),
            "mutant": self.mutant,
            "kinds": self.kinds,
            "totals": self.totals(),
            "by_kind": self.by("kind"),
            "by_op": self.by("op"),
            "violating_runs": self.violating_runs(),
            "skipped": next((r["skipped"] for r in self.runs if r.get("skipped")), None),
            "violations": [
                {"run": r["run"], "kind": r["kind"], "op": r["op"], **r["violations"]}
                for r in self.runs
                if any(r["violations"]["counts"].values())
            ],
        }


def _crashed(seed: int, run: int, why: str) -> dict[str, Any]:
    """The record of a run that could not report itself: counted as a crash, never as passed."""
    v = Violations()
    v.add("crash", why)
    return {
        "run": run,
        "seed": seed,
        "kind": "?",
        "op": "?",
        "flavour": "?",
        "skipped": None,
        "violations": v.to_json(),
        "fired": False,
        "seconds": 0.0,
    }


def _job(
    job: int,
    jobs: int,
    seed: int,
    runs: Iterable[int],
    workdir: Path,
    templates: dict[str, Path],
    kinds: list[str] | None,
    mutant: str | None,
    out: Path,
    progress: bool,
) -> None:
    lab = LazyLab(workdir / f"remote-{job}")
    with open(out, "w") as f, contextlib.closing(lab):
        for run in runs:
            if run % jobs != job:
                continue
            try:
                r = run_one(seed, run, workdir, templates, kinds=kinds, mutant=mutant, lab=lab)
            except Exception as exc:  # the driver's own failure: a crash of the run, never silent
                r = _crashed(seed, run, f"driver: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"[-1500:])
            f.write(json.dumps(r) + "\n")
            f.flush()
            if progress:
                bad = {c: n for c, n in r["violations"]["counts"].items() if n}
                print(
                    f"run {run:5d} {r['kind']:<13} {r['op']:<8} {r.get('seconds', 0):6.2f}s "
                    + (f"VIOLATIONS {bad}" if bad else ("skipped" if r.get("skipped") else "ok")),
                    flush=True,
                )


def run_campaign(
    seed: int,
    runs: int,
    *,
    first: int = 0,
    jobs: int = 1,
    kinds: list[str] | None = None,
    mutant: str | None = None,
    workdir: Path | None = None,
    progress: bool = False,
) -> CampaignResult:
    """Runs ``first`` .. ``first + runs - 1`` of campaign ``seed``, ``jobs`` at a time."""
    if mutant is not None and mutant not in inject.MUTANTS:
        raise ValueError(f"unknown mutant {mutant!r}; known: {', '.join(inject.MUTANTS)}")
    _preload()
    t0 = time.monotonic()
    own = workdir is None
    work = default_workdir("carraystore-faults-") if workdir is None else workdir
    work.mkdir(parents=True, exist_ok=True)
    try:
        templates = make_templates(work)
        if "enospc" in (kinds or KINDS):
            inject.tmpfs_available()  # probed once, before the jobs fork
        numbers = range(first, first + runs)
        outs = [work / f"results-{j}.jsonl" for j in range(jobs)]
        if jobs == 1:
            _job(0, 1, seed, numbers, work, templates, kinds, mutant, outs[0], progress)
        else:
            pids = []
            for j in range(jobs):
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:  # pragma: no cover (a job process)
                    code = 0
                    try:
                        _job(j, jobs, seed, numbers, work, templates, kinds, mutant, outs[j], progress)
                    except BaseException:
                        traceback.print_exc()
                        code = 1
                    finally:
                        sys.stdout.flush()
                        os._exit(code)
                pids.append(pid)
            for pid in pids:
                os.waitpid(pid, 0)
        results = []
        for o in outs:
            if o.exists():
                results += [json.loads(line) for line in o.read_text().splitlines() if line.strip()]
        got = {r["run"] for r in results}
        for run in numbers:
            if run not in got:  # a job died: its runs count as crashed, never as passed
                results.append(_crashed(seed, run, "the job running this run died"))
        results.sort(key=lambda r: r["run"])
        return CampaignResult(seed, results, time.monotonic() - t0, mutant, kinds)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


def replay(
    seed: int, run: int, *, kinds: list[str] | None = None, mutant: str | None = None, workdir: Path | None = None
) -> dict[str, Any]:
    """Run ``run`` of campaign ``seed`` alone, printing the plan, every event, the workers' output, the verdict."""
    _preload()
    work = default_workdir("carraystore-faults-replay-") if workdir is None else workdir
    templates = make_templates(work)
    with contextlib.closing(LazyLab(work / "remote")) as lab:
        r = run_one(seed, run, work, templates, kinds=kinds, mutant=mutant, verbose=True, keep=True, lab=lab)
    shutil.rmtree(work / "remote", ignore_errors=True)  # the server's data; the run's folder stays
    print(f"  kept in {work / f'run-{run:05d}'}")
    return r
