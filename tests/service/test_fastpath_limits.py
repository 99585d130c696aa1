"""Every length of a fast-path frame is checked before anything is allocated or read (issue 23, items 1, 2).

- A request frame that announces more data than the session's request region (58 bytes announcing
  2**49 or 2**62) closes its connection at once: the server's RSS does not move and health keeps
  answering. One whose header is refused but whose data fits is answered with the error, its bytes
  read into one reused buffer and dropped, and the connection serves the next request.
- Before its hello a connection holds a few KiB: a first frame that is not a hello of at most
  MAX_HELLO_BYTES is refused on its header, and past MAX_GREETING connections waiting for their hello
  the newest are closed at once.

The RSS tests run the server as a process of its own, so its RSS is not mixed with this process's.
"""

from __future__ import annotations

import contextlib
import socket
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pshard.client.ps_client import PSClient
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.rpc.options import channel_options
from pshard.common.wire import fastwire
from pshard.ps_server.transport.fastconn import HELLO_TIMEOUT_S, MAX_HELLO_BYTES, Sink
from pshard.ps_server.transport.fastpath import MAX_GREETING

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import parameter_server_pb2_grpc as pb_grpc
from pshard.api.v1 import tensor_pb2
from tests.service.conftest import WAIT_S
from tests.service.test_memory_bounds import server_rss_bytes

MIB = 2**20
ASYNC = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=0.1))
F32 = tensor_pb2.DTYPE_FLOAT32


def test_a_sink_of_any_size_holds_one_buffer():
    sink = Sink(2**62)
    assert len(sink) == 2**42 and len(sink[0]) == MIB and sink[len(sink) - 1] is sink[0]
    tail = Sink(3 * MIB + 5)
    assert [len(t) for t in tail] == [MIB, MIB, MIB, 5]
    assert list(Sink(0)) == []


def _server(procs):
    server = procs.python("ps", "-m", "pshard.ps_server", "--bind", "127.0.0.1:0", "--no-scheduler",
                          "--workers", "w0", "--mode", "async", "--lr", "0.1", "--transport", "tcp",
                          "--log-level", "WARNING")
    port = int(server.wait_for_line(r"listening on port (\d+)", WAIT_S).group(1))
    address = f"127.0.0.1:{port}"
    with PSClient([address], "w0", timeout_s=WAIT_S, transport="grpc") as client:
        client.declare({"w": np.zeros(16, np.float32)}, ASYNC)
    return server, address, _open(address).port


def _open(address: str, request_bytes: int = 4096) -> pb.OpenTransportResponse:
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        return pb_grpc.ParameterServerServiceStub(channel).OpenTransport(pb.OpenTransportRequest(
            worker_id="w0", kind=pb.TRANSPORT_KIND_TCP, request_bytes=request_bytes, reply_bytes=4096),
            timeout=WAIT_S)


def _session(address: str, fast_port: int, request_bytes: int = 4096) -> socket.socket:
    reply = _open(address, request_bytes)
    sock = socket.create_connection(("127.0.0.1", fast_port), timeout=WAIT_S)
    fastwire.send_frame(sock, fastwire.HELLO, pb.TransportHello(session=reply.session, secret=reply.secret)
                        .SerializeToString())
    return sock


def _refused_header(shape: list[int], key: str = "w") -> bytes:
    return pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=pb.Stamp(worker_id="w0"), push=[
        pb.SliceMeta(id={"key": key}, dtype=F32, shape=shape)]).SerializeToString()


def _closed(sock: socket.socket) -> bool:
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def _health_s(address: str) -> float:
    with grpc.insecure_channel(address) as channel:
        started = time.perf_counter()
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        return time.perf_counter() - started


@pytest.mark.parametrize("data_len", [2**49, 2**62])
def test_a_58_byte_frame_announcing_petabytes_closes_its_connection_and_costs_no_memory(procs, data_len):
    server, address, fast_port = _server(procs)
    _health_s(address)  # warm
    before = server_rss_bytes(server.pid)
    meta = _refused_header([-1], key="fc1.weight")  # the frame: 58 bytes
    frame = fastwire.encode_header(fastwire.REQUEST, len(meta), data_len) + meta
    assert len(frame) == 58
    with _session(address, fast_port) as sock:
        sock.sendall(frame)
        assert _closed(sock), "the server kept a connection announcing more than its region"
    probe_s = _health_s(address)
    grown = server_rss_bytes(server.pid) - before
    print(f"\n58-byte frame announcing {data_len} bytes: server RSS {before / MIB:.0f} MiB -> "
          f"{(before + grown) / MIB:.0f} MiB, health probe {probe_s * 1e3:.1f} ms")
    assert grown < 16 * MIB, f"server RSS grew {grown / MIB:.0f} MiB"
    assert probe_s < 2.0, f"health took {probe_s:.1f} s"
    assert server.alive(), server.output()
    assert "Traceback" not in server.output() and "MemoryError" not in server.output()


