"""Shuffle you can see: batch diversity and displacement of an epoch against a global shuffle."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import carraystore
from carraystore.base.errors import InvalidInputError
from carraystore.cli.main import main
from carraystore.engine.sampling import plan_epoch
from carraystore.engine.shuffle_report import (
    GLOBAL_MEDIAN_DISPLACEMENT,
    compare_windows,
    displacement,
    distinct_per_batch,
    expected_displacement,
    expected_distinct_per_batch,
    report_for_order,
    shuffle_report,
)

N, K, B = 4096, 64, 32
SORTED_LABELS = np.repeat(np.arange(8), N // 8)  # a store written in class order (--keep-order folders)


def _report(shuffle: Any, window: int = 16, seed: int = 0, labels: np.ndarray = SORTED_LABELS) -> Any:
    plan = plan_epoch(N, K, shuffle=shuffle, window=window, seed=seed)
    return report_for_order(plan.items, B, labels=labels, chunk_size=K, shuffle=shuffle, window=window, seed=seed)


# -- the measures --------------------------------------------------------------------------


def test_expected_distinct_is_exact_on_a_small_case() -> None:
    values = np.array([0, 0, 1, 2, 2, 2])
    for b in (1, 2, 3, 4):
        subsets = list(itertools.combinations(range(len(values)), b))
        brute = sum(len(set(values[list(s)])) for s in subsets) / len(subsets)
        assert expected_distinct_per_batch(values, b) == pytest.approx(brute, rel=1e-12)
    assert math.isnan(expected_distinct_per_batch(values, 7))  # not one full batch


def test_expected_displacement_is_exact_on_a_small_case() -> None:
    n = 5
    perms = list(itertools.permutations(range(n)))
    brute = np.mean([displacement(np.array(p)).mean() for p in perms])
    assert expected_displacement(n) == pytest.approx(brute, rel=1e-12)
    assert expected_displacement(10**6) == pytest.approx(1 / 3, rel=1e-6)


def test_distinct_per_batch_counts_each_full_batch() -> None:
    labels = np.array([0, 0, 1, 1, 2, 2, 3])
    assert distinct_per_batch(labels, np.arange(7), 2) == 1.0  # the short last batch is left out
    assert distinct_per_batch(labels, np.array([0, 2, 1, 3, 4, 6, 5]), 2) == 2.0
    # strings (group names) count as values too
    names = np.array(["a", "a", "b", "b"])
    assert distinct_per_batch(names, np.array([0, 2, 1, 3]), 2) == 2.0


def test_global_shuffle_scores_about_one_on_every_measure() -> None:
    r = _report("global")
    for name in ("classes", "chunks"):
        d = r.diversity_of(name)
        assert d is not None and abs(d.score - 1) < 0.03, (name, d)
    assert abs(r.displacement_score - 1) < 0.05
    assert abs(r.displacement_median - GLOBAL_MEDIAN_DISPLACEMENT) < 0.03


def test_store_order_scores_low() -> None:
    r = _report(False)
    assert r.diversity_of("classes").score < 0.2  # type: ignore[union-attr]
    assert r.diversity_of("chunks").score < 0.1  # type: ignore[union-attr]
    assert r.displacement_mean == 0.0 and r.displacement_score == 0.0


def test_block_shuffle_lies_between_and_improves_with_the_window() -> None:
    seq, glob = _report(False), _report("global")
    scores = {w: _report("block", window=w) for w in (1, 4, 16)}
    for name in ("classes", "chunks"):
        s = [scores[w].diversity_of(name).score for w in (1, 4, 16)]  # type: ignore[union-attr]
        assert s[0] < s[1] < s[2], (name, s)
        assert seq.diversity_of(name).score <= s[0]  # type: ignore[union-attr]
        assert s[2] < glob.diversity_of(name).score  # type: ignore[union-attr]
    # a window of w chunks: a batch holds samples of at most w chunks
    assert scores[4].diversity_of("chunks").observed <= 4  # type: ignore[union-attr]
    # block shuffle moves whole chunks anywhere: samples travel as far as under a global shuffle
    assert all(abs(r.displacement_score - 1) < 0.1 for r in scores.values())


def test_a_shuffled_store_mixes_classes_even_with_small_windows() -> None:
    shuffled = np.random.default_rng(3).permutation(SORTED_LABELS)
    r = _report("block", window=1, labels=shuffled)
    assert r.diversity_of("classes").score > 0.95  # type: ignore[union-attr]
    assert r.diversity_of("chunks").score < 0.1  # type: ignore[union-attr]  # still one chunk per batch


def test_numbers_are_deterministic_for_a_seed() -> None:
    assert _report("block", seed=7) == _report("block", seed=7)
    a, b = _report("block", seed=7), _report("block", seed=8)
    assert (a.displacement_mean, a.diversity) != (b.displacement_mean, b.diversity)


def test_summary_names_each_measure_and_the_reference() -> None:
    text = _report("block", window=4).summary()
    assert "block shuffle, window 4 chunks" in text
    assert "classes per batch" in text and "chunks per batch" in text and "global shuffle" in text
    assert "displacement" in text and "score" in text


def test_groups_are_measured_when_given() -> None:
    groups = np.repeat([f"clip{i}" for i in range(64)], N // 64)
    plan = plan_epoch(N, K, shuffle="global", seed=0)
    r = report_for_order(plan.items, B, groups=groups, chunk_size=K, shuffle="global")
    assert r.diversity_of("classes") is None
    assert abs(r.diversity_of("groups").score - 1) < 0.03  # type: ignore[union-attr]
    with pytest.raises(InvalidInputError):
        report_for_order(plan.items, B, labels=np.zeros(10))


# -- on a store, through the loader and the CLI ------------------------------------------


@pytest.fixture(scope="module")
def sorted_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store of real photos written in class order (as --keep-order does with class folders)."""
    pytest.importorskip("skimage", reason="sample photos come from scikit-image (the test extra)")
    from carraystore.ingest.sample_data import make_photo_folder

    root = tmp_path_factory.mktemp("shuffle")
    photos = make_photo_folder(root / "p", n=256, size=(16, 16), classes=["astronaut", "coffee", "rocket", "chelsea"])
    out = root / "s.b2nd"
    carraystore.from_directory(photos, out, keep_order=True, chunk_images=8)
    return out


