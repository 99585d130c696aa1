"""gRPC adapter of the parameter server: decode the request, call the handler, encode the reply.

Everything the server means by a request lives in ps_server.handlers (and the store below it);
this module only knows the protobuf messages, the Exchange stream's frames, and that a PSError
ends the call with its status (ps_common.rpc_status).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence

import grpc.aio
from pshard.common import codec
from pshard.common.codec import WireArray, encode_data_frame
from pshard.common.errors import EmptyRequestError, InvalidArgumentError
from pshard.common.framing import FramePacker, SliceReader
from pshard.common.rpc_status import maps_errors, maps_stream_errors
from pshard.ps_server.handlers import EncodedSlice, ExchangeDone, ParameterServerHandlers, PulledSlice
from pshard.ps_server.store import SliceMeta

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import tensor_pb2 as tensor_pb

_MODE_ENUM = {"sync": pb.SYNC, "async": pb.ASYNC, "ssp": pb.SSP}
# Slices at least this big are sent as a frame of their own (cached and shared in sync mode);
# smaller ones are packed together so a model of many tiny tensors is not many tiny messages.
_OWN_FRAME_BYTES = 256 * 1024


def _frame_or_bytes(wire: WireArray) -> tuple[bytes, bool]:
    """Exchange's encoder: (bytes, whether they are a whole data frame). One copy, into the bytes."""
    if wire.array.nbytes >= _OWN_FRAME_BYTES:
        return encode_data_frame([wire.array]), True
    return wire.array.tobytes(), False


def _seconds(timeout_ms: int) -> float | None:
    return timeout_ms / 1000 if timeout_ms else None  # None: the server's pull timeout


def _slices_to_proto(slices: Sequence[PulledSlice]) -> list[tensor_pb.SliceTensor]:
    return [codec.slice_tensor_to_proto(s.key, s.value, s.version) for s in slices]