def test_a_refused_header_whose_data_fits_is_answered_and_the_connection_serves_on(procs):
    _, address, fast_port = _server(procs)
    data = np.ones(3 * MIB // 4, np.float32)  # 3 MiB: read through the sink in chunks
    with _session(address, fast_port, request_bytes=4 * MIB) as sock:
        fastwire.send_frame(sock, fastwire.REQUEST, _refused_header([1, -1]), [data])
        kind, meta, n = fastwire.recv_frame_head(sock)
        reply = pb.TransportReply.FromString(meta)
        assert kind == fastwire.REPLY and not n and reply.error_type == "InvalidArgumentError", reply
        pull = pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=pb.Stamp(worker_id="w0"),
                                 pull=[{"key": "w"}])
        fastwire.send_frame(sock, fastwire.REQUEST, pull.SerializeToString())
        pulled = b""
        while (frame := fastwire.recv_frame_head(sock))[0] == fastwire.SLICE:  # a session's first pull
            pulled += fastwire.recv_exact(sock, frame[2])
        kind, meta, n = frame
        reply = pb.TransportReply.FromString(meta)
        assert kind == fastwire.REPLY and not reply.error_type, reply
        pulled += fastwire.recv_exact(sock, n)
        assert np.frombuffer(pulled, np.float32).tolist() == [0.0] * 16


def test_unauthenticated_connections_announcing_big_metadata_cost_no_memory(procs):
    """Issue 23 item 2: 20 connections each announcing 16 MiB of hello metadata took 66 -> 713 MiB."""
    server, address, fast_port = _server(procs)
    before = server_rss_bytes(server.pid)
    junk = bytes(fastwire.MAX_META_BYTES)
    socks = [socket.create_connection(("127.0.0.1", fast_port), timeout=WAIT_S) for _ in range(24)]
    try:
        for sock in socks:
            # Refused on the header, while the rest is on its way: the send may break.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(fastwire.encode_header(fastwire.HELLO, fastwire.MAX_META_BYTES, 0) + junk)
        peak = server_rss_bytes(server.pid)
        assert all(_closed(sock) for sock in socks)
    finally:
        for sock in socks:
            sock.close()
    grown = max(peak, server_rss_bytes(server.pid)) - before
    print(f"\n24 connections announcing 16 MiB hellos: server RSS {before / MIB:.0f} MiB, "
          f"+{grown / MIB:.1f} MiB")
    assert grown < 16 * MIB, f"server RSS grew {grown / MIB:.0f} MiB"
    assert _health_s(address) < 2.0


def _wait(condition, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_connections_past_the_cap_without_a_hello_are_refused_at_once(start_server, new_client):
    server = start_server()
    new_client([server], "w0", transport="grpc").declare({"w": np.zeros(16, np.float32)}, ASYNC)
    fast = server.running.fast
    extra = 8
    socks = [socket.create_connection(("127.0.0.1", fast.port), timeout=WAIT_S)
             for _ in range(MAX_GREETING + extra)]
    try:
        _wait(lambda: fast.refused_greetings == extra, f"refused {fast.refused_greetings}, expected {extra}",
              HELLO_TIMEOUT_S)
        closed = [s for s in socks if _closed_now(s)]
        assert len(closed) == extra and fast.greeting == MAX_GREETING
        # Those waiting are closed at the hello deadline; then a worker gets on as usual.
        _wait(lambda: fast.greeting == 0, "connections without a hello outlived the deadline")
        assert all(_closed(s) for s in socks)
    finally:
        for sock in socks:
            sock.close()
    client = new_client([server], "w0", transport="tcp")
    client.declare({"w": np.zeros(16, np.float32)}, ASYNC)
    client.push_pull({"w": np.ones(16, np.float32)}, 0, {"w": np.empty(16, np.float32)})
    assert client.transports == ["tcp"]


def _closed_now(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        sock.setblocking(True)


def test_a_first_frame_that_is_not_a_small_hello_is_refused_on_its_header(start_server):
    server = start_server()
    fast = server.running.fast
    for header in (fastwire.encode_header(fastwire.HELLO, MAX_HELLO_BYTES + 1, 0),
                   fastwire.encode_header(fastwire.HELLO, 10, 1),
                   fastwire.encode_header(fastwire.REQUEST, 10, 0)):
        with socket.create_connection(("127.0.0.1", fast.port), timeout=WAIT_S) as sock:
            sock.sendall(header)  # no metadata follows: refused on the header alone
            assert _closed(sock), header
    _wait(lambda: fast.greeting == 0, "refused connections still counted as waiting for a hello")


def test_a_header_naming_too_many_slices_is_refused_before_they_are_decoded(start_server, wire):
    server = start_server()
    wire.declare(server, ASYNC, {"w": np.zeros(16, np.float32)})
    opened = _open(server.address)
    pulls = pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=pb.Stamp(worker_id="w0"),
                              pull=[{"key": "w"}] * 70_000).SerializeToString()
    with socket.create_connection(("127.0.0.1", opened.port), timeout=WAIT_S) as sock:
        hello = pb.TransportHello(session=opened.session, secret=opened.secret)
        fastwire.send_frame(sock, fastwire.HELLO, hello.SerializeToString())
        fastwire.send_frame(sock, fastwire.REQUEST, pulls)
        kind, meta, n = fastwire.recv_frame_head(sock)
    reply = pb.TransportReply.FromString(meta)
    assert kind == fastwire.REPLY and not n and reply.error_type == "InvalidArgumentError", reply
    assert reply.error_message.startswith("fast-path request pull: got 70000 slices"), reply.error_message
