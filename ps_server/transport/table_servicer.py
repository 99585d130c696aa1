"""gRPC adapter of the sparse tables (proto/pshard/api/v1/sparse.proto) over ps_server.handlers.tables.

The methods decode a request, call the handler and encode its reply; the wrapping each gets from
`rpc_handlers` (the parameter server's `unary`: in-flight budget, parsing, PSError -> status) is
the dense service's own, so both services refuse and account for requests the same way. Rows of
a large reply are copied and encoded on a worker thread (the wrapping then sends the bytes as
they are): a 2 Mi-row reply's copies and encoding held the event loop for a second.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
import numpy as np
from google.protobuf.message import Message
from pshard.common.wire.sparse_codec import spec_from_proto
from pshard.ps_server.handlers.tables import TableHandlers

from pshard.api.v1 import sparse_pb2 as pb

SERVICE_NAME = "pshard.api.v1.SparseTablesService"
# Reply rows from which the copy and encoding leave the event loop (the servicer's _OFFLOAD_BYTES).
OFF_LOOP_BYTES = 1 << 20
Wrap = Callable[[str, type[Message], Any], Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]]


class SparseTablesServicer:
    def __init__(self, handlers: TableHandlers) -> None:
        self._handlers = handlers

    async def DeclareTable(self, request: pb.DeclareTableRequest, context: object) -> pb.DeclareTableResponse:
        return pb.DeclareTableResponse(created=await self._handlers.declare(spec_from_proto(request.spec)))

    async def PullRows(self, request: pb.PullRowsRequest, context: object) -> pb.PullRowsResponse | bytes:
        rows = await self._handlers.pull(request.table, request.ids, request.clock, request.worker_id)
        return await _reply(rows, lambda b: pb.PullRowsResponse(rows=b))

    async def PushRows(self, request: pb.PushRowsRequest, context: object) -> pb.PushRowsResponse:
        stored = await self._handlers.push(request.table, request.ids, request.grads, request.clock,
                                           request.worker_id, request.push_id,
                                           request.layout_version, _schedule(request))
        return pb.PushRowsResponse(stored=stored)

    async def PushPullRows(self, request: pb.PushPullRowsRequest,
                           context: object) -> pb.PushPullRowsResponse | bytes:
        stored, rows = await self._handlers.push_pull(request.table, request.push_ids, request.grads,
                                                      request.pull_ids, request.clock, request.worker_id,
                                                      push_id=request.push_id,
                                                      layout_version=request.layout_version,
                                                      schedule=_schedule(request))
        return await _reply(rows, lambda b: pb.PushPullRowsResponse(stored=stored, rows=b))

    async def ExportTable(self, request: pb.ExportTableRequest, context: object) -> pb.ExportTableResponse:
        ids_path, rows_path, n = await self._handlers.export(request.table)
        return pb.ExportTableResponse(ids_path=str(ids_path), rows_path=str(rows_path), rows=n)

    async def CheckpointTables(self, request: pb.CheckpointTablesRequest,
                               context: object) -> pb.CheckpointTablesResponse:
        path = await self._handlers.checkpoint()
        return pb.CheckpointTablesResponse(path=str(path or ""))

    async def GetTableStats(self, request: pb.GetTableStatsRequest,
                            context: object) -> pb.GetTableStatsResponse:
        stats = self._handlers.stats(request.table)
        return pb.GetTableStatsResponse(rows=stats.rows, evicted=stats.evicted, steps=stats.steps)

    async def OpenTableStream(self, request: pb.OpenTableStreamRequest,
                              context: object) -> pb.OpenTableStreamResponse:
        """Deprecated: table requests ride the fast-path sessions (EXCHANGE_OP_TABLE); port 0 tells an
        older client to use gRPC."""
        return pb.OpenTableStreamResponse(port=0)


async def _reply(rows: np.ndarray, make: Callable[[bytes], Message]) -> Message | bytes:
    """`make(rows' bytes)`: the reply, or for large rows its encoding, done on a worker thread."""
    if rows.nbytes < OFF_LOOP_BYTES:
        return make(rows.tobytes())
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(None, lambda: make(rows.tobytes()).SerializeToString())


def rpc_handlers(servicer: SparseTablesServicer, wrap: Wrap) -> grpc.GenericRpcHandler:
    """The service's methods, each wrapped by `wrap(name, request type, method)` into a raw-bytes handler."""
    methods = {
        "DeclareTable": pb.DeclareTableRequest, "PullRows": pb.PullRowsRequest,
        "PushRows": pb.PushRowsRequest,
        "PushPullRows": pb.PushPullRowsRequest, "ExportTable": pb.ExportTableRequest,
        "CheckpointTables": pb.CheckpointTablesRequest, "GetTableStats": pb.GetTableStatsRequest,
        "OpenTableStream": pb.OpenTableStreamRequest,
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        name: grpc.unary_unary_rpc_method_handler(wrap(name, request, getattr(servicer, name)))
        for name, request in methods.items()})


def _schedule(request: pb.PushRowsRequest | pb.PushPullRowsRequest) -> tuple[int, int, int]:
    """A scheduled call's push (pshard.coordinator): (schedule id, push number, floor); id 0: none."""
    return request.schedule_id, request.schedule_seq, request.schedule_floor
