"""pytest fixture (imported by tests/conftest.py): no test leaves loader threads running.

``no_loader_threads_left``, used by the loader and pipeline tests, checks after each test
that no thread named by the loader is alive. Only garbage can still hold one (an abandoned
iterator), so the garbage is collected only when one is: a full collection costs ~0.3-1 CPU-s
once TensorFlow and torch are imported, after each of dozens of tests.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from carraystore.engine.loader import THREAD_NAME_PREFIX


def loader_threads() -> list[threading.Thread]:
    """The loader's threads that are alive."""
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME_PREFIX) and t.is_alive()]


@pytest.fixture
def no_loader_threads_left() -> Iterator[None]:
    yield
    if loader_threads():
        gc.collect()
    assert loader_threads() == [], "a test left loader threads running"