def test_shuffle_report_of_a_store_matches_the_batches_the_loader_serves(sorted_store: Path) -> None:
    with carraystore.open(sorted_store) as store:
        labels = store.labels
        assert labels is not None and np.all(np.diff(labels) >= 0)  # class order
        r = shuffle_report(store, 16, window=2, seed=3, epoch=1)
        with store.batches(16, window=2, seed=3, epoch=1) as it:
            served = it.shuffle_report()
            distinct = [len(np.unique(y)) for _x, y in it if len(y) == 16]
    assert served == r
    assert r.diversity_of("classes").observed == pytest.approx(np.mean(distinct))  # type: ignore[union-attr]
    assert r.window == 2 and r.epoch == 1 and r.length == 256


def test_compare_windows_orders_rows_and_defaults(sorted_store: Path) -> None:
    rows = compare_windows(sorted_store, 16)  # 32 chunks: windows 1, 4, 16, and 32 (the whole store)
    assert [r.shuffle for r in rows] == ["none", "block", "block", "block", "block", "global"]
    assert [r.window for r in rows[1:-1]] == [1, 4, 16, 32]
    chunk_scores = [r.diversity_of("chunks").score for r in rows[1:-1]]  # type: ignore[union-attr]
    assert chunk_scores == sorted(chunk_scores)
    with pytest.raises(InvalidInputError):
        compare_windows(sorted_store, 16, [0])


def test_cli_bench_shuffle_prints_the_trade_off(sorted_store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "shuffle", str(sorted_store), "--batch-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "256 samples in 32 chunks of 8, batches of 16, seed 0, epoch 0" in out
    for row in ("| store order |", "| block shuffle, window 1 |", "| block shuffle, window 16 (default) |"):
        assert row in out
    assert "| global shuffle |" in out and "classes per batch (score)" in out
    assert main(["bench", "shuffle", str(sorted_store), "--batch-size", "16", "--window", "2", "--seed", "5"]) == 0
    again = capsys.readouterr().out
    assert "| block shuffle, window 2 |" in again and "window 16" not in again and "seed 5" in again
    # the same arguments print the same numbers
    assert main(["bench", "shuffle", str(sorted_store), "--batch-size", "16", "--window", "2", "--seed", "5"]) == 0
    assert capsys.readouterr().out == again
    assert main(["bench", "shuffle", str(sorted_store), "--batch-size", "0"]) == 2
    assert "--batch-size" in capsys.readouterr().err
