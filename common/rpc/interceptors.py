"""gRPC server interceptors shared by pshard's services (the scheduler, the parameter server, a serving
worker)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import DecodeError


class DecodeErrors(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Unparseable request bytes are INVALID_ARGUMENT, not grpc's UNKNOWN "Unexpected DecodeError".

    grpc decodes a request before any handler runs, so the decoding moves into the handler, where
    the failure can be answered with a proper status. Unary requests, and each message of a
    stream-stream call (a serving worker's Serve); handlers registered without a deserializer (raw
    bytes: the parameter server's Exchange reads its own frames) are left as they are.
    """

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        if handler.request_streaming and handler.stream_stream is None:
            return handler  # stream-unary: none is served today
        decode, method = handler.request_deserializer, details.method

        async def parse(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                return decode(raw)
            except DecodeError as e:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: not a valid request: {e}")

        if handler.stream_stream is not None:
            streamed = handler.stream_stream

            async def parsed(raws: AsyncIterator[bytes],
                             context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                async for raw in raws:
                    yield await parse(raw, context)

            async def call_streams(raws: AsyncIterator[bytes], context: grpc.aio.ServicerContext
                                   ) -> AsyncIterator[Any]:
                async for response in streamed(parsed(raws, context), context):
                    yield response
            return handler._replace(request_deserializer=None, stream_stream=call_streams)
        if handler.unary_unary is not None:
            unary = handler.unary_unary

            async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
                return await unary(await parse(raw, context), context)
            return handler._replace(request_deserializer=None, unary_unary=call)
        stream = handler.unary_stream

        async def call_stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in stream(await parse(raw, context), context):
                yield response
        return handler._replace(request_deserializer=None, unary_stream=call_stream)
