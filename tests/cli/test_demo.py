"""``make demo`` (carraystore.cli.demo) at a tiny scale: it runs and prints medians with their spread."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from carraystore.cli.demo import main, time_rounds


def test_time_rounds_warms_up_then_interleaves_new_epochs() -> None:
    calls: list[tuple[str, int]] = []

    def contender(name: str, n: int):  # type: ignore[no-untyped-def]
        def run(epoch: int) -> int:
            calls.append((name, epoch))
            return n

        return run

    times = time_rounds({"a": contender("a", 5), "b": contender("b", 7), "c": contender("c", 9)}, rounds=3)
    # one warm-up epoch each (epoch 0), then every round one epoch each, a new epoch per round,
    # with the first contender of a round rotating
    assert calls == [
        ("a", 0), ("b", 0), ("c", 0),
        ("a", 1), ("b", 1), ("c", 1),
        ("b", 2), ("c", 2), ("a", 2),
        ("c", 3), ("a", 3), ("b", 3),
    ]  # fmt: skip
    assert [len(v) for v in times.values()] == [3, 3, 3]
    assert all(n == 5 and t >= 0 for n, t in times["a"])


def test_demo_runs_at_a_tiny_scale_and_prints_the_spread(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("skimage", reason="the demo's photos come from scikit-image")
    assert main(["--out", str(tmp_path / "demo"), "-n", "40", "--size", "32", "--rounds", "3"]) == 0
    out = capsys.readouterr().out
    assert "median of 3 interleaved rounds" in out
    header = next(line for line in out.splitlines() if "images/s" in line and "loader" in line)
    assert "min-max" in header and "speedup" in header
    rows = {}
    for line in out.splitlines():
        m = re.match(r"\s+(per-file Pillow loop|carraystore, default preset|carraystore, --preset fast)\S*.*?"
                     r"\s(\d+)\s+(\d+)\s+(\d+)-(\d+)\s+([\d.]+)x\s+([\d.]+)$", line)  # fmt: skip
        if m:
            rows[m.group(1)] = [float(g) for g in m.groups()[1:]]
    assert set(rows) == {"per-file Pillow loop", "carraystore, default preset", "carraystore, --preset fast"}
    for name, (images, median, lo, hi, speedup, mb) in rows.items():
        assert images == 32  # the train split: 80% of 40
        assert lo <= median <= hi, name
        assert speedup > 0 and mb >= 0
    assert rows["per-file Pillow loop"][4] == 1.0
    assert rows["carraystore, default preset"][5] > 0  # a store of decoded pixels: 32 x 32x32x3 bytes
    assert (tmp_path / "demo" / "train.b2nd").is_file() and (tmp_path / "demo" / "train-fast.b2nd").is_file()
