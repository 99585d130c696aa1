"""A dispatcher's Serve stream feed (pshard.coordinator.dispatch._Feed) over a real ClosureQueue: calls
sent two to a message, two messages out per worker at most, a lone call at once and alone, the job on a
stream's first call only, answers taken in the order sent, and the calls out on a stream that ends go
back to the queue under their schedule ids."""

from __future__ import annotations

import threading
import time

import pytest
from pshard.common.job import JobConfig
from pshard.common.security.credentials import SecurityConfig
from pshard.common.wire import codec
from pshard.coordinator.closures import Closure, ClosureQueue, RemoteValue
from pshard.coordinator.dispatch import BATCH, DEPTH, Dispatcher, _Feed

from pshard.api.v1 import coordinator_pb2 as pb

WAIT_S = 10.0


@pytest.fixture
def queue_and_dispatcher():
    queue = ClosureQueue(no_worker_s=60.0)
    queue.set_workers({"w0"})
    # A channel is made, never connected: the feed is driven here, not by a stream.
    job = codec.job_to_proto(JobConfig(mode="async"))
    d = Dispatcher("w0", "127.0.0.1:1", queue, job, SecurityConfig(), lambda: None)
    try:
        yield queue, d
    finally:
        d.stop()


def _put(queue: ClosureQueue, n: int) -> list[int]:
    ids = []
    for _ in range(n):
        sid = queue.next_id()
        queue.put(Closure(pb.RunRequest(schedule_id=sid, function="m:f"), RemoteValue(sid, "m:f")))
        ids.append(sid)
    return ids


def _calls(message: pb.ServeRequest) -> list[pb.RunRequest]:
    return [message.call, *message.more]


def _ids(message: pb.ServeRequest) -> list[int]:
    return [c.schedule_id for c in _calls(message)]


def test_a_feed_sends_two_batches_ahead_and_the_next_once_one_is_answered(queue_and_dispatcher) -> None:
    queue, d = queue_and_dispatcher
    ids = _put(queue, 5)
    feed = _Feed(d)
    first, second = next(feed), next(feed)
    assert _ids(first) == ids[:BATCH] and _ids(second) == ids[BATCH:DEPTH]
    assert first.call.HasField("job") and not any(c.HasField("job") for c in [*first.more, *_calls(second)])
    assert {c.schedule_floor for c in [*_calls(first), *_calls(second)]} == {ids[0]}

    third: list[pb.ServeRequest] = []
    sender = threading.Thread(target=lambda: third.append(next(feed)))
    sender.start()
    sender.join(0.3)
    assert sender.is_alive() and not third  # DEPTH out: the next batch waits for answers

    assert feed.answered(ids[0]).schedule_id == ids[0]
    sender.join(0.3)
    assert sender.is_alive() and not third  # a batch's room, not one call's
    assert feed.answered(ids[1]).schedule_id == ids[1]
    sender.join(WAIT_S)
    assert [_ids(m) for m in third] == [ids[4:]]  # what is queued, without waiting for a second call


def test_a_lone_call_goes_at_once_and_a_batch_never_takes_a_call_an_idle_worker_waits_for(
        queue_and_dispatcher) -> None:
    queue, d = queue_and_dispatcher
    queue.set_workers({"w0", "w1"})
    ids = _put(queue, 1)
    feed = _Feed(d)
    assert _ids(next(feed)) == ids
    taken: list[Closure | None] = []
    idle = threading.Thread(target=lambda: taken.append(queue.take("w1", WAIT_S)))
    idle.start()
    deadline = time.monotonic() + WAIT_S
    while queue.idle == 0:  # until w1's dispatcher waits for a call of its own
        assert time.monotonic() < deadline, "w1's dispatcher never waited for a call"
        time.sleep(0.01)  # polling a counter that has no event of its own
    more = _put(queue, 2)
    idle.join(WAIT_S)
    assert [c.schedule_id for c in taken if c is not None] == more[:1]  # the idle worker got the first
    assert _ids(next(feed)) == more[1:]


def test_an_answer_out_of_order_is_refused_naming_both_ids(queue_and_dispatcher) -> None:
    queue, d = queue_and_dispatcher
    ids = _put(queue, 2)
    feed = _Feed(d)
    assert _ids(next(feed)) == ids
    with pytest.raises(RuntimeError, match=f"answered schedule {ids[1]}, expected {ids[0]}"):
        feed.answered(ids[1])


def test_the_calls_out_on_a_closed_feed_are_handed_back_and_it_sends_no_more(queue_and_dispatcher) -> None:
    queue, d = queue_and_dispatcher
    ids = _put(queue, 4)
    feed = _Feed(d)
    next(feed), next(feed)
    out = feed.close()
    assert [c.schedule_id for c in out] == ids
    d.lose(out)
    with pytest.raises(StopIteration):
        next(feed)
    again = _Feed(d)  # the next stream: the lost calls first, in their order, the job again
    resent = [next(again), next(again)]
    assert [_ids(m) for m in resent] == [ids[:2], ids[2:]]
    assert resent[0].call.HasField("job")
