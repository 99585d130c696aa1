"""The one mapping between pshard's errors and gRPC status, in both directions.

A servicer method decorated with `maps_errors` (unary) or `maps_stream_errors` (streaming) lets
a `PSError` end the call through `abort(context, err)`: the status code comes from
`err.status`, the message is the error's own (it carries the values), and trailing metadata
``ps-error-type`` names the class. A client calls `raise_from_rpc_error(e)` and gets the same class
back, so callers catch `StaleGenerationError` whether it happened locally or on a server.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import grpc
import grpc.aio
from pshard.common.errors import (
    InvalidArgumentError,
    MessageTooLargeError,
    OverloadedError,
    PermissionDeniedError,
    PSError,
    PullTimeoutError,
    UnauthenticatedError,
    UnavailableError,
    facts_json,
    rebuild,
)

ERROR_TYPE_KEY = "ps-error-type"
# Trailing metadata of an OverloadedError: how long the client should wait before retrying.
RETRY_AFTER_KEY = "ps-retry-after-ms"
# Trailing metadata: the error's facts (PSError.facts) as a JSON object, when it has any.
FACTS_KEY = "ps-error-facts"

# Without a ps-error-type (a proxy answered, or the transport failed), the code alone picks a class.
_BY_CODE: dict[grpc.StatusCode, type[PSError]] = {
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: PullTimeoutError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: MessageTooLargeError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
}


def to_grpc_status(err: PSError) -> grpc.StatusCode:
    """The status named by `err.status` (INTERNAL if the name is not a gRPC code)."""
    return grpc.StatusCode.__members__.get(err.status, grpc.StatusCode.INTERNAL)


def _trailing_metadata(err: PSError) -> tuple[tuple[str, str], ...]:
    metadata: tuple[tuple[str, str], ...] = ((ERROR_TYPE_KEY, type(err).__name__),)
    if isinstance(err, OverloadedError) and err.retry_after_ms is not None:
        metadata += ((RETRY_AFTER_KEY, str(err.retry_after_ms)),)
    if err.facts:
        metadata += ((FACTS_KEY, facts_json(err)),)
    return metadata


def set_status(context: grpc.aio.ServicerContext, err: PSError) -> None:
    """What `abort` sends, for a unary handler that then returns (an empty reply) instead of raising.

    grpc's abort raises an exception that stays in a reference cycle with the call's state until the
    cyclic GC runs; on a server that refuses a flood, those cycles held the requests' bytes.
    """
    context.set_code(to_grpc_status(err))
    context.set_details(str(err))
    context.set_trailing_metadata(_trailing_metadata(err))


async def abort(context: grpc.aio.ServicerContext, err: PSError) -> NoReturn:
    """End the RPC with `err`'s status and message; the class name travels as trailing metadata."""
    await context.abort(to_grpc_status(err), str(err), trailing_metadata=_trailing_metadata(err))
    raise AssertionError("context.abort returned")  # it always raises; this line keeps NoReturn honest


Response = TypeVar("Response")
UnaryMethod = Callable[[Any, Any, grpc.aio.ServicerContext], Awaitable[Response]]
StreamMethod = Callable[[Any, Any, grpc.aio.ServicerContext], AsyncIterator[Response]]


def maps_errors(method: UnaryMethod[Response]) -> UnaryMethod[Response]:
    """A unary servicer method whose PSErrors end the call with their own status and message."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Response:
        try:
            return await method(self, request, context)
        except PSError as err:
            await abort(context, err)

    return wrapper


def maps_stream_errors(method: StreamMethod[Response]) -> StreamMethod[Response]:
    """The same for a response-streaming method (an async generator): messages already sent stay sent."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Response]:
        try:
            async for response in method(self, request, context):
                yield response
        except PSError as err:
            await abort(context, err)

    return wrapper


def error_from_rpc_error(e: grpc.RpcError) -> PSError:
    """The PSError a failed call stands for: the server's own class when it named one."""
    if not isinstance(e, grpc.Call | grpc.aio.AioRpcError):
        return UnavailableError(f"RPC failed: {e}")
    code, details = e.code(), e.details() or ""
    metadata = e.trailing_metadata() or ()
    name = next((str(v) for k, v in metadata if k == ERROR_TYPE_KEY), None)
    if name == OverloadedError.__name__:
        hint = next((str(v) for k, v in metadata if k == RETRY_AFTER_KEY), "")
        return OverloadedError(details, int(hint) if hint.isdigit() else None)
    if name:
        found = rebuild(name, details, next((str(v) for k, v in metadata if k == FACTS_KEY), ""))
        if type(found) is not PSError or name == PSError.__name__:
            return found
    fallback = _BY_CODE.get(code, PSError)
    return fallback(f"{code.name if code else 'UNKNOWN'}: {details}")


def raise_from_rpc_error(e: grpc.RpcError) -> NoReturn:
    """Re-raise a failed call as the PSError class the server raised (chained to `e`)."""
    raise error_from_rpc_error(e) from e
