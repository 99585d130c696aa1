"""The pipelined TCP fast path on a real server: a large request is applied slice by slice as its
bytes arrive, and pulled slices go out before the reply's summary; a connection lost between two
slices leaves the ones that arrived applied, and the step resent over gRPC applies only the rest."""

from __future__ import annotations

import socket
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pshard.common.errors import PSError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.wire import fastwire
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb
from tests.service.conftest import WAIT_S

ASYNC = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=1.0))
SYNC = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=1.0))
N = 2**19  # 2 MB of float32 per slice: a request of two is served while it arrives
PARAMS = {"a": np.zeros(N, np.float32), "b": np.zeros(N, np.float32)}


def _connect(wire, server, worker: str) -> socket.socket:
    """A raw TCP session of `worker`, its hello sent."""
    opened = wire.stub(server).OpenTransport(pb.OpenTransportRequest(
        worker_id=worker, kind=pb.TRANSPORT_KIND_TCP, request_bytes=8 * N, reply_bytes=8 * N), timeout=WAIT_S)
    sock = socket.create_connection(("127.0.0.1", opened.port), timeout=WAIT_S)
    hello = pb.TransportHello(session=opened.session, secret=opened.secret).SerializeToString()
    fastwire.send_frame(sock, fastwire.HELLO, hello)
    return sock


def _header(wire, worker: str, clock: int) -> bytes:
    return pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=wire.stamp(worker, clock),
                             push=[wire.meta(k, "float32", (N,)) for k in PARAMS],
                             pull=[wire.slice_id(k) for k in PARAMS], timeout_ms=int(WAIT_S * 1000)
                             ).SerializeToString()


