"""Several batches in flight (carraystore.engine.pipeline), the memory budget, and what the process may use
(carraystore.base.resources): on real photos."""

from __future__ import annotations

import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from helpers import make_store

import carraystore
from carraystore.base.errors import InvalidInputError, LoaderError
from carraystore.base.resources import available_cpus, format_bytes, memory_limit, parse_bytes
from carraystore.engine.decoder import EpochDecoder
from carraystore.engine.loader import batches
from carraystore.engine.options import LoaderOptions, default_threads
from carraystore.engine.pipeline import MAX_ASSEMBLERS, assemblers_for
from carraystore.engine.spec import make_spec
from carraystore.ingest.sample_data import PHOTOS, load_photo, photo_crops

N = 600


@pytest.fixture(scope="module")
def store_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """600 real 48x48 photo crops, 16 per chunk (38 chunks): many windows of window=4."""
    rng = np.random.default_rng(3)
    x = np.concatenate([np.stack(photo_crops(load_photo(p), N // 4, (48, 48), rng)) for p in PHOTOS[:4]])
    return make_store(tmp_path_factory.mktemp("pipeline") / "photos.b2nd", x, np.arange(N) % 7, chunk_images=16)


pytestmark = pytest.mark.usefixtures("no_loader_threads_left")


def _epoch(path: Path, **kw) -> list[tuple[np.ndarray, np.ndarray]]:
    with batches(carraystore.open(path), 32, **kw) as it:
        return [(x.copy(), y.copy()) for x, y in it]


# -- resources -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text,expected",
    [("2GB", 2 * 10**9), ("512MiB", 512 << 20), ("1.5g", 1_500_000_000), (" 64 kB ", 64_000), ("100", 100)],
)
def test_parse_bytes_reads_sizes(text: str, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "2 parsecs", "-1GB", "0", 0, -5, 1.5, True, None])
def test_parse_bytes_names_what_it_takes(bad: object) -> None:
    with pytest.raises(InvalidInputError, match="memory_budget"):
        parse_bytes(bad, "memory_budget")  # type: ignore[arg-type]


def test_cpus_follow_the_cgroup_quota_and_the_affinity_mask(tmp_path: Path) -> None:
    mask = len(__import__("os").sched_getaffinity(0))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert available_cpus(tmp_path) == mask
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # docker --cpus=1.5
    assert available_cpus(tmp_path) == min(mask, 2)
    (tmp_path / "cpu.max").write_text("50000 100000\n")
    assert available_cpus(tmp_path) == 1
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert available_cpus(v1) == mask
    assert default_threads() == max(2, available_cpus())


def test_memory_limit_is_the_cgroup_limit_when_lower(tmp_path: Path) -> None:
    ram = memory_limit(tmp_path / "none")
    assert ram > 0
    (tmp_path / "memory.max").write_text("max\n")
    assert memory_limit(tmp_path) == ram
    (tmp_path / "memory.max").write_text(f"{256 << 20}\n")
    assert memory_limit(tmp_path) == 256 << 20
    assert LoaderOptions().memory_budget == memory_limit() // 4


# -- several batches in flight ---------------------------------------------------------------------


def test_assemblers_grow_with_threads_and_stay_one_with_a_transform(store_path: Path) -> None:
    store = carraystore.open(store_path)
    assert assemblers_for(make_spec(store, 32, num_threads=2)) == 1
    assert assemblers_for(make_spec(store, 32, num_threads=8)) == 2
    assert assemblers_for(make_spec(store, 32, num_threads=64)) == MAX_ASSEMBLERS
    assert assemblers_for(make_spec(store, 32, num_threads=64, transform=lambda x, y: (x, y))) == 1


def test_many_assemblers_give_the_same_batches_in_the_same_order_each_window_decoded_once(store_path: Path) -> None:
    one = _epoch(store_path, num_threads=1, window=4, seed=2)
    store = carraystore.open(store_path)
    with batches(store, 32, num_threads=16, window=4, seed=2, queue_size=3) as it:
        assert it.memory.assemblers == 4
        assert len([t for t in it.threads if "assemble" in t.name]) == 4
        many = [(x.copy(), y.copy()) for x, y in it]
        counts = it._s.decoder.decode_count
    assert len(many) == len(one) == -(-N // 32)
    for (xa, ya), (xb, yb) in zip(one, many, strict=True):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
    assert set(counts.values()) == {1}, f"windows decoded more than once: {counts}"


def _one_window_decoder(store_path: Path) -> tuple[EpochDecoder, int]:
    """A decoder over ordered windows of 4 chunks, with slots for one window only, and the
    first window of at least two batches (their thread may be slow to ask for them)."""
    spec = make_spec(carraystore.open(store_path), 32, shuffle=False, window=4)
    plan = spec.plan(0)
    dec = EpochDecoder(spec, 0, plan.max_window_chunks, 2, "test-pipeline", direct=False, plan=plan)
    v = next(v for v in range(plan.nwindows) if len(dec._batches_of(v)) >= 2)
    return dec, v


def _wait_for_a_waiter(dec: EpochDecoder, t: threading.Thread) -> None:
    """Until ``t`` waits on the decoder (for slots), or has finished without waiting."""
    deadline = time.monotonic() + 10
    while not dec.cond._waiters and t.is_alive():  # type: ignore[attr-defined]
        assert time.monotonic() < deadline, "the thread neither waited nor finished"
        time.sleep(0.005)


def test_a_window_a_slow_thread_took_a_batch_of_is_not_evicted_for_later_batches(store_path: Path) -> None:
    """An assembler that took a batch but was preempted before asking for it (no pin yet):
    a thread with a later batch waits for it instead of evicting its window (decoded twice)."""
    dec, v = _one_window_decoder(store_path)
    try:
        first, second = dec._batches_of(v)[:2]
        later = dec._batches_of(v)[-1] + 1  # drawn (at least partly) from the next window
        for b in range(first + 1):
            dec.batch(b)  # window v is resident, its batch ``second`` still to come
        dec.claim(second)  # taken on by a thread that has not asked yet
        t = threading.Thread(target=dec.batch, args=(later,))
        t.start()
        _wait_for_a_waiter(dec, t)  # the later batch waits for slots
        time.sleep(0.1)
        dec.batch(second)
        t.join(10)
        assert not t.is_alive()
        assert dec.decode_count[v] == 1, dec.decode_count
        assert not dec.claimed
    finally:
        dec.close()


def test_a_window_started_while_a_batch_waited_for_its_slots_is_decoded_once(store_path: Path) -> None:
    """A batch waiting for slots for window w while read-ahead started w meanwhile takes
    that window instead of starting (decoding, counting) it a second time."""
    dec, v = _one_window_decoder(store_path)
    try:
        for b in range(dec._batches_of(v)[0]):
            dec.batch(b)
        win = dec._acquire(v)  # window v pinned: no slot is free for v + 1
        t = threading.Thread(target=dec._acquire, args=(v + 1,))
        t.start()
        _wait_for_a_waiter(dec, t)
        with dec.cond:  # v served and finished; read-ahead takes its slots for v + 1 first
            win.pins -= 1
            win.unserved.clear()
            dec.finished.add(v)
            dec._changes += 1  # (as _release counts a window finished: read-ahead tries again)
            dec.read_ahead(v + 1)
        t.join(10)
        assert not t.is_alive()
        assert dec.decode_count[v + 1] == 1, dec.decode_count
    finally:
        dec.close()


def test_read_ahead_starts_the_next_window_once_a_served_one_frees_its_slots(store_path: Path) -> None:
    """Read-ahead that found no room does not try again until a slot is freed or a window
    finishes; when the last batch of a window is served, it starts the window after next."""
    spec = make_spec(carraystore.open(store_path), 32, shuffle=False, window=4)
    plan = spec.plan(0)
    v = next(v for v in range(plan.nwindows - 2) if len(plan.window_chunks[v]) == len(plan.window_chunks[v + 2]) == 4)
    dec = EpochDecoder(spec, 0, 8, 1, "test-pipeline", direct=False, plan=plan)  # slots for two windows
    try:
        batches_of_v = list(dec._batches_of(v))
        for b in range(batches_of_v[0]):
            dec.batch(b)
        dec.read_ahead(v)
        assert {v, v + 1} <= set(dec.windows) and v + 2 not in dec.windows  # no room for v + 2
        for b in batches_of_v[:-1]:  # window v still has a batch to serve: no room yet
            dec.batch(b)
            assert v + 2 not in dec.windows and dec.decode_count.get(v + 2) is None
        dec.batch(batches_of_v[-1])  # v served: its slots go to v + 2, decoded ahead
        assert v + 2 in dec.windows and dec.decode_count[v + 2] == 1, dec.decode_count
        dec.windows[v + 2].done.wait(10)
        for b in range(batches_of_v[-1] + 1, plan.batches_of(v + 2, 32)[-1] + 1):
            dec.batch(b)
        assert set(dec.decode_count.values()) == {1}, dec.decode_count
    finally:
        dec.close()


def test_a_failed_batch_reaches_the_consumer_in_its_place(store_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from carraystore.engine.decoder import EpochDecoder

    real = EpochDecoder.batch

    def failing(self: EpochDecoder, i: int, out: np.ndarray | None = None):  # type: ignore[no-untyped-def]
        if i == 5:
            raise OSError("disk went away")
        return real(self, i, out)

    monkeypatch.setattr(EpochDecoder, "batch", failing)
    got = 0
    with pytest.raises(LoaderError, match="disk went away"):  # noqa: PT012
        for _ in batches(carraystore.open(store_path), 32, num_threads=16, window=4):
            got += 1
    assert got == 5, "every batch before the failed one arrives, in order"


# -- the memory budget ------------------------------------------------------------------------------


def test_the_budget_shrinks_prefetch_and_the_loader_keeps_it(store_path: Path) -> None:
    store = carraystore.open(store_path)
    slot = store.chunk_images * store.meta.image_nbytes
    batch = 32 * store.meta.image_nbytes
    free = _epoch(store_path, window=4, seed=1)
    with batches(store, 32, window=4, seed=1) as it:
        assert it.memory.slots == 8  # window + prefetch (default: one window)
    budget = 5 * slot + 5 * batch  # one window and a slot over; the queue (2), an assembler's and 2 spare buffers
    tracemalloc.start()
    try:
        with batches(store, 32, window=4, seed=1, memory_budget=budget, verify=False) as it:
            m = it.memory
            base = tracemalloc.get_traced_memory()[0]
            got = [(x.copy(), y.copy()) for x, y in it]
            peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert m.budget == budget and m.held <= budget
    assert m.slots == 5 and m.assemblers == 1, m
    # the order is the options', never the budget's
    for (xa, ya), (xb, yb) in zip(free, got, strict=True):
        np.testing.assert_array_equal(xa, xb)
        np.testing.assert_array_equal(ya, yb)
    # what numpy allocated while the loader ran: its plan, the copies this test keeps, a little slack
    kept = sum(x.nbytes + y.nbytes for x, y in got)
    assert peak - base <= m.held + kept + (2 << 20), (format_bytes(peak - base), m.describe())


def test_a_budget_below_one_window_is_refused_with_what_to_lower(store_path: Path) -> None:
    store = carraystore.open(store_path)
    with pytest.raises(InvalidInputError, match=r"memory_budget=.*too small.*lower window="):
        batches(store, 32, window=8, memory_budget="100kB")
    with pytest.raises(InvalidInputError, match="memory_budget"):
        batches(store, 32, shuffle="global", memory_budget="1MB")  # the whole store is one window


def test_a_tight_budget_gives_up_assemblers_before_failing(store_path: Path) -> None:
    store = carraystore.open(store_path)
    slot = store.chunk_images * store.meta.image_nbytes
    batch = 32 * store.meta.image_nbytes
    roomy = batches(store, 32, window=4, num_threads=16)
    assert roomy.memory.assemblers == 4 and roomy.memory.slots >= 8
    roomy.close()
    # with 4 assemblers (8 buffers) only 4 slots are left: not enough for the windows of 4
    # batches under way; with one assembler (5 buffers) 10 are, of which it wants 8
    tight = batches(store, 32, window=4, num_threads=16, memory_budget=4 * slot + 8 * batch)
    assert (tight.memory.assemblers, tight.memory.slots, tight.memory.batch_buffers) == (1, 8, 5)
    assert tight.memory.held <= tight.memory.budget
    assert sum(len(x) for x, _ in tight) == N


def test_image_by_image_decompression_only_up_to_four_threads(tmp_path: Path) -> None:
    """Direct mode (each image decompressed into its batch) stopped scaling past 4 threads on
    16 cores (bench/results/device/probe.log): more threads decode whole chunks instead."""
    from carraystore.engine.decoder import DIRECT_MAX_THREADS
    from carraystore.format import blocks

    if not blocks.available():
        pytest.skip("c-blosc2's getitem is not reachable here")
    rng = np.random.default_rng(1)
    x = np.stack(photo_crops(load_photo(PHOTOS[0]), 24, (160, 160), rng))  # 76.8 kB images
    path = tmp_path / "fast.b2nd"
    with carraystore.create(path, (160, 160, 3), codec="fast", chunk_images=8) as w:
        w.append(x, np.arange(24) % 3)
    got = {}
    for t in (1, 2, DIRECT_MAX_THREADS, DIRECT_MAX_THREADS + 1, 16):
        with batches(carraystore.open(path), 5, num_threads=t, seed=3) as it:
            got[t] = ([b[0].copy() for b in it], it._s.decoder.direct)
            # direct mode: one assembler per thread, each making whole batches
            assert it.memory.assemblers == (t if t <= DIRECT_MAX_THREADS else max(1, min(4, -(-t // 4))))
    assert [got[t][1] for t in got] == [True, True, True, False, False]
    # a batch made alone (one assembler with a transform) is cut into parts the decoder threads help with
    store = carraystore.open(path)
    for kw in ({"num_threads": 1}, {"num_threads": 2, "transform": lambda x, y: (x, y)}):
        with batches(store, 16, seed=3, **kw) as it:
            assert it.memory.assemblers == 1 and it._s.decoder.direct
            for i, (x, _) in enumerate(it):
                np.testing.assert_array_equal(x, store.take(it.plan.samples(16 * i, 16 * (i + 1))))
    for t in got:
        assert len(got[t][0]) == len(got[1][0])
        for a, b in zip(got[1][0], got[t][0], strict=True):
            np.testing.assert_array_equal(a, b)
