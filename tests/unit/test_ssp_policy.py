"""Bounded staleness (SSP): a read at clock c contains every update from clocks <= c - s - 1."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import numpy as np
import pytest
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.types import SliceKey, Stamp
from pshard.ps_server.core.store import ShardStore, Waiting

from tests.unit.store_waits import wait_pull

W = SliceKey("w")
TIMEOUT_S = 20.0


def ssp_store(staleness: int, workers: str | None, size: int = 2) -> ShardStore:
    config = JobConfig(mode="ssp", staleness=staleness, optimizer=OptimizerConfig(lr=1.0))
    store = ShardStore(config, quorum={w: 1 for w in workers} if workers else None)
    store.declare([(W, np.zeros(size))])
    return store


def push(store: ShardStore, worker: str, *clocks: int) -> None:
    for clock in clocks:
        store.push(Stamp(worker, 1, clock), {W: np.ones(2)})


def status(store: ShardStore, worker: str, clock: int) -> Waiting | None:
    return store.pull_status(Stamp(worker, 1, clock), [W])


def test_a_read_at_clock_c_waits_until_the_slowest_pushed_c_minus_s_minus_1() -> None:
    store = ssp_store(1, "ab")
    push(store, "a", 0, 1, 2)

    before = status(store, "a", 3)
    push(store, "b", 0)
    middle = status(store, "a", 3)
    push(store, "b", 1)

    assert before == middle == Waiting(workers=("b",), clock=1, keys=(W,))
    assert status(store, "a", 3) is None


def test_pushes_are_applied_at_once_as_in_async() -> None:
    store = ssp_store(0, "ab")

    push(store, "a", 0)

    [(value, version)] = store.read([W])
    assert version == 1 and value.tolist() == [-1, -1]


def test_staleness_zero_waits_like_bsp() -> None:
    store = ssp_store(0, "ab")
    push(store, "a", 0)

    waiting = status(store, "a", 1)
    push(store, "b", 0)

    assert waiting is not None and waiting.workers == ("b",) and waiting.clock == 0
    assert status(store, "a", 1) is None


def test_a_very_large_staleness_never_waits() -> None:
    store = ssp_store(1000, "ab")

    push(store, "a", *range(50))

    assert status(store, "a", 50) is None


def test_without_a_quorum_the_workers_seen_so_far_are_waited_for() -> None:
    store = ssp_store(0, None)
    push(store, "a", 0)
    alone = status(store, "a", 1)
    assert status(store, "b", 0) is None  # b shows up, at clock 0

    waiting = status(store, "a", 1)

    assert alone is None
    assert waiting is not None and waiting.workers == ("b",)


def test_a_worker_leaving_releases_the_others_at_once() -> None:
    store = ssp_store(0, "ab")
    push(store, "a", 0)
    results: list[object] = []
    pull = Stamp("a", 1, 1)
    waiter = threading.Thread(target=lambda: results.append(wait_pull(store, pull, [W], TIMEOUT_S)))
    waiter.start()

    store.set_quorum({"a": 1})
    waiter.join(TIMEOUT_S)

    assert not waiter.is_alive() and len(results) == 1


def test_a_joining_worker_is_waited_for_from_the_slowest_clock_on_not_from_zero() -> None:
    store = ssp_store(0, "ab")
    push(store, "a", *range(5))
    push(store, "b", *range(5))

    store.set_quorum({"a": 1, "b": 1, "c": 1})
    at_join = status(store, "a", 5)
    push(store, "a", 5)
    after = status(store, "a", 6)
    push(store, "c", 5)

    assert at_join is None  # c joined at clock 4: nobody waits for it to replay clocks 0..4
    assert after is not None and after.workers == ("b", "c") and after.clock == 5
    assert store.pull_status(Stamp("c", 1, 0), [W]) is None


@dataclass(frozen=True)
class ReadRecord:
    worker: int
    clock: int
    seen: np.ndarray  # seen[w, c]: the update of worker w at clock c is in the value read


@pytest.mark.parametrize("staleness", [0, 1, 3])
def test_threaded_run_every_read_contains_all_updates_older_than_the_staleness_bound(staleness: int) -> None:
    workers, clocks = 4, 12
    # One marker element per (worker, clock): an update adds exactly 1 there, so a read shows
    # which updates it contains, and how far each worker had got when it was taken.
    store = ssp_store(staleness, "0123", size=workers * clocks)
    records: list[ReadRecord] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def run(w: int) -> None:
        rng = random.Random(1000 * staleness + w)
        try:
            for c in range(clocks):
                [(value, _)] = wait_pull(store, Stamp(str(w), 1, c), [W], TIMEOUT_S)
                with lock:
                    records.append(ReadRecord(w, c, value.reshape(workers, clocks) == 1))
                time.sleep(rng.uniform(0, 0.003))  # uneven compute time, so the workers drift apart
                grad = np.zeros(workers * clocks)
                grad[w * clocks + c] = -1.0
                store.push(Stamp(str(w), 1, c), {W: grad})
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)

    assert not any(t.is_alive() for t in threads) and errors == []
    assert len(records) == workers * clocks
    for r in records:
        reached = r.seen.sum(axis=1)  # each worker's clock as this read saw it
        # Updates land in clock order per worker: what a read holds is a prefix of each row.
        assert all(r.seen[w, :n].all() for w, n in enumerate(reached))
        needed = r.clock - staleness - 1
        assert r.seen[:, : max(needed + 1, 0)].all(), f"read {r} misses an update from clock <= {needed}"
        assert r.clock - reached.min() <= staleness, f"worker {r.worker} at {r.clock} ran ahead of {reached}"
