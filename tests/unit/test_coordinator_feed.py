"""A dispatcher's Serve stream feed (pshard.coordinator.dispatch._Feed) over a real ClosureQueue: two calls
out per worker at most, the job on a stream's first call only, answers taken in the order sent, and the
calls out on a stream that ends go back to the queue under their schedule ids."""

from __future__ import annotations

import threading

import pytest
from pshard.common.job import JobConfig
from pshard.common.security.credentials import SecurityConfig
from pshard.common.wire import codec
from pshard.coordinator.closures import Closure, ClosureQueue, RemoteValue
from pshard.coordinator.dispatch import DEPTH, Dispatcher, _Feed

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


def test_a_feed_sends_two_calls_ahead_and_the_next_once_one_is_answered(queue_and_dispatcher) -> None:
    queue, d = queue_and_dispatcher
    ids = _put(queue, 3)
    feed = _Feed(d)
    first, second = next(feed).call, next(feed).call
    assert [first.schedule_id, second.schedule_id] == ids[:DEPTH]
    assert first.HasField("job") and not second.HasField("job")  # the stream's first call only
    assert first.schedule_floor == second.schedule_floor == ids[0]

    third: list[pb.ServeRequest] = []
    sender = threading.Thread(target=lambda: third.append(next(feed)))
    sender.start()
    sender.join(0.3)
    assert sender.is_alive() and not third  # two out: the third waits for an answer

    assert feed.answered(ids[0]).schedule_id == ids[0]
    sender.join(WAIT_S)
    assert [r.call.schedule_id for r in third] == [ids[2]]


def test_an_answer_out_of_order_is_refused_naming_both_ids(queue_and_dispatcher) -> None:
    queue, d = queue_and_dispatcher
    ids = _put(queue, 2)
    feed = _Feed(d)
    next(feed), next(feed)
    with pytest.raises(RuntimeError, match=f"answered schedule {ids[1]}, expected {ids[0]}"):
        feed.answered(ids[1])


def test_the_calls_out_on_a_closed_feed_are_handed_back_and_it_sends_no_more(queue_and_dispatcher) -> None:
    queue, d = queue_and_dispatcher
    ids = _put(queue, 3)
    feed = _Feed(d)
    next(feed), next(feed)
    out = feed.close()
    assert [c.schedule_id for c in out] == ids[:2]
    d.lose(out)
    with pytest.raises(StopIteration):
        next(feed)
    again = _Feed(d)  # the next stream: the lost calls first, in their order, the job again
    resent = [next(again).call, next(again).call]
    assert [r.schedule_id for r in resent] == ids[:2]
    assert resent[0].HasField("job")
