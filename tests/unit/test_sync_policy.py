"""Sync (BSP) mode: per slice and clock, one optimizer step with the mean of the quorum's gradients."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from pshard.common.errors import FutureClockError, InvalidArgumentError, PullTimeoutError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.types import SliceKey, Stamp
from pshard.ps_server.core.optimizers import SliceState
from pshard.ps_server.core.store import PushOutcome, ShardStore, Waiting

from tests.unit.store_waits import wait_pull

W = SliceKey("w")
TIMEOUT_S = 10.0  # upper bound for waits that should end at once


def f64(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float64)


def sync_store(workers: str, backup_workers: int = 0, lr: float = 1.0) -> ShardStore:
    config = JobConfig(mode="sync", backup_workers=backup_workers, optimizer=OptimizerConfig(lr=lr))
    store = ShardStore(config, quorum={w: 1 for w in workers} if workers else None)
    store.declare([(W, f64(10, 20))])
    return store


def push(store: ShardStore, worker: str, clock: int, *grad: float) -> PushOutcome:
    return store.push(Stamp(worker, 1, clock), {W: f64(*grad)})


def value(store: ShardStore) -> tuple[list[float], int]:
    [(v, version)] = store.read([W])
    return v.tolist(), version


class RecordingSGD:
    """SGD that records every step it is asked to take."""

    def __init__(self) -> None:
        self.grads: list[list[float]] = []

    def init_state(self, param: np.ndarray) -> SliceState:
        return {}

    def step(self, param: np.ndarray, grad: np.ndarray, state: SliceState) -> None:
        self.grads.append(grad.tolist())
        param -= grad


def test_pull_waits_for_every_worker_in_sync_mode() -> None:
    store = sync_store("abc")
    push(store, "a", 0, 1, 1)
    push(store, "b", 0, 1, 1)

    waiting = store.pull_status(Stamp("a", 1, 1), [W])
    push(store, "c", 0, 1, 1)

    assert waiting == Waiting(workers=("c",), clock=0, keys=(W,))
    assert store.pull_status(Stamp("a", 1, 1), [W]) is None
    assert value(store) == ([9, 19], 1)


def test_the_optimizer_steps_once_per_clock_with_the_mean_gradient() -> None:
    sgd = RecordingSGD()
    store = ShardStore(JobConfig(mode="sync"), quorum={"a": 1, "b": 1, "c": 1}, optimizer=sgd)
    store.declare([(W, f64(0, 0))])

    for worker, grad in zip("abc", ([3, 0], [0, 6], [3, 3]), strict=True):
        store.push(Stamp(worker, 1, 0), {W: f64(*grad)})

    assert sgd.grads == [[2, 3]]
    assert value(store) == ([-2, -3], 1)


def test_sync_training_on_disjoint_batches_matches_one_process_on_the_union() -> None:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3, dtype=torch.float64)
    x, y = torch.randn(32, 4, dtype=torch.float64), torch.randn(32, 3, dtype=torch.float64)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    keys = [SliceKey(k) for k in initial]
    store = ShardStore(JobConfig(mode="sync", optimizer=OptimizerConfig(lr=0.1)), quorum={"w0": 1, "w1": 1})
    store.declare([(k, initial[k.key].numpy()) for k in keys])

    reference = torch.nn.Linear(4, 3, dtype=torch.float64)
    reference.load_state_dict(initial)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    steps = 5
    for clock in range(steps):
        for rank in range(2):
            stamp = Stamp(f"w{rank}", 1, clock)
            weights = wait_pull(store, stamp, keys, timeout_s=TIMEOUT_S)
            model.load_state_dict({k.key: torch.from_numpy(v)
                                   for k, (v, _) in zip(keys, weights, strict=True)})
            model.zero_grad()
            torch.nn.functional.mse_loss(model(x[rank::2]), y[rank::2]).backward()
            store.push(stamp, {k: dict(model.named_parameters())[k.key].grad.numpy() for k in keys})
        opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        opt.step()

    for k, (v, version) in zip(keys, store.read(keys), strict=True):
        assert version == steps
        np.testing.assert_allclose(v, reference.state_dict()[k.key].numpy(), rtol=1e-12, atol=1e-12)


def test_a_late_push_is_dropped_and_counted() -> None:
    store = sync_store("abc", backup_workers=1)
    push(store, "a", 0, 2, 2)
    push(store, "b", 0, 4, 4)

    outcome = push(store, "c", 0, 100, 100)

    assert (outcome.applied, outcome.dropped) == (0, 1)
    assert value(store) == ([7, 17], 1)
    stats = store.stats()
    assert (stats.late_gradients_dropped, stats.pushes_dropped, stats.pushes_applied) == (1, 1, 2)


def test_backup_workers_use_the_first_gradients_of_a_clock_and_drop_the_rest() -> None:
    store = sync_store("abcd", backup_workers=2)

    push(store, "d", 0, 2, 2)
    push(store, "b", 0, 0, 4)
    late = [push(store, w, 0, 100, 100) for w in "ac"]

    assert value(store) == ([9, 17], 1)
    assert [(o.applied, o.dropped) for o in late] == [(0, 1), (0, 1)]
    assert store.stats().late_gradients_dropped == 2


def test_a_push_for_a_clock_not_reached_yet_is_refused_naming_clock_and_version() -> None:
    store = sync_store("ab")

    with pytest.raises(FutureClockError) as info:
        push(store, "a", 1, 1, 1)

    assert "'w'" in str(info.value) and "clock 1" in str(info.value) and "version is 0" in str(info.value)


def test_a_pull_more_than_one_clock_ahead_is_refused() -> None:
    store = sync_store("ab")

    with pytest.raises(FutureClockError, match="clock 2"):
        store.pull_status(Stamp("a", 1, 2), [W])


def test_a_worker_leaving_mid_clock_releases_the_others_at_once() -> None:
    store = sync_store("abc")
    push(store, "a", 0, 2, 2)
    push(store, "b", 0, 4, 4)
    results: list[object] = []
    pull = Stamp("a", 1, 1)
    waiter = threading.Thread(target=lambda: results.append(wait_pull(store, pull, [W], TIMEOUT_S)))
    waiter.start()

    store.set_quorum({"a": 1, "b": 1})
    waiter.join(TIMEOUT_S)

    assert not waiter.is_alive()
    assert value(store) == ([7, 17], 1)
    assert len(results) == 1


def test_a_worker_that_leaves_keeps_its_contribution_to_the_pending_clock() -> None:
    store = sync_store("abc")
    push(store, "c", 0, 9, 9)
    push(store, "a", 0, 0, 3)

    store.set_quorum({"a": 1, "b": 1})
    waiting = store.pull_status(Stamp("a", 1, 1), [W])
    push(store, "b", 0, 0, 0)

    assert waiting is not None and waiting.workers == ("b",)
    assert value(store) == ([7, 16], 1)


def test_a_joining_worker_is_expected_from_the_pending_clock_on() -> None:
    store = sync_store("ab")
    push(store, "a", 0, 1, 1)

    store.set_quorum({"a": 1, "b": 1, "c": 1})
    push(store, "b", 0, 1, 1)
    waiting = store.pull_status(Stamp("a", 1, 1), [W])
    push(store, "c", 0, 1, 1)

    assert waiting is not None and waiting.workers == ("c",)
    assert value(store) == ([9, 19], 1)


def test_without_a_quorum_gradients_accumulate_until_one_is_set() -> None:
    store = sync_store("")
    push(store, "a", 0, 2, 2)
    push(store, "b", 0, 4, 4)
    waiting = store.pull_status(Stamp("a", 1, 1), [W])

    store.set_quorum({"a": 1, "b": 1})

    assert waiting is not None and waiting.workers == () and "no quorum" in str(waiting)
    assert value(store) == ([7, 17], 1)


def test_a_pull_that_can_never_be_satisfied_times_out_naming_the_missing_workers_and_clock() -> None:
    store = sync_store("abc")
    push(store, "a", 0, 1, 1)

    with pytest.raises(PullTimeoutError) as info:
        wait_pull(store, Stamp("a", 1, 1), [W], timeout_s=0.05)

    message = str(info.value)
    assert "['b', 'c']" in message and "clock 0" in message and "'a'" in message


def test_a_retried_push_after_its_clock_completed_is_a_duplicate_not_late() -> None:
    store = sync_store("ab")
    push(store, "a", 0, 1, 1)
    push(store, "b", 0, 1, 1)

    outcome = push(store, "a", 0, 1, 1)

    assert outcome.dropped == 1
    assert store.stats().late_gradients_dropped == 0
    assert value(store) == ([9, 19], 1)


def test_clocks_advance_one_aggregate_step_each() -> None:
    store = sync_store("ab")

    for clock in range(3):
        for worker in "ab":
            assert store.pull_status(Stamp(worker, 1, clock), [W]) is None
            push(store, worker, clock, 1, 2)

    assert value(store) == ([7, 14], 3)
    assert store.stats().worker_clocks == {"a": 2, "b": 2}


def test_plain_sgd_folds_the_mean_into_the_learning_rate_within_an_ulp() -> None:
    # Three workers, plain SGD: the store multiplies the sum by -lr/3 instead of dividing first.
    rng = np.random.default_rng(7)
    start = rng.standard_normal(4096).astype(np.float32)
    grads = [rng.standard_normal(4096).astype(np.float32) for _ in range(3)]
    store = ShardStore(JobConfig(mode="sync", optimizer=OptimizerConfig("sgd", lr=0.3)),
                       quorum={"a": 0, "b": 0, "c": 0})
    store.declare([(SliceKey("w"), start)])

    for worker, grad in zip("abc", grads, strict=True):
        store.push(Stamp(worker, 0, 0), {SliceKey("w"): grad})

    [(value, version)] = store.read([SliceKey("w")])
    mean = (grads[0] + grads[1] + grads[2]) / np.float32(3)
    expected = start - np.float32(0.3) * mean
    assert version == 1
    ulp = np.finfo(np.float32).eps * np.abs(start).max()
    np.testing.assert_allclose(value, expected, rtol=0, atol=4 * ulp)


def test_a_clock_steps_with_the_lr_its_pushes_are_stamped_with() -> None:
    store = sync_store("ab", lr=1.0)
    store.push(Stamp("a", 1, 0, 0.5), {W: f64(2, 4)})
    store.push(Stamp("b", 1, 0, 0.5), {W: f64(4, 8)})
    assert value(store) == ([10 - 0.5 * 3, 20 - 0.5 * 6], 1)
    push(store, "a", 1, 1, 1)  # unstamped: the job's lr again
    push(store, "b", 1, 1, 1)
    assert value(store) == ([8.5 - 1, 17 - 1], 2)


def test_a_push_whose_lr_disagrees_with_its_clock_is_refused_whole() -> None:
    store = sync_store("ab", lr=1.0)
    store.push(Stamp("a", 1, 0, 0.5), {W: f64(2, 4)})
    refused = (r"stamp.lr: worker 'b' pushed clock 0 of slice 'w' with lr 0.25, "
               r"the clock's earlier pushes \(\['a'\]\) with 0.5")
    with pytest.raises(InvalidArgumentError, match=refused):
        store.push(Stamp("b", 1, 0, 0.25), {W: f64(4, 8)})
    assert store.pull_status(Stamp("b", 1, 1), [W]) is not None  # b's push did not count
    store.push(Stamp("b", 1, 0, 0.5), {W: f64(4, 8)})  # the same push, agreeing, is then accepted
    assert value(store) == ([8.5, 17.0], 1)


def test_an_unstamped_push_after_a_stamped_one_of_its_clock_is_refused_whole() -> None:
    # The check is skipped while no push ever carried an lr (every step_lr is None): not past that.
    store = sync_store("ab", lr=1.0)
    store.push(Stamp("a", 1, 0, 0.5), {W: f64(2, 4)})
    refused = r"stamp.lr: worker 'b' pushed clock 0 of slice 'w' with lr the job's 1.0, the clock's earlier"
    with pytest.raises(InvalidArgumentError, match=refused):
        store.push(Stamp("b", 1, 0), {W: f64(4, 8)})
    assert store.pull_status(Stamp("b", 1, 1), [W]) is not None  # b's push did not count


def test_an_averaged_slice_holds_the_mean_of_the_pushes_whatever_the_optimizer() -> None:
    config = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.5, momentum=0.9),
                       averaged=("b",))
    store = ShardStore(config, quorum={"a": 1, "c": 1})
    store.declare([(SliceKey("b"), f64(0, 0)), (W, f64(10, 20))])
    for worker, values in (("a", (1, 2)), ("c", (3, 6))):
        store.push(Stamp(worker, 1, 0, 0.25), {SliceKey("b"): f64(*values), W: f64(*values)})
    [(mean, version), (weights, _)] = store.read([SliceKey("b"), W])
    assert mean.tolist() == [2, 4] and version == 1  # the mean, not an SGD step of it
    assert weights.tolist() == [10 - 0.25 * 2, 20 - 0.25 * 4]  # the job's optimizer, at the stamped lr


def test_a_stamp_with_the_jobs_own_lr_agrees_with_an_unstamped_push() -> None:
    store = sync_store("ab", lr=1.0)
    store.push(Stamp("a", 1, 0, 1.0), {W: f64(2, 4)})
    push(store, "b", 0, 4, 8)
    assert value(store) == ([7.0, 14.0], 1)