def test_a_connection_reset_between_two_slices_falls_back_and_applies_nothing_twice(start_server, new_client,
                                                                                    wire):
    server = start_server(ServerSettings())
    w0 = new_client([server], "w0", transport="grpc")
    w0.declare(PARAMS, ASYNC)
    ones = np.ones(N, np.float32)
    meta = _header(wire, "w0", 0)
    with _connect(wire, server, "w0") as sock:
        # Slice a whole and half of b: the request announces both, and the connection goes first.
        sock.sendall(fastwire.encode_header(fastwire.REQUEST, len(meta), 2 * ones.nbytes) + meta)
        sock.sendall(ones)
        sock.sendall(ones[:N // 2])
        wire.wait_stats(server, lambda s: s.pushes_applied == 1, "slice a applied before b arrived")
        # a is pulled back as soon as it is applied, ahead of the reply: before b is in.
        kind, slice_meta, data_len = fastwire.recv_frame_head(sock)
        assert (kind, fastwire.decode_slice_meta(slice_meta), data_len) == (fastwire.SLICE, 0, ones.nbytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # reset
    # The step again, whole, over gRPC: a is a duplicate, only b is applied.
    weights = w0.push_pull({k: np.ones(N, np.float32) for k in PARAMS}, 0)
    assert (w0.last_result.applied, w0.last_result.dropped) == (1, 1)
    for key in PARAMS:
        np.testing.assert_array_equal(weights[key], np.full(N, -1.0, np.float32))
    stats = wire.stats(server)
    assert (stats.pushes_applied, stats.pushes_dropped) == (2, 1)


def test_sync_slices_sent_from_the_store_are_each_one_versions_bytes(start_server, new_client):
    """Over plain TCP in sync mode the pulled slices are sent from the values themselves (no copy
    into the session's slot): every worker still gets exactly the version its step produced."""
    server = start_server(ServerSettings(static_quorum={"w0": 0, "w1": 0}))
    workers = [new_client([server], w, transport="tcp") for w in ("w0", "w1")]
    for w in workers:
        w.declare(PARAMS, SYNC)

    def steps(rank: int) -> list[dict[str, np.ndarray]]:
        seen = []
        for clock in range(4):
            grads = {k: np.full(N, rank + 1.0, np.float32) for k in PARAMS}
            seen.append({k: v.copy() for k, v in workers[rank].push_pull(grads, clock).items()})
        return seen

    with ThreadPoolExecutor(2) as pool:
        results = [f.result(timeout=WAIT_S) for f in [pool.submit(steps, r) for r in range(2)]]
    for seen in results:
        for clock, weights in enumerate(seen):  # each step averages 1 and 2: down by 1.5
            for value in weights.values():
                np.testing.assert_array_equal(value, np.full(N, -1.5 * (clock + 1), np.float32))
    assert all(w.transports == ["tcp"] for w in workers)


def test_a_large_push_refused_at_its_header_is_answered_and_the_path_serves_the_next_step(start_server,
                                                                                          new_client, wire):
    """The refusal (a clock from the future, in sync mode) can come while the worker still sends the
    request's bytes: the server reads them to the end, and the next request on the path is served."""
    server = start_server(ServerSettings(static_quorum={"w0": 0}))
    w0 = new_client([server], "w0", transport="tcp")
    w0.declare(PARAMS, SYNC)
    grads = {k: np.ones(N, np.float32) for k in PARAMS}
    with pytest.raises(PSError, match="clock"):
        w0.push_pull(grads, 5)
    weights = w0.push_pull(grads, 0)
    for key in PARAMS:
        np.testing.assert_array_equal(weights[key], np.full(N, -1.0, np.float32))
    assert w0.transports == ["tcp"]
    assert wire.stats(server).pushes_applied == 2


def test_a_sync_slice_updated_while_it_is_sent_from_the_store_breaks_the_path_not_the_bytes(
        start_server, new_client, wire):
    """The torn-read guard of lending: a reader that stalls mid-pull while the only trainer completes
    the next clock (the values are rewritten under the send) gets the path broken (the worker then
    pulls over gRPC), never a reply that vouches for the bytes it was sent."""
    n = 2**23  # 32 MB in 4 MiB slices: more than the kernel's buffers hold, so the send stalls
    server = start_server(ServerSettings(static_quorum={"w0": 0}))
    w0 = new_client([server], "w0", transport="grpc")
    w0.declare({"a": np.zeros(n, np.float32)}, SYNC)
    parts = [s.slice_key.part for s in w0.layout.slices_on(0)]
    assert len(parts) >= 4
    opened = wire.stub(server).OpenTransport(pb.OpenTransportRequest(
        worker_id="reader", kind=pb.TRANSPORT_KIND_TCP, request_bytes=4 * n, reply_bytes=4 * n),
        timeout=WAIT_S)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)  # before connecting: the window
        sock.settimeout(WAIT_S)
        sock.connect(("127.0.0.1", opened.port))
        hello = pb.TransportHello(session=opened.session, secret=opened.secret).SerializeToString()
        fastwire.send_frame(sock, fastwire.HELLO, hello)
        meta = pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=wire.stamp("reader", 0),
                                 pull=[wire.slice_id("a", p) for p in parts],
                                 timeout_ms=int(WAIT_S * 1000)).SerializeToString()
        sock.sendall(fastwire.encode_header(fastwire.REQUEST, len(meta), 0) + meta)
        kind, _, data_len = fastwire.recv_frame_head(sock)
        assert kind == fastwire.SLICE
        # The send is under way and stalled on our window: the clock completes under it.
        weights = w0.push_pull({"a": np.ones(n, np.float32)}, 0)
        np.testing.assert_array_equal(weights["a"], np.full(n, -1.0, np.float32))
        slices = 0
        while kind == fastwire.SLICE:
            slices += 1
            fastwire.discard(sock, data_len)
            kind, reply_meta, data_len = fastwire.recv_frame_head(sock)
    assert kind == fastwire.REPLY
    reply = pb.TransportReply.FromString(reply_meta)
    assert reply.error_type == "TransportBroken", (slices, reply)
    assert "changed while it was sent" in reply.error_message
    assert slices < len(parts)  # broken at the slice that changed, not after them all
