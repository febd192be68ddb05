"""ReclaimSchedule fires once per multiple crossed, however far the count jumps."""

import random

import mlx.core as mx
import pytest

from mlx_stream.cache import reclaim
from mlx_stream.cache.reclaim import MemorySnapshot, ReclaimSchedule, memory_snapshot


def _fires(schedule: ReclaimSchedule, steps: list[int]) -> tuple[list[int], int]:
    """Walk a count by ``steps``; return the counts where it fired and the final count."""
    count, fired = 0, []
    for s in steps:
        if schedule.due(count, count + s):
            fired.append(count + s)
        count += s
    return fired, count


@pytest.mark.parametrize("jump", [1, 3, 5, 7])
def test_crossing_fires_once_per_multiple_for_fixed_jumps(jump):
    schedule = ReclaimSchedule(every=256)
    fired, count = _fires(schedule, [jump] * 2000)
    assert len(fired) == count // 256
    # The k-th firing is the first count at or past k * 256.
    assert [f // 256 for f in fired] == list(range(1, count // 256 + 1))
    assert all(f - 256 * (f // 256) < jump for f in fired)


@pytest.mark.parametrize("every", [300, 512])
def test_crossing_fires_once_per_multiple_for_random_jumps(every):
    rng = random.Random(every)
    steps = [rng.randint(1, 300) for _ in range(5000)]
    fired, count = _fires(ReclaimSchedule(every=every), steps)
    # Jumps never exceed ``every``, so each multiple is crossed by exactly one step.
    assert len(fired) == count // every
    assert [f // every for f in fired] == list(range(1, count // every + 1))


def test_crossing_fires_once_for_a_jump_over_several_multiples():
    schedule = ReclaimSchedule(every=64)
    assert schedule.due(10, 300)  # four multiples crossed, one reclaim is enough
    assert not schedule.due(300, 319)
    assert schedule.due(319, 320)


def test_crossing_never_misses_a_step_that_crosses():
    rng = random.Random(1)
    schedule = ReclaimSchedule(every=256)
    count = 0
    for _ in range(5000):
        new = count + rng.randint(1, 300)
        assert schedule.due(count, new) == (new // 256 > count // 256)
        count = new


def test_every_one_fires_every_step():
    fired, count = _fires(ReclaimSchedule(every=1), [1] * 100 + [4] * 10)
    assert len(fired) == 110 and count == 140


def test_exact_mode_misses_multiples_under_jumps_of_three():
    fired, count = _fires(ReclaimSchedule(every=256, mode="exact"), [3] * 2000)
    # Only multiples of 3 * 256 are landed on.
    assert len(fired) == count // (3 * 256)
    assert len(fired) < count // 256 / 2


def test_none_mode_never_fires():
    fired, _ = _fires(ReclaimSchedule(mode="none"), [1] * 1000)
    assert fired == []


def test_step_clears_the_pool_and_counts():
    schedule = ReclaimSchedule(every=4)
    a = mx.ones((1024, 1024))
    mx.eval(a)
    del a
    assert mx.get_cache_memory() > 0
    assert not schedule.step(0, 3)
    assert mx.get_cache_memory() > 0
    assert schedule.step(3, 6)
    assert mx.get_cache_memory() == 0
    assert schedule.reclaims == 1
    assert schedule.reclaimed_bytes >= 4 * 1024 * 1024


def test_memory_snapshot_reads_counters_on_cpu():
    reclaim.reset_peak()
    a = mx.ones((256, 1024))
    mx.eval(a)
    snap = memory_snapshot()
    assert isinstance(snap, MemorySnapshot)
    assert snap.active >= a.nbytes
    assert snap.peak >= snap.active


def test_set_wired_limit_does_nothing_without_metal(monkeypatch):
    def boom(limit):
        raise AssertionError("set_wired_limit must not be called without Metal")

    monkeypatch.setattr(mx.metal, "is_available", lambda: False)
    monkeypatch.setattr(mx, "set_wired_limit", boom)
    assert reclaim.set_wired_limit() is None
    assert reclaim.set_wired_limit(1 << 30) is None
