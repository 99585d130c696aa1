"""The coordinator's scheduling state (pshard.coordinator.closures), driven directly with an injected clock:
queueing, re-dispatch under the same schedule id, the first result winning, errors, and no workers left."""

from __future__ import annotations

import random
import threading
import time

import pytest
from pshard.common.errors import CancelledCallError, NoWorkersError, PullTimeoutError, ScheduledFunctionError
from pshard.coordinator.closures import Closure, ClosureQueue, RemoteValue

from pshard.api.v1 import coordinator_pb2 as pb


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def queue_with(*names: str, workers: tuple[str, ...] = ("worker-0",),
               clock: FakeClock | None = None) -> tuple[ClosureQueue, list[RemoteValue]]:
    q = ClosureQueue(no_worker_s=5.0, clock=clock or FakeClock())
    q.set_workers(set(workers))
    remotes = []
    for name in names:
        sid = q.next_id()
        remote = RemoteValue(sid, name)
        q.put(Closure(pb.RunRequest(schedule_id=sid, function=name), remote))
        remotes.append(remote)
    return q, remotes


def test_calls_are_taken_in_order_and_each_result_reaches_its_remote_value() -> None:
    q, (a, b) = queue_with("m:a", "m:b")

    first, second = q.take("worker-0", 0), q.take("worker-1", 0)
    q.finish(second.schedule_id, "worker-1", "B")
    q.finish(first.schedule_id, "worker-0", "A")

    assert (first.schedule_id, second.schedule_id) == (1, 2)
    assert (a.fetch(0), a.worker, b.fetch(0), b.worker) == ("A", "worker-0", "B", "worker-1")
    assert q.done()
    q.join(0)


def test_a_call_lost_with_its_worker_runs_again_first_under_the_same_schedule_id() -> None:
    q, _ = queue_with("m:a", "m:b")
    taken = q.take("worker-0", 0)

    q.lost(taken.schedule_id, "worker-0")
    again = q.take("worker-1", 0)

    assert again.schedule_id == taken.schedule_id == 1
    assert again.runs == ["worker-0", "worker-1"]
    assert q.redispatched == 1
    assert q.floor() == 1  # call 1 is unfinished: servers must still take its pushes


def test_the_first_run_to_finish_gives_the_result_and_a_late_one_is_ignored() -> None:
    q, (a,) = queue_with("m:a")
    q.take("worker-0", 0)
    q.lost(1, "worker-0")  # cut off, but still running there
    q.take("worker-1", 0)

    assert q.finish(1, "worker-1", "from worker-1")
    assert not q.finish(1, "worker-0", "from worker-0")  # the cut-off run came back late
    assert (a.fetch(0), a.worker) == ("from worker-1", "worker-1")
    assert q.floor() == 2


def test_a_lost_report_for_a_call_that_finished_or_moved_changes_nothing() -> None:
    q, _ = queue_with("m:a")
    q.take("worker-0", 0)
    q.lost(1, "worker-0")
    q.take("worker-1", 0)

    q.lost(1, "worker-0")  # the old run's report arrives after the re-dispatch

    assert q.take("worker-2", 0) is None


def test_an_error_fails_its_call_cancels_the_waiting_ones_and_join_raises_it_once() -> None:
    q, (a, b) = queue_with("m:a", "m:b")
    q.take("worker-0", 0)
    error = ScheduledFunctionError("schedule 1 (m:a) raised on worker-0: builtins.ValueError: boom")

    q.fail(1, "worker-0", error)

    with pytest.raises(ScheduledFunctionError, match="boom"):
        a.fetch(0)
    with pytest.raises(CancelledCallError, match=r"schedule 2 .* cancelled: schedule 1 failed first"):
        b.fetch(0)
    with pytest.raises(ScheduledFunctionError, match="boom"):
        q.put(Closure(pb.RunRequest(schedule_id=q.next_id(), function="m:c"), RemoteValue(3, "m:c")))
    with pytest.raises(ScheduledFunctionError, match="boom"):
        q.join(0)
    q.join(0)  # handled: join raised it
    q.put(Closure(pb.RunRequest(schedule_id=q.next_id(), function="m:d"), RemoteValue(4, "m:d")))


def test_join_fails_naming_the_calls_and_workers_when_no_worker_is_left() -> None:
    clock = FakeClock()
    q, _ = queue_with("m:a", "m:b", clock=clock, workers=("worker-0",))
    q.take("worker-0", 0)
    q.set_workers(set())  # its dispatcher found it gone
    q.lost(1, "worker-0")
    clock.now += 5.0

    with pytest.raises(NoWorkersError) as raised:
        q.join(10)

    message = str(raised.value)
    assert "2 scheduled call(s) unfinished (schedule ids 1, 2)" in message
    assert "no serving worker for 5.0 s" in message and "worker-0" in message
    assert raised.value.facts == {"unfinished": 2}


