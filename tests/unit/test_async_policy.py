"""Async mode: every push is applied at once, one update at a time per slice; pulls never wait."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from pshard.common.errors import FutureClockError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.types import SliceKey, Stamp
from pshard.ps_server.core.optimizers import Optimizer, SliceState
from pshard.ps_server.core.store import PushOutcome, ShardStore

from tests.unit.store_waits import wait_pull

TIMEOUT_S = 30.0
# Big enough that numpy releases the GIL mid-update: unlocked updates would lose each other.
SIZE = 1 << 16


def async_store(*keys: SliceKey, quorum: dict[str, int] | None = None,
                optimizer: Optimizer | None = None) -> ShardStore:
    store = ShardStore(JobConfig(mode="async", optimizer=OptimizerConfig(lr=1.0)), quorum=quorum,
                       optimizer=optimizer)
    store.declare([(k, np.zeros(SIZE, np.float32)) for k in keys])
    return store


@pytest.fixture(autouse=True)
def frequent_thread_switches() -> Iterator[None]:
    # Python switches threads every 5 ms by default, so a race window of a few bytecodes is
    # rarely hit; switching every microsecond makes a missing lock show up in these tests.
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


class TwoPassSGD:
    """SGD's math in two passes (read all, then write all), as multi-pass optimizers like Adam update.

    Between the passes it lets other threads run: two unlocked updates of one slice
    then lose one of them almost every time, where a single in-place pass mostly hides
    the race (the later thread trails the earlier one through memory).
    """

    def init_state(self, param: np.ndarray) -> SliceState:
        return {}

    def step(self, param: np.ndarray, grad: np.ndarray, state: SliceState) -> None:
        updated = param - grad
        time.sleep(0)  # yield the GIL: widens the window a missing lock would leave open
        param[...] = updated


def run_together(targets: list[Callable[[], None]]) -> None:
    """Start every target at the same moment (a barrier), each on its own thread; fail on error or hang."""
    barrier = threading.Barrier(len(targets))
    errors: list[BaseException] = []

    def run(target: Callable[[], None]) -> None:
        try:
            barrier.wait(TIMEOUT_S)
            target()
        except BaseException as e:  # surfaced below: a thread's exception would otherwise vanish
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a thread did not finish in time"
    assert errors == []


@pytest.mark.parametrize("optimizer", [None, TwoPassSGD()], ids=["sgd", "two-pass-sgd"])
def test_concurrent_pushes_from_8_threads_are_all_applied_exactly(optimizer: Optimizer | None) -> None:
    keys = [SliceKey("a"), SliceKey("b", part=1)]
    store = async_store(*keys, optimizer=optimizer)
    workers, clocks = 8, 40
    # Integer-valued float32 gradients: every partial sum is exact, so any lost update shows.
    ramp = np.arange(SIZE, dtype=np.float32) % 7

    def grad(w: int, c: int, k: int) -> np.ndarray:
        return ramp + float(w * 3 + c + k)

    def worker(w: int) -> Callable[[], None]:
        def loop() -> None:
            for c in range(clocks):
                store.push(Stamp(f"w{w}", 1, c), {k: grad(w, c, i) for i, k in enumerate(keys)})
        return loop

    run_together([worker(w) for w in range(workers)])

    for i, (value, version) in enumerate(store.read(keys)):
        expected = -sum((grad(w, c, i).astype(np.float64) for w in range(workers) for c in range(clocks)),
                        np.zeros(SIZE))
        np.testing.assert_array_equal(value, expected.astype(np.float32))
        assert version == workers * clocks
    assert store.stats().pushes_applied == workers * clocks * len(keys)


def test_the_same_push_sent_twice_concurrently_is_applied_once() -> None:
    key = SliceKey("w")
    store = async_store(key, optimizer=TwoPassSGD())
    outcomes: list[PushOutcome] = []
    rounds = 300

    for clock in range(rounds):
        def send(c: int = clock) -> None:
            outcomes.append(store.push(Stamp("a", 1, c), {key: np.ones(SIZE, np.float32)}))
        run_together([send, send])

    [(value, version)] = store.read([key])
    assert version == rounds
    assert np.all(value == -rounds)
    assert sorted((o.applied, o.dropped) for o in outcomes) == [(0, 1)] * rounds + [(1, 0)] * rounds


def test_pulls_never_wait_and_see_the_latest_value() -> None:
    key = SliceKey("w")
    store = async_store(key, quorum={"a": 1, "b": 1})
    for clock in range(3):
        store.push(Stamp("a", 1, clock), {key: np.ones(SIZE, np.float32)})

    assert store.pull_status(Stamp("b", 1, 0), [key]) is None
    [(value, version)] = wait_pull(store, Stamp("a", 1, 3), [key], timeout_s=1)
    assert version == 3 and value[0] == -3


@pytest.mark.parametrize("op", ["push", "pull"])
def test_a_clock_more_than_one_past_the_furthest_push_is_refused(op: str) -> None:
    key = SliceKey("w")
    store = async_store(key)
    store.push(Stamp("a", 1, 0), {key: np.ones(SIZE, np.float32)})

    with pytest.raises(FutureClockError) as info:
        if op == "push":
            store.push(Stamp("b", 1, 2), {key: np.ones(SIZE, np.float32)})
        else:
            store.pull_status(Stamp("b", 1, 2), [key])

    assert "clock 2" in str(info.value) and "largest clock pushed there is 0" in str(info.value)


def test_without_a_quorum_any_worker_may_push() -> None:
    key = SliceKey("w")
    store = async_store(key)

    outcomes = [store.push(Stamp(w, 1, 0), {key: np.ones(SIZE, np.float32)}) for w in ("x", "y")]

    assert [o.applied for o in outcomes] == [1, 1]
    assert store.stats().worker_clocks == {"x": 0, "y": 0}
