"""A slice's update split over threads (pshard.common.chunks, ps_server.core.chunked): the same bits.

The pools here cut even small slices (min_chunk of a few hundred elements, unaligned lengths), so
every chunk boundary and the uneven last chunk are exercised on arrays a test can afford.
"""

from __future__ import annotations

import itertools
import threading

import numpy as np
import pytest
from pshard.common.chunks import ChunkPool, configure_shared_pool, default_threads, shared_pool, split
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.types import SliceKey, Stamp
from pshard.ps_server.core import chunked
from pshard.ps_server.core.optimizers import SGD, make_optimizer
from pshard.ps_server.core.store import ShardStore

from tests.unit.test_optimizers import CONFIGS

SHAPE = (37, 101)  # 3,737 elements: chunks of 1,280 (aligned to 64) and an uneven tail


@pytest.fixture
def pool():
    p = ChunkPool(3, min_chunk=500)
    yield p
    p.close()


def test_split_covers_every_element_once_in_aligned_chunks():
    cases = [(3737, 3, 500), (10, 4, 1), (1 << 20, 8, 128 * 1024), (100, 8, 1000), (0, 3, 1)]
    for n, parts, min_chunk in cases:
        ranges = split(n, parts, min_chunk)
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        assert len(ranges) <= max(1, parts)
        assert all(lo % 64 == 0 for lo, _ in ranges)
    assert len(split(3737, 3, 500)) == 3
    assert split(1000, 8, 1000) == [(0, 1000)]  # too small to be worth a thread


def test_splits_answers_whether_ranges_cuts_without_cutting_the_small_ones():
    for threads, min_chunk in [(1, 500), (3, 500), (8, 1), (2, 64), (4, 128 * 1024)]:
        pool = ChunkPool(threads, min_chunk=min_chunk)
        try:
            for n in [0, 1, 2, 63, 64, 65, 127, 128, 129, 999, 1000, 1001, 1500, 3737, 1 << 20]:
                for chunk in (None, 1, 64, 1000):
                    cut = len(pool.ranges(n, chunk)) > 1
                    assert pool.splits(n, chunk) == cut, (threads, min_chunk, n, chunk)
        finally:
            pool.close()


def test_default_threads_is_half_the_cores_within_1_to_8():
    assert [default_threads(c) for c in (1, 2, 3, 16, 64)] == [1, 1, 1, 8, 8]
    with pytest.raises(ValueError, match="threads: got 0"):
        ChunkPool(0)
    with pytest.raises(ValueError, match="threads: got -1"):
        configure_shared_pool(-1)


def test_the_shared_pool_is_sized_once_by_configure():
    before = shared_pool().threads
    try:
        assert configure_shared_pool(3).threads == 3
        assert shared_pool() is configure_shared_pool(3)  # the same size again keeps the pool
    finally:
        configure_shared_pool(before)


def test_run_uses_the_helper_threads_and_raises_a_chunks_error(pool):
    seen: list[tuple[int, int, str]] = []
    pool.run(lambda lo, hi: seen.append((lo, hi, threading.current_thread().name)), 3737)
    assert sorted((lo, hi) for lo, hi, _ in seen) == split(3737, 3, 500)
    assert any(name.startswith("pshard-chunks") for *_, name in seen)

    def fail(lo: int, hi: int) -> None:
        if lo > 0:
            raise ValueError(f"chunk at {lo}")

    with pytest.raises(ValueError, match="chunk at"):
        pool.run(fail, 3737)


def test_copy_is_np_copyto(pool):
    src = np.arange(3737, dtype=np.float64).reshape(SHAPE)
    dst = np.zeros(SHAPE, dtype=np.float32)
    pool.copy(dst, src)
    assert np.array_equal(dst, src.astype(np.float32))
    with pytest.raises(ValueError, match="destination has 3 elements, source 3737"):
        pool.copy(np.zeros(3), src)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("config", CONFIGS, ids=str)
def test_a_chunked_step_equals_the_whole_step_bit_for_bit(pool, config, dtype):
    rng = np.random.default_rng(7)
    optimizer = make_optimizer(config)
    whole = rng.standard_normal(SHAPE).astype(dtype)
    split_value = whole.copy()
    whole_state, split_state = optimizer.init_state(whole), optimizer.init_state(split_value)
    for _ in range(4):  # the first step of momentum and Adam differs from the later ones
        grad = rng.standard_normal(SHAPE).astype(dtype)
        optimizer.step(whole, grad, whole_state)
        chunked.step(pool, optimizer, split_value, grad, split_state)
    assert whole.tobytes() == split_value.tobytes()
    assert whole_state.keys() == split_state.keys()
    for key, value in whole_state.items():
        if isinstance(value, np.ndarray):
            assert value.tobytes() == split_state[key].tobytes(), key  # type: ignore[union-attr]
        else:
            assert split_state[key] == value, key


def test_chunked_sums_and_the_folded_sgd_step_equal_numpy(pool):
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3)]
    total = np.empty(SHAPE, np.float32)
    for i, grad in enumerate(grads):
        chunked.accumulate(pool, total, grad, first=i == 0)
    expected = grads[0].copy()
    expected += grads[1]
    expected += grads[2]
    assert total.tobytes() == expected.tobytes()
    value = rng.standard_normal(SHAPE).astype(np.float32)
    want = value.copy()
    sgd = SGD(OptimizerConfig(name="sgd", lr=0.1))
    sgd.step_scaled(want, expected.copy(), 1 / 3)
    chunked.step_scaled(pool, sgd, value, total.copy(), 1 / 3)
    assert value.tobytes() == want.tobytes()
    chunked.divide(pool, total, 3)
    expected /= 3
    assert total.tobytes() == expected.tobytes()


def test_a_store_on_a_pool_trains_as_one_on_a_single_thread(pool):
    """Sync mode, 2 workers (the summed path), SGD with momentum: the same values after 3 clocks."""
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.05, momentum=0.9))
    rng = np.random.default_rng(11)
    start = rng.standard_normal(SHAPE).astype(np.float32)
    key = SliceKey("w", 0)
    stores = [ShardStore(job, quorum={"a": 0, "b": 0}, pool=p) for p in (ChunkPool(1), pool)]
    for store in stores:
        store.declare([(key, start)])
    for clock in range(3):
        grads = {w: rng.standard_normal(SHAPE).astype(np.float32) for w in "ab"}
        for store in stores:
            for worker, grad in grads.items():
                store.push(Stamp(worker, 0, clock), {key: grad})
    (one, v1), = stores[0].read([key])
    (many, v2), = stores[1].read([key])
    assert v1 == v2 == 3
    assert one.tobytes() == many.tobytes()
    assert not np.array_equal(one, start)


def test_the_server_flag_sizes_its_update_pool():
    from pshard.ps_server.__main__ import _settings, build_parser

    assert _settings(build_parser().parse_args(["--update-threads", "3"])).update_threads == 3
    assert _settings(build_parser().parse_args([])).update_threads == 1  # opt-in: 0 = half the cores


def test_a_process_that_configures_nothing_works_on_one_thread():
    import pshard.common.chunks as chunks

    saved = chunks._shared
    chunks._shared = None
    try:
        assert shared_pool().threads == 1
    finally:
        chunks._shared = saved
