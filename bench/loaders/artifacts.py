"""Building each peer's converted copy of the images once, and reusing it while its inputs are unchanged."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

from bench.loaders.peer import Context, Peer

__all__ = ["BUILD_VERSION", "build_artifact"]

BUILD_VERSION = "1"  # bump to invalidate cached artifacts when a builder changes


def _artifact_dir(work: Path, peer: Peer) -> Path:
    return work / getattr(peer, "artifact", peer.name)


def build_artifact(peer: Peer, ctx: Context, work: Path) -> tuple[Path, float]:
    """Build (or reuse) ``peer``'s artifact under ``work``; returns its path and build seconds.

    An artifact is reused only if it was built from the same images (root, subset, size,
    file list) with the same builder version and peer settings (e.g. the preset's codec).
    """
    dest = _artifact_dir(work, peer)
    if not peer.builds:
        return dest, 0.0
    folder = ctx.folder
    key = {
        "version": BUILD_VERSION,
        "root": ctx.root,
        "limit": ctx.limit,
        "seed": ctx.seed,
        "image_size": list(ctx.image_size) if ctx.image_size else None,
        "color_mode": ctx.color_mode,
        "files": len(folder.files),
        "sizes": sum(p.stat().st_size for p in folder.files),
        **peer.key(),
    }
    marker = dest / ".complete.json"
    if marker.exists():
        with contextlib.suppress(ValueError, KeyError, OSError):
            info = json.loads(marker.read_text())
            if info.get("key") == json.loads(json.dumps(key)):
                return dest, float(info["build_s"])
    shutil.rmtree(dest, ignore_errors=True)
    t = time.perf_counter()
    peer.build(ctx, dest)
    build_s = time.perf_counter() - t
    marker.write_text(json.dumps({"key": key, "build_s": build_s}))
    return dest, build_s
