"""Every malformed or unacceptable request, through a real server: the right gRPC status, a message
naming the key and both values, the ps-error-type trailer, PSClient re-raising the same class,
and the store byte-for-byte as it was (docs/architecture.md, 7 Wire)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.errors import (
    DTypeMismatchError,
    EmptyRequestError,
    FutureClockError,
    InvalidArgumentError,
    LayoutConflictError,
    MessageTooLargeError,
    PayloadSizeError,
    PSError,
    PullTimeoutError,
    ShapeMismatchError,
    StaleGenerationError,
    UnknownKeyError,
)
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.rpc.options import CHUNK_BYTES, FRAME_SLACK_BYTES
from pshard.common.rpc.status import ERROR_TYPE_KEY, error_from_rpc_error
from pshard.ps_server.service import ServerThread
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import tensor_pb2

from .conftest import Wire

CODE = grpc.StatusCode
GENERATION = 2
JOB = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.5, momentum=0.9))
PARAMS: dict[str, np.ndarray] = {"fc.weight": np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
                                 "fc.bias": np.array([0.25, -1.5, 3.0, 0.125], dtype=np.float32)}
KEYS = list(PARAMS)


@dataclass
class Primed:
    """A sync server (quorum w0, w1 at generation 2) whose slices have completed clock 0.

    Declared by PSClient, as workers do: slices are flat, so 'fc.weight' is stored with shape (12,).
    """

    server: ServerThread
    wire: Wire

    def state(self) -> tuple[dict[str, tuple[bytes, int]], tuple]:
        """Stored bytes and versions of every slice, and the counters a refused request must not move."""
        stats = self.wire.stats(self.server)
        counters = (stats.slices, stats.bytes_stored, stats.pushes_applied, stats.pushes_dropped,
                    stats.late_gradients_dropped, dict(stats.worker_clocks), stats.min_version,
                    stats.max_version)
        return self.wire.read(self.server, KEYS, "w0", GENERATION, clock=1), counters


@pytest.fixture
def primed(start_server, wire, new_client) -> Primed:
    server = start_server(ServerSettings(static_quorum={"w0": GENERATION, "w1": GENERATION}))
    new_client([server], "w0", generation=GENERATION).declare(PARAMS, JOB)
    for worker in ("w0", "w1"):
        wire.stub(server).Push(pb.PushRequest(
            stamp=wire.stamp(worker, 0, GENERATION),
            gradients=[wire.tensor(k, np.ones(v.size, v.dtype)) for k, v in PARAMS.items()]), timeout=10)
    return Primed(server, wire)


F32 = tensor_pb2.DTYPE_FLOAT32


def _raw_tensor(key: str, dtype: tensor_pb2.Dtype, shape: list[int], data: bytes) -> tensor_pb2.SliceTensor:
    return tensor_pb2.SliceTensor(id=tensor_pb2.SliceId(key=key),
                                  tensor=tensor_pb2.Tensor(dtype=dtype, shape=shape, data=data))


# ---- unary Push / Pull / Declare ----

# name -> (request builder, code, class, values the message must name)
BAD_PUSHES: dict[str, tuple[Callable, grpc.StatusCode, type[PSError], tuple]] = {
    "unknown key": (
        lambda w: pb.PushRequest(stamp=w.stamp("w0", 1, GENERATION),
                                 gradients=[w.tensor("fc.nope", np.ones(4, np.float32))]),
        CODE.NOT_FOUND, UnknownKeyError, ("'fc.nope'", "2 slices")),
    "wrong shape": (
        lambda w: pb.PushRequest(stamp=w.stamp("w0", 1, GENERATION),
                                 gradients=[w.tensor("fc.weight", np.ones((4, 3), np.float32))]),
        CODE.INVALID_ARGUMENT, ShapeMismatchError, ("'fc.weight'", "(4, 3)", "(12,)")),
    "wrong dtype": (
        lambda w: pb.PushRequest(stamp=w.stamp("w0", 1, GENERATION),
                                 gradients=[w.tensor("fc.weight", np.ones(12, np.float64))]),
        CODE.INVALID_ARGUMENT, DTypeMismatchError, ("'fc.weight'", "float64", "float32")),
    "byte length not matching the shape": (
        lambda w: pb.PushRequest(stamp=w.stamp("w0", 1, GENERATION),
                                 gradients=[_raw_tensor("fc.weight", F32, [12], b"\0" * 40)]),
        CODE.INVALID_ARGUMENT, PayloadSizeError, ("'fc.weight'", "40 bytes", "48", "(12,)")),
    "clock far in the future": (
        lambda w: pb.PushRequest(stamp=w.stamp("w0", 1000, GENERATION),
                                 gradients=[w.tensor("fc.bias", np.ones(4, np.float32))]),
        CODE.OUT_OF_RANGE, FutureClockError, ("'fc.bias'", "clock 1000", "version is 1")),
    "stale generation": (
        lambda w: pb.PushRequest(stamp=w.stamp("w0", 1, GENERATION - 1),
                                 gradients=[w.tensor("fc.bias", np.ones(4, np.float32))]),
        CODE.FAILED_PRECONDITION, StaleGenerationError,
        ("'w0'", f"generation {GENERATION - 1}", f"generation {GENERATION}")),
    "push from a non-member": (
        lambda w: pb.PushRequest(stamp=w.stamp("intruder", 1, GENERATION),
                                 gradients=[w.tensor("fc.bias", np.ones(4, np.float32))]),
        CODE.FAILED_PRECONDITION, StaleGenerationError, ("'intruder'", "['w0', 'w1']")),
    "empty request": (
        lambda w: pb.PushRequest(stamp=w.stamp("w0", 1, GENERATION)),
        CODE.INVALID_ARGUMENT, EmptyRequestError, ("'w0'", "no gradients")),
    "no worker id": (
        lambda w: pb.PushRequest(stamp=w.stamp("", 1, GENERATION),
                                 gradients=[w.tensor("fc.bias", np.ones(4, np.float32))]),
        CODE.INVALID_ARGUMENT, InvalidArgumentError, ("worker_id", "''")),
    "one bad slice among good ones": (
        lambda w: pb.PushRequest(stamp=w.stamp("w0", 1, GENERATION),
                                 gradients=[w.tensor("fc.bias", np.ones(4, np.float32)),
                                            w.tensor("fc.weight", np.ones((3, 4), np.float32))]),
        CODE.INVALID_ARGUMENT, ShapeMismatchError, ("'fc.weight'", "(3, 4)", "(12,)")),
}


@pytest.mark.parametrize("case", list(BAD_PUSHES))
def test_bad_push_is_refused_naming_the_values_and_leaves_the_store_unchanged(primed, wire, case):
    build, code, error_class, values = BAD_PUSHES[case]
    before = primed.state()

    with pytest.raises(grpc.RpcError) as caught:
        wire.stub(primed.server).Push(build(wire), timeout=10)

    _assert_error(caught.value, code, error_class, *values)
    assert primed.state() == before


BAD_PULLS: dict[str, tuple[Callable, grpc.StatusCode, type[PSError], tuple]] = {
    "unknown key": (
        lambda w: pb.PullRequest(stamp=w.stamp("w0", 1, GENERATION), slices=[w.slice_id("fc.nope")]),
        CODE.NOT_FOUND, UnknownKeyError, ("'fc.nope'",)),
    "unknown part of a known key": (
        lambda w: pb.PullRequest(stamp=w.stamp("w0", 1, GENERATION), slices=[w.slice_id("fc.weight", 3)]),
        CODE.NOT_FOUND, UnknownKeyError, ("'fc.weight[3]'",)),
    "clock far in the future": (
        lambda w: pb.PullRequest(stamp=w.stamp("w0", 50, GENERATION), slices=[w.slice_id("fc.bias")]),
        CODE.OUT_OF_RANGE, FutureClockError, ("'fc.bias'", "clock 50", "version is 1")),
    "stale generation": (
        lambda w: pb.PullRequest(stamp=w.stamp("w1", 1, GENERATION - 1), slices=[w.slice_id("fc.bias")]),
        CODE.FAILED_PRECONDITION, StaleGenerationError,
        ("'w1'", f"generation {GENERATION - 1}", f"generation {GENERATION}")),
    "empty request": (
        lambda w: pb.PullRequest(stamp=w.stamp("w0", 1, GENERATION)),
        CODE.INVALID_ARGUMENT, EmptyRequestError, ("'w0'", "no slices")),
}


@pytest.mark.parametrize("case", list(BAD_PULLS))
def test_bad_pull_is_refused_naming_the_values_and_leaves_the_store_unchanged(primed, wire, case):
    build, code, error_class, values = BAD_PULLS[case]
    before = primed.state()

    with pytest.raises(grpc.RpcError) as caught:
        wire.stub(primed.server).Pull(build(wire), timeout=10)

    _assert_error(caught.value, code, error_class, *values)
    assert primed.state() == before


BAD_DECLARES: dict[str, tuple[Callable, grpc.StatusCode, type[PSError], tuple]] = {
    "wrong shape (a new key in the same request is not created either)": (
        lambda w: pb.DeclareRequest(slices=[w.tensor("fc.extra", np.ones(2, np.float32)),
                                            w.tensor("fc.weight", np.ones((4, 3), np.float32))]),
        CODE.INVALID_ARGUMENT, ShapeMismatchError, ("'fc.weight'", "(4, 3)", "(12,)")),
    "wrong dtype": (
        lambda w: pb.DeclareRequest(slices=[w.tensor("fc.bias", np.ones(4, np.float64))]),
        CODE.INVALID_ARGUMENT, DTypeMismatchError, ("'fc.bias'", "float64", "float32")),
    "a dtype that cannot be trained": (
        lambda w: pb.DeclareRequest(slices=[w.tensor("fc.steps", np.ones(4, np.int32))]),
        CODE.INVALID_ARGUMENT, DTypeMismatchError, ("'fc.steps'", "int32")),
    "byte length not matching the shape": (
        lambda w: pb.DeclareRequest(slices=[_raw_tensor("fc.extra", F32, [2], b"\0" * 7)]),
        CODE.INVALID_ARGUMENT, PayloadSizeError, ("'fc.extra'", "7 bytes", "8")),
    "a different job config": (
        lambda w: pb.DeclareRequest(
            slices=[w.tensor("fc.bias", PARAMS["fc.bias"])],
            config=pb.JobConfig(mode=pb.CONSISTENCY_MODE_ASYNC,
                                optimizer=pb.OptimizerConfig(name=pb.OPTIMIZER_SGD, lr=0.5))),
        CODE.FAILED_PRECONDITION, LayoutConflictError, ("mode='async'", "mode='sync'")),
    "empty request": (
        lambda w: pb.DeclareRequest(),
        CODE.INVALID_ARGUMENT, EmptyRequestError, ("no slices",)),
}


@pytest.mark.parametrize("case", list(BAD_DECLARES))
def test_bad_declare_is_refused_naming_the_values_and_leaves_the_store_unchanged(primed, wire, case):
    build, code, error_class, values = BAD_DECLARES[case]
    before = primed.state()

    with pytest.raises(grpc.RpcError) as caught:
        wire.stub(primed.server).Declare(build(wire), timeout=10)

    _assert_error(caught.value, code, error_class, *values)
    assert primed.state() == before


def test_push_to_a_server_holding_nothing_points_at_a_missing_checkpoint(start_server, wire):
    # What a worker sees mid-run when a server came back without a checkpoint to restore.
    server = start_server(ServerSettings(static_quorum={"w0": GENERATION}))

    with pytest.raises(grpc.RpcError) as caught:
        wire.stub(server).Push(pb.PushRequest(stamp=wire.stamp("w0", 3, GENERATION), gradients=[
            wire.tensor("fc.bias", np.ones(4, np.float32))]), timeout=10)

    _assert_error(caught.value, CODE.NOT_FOUND, UnknownKeyError, "'fc.bias'", "holds none",
                  "--checkpoint-dir")
    assert wire.stats(server).slices == 0


def test_push_to_a_replicated_server_holding_nothing_says_it_rejoins_as_a_backup(start_server, wire):
    # With replicas, a server restarted at a dead primary's address answers before the scheduler has
    # published the failover: the sender's layout is stale, and a checkpoint is not what it lacks.
    server = start_server(ServerSettings(static_quorum={"w0": GENERATION}, replicas=1))

    with pytest.raises(grpc.RpcError) as caught:
        wire.stub(server).Push(pb.PushRequest(stamp=wire.stamp("w0", 3, GENERATION), gradients=[
            wire.tensor("fc.bias", np.ones(4, np.float32))]), timeout=10)

    _assert_error(caught.value, CODE.NOT_FOUND, UnknownKeyError, "'fc.bias'", "holds none",
                  "rejoins as a backup", "predates the failover")
    assert "--checkpoint-dir" not in caught.value.details()
    assert wire.stats(server).slices == 0


def test_unary_message_over_the_servers_limit_is_refused_before_it_reaches_the_store(start_server, wire):
    # gRPC's limit is raised to fit one Exchange frame whatever is asked for: that is the floor.
    limit = CHUNK_BYTES + FRAME_SLACK_BYTES
    server = start_server(ServerSettings(static_quorum={"w0": 0}), max_message_bytes=2**20)
    layer = np.zeros(3 * 2**20 // 4, np.float32)  # 3 MiB: each fits, both in one Push do not
    for key in ("a", "b"):
        wire.declare(server, JOB, {key: layer})
    request = pb.PushRequest(stamp=wire.stamp("w0", 0), gradients=[
        wire.tensor(key, np.ones_like(layer)) for key in ("a", "b")])
    assert request.ByteSize() > limit

    with pytest.raises(grpc.RpcError) as caught:
        wire.stub(server).Push(request, timeout=10)

    err = caught.value
    assert err.code() == CODE.RESOURCE_EXHAUSTED
    assert str(request.ByteSize()) in err.details() and str(limit) in err.details(), err.details()
    # gRPC itself refuses the message: no servicer ran, so the class follows from the code alone.
    assert ERROR_TYPE_KEY not in dict(err.trailing_metadata() or ())
    assert type(error_from_rpc_error(err)) is MessageTooLargeError
    stats = wire.stats(server)
    assert (stats.pushes_applied, stats.pushes_dropped, stats.max_version) == (0, 0, 0)
    for key in ("a", "b"):
        assert wire.read(server, [key]) == {key: (layer.tobytes(), 0)}


# ---- malformed Exchange streams ----

def _push_header(w, *metas: pb.SliceMeta, worker: str = "w0", clock: int = 1,
                 generation: int = GENERATION) -> bytes:
    return w.header_frame(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=w.stamp(worker, clock, generation),
                          push=list(metas))


BIAS = ("fc.bias", "float32", [4])  # 16 bytes
WEIGHT = ("fc.weight", "float32", [12])  # 48 bytes

BAD_EXCHANGES: dict[str, tuple[Callable, grpc.StatusCode, type[PSError], tuple]] = {
    "no header: the stream ends at once": (
        lambda w: [],
        CODE.INVALID_ARGUMENT, EmptyRequestError, ("before its header",)),
    "data before the header": (
        lambda w: [w.data_frame(np.ones(4, np.float32)), _push_header(w, w.meta(*BIAS))],
        CODE.INVALID_ARGUMENT, InvalidArgumentError, ("must be a header", "got data")),
    "a second header after data": (
        lambda w: [_push_header(w, w.meta(*BIAS)), w.data_frame(np.ones(2, np.float32)),
                   _push_header(w, w.meta(*BIAS))],
        CODE.INVALID_ARGUMENT, InvalidArgumentError, ("only data frames",)),
    "more bytes than announced": (
        lambda w: [_push_header(w, w.meta(*BIAS)), w.data_frame(np.ones(5, np.float32))],
        CODE.INVALID_ARGUMENT, PayloadSizeError, ("20 bytes", "announced 16")),
    "fewer bytes, then the end": (
        lambda w: [_push_header(w, w.meta(*WEIGHT), w.meta(*BIAS)), w.data_frame(np.ones(7, np.float32))],
        CODE.INVALID_ARGUMENT, PayloadSizeError, ("after 28 bytes", "announced 64", "'fc.weight'")),
    "unknown key in the header": (
        lambda w: [_push_header(w, w.meta("fc.nope", "float32", [4])), w.data_frame(np.ones(4, np.float32))],
        CODE.NOT_FOUND, UnknownKeyError, ("'fc.nope'",)),
    "wrong shape in the header": (
        lambda w: [_push_header(w, w.meta("fc.weight", "float32", [4, 3])),
                   w.data_frame(np.ones(12, np.float32))],
        CODE.INVALID_ARGUMENT, ShapeMismatchError, ("'fc.weight'", "(4, 3)", "(12,)")),
    "wrong dtype in the header": (
        lambda w: [_push_header(w, w.meta("fc.bias", "float64", [4])), w.data_frame(np.ones(4, np.float64))],
        CODE.INVALID_ARGUMENT, DTypeMismatchError, ("'fc.bias'", "float64", "float32")),
    "clock far in the future": (
        lambda w: [_push_header(w, w.meta(*BIAS), clock=1000), w.data_frame(np.ones(4, np.float32))],
        CODE.OUT_OF_RANGE, FutureClockError, ("'fc.bias'", "clock 1000", "version is 1")),
    "stale generation": (
        lambda w: [_push_header(w, w.meta(*BIAS), generation=GENERATION - 1),
                   w.data_frame(np.ones(4, np.float32))],
        CODE.FAILED_PRECONDITION, StaleGenerationError,
        ("'w0'", f"generation {GENERATION - 1}", f"generation {GENERATION}")),
    "push from a non-member": (
        lambda w: [_push_header(w, w.meta(*BIAS), worker="intruder"), w.data_frame(np.ones(4, np.float32))],
        CODE.FAILED_PRECONDITION, StaleGenerationError, ("'intruder'", "['w0', 'w1']")),
    "nothing to push or pull": (
        lambda w: [_push_header(w)],
        CODE.INVALID_ARGUMENT, EmptyRequestError, ("'w0'", "nothing to push or pull")),
    "no operation": (
        lambda w: [w.header_frame(stamp=w.stamp("w0", 1, GENERATION), push=[w.meta(*BIAS)]),
                   w.data_frame(np.ones(4, np.float32))],
        CODE.INVALID_ARGUMENT, InvalidArgumentError, ("header.op", "got 0")),
}


@pytest.mark.parametrize("case", list(BAD_EXCHANGES))
def test_malformed_exchange_is_refused_naming_the_values_and_leaves_the_store_unchanged(primed, wire, case):
    build, code, error_class, values = BAD_EXCHANGES[case]
    before = primed.state()

    with pytest.raises(grpc.RpcError) as caught:
        wire.exchange(primed.server, build(wire))

    _assert_error(caught.value, code, error_class, *values)
    assert primed.state() == before


# ---- PSClient: the server's error class, re-raised ----

GRADS = {k: np.ones_like(v) for k, v in PARAMS.items()}
WITH_EXTRA_KEY = [*(ParamSpec(k, "float32", v.shape) for k, v in PARAMS.items()),
                  ParamSpec("fc.extra", "float32", (2,))]


def _declared(client):
    client.declare(PARAMS, JOB)
    return client


# name -> (call given a PSClient factory and the server, class, values the message must name)
CLIENT_CALLS: dict[str, tuple[Callable, type[PSError], tuple]] = {
    "declare with another shape": (
        lambda make, server: make("w0").declare({"fc.weight": np.ones((4, 4), np.float32)}, JOB),
        ShapeMismatchError, ("'fc.weight'", "(16,)", "(12,)")),
    "declare with another dtype": (
        lambda make, server: make("w0").declare({"fc.bias": np.ones(4, np.float64)}, JOB),
        DTypeMismatchError, ("'fc.bias'", "float64", "float32")),
    "declare with another job": (
        lambda make, server: make("w0").declare(PARAMS, JobConfig(mode="async")),
        LayoutConflictError, ("mode='async'", "mode='sync'")),
    "pull of a key the server does not hold": (
        lambda make, server: make("w0", layout=plan_layout(WITH_EXTRA_KEY, [server.address])).pull(
            1, keys=["fc.extra"]),
        UnknownKeyError, ("'fc.extra'",)),
    "push at a clock far in the future": (
        lambda make, server: _declared(make("w0")).push_pull(GRADS, 1000),
        FutureClockError, ("clock 1000", "version is 1")),
    "push from a stale generation": (
        lambda make, server: _declared(make("w0", generation=GENERATION - 1)).push_pull(GRADS, 1),
        StaleGenerationError, ("'w0'", f"generation {GENERATION - 1}", f"generation {GENERATION}")),
    "push from a non-member": (
        lambda make, server: _declared(make("intruder")).push_pull(GRADS, 1),
        StaleGenerationError, ("'intruder'", "['w0', 'w1']")),
}


@pytest.mark.parametrize("case", list(CLIENT_CALLS))
def test_psclient_reraises_the_servers_error_class_and_the_store_is_unchanged(primed, new_client, case):
    call, error_class, values = CLIENT_CALLS[case]

    def make(worker: str, **kwargs: object):
        kwargs.setdefault("generation", GENERATION)
        # The gRPC mapping of errors (the fast paths answer the same: tests/service/test_transports.py).
        kwargs.setdefault("transport", "grpc")
        return new_client([primed.server], worker, **kwargs)

    before = primed.state()

    with pytest.raises(PSError) as caught:
        call(make, primed.server)

    assert type(caught.value) is error_class, repr(caught.value)
    for value in values:
        assert str(value) in str(caught.value)
    assert isinstance(caught.value.__cause__, grpc.RpcError)  # it came from the server
    assert primed.state() == before


# ---- waits that can never end ----

def _park_w0_at_clock_2(primed, wire) -> None:
    """w0 pushes clock 1; w1 never does, so clock 1 never completes."""
    wire.stub(primed.server).Push(pb.PushRequest(
        stamp=wire.stamp("w0", 1, GENERATION),
        gradients=[wire.tensor(k, np.ones(v.size, v.dtype)) for k, v in PARAMS.items()]), timeout=10)


def test_sync_pull_that_cannot_be_satisfied_times_out_naming_the_missing_worker_and_clock(primed, wire):
    _park_w0_at_clock_2(primed, wire)
    before = primed.state()

    with pytest.raises(grpc.RpcError) as caught:
        wire.stub(primed.server).Pull(pb.PullRequest(
            stamp=wire.stamp("w0", 2, GENERATION), slices=[wire.slice_id(k) for k in KEYS], timeout_ms=200),
            timeout=10)

    _assert_error(caught.value, CODE.DEADLINE_EXCEEDED, PullTimeoutError, "'w0'", "clock 2", "['w1']",
                  "clock 1")
    stats = wire.stats(primed.server)
    assert (stats.pulls_timed_out, stats.pulls_waiting) == (1, 0)
    assert primed.state() == before


def test_psclient_pull_timeout_names_the_missing_worker_and_clock(primed, wire, new_client):
    _park_w0_at_clock_2(primed, wire)
    client = new_client([primed.server], "w0", generation=GENERATION, timeout_s=0.3)
    client.declare(PARAMS, JOB)

    with pytest.raises(PullTimeoutError) as caught:
        client.pull(2)

    assert "['w1']" in str(caught.value) and "clock 1" in str(caught.value), str(caught.value)


def _assert_error(err: grpc.RpcError, code: grpc.StatusCode, error_class: type[PSError],
                  *values: object) -> None:
    """The status code, every value in the message, and the class named in trailing metadata."""
    assert err.code() == code, f"{err.code()}: {err.details()}"
    for value in values:
        assert str(value) in err.details(), f"{value!r} not in {err.details()!r}"
    assert dict(err.trailing_metadata() or ()).get(ERROR_TYPE_KEY) == error_class.__name__
    assert type(error_from_rpc_error(err)) is error_class
