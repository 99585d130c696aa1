"""Sparse tables' pure core: parity with torch's sparse optimizers, admission, TTL, LRU/LFU, placement."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pshard.client.tables import _FEW_RUNS, _Split
from pshard.common.errors import InvalidArgumentError
from pshard.common.sparse import TableConfig, mix64, server_of
from pshard.ps_server.tables.table import SparseTable, initial_rows

N_IDS, DIM, STEPS = 30, 6, 50


def _coalesce(ids: np.ndarray, grads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the client does before a push: distinct ids, their gradients summed."""
    uniq, inverse = np.unique(ids, return_inverse=True)
    summed = np.zeros((len(uniq), grads.shape[1]), grads.dtype)
    np.add.at(summed, inverse, grads)
    return uniq, summed


def _torch_optimizer(name: str, params: list[torch.Tensor], config: TableConfig) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=config.lr)
    if name == "adagrad":
        return torch.optim.Adagrad(params, lr=config.lr, eps=config.eps,
                                   initial_accumulator_value=config.initial_accumulator_value)
    return torch.optim.SparseAdam(params, lr=config.lr, betas=config.betas, eps=config.eps)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam", "lazy_adam"])
def test_matches_torch_sparse_optimizers_over_50_steps_with_duplicates(optimizer: str) -> None:
    config = TableConfig("emb", DIM, initializer="normal", init_scale=0.5, optimizer=optimizer, lr=0.05,
                         initial_accumulator_value=0.1)
    table = SparseTable(config)
    all_ids = np.arange(N_IDS, dtype=np.int64) * 7919 - 100  # any int64s, negative ones too
    init = initial_rows(config, all_ids)
    # lazy_adam's reference: one SparseAdam per row, so each row counts its own steps.
    per_row = optimizer == "lazy_adam"
    embs = [torch.nn.Embedding(1 if per_row else N_IDS, DIM, sparse=True)
            for _ in range(N_IDS if per_row else 1)]
    for i, emb in enumerate(embs):
        emb.weight.data = torch.from_numpy(init[i:i + 1].copy() if per_row else init.copy())
    opts = [_torch_optimizer(optimizer, list(e.parameters()), config) for e in embs]
    rng = np.random.default_rng(1)
    for _ in range(STEPS):
        pos = rng.integers(0, N_IDS, 24)  # positions in all_ids, with repeats
        weights = torch.from_numpy(rng.normal(size=(24, DIM)).astype(np.float32))
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        if per_row:
            for k, emb in enumerate(embs):
                sel = np.flatnonzero(pos == k)
                if len(sel):
                    (emb(torch.zeros(len(sel), dtype=torch.long)) * weights[sel]).sum().backward()
                    opts[k].step()
        else:
            (embs[0](torch.from_numpy(pos)) * weights).sum().backward()
            opts[0].step()
        ids, grads = _coalesce(all_ids[pos], weights.numpy())
        table.push(ids, grads)
    expected = np.concatenate([e.weight.detach().numpy() for e in embs])
    np.testing.assert_allclose(table.pull(all_ids), expected, rtol=1e-6, atol=1e-7)
    assert not np.allclose(expected, init)  # training moved the rows


def test_initial_rows_are_a_function_of_table_id_and_seed_only() -> None:
    config = TableConfig("a", 16, initializer="uniform", init_scale=0.1, seed=3)
    ids = np.array([0, 1, -1, 2**63 - 1, -(2**63)], np.int64)
    first = initial_rows(config, ids)
    np.testing.assert_array_equal(first[::-1], initial_rows(config, ids[::-1]))
    np.testing.assert_array_equal(first, SparseTable(config).pull(ids))
    assert np.abs(first).max() <= 0.1 and len(np.unique(first)) == first.size
    assert not np.array_equal(first, initial_rows(TableConfig("a", 16, init_scale=0.1, seed=4), ids))
    assert not np.array_equal(first, initial_rows(TableConfig("b", 16, init_scale=0.1, seed=3), ids))


def test_placement_spreads_ids_evenly_and_moves_few_when_a_server_joins() -> None:
    ids = np.arange(0, 300_000, 3, dtype=np.int64)  # multiples of n: id % n would put all on one server
    three, four = server_of(ids, 3), server_of(ids, 4)
    assert np.bincount(three).min() > 0.3 * len(ids)
    moved = three != four
    assert (four[moved] == 3).all() and 0.2 < moved.mean() < 0.3


