"""What this process may use: its cores and memory as affinity and cgroup quotas limit them (layer 0).
The loader's defaults come from here."""

from __future__ import annotations

import math
import os
import re
from pathlib import Path

from carraystore.base.errors import InvalidInputError

__all__ = ["available_cpus", "memory_limit", "parse_bytes", "format_bytes"]

_CGROUP = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_cpu_quota(root: Path = _CGROUP) -> float | None:
    """Cores the cgroup's CPU quota allows (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), None if unlimited."""
    v2 = _read(root / "cpu.max")
    if v2:
        quota, _, period = v2.partition(" ")
        if quota != "max" and period:
            try:
                return int(quota) / int(period)
            except ValueError:
                return None
        return None
    q, p = _read(root / "cpu" / "cpu.cfs_quota_us"), _read(root / "cpu" / "cpu.cfs_period_us")
    try:
        if q is not None and p is not None and int(q) > 0 and int(p) > 0:
            return int(q) / int(p)
    except ValueError:
        return None
    return None


def available_cpus(root: Path = _CGROUP) -> int:
    """Cores this process may run on: its affinity mask, bounded by the cgroup's CPU quota (at least 1)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    quota = _cgroup_cpu_quota(root)
    if quota is not None and quota > 0:
        n = min(n, max(1, math.ceil(quota)))
    return max(1, n)


def memory_limit(root: Path = _CGROUP) -> int:
    """Bytes of memory this process may use: the machine's RAM, bounded by the cgroup's limit."""
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        ram = 8 << 30
    for name in ("memory.max", "memory/memory.limit_in_bytes"):
        text = _read(root / name)
        if text and text != "max":
            try:
                limit = int(text)
            except ValueError:
                continue
            if 0 < limit < ram:  # v1 says "no limit" with a huge number
                return limit
    return int(ram)


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, name: str = "size") -> int:
    """Bytes from an int or a string such as ``"2GB"`` or ``"512MiB"`` (kB/MB/GB decimal, KiB/MiB/GiB binary)."""
    if isinstance(value, bool):
        raise InvalidInputError(f"{name} must be bytes (an int) or a size such as '2GB', got {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise InvalidInputError(f"{name} must be positive, got {value!r}")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        unit = _UNITS.get(m.group(2).lower()) if m else None
        if m is not None and unit is not None:
            n = int(float(m.group(1)) * unit)
            if n > 0:
                return n
    raise InvalidInputError(f"{name} must be bytes (an int) or a size such as '2GB' or '512MiB', got {value!r}")


def format_bytes(n: int) -> str:
    """``n`` bytes for people: ``"1.5 GB"``, ``"12.0 MB"``."""
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
