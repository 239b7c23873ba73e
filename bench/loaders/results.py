"""The comparison's results (one row per peer) and the goals they are checked against."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from bench.loaders.registry import ON_DISK

__all__ = ["PeerResult", "Comparison", "check_goals"]


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
    bytes_on_disk: int | None = None
    peak_rss_mb: float | None = None
    diversity: float | None = None
    build_s: float | None = None
    warm_s: list[float] = field(default_factory=list)
    cold_s: list[float] = field(default_factory=list)
    on_disk: bool = True


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


def check_goals(cmp: Comparison) -> dict[str, Any]:
    """The comparison's three goals, measured: each with ``met`` (True/False/None) and the numbers."""
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
    default = cmp.row("carraystore_balanced_block")
    cold_disk = [r for r in disk if r.images_per_s_cold]
    if default and default.status == "ok" and default.images_per_s_cold and cold_disk:
        best = max(cold_disk, key=lambda r: r.images_per_s_cold or 0)
        goals["cold_default_beats_all"] = {
            "met": default.images_per_s_cold > (best.images_per_s_cold or 0),
            "carraystore": default.images_per_s_cold,
            "best_peer": best.name,
            "best_peer_images_per_s": best.images_per_s_cold,
            "ratio": default.images_per_s_cold / (best.images_per_s_cold or 1),
        }
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
