"""gRPC adapter of the wasted-request tarpit (ps_server.budget.WasteTarpit): a flood stops costing reads.

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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from pshard.common.errors import EmptyRequestError, OverloadedError
from pshard.common.rpc_status import abort
from pshard.ps_server.budget import WasteTarpit

from pshard.api.v1 import parameter_server_pb2 as pb

log = logging.getLogger("pshard.ps")

# The client's fault: sending more of the same is wasted. Not RESOURCE_EXHAUSTED (the server's own
# load: clients back off from it), DEADLINE_EXCEEDED, UNAVAILABLE or FAILED_PRECONDITION (a state).
WASTED_CODES = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                          grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.PERMISSION_DENIED,
                          grpc.StatusCode.UNAUTHENTICATED})
# Push-only replies: (applied, dropped) fit in a few bytes; a reply with pulled slices is never wasted.
_PUSH_REPLIES: dict[str, type[pb.PushResponse] | type[pb.PushPullResponse]] = {
    "/pshard.api.v1.ParameterServerService/Push": pb.PushResponse,
    "/pshard.api.v1.ParameterServerService/PushPull": pb.PushPullResponse,
}
_PUSH_REPLY_MAX_BYTES = 32


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
