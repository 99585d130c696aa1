"""Fast-path refusals are counted where the gRPC interceptor counts its own (pshard_auth_refused_total).

A peer without a session's secret (TCP or shared memory) is UNAUTHENTICATED, a session acting for
another worker PERMISSION_DENIED: both under the Exchange method, whose requests the fast paths carry.
"""

from __future__ import annotations

import socket

import numpy as np
from pshard.common.rpc.options import EXCHANGE_METHOD
from pshard.common.wire import fastwire
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb
from tests.service.conftest import WAIT_S
from tests.service.test_fastpath_security import (  # noqa: F401  (shm_dir: a fixture)
    ASYNC,
    PARAMS,
    _grads,
    _refused_over_shm,
    _refused_over_tcp,
    _weights,
    shm_dir,
)


def _hello(session: int, secret: bytes) -> bytes:
    return pb.TransportHello(session=session, secret=secret).SerializeToString()


def _open(wire, server, kind: pb.TransportKind) -> pb.OpenTransportResponse:
    return wire.stub(server).OpenTransport(pb.OpenTransportRequest(
        worker_id="w0", kind=kind, request_bytes=4096, reply_bytes=4096), timeout=WAIT_S)


def test_peers_without_the_session_secret_are_counted_unauthenticated(shm_dir, start_server, new_client,  # noqa: F811
                                                                        wire):
    server = start_server(ServerSettings(shm_dir=str(shm_dir)))
    new_client([server], "w0", transport="grpc").declare(PARAMS, ASYNC)
    refusals = server.running.refusals
    assert refusals is not None and refusals.total() == 0
    tcp, shm = _open(wire, server, pb.TRANSPORT_KIND_TCP), _open(wire, server, pb.TRANSPORT_KIND_SHM)
    wrong = bytes(b ^ 1 for b in tcp.secret)
    assert _refused_over_tcp(server.running.fast.port, _hello(tcp.session, wrong))
    assert _refused_over_tcp(server.running.fast.port, b"\xff garbage")
    assert _refused_over_shm(shm_dir / shm.socket, _hello(shm.session, b""))
    assert refusals.snapshot() == {("UNAUTHENTICATED", EXCHANGE_METHOD): 3}
    # The worker with the secret gets on, and is not counted for it.
    assert not _refused_over_tcp(server.running.fast.port, _hello(tcp.session, tcp.secret))
    assert refusals.total("UNAUTHENTICATED") == 3


def test_a_session_acting_for_another_worker_is_counted_permission_denied(shm_dir, start_server,  # noqa: F811
                                                                           new_client, wire):
    server = start_server(ServerSettings(shm_dir=str(shm_dir)))
    new_client([server], "w0", transport="grpc").declare(PARAMS, ASYNC)
    before = _weights(wire, server)
    session = _open(wire, server, pb.TRANSPORT_KIND_TCP)
    grads = _grads(1.0)["small"]
    header = pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=pb.Stamp(worker_id="w1", clock=0),
                               push=[pb.SliceMeta(id={"key": "small"}, dtype=1, shape=[10])])
    with socket.create_connection(("127.0.0.1", server.running.fast.port), timeout=WAIT_S) as sock:
        fastwire.send_frame(sock, fastwire.HELLO, _hello(session.session, session.secret))
        fastwire.send_frame(sock, fastwire.REQUEST, header.SerializeToString(), [np.ascontiguousarray(grads)])
        kind, meta, n = fastwire.recv_frame_head(sock)
        assert kind == fastwire.REPLY
        fastwire.discard(sock, n)
    reply = pb.TransportReply.FromString(meta)
    assert reply.error_type == "PermissionDeniedError", reply
    assert server.running.refusals.snapshot() == {("PERMISSION_DENIED", EXCHANGE_METHOD): 1}
    assert _weights(wire, server) == before
