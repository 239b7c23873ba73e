"""What a benchmark's processes used: peak resident memory and CPU seconds.

Shared by the loader comparison's children, the remote contenders and the ``bench/``
files that watch a server process.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from pathlib import Path

__all__ = ["peak_rss_mb", "cpu_seconds"]


def peak_rss_mb() -> float:
    """Peak resident memory of this process in MB.

    Linux: ``VmHWM`` of /proc/self/status, the high-water mark of this program's own
    memory; ``ru_maxrss`` would also count the parent's RSS at fork time, which Linux
    carries across ``exec``.
    """
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 1024 / 1024


def cpu_seconds(pid: int | None = None) -> float:
    """User + system CPU seconds of this process (all its threads), or of process ``pid``
    (Linux: from /proc/PID/stat)."""
    if pid is None:
        t = os.times()
        return t.user + t.system
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
