"""The compiled loops of sparse tables (ps_server.tables.kernels) against the numpy code they replace."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pshard.common.sparse import TableConfig
from pshard.ps_server.tables import kernels, row_optim
from pshard.ps_server.tables.rowhash import IdIndex

# Row counts around the prefetch distance: loops whose look-ahead runs past the end of `rows`.
_SIZES = (0, 1, kernels.AHEAD - 1, kernels.AHEAD, kernels.AHEAD + 1, 300)


def _shift(index: IdIndex) -> int:
    return 64 - (len(index._slots).bit_length() - 1)


def _probed(index: IdIndex, query: np.ndarray) -> np.ndarray:
    """The reference: the row of each id by IdIndex._probe, the numpy probe its inserts use."""
    slot = index._probe(query)
    return np.where(slot >= 0, index._slots[np.maximum(slot, 0)].astype(np.int64) - 1, -1)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(-40, 40), max_size=60), st.lists(st.integers(-40, 40), max_size=60),
       st.lists(st.integers(-60, 60), max_size=80))
def test_lookup_finds_what_the_numpy_probe_finds(inserted: list[int], deleted: list[int],
                                                 queried: list[int]) -> None:
    """Small id ranges make long collision runs, and deletions tombstones that a lookup must pass."""
    index = IdIndex()
    ids = np.unique(np.array(inserted, np.int64))
    rows = index.insert(ids)
    gone = np.isin(ids, deleted)
    index.delete_rows(rows[gone])
    query = np.array([*queried, -(2**63), 2**63 - 1], np.int64)
    out = np.full(len(query), 12345, np.int64)
    kernels.lookup(index._slots, index.ids, query, _shift(index), out)
    np.testing.assert_array_equal(out, _probed(index, query))
    np.testing.assert_array_equal(out[np.isin(query, ids[gone])], -1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(-50, 50), max_size=30), st.lists(st.integers(-50, 50),
                                                                                  max_size=30)), max_size=12))
def test_compiled_inserts_and_deletes_keep_the_index_the_numpy_probe_reads(
        rounds: list[tuple[list[int], list[int]]]) -> None:
    """IdIndex's insert and delete_rows run kernels.insert and kernels.delete: rounds of both, on long
    collision runs full of tombstones, leave every id where the numpy probe finds it, the tombstones
    counted."""
    index, held = IdIndex(), dict[int, int]()
    for added, removed in rounds:
        new = np.setdiff1d(np.array(added, np.int64), np.array(list(held), np.int64))
        for i, r in zip(new.tolist(), index.insert(new).tolist(), strict=True):
            held[i] = r
        gone = [i for i in dict.fromkeys(removed) if i in held]
        index.delete_rows(np.array([held.pop(i) for i in gone], np.int64))
        query = np.arange(-60, 61, dtype=np.int64)
        want = np.array([held.get(i, -1) for i in query.tolist()], np.int64)
        np.testing.assert_array_equal(index.lookup(query), want)
        np.testing.assert_array_equal(_probed(index, query), want)
        assert index._tombs == int((index._slots == -1).sum()) and len(index) == len(held)


def test_lookup_probes_past_a_crowded_home_and_tombstones() -> None:
    """A full-size table: most ids at home, some far along a run, half the run's slots tombstones."""
    rng = np.random.default_rng(3)
    index = IdIndex()
    ids = rng.choice(1 << 62, 200_000, replace=False).astype(np.int64)
    rows = index.insert(ids)
    index.delete_rows(rows[::3])
    query = np.concatenate([ids, rng.integers(-(2**63), 2**63 - 1, 5_000)])
    rng.shuffle(query)
    frozen = query.copy()
    frozen.flags.writeable = False  # as gRPC's bytes arrive
    out = np.empty(len(query), np.int64)
    kernels.lookup(index._slots, index.ids, frozen, _shift(index), out)
    np.testing.assert_array_equal(out, _probed(index, query))
    assert (out >= 0).sum() == len(ids) - len(rows[::3])


