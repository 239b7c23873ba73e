"""What a measurement ran on: the machine and the libraries' versions."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path
from typing import Any

__all__ = ["machine_info", "library_versions"]


def machine_info() -> dict[str, Any]:
    """CPU count and model, memory, OS and Python of this machine."""
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = None
    with contextlib.suppress(Exception):
        mem = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1)
    return {
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu": cpu,
        "memory_gb": mem,
        "system": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
    }


def library_versions() -> dict[str, str]:
    """Versions of carraystore and of every peer's library that is installed."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in (
        "carraystore",
        "blosc2",
        "numpy",
        "pillow",
        "tensorflow-cpu",
        "tensorflow",
        "keras",
        "h5py",
        "zarr",
        "numcodecs",
    ):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            continue
    if "tensorflow-cpu" in out and "tensorflow" in out:
        del out["tensorflow"]
    return out
