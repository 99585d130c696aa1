"""The wasted-request tarpit on a real server (ps_server/transport/tarpit.py): a connection that keeps sending
requests that are refused or change nothing is refused unread; one that waits as asked is read again."""

from __future__ import annotations

import socket
import time

import grpc
import numpy as np
import pytest
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.rpc.options import channel_options, identity
from pshard.common.rpc.status import RETRY_AFTER_KEY
from pshard.common.wire import fastwire

from pshard.api.v1 import parameter_server_pb2 as pb
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


# ---- issue 23, item 7: pushes from outside the quorum, and the fast paths ----

@pytest.fixture
def member_server(start_server, wire):
    """A server whose quorum is w0 alone, holding "w" (1 MiB), and a tarpit of 8 MiB."""
    server = start_server(ServerSettings(default_job=ASYNC, waste_limit_bytes=8 * MIB,
                                         static_quorum={"w0": 0}))
    wire.declare(server, ASYNC, {"w": np.zeros(MIB // 4, np.float32)})
    return server


def test_pushes_from_outside_the_quorum_are_held_like_any_refusal(member_server, wire: Wire):
    channel = grpc.insecure_channel(member_server.address,
                                    options=[*channel_options(), ("pshard.test.tarpit", 2)])
    call = channel.unary_unary(PUSH, request_serializer=identity, response_deserializer=identity)
    intruder = Wire.push_request("intruder", 0, {"w": np.ones(MIB // 4, np.float32)}).SerializeToString()
    try:
        for _ in range(8):  # read: 1 MiB of FAILED_PRECONDITION each, then held
            assert code_and_hint(call, intruder)[0] == grpc.StatusCode.FAILED_PRECONDITION
        assert code_and_hint(call, intruder) == (grpc.StatusCode.RESOURCE_EXHAUSTED, 200)
    finally:
        channel.close()
    assert wire.read(member_server, ["w"])["w"][1] == 0


def _fast_push(sock, header: bytes, data: np.ndarray) -> tuple[pb.TransportReply, float]:
    started = time.monotonic()
    fastwire.send_frame(sock, fastwire.REQUEST, header, [data])
    kind, meta, n = fastwire.recv_frame_head(sock)
    assert kind == fastwire.REPLY and not n
    return pb.TransportReply.FromString(meta), time.monotonic() - started


def test_a_fast_path_session_wasting_requests_is_not_read_for_its_hold(member_server, wire: Wire):
    reply = wire.stub(member_server).OpenTransport(pb.OpenTransportRequest(
        worker_id="intruder", kind=pb.TRANSPORT_KIND_TCP, request_bytes=2 * MIB, reply_bytes=4096),
        timeout=WAIT_S)
    header = pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=pb.Stamp(worker_id="intruder"),
                               push=[Wire.meta("w", "float32", [MIB // 4])]).SerializeToString()
    grads = np.ones(MIB // 4, np.float32)
    tarpit = member_server.running.tarpit
    assert tarpit is not None
    with socket.create_connection(("127.0.0.1", reply.port), timeout=WAIT_S) as sock:
        hello = pb.TransportHello(session=reply.session, secret=reply.secret)
        fastwire.send_frame(sock, fastwire.HELLO, hello.SerializeToString())
        for _ in range(8):  # 1 MiB each: read and refused, 8 MiB in a row
            refused, _ = _fast_push(sock, header, grads)
            assert refused.error_type == "StaleGenerationError", refused
        deadline = time.monotonic() + WAIT_S  # counted once the reply is written: polled
        while tarpit.held < 1:
            assert time.monotonic() < deadline, "the session was never held"
            time.sleep(0.01)
        refused, took_s = _fast_push(sock, header, grads)  # not read before the hold is over
        assert refused.error_type == "StaleGenerationError" and took_s >= 0.15, (refused, took_s)
        refused, took_s = _fast_push(sock, header, grads)  # wasted again: held twice as long
        assert took_s >= 0.3, took_s
    assert wire.read(member_server, ["w"])["w"][1] == 0
