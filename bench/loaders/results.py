"""The comparison's results (one row per peer) and the goals they are checked against."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bench.loaders.registry import ON_DISK

__all__ = ["PeerResult", "Comparison", "check_goals", "default_preset"]


@dataclass
class PeerResult:
    """One row of the comparison."""

    name: str
    label: str
    status: str  # "ok", "skipped" or "error"
    reason: str = ""
    n_images: int = 0
    images_per_s_warm: float | None = None
    images_per_s_cold: float | None = None
    mb_per_s_warm: float | None = None
    mb_per_s_cold: float | None = None
    #: cold, with reads of the disk limited (``info["throttle"]["mbs"]`` MB/s); None: not measured
    images_per_s_throttled: float | None = None
    mb_per_s_throttled: float | None = None
    bytes_on_disk: int | None = None
    peak_rss_mb: float | None = None
    diversity: float | None = None
    build_s: float | None = None
    warm_s: list[float] = field(default_factory=list)
    cold_s: list[float] = field(default_factory=list)
    on_disk: bool = True
    throttled_s: list[float] = field(default_factory=list)


@dataclass
class Comparison:
    """All rows plus what they were measured on."""

    rows: list[PeerResult]
    info: dict[str, Any]

    def row(self, name: str) -> PeerResult | None:
        return next((r for r in self.rows if r.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {"info": self.info, "rows": [asdict(r) for r in self.rows], "goals": check_goals(self)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Comparison:
        return cls([PeerResult(**r) for r in data["rows"]], data["info"])


#: What the default preset must reach against the best on-disk peer, cold: at least this much where the
#: disk is slower than the codec (the cold epoch runs well below the warm one) ...
COLD_GOAL_DISK_BOUND = 1.2
#: ... and never below it where the codec sets the pace
COLD_GOAL_CODEC_BOUND = 1.0
#: a cold epoch below this share of the warm one counts as held by the disk
DISK_BOUND_SHARE = 0.8


def default_preset(cmp: Comparison, regime: str) -> str:
    """The preset a store gets by default in ``regime`` (``"cold"`` or ``"throttled"``): ``info["default_presets"]``
    (the rule's choice for the measured disk), else ``balanced``."""
    return str(cmp.info.get("default_presets", {}).get(regime, "balanced"))


def _cold_goal(cmp: Comparison, regime: str, disk: list[PeerResult]) -> dict[str, Any] | None:
    attr = "images_per_s_cold" if regime == "cold" else "images_per_s_throttled"
    name = default_preset(cmp, regime)
    row = cmp.row(f"carraystore_{name}_block")
    peers = [r for r in disk if getattr(r, attr)]
    if row is None or row.status != "ok" or not getattr(row, attr) or not peers:
        return None
    best = max(peers, key=lambda r: getattr(r, attr) or 0)
    rate = float(getattr(row, attr))
    disk_bound = regime == "throttled" or rate < DISK_BOUND_SHARE * (row.images_per_s_warm or 0)
    need = COLD_GOAL_DISK_BOUND if disk_bound else COLD_GOAL_CODEC_BOUND
    ratio = rate / (getattr(best, attr) or 1)
    return {
        "met": ratio >= need,
        "preset": name,
        "carraystore": rate,
        "best_peer": best.name,
        "best_peer_images_per_s": getattr(best, attr),
        "ratio": ratio,
        "goal": need,
        "disk_bound": disk_bound,
    }


def check_goals(cmp: Comparison) -> dict[str, Any]:
    """The comparison's goals, measured: each with ``met`` (True/False/None) and the numbers.

    Warm, ``fast`` at least 2x the fastest on-disk peer and half in-memory numpy; cold (and
    cold on the throttled disk, when measured), the default preset for that disk at least
    1.2x the fastest on-disk peer where the disk holds it back, never below it otherwise;
    ``small`` no larger than the ``.npz`` cache.
    """
    ok = [r for r in cmp.rows if r.status == "ok"]
    disk = [r for r in ok if r.name in ON_DISK]
    goals: dict[str, Any] = {}
    fast = cmp.row("carraystore_fast_block")
    if fast and fast.status == "ok" and disk:
        best = max(disk, key=lambda r: r.images_per_s_warm or 0)
        ratio = (fast.images_per_s_warm or 0) / (best.images_per_s_warm or 1)
        goals["warm_fast_2x"] = {
            "met": ratio >= 2.0,
            "carraystore": fast.images_per_s_warm,
            "best_peer": best.name,
            "best_peer_images_per_s": best.images_per_s_warm,
            "ratio": ratio,
        }
    numpy = cmp.row("numpy_memory")
    if fast and fast.status == "ok" and numpy and numpy.status == "ok":
        ratio = (fast.images_per_s_warm or 0) / (numpy.images_per_s_warm or 1)
        goals["warm_fast_half_numpy"] = {
            "met": ratio >= 0.5,
            "carraystore": fast.images_per_s_warm,
            "numpy_images_per_s": numpy.images_per_s_warm,
            "ratio": ratio,
        }
    cold = _cold_goal(cmp, "cold", disk)
    if cold is not None:
        goals["cold_default_beats_all"] = cold
    throttled = _cold_goal(cmp, "throttled", disk)
    if throttled is not None:
        goals["throttled_default_beats_all"] = throttled
    small = next((r for r in ok if r.name == "carraystore_small_block"), None)
    npz = cmp.row("npz_cache")
    if small and npz and npz.status == "ok" and small.bytes_on_disk and npz.bytes_on_disk:
        goals["small_not_larger_than_npz"] = {
            "met": small.bytes_on_disk <= npz.bytes_on_disk,
            "carraystore_small_bytes": small.bytes_on_disk,
            "npz_bytes": npz.bytes_on_disk,
            "ratio": small.bytes_on_disk / npz.bytes_on_disk,
        }
    return goals
