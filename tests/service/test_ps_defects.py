"""Regressions for issue 7's parameter-server defects 1, 3, 5 and 6, through a real server on
127.0.0.1:0: the status code, a message naming the field and its values, the error class in the
trailing metadata, and the stored weights byte-for-byte as they were (docs/architecture.md, 9 Failures).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import grpc
import numpy as np
import pytest
from pshard.common.errors import (
    FutureClockError,
    InvalidArgumentError,
    PSError,
    StaleGenerationError,
)
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.rpc.status import ERROR_TYPE_KEY, error_from_rpc_error
from pshard.common.types import SliceKey, Stamp
from pshard.common.wire import codec
from pshard.ps_server.handlers.dense import ParameterServerHandlers
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import tensor_pb2

CODE = grpc.StatusCode
F32 = tensor_pb2.DTYPE_FLOAT32
MODEL: dict[str, np.ndarray] = {"w": np.arange(12, dtype=np.float32) / 7,
                                "fc1.weight": np.linspace(-1, 1, 5, dtype=np.float32)}
READER = "weights-reader"  # reads the weights back; never pushes


def _stored(server, wire) -> tuple[dict[str, tuple[bytes, int]], tuple]:
    """Every slice's bytes and version, and the counters a refused request must not move."""
    stats = wire.stats(server)
    counters = (stats.slices, stats.pushes_applied, stats.pushes_dropped, dict(stats.worker_clocks),
                stats.min_version, stats.max_version)
    return wire.read(server, MODEL, worker=READER), counters


def _assert_error(err: grpc.RpcError, code: grpc.StatusCode, error_class: type[PSError],
                  *values: object) -> None:
    assert err.code() == code, f"{err.code()}: {err.details()}"
    for value in values:
        assert str(value) in err.details(), f"{value!r} not in {err.details()!r}"
    assert dict(err.trailing_metadata() or ()).get(ERROR_TYPE_KEY) == error_class.__name__
    assert type(error_from_rpc_error(err)) is error_class