def test_join_waits_for_a_worker_while_one_may_still_come() -> None:
    clock = FakeClock()
    q, _ = queue_with("m:a", clock=clock, workers=())
    clock.now += 4.9

    with pytest.raises(PullTimeoutError, match="1 scheduled call"):
        q.join(0)  # not yet NoWorkersError: a worker may register within the heartbeat timeout


def test_fetch_with_a_timeout_names_the_call() -> None:
    _, (a,) = queue_with("m:a")
    with pytest.raises(PullTimeoutError, match=r"schedule 1 \(m:a\) has no result after 0.01 s"):
        a.fetch(0.01)


def test_join_waits_the_start_up_time_for_the_first_worker_and_says_none_came() -> None:
    clock = FakeClock()
    q = ClosureQueue(no_worker_s=5.0, clock=clock, startup_s=60.0)
    q.put(Closure(pb.RunRequest(schedule_id=q.next_id(), function="m:a"), RemoteValue(1, "m:a")))
    clock.now += 30.0
    with pytest.raises(PullTimeoutError):
        q.join(0)  # workers start slower than a script: still waiting

    clock.now += 30.0
    with pytest.raises(NoWorkersError, match="none ever registered"):
        q.join(0)


def test_join_raises_the_first_error_once_the_calls_running_beside_it_have_ended() -> None:
    q, _ = queue_with("m:a", "m:b", workers=("worker-0", "worker-1"))
    q.take("worker-0", 0)
    q.take("worker-1", 0)
    q.fail(1, "worker-0", ScheduledFunctionError("first"))
    with pytest.raises(PullTimeoutError):
        q.join(0)  # call 2 still runs: its error, if any, belongs to this join too

    q.fail(2, "worker-1", ScheduledFunctionError("second"))

    with pytest.raises(ScheduledFunctionError, match="first"):
        q.join(0)
    q.join(0)  # both handled


def test_calls_after_a_restore_are_numbered_above_the_checkpoints_calls_and_so_is_the_floor() -> None:
    q, _ = queue_with("m:a")
    q.take("worker-0", 0)
    q.number_above(41)  # the restored checkpoint's last call
    q.number_above(5)  # never lowers it
    assert q.next_id() == 42 and q.floor() == 1  # call 1 is still running
    q.finish(1, "worker-0", None)
    assert q.floor() == 43


def test_a_busy_worker_takes_its_next_call_ahead_only_while_no_worker_waits_for_one() -> None:
    """A dispatcher's second slot sends its worker the next call while it runs one (no dispatch round trip
    between them), but never one that an idle worker's dispatcher is waiting for."""
    q, _ = queue_with(workers=("worker-0", "worker-1"))
    got: list[Closure | None] = []
    idle = threading.Thread(target=lambda: got.append(q.take("worker-1", 10.0)))
    idle.start()
    deadline = time.monotonic() + 10.0
    while q.idle != 1 and time.monotonic() < deadline:
        time.sleep(0.001)  # waiting for the thread to wait in take(): a state, polled with a deadline
    assert q.idle == 1

    def put(name: str) -> None:
        sid = q.next_id()
        q.put(Closure(pb.RunRequest(schedule_id=sid, function=name), RemoteValue(sid, name)))

    put("m:a")
    assert q.take("worker-0", 0, ahead=True) is None  # worker-1 waits for it
    idle.join(10.0)
    assert [(c.schedule_id, c.runs) for c in got if c is not None] == [(1, ["worker-1"])]
    put("m:b")
    ahead = q.take("worker-0", 0, ahead=True)  # no worker waits now: worker-0 runs call 2 next
    assert ahead is not None and ahead.schedule_id == 2 and q.floor() == 1
    assert q.take("worker-0", 0, ahead=True) is None  # nothing left


def test_the_floor_is_the_smallest_unfinished_id_through_takes_losses_finishes_and_a_failure() -> None:
    """Kept as a heap rather than scanned per dispatch (a scan cost 2.5 ms a dispatch with 10,000 calls
    waiting): checked against the calls' own state after each of a seeded random run's steps."""
    rng = random.Random(21)
    q, remotes = queue_with(*[f"m:f{i}" for i in range(60)], workers=("w",))
    running: list[Closure] = []
    for step in range(200):
        op = rng.random()
        if op < 0.45 and (c := q.take("w", 0)) is not None:
            running.append(c)
        elif op < 0.8 and running:
            q.finish(running.pop(rng.randrange(len(running))).schedule_id, "w", None)
        elif running:
            q.lost(running.pop(rng.randrange(len(running))).schedule_id, "w")
        if step == 150 and running:  # a failure: the waiting calls are cancelled, so they end too
            q.fail(running.pop(0).schedule_id, "w", ScheduledFunctionError("boom"))
        unfinished = [r.schedule_id for r in remotes if not r.done()]
        assert q.floor() == min(unfinished, default=61), step
