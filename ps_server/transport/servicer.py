"""gRPC adapter of the parameter server: decode the request, call the handler, encode the reply.

Everything the server means by a request lives in ps_server.handlers.dense (and the store below it);
this module only knows the protobuf messages, the Exchange stream's frames, and that a PSError
ends the call with its status (common.rpc.status).

It also keeps the server's in-flight byte budget (ps_server.transport.budget): a unary request reserves its
serialized size before it is parsed (the methods receive raw bytes, see `unary`), an Exchange stream
reserves each frame as it arrives and gives it back once the frame's slices are applied. Large
replies are encoded on a small thread pool, so one big pull does not stall the event loop that
every other caller shares.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import traceback
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Executor
from typing import TypeVar

import grpc.aio
from google.protobuf.message import DecodeError, Message
from pshard.common.errors import (
    EmptyRequestError,
    InvalidArgumentError,
    PermissionDeniedError,
    PSError,
    PullTimeoutError,
    quote,
)
from pshard.common.job import JobConfig
from pshard.common.rpc.status import maps_stream_errors, set_status
from pshard.common.security.auth import caller, check_acts_as, may_configure, refused, sees_worker_ids
from pshard.common.types import SliceKey
from pshard.common.wire import codec
from pshard.common.wire.codec import WireArray, encode_data_frame
from pshard.common.wire.framing import FramePacker, SliceReader
from pshard.ps_server.core.store import SliceMeta
from pshard.ps_server.handlers.dense import EncodedSlice, ExchangeDone, ParameterServerHandlers, PulledSlice
from pshard.ps_server.heap import HeapTrimmer
from pshard.ps_server.replication.records import record_from_proto
from pshard.ps_server.replication.tables import hold_rows
from pshard.ps_server.transport.budget import InflightBudget, Reservation

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import tensor_pb2 as tensor_pb

# Slices at least this big are sent as a frame of their own (cached and shared in sync mode);
# smaller ones are packed together so a model of many tiny tensors is not many tiny messages.
_OWN_FRAME_BYTES = 256 * 1024
# Replies at least this big are encoded on the servicer's thread pool instead of the event loop.
_OFFLOAD_BYTES = 1 << 20
# Requests up to this size are parsed on the event loop, bigger ones on the thread pool. Parsing is
# a copy (a few GB/s: ~1 ms at this bound), while a hand-off to a thread costs the loop more under
# load: the parsing thread holds the GIL, and each time the loop releases it (any system call) it
# waits up to the interpreter's switch interval (5 ms) to get it back. Measured with the flood of
# tests/e2e/test_flood.py (4 MiB requests), interleaved runs: the bystander worker's median p90
# fell from ~2 ms to ~0.5 ms; its p99 did not change measurably (docs/architecture.md, 10 Running).
_PARSE_ON_LOOP_BYTES = 8 << 20

Request = TypeVar("Request", bound=Message)
# Unary methods whose request carries a stamp (its clock feeds the staleness histogram).
_STAMPED = frozenset({"Push", "Pull", "PushPull"})
# Sparse-table methods whose request names a worker (docs/architecture.md, 13 Security): bound to the
# caller's credential as the stamped dense ones are. A pull without a worker id names nobody.
_NAMES_WORKER = frozenset({"PushRows", "PushPullRows", "PullRows"})
UnaryHandler = Callable[[bytes, grpc.aio.ServicerContext], Awaitable[bytes]]


def _check_table_caller(name: str, request: Message) -> None:
    worker: str = request.worker_id  # type: ignore[attr-defined]
    if worker or name != "PullRows":
        check_acts_as(worker, name)


def _frame_or_bytes(wire: WireArray) -> tuple[bytes, bool]:
    """Exchange's encoder: (bytes, whether they are a whole data frame). One copy, into the bytes."""
    if wire.array.nbytes >= _OWN_FRAME_BYTES:
        return encode_data_frame([wire.array]), True
    return wire.array.tobytes(), False


def _seconds(request: codec.TimedRequest) -> float | None:
    timeout_ms = codec.timeout_ms_from_proto(request)
    return timeout_ms / 1000 if timeout_ms is not None else None  # None: the server's pull timeout