def _jump_reference(key: int, n: int) -> int:
    """Lamport & Veach's jump consistent hash, one id at a time in Python integers and floats."""
    bucket, jump = -1, 0
    while jump < n:
        bucket = jump
        key = (key * 2862933555777941757 + 1) % 2**64
        jump = int((bucket + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return max(bucket, 0)


def test_placement_is_the_jump_hash_of_each_id() -> None:
    # Placement is a contract between every client and server: the vectorised rounds (compacted to
    # the ids still jumping) must land each id where the one-at-a-time algorithm does.
    rng = np.random.default_rng(5)
    ids = np.concatenate([rng.integers(-(2**63), 2**63 - 1, 600, dtype=np.int64),
                          np.arange(-50, 50, dtype=np.int64), [2**63 - 1, -(2**63)]])
    keys = [int(k) for k in mix64(ids.view(np.uint64))]
    for n in [*range(1, 12), 17, 64, 1000]:
        expected = [_jump_reference(k, n) for k in keys]
        np.testing.assert_array_equal(server_of(ids, n), expected, err_msg=f"{n} servers")
    assert server_of(np.zeros(0, np.int64), 3).shape == (0,)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_client_sums_the_gradients_of_repeated_ids_in_call_order(dtype: type) -> None:
    # Zipf ids: hundreds of short runs (summed a row per round) and a few runs of hundreds of
    # repeats (summed whole); each id's sum is its gradients added one after another, in call order.
    rng = np.random.default_rng(2)
    ids = ((rng.zipf(1.1, 4096) - 1) % 100_000).astype(np.int64)
    counts = np.unique(ids, return_counts=True)[1]
    assert (counts > 1).sum() > 4 * _FEW_RUNS and (counts > 100).any()
    grads: np.ndarray = rng.standard_normal((4096, 5)).astype(dtype)
    split = _Split(ids, 3)
    summed = split.coalesce(grads, np.empty((len(split.ids), 5), dtype))
    position = {int(i): k for k, i in enumerate(split.ids)}
    expected = np.zeros_like(summed)
    for p, i in enumerate(ids.tolist()):
        expected[position[i]] += grads[p]
    np.testing.assert_array_equal(summed, expected)


def test_admission_counts_pushes_until_the_nth_sighting() -> None:
    config = TableConfig("t", 4, optimizer="sgd", lr=1.0, admit_after=3)
    table = SparseTable(config)
    ids = np.array([10, 20], np.int64)
    init = initial_rows(config, ids)
    ones = np.ones((2, 4), np.float32)
    for _ in range(2):
        assert table.push(ids, ones) == 0
        np.testing.assert_array_equal(table.pull(ids), init)
        assert len(table) == 0
    assert table.push(ids[:1], ones[:1]) == 1  # the third sighting of id 10 admits and applies it
    np.testing.assert_array_equal(table.pull(ids), np.stack([init[0] - 1, init[1]]))
    assert len(table) == 1


@pytest.mark.parametrize("initializer", ["normal", "zeros"])
def test_pulls_of_ids_without_rows_return_initial_values_and_create_nothing(initializer: str) -> None:
    config = TableConfig("t", 3, optimizer="sgd", lr=1.0, initializer=initializer, seed=7, max_rows=4)
    table = SparseTable(config)
    table.push(np.array([1], np.int64), np.ones((1, 3), np.float32))
    ids = np.array([1, 5, 9, 2**40], np.int64)
    before = (len(table), table.admitted, table.evicted, table.index.row_capacity)
    for _ in range(3):  # a repeated read is still a read
        rows = table.pull(ids)
        np.testing.assert_array_equal(rows[1:], initial_rows(config, ids[1:]))
        np.testing.assert_array_equal(rows[0], initial_rows(config, ids[:1])[0] - 1)
    assert (len(table), table.admitted, table.evicted, table.index.row_capacity) == before
    # A pull of many new ids neither grows the arrays nor evicts the one row (max_rows=4).
    table.pull(np.arange(10, 100_010, dtype=np.int64))
    assert (len(table), table.admitted, table.evicted, len(table.values)) == (1, 1, 0, before[3])
    # A push then starts from the value the pull returned.
    table.push(ids[1:2], np.ones((1, 3), np.float32))
    np.testing.assert_array_equal(table.pull(ids[1:2]), initial_rows(config, ids[1:2]) - 1)


def test_probability_admission_is_seeded() -> None:
    def admitted(seed: int) -> int:
        table = SparseTable(TableConfig("t", 2, admit_prob=0.25, seed=seed))
        table.push(np.arange(4000, dtype=np.int64), np.zeros((4000, 2), np.float32))
        return len(table)

    assert admitted(1) == admitted(1)
    assert 800 < admitted(1) < 1200


def test_ttl_in_clocks_evicts_rows_not_touched_for_t_clocks() -> None:
    evicted: list[np.ndarray] = []
    table = SparseTable(TableConfig("t", 2, lr=1.0, ttl=3), on_evict=evicted.append)
    one = np.ones((1, 2), np.float32)
    table.push(np.array([1], np.int64), one, clock=1)
    table.push(np.array([2], np.int64), one, clock=4)
    assert len(table) == 2  # id 1 is 3 clocks old: still there
    table.push(np.array([2], np.int64), one, clock=5)
    assert len(table) == 1 and table.evicted == 1 and np.concatenate(evicted).tolist() == [1]
    init = initial_rows(table.config, np.array([1], np.int64))
    np.testing.assert_array_equal(table.pull(np.array([1], np.int64), clock=5), init)  # a fresh row


def test_ttl_in_seconds_uses_the_injected_clock() -> None:
    now = [100.0]
    table = SparseTable(TableConfig("t", 2, ttl=10, ttl_unit="seconds"), now=lambda: now[0])
    table.push(np.array([1, 2], np.int64), np.zeros((2, 2), np.float32))
    now[0] = 105.0
    table.pull(np.array([2], np.int64))  # a read of a row touches it
    now[0] = 112.0
    table.push(np.array([3], np.int64), np.zeros((1, 2), np.float32))
    assert sorted(table.index.ids[table.index.live_rows()].tolist()) == [2, 3]


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_row_cap_evicts_by_policy(policy: str) -> None:
    evicted: list[np.ndarray] = []
    table = SparseTable(TableConfig("t", 2, max_rows=3, cap_policy=policy), on_evict=evicted.append)
    g = np.zeros((1, 2), np.float32)
    for clock, i in enumerate([1, 1, 1, 2, 2, 3]):  # counts 1:3, 2:2, 3:1; last touch 3 > 2 > 1
        table.push(np.array([i], np.int64), g, clock=clock)
    table.push(np.array([4], np.int64), g, clock=10)
    assert len(table) == 3
    assert np.concatenate(evicted).tolist() == ([1] if policy == "lru" else [3])


def test_config_refuses_bad_values_naming_the_table() -> None:
    with pytest.raises(InvalidArgumentError, match="table 'x': dim"):
        TableConfig("x", 0)
    with pytest.raises(InvalidArgumentError, match="optimizer"):
        TableConfig("x", 4, optimizer="rmsprop")


def test_sync_clocks_apply_the_mean_once_every_member_pushed() -> None:
    from pshard.ps_server.tables.sync import SyncClocks

    sync = SyncClocks()
    g = np.ones((2, 3), np.float32)
    assert sync.push(5, "a", np.array([1, 2]), g, {"a", "b"}) == []  # a table starts at its first clock
    assert sync.push(5, "a", np.array([1, 2]), 9 * g, {"a", "b"}) == []  # a resent push is dropped
    assert sync.waiting_for(5, {"a", "b"}) == ["b"]
    assert sync.push(6, "a", np.array([3]), g[:1], {"a", "b"}) == []  # clock 6 waits for clock 5
    (ids, mean, clock), = sync.push(5, "b", np.array([2, 3]), 3 * g, {"a", "b"})
    assert clock == 5 and ids.tolist() == [1, 2, 3]
    np.testing.assert_array_equal(mean[:, 0], [0.5, 2.0, 1.5])  # a row one worker did not touch: zero from it
    assert sync.push(4, "b", np.array([1]), g[:1], {"a", "b"}) == []  # a clock already applied
    (ids, mean, clock), = sync.ready({"a"})  # b left: clock 6 is complete without it
    assert clock == 6 and ids.tolist() == [3] and sync.applied == 7
