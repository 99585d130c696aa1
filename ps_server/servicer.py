"""gRPC servicer of the parameter server: a thin layer over ShardStore.

It decodes requests, checks them against the declared slices, hands them to the
store and waits (as coroutines, never as threads) until the store's consistency
policy lets a pull through. All semantics live in ps_server.store/policies.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np
from pshard.common import codec
from pshard.common.codec import encode_data_frame
from pshard.common.errors import (
    DTypeMismatchError,
    EmptyRequestError,
    InvalidArgumentError,
    LayoutConflictError,
    PSError,
    PullTimeoutError,
    ShapeMismatchError,
    UnknownKeyError,
)
from pshard.common.framing import FramePacker, SliceReader
from pshard.common.job import JobConfig
from pshard.common.rpc import CHUNK_BYTES
from pshard.common.rpc_status import abort
from pshard.common.types import SliceKey, Stamp
from pshard.ps_server.checkpoint import load_shard, save_shard
from pshard.ps_server.store import ShardStore
from pshard.ps_server.waiters import ChangeSignal

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import tensor_pb2 as tensor_pb

log = logging.getLogger("pshard.ps")

Request = TypeVar("Request")
Response = TypeVar("Response")
Handler = Callable[[Any, Request, grpc.aio.ServicerContext], Awaitable[Response]]


def _unary(handler: Handler[Request, Response]) -> Handler[Request, Response]:
    """A unary handler whose PSErrors end the call with their status (the one mapping, rpc_status)."""
    @functools.wraps(handler)
    async def wrapper(self: Any, request: Request, context: grpc.aio.ServicerContext) -> Response:
        try:
            return await handler(self, request, context)
        except PSError as err:
            await abort(context, err)
    return wrapper

_MODE_ENUM = {"sync": pb.SYNC, "async": pb.ASYNC, "ssp": pb.SSP}
# Slices at least this big are sent as a frame of their own (cached and shared in sync mode);
# smaller ones are packed together so a model of many tiny tensors is not many tiny messages.
_OWN_FRAME_BYTES = 256 * 1024


@dataclass(frozen=True)
class ServerSettings:
    """Parsed once in __main__ (or built by tests)."""

    # Job used when the first Declare carries none; None = the first Declare's config decides.
    default_job: JobConfig | None = None
    # Workers expected before any scheduler view arrives: worker id -> generation.
    static_quorum: Mapping[str, int] | None = None
    pull_timeout_s: float = 60.0
    chunk_bytes: int = CHUNK_BYTES
    checkpoint_dir: str | None = None
    shard_name: str = "shard"


class ParameterServerServicer:
    def __init__(self, settings: ServerSettings, loop: asyncio.AbstractEventLoop) -> None:
        self._settings = settings
        self._signal = ChangeSignal(loop)
        self._store: ShardStore | None = None
        self._specs: dict[SliceKey, tuple[str, tuple[int, ...]]] = {}
        self._quorum: dict[str, int] | None = (dict(settings.static_quorum)
                                               if settings.static_quorum else None)
        self._config_lock = asyncio.Lock()
        # Sync mode: every worker pulls the same version of a slice, so its encoding is made once
        # and shared (slice -> (version, bytes, is a whole data frame)). Costs one copy of the shard.
        self._encoded: dict[SliceKey, tuple[int, bytes, bool]] = {}
        # Generation of the newest scheduler view applied; None when no scheduler is followed.
        self._view_generation: int | None = None
        self.pulls_served = 0
        self.pulls_timed_out = 0
        if settings.checkpoint_dir:
            snap = load_shard(Path(settings.checkpoint_dir), settings.shard_name)
            if snap is not None:
                self._install(ShardStore.restore(snap))
                log.info("restored %d slices from %s", len(self._specs), settings.checkpoint_dir)
        if self._store is None and settings.default_job is not None:
            self._install(ShardStore(settings.default_job, quorum=self._quorum))

    # ---- state ----

    def _install(self, store: ShardStore) -> None:
        if self._quorum is not None:
            store.set_quorum(self._quorum)
        store.subscribe(self._signal.notify)
        # Dtype as declared (a float16 slice keeps a float32 master) and shape, without copying values.
        declared = store.keys()
        self._specs = {key: store.read_with(key, lambda value, dtype, _: (dtype.name, value.shape))
                       for key in declared}
        self._store = store

    @property
    def store(self) -> ShardStore:
        if self._store is None:
            raise LayoutConflictError("no parameters declared yet: call Declare (with the job config) first")
        return self._store

    @property
    def has_store(self) -> bool:
        return self._store is not None

    def follow_views(self) -> None:
        """From now on membership comes from scheduler views (see _await_view)."""
        self._view_generation = self._view_generation or 0

    def set_quorum(self, quorum: Mapping[str, int], generation: int | None = None) -> None:
        """Membership changed (scheduler view): only live workers are waited for."""
        self._quorum = dict(quorum)
        if generation is not None:
            self._view_generation = max(generation, self._view_generation or 0)
        if self._store is not None:
            self._store.set_quorum(self._quorum)
        self._signal.notify()

    async def _await_view(self, stamp: Stamp, deadline: float) -> None:
        """A stamp newer than our view means the view is on its way (a worker that just
        registered can reach us before the scheduler's Watch does): wait for it rather than
        refuse the worker as a non-member."""
        if self._view_generation is None or stamp.generation <= self._view_generation:
            return
        await self._signal.wait_for(
            lambda: True if (self._view_generation or 0) >= stamp.generation else None,
            min(deadline, time.monotonic() + 10.0))

    def _spec(self, key: SliceKey) -> tuple[str, tuple[int, ...]]:
        try:
            return self._specs[key]
        except KeyError:
            held = (f"{len(self._specs)} slices are" if self._specs else
                    # The usual way to get here mid-run: a server restarted with nothing to restore.
                    "it holds none: restarted without a checkpoint? see --checkpoint-dir")
            raise UnknownKeyError(f"slice {str(key)!r} is not declared on this server ({held})") from None

    def _check_push_meta(self, key: SliceKey, dtype: str, shape: tuple[int, ...]) -> None:
        stored_dtype, stored_shape = self._spec(key)
        if shape != stored_shape:
            raise ShapeMismatchError(f"key {str(key)!r}: got shape {shape}, store has {stored_shape}")
        wire = self.store.config.wire_dtype
        if dtype != stored_dtype and not (wire and dtype == wire and stored_dtype in codec.PARAM_DTYPES):
            allowed = stored_dtype + (f" or {wire}" if wire else "")
            raise DTypeMismatchError(f"key {str(key)!r}: got dtype {dtype}, store has {allowed}")

    def _to_store(self, key: SliceKey, wire: codec.WireArray) -> np.ndarray:
        stored_dtype, _ = self._specs[key]
        return codec.cast(wire, stored_dtype).array

    def _encode(self, key: SliceKey) -> tuple[int, bytes, bool]:
        """(version, wire bytes, whether they form a whole data frame) of a slice's current value.

        The value is copied once, under the slice's lock, straight into the bytes that go on the
        wire; a slice of at least _OWN_FRAME_BYTES travels as its own frame.
        """
        cached = self._encoded.get(key)
        if cached is not None and cached[0] == self.store.version(key):
            return cached

        def encode(value: np.ndarray, dtype: np.dtype, version: int) -> tuple[int, bytes, bool]:
            if value.dtype != dtype:
                value = value.astype(dtype)
            wire = self._to_wire(key, value).array
            if wire.nbytes >= _OWN_FRAME_BYTES:
                return version, encode_data_frame([wire]), True
            return version, wire.tobytes(), False

        result = self.store.read_with(key, encode)
        if self.store.config.mode == "sync":
            self._encoded[key] = result
        return result

    def _to_wire(self, key: SliceKey, value: np.ndarray) -> codec.WireArray:
        stored = codec.WireArray(value, self._specs[key][0])
        wire = self.store.config.wire_dtype
        return codec.cast(stored, wire) if wire and stored.dtype in codec.PARAM_DTYPES else stored

    # ---- declare ----

    async def _configure(self, job: JobConfig | None) -> ShardStore:
        async with self._config_lock:
            if self._store is None:
                self._install(ShardStore(job or JobConfig(), quorum=self._quorum))
                log.info("configured: %s", job or JobConfig())
            elif job is not None and job != self._store.config:
                raise LayoutConflictError(f"config: got {job}, this server runs {self._store.config}")
            return self._store  # type: ignore[return-value]

    async def _declare(self, job: JobConfig | None,
                       items: Sequence[tuple[SliceKey, codec.WireArray]]
                       ) -> tuple[list[bool], list[np.ndarray]]:
        if not items:
            raise EmptyRequestError("Declare: no slices given")
        for key, wire in items:
            if wire.dtype not in codec.PARAM_DTYPES:
                raise DTypeMismatchError(f"key {str(key)!r}: got dtype {wire.dtype}, parameters must be "
                                         f"one of {codec.PARAM_DTYPES} (declare bfloat16 models as float32 "
                                         "and set wire_dtype=bfloat16)")
        store = await self._configure(job)
        keys = [k for k, _ in items]
        created = store.declare([(k, w.array) for k, w in items])
        for (key, wire), new in zip(items, created, strict=True):
            if new:
                self._specs[key] = (wire.dtype, tuple(wire.array.shape))
        return created, [v for v, _ in store.read(keys)]

    @_unary
    async def Declare(self, request: pb.DeclareRequest, context: grpc.aio.ServicerContext
                      ) -> pb.DeclareResponse:
        job = codec.job_from_proto(request.config) if request.HasField("config") else None
        items = [codec.slice_tensor_from_proto(s) for s in request.slices]
        created, values = await self._declare(job, items)
        return pb.DeclareResponse(created=created, slices=[
            codec.slice_tensor_to_proto(k, self._to_wire(k, v))
            for (k, _), v in zip(items, values, strict=True)])

    # ---- push / pull ----

    def _push(self, stamp: Stamp, items: Sequence[tuple[SliceKey, codec.WireArray]]) -> tuple[int, int]:
        for key, wire in items:
            self._check_push_meta(key, wire.dtype, tuple(wire.array.shape))
        outcome = self.store.push(stamp, {k: self._to_store(k, w) for k, w in items})
        return outcome.applied, outcome.dropped

    async def _wait_readable(self, stamp: Stamp, keys: Sequence[SliceKey], deadline: float) -> None:
        store = self.store
        started = time.monotonic()
        status = store.pull_status(stamp, keys)  # validates; raises on bad keys or clocks
        if status is None:
            return
        ready = await self._signal.wait_for(
            lambda: True if store.pull_status(stamp, keys) is None else None, deadline)
        if ready is None:
            self.pulls_timed_out += 1
            waiting = store.pull_status(stamp, keys)
            if waiting is None:
                return
            raise PullTimeoutError(
                f"pull by {stamp.worker_id!r} at clock {stamp.clock} timed out after "
                f"{time.monotonic() - started:.1f}s waiting for workers {list(waiting.workers)} "
                f"to reach clock {waiting.clock} (slices {[str(k) for k in waiting.keys][:5]})")

    def _timeout_s(self, timeout_ms: int) -> float:
        return timeout_ms / 1000 if timeout_ms else self._settings.pull_timeout_s

    async def _push_then_pull(self, stamp: Stamp, items: Sequence[tuple[SliceKey, codec.WireArray]],
                              keys: Sequence[SliceKey], timeout_ms: int
                              ) -> tuple[int, int, list[tensor_pb.SliceTensor]]:
        """What the unary Push, Pull and PushPull share: push (whole request atomically), then pull
        at the next clock (or at `stamp.clock` when nothing was pushed)."""
        for key in keys:
            self._spec(key)
        deadline = time.monotonic() + self._timeout_s(timeout_ms)
        await self._await_view(stamp, deadline)
        applied, dropped = self._push(stamp, items) if items else (0, 0)
        if not keys:
            return applied, dropped, []
        await self._wait_readable(stamp._replace(clock=stamp.clock + 1) if items else stamp, keys, deadline)
        self.pulls_served += 1
        return applied, dropped, [codec.slice_tensor_to_proto(k, self._to_wire(k, v), version)
                                  for k, (v, version) in zip(keys, self.store.read(keys), strict=True)]

    @_unary
    async def Push(self, request: pb.PushRequest, context: grpc.aio.ServicerContext) -> pb.PushResponse:
        stamp = codec.stamp_from_proto(request.stamp)
        items = [codec.slice_tensor_from_proto(g) for g in request.gradients]
        if not items:
            raise EmptyRequestError(f"Push from {stamp.worker_id!r}: no gradients given")
        applied, dropped, _ = await self._push_then_pull(stamp, items, [], 0)
        return pb.PushResponse(applied=applied, dropped=dropped)

    @_unary
    async def Pull(self, request: pb.PullRequest, context: grpc.aio.ServicerContext) -> pb.PullResponse:
        stamp = codec.stamp_from_proto(request.stamp)
        keys = [codec.slice_id_from_proto(s) for s in request.slices]
        if not keys:
            raise EmptyRequestError(f"Pull from {stamp.worker_id!r}: no slices given")
        _, _, slices = await self._push_then_pull(stamp, [], keys, request.timeout_ms)
        return pb.PullResponse(slices=slices)

    @_unary
    async def PushPull(self, request: pb.PushPullRequest, context: grpc.aio.ServicerContext
                       ) -> pb.PullResponse:
        stamp = codec.stamp_from_proto(request.stamp)
        items = [codec.slice_tensor_from_proto(g) for g in request.gradients]
        keys = [codec.slice_id_from_proto(s) for s in request.pull]
        if not items and not keys:
            raise EmptyRequestError(f"PushPull from {stamp.worker_id!r}: nothing to push or pull")
        applied, dropped, slices = await self._push_then_pull(stamp, items, keys, request.timeout_ms)
        return pb.PullResponse(applied=applied, dropped=dropped, slices=slices)

    # ---- Exchange: chunked push + pull on one stream ----

    async def Exchange(self, frames: AsyncIterator[bytes], context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[bytes]:
        try:
            async for out in self._exchange(frames):
                yield out
        except PSError as err:
            await abort(context, err)

    async def _exchange(self, frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        first = await anext(frames, None)
        if first is None:
            raise EmptyRequestError("Exchange: the stream ended before its header frame")
        message = codec.decode_frame(first)
        if message.WhichOneof("body") != "header":
            kind = message.WhichOneof("body")
            raise InvalidArgumentError(f"Exchange: first frame must be a header, got {kind}")
        header = message.header
        metas = [(codec.slice_id_from_proto(m.id), codec.dtype_from_proto(m.dtype, "push dtype"),
                  tuple(m.shape)) for m in header.push]
        if header.op == pb.DECLARE:
            async for out in self._exchange_declare(header, metas, frames):
                yield out
        elif header.op == pb.PUSH_PULL:
            async for out in self._exchange_push_pull(header, metas, frames):
                yield out
        else:
            raise InvalidArgumentError(f"Exchange header.op: got {header.op}, expected PUSH_PULL or DECLARE")

    async def _read_slices(self, metas: Sequence[tuple[SliceKey, str, tuple[int, ...]]],
                           frames: AsyncIterator[bytes]) -> AsyncIterator[tuple[int, codec.WireArray]]:
        names = [f"slice {str(k)!r}" for k, _, _ in metas]
        reader = SliceReader([codec.nbytes_of(n, d, s) for n, (_, d, s) in zip(names, metas, strict=True)],
                             names)

        def wire(index: int, buf: memoryview) -> tuple[int, codec.WireArray]:
            _, dtype, shape = metas[index]
            return index, codec.WireArray(codec.array_from_buffer(buf, dtype, shape, names[index]), dtype)

        for index, buf in reader.initial():
            yield wire(index, buf)
        async for frame in frames:
            payload = codec.decode_data_frame(frame)
            if payload is None:
                raise InvalidArgumentError("Exchange: expected only data frames after the header")
            for index, buf in reader.feed(payload):
                yield wire(index, buf)
        reader.finish()

    async def _exchange_declare(self, header: pb.ExchangeHeader, metas: list, frames: AsyncIterator[bytes]
                                ) -> AsyncIterator[bytes]:
        job = codec.job_from_proto(header.config) if header.HasField("config") else None
        items: list[tuple[SliceKey, codec.WireArray]] = []
        async for index, wire in self._read_slices(metas, frames):
            # Views of the frames; store.declare copies what it keeps.
            items.append((metas[index][0], wire))
        created, values = await self._declare(job, items)
        packer = FramePacker(self._settings.chunk_bytes)
        for (key, _), value in zip(items, values, strict=True):
            for out in packer.add(self._to_wire(key, value).array):
                yield out
        last = packer.flush()
        if last is not None:
            yield last
        yield codec.encode_frame(pb.Frame(summary=pb.ExchangeSummary(created=created)))

    async def _exchange_push_pull(self, header: pb.ExchangeHeader, metas: list,
                                  frames: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        stamp = codec.stamp_from_proto(header.stamp)
        for key, dtype, shape in metas:
            self._check_push_meta(key, dtype, shape)
        pull_keys = [codec.slice_id_from_proto(s) for s in header.pull]
        for key in pull_keys:
            self._spec(key)
        if not metas and not pull_keys:
            raise EmptyRequestError(f"Exchange from {stamp.worker_id!r}: nothing to push or pull")
        deadline = time.monotonic() + self._timeout_s(header.timeout_ms)
        await self._await_view(stamp, deadline)
        # The worker pushed step `clock`; what it pulls back is for its next step.
        pull_stamp = stamp._replace(clock=stamp.clock + 1) if metas else stamp
        counts = [0, 0]
        # Set once this request's own gradient for the slice has been handed to the store: the pull
        # must not be checked (or read) before it, or an async pull at clock + 1 looks like a read from
        # the future, a bad push's error loses to a pull error, and the read misses the worker's own update.
        pushed = {key: asyncio.Event() for key, _, _ in metas}

        async def consume() -> None:
            async for index, wire in self._read_slices(metas, frames):
                applied, dropped = self._push(stamp, [(metas[index][0], wire)])
                counts[0] += applied
                counts[1] += dropped
                pushed[metas[index][0]].set()

        reader = asyncio.ensure_future(consume())
        try:
            packer = FramePacker(self._settings.chunk_bytes, whole_slices=True)
            versions: list[int] = []
            for key in pull_keys:
                own = pushed.get(key)
                if ((own is not None and not own.is_set())
                        or self.store.pull_status(pull_stamp, [key]) is not None):
                    # Not ready: send what is packed so the client can use it while we wait.
                    pending = packer.flush()
                    if pending is not None:
                        yield pending
                    await self._wait_ready_or_failed(pull_stamp, key, deadline, reader, own)
                version, data, whole_frame = self._encode(key)
                versions.append(version)
                if whole_frame:
                    pending = packer.flush()
                    if pending is not None:
                        yield pending
                    yield data
                else:
                    for out in packer.add(data):
                        yield out
            last = packer.flush()
            if last is not None:
                yield last
            await reader  # the push side must be complete (and its errors raised) before the summary
            self.pulls_served += bool(pull_keys)
            yield codec.encode_frame(pb.Frame(summary=pb.ExchangeSummary(
                versions=versions, applied=counts[0], dropped=counts[1])))
        finally:
            if not reader.done():
                reader.cancel()

    async def _wait_ready_or_failed(self, stamp: Stamp, key: SliceKey, deadline: float,
                                    reader: asyncio.Future, own: asyncio.Event | None) -> None:
        """Wait for the request's own push of `key` (if any), then for `key` to be readable;
        a failed push side ends the wait with its error at once."""
        async def ready() -> None:
            if own is not None:
                try:
                    await asyncio.wait_for(own.wait(), max(0.0, deadline - time.monotonic()))
                except TimeoutError:
                    raise PullTimeoutError(f"Exchange from {stamp.worker_id!r}: the gradient of slice "
                                           f"{str(key)!r} did not arrive before the request's deadline"
                                           ) from None
            await self._wait_readable(stamp, [key], deadline)

        waiter = asyncio.ensure_future(ready())
        try:
            await asyncio.wait({waiter, reader}, return_when=asyncio.FIRST_COMPLETED)
            if reader.done() and reader.exception() is not None:
                raise reader.exception()  # type: ignore[misc]
            await waiter
        finally:
            waiter.cancel()

    # ---- operations ----

    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext
                       ) -> pb.GetStatsResponse:
        if self._store is None:
            return pb.GetStatsResponse(pulls_waiting=self._signal.waiting)
        s = self._store.stats()
        job = self._store.config
        return pb.GetStatsResponse(
            mode=_MODE_ENUM[job.mode], staleness=job.staleness, optimizer=job.optimizer.name,
            slices=s.slices, bytes_stored=s.bytes_stored, pushes_applied=s.pushes_applied,
            pushes_dropped=s.pushes_dropped, late_gradients_dropped=s.late_gradients_dropped,
            pulls_served=self.pulls_served, pulls_waiting=self._signal.waiting,
            pulls_timed_out=self.pulls_timed_out, quorum=sorted(s.quorum),
            worker_clocks=dict(s.worker_clocks), min_version=s.min_version, max_version=s.max_version)

    async def checkpoint(self, at_version: int = 0, timeout_s: float = 60.0) -> tuple[Path, int]:
        if not self._settings.checkpoint_dir:
            raise InvalidArgumentError("checkpoint: this server was started without --checkpoint-dir")
        store = self.store
        ok = await self._signal.wait_for(
            lambda: True if store.stats().min_version >= at_version else None, time.monotonic() + timeout_s)
        if ok is None:
            raise PullTimeoutError(f"checkpoint at version {at_version}: slices are still at "
                                   f"version {store.stats().min_version} after {timeout_s:.1f}s")
        snap = store.snapshot()
        path = await asyncio.get_running_loop().run_in_executor(
            None, save_shard, Path(self._settings.checkpoint_dir), snap, self._settings.shard_name)
        return path, store.stats().min_version

    @_unary
    async def Checkpoint(self, request: pb.CheckpointRequest, context: grpc.aio.ServicerContext
                         ) -> pb.CheckpointResponse:
        path, version = await self.checkpoint(request.at_version, self._timeout_s(request.timeout_ms))
        return pb.CheckpointResponse(path=str(path), min_version=version)
