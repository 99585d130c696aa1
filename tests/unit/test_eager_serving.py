"""run_eagerly (ps_server.transport.fastconn): a request served inside the read callback when it never waits,
and exactly as under a task when it does (results, exceptions and cancellation reach it)."""

from __future__ import annotations

import asyncio

import pytest
from pshard.ps_server.transport.fastconn import run_eagerly


def test_a_coroutine_that_never_waits_finishes_in_the_call_without_a_task() -> None:
    log: list[str] = []

    async def serve() -> None:
        log.append("served")

    async def main() -> None:
        assert run_eagerly(asyncio.get_running_loop(), serve()) is None
        assert log == ["served"]  # before any turn of the loop

    asyncio.run(main())


def test_a_coroutine_that_waits_gets_each_result_and_exception_as_under_a_task() -> None:
    log: list[object] = []

    async def serve(loop: asyncio.AbstractEventLoop) -> None:
        ready = loop.create_future()
        loop.call_soon(ready.set_result, 5)
        log.append(await ready)
        failed = loop.create_future()
        loop.call_soon(failed.set_exception, ValueError("bad"))
        with pytest.raises(ValueError, match="bad"):
            await failed
        first, other = loop.create_future(), loop.create_future()
        loop.call_soon(first.set_result, 1)
        done, _ = await asyncio.wait({first, other}, return_when=asyncio.FIRST_COMPLETED)
        log.append(done == {first})
        await asyncio.sleep(0)
        log.append(await asyncio.wait_for(asyncio.sleep(0, "slept"), 5))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = run_eagerly(loop, serve(loop))
        assert task is not None and log == []
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert log == [5, True, "slept"]


def test_cancelling_the_rest_raises_cancelled_error_inside_the_coroutine() -> None:
    log: list[str] = []

    async def serve(loop: asyncio.AbstractEventLoop) -> None:
        try:
            await loop.create_future()  # never set: only a cancel ends this wait
        except asyncio.CancelledError:
            log.append("cancelled")
            raise

    async def main() -> None:
        loop = asyncio.get_running_loop()
        task = run_eagerly(loop, serve(loop))
        assert task is not None
        await asyncio.sleep(0)  # the task is now waiting on the coroutine's future
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert log == ["cancelled"]


def test_a_cancel_that_finds_the_awaited_future_already_done_still_reaches_the_coroutine() -> None:
    log: list[str] = []

    async def serve(gate: asyncio.Future[None]) -> None:
        try:
            await gate  # as under a task: the cancel is raised here, though gate has its result
        except asyncio.CancelledError:
            log.append("cancelled")
            raise
        log.append("went on")

    async def main() -> None:
        loop = asyncio.get_running_loop()
        gate: asyncio.Future[None] = loop.create_future()
        task = run_eagerly(loop, serve(gate))
        assert task is not None
        await asyncio.sleep(0)
        gate.set_result(None)  # the task's wake-up is scheduled, not run: the cancel finds gate done
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert log == ["cancelled"]


def test_a_wait_with_a_deadline_in_the_eager_part_works_on_every_python() -> None:
    # Python 3.12's wait_for needs a current task: run_eagerly must give the eager part one there (the
    # GPU machine's 3.12 broke every shm request whose first wait had a deadline). On 3.11 the eager
    # part runs without a task and wait_for needs none.
    log: list[object] = []

    async def serve(loop: asyncio.AbstractEventLoop) -> None:
        ready = loop.create_future()
        loop.call_soon(ready.set_result, "arrived")
        log.append(await asyncio.wait_for(ready, 5))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        started: asyncio.Future[asyncio.Task[None] | None] = loop.create_future()

        def read_callback() -> None:  # where the server calls it: a protocol callback, outside any task
            try:
                started.set_result(run_eagerly(loop, serve(loop)))
            except Exception as err:
                started.set_exception(err)

        loop.call_soon(read_callback)
        task = await asyncio.wait_for(started, 5)
        assert task is not None
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert log == ["arrived"]


def test_an_exception_of_the_eager_part_is_raised_by_the_call() -> None:
    async def serve() -> None:
        raise ValueError("refused at once")

    async def main() -> None:
        with pytest.raises(ValueError, match="refused at once"):
            run_eagerly(asyncio.get_running_loop(), serve())

    asyncio.run(main())
