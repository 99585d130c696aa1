"""The parameter server's request handlers, driven directly: no network, no gRPC, no protobuf.

What another transport (shared memory, raw sockets) gets when it calls the same handlers.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import TypeVar

import numpy as np
import pytest
from pshard.common.errors import (
    DTypeMismatchError,
    EmptyRequestError,
    LayoutConflictError,
    PullTimeoutError,
    ShapeMismatchError,
    UnknownKeyError,
)
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.types import SliceKey, Stamp
from pshard.common.wire.codec import WireArray, bf16_to_f32, f32_to_bf16
from pshard.ps_server.core.store import SliceMeta
from pshard.ps_server.handlers.dense import EncodedSlice, ExchangeDone, ParameterServerHandlers, Stall
from pshard.ps_server.settings import ServerSettings

from tests.unit.snapshots import snapshot_diff

T = TypeVar("T")
W, B = SliceKey("fc.weight"), SliceKey("fc.bias")
SYNC = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=1.0))
# Upper bound for anything that should take milliseconds; only a hang uses it up.
WAIT_S = 10.0


def f32(*values: float) -> WireArray:
    return WireArray(np.array(values, np.float32), "float32")


def run(coro: Awaitable[T]) -> T:
    async def bounded() -> T:
        return await asyncio.wait_for(coro, WAIT_S)
    return asyncio.run(bounded())


async def declared(job: JobConfig = SYNC, quorum: Sequence[str] = ("a", "b")) -> ParameterServerHandlers:
    handlers = ParameterServerHandlers(ServerSettings(static_quorum={w: 0 for w in quorum}))
    await handlers.declare(job, [(W, f32(1, 2, 3)), (B, f32(0.5, 0.5))])
    return handlers


async def gradients(*items: tuple[int, WireArray], read: list[int] | None = None
                    ) -> AsyncIterator[tuple[int, WireArray]]:
    for index, wire in items:
        if read is not None:
            read.append(index)
        yield index, wire


def raw_bytes(wire: WireArray) -> bytes:
    return wire.array.tobytes()


class CountingEncoder:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, wire: WireArray) -> bytes:
        self.calls += 1
        return wire.array.tobytes()


# ---- push and pull ----

def test_sync_pull_waits_until_every_worker_of_the_quorum_pushed_then_reads_the_mean_step() -> None:
    async def scenario() -> None:
        handlers = await declared()
        a = asyncio.ensure_future(handlers.push_pull(Stamp("a", 0, 0), [(W, f32(2, 2, 2))], [W]))
        await asyncio.sleep(0)
        while handlers.stats().pulls_waiting == 0:  # a's pull is parked, not answered
            await asyncio.sleep(0.001)
        assert not a.done()

        b = await handlers.push_pull(Stamp("b", 0, 0), [(W, f32(4, 4, 4))], [W])

        got = await a
        for result in (got, b):
            [pulled] = result.slices
            assert pulled.version == 1 and pulled.value.array.tolist() == [-2, -1, 0]  # [1,2,3] - mean 3
        assert handlers.stats().pulls_served == 2

    run(scenario())


def test_sync_pull_that_cannot_be_satisfied_times_out_naming_the_missing_worker_and_clock() -> None:
    async def scenario() -> None:
        handlers = await declared()
        await handlers.push(Stamp("a", 0, 0), [(W, f32(1, 1, 1))])

        with pytest.raises(PullTimeoutError) as info:
            await handlers.pull(Stamp("a", 0, 1), [W], timeout_s=0.05)

        message = str(info.value)
        assert "'a'" in message and "clock 1" in message and "['b']" in message and "clock 0" in message
        assert handlers.stats().pulls_timed_out == 1

    run(scenario())


@pytest.mark.parametrize(("items", "error", "words"), [
    ([(W, f32(1, 1, 1)), (SliceKey("nope"), f32(1))], UnknownKeyError, ("'nope'", "2 slices")),
    ([(W, f32(1, 1, 1)), (B, f32(1, 1, 1))], ShapeMismatchError, ("'fc.bias'", "(3,)", "(2,)")),
    ([(W, f32(1, 1, 1)), (B, WireArray(np.ones(2), "float64"))], DTypeMismatchError,
     ("'fc.bias'", "float64", "float32")),
    ([(W, f32(1, 1, 1)), (B, WireArray(np.ones(2, np.float16), "float16"))], DTypeMismatchError,
     ("'fc.bias'", "float16", "float32")),
    ([], EmptyRequestError, ("'a'", "no gradients")),
], ids=["unknown key", "wrong shape", "wrong dtype", "float16 without a wire dtype", "empty"])
def test_a_refused_push_names_the_values_and_leaves_the_store_unchanged(
        items: list[tuple[SliceKey, WireArray]], error: type[Exception], words: tuple[str, ...]) -> None:
    async def scenario() -> None:
        handlers = await declared()
        before, stats_before = handlers.store.snapshot(), handlers.stats()

        with pytest.raises(error) as info:
            await handlers.push(Stamp("a", 0, 0), items)

        for word in words:
            assert word in str(info.value)
        assert snapshot_diff(handlers.store.snapshot(), before) == []
        assert handlers.stats() == stats_before

    run(scenario())


def test_a_pull_of_an_undeclared_key_names_it() -> None:
    async def scenario() -> None:
        handlers = await declared()
        with pytest.raises(UnknownKeyError, match=r"'fc.weight\[3\]'"):
            await handlers.pull(Stamp("a", 0, 0), [SliceKey("fc.weight", 3)])

    run(scenario())


def test_a_server_holding_nothing_points_at_a_missing_checkpoint() -> None:
    async def scenario() -> None:
        handlers = ParameterServerHandlers(ServerSettings(static_quorum={"a": 0}))
        with pytest.raises(UnknownKeyError) as info:
            await handlers.push(Stamp("a", 0, 3), [(B, f32(1, 1))])
        assert "'fc.bias'" in str(info.value) and "--checkpoint-dir" in str(info.value)
        assert not handlers.has_store

    run(scenario())


def test_wire_dtype_gradients_are_accepted_and_values_come_back_in_the_wire_dtype() -> None:
    job = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=1.0), wire_dtype="bfloat16")

    async def scenario() -> None:
        handlers = await declared(job, quorum=("a",))
        grad = WireArray(f32_to_bf16(np.array([0.5, 0.25, 1.0], np.float32)), "bfloat16")

        result = await handlers.push_pull(Stamp("a", 0, 0), [(W, grad)], [W])

        [pulled] = result.slices
        assert pulled.value.dtype == "bfloat16"
        assert bf16_to_f32(pulled.value.array).tolist() == [0.5, 1.75, 2.0]
        # The store keeps the declared float32; only the wire dtype is accepted besides it.
        with pytest.raises(DTypeMismatchError, match=r"float16.*float32 or the job's wire dtype bfloat16"):
            await handlers.push(Stamp("a", 0, 1), [(W, WireArray(np.ones(3, np.float16), "float16"))])

    run(scenario())


# ---- declare ----

def test_declare_reports_what_it_created_and_the_first_value_wins() -> None:
    async def scenario() -> None:
        handlers = await declared()

        created, values = await handlers.declare(None, [(W, f32(9, 9, 9)), (SliceKey("new"), f32(4))])

        assert created == [False, True]
        assert [v.array.tolist() for v in values] == [[1, 2, 3], [4]]

    run(scenario())


@pytest.mark.parametrize(("job", "items", "error", "words"), [
    (SYNC, [(SliceKey("steps"), WireArray(np.ones(2, np.int32), "int32"))], DTypeMismatchError,
     ("'steps'", "int32")),
    (SYNC, [(SliceKey("w16"), WireArray(np.ones(2, np.uint16), "bfloat16"))], DTypeMismatchError,
     ("'w16'", "bfloat16", "wire_dtype=bfloat16")),
    (SYNC, [], EmptyRequestError, ("no slices",)),
], ids=["integers", "bfloat16", "empty"])
def test_a_refused_first_declare_leaves_the_server_unconfigured(
        job: JobConfig, items: list[tuple[SliceKey, WireArray]], error: type[Exception],
        words: tuple[str, ...]) -> None:
    async def scenario() -> None:
        handlers = ParameterServerHandlers(ServerSettings())

        with pytest.raises(error) as info:
            await handlers.declare(job, items)

        for word in words:
            assert word in str(info.value)
        assert not handlers.has_store and handlers.stats().job is None
        # So a correct declaration (even of another job) still configures it.
        await handlers.declare(JobConfig(mode="async"), [(W, f32(1, 2, 3))])
        assert handlers.store.config.mode == "async"

    run(scenario())


def test_declare_with_another_job_is_a_layout_conflict_naming_both() -> None:
    async def scenario() -> None:
        handlers = await declared()
        with pytest.raises(LayoutConflictError) as info:
            await handlers.declare(JobConfig(mode="async"), [(W, f32(1, 2, 3))])
        assert "mode='async'" in str(info.value) and "mode='sync'" in str(info.value)

    run(scenario())


# ---- exchange ----

def test_exchange_refuses_a_bad_announcement_before_reading_any_gradient() -> None:
    async def scenario() -> None:
        handlers = await declared()
        before = handlers.store.snapshot()
        read: list[int] = []
        metas = [SliceMeta(W, "float32", (3,)), SliceMeta(B, "float32", (4,))]

        events = handlers.exchange(Stamp("a", 0, 0), metas, [W],
                                   gradients((0, f32(1, 1, 1)), (1, f32(1, 1, 1, 1)), read=read), raw_bytes)
        with pytest.raises(ShapeMismatchError, match=r"'fc.bias'.*\(4,\).*\(2,\)"):
            await anext(events)

        assert read == []
        assert snapshot_diff(handlers.store.snapshot(), before) == []

    run(scenario())


def test_exchange_in_sync_mode_stalls_until_the_quorum_pushed_and_shares_one_encoding() -> None:
    async def scenario() -> None:
        handlers = await declared()
        encode = CountingEncoder()
        metas = [SliceMeta(W, "float32", (3,)), SliceMeta(B, "float32", (2,))]

        async def exchange(worker: str, w: float, b: float) -> list[object]:
            grads = gradients((0, f32(w, w, w)), (1, f32(b, b)))
            return [e async for e in handlers.exchange(Stamp(worker, 0, 0), metas, [W, B], grads, encode)]

        a = asyncio.ensure_future(exchange("a", 2, 1))
        await asyncio.sleep(0)
        while handlers.stats().pulls_waiting == 0:  # a waits for b's gradients
            await asyncio.sleep(0.001)
        events_b = await exchange("b", 4, 3)
        events_a = await a

        assert [type(e) for e in events_a] == [Stall, EncodedSlice, EncodedSlice, ExchangeDone]
        for events in (events_a, events_b):
            pulled = [e for e in events if isinstance(e, EncodedSlice)]
            assert [e.key for e in pulled] == [W, B]
            assert np.frombuffer(pulled[0].payload, np.float32).tolist() == [-2, -1, 0]
            assert np.frombuffer(pulled[1].payload, np.float32).tolist() == [-1.5, -1.5]
            done = events[-1]
            assert isinstance(done, ExchangeDone) and (done.versions, done.applied) == ([1, 1], 2)
        assert encode.calls == 2  # W and B once each, shared by both workers

    run(scenario())


def test_the_handlers_import_no_grpc() -> None:
    code = ("import sys, pshard.ps_server.handlers.dense; "
            "found = sorted(m for m in sys.modules if m == 'grpc' or m.startswith('grpc.')); "
            "sys.exit(f'imported {found}' if found else 0)")
    process = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert process.returncode == 0, process.stderr
