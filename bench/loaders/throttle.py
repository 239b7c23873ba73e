"""A throttled disk for the comparison's cold epochs: a cgroup-v1 ``blkio`` read limit, and a disk's cold read speed.

:func:`open_throttle` makes a blkio cgroup whose members read the block device holding a
folder at most ``mbs`` MB/s (``blkio.throttle.read_bps_device``), as an HDD or a network
file system would serve it; a child process joins it (:func:`join`) for its throttled
epoch and leaves it (:func:`leave`) afterwards. Where this is not possible (no cgroup v1
blkio controller, not root, a folder on no block device) :func:`open_throttle` returns
the reason as text, and the comparison skips the throttled regime saying why.

:func:`cold_read_mbs` measures what a folder's disk gives to a cold sequential read (a
probe file written beside it, evicted from the page cache, read back, removed), in this
process or, with a throttle, in a child process that joined it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Throttle", "open_throttle", "block_device", "join", "leave", "cold_read_mbs", "BLKIO"]

#: Where the cgroup-v1 blkio hierarchy is mounted.
BLKIO = Path("/sys/fs/cgroup/blkio")


@dataclass
class Throttle:
    """A blkio cgroup limiting reads of one block device (``major:minor``) to ``mbs`` MB/s."""

    mbs: float
    device: str
    cgroup: Path

    @property
    def procs(self) -> Path:
        return self.cgroup / "cgroup.procs"

    def to_json(self) -> dict[str, object]:
        return {"mbs": self.mbs, "device": self.device, "cgroup": str(self.cgroup)}

    def close(self) -> None:
        """Remove the cgroup (it must be empty: every child left or ended)."""
        with contextlib.suppress(OSError):
            self.cgroup.rmdir()


def block_device(path: str | os.PathLike[str]) -> tuple[str | None, str]:
    """The whole disk (``major:minor``) holding ``path``, or None and why not.

    A partition's reads are throttled on its disk: the cgroup takes whole disks only.
    """
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    sys_dev = Path(f"/sys/dev/block/{major}:{minor}")
    if not sys_dev.exists():
        return None, f"{path} is on device {major}:{minor}, which is not a block device (tmpfs, overlay, network?)"
    real = sys_dev.resolve()
    if (real / "partition").exists():
        parent = real.parent / "dev"
        with contextlib.suppress(OSError):
            return parent.read_text().strip(), ""
        return None, f"cannot find the disk of partition {major}:{minor}"
    return f"{major}:{minor}", ""


def open_throttle(path: str | os.PathLike[str], mbs: float, name: str | None = None) -> Throttle | str:
    """A cgroup that reads ``path``'s disk at ``mbs`` MB/s, or the reason it cannot be made here."""
    if mbs <= 0:
        return f"a read limit of {mbs} MB/s is not a speed"
    if not (BLKIO / "blkio.throttle.read_bps_device").exists():
        return f"no cgroup-v1 blkio controller at {BLKIO} (cgroup v2 or a container without it)"
    device, why = block_device(path)
    if device is None:
        return why
    group = BLKIO / (name or f"carraystore-bench-{int(mbs)}mbs-{os.getpid()}")
    try:
        group.mkdir(exist_ok=True)
        (group / "blkio.throttle.read_bps_device").write_text(f"{device} {int(mbs * 1e6)}\n")
        rule = (group / "blkio.throttle.read_bps_device").read_text()
    except OSError as exc:
        with contextlib.suppress(OSError):
            group.rmdir()
        return f"cannot set a blkio read limit ({exc.strerror or exc}; needs root and a writable {BLKIO})"
    if f"{device} {int(mbs * 1e6)}" not in rule:
        group.rmdir()
        return f"the kernel did not keep the read limit on {device} ({rule.strip()!r})"
    return Throttle(mbs, device, group)


def _own_blkio_group() -> Path:
    """The blkio cgroup this process is in now (to go back to after a throttled epoch)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, where = line.split(":", 2)
            if "blkio" in controllers.split(","):
                return BLKIO / where.lstrip("/")
    return BLKIO


def join(procs: str | os.PathLike[str]) -> Path:
    """Move this process (every thread of it) into the cgroup of ``procs``; returns the group it left."""
    home = _own_blkio_group()
    Path(procs).write_text(f"{os.getpid()}\n")
    return home


def leave(home: str | os.PathLike[str]) -> None:
    """Move this process back into the cgroup ``home`` (what :func:`join` returned)."""
    (Path(home) / "cgroup.procs").write_text(f"{os.getpid()}\n")


def _probe_read(path: Path) -> float:
    """Seconds to read ``path`` cold, in 8 MiB reads (the file evicted first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t = time.perf_counter()
        while os.read(fd, 8 << 20):
            pass
        return time.perf_counter() - t
    finally:
        os.close(fd)


def cold_read_mbs(folder: str | os.PathLike[str], nbytes: int = 128 << 20, throttle: Throttle | None = None) -> float:
    """MB/s of a cold sequential read of a probe file of ``nbytes`` written in ``folder`` (removed after).

    With ``throttle``, the read runs in a child process inside its cgroup.
    """
    probe = Path(folder) / f".carraystore-read-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            block = os.urandom(1 << 20)
            for _ in range(max(1, nbytes >> 20)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        size = probe.stat().st_size
        if throttle is None:
            return size / _probe_read(probe) / 1e6
        code = (
            "import sys; from bench.loaders.throttle import join, _probe_read; from pathlib import Path; "
            "join(sys.argv[1]); print(_probe_read(Path(sys.argv[2])))"
        )
        root = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
        out = subprocess.run(
            [sys.executable, "-c", code, str(throttle.procs), str(probe)],
            capture_output=True,
            text=True,
            check=True,
            env=env,
            timeout=600,
        )
        return size / float(out.stdout.strip().splitlines()[-1]) / 1e6
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