@pytest.mark.parametrize("n", _SIZES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gather_touch_is_a_take_and_a_stamp(n: int, dtype: type[np.floating]) -> None:
    rng = np.random.default_rng(n)
    values: np.ndarray = rng.standard_normal((1_000, 7)).astype(dtype)  # 7: a row ends mid cache line
    touch = rng.random(1_000)
    rows = rng.choice(1_000, n, replace=False).astype(np.int64)
    expect_touch = touch.copy()
    expect_touch[rows] = 5.0
    out: np.ndarray = np.full((n, 7), np.nan, dtype)
    kernels.gather_touch(values, touch, rows, 5.0, out)
    np.testing.assert_array_equal(out, values[rows])
    np.testing.assert_array_equal(touch, expect_touch)


def _hard_numbers(rng: np.random.Generator, shape: tuple[int, int], dtype: type) -> np.ndarray:
    """Numbers whose rounding shows any change of operation order: wide exponents, subnormals,
    exact zeros of both signs, and a few NaN and Inf (tables may allow them)."""
    info = np.finfo(dtype)
    a = rng.standard_normal(shape) * np.exp2(rng.integers(-30, 30, shape))
    flat = a.reshape(-1)
    special = np.array([0.0, -0.0, np.nan, np.inf, -np.inf, float(info.tiny) / 4, float(info.max) / 2,
                        1e-30, -1e-30, 3.0, -3.0, float(info.eps)])
    picks = rng.choice(len(flat), min(len(flat), len(special)), replace=False)
    flat[picks] = special[: len(picks)]
    return a.astype(dtype)


def _bits(a: np.ndarray) -> np.ndarray:
    """Bit patterns, every NaN as one (the order of operations, not NaN payloads, is under test)."""
    a = np.where(np.isnan(a), np.nan, a).astype(a.dtype)
    return a.view(np.uint32 if a.dtype == np.float32 else np.uint64)


@pytest.mark.parametrize("n", _SIZES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_in_place_updates_equal_row_optim_bit_for_bit(n: int, dtype: type, optimizer: str) -> None:
    rng = np.random.default_rng(100 + n)
    config = TableConfig("t", 9, dtype=np.dtype(dtype).name, optimizer=optimizer, lr=0.037, eps=1e-7,
                         allow_nonfinite=True)
    values = _hard_numbers(rng, (400, 9), dtype)
    acc = np.abs(_hard_numbers(rng, (400, 9), dtype))
    touch, count = np.zeros(400), rng.integers(0, 5, 400).astype(np.int32)
    rows = rng.choice(400, n, replace=False).astype(np.int64)
    grads = _hard_numbers(rng, (n, 9), dtype)
    grads.flags.writeable = False  # gRPC's bytes are read-only

    state = {"sum": acc[rows].copy()} if optimizer == "adagrad" else {}
    with np.errstate(all="ignore"):  # the hard numbers overflow and make NaN on purpose
        expect_rows = row_optim.apply(config, values[rows].copy(), grads, state, 1, np.empty((n, 9), dtype))
    expect_count = count.copy()
    expect_count[rows] += 1
    expect_values, expect_acc = values.copy(), acc.copy()
    expect_values[rows] = expect_rows
    if optimizer == "adagrad":
        expect_acc[rows] = state["sum"]

    lr, eps = dtype(config.lr), dtype(config.eps)
    sums = acc if optimizer == "adagrad" else values[:0]  # sgd passes sums of no rows
    kernels.push_touch(values, sums, touch, count, rows, grads, lr, eps, 2.5)
    np.testing.assert_array_equal(_bits(values), _bits(expect_values))
    np.testing.assert_array_equal(_bits(acc), _bits(expect_acc))
    np.testing.assert_array_equal(count, expect_count)
    np.testing.assert_array_equal(np.flatnonzero(touch), np.sort(rows))
    assert (touch[rows] == 2.5).all()


def test_warm_compiles_every_kernel_a_request_calls() -> None:
    """After warm(), a table's requests add no compiled signature (a compilation mid-request costs
    a fraction of a second, and would land on the event loop)."""
    from pshard.ps_server.tables.table import SparseTable

    for dtype in kernels.DTYPES:
        kernels.warm(dtype)
    dispatchers = [kernels.lookup, kernels.gather_touch, kernels.push_touch,
                   kernels.ascending, kernels._finite_bits]
    before = [len(d.signatures) for d in dispatchers]
    for optimizer in ("sgd", "adagrad"):
        for dtype in ("float32", "float64"):
            table = SparseTable(TableConfig("w", 4, dtype=dtype, optimizer=optimizer))
            ids = np.frombuffer(np.arange(10, dtype=np.int64).tobytes(), np.int64)  # read-only, as gRPC's
            table.pull(ids, clock=3)  # rows created
            table.pull(ids, clock=4)  # rows found: the compiled gather
            grads = np.frombuffer(np.ones((10, 4), dtype).tobytes(), dtype).reshape(10, 4)
            table.push(ids, grads, clock=5)
            table.push(ids.copy(), np.ones((10, 4), dtype), clock=6)  # a fast path's writable views
            for checked in (ids, ids.copy()):  # what TableHandlers checks before a table sees them
                assert kernels.ascending(checked)
            assert kernels.all_finite(grads) and kernels.all_finite(grads.copy())
    assert [len(d.signatures) for d in dispatchers] == before


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=30) | st.lists(st.integers(-3, 3), max_size=8))
def test_ascending_is_strictly_increasing(ids: list[int]) -> None:
    a = np.array(ids, np.int64)
    assert kernels.ascending(a) == bool((a[1:] > a[:-1]).all())
    a.sort()  # sorted, with repeats kept: a repeat is not ascending
    assert kernels.ascending(a) == (len(set(ids)) == len(ids))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_finite_finds_any_nan_or_inf_and_nothing_else(dtype: type[np.floating]) -> None:
    rng = np.random.default_rng(7)
    info = np.finfo(dtype)
    finite: np.ndarray = rng.standard_normal((33, 5)).astype(dtype)
    finite[0, :3] = [info.max, info.max, float(info.tiny) / 8]  # a sum overflows; a subnormal
    finite[1, 0] = -0.0
    assert kernels.all_finite(finite)
    for bad in (np.nan, np.inf, -np.inf):
        for where in ((0, 0), (16, 2), (32, 4)):  # first, middle and last number
            grads = finite.copy()
            grads[where] = bad
            grads.flags.writeable = False
            assert not kernels.all_finite(grads)
    assert kernels.all_finite(np.zeros((0, 5), dtype))


def test_without_a_writable_cache_directory_the_kernels_compile_in_the_process() -> None:
    """numba refuses to decorate a cached function when no cache directory is writable (a read-only root
    file system: Kubernetes' readOnlyRootFilesystem). The kernels then compile uncached, with a warning.
    NUMBA_CACHE_LOCATOR_CLASSES=IPythonCacheLocator leaves numba only a locator that finds nothing for a
    file, which is what a read-only system gives it."""
    import os
    import subprocess
    import sys

    code = ("import logging, numpy as np; logging.basicConfig()\n"
            "from pshard.common.sparse import TableConfig\n"
            "from pshard.ps_server.tables.table import SparseTable\n"
            "table = SparseTable(TableConfig('t', 4, initializer='zeros'))\n"
            "table.push(np.arange(3, dtype=np.int64), np.ones((3, 4), np.float32))\n"
            "print(table.pull(np.arange(3, dtype=np.int64)).sum())\n")
    env = {**os.environ, "NUMBA_CACHE_LOCATOR_CLASSES": "IPythonCacheLocator"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert abs(float(done.stdout) + 0.12) < 1e-6  # SGD, lr 0.01: 12 numbers from 0 by -0.01 each
    assert "numba has no cache directory it may write" in done.stderr
