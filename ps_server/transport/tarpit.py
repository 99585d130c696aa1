"""gRPC adapter of the wasted-request tarpit (ps_server.transport.budget.WasteTarpit): a flood stops costing
reads.

A unary request is only worth reading if it can do something. A connection whose requests keep
being refused, or keep changing nothing, is a client that ignores its refusals: a buggy retry loop
or a flood. Measured with tests/e2e/test_flood.py (16 connections sending 4 MiB PushPulls back to
back, half of an unknown key, half duplicates), reading and refusing them took half of the event
loop, and a worker stepping beside them over shared memory went from 0.7 ms to 12-15 ms at p99.

So every unary method of pshard's services is served as a stream-unary one, which grpc calls
before it reads the message: the interceptor first asks the tarpit whether the peer may be read.
A held peer's request is answered RESOURCE_EXHAUSTED with a retry hint after the hold, its bytes
never copied into Python (gRPC's flow control stops the rest of them at the window); PSClient
backs off as asked and is read again. Other requests are read and served as usual, and their
outcome (the status code; for Push and PushPull without a pull, whether anything was applied) is
recorded. The cost for a normal call is one awaited read, within the noise of a small call.

The fast paths (ps_server/transport/fastconn.py) cannot refuse a frame unread without losing the stream's
step, so a held session's connection is not read at all for the hold: its next request waits in the
kernel's buffers and the worker's socket, and a flood sends one request per hold there too.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from pshard.common.errors import EmptyRequestError, OverloadedError, PSError, error_classes
from pshard.common.rpc.status import abort
from pshard.ps_server.transport.budget import WasteTarpit

from pshard.api.v1 import parameter_server_pb2 as pb

log = logging.getLogger("pshard.ps")

# What a request can come back with without being wasted: served, or not served for the server's own
# reasons (its load: clients back off from RESOURCE_EXHAUSTED on their own; a deadline; the server not
# ready or failing). Every other code is a refusal of what the client sent, FAILED_PRECONDITION
# included: a push from an id outside the quorum is read in full and refused as StaleGenerationError, and
# a flood of them cost as much as one of unknown keys (issue 23, item 7).
NOT_WASTED_CODES = frozenset({
    grpc.StatusCode.OK, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.DATA_LOSS})
WASTED_CODES = frozenset(code for code in grpc.StatusCode if code not in NOT_WASTED_CODES)
# Push-only replies: (applied, dropped) fit in a few bytes; a reply with pulled slices is never wasted.
_PUSH_REPLIES: dict[str, type[pb.PushResponse] | type[pb.PushPullResponse]] = {
    "/pshard.api.v1.ParameterServerService/Push": pb.PushResponse,
    "/pshard.api.v1.ParameterServerService/PushPull": pb.PushPullResponse,
}
_PUSH_REPLY_MAX_BYTES = 32


_NOT_WASTED_NAMES = frozenset(code.name for code in NOT_WASTED_CODES)


def wasted_reply(reply: pb.TransportReply) -> bool:
    """A fast-path reply that refuses what the client sent (as WASTED_CODES), or a push-only request
    whose every gradient was dropped. A broken path (TransportBroken) or an unknown error is not."""
    if reply.error_type:
        cls = error_classes().get(reply.error_type, PSError)
        return cls.status not in _NOT_WASTED_NAMES
    return not reply.sizes and reply.summary.applied == 0 and reply.summary.dropped > 0


def _changed_nothing(method: str, reply: object) -> bool:
    """A Push or push-only PushPull whose every gradient was dropped (a duplicate, or late)."""
    reply_type = _PUSH_REPLIES.get(method)
    if reply_type is None or not isinstance(reply, bytes) or len(reply) > _PUSH_REPLY_MAX_BYTES:
        return False
    outcome = reply_type.FromString(reply)
    return outcome.applied == 0 and outcome.dropped > 0


class Tarpit(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Holds and refuses unread the unary requests of peers that keep wasting them (module docstring).

    Only methods under `prefix` (pshard's own services): a health prober asking for an unknown
    service on one connection is left alone. Must come first among the server's interceptors, so
    that the refusals of the others (credentials) count too.
    """

    def __init__(self, tarpit: WasteTarpit, refused_unread: Callable[[], None] = lambda: None,
                 prefix: str = "/pshard.") -> None:
        """`refused_unread`: called after each request refused unread (the heap trimmer's cue)."""
        self.tarpit = tarpit
        self._refused_unread = refused_unread
        self._prefix = prefix

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        method: str = details.method
        if handler is None or handler.unary_unary is None or not method.startswith(self._prefix):
            return handler
        unary, decode = handler.unary_unary, handler.request_deserializer
        tarpit, refused_unread = self.tarpit, self._refused_unread

        async def call(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> Any:
            peer = context.peer()
            hold_s = tarpit.admit(peer)
            if hold_s is not None:
                await asyncio.sleep(hold_s)
                refused_unread()
                await abort(context, OverloadedError(
                    f"{method}: refused unread: the requests of this connection ({tarpit.describe(peer)} "
                    f"in a row) were refused or changed nothing, and it came back before the wait it was "
                    f"asked for; retry later", retry_after_ms=tarpit.retry_after_ms(hold_s)))
            raw = await anext(requests, None)
            if raw is None:
                await abort(context, EmptyRequestError(f"{method}: the call carried no request message"))
                return None  # not reached (abort raises); tells the type checker `raw` is bytes below
            nbytes, reply = len(raw), None
            try:
                reply = await unary(decode(raw) if decode is not None else raw, context)
                return reply
            finally:
                wasted = context.code() in WASTED_CODES or _changed_nothing(method, reply)
                if tarpit.served(peer, nbytes, wasted):
                    log.warning("%s: %s of requests in a row refused or changing nothing; holding its next "
                                "ones (refused unread) until it waits as asked", peer, tarpit.describe(peer))

        return grpc.stream_unary_rpc_method_handler(call, response_serializer=handler.response_serializer)