def _slices_to_proto(slices: Sequence[PulledSlice]) -> list[tensor_pb.SliceTensor]:
    return [codec.slice_tensor_to_proto(s.key, s.value, s.version) for s in slices]


def _pull_response(applied: int, dropped: int, slices: Sequence[PulledSlice]) -> bytes:
    # A PushPullResponse; Pull's reply too: with applied = dropped = 0 it encodes exactly as a
    # PullResponse (the same field 1, slices), so both share this encoder.
    return pb.PushPullResponse(applied=applied, dropped=dropped,
                               slices=_slices_to_proto(slices)).SerializeToString()


def _unique(keys: list[SliceKey], what: str) -> list[SliceKey]:
    """`keys`, refused when one repeats: a pull naming a slice thousands of times would encode
    and send it thousands of times."""
    if len(set(keys)) != len(keys):
        key, count = Counter(keys).most_common(1)[0]
        raise InvalidArgumentError(f"{what}: slice {quote(str(key))} named {count} times, each slice at "
                                   "most once")
    return keys


def _forget_locals(exc: BaseException) -> None:
    """Drop the locals of the frames an ending call's exceptions point to.

    A refused request's exceptions sit in reference cycles (the frames in their tracebacks, grpc's
    abort, the task) that only the cyclic GC frees, and their frames hold the request's bytes, its
    parsed message and arrays: a flood of refused 4 MiB requests kept 2 GiB alive this way.
    """
    seen: set[int] = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        stack += [e.__context__, e.__cause__]


def _parse(message_type: type[Request], raw: bytes, method: str) -> Request:
    try:
        return message_type.FromString(raw)
    except DecodeError as err:
        raise InvalidArgumentError(f"{method}: {len(raw)} bytes are not a {message_type.__name__} "
                                   f"({err})") from None


