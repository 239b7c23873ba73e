"""Fork safety, in one place: a forked child must not inherit a chunk read, a decompression or a lock half-way.
- :data:`FORK_GATE` is held (shared) by every chunk read and decompression; ``fork()`` waits until none runs.
- :func:`in_forked_child`: decompress with one blosc2 thread (its threads hang in such a child).
- :func:`at_fork_in_child` registers what a module must reset in a child (locks, thread registries)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["FORK_GATE", "in_forked_child", "at_fork_in_child"]

_FORKED_CHILD = False
_CHILD_RESETS: list[Callable[[], None]] = []


class _ForkGate:
    """A shared gate: many holders at once, and ``fork()`` only when nobody holds it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0

    def __enter__(self) -> None:
        with self._cond:
            self._active += 1

    def __exit__(self, *exc: Any) -> None:
        with self._cond:
            self._active -= 1
            if not self._active:
                self._cond.notify_all()

    def before_fork(self) -> None:
        self._cond.acquire()  # held across fork: no thread can enter meanwhile
        self._cond.wait_for(lambda: self._active == 0, timeout=30)

    def after_fork_in_parent(self) -> None:
        self._cond.release()

    def after_fork_in_child(self) -> None:
        self._cond = threading.Condition()
        self._active = 0


#: Held (shared) by every chunk read and decompression.
FORK_GATE = _ForkGate()


def in_forked_child() -> bool:
    """Whether this process was forked from another Python process (decompress serially)."""
    return _FORKED_CHILD


def at_fork_in_child(reset: Callable[[], None]) -> None:
    """Run ``reset()`` in every forked child (after the gate and the flag are reset)."""
    _CHILD_RESETS.append(reset)


def _after_fork_in_child() -> None:
    global _FORKED_CHILD
    _FORKED_CHILD = True
    FORK_GATE.after_fork_in_child()
    for reset in _CHILD_RESETS:
        reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=FORK_GATE.before_fork,
        after_in_parent=FORK_GATE.after_fork_in_parent,
        after_in_child=_after_fork_in_child,
    )
