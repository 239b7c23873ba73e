"""The link policy: how one epoch's decoder shares a read-ahead source's link (layer 4).

A decoder over a :class:`~carraystore.format.frame.ReadAheadSource` holds one
:class:`LinkPolicy`: the first (lead) window is fetched alone, so the first batch does not
share the link; then chunks are announced ahead (:attr:`LinkPolicy.want`); the next epoch's
first window is kept or hinted (only by the newest policy on a source, :data:`_NEWEST`).
Over a local file it does nothing (:attr:`LinkPolicy.lead_in` set from the start). State is
guarded by the decoder's ``cond``; lock order: docs/engine.md.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from carraystore.base.forksafe import at_fork_in_child
from carraystore.engine.sampling import EpochPlan
from carraystore.engine.spec import LoaderSpec
from carraystore.format.frame import ReadAheadSource

__all__ = ["LinkPolicy", "NEXT_EPOCH_THREAD", "HINT_DEADLINE_S"]

#: the name of the thread that plans the next epoch and hints its first window
NEXT_EPOCH_THREAD = "carraystore-next-epoch"
#: seconds that thread waits for this epoch's bytes before giving up
HINT_DEADLINE_S = 600.0

#: the policy last started on each source: only it hints the next epoch
_NEWEST: weakref.WeakKeyDictionary[Any, LinkPolicy] = weakref.WeakKeyDictionary()
_NEWEST_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    global _NEWEST_LOCK
    _NEWEST_LOCK = threading.Lock()


at_fork_in_child(_after_fork_in_child)


class LinkPolicy:
    """The lead window, the announce distance and the next epoch's hint of one decoder.

    ``serves``: the decoder's ``(k, n)``; only its own batches' windows are fetched and
    hinted. Every method but :meth:`start_hint` is called with ``cond`` held.
    """

    def __init__(
        self, spec: LoaderSpec, epoch: int, plan: EpochPlan, serves: tuple[int, int], cond: threading.Condition
    ) -> None:
        self.spec, self.store, self.epoch, self.plan, self.serves, self.cond = (
            spec, spec.store, epoch, plan, serves, cond,
        )  # fmt: skip
        src = spec.store.source
        #: the source, when it reads ahead over a link to share (None: a local file)
        self.source: ReadAheadSource | None = src if isinstance(src, ReadAheadSource) and src.max_inflight else None
        #: chunks a decoder keeps announced beyond the window it starts (0: one window ahead)
        self.want = self.source.max_inflight if self.source else 0
        self.lead: object | None = None  # the lead window (the decoder's)
        self.lead_w = -1
        self._lead_need = 0
        self._arrived: set[int] = set()
        #: set once the lead's bytes are in (from the start without a link)
        self.lead_in = threading.Event()
        if self.source is None:
            self.lead_in.set()
        self._next_lead: frozenset[int] = frozenset()
        #: chunks of the next epoch's first window this epoch fetched, kept for the next
        self.kept: set[int] = set()
        self._announced: set[int] = set()
        self._all_announced = threading.Event()
        self._epoch_chunks: list[int] = []
        #: the next epoch's first window was hinted to the source
        self.next_epoch_hinted = False
        self.closed = False

    def mine(self, w: int, plan: EpochPlan | None = None) -> range:
        """The batches of window ``w`` the decoder serves (of ``plan``: this epoch's by default)."""
        return (self.plan if plan is None else plan).batches_of(w, self.spec.batch_size, self.serves)

    # -- the lead window -----------------------------------------------------------------
    def take_lead(self, win: object, w: int, chunks: np.ndarray) -> None:
        """Make window ``w`` (just started) the lead if none is yet and the link is shared."""
        if self.lead_in.is_set() or self.lead is not None:
            return
        self.lead, self.lead_w, self._lead_need = win, w, len(chunks)
        hinted = bool(len(chunks)) and self.store.chunks_hinted(chunks)
        if not len(chunks) or (hinted and self.store.wait_chunks_fetched(chunks, timeout=0)):
            # nothing to fetch, or already in (hinted by the previous epoch)
            self.lead_in.set()
        elif hinted:
            # on their way: one chunk of the next window keeps the link busy meanwhile
            nxt = next((v for v in range(w + 1, self.plan.nwindows) if self.mine(v)), None)
            if nxt is not None:
                self.store.prefetch_chunks(self.plan.window_chunks[nxt][:1])

    def lead_fetched(self, j: int) -> bool:
        """The lead's chunk ``j`` is in or failed (may be said twice); True when it was the last."""
        if j in self._arrived:
            return False
        self._arrived.add(j)
        if len(self._arrived) < self._lead_need or self.lead_in.is_set():
            return False
        self.lead_in.set()
        return not self.closed

    # -- announcing --------------------------------------------------------------------------
    def announced(self, chunks: Sequence[int]) -> None:
        """These chunks were announced; those of the next epoch's first window are kept for it too."""
        if self.source is None:
            return
        self._announced.update(int(c) for c in chunks)
        keep = [int(c) for c in chunks if int(c) in self._next_lead and int(c) not in self.kept]
        if keep:
            self._keep_for_next(keep)

    def all_announced(self, chunks: Sequence[int]) -> None:
        """The epoch's last window was announced (``chunks``: the last announcement)."""
        if self.source is not None and self.lead_in.is_set() and not self._all_announced.is_set():
            self._epoch_chunks = [int(c) for c in chunks]
            self._all_announced.set()

    # -- the next epoch ------------------------------------------------------------------
    def start_hint(self, unread: Callable[[], set[int]]) -> None:
        """Start the next-epoch hint thread (link only); ``unread()`` (``cond`` held): chunks yet to read."""
        if self.source is None:
            return
        with _NEWEST_LOCK, contextlib.suppress(TypeError):  # (a source that takes no weak reference)
            _NEWEST[self.source] = self
        threading.Thread(target=self._hint_next_epoch, args=(unread,), name=NEXT_EPOCH_THREAD, daemon=True).start()

    def _hint_next_epoch(self, unread: Callable[[], set[int]]) -> None:
        """Keep the next epoch's first-window chunks this epoch fetches; hint the rest once all are in."""
        try:
            plan = self.spec.plan(self.epoch + 1)
            w = next((v for v in range(plan.nwindows) if len(plan.window_chunks[v]) and self.mine(v, plan)), None)
            if w is None:
                return
            lead = [int(c) for c in plan.window_chunks[w]]
            with self.cond:
                self._next_lead = frozenset(lead)
                # announced before the plan was made: kept if not read yet
                keep = [c for c in lead if c in self._announced and c not in self.kept]
                keep = [c for c in keep if self.store.chunks_hinted([c])]
                if keep:
                    self._keep_for_next(keep)
            # wait for this epoch's chunks; an epoch closed before that hints nothing
            deadline = time.monotonic() + HINT_DEADLINE_S
            while not self._all_announced.wait(0.5):
                if self.closed or time.monotonic() > deadline:
                    return
            while not self.store.wait_chunks_fetched(self._epoch_chunks, timeout=0.5):
                if self.closed or time.monotonic() > deadline:
                    return
            with self.cond:
                # plus kept ones the source let go after this epoch read them
                left = unread()
                rest = [c for c in lead if c not in self.kept or (c not in left and not self.store.chunks_hinted([c]))]
                self.next_epoch_hinted = self._keep_for_next(rest)
        except Exception:  # e.g. a resumed epoch's options plan no other epoch: no hint
            pass

    def _keep_for_next(self, chunks: list[int]) -> bool:
        """Hint the next epoch's ``chunks`` unless a later policy started on this source; whether hinted."""
        with _NEWEST_LOCK:  # held while hinting: a decoder starting now hints after this
            try:
                newest = _NEWEST.get(self.source, self)
            except TypeError:
                newest = self
            if newest is not self:
                return False
            self.store.prefetch_chunks(chunks, again=True)
            self.kept.update(chunks)
            return True

    def close(self) -> None:
        """The decoder closed: release lead waiters; no hint unless all was announced already."""
        self.closed = True
        self.lead_in.set()
