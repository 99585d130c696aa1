"""Reads of sparse tables through TableHandlers: they create no rows, and a large request's table work
leaves the event loop (so health probes and other tables' callers are answered meanwhile)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from pshard.common.limits import Limits
from pshard.common.sparse import TableConfig
from pshard.ps_server.handlers.tables import OFF_LOOP_IDS, TableHandlers
from pshard.ps_server.settings import ServerSettings
from pshard.ps_server.tables.table import initial_rows
from pshard.ps_server.transport.table_servicer import OFF_LOOP_BYTES, SparseTablesServicer

from pshard.api.v1 import sparse_pb2 as pb

_LARGE = 4 * OFF_LOOP_IDS


def _handlers() -> TableHandlers:
    return TableHandlers(ServerSettings(limits=Limits(max_request_bytes=1 << 30)))


async def _loop_turns_while(work: asyncio.Task[object]) -> int:
    """How many times the loop ran another coroutine while `work` was running."""
    turns = 0
    while not work.done():
        await asyncio.sleep(0)
        turns += 1
    await work
    return turns


def test_pulls_and_push_pulls_of_new_ids_create_no_rows() -> None:
    async def main() -> None:
        handlers = _handlers()
        config = TableConfig("t", 4, optimizer="sgd", lr=1.0, seed=3)
        await handlers.declare(config)
        ids = np.arange(0, 1000, 7, dtype=np.int64)
        rows = await handlers.pull("t", ids.tobytes())
        np.testing.assert_array_equal(rows, initial_rows(config, ids))
        assert handlers.stats("t").rows == 0 and handlers.stats("t").admitted == 0
        # PushPullRows: the push's rows exist (and are read as pushed); the other pulled ids stay absent.
        pushed = ids[:3]
        stored, rows = await handlers.push_pull("t", pushed.tobytes(), np.ones((3, 4), np.float32).tobytes(),
                                                ids.tobytes())
        assert stored == 3 and handlers.stats("t").rows == 3
        np.testing.assert_array_equal(rows[:3], initial_rows(config, pushed) - 1)
        np.testing.assert_array_equal(rows[3:], initial_rows(config, ids[3:]))

    asyncio.run(main())


@pytest.mark.parametrize("what", ["pull", "push", "push_pull"])
def test_a_large_request_runs_off_the_event_loop_and_a_small_one_on_it(what: str) -> None:
    async def main() -> None:
        handlers = _handlers()
        await handlers.declare(TableConfig("t", 4))

        def request(n: int) -> asyncio.Task[object]:
            ids = np.arange(n, dtype=np.int64).tobytes()
            grads = np.ones((n, 4), np.float32).tobytes()
            call = {"pull": lambda: handlers.pull("t", ids), "push": lambda: handlers.push("t", ids, grads),
                    "push_pull": lambda: handlers.push_pull("t", ids, grads, ids)}[what]
            return asyncio.get_running_loop().create_task(call())  # type: ignore[no-untyped-call]

        # A small request is done in one step of its task: no other coroutine runs meanwhile.
        assert await _loop_turns_while(request(100)) <= 1
        # A large one (a few 10 ms of numpy and compiled loops) lets the loop run others meanwhile.
        assert await _loop_turns_while(request(_LARGE)) > 1
        assert handlers.stats("t").rows == (0 if what == "pull" else _LARGE)

    asyncio.run(main())


def test_a_cancelled_large_pull_keeps_the_table_locked_until_its_thread_is_done() -> None:
    async def main() -> None:
        handlers = _handlers()
        config = TableConfig("t", 4, optimizer="sgd", lr=1.0)
        await handlers.declare(config)
        ids = np.arange(_LARGE, dtype=np.int64)
        table, finished = handlers.find("t"), []
        assert table is not None
        read = table.pull

        def pull_and_note(*args: object) -> np.ndarray:  # the real pull, noting when its thread is done
            rows = read(*args)  # type: ignore[arg-type]
            finished.append(len(rows))
            return rows

        table.pull = pull_and_note  # type: ignore[method-assign]
        pull = asyncio.get_running_loop().create_task(handlers.pull("t", ids.tobytes()))
        await asyncio.sleep(0)
        while not handlers._locks["t"].locked():  # the pull holds the table: its thread runs
            await asyncio.sleep(0.001)
        pull.cancel()
        # The push waits for the lock, which the cancelled pull releases only once its thread ended.
        await handlers.push("t", ids[:1].tobytes(), np.ones((1, 4), np.float32).tobytes())
        assert finished == [_LARGE] and pull.cancelled()
        np.testing.assert_array_equal(await handlers.pull("t", ids[:1].tobytes()),
                                      initial_rows(config, ids[:1]) - 1)

    asyncio.run(main())


def test_the_grpc_reply_of_a_large_pull_is_encoded_off_the_event_loop() -> None:
    async def main() -> None:
        handlers = _handlers()
        config = TableConfig("t", 32)
        await handlers.declare(config)
        servicer = SparseTablesServicer(handlers)
        ids = np.arange(OFF_LOOP_BYTES // 128, dtype=np.int64)  # rows of 128 bytes: 1 MiB of reply
        assert len(ids) < OFF_LOOP_IDS  # the table's work stays on the loop; the reply's leaves it
        reply = asyncio.get_running_loop().create_task(
            servicer.PullRows(pb.PullRowsRequest(table="t", ids=ids.tobytes()), None))
        assert await _loop_turns_while(reply) > 1
        rows = np.frombuffer(pb.PullRowsResponse.FromString(reply.result()).rows, np.float32)
        np.testing.assert_array_equal(rows.reshape(-1, 32), initial_rows(config, ids))
        small = await servicer.PullRows(pb.PullRowsRequest(table="t", ids=ids[:10].tobytes()), None)
        assert isinstance(small, pb.PullRowsResponse) and len(small.rows) == 10 * 128

    asyncio.run(main())
