"""gRPC adapter of global checkpoints: SaveCheckpointPart and RestoreCheckpoint, five-line delegates to the
transport-free GlobalCheckpoints (ps_server/handlers/global_checkpoints.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from pshard.common import checkpoint_store as ckpt
from pshard.common.types import SliceKey
from pshard.common.wire import codec
from pshard.ps_server.handlers.global_checkpoints import GlobalCheckpoints

from pshard.api.v1 import parameter_server_pb2 as pb


def ranges_from_proto(ranges: Any) -> dict[SliceKey, ckpt.Range]:
    return {SliceKey(r.key, r.part): ckpt.Range(r.key, r.offset, r.numel, tuple(r.shape)) for r in ranges}


class GlobalCheckpointServicer:
    """SaveCheckpointPart and RestoreCheckpoint: five-line delegates to GlobalCheckpoints."""

    def __init__(self, checkpoints: GlobalCheckpoints) -> None:
        self._checkpoints = checkpoints

    async def SaveCheckpointPart(self, request: pb.SaveCheckpointPartRequest, context: object
                                 ) -> pb.SaveCheckpointPartResponse:
        timeout_s = request.timeout_ms / 1000 if request.HasField("timeout_ms") else None
        files, lo, hi = await self._checkpoints.save_part(request.directory, request.clock,
                                                          ranges_from_proto(request.ranges), request.server,
                                                          timeout_s, len(request.ranges))
        return pb.SaveCheckpointPartResponse(
            files=[pb.CheckpointFile(name=f.name, sha256=f.sha256, size=f.size) for f in files],
            min_version=lo, max_version=hi)

    async def RestoreCheckpoint(self, request: pb.RestoreCheckpointRequest, context: object
                                ) -> pb.RestoreCheckpointResponse:
        restored, clock, slices, rows = await self._checkpoints.restore(
            request.directory, codec.job_from_proto(request.config), ranges_from_proto(request.ranges),
            request.server, request.servers, request.resume, len(request.ranges), tuple(request.row_owners))
        return pb.RestoreCheckpointResponse(restored=restored, clock=clock, slices=slices, rows=rows)


def rpc_handlers(servicer: GlobalCheckpointServicer, unary: Callable[..., Any], service: str
                 ) -> grpc.GenericRpcHandler:
    """The two methods, through the dense servicer's `unary` wrapper (budget, error mapping, metrics)."""
    return grpc.method_handlers_generic_handler(service, {
        "SaveCheckpointPart": grpc.unary_unary_rpc_method_handler(
            unary("SaveCheckpointPart", pb.SaveCheckpointPartRequest, servicer.SaveCheckpointPart)),
        "RestoreCheckpoint": grpc.unary_unary_rpc_method_handler(
            unary("RestoreCheckpoint", pb.RestoreCheckpointRequest, servicer.RestoreCheckpoint)),
    })
