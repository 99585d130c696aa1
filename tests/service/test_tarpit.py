"""The wasted-request tarpit on a real server (ps_server/tarpit.py): a connection that keeps sending
requests that are refused or change nothing is refused unread; one that waits as asked is read again."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.rpc import channel_options, identity
from pshard.common.rpc_status import RETRY_AFTER_KEY

from tests.service.conftest import WAIT_S, ServerSettings, Wire

MIB = 2**20
ASYNC = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=0.1))
PUSH = "/pshard.api.v1.ParameterServerService/Push"


def code_and_hint(call: grpc.UnaryUnaryMultiCallable, body: bytes) -> tuple[grpc.StatusCode, int | None]:
    try:
        call(body, timeout=WAIT_S)
    except grpc.RpcError as err:
        hints = [int(v) for k, v in err.trailing_metadata() or () if k == RETRY_AFTER_KEY]
        return err.code(), hints[0] if hints else None
    return grpc.StatusCode.OK, None


@pytest.fixture
def push(start_server, wire):
    """A server holding "w" (1 MiB), and a Push call of raw bytes on a connection of its own."""
    server = start_server(ServerSettings(default_job=ASYNC, waste_limit_bytes=8 * MIB))
    wire.declare(server, ASYNC, {"w": np.zeros(MIB // 4, np.float32)})
    # A channel option nobody else uses: a connection of its own, not shared with `wire`'s.
    channel = grpc.insecure_channel(server.address, options=[*channel_options(), ("pshard.test.tarpit", 1)])
    yield server, channel.unary_unary(PUSH, request_serializer=identity, response_deserializer=identity)
    channel.close()


def test_a_connection_wasting_requests_is_refused_unread_with_a_hint_others_are_served(push, wire: Wire):
    server, call = push
    unknown = Wire.push_request("flood", 0, {"nope": np.ones(MIB, np.float32)}).SerializeToString()
    assert code_and_hint(call, unknown)[0] == grpc.StatusCode.NOT_FOUND  # read: 4 MiB wasted
    assert code_and_hint(call, unknown)[0] == grpc.StatusCode.NOT_FOUND  # 8 MiB: held from now on
    served = server.running.handlers.requests.served
    started = time.monotonic()
    code, hint = code_and_hint(call, unknown)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert hint == 200
    assert time.monotonic() - started >= 0.2  # held before the refusal: a flood sends one per hold
    code, hint = code_and_hint(call, unknown)  # back at once, not after the hint: held twice as long
    assert (code, hint) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 400)
    assert server.running.tarpit is not None and server.running.tarpit.held == 2
    assert server.running.handlers.requests.served == served  # the held ones never reached a handler
    # Other connections are served as usual meanwhile.
    assert wire.read(server, ["w"])["w"][1] == 0


def test_duplicate_pushes_are_wasted_too_and_a_client_that_waits_is_read_again(push, wire: Wire):
    server, call = push
    grad = Wire.push_request("w0", 0, {"w": np.full(MIB // 4, 1e-3, np.float32)}).SerializeToString()
    assert code_and_hint(call, grad)[0] == grpc.StatusCode.OK  # applied
    for _ in range(8):  # the same (worker, clock, slice) again: dropped, 8 MiB of nothing
        assert code_and_hint(call, grad)[0] == grpc.StatusCode.OK
    code, hint = code_and_hint(call, grad)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and hint is not None
    time.sleep(2 * hint / 1000)  # polling: what a client that honours the hint does
    next_step = Wire.push_request("w0", 1, {"w": np.full(MIB // 4, 1e-3, np.float32)}).SerializeToString()
    assert code_and_hint(call, next_step)[0] == grpc.StatusCode.OK  # read, applied: the streak is forgotten
    assert code_and_hint(call, grad)[0] == grpc.StatusCode.OK  # a duplicate is read again
    assert wire.read(server, ["w"])["w"][1] == 2  # exactly the two clocks were applied
