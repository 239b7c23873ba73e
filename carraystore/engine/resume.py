"""Where training stopped inside an epoch, at any world size: the resume state every adapter shares.

A state is a JSON-friendly dict (``version`` 1)::

    {"version": 1, "epoch": 3,
     "consumed": [{"world_size": 4, "samples": 640}, {"world_size": 2, "samples": 128}],
     "samples": 768, "batch_size": 32, "num_items": 5000, "chunk_images": 84,
     "shuffle": "block", "seed": 0, "window": 16, ...}

``consumed``: the epoch's runs, oldest first (ranks in lockstep, as under DDP); the rest is
:func:`carraystore.engine.sampling.remainder_plan`. ``batch_size``: the per-rank batch size of
the order. A loader whose store or options differ refuses the state (:func:`check_order`).
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from carraystore.base.errors import InvalidInputError

__all__ = ["STATE_VERSION", "ORDER_FIELDS", "ResumePoint", "check_order"]

#: ``state["version"]``.
STATE_VERSION = 1

#: Loader options the epoch's order depends on: a state must agree on them with the loader resuming it.
ORDER_FIELDS = ("shuffle", "seed", "window", "drop_remainder", "sequence_length", "sequence_stride", "clip_starts")

#: Store facts the order depends on (``clip_runs``: CRC32 of the group runs, None without
#: ``sequence_length``; ``content``: CRC32 of the chunks' CRC32s, telling stores apart).
STORE_FACTS = ("num_items", "chunk_images", "clip_runs", "content")


@dataclass(frozen=True)
class ResumePoint:
    """An interrupted epoch: its number, the runs of it so far and the order they were made in.

    ``runs``: ``(world_size, samples each rank consumed)``, oldest first; ``order``: the saved
    ORDER_FIELDS and STORE_FACTS as (name, value) pairs; ``batch_size`` 0: the loader's own.
    """

    epoch: int
    runs: tuple[tuple[int, int], ...]
    order: tuple[tuple[str, Any], ...]
    batch_size: int = 0

    @classmethod
    def from_state(cls, state: Any) -> ResumePoint:
        """Parse a state dict (what a ``state_dict()`` returned); a named error for anything else."""
        if isinstance(state, ResumePoint):
            return state
        if not isinstance(state, Mapping) or _count(state.get("version")) != STATE_VERSION:
            raise InvalidInputError(
                f"not a carraystore resume state of version {STATE_VERSION}: {str(state)[:200]}; "
                "pass what a carraystore state_dict() returned"
            )
        missing = [k for k in ("epoch", "consumed", *ORDER_FIELDS, *STORE_FACTS) if k not in state]
        if missing:
            raise InvalidInputError(f"this resume state lacks {missing}; pass what a carraystore state_dict() returned")
        epoch = state["epoch"]
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise InvalidInputError(f"a resume state's epoch must be an integer >= 0, got {epoch!r}")
        consumed = state["consumed"]
        if not isinstance(consumed, (list, tuple)):
            raise InvalidInputError(f"a resume state's consumed must be a list of runs, got {str(consumed)[:200]}")
        runs = []
        for run in consumed:
            w = _count(run.get("world_size")) if isinstance(run, Mapping) else None
            total = _count(run.get("samples")) if isinstance(run, Mapping) else None
            if w is None or total is None:
                raise InvalidInputError(
                    f"a run of a resume state must be {{'world_size': int, 'samples': int}}, got {str(run)[:200]}"
                )
            # every run a loader records consumed at least one sample on each of its ranks
            if w < 1 or total < w or total % w:
                raise InvalidInputError(f"a run of {total} samples over world_size {w} is not a run ranks make")
            runs.append((w, total // w))
        order = tuple((k, _frozen(state[k])) for k in (*ORDER_FIELDS, *STORE_FACTS))
        bs = state.get("batch_size", 0)
        if isinstance(bs, bool) or not isinstance(bs, int) or bs < 0:
            raise InvalidInputError(
                f"a resume state's batch_size must be an integer >= 0 (0: not recorded), got {bs!r}"
            )
        return cls(epoch, tuple(runs), order, bs)

    def to_state(self) -> dict[str, Any]:
        """The JSON-friendly dict form (what ``from_state`` reads)."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "consumed": [{"world_size": w, "samples": c * w} for w, c in self.runs],
            "samples": sum(c * w for w, c in self.runs),
            "batch_size": self.batch_size,
            **{k: _thawed(v) for k, v in self.order},
        }

    def then(self, epoch: int, world_size: int, per_rank: int, batches_left: bool) -> ResumePoint:
        """The point after a run at ``world_size`` consumed ``per_rank`` samples of ``epoch`` per
        rank (``self``'s runs count only for the same epoch); ``batches_left`` False: next epoch."""
        if not batches_left:
            return ResumePoint(epoch + 1, (), self.order, self.batch_size)
        runs = self.runs if self.epoch == epoch else ()
        if per_rank:
            runs = (*runs, (int(world_size), int(per_rank)))
        return ResumePoint(epoch, runs, self.order, self.batch_size)


def _count(v: Any) -> int | None:
    """``v`` as an int when it is one (a Python or numpy integer, not a bool, a float or a string), else None."""
    if isinstance(v, bool):
        return None
    try:
        return operator.index(v)
    except TypeError:
        return None


def _frozen(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v


def _thawed(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def check_order(point: ResumePoint, mine: Mapping[str, Any], location: str) -> None:
    """Refuse a state saved for another order: ``mine`` is the loader's ORDER_FIELDS and STORE_FACTS."""
    saved = dict(point.order)
    diff = {k: (saved.get(k), _frozen(v)) for k, v in mine.items() if saved.get(k) != _frozen(v)}
    if diff:
        what = ", ".join(f"{k}: saved {a!r}, here {b!r}" for k, (a, b) in diff.items())
        raise InvalidInputError(
            f"{location}: this resume state was saved for another order ({what}); "
            "make the loader with the same store and options to resume"
        )
    n = int(mine.get("num_items", 0))
    for w, _ in point.runs:
        if w > max(1, n):  # each rank of a run holds at least one item: more ranks are no run of this store
            raise InvalidInputError(
                f"{location}: this resume state has a run of world_size {w} over the store's {n} items, which no "
                "run makes (every rank holds at least one item); the state is damaged"
            )
