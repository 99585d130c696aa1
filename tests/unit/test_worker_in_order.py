"""A serving worker runs the coordinator's calls in the order they were taken for it, whichever of two calls
in flight arrives first (pshard.worker.serve.InOrder, on a real event loop and real threads)."""

from __future__ import annotations

import asyncio
import threading

from pshard.worker.serve import InOrder

from pshard.api.v1 import coordinator_pb2 as pb


def _run(order: InOrder, requests: list[pb.RunRequest], gaps_s: list[float]) -> list[int]:
    ran: list[int] = []
    lock = threading.Lock()

    def fn(request: pb.RunRequest) -> int:
        with lock:
            ran.append(request.schedule_id)
        return request.schedule_id

    async def main() -> None:
        async def arrive(request: pb.RunRequest, gap_s: float) -> int:
            await asyncio.sleep(gap_s)  # when this RPC reaches the handler
            return await order.run(request, fn)

        await asyncio.gather(*(arrive(r, g) for r, g in zip(requests, gaps_s, strict=True)))

    asyncio.run(main())
    return ran


def test_a_call_that_arrives_before_its_predecessor_runs_after_it() -> None:
    requests = [pb.RunRequest(schedule_id=1), pb.RunRequest(schedule_id=2, after=1),
                pb.RunRequest(schedule_id=3, after=2)]
    assert _run(InOrder(wait_s=10.0), requests, [0.2, 0.0, 0.1]) == [1, 2, 3]


def test_a_predecessor_that_never_comes_delays_a_call_by_the_wait_only() -> None:
    requests = [pb.RunRequest(schedule_id=9, after=8)]
    assert _run(InOrder(wait_s=0.2), requests, [0.0]) == [9]


def test_calls_without_a_predecessor_run_one_at_a_time() -> None:
    inside = [0]
    most = [0]
    guard = threading.Lock()

    def fn(request: pb.RunRequest) -> int:
        with guard:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        threading.Event().wait(0.01)  # a function that takes a while
        with guard:
            inside[0] -= 1
        return request.schedule_id

    order = InOrder(wait_s=1.0)

    async def main() -> None:
        await asyncio.gather(*(order.run(pb.RunRequest(schedule_id=i), fn) for i in range(1, 6)))

    asyncio.run(main())
    assert most[0] == 1


def test_a_cancelled_call_leaves_the_fifo_while_its_function_still_runs() -> None:
    """Why pshard.coordinator.runner.CallRunner keeps a threading lock of its own: a Run cancelled
    mid-call (its RPC broke) frees InOrder's FIFO at once, though its function's thread cannot be
    stopped, so the next call starts beside it."""
    running, release = threading.Event(), threading.Event()
    started: list[int] = []

    def fn(request: pb.RunRequest) -> int:
        started.append(request.schedule_id)
        if request.schedule_id == 1:
            running.set()
            release.wait(10.0)  # still running after its RPC was cancelled
        return request.schedule_id

    order = InOrder(wait_s=1.0)

    async def main() -> bool:
        first = asyncio.create_task(order.run(pb.RunRequest(schedule_id=1), fn))
        assert await asyncio.to_thread(running.wait, 10.0)
        first.cancel()
        second = await order.run(pb.RunRequest(schedule_id=2, after=1), fn)
        beside = not release.is_set()
        release.set()
        return second == 2 and beside

    assert asyncio.run(main())
    assert started == [1, 2]