class ParameterServerServicer:
    def __init__(self, handlers: ParameterServerHandlers, chunk_bytes: int, budget: InflightBudget,
                 executor: Executor, pull_timeout_s: float, trimmer: HeapTrimmer) -> None:
        """`executor`: a small bounded pool for encoding large replies off the event loop;
        `pull_timeout_s`: the deadline of an Exchange whose header names no timeout_ms;
        `trimmer`: told when each request ends, to give its memory back to the system."""
        self._trimmer = trimmer
        self._handlers = handlers
        self._pull_timeout_s = pull_timeout_s
        self._chunk_bytes = chunk_bytes
        self._budget = budget
        self._executor = executor

    def unary(self, name: str, message_type: type[Request],
              method: Callable[[Request, grpc.aio.ServicerContext], Awaitable[Message | bytes]]
              ) -> UnaryHandler:
        """`method` as a gRPC handler of raw bytes: their size is reserved in the budget before they
        are parsed, and held until the reply is encoded."""
        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> bytes:
            held = self._budget.reservation(name)
            started, sent, refused, clock = time.perf_counter(), 0, None, None
            self._trimmer.request_started(len(raw))
            try:
                held.add(len(raw))
                if len(raw) <= _PARSE_ON_LOOP_BYTES:
                    request = _parse(message_type, raw, name)
                else:  # a bounded stall only: the biggest requests are parsed off the event loop
                    request = await asyncio.get_running_loop().run_in_executor(
                        self._executor, _parse, message_type, raw, name)
                if name in _STAMPED:
                    clock = request.stamp.clock  # type: ignore[attr-defined]
                    check_acts_as(request.stamp.worker_id, name)  # type: ignore[attr-defined]
                elif name in _NAMES_WORKER:
                    _check_table_caller(name, request)
                reply = await method(request, context)
                out = reply if isinstance(reply, bytes) else await self._encode(reply)
                sent = len(out)
                return out
            except PSError as err:
                set_status(context, err)
                refused = type(err).__name__
                _forget_locals(err)
                return b""
            except BaseException as exc:
                _forget_locals(exc)
                raise
            finally:
                held.release()
                self._trimmer.request_ended(held.total)
                self._handlers.requests.record("grpc", name, len(raw), sent, time.perf_counter() - started,
                                               refused, clock)

        return handle

    async def _encode(self, reply: Message) -> bytes:
        if reply.ByteSize() < _OFFLOAD_BYTES:
            return reply.SerializeToString()
        return await asyncio.get_running_loop().run_in_executor(self._executor, reply.SerializeToString)

    async def _pull_reply(self, applied: int, dropped: int, slices: Sequence[PulledSlice]) -> bytes:
        if sum(s.value.array.nbytes for s in slices) < _OFFLOAD_BYTES:
            return _pull_response(applied, dropped, slices)
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, _pull_response, applied, dropped, slices)

    async def _may_configure(self, job: object, timeout_s: float | None) -> None:
        """Only the chief (or an admin) sets the job's configuration; a worker's Declare that comes
        first waits for it, and is refused if it never comes (docs/architecture.md, 13 Security)."""
        if job is None or self._handlers.has_store or may_configure(caller()):
            return
        wait_s = timeout_s if timeout_s is not None else self._pull_timeout_s
        if not await self._handlers.wait_configured(time.monotonic() + wait_s):
            refused("Declare")
            raise PermissionDeniedError(f"Declare: {caller()} may not set the job configuration, and the "
                                        f"chief did not set it within {wait_s:g} s")

    def _check_adds(self, metas: Sequence[SliceMeta]) -> None:
        """A declaration that would add parameters to a configured server: the chief's only."""
        who = caller()
        if may_configure(who):
            return
        try:
            self._handlers.check_adds_nothing(metas, str(who))
        except PermissionDeniedError:
            refused("Declare")
            raise

    # ---- unary ----

    async def Declare(self, request: pb.DeclareRequest, context: grpc.aio.ServicerContext
                      ) -> pb.DeclareResponse:
        job = codec.job_from_proto(request.config) if request.HasField("config") else None
        remaining = context.time_remaining()
        await self._may_configure(job, None if remaining is None else max(0.0, remaining - 0.2))
        items = [codec.slice_tensor_from_proto(s) for s in request.slices]
        self._check_adds([SliceMeta(k, w.dtype, tuple(w.array.shape)) for k, w in items])
        created, values = await self._handlers.declare(job, items)
        return pb.DeclareResponse(created=created, slices=[
            codec.slice_tensor_to_proto(k, v) for (k, _), v in zip(items, values, strict=True)])

    async def Push(self, request: pb.PushRequest, context: grpc.aio.ServicerContext) -> pb.PushResponse:
        outcome = await self._handlers.push(codec.stamp_from_proto(request.stamp),
                                            [codec.slice_tensor_from_proto(g) for g in request.gradients])
        return pb.PushResponse(applied=outcome.applied, dropped=outcome.dropped)

    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> bytes:
        slices = await self._handlers.pull(
            codec.stamp_from_proto(request.stamp),
            _unique([codec.slice_id_from_proto(s) for s in request.slices], "Pull"),
            _seconds(request))
        return await self._pull_reply(0, 0, slices)

    async def PushPull(self, request: pb.PushPullRequest, context: grpc.aio.ServicerContext) -> bytes:
        result = await self._handlers.push_pull(
            codec.stamp_from_proto(request.stamp),
            [codec.slice_tensor_from_proto(g) for g in request.gradients],
            _unique([codec.slice_id_from_proto(s) for s in request.pull], "PushPull"),
            _seconds(request))
        return await self._pull_reply(result.applied, result.dropped, result.slices)

    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
                       ) -> pb.GetStatsResponse:
        stats = self._handlers.stats()
        s, job = stats.store, stats.job
        if s is None or job is None:
            return pb.GetStatsResponse(pulls_waiting=stats.pulls_waiting)
        reply = pb.GetStatsResponse(
            mode=codec.mode_to_proto(job.mode), staleness=job.staleness,
            optimizer=codec.optimizer_to_proto(job.optimizer.name),
            slices=s.slices, bytes_stored=s.bytes_stored, pushes_applied=s.pushes_applied,
            pushes_dropped=s.pushes_dropped, late_gradients_dropped=s.late_gradients_dropped,
            pulls_served=stats.pulls_served, pulls_waiting=stats.pulls_waiting,
            pulls_timed_out=stats.pulls_timed_out, quorum=sorted(s.quorum),
            worker_clocks=dict(s.worker_clocks), min_version=s.min_version, max_version=s.max_version,
            worker_transports=dict(stats.transports), nonfinite_dropped=s.nonfinite_dropped,
            step_times={w: pb.StepTimes(steps=t.steps, p50_s=t.p50_s, p90_s=t.p90_s, p99_s=t.p99_s,
                                        max_s=t.max_s) for w, t in s.step_times.items()},
            hangs=[pb.HangReport(key=h.key, clock=h.clock, waiting_for=h.waiting_for, stalled_s=h.stalled_s)
                   for h in stats.hangs])
        if not sees_worker_ids():  # who trains is for the job's own nodes and its operators
            for name in ("quorum", "worker_clocks", "worker_transports", "step_times", "hangs"):
                reply.ClearField(name)
        return reply

    async def Replicate(self, request: pb.ReplicateRequest, context: grpc.aio.ServicerContext
                        ) -> pb.ReplicateResponse:
        # Server to server (docs/architecture.md, 9 Failures); the role table lets only servers call it.
        if request.tables or request.release_tables:  # table rows (ps_server/replication/tables.py)
            inline = await hold_rows(self._handlers.table_replication, request, executor=self._executor)
            return pb.ReplicateResponse(tables_need_inline=inline)
        records, primary, release = request.records, request.primary, request.release
        config = JobConfig() if release else codec.job_from_proto(request.config)  # a release carries none
        # Decoding and replaying copy and step every byte: off the event loop (the replica set locks itself).
        need = await asyncio.get_running_loop().run_in_executor(
            self._executor, lambda: self._handlers.replicate(
                config, [record_from_proto(r) for r in records], primary, release, request.segments))
        return pb.ReplicateResponse(need_state=[codec.slice_id_to_proto(k) for k in need])

    async def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.aio.ServicerContext
                         ) -> pb.CheckpointResponse:
        path, version = await self._handlers.checkpoint(request.at_version, _seconds(request))
        return pb.CheckpointResponse(path=str(path), min_version=version)

    # ---- Exchange: a header frame, then data frames; replies are data frames, then a summary ----

    @maps_stream_errors
    async def Exchange(self, frames: AsyncIterator[bytes], context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[bytes]:
        started, sent, clock = time.perf_counter(), [0], [None]

        def record(received: int, refused: str | None) -> None:
            self._handlers.requests.record("grpc", "Exchange", received, sent[0],
                                           time.perf_counter() - started, refused, clock[0])

        with self._budget.reservation("Exchange") as held, _ending(self._trimmer, held, record):
            first = await anext(frames, None)
            if first is None:
                raise EmptyRequestError("Exchange: the stream ended before its header frame")
            held.add(len(first))
            message = codec.decode_request_frame(first)
            if message.WhichOneof("body") != "header":
                kind = message.WhichOneof("body")
                raise InvalidArgumentError(f"Exchange: first frame must be a header, got {kind}")
            header = message.header
            if header.op == pb.EXCHANGE_OP_PUSH_PULL:
                clock[0] = header.stamp.clock
                check_acts_as(header.stamp.worker_id, "Exchange")
            held.release()  # the header is decoded; the data frames reserve their own bytes
            metas = [SliceMeta(codec.slice_id_from_proto(m.id), codec.dtype_from_proto(m.dtype, "push dtype"),
                               tuple(m.shape), codec.encoding_from_proto(m.encoding, "push encoding"))
                     for m in header.push]
            # Frames stop being waited for at the request's own deadline, a push or a declare too.
            deadline = time.monotonic() + (t if (t := _seconds(header)) is not None else self._pull_timeout_s)
            if header.op == pb.EXCHANGE_OP_DECLARE:
                replies = self._exchange_declare(header, metas, _FrameSource(frames, held, deadline, False))
            elif header.op == pb.EXCHANGE_OP_PUSH_PULL:
                replies = self._exchange_push_pull(header, metas, _FrameSource(frames, held, deadline, True))
            else:
                raise InvalidArgumentError(f"Exchange header.op: got {header.op}, "
                                           "expected PUSH_PULL or DECLARE")
            async for out in replies:
                sent[0] += len(out)
                yield out

    async def _exchange_declare(self, header: pb.ExchangeHeader, metas: Sequence[SliceMeta],
                                frames: _FrameSource) -> AsyncIterator[bytes]:
        job = codec.job_from_proto(header.config) if header.HasField("config") else None
        await self._may_configure(job, frames.remaining_s())
        self._check_adds(metas)
        # Views of the frames, all held (and reserved) until the store has copied what it keeps.
        items = [(metas[index].key, wire) async for index, wire in _read_slices(metas, frames)]
        created, values = await self._handlers.declare(job, items)
        del items
        frames.release()
        packer = FramePacker(self._chunk_bytes)
        for value in values:
            for out in packer.add(value.array):
                yield out
        last = packer.flush()
        if last is not None:
            yield last
        yield codec.encode_frame(pb.ExchangeResponse(summary=pb.ExchangeSummary(created=created)))

    async def _exchange_push_pull(self, header: pb.ExchangeHeader, metas: Sequence[SliceMeta],
                                  frames: _FrameSource) -> AsyncIterator[bytes]:
        packer = FramePacker(self._chunk_bytes, whole_slices=True)
        pull = _unique([codec.slice_id_from_proto(s) for s in header.pull], "Exchange header.pull")
        events = self._handlers.exchange(
            codec.stamp_from_proto(header.stamp), metas, pull,
            _read_slices(metas, frames), _frame_or_bytes, _seconds(header),
            codec.pull_packs_from_proto(header) if header.pull_packing else ())
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
                    yield codec.encode_frame(pb.ExchangeResponse(summary=pb.ExchangeSummary(
                        versions=event.versions, applied=event.applied, dropped=event.dropped)))


@contextlib.contextmanager
def _ending(trimmer: HeapTrimmer, held: Reservation,
            record: Callable[[int, str | None], None]) -> Iterator[None]:
    """An Exchange call's end: its exceptions keep no frame's data alive, its memory goes back,
    its bytes, time and refusal (if any) are recorded."""
    refused = None
    try:
        yield
    except BaseException as exc:
        refused = type(exc).__name__ if isinstance(exc, PSError) else None
        _forget_locals(exc)
        raise
    finally:
        trimmer.request_ended(held.total, stream=True)
        record(held.total, refused)


class _FrameSource:
    """An Exchange call's data frames, each reserved in the budget as it arrives and waited for
    no later than the request's deadline.

    With `release_applied`, reading the next frame gives back the previous ones' bytes: the handler
    applies (copies) every slice a frame completes before it asks for more. Bytes of a slice still
    being assembled across frames stay reserved (`keep`).
    """

    def __init__(self, frames: AsyncIterator[bytes], held: Reservation, deadline: float,
                 release_applied: bool) -> None:
        self._frames = frames
        self._held = held
        self._deadline = deadline
        self._release_applied = release_applied

    def remaining_s(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    async def next(self, keep: int) -> bytes | None:
        if self._release_applied:
            self._held.release(self._held.held - keep)
        try:
            frame = await asyncio.wait_for(anext(self._frames, None), self._deadline - time.monotonic())
        except TimeoutError:
            raise PullTimeoutError("Exchange: the stream's data frames did not arrive before the "
                                   "request's deadline (header timeout_ms)") from None
        if frame is not None:
            self._held.add(len(frame))
        return frame

    def release(self) -> None:
        self._held.release()


async def _read_slices(metas: Sequence[SliceMeta], frames: _FrameSource
                       ) -> AsyncIterator[tuple[int, WireArray]]:
    """(index into `metas`, zero-copy view) of each slice as its bytes complete in the data frames.

    Nothing is allocated for what the header announces: a slice spanning frames grows as its bytes
    arrive (common.wire.framing.SliceReader), and those bytes are reserved like the frames'.
    """
    names = [f"slice {quote(str(m.key))}" for m in metas]
    reader = SliceReader([codec.nbytes_of(n, m.dtype, m.shape) for n, m in zip(names, metas, strict=True)],
                         names)

    def wire(index: int, buf: memoryview) -> tuple[int, WireArray]:
        _, dtype, shape, encoding = metas[index]
        return index, WireArray(codec.array_from_buffer(buf, dtype, shape, names[index]), dtype, encoding)

    for index, buf in reader.initial():
        yield wire(index, buf)
    while (frame := await frames.next(keep=reader.pending)) is not None:
        payload = codec.decode_data_frame(frame)
        if payload is None:
            raise InvalidArgumentError("Exchange: expected only data frames after the header")
        for index, buf in reader.feed(payload):
            yield wire(index, buf)
    reader.finish()
