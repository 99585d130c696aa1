"""Which outcomes the tarpit counts as wasted (ps_server/transport/tarpit.py): every refusal of what the
client
sent, whatever its code, and no failure of the server's own (issue 23, item 7)."""

from __future__ import annotations

import grpc
import pytest
from pshard.common.errors import (
    InvalidArgumentError,
    LayoutConflictError,
    OverloadedError,
    PermissionDeniedError,
    PSError,
    StaleGenerationError,
    UnknownKeyError,
)
from pshard.common.wire.fastwire import TransportBroken
from pshard.ps_server.transport.fastconn import error_reply
from pshard.ps_server.transport.tarpit import WASTED_CODES, wasted_reply

from pshard.api.v1 import parameter_server_pb2 as pb


def test_a_push_from_outside_the_quorum_is_wasted_on_grpc():
    assert grpc.StatusCode.FAILED_PRECONDITION in WASTED_CODES
    assert {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
            grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.OUT_OF_RANGE} <= WASTED_CODES
    assert not {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE,
                grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL} & WASTED_CODES


@pytest.mark.parametrize("error", [StaleGenerationError("not a live member"), InvalidArgumentError("shape"),
                                   UnknownKeyError("nope"), PermissionDeniedError("as w1"),
                                   LayoutConflictError("differs")], ids=lambda e: type(e).__name__)
def test_fast_path_refusals_are_wasted_whatever_their_code(error):
    assert wasted_reply(error_reply(error))


@pytest.mark.parametrize("error", [TransportBroken("reset"), OverloadedError("busy"), PSError("bug")],
                         ids=lambda e: type(e).__name__)
def test_a_broken_path_or_a_busy_server_is_not_the_clients_waste(error):
    assert not wasted_reply(error_reply(error))


def test_a_fast_path_push_that_changed_nothing_is_wasted_one_that_pulled_is_not():
    dropped = pb.TransportReply()
    dropped.summary.dropped = 2
    assert wasted_reply(dropped)
    pulled = pb.TransportReply(sizes=[4], offsets=[0])
    pulled.summary.dropped = 2
    assert not wasted_reply(pulled)
    applied = pb.TransportReply()
    applied.summary.applied = 1
    assert not wasted_reply(applied)