class ParameterServerServicer:
    def __init__(self, handlers: ParameterServerHandlers, chunk_bytes: int) -> None:
        self._handlers = handlers
        self._chunk_bytes = chunk_bytes

    # ---- unary ----

    @maps_errors
    async def Declare(self, request: pb.DeclareRequest, context: grpc.aio.ServicerContext
                      ) -> pb.DeclareResponse:
        job = codec.job_from_proto(request.config) if request.HasField("config") else None
        items = [codec.slice_tensor_from_proto(s) for s in request.slices]
        created, values = await self._handlers.declare(job, items)
        return pb.DeclareResponse(created=created, slices=[
            codec.slice_tensor_to_proto(k, v) for (k, _), v in zip(items, values, strict=True)])

    @maps_errors
    async def Push(self, request: pb.PushRequest, context: grpc.aio.ServicerContext) -> pb.PushResponse:
        outcome = await self._handlers.push(codec.stamp_from_proto(request.stamp),
                                            [codec.slice_tensor_from_proto(g) for g in request.gradients])
        return pb.PushResponse(applied=outcome.applied, dropped=outcome.dropped)

    @maps_errors
    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> pb.PullResponse:
        slices = await self._handlers.pull(codec.stamp_from_proto(request.stamp),
                                           [codec.slice_id_from_proto(s) for s in request.slices],
                                           _seconds(request.timeout_ms))
        return pb.PullResponse(slices=_slices_to_proto(slices))

    @maps_errors
    async def PushPull(self, request: pb.PushPullRequest, context: grpc.aio.ServicerContext
                       ) -> pb.PullResponse:
        result = await self._handlers.push_pull(
            codec.stamp_from_proto(request.stamp),
            [codec.slice_tensor_from_proto(g) for g in request.gradients],
            [codec.slice_id_from_proto(s) for s in request.pull], _seconds(request.timeout_ms))
        return pb.PullResponse(applied=result.applied, dropped=result.dropped,
                               slices=_slices_to_proto(result.slices))

    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
                       ) -> pb.GetStatsResponse:
        stats = self._handlers.stats()
        s, job = stats.store, stats.job
        if s is None or job is None:
            return pb.GetStatsResponse(pulls_waiting=stats.pulls_waiting)
        return pb.GetStatsResponse(
            mode=_MODE_ENUM[job.mode], staleness=job.staleness, optimizer=job.optimizer.name,
            slices=s.slices, bytes_stored=s.bytes_stored, pushes_applied=s.pushes_applied,
            pushes_dropped=s.pushes_dropped, late_gradients_dropped=s.late_gradients_dropped,
            pulls_served=stats.pulls_served, pulls_waiting=stats.pulls_waiting,
            pulls_timed_out=stats.pulls_timed_out, quorum=sorted(s.quorum),
            worker_clocks=dict(s.worker_clocks), min_version=s.min_version, max_version=s.max_version)

    @maps_errors
    async def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.aio.ServicerContext
                         ) -> pb.CheckpointResponse:
        path, version = await self._handlers.checkpoint(request.at_version, _seconds(request.timeout_ms))
        return pb.CheckpointResponse(path=str(path), min_version=version)

    # ---- Exchange: a header frame, then data frames; replies are data frames, then a summary ----

    @maps_stream_errors
    async def Exchange(self, frames: AsyncIterator[bytes], context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[bytes]:
        first = await anext(frames, None)
        if first is None:
            raise EmptyRequestError("Exchange: the stream ended before its header frame")
        message = codec.decode_frame(first)
        if message.WhichOneof("body") != "header":
            kind = message.WhichOneof("body")
            raise InvalidArgumentError(f"Exchange: first frame must be a header, got {kind}")
        header = message.header
        metas = [SliceMeta(codec.slice_id_from_proto(m.id), codec.dtype_from_proto(m.dtype, "push dtype"),
                           tuple(m.shape)) for m in header.push]
        if header.op == pb.DECLARE:
            replies = self._exchange_declare(header, metas, frames)
        elif header.op == pb.PUSH_PULL:
            replies = self._exchange_push_pull(header, metas, frames)
        else:
            raise InvalidArgumentError(f"Exchange header.op: got {header.op}, expected PUSH_PULL or DECLARE")
        async for out in replies:
            yield out

    async def _exchange_declare(self, header: pb.ExchangeHeader, metas: Sequence[SliceMeta],
                                frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        job = codec.job_from_proto(header.config) if header.HasField("config") else None
        # Views of the frames; the store copies what it keeps.
        items = [(metas[index].key, wire) async for index, wire in _read_slices(metas, frames)]
        created, values = await self._handlers.declare(job, items)
        packer = FramePacker(self._chunk_bytes)
        for value in values:
            for out in packer.add(value.array):
                yield out
        last = packer.flush()
        if last is not None:
            yield last
        yield codec.encode_frame(pb.Frame(summary=pb.ExchangeSummary(created=created)))

    async def _exchange_push_pull(self, header: pb.ExchangeHeader, metas: Sequence[SliceMeta],
                                  frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        packer = FramePacker(self._chunk_bytes, whole_slices=True)
        events = self._handlers.exchange(
            codec.stamp_from_proto(header.stamp), metas, [codec.slice_id_from_proto(s) for s in header.pull],
            _read_slices(metas, frames), _frame_or_bytes, _seconds(header.timeout_ms))
        # aclosing: a cancelled call stops the handler's push side at once, not when collected.
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, EncodedSlice) and not event.payload[1]:
                    for out in packer.add(event.payload[0]):
                        yield out
                    continue
                # A slice of its own frame, a wait (send what is packed for the client to use), or the end.
                pending = packer.flush()
                if pending is not None:
                    yield pending
                if isinstance(event, EncodedSlice):
                    yield event.payload[0]
                elif isinstance(event, ExchangeDone):
                    yield codec.encode_frame(pb.Frame(summary=pb.ExchangeSummary(
                        versions=event.versions, applied=event.applied, dropped=event.dropped)))


async def _read_slices(metas: Sequence[SliceMeta], frames: AsyncIterator[bytes]
                       ) -> AsyncIterator[tuple[int, WireArray]]:
    """(index into `metas`, zero-copy view) of each slice as its bytes complete in the data frames."""
    names = [f"slice {str(m.key)!r}" for m in metas]
    reader = SliceReader([codec.nbytes_of(n, m.dtype, m.shape) for n, m in zip(names, metas, strict=True)],
                         names)

    def wire(index: int, buf: memoryview) -> tuple[int, WireArray]:
        _, dtype, shape = metas[index]
        return index, WireArray(codec.array_from_buffer(buf, dtype, shape, names[index]), dtype)

    for index, buf in reader.initial():
        yield wire(index, buf)
    async for frame in frames:
        payload = codec.decode_data_frame(frame)
        if payload is None:
            raise InvalidArgumentError("Exchange: expected only data frames after the header")
        for index, buf in reader.feed(payload):
            yield wire(index, buf)
    reader.finish()