def _refused(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


# ---- defect 1: a rejected request changed the store ----

@pytest.fixture(params=["async", "sync"])
def declared(request, start_server, wire):
    """One worker w0; 'w' has completed clock 0 (in sync, so a pull at clock 2 of the never-pushed
    'fc1.weight' is from the future while a push of 'w' at clock 1 is on time)."""
    mode = request.param
    server = start_server(ServerSettings(default_job=JobConfig(mode=mode), static_quorum={"w0": 0}))
    wire.declare(server, None, MODEL)
    wire.stub(server).Push(wire.push_request("w0", 0, {"w": np.ones(12, np.float32)}), timeout=10)
    return mode, server


def test_a_push_pull_refused_for_its_pull_part_applies_nothing(declared, wire):
    mode, server = declared
    clock = 0 if mode == "async" else 1
    before = _stored(server, wire)

    err = _refused(lambda: wire.stub(server).PushPull(pb.PushPullRequest(
        stamp=wire.stamp("w0", clock), gradients=[wire.tensor("w", np.full(12, 0.5, np.float32))],
        pull=[wire.slice_id("fc1.weight")]), timeout=10))

    _assert_error(err, CODE.OUT_OF_RANGE, FutureClockError, "'fc1.weight'", f"clock {clock + 1}")
    assert _stored(server, wire) == before


def test_an_exchange_header_refused_for_its_pull_part_applies_nothing(declared, wire):
    mode, server = declared
    clock = 0 if mode == "async" else 1
    before = _stored(server, wire)
    header = wire.header_frame(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=wire.stamp("w0", clock),
                               push=[wire.meta("w", "float32", (12,))], pull=[wire.slice_id("fc1.weight")])

    err = _refused(lambda: wire.exchange(server, [header, wire.data_frame(np.full(12, 0.5, np.float32))]))

    _assert_error(err, CODE.OUT_OF_RANGE, FutureClockError, "'fc1.weight'", f"clock {clock + 1}")
    assert _stored(server, wire) == before


# ---- defect 3: one read fenced a worker forever ----

@pytest.mark.parametrize("generation", [2**64 - 1, 2**62 + 1])
def test_a_read_with_an_absurd_generation_is_refused_and_fences_nobody(start_server, wire, generation):
    server = start_server(ServerSettings(default_job=JobConfig(mode="async"), static_quorum={"w0": 1}))
    wire.declare(server, None, MODEL)
    before = _stored(server, wire)

    err = _refused(lambda: wire.stub(server).Pull(pb.PullRequest(
        stamp=wire.stamp("w0", 0, generation), slices=[wire.slice_id("w")]), timeout=10))

    _assert_error(err, CODE.INVALID_ARGUMENT, InvalidArgumentError, "'w0'", f"generation {generation}",
                  str(2**62))
    assert _stored(server, wire) == before
    # The real w0 still writes.
    reply = wire.stub(server).Push(wire.push_request("w0", 0, {"w": np.ones(12, np.float32)}, 1), timeout=10)
    assert reply.applied == 1


def test_a_read_with_a_newer_generation_does_not_fence_the_worker(start_server, wire):
    # Reads need only a current generation; only a member's write may move the fencing stamp.
    server = start_server(ServerSettings(default_job=JobConfig(mode="async"), static_quorum={"w0": 1}))
    wire.declare(server, None, MODEL)

    wire.stub(server).Pull(pb.PullRequest(stamp=wire.stamp("w0", 0, 2**40), slices=[wire.slice_id("w")]),
                           timeout=10)

    reply = wire.stub(server).Push(wire.push_request("w0", 0, {"w": np.ones(12, np.float32)}, 1), timeout=10)
    assert reply.applied == 1


def test_a_generation_the_scheduler_never_handed_out_is_refused_and_moves_nothing() -> None:
    """Following a scheduler (view generation 3): a stamp of generation 9 waits for that view until the
    request's deadline, then is refused; the worker's real generation still writes."""
    async def scenario() -> None:
        handlers = ParameterServerHandlers(ServerSettings(default_job=JobConfig(mode="async")))
        handlers.follow_views()
        handlers.set_quorum({"w0": 3}, generation=3)
        key = SliceKey("w", 0)
        await handlers.declare(None, [(key, codec.WireArray(MODEL["w"], "float32"))])
        grad = [(key, codec.WireArray(np.ones(12, np.float32), "float32"))]
        for request in (lambda: handlers.push_pull(Stamp("w0", 9, 0), grad, [], timeout_s=0.05),
                        lambda: handlers.push_pull(Stamp("w0", 9, 0), [], [key], timeout_s=0.05)):
            with pytest.raises(StaleGenerationError, match=r"'w0'.*generation 9.*generation 3"):
                await request()
        assert handlers.store.stats().pushes_applied == 0
        assert np.array_equal(handlers.store.read([key])[0][0], MODEL["w"])
        assert (await handlers.push(Stamp("w0", 3, 0), grad)).applied == 1

    asyncio.run(scenario())


# ---- defect 5: unhandled exceptions ----

def _tensor(key: str, shape: list[int], data: bytes) -> tensor_pb2.SliceTensor:
    return tensor_pb2.SliceTensor(id=tensor_pb2.SliceId(key=key),
                                  tensor=tensor_pb2.Tensor(dtype=F32, shape=shape, data=data))


HUGE = 2**62
BAD_SHAPES = {
    "a zero beside a huge dimension": ([0, HUGE], b"", (f"(0, {HUGE})", str(2**31))),
    "an element count overflowing int64": ([2**40, 2**40], b"", (f"({2**40}, {2**40})", str(2**31))),
    "more dimensions than numpy allows": ([1] * 65, bytes(4), ("65 dimensions", "at most 32")),
    "more dimensions than the limit": ([1] * 33, bytes(4), ("33 dimensions", "at most 32")),
}


@pytest.mark.parametrize("method", ["Declare", "Push", "PushPull"])
@pytest.mark.parametrize("case", list(BAD_SHAPES))
def test_absurd_shapes_are_invalid_argument_naming_the_shape(start_server, wire, method, case):
    server = start_server(ServerSettings(default_job=JobConfig(mode="async")))
    wire.declare(server, None, MODEL)
    shape, data, values = BAD_SHAPES[case]
    before = _stored(server, wire)
    stub = wire.stub(server)
    calls = {
        "Declare": lambda: stub.Declare(pb.DeclareRequest(slices=[_tensor("w", shape, data)]), timeout=10),
        "Push": lambda: stub.Push(pb.PushRequest(stamp=wire.stamp("w0", 0),
                                                 gradients=[_tensor("w", shape, data)]), timeout=10),
        "PushPull": lambda: stub.PushPull(pb.PushPullRequest(
            stamp=wire.stamp("w0", 0), gradients=[_tensor("w", shape, data)], pull=[wire.slice_id("w")]),
            timeout=10),
    }

    err = _refused(calls[method])

    _assert_error(err, CODE.INVALID_ARGUMENT, InvalidArgumentError, "'w'", *values)
    assert _stored(server, wire) == before


def test_an_exchange_header_with_an_absurd_shape_is_invalid_argument(start_server, wire):
    server = start_server(ServerSettings(default_job=JobConfig(mode="async")))
    wire.declare(server, None, MODEL)
    before = _stored(server, wire)
    header = wire.header_frame(op=pb.EXCHANGE_OP_DECLARE, push=[wire.meta("w", "float32", (0, HUGE))])

    err = _refused(lambda: wire.exchange(server, [header]))

    _assert_error(err, CODE.INVALID_ARGUMENT, InvalidArgumentError, "'w'", f"(0, {HUGE})")
    assert _stored(server, wire) == before


@pytest.mark.parametrize("frames", [[b"\x0b"], [b"\xff\xff\xff"], [b"\x12\x05ab"]],
                         ids=["truncated tag", "no message", "data frame first"])
def test_malformed_exchange_frames_are_invalid_argument(start_server, wire, frames):
    server = start_server(ServerSettings(default_job=JobConfig(mode="async")))
    wire.declare(server, None, MODEL)
    before = _stored(server, wire)

    err = _refused(lambda: wire.exchange(server, frames))

    assert err.code() == CODE.INVALID_ARGUMENT, f"{err.code()}: {err.details()}"
    assert "Exchange" in err.details() or "frame" in err.details(), err.details()
    assert _stored(server, wire) == before


LONG = "x" * 300
BAD_STRINGS = {
    "a worker id past the limit": (
        lambda w: pb.PushRequest(stamp=w.stamp(LONG, 0), gradients=[w.tensor("w", np.ones(12, np.float32))]),
        ("stamp.worker_id", "300 characters", "at most 256")),
    "a pushed key past the limit": (
        lambda w: pb.PushRequest(stamp=w.stamp("w0", 0),
                                 gradients=[w.tensor("k" * 2000, np.ones(2, np.float32))]),
        ("key", "2000 characters", "at most 1024")),
    "a slice pushed twice": (
        lambda w: pb.PushRequest(stamp=w.stamp("w0", 0),
                                 gradients=[w.tensor("w", np.ones(12, np.float32))] * 2),
        ("'w'", "named 2 times")),
}


@pytest.mark.parametrize("case", list(BAD_STRINGS))
def test_requests_past_the_documented_limits_are_invalid_argument(start_server, wire, case):
    server = start_server(ServerSettings(default_job=JobConfig(mode="async")))
    wire.declare(server, None, MODEL)
    build, values = BAD_STRINGS[case]
    before = _stored(server, wire)

    err = _refused(lambda: wire.stub(server).Push(build(wire), timeout=10))

    _assert_error(err, CODE.INVALID_ARGUMENT, InvalidArgumentError, *values)
    assert _stored(server, wire) == before


# ---- defect 6: absurd job settings were accepted ----

ADAM = dict(name=pb.OPTIMIZER_ADAM, beta1=0.9, beta2=0.999, eps=1e-8)
ADAGRAD = dict(name=pb.OPTIMIZER_ADAGRAD, eps=1e-10)
SGD, ADAMW = pb.OPTIMIZER_SGD, pb.OPTIMIZER_ADAMW
SYNC, SSP = pb.CONSISTENCY_MODE_SYNC, pb.CONSISTENCY_MODE_SSP
# name -> (OptimizerConfig fields, JobConfig fields, values the message must name)
BAD_JOBS = {
    "lr 1e30": (dict(lr=1e30), {}, ("optimizer.lr", "1e+30")),
    "lr negative": (dict(lr=-0.1), {}, ("optimizer.lr", "-0.1")),
    "lr infinite": (dict(lr=math.inf), {}, ("optimizer.lr", "inf")),
    "momentum NaN": (dict(momentum=math.nan), {}, ("optimizer.momentum", "nan")),
    "momentum above 1": (dict(momentum=1.5), {}, ("optimizer.momentum", "1.5")),
    "dampening negative": (dict(dampening=-1.0), {}, ("optimizer.dampening", "-1.0")),
    "weight_decay NaN": (dict(weight_decay=math.nan), {}, ("optimizer.weight_decay", "nan")),
    "weight_decay negative": (dict(weight_decay=-0.01), {}, ("optimizer.weight_decay", "-0.01")),
    "beta1 of 1": ({**ADAM, "beta1": 1.0}, {}, ("optimizer.betas[0]", "1.0")),
    "beta2 NaN": ({**ADAM, "beta2": math.nan}, {}, ("optimizer.betas[1]", "nan")),
    "beta negative": ({**ADAM, "name": ADAMW, "beta1": -0.5}, {}, ("optimizer.betas[0]", "-0.5")),
    "eps 0 for adam": ({**ADAM, "eps": 0.0}, {}, ("optimizer.eps", "0.0", "adam")),
    "eps negative": ({**ADAGRAD, "eps": -1e-8}, {}, ("optimizer.eps", "-1e-08")),
    "eps infinite": ({**ADAM, "eps": math.inf}, {}, ("optimizer.eps", "inf")),
    "lr_decay infinite": ({**ADAGRAD, "lr_decay": math.inf}, {}, ("optimizer.lr_decay", "inf")),
    "initial_accumulator_value negative": ({**ADAGRAD, "initial_accumulator_value": -1.0}, {},
                                           ("optimizer.initial_accumulator_value", "-1.0")),
    "staleness past the bound": ({}, dict(mode=SSP, staleness=2**21), ("staleness", str(2**21))),
    "backup_workers past the bound": ({}, dict(backup_workers=10**6), ("backup_workers", "1000000")),
}


@pytest.mark.parametrize("case", list(BAD_JOBS))
def test_absurd_job_settings_are_refused_naming_the_field_and_value(start_server, wire, case):
    server = start_server(ServerSettings())  # unconfigured: the first Declare's job would win
    optimizer, job, values = BAD_JOBS[case]
    request = pb.DeclareRequest(
        slices=[wire.tensor("w", MODEL["w"])],
        config=pb.JobConfig(**{"mode": SYNC, **job},
                            optimizer=pb.OptimizerConfig(**{"name": SGD, "lr": 0.1, **optimizer})))

    err = _refused(lambda: wire.stub(server).Declare(request, timeout=10))

    _assert_error(err, CODE.INVALID_ARGUMENT, InvalidArgumentError, *values)
    stats = wire.stats(server)
    assert stats.slices == 0 and not stats.optimizer, "a refused Declare configured the server"
    # A sane job still configures it afterwards.
    ok = request.config.optimizer
    ok.CopyFrom(pb.OptimizerConfig(name=SGD, lr=0.1))
    request.config.CopyFrom(pb.JobConfig(mode=SYNC, optimizer=ok))
    assert list(wire.stub(server).Declare(request, timeout=10).created) == [True]


def test_job_config_refusals_name_the_field_without_a_server() -> None:
    with pytest.raises(InvalidArgumentError, match=r"optimizer\.lr: got 1e\+30"):
        OptimizerConfig(lr=1e30)
    with pytest.raises(InvalidArgumentError, match=r"optimizer\.momentum: got nan"):
        OptimizerConfig(momentum=math.nan)
    with pytest.raises(InvalidArgumentError, match=r"staleness: got -1"):
        JobConfig(mode="ssp", staleness=-1)
