"""The one codec: numpy <-> protobuf, Python's own types <-> the wire's enums, and the Exchange frames.

Tensors travel as {dtype, shape, bytes} (little-endian, C order). bfloat16 has no
numpy dtype: on the wire and in numpy it is its raw 16-bit pattern (a uint16
array) tagged "bfloat16"; `bf16_to_f32`/`f32_to_bf16` convert. Never pickle.

Arrays in this module travel with a logical dtype name (`WireArray`), because
a uint16 array may be bfloat16. The facts about each dtype live in `pshard.common.wire.dtypes`.

The Python side names roles, modes and optimizers with strings (`pshard.common.cluster.view.ROLES`,
`pshard.common.job.MODES`/`OPTIMIZERS`); the wire uses enums. This module is the one place that
converts: an enum value this version does not know is an InvalidArgumentError naming the field.
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple, Protocol

import numpy as np
from google.protobuf.message import DecodeError
from pshard.common.cluster.layout import Layout, LayoutSlice, ParamSpec
from pshard.common.cluster.loads import Counters, ServerLoad
from pshard.common.cluster.view import (
    ROLES,
    ClusterView,
    Node,
    NodeState,
    PartitionCopy,
    ServerLoss,
    SliceCopy,
)
from pshard.common.compression import PullPack
from pshard.common.errors import EmptyRequestError, InvalidArgumentError, PayloadSizeError, quote
from pshard.common.job import MODES, NONFINITE, OPTIMIZERS, JobConfig, OptimizerConfig, check_lr
from pshard.common.limits import DEFAULT_LIMITS
from pshard.common.types import SliceKey, Stamp
from pshard.common.wire import dtypes

from pshard.api.v1 import parameter_server_pb2 as ps_pb
from pshard.api.v1 import scheduler_pb2 as sched_pb
from pshard.api.v1 import tensor_pb2 as tensor_pb


class WireArray(NamedTuple):
    """A numpy array and its logical dtype (bfloat16 arrays are stored as uint16). `encoding`: a pushed
    gradient packed by a compressor ("topk", "randomk", "sign"; pshard.common.wire.compress) travels as
    uint8 bytes tagged with it; "" is a plain array."""

    array: np.ndarray
    dtype: str
    encoding: str = ""


def numpy_dtype(name: str) -> np.dtype:
    return dtypes.numpy_dtype(name)


def dtype_to_proto(name: str) -> tensor_pb.Dtype:
    return typing.cast(tensor_pb.Dtype, dtypes.info(name).proto)


def dtype_from_proto(enum: int, field: str = "dtype") -> str:
    return dtypes.from_proto(enum, field).name


def dtype_name_of(array: np.ndarray) -> str:
    return dtypes.of_numpy(array.dtype).name


# ---- enums: Python's names <-> the wire's values ----

class _Enum(NamedTuple):
    """One wire enum next to Python's names for its values."""

    to_proto: dict[str, int]
    from_proto: dict[int, str]
    unspecified: str  # the name of value 0, proto3's "not set"


def _enum(names: Sequence[str], value_of: Callable[[str], int], prefix: str) -> _Enum:
    """Pairs Python's names with the values named PREFIX_NAME ("ps" -> ROLE_PS). A Python name
    without its enum value fails here, at import, not on the first message that uses it."""
    to_proto = {name: value_of(f"{prefix}_{name.upper()}") for name in names}
    return _Enum(to_proto, {v: k for k, v in to_proto.items()}, f"{prefix}_UNSPECIFIED")


def _to_proto(enum: _Enum, name: str, field: str) -> int:
    try:
        return enum.to_proto[name]
    except KeyError:
        raise InvalidArgumentError(f"{field}: got {name!r}, expected one of {tuple(enum.to_proto)}") from None


def _from_proto(enum: _Enum, value: int, field: str) -> str:
    if value == 0:
        raise EmptyRequestError(f"{field}: got {enum.unspecified}, expected one of {tuple(enum.to_proto)}")
    try:
        return enum.from_proto[value]
    except KeyError:
        raise InvalidArgumentError(f"{field}: got enum value {value}, expected one of "
                                   f"{tuple(enum.to_proto)}") from None


_ROLES = _enum(ROLES, sched_pb.Role.Value, "ROLE")
_MODES = _enum(MODES, ps_pb.ConsistencyMode.Value, "CONSISTENCY_MODE")
_OPTIMIZERS = _enum(OPTIMIZERS, ps_pb.Optimizer.Value, "OPTIMIZER")
_NONFINITE = _enum(NONFINITE, ps_pb.NonfinitePolicy.Value, "NONFINITE_POLICY")
_ENCODINGS = _enum(("topk", "randomk", "sign"), tensor_pb.Encoding.Value, "ENCODING")


def role_to_proto(role: str) -> sched_pb.Role:
    return typing.cast(sched_pb.Role, _to_proto(_ROLES, role, "role"))


def role_from_proto(value: int, field: str = "role") -> str:
    return _from_proto(_ROLES, value, field)


def mode_to_proto(mode: str) -> ps_pb.ConsistencyMode:
    return typing.cast(ps_pb.ConsistencyMode, _to_proto(_MODES, mode, "mode"))


def mode_from_proto(value: int, field: str = "mode") -> str:
    return _from_proto(_MODES, value, field)


def optimizer_to_proto(name: str) -> ps_pb.Optimizer:
    return typing.cast(ps_pb.Optimizer, _to_proto(_OPTIMIZERS, name, "optimizer.name"))


def optimizer_from_proto(value: int, field: str = "optimizer.name") -> str:
    return _from_proto(_OPTIMIZERS, value, field)


def encoding_to_proto(encoding: str) -> tensor_pb.Encoding:
    """A packed slice's encoding ("" = not packed, ENCODING_UNSPECIFIED)."""
    return typing.cast(tensor_pb.Encoding, _to_proto(_ENCODINGS, encoding, "encoding") if encoding else 0)


def encoding_from_proto(value: int, field: str = "encoding") -> str:
    return "" if value == 0 else _from_proto(_ENCODINGS, value, field)


def pull_packs_to_proto(packs: Sequence[PullPack]) -> list[ps_pb.PullPacking]:
    return [ps_pb.PullPacking(encoding=encoding_to_proto(p.encoding), k=p.k, base=p.base) for p in packs]


def pull_packs_from_proto(header: ps_pb.ExchangeHeader) -> list[PullPack]:
    """ExchangeHeader.pull_packing ([] when the request pulls every slice whole)."""
    return [PullPack(encoding_from_proto(p.encoding, "pull_packing.encoding"), p.k, p.base)
            for p in header.pull_packing]


def nonfinite_to_proto(policy: str) -> ps_pb.NonfinitePolicy:
    return typing.cast(ps_pb.NonfinitePolicy, _to_proto(_NONFINITE, policy, "nonfinite"))


def nonfinite_from_proto(value: int, field: str = "nonfinite") -> str:
    # Unset is the documented default: a client that predates the setting keeps refusing NaN.
    return "reject" if value == 0 else _from_proto(_NONFINITE, value, field)


# ---- optional fields ----

class TimedRequest(Protocol):
    """A request with an `optional uint32 timeout_ms`."""

    timeout_ms: int

    def HasField(self, name: str) -> bool: ...


def timeout_ms_from_proto(message: TimedRequest) -> int | None:
    """A request's `optional timeout_ms`: None when absent (the receiver's default), else the value,
    0 included (answer at once)."""
    return message.timeout_ms if message.HasField("timeout_ms") else None


# ---- bfloat16 ----

def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    """bfloat16 is the top half of a float32: widen by shifting into the high 16 bits."""
    wide = np.asarray(bits).astype(np.uint32)
    wide <<= 16  # in place: `wide << 16` would turn a 0-d array into a numpy scalar
    return wide.view(np.float32)


def f32_to_bf16(values: np.ndarray) -> np.ndarray:
    """Round to nearest even, as torch does; NaN stays NaN (its payload is kept quiet)."""
    values = np.asarray(values, dtype=np.float32)
    # Work flat: ascontiguousarray would make a 0-d array 1-d, and 0-d arithmetic yields scalars.
    flat = values.reshape(-1)
    bits = flat.view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(flat)
    if nan.any():
        rounded[nan] = ((bits[nan] >> 16) | 0x0040).astype(np.uint16)
    return rounded.reshape(values.shape)


def cast(wire: WireArray, dtype: str) -> WireArray:
    """Convert between float dtypes (the wire compression casts), via float32 for bfloat16."""
    if wire.dtype == dtype:
        return wire
    values = bf16_to_f32(wire.array) if wire.dtype == "bfloat16" else wire.array
    if dtype == "bfloat16":
        return WireArray(f32_to_bf16(values), dtype)
    return WireArray(values.astype(numpy_dtype(dtype)), dtype)


# ---- tensors ----

def nbytes_of(what: str, dtype: str, shape: Sequence[int]) -> int:
    """The byte length a (dtype, shape) needs. A shape past the documented limits (too many
    dimensions, too many elements, a negative dimension) is an error naming `what`, raised before
    numpy sees it: numpy's own refusals are not errors a client can be told about."""
    return DEFAULT_LIMITS.check_shape(what, shape) * numpy_dtype(dtype).itemsize


def check_nbytes(what: str, dtype: str, shape: Sequence[int], nbytes: int) -> int:
    """The byte length a (dtype, shape) needs; PayloadSizeError naming both when `nbytes` differs."""
    want = nbytes_of(what, dtype, shape)
    if nbytes != want:
        raise PayloadSizeError(f"{what}: got {nbytes} bytes, dtype {dtype} and shape {tuple(shape)} "
                               f"need {want}")
    return want


def array_from_buffer(buffer: bytes | memoryview, dtype: str, shape: Sequence[int],
                      what: str = "tensor") -> np.ndarray:
    """Zero-copy view of `buffer` (read-only when the buffer is bytes)."""
    check_nbytes(what, dtype, shape, len(buffer))
    return np.frombuffer(buffer, dtype=numpy_dtype(dtype)).reshape(tuple(shape))


def tensor_to_proto(wire: WireArray) -> tensor_pb.Tensor:
    # Not ascontiguousarray: it makes a 0-d array 1-d. tobytes() is C order whatever the strides.
    array = np.asarray(wire.array, dtype=numpy_dtype(wire.dtype))
    return tensor_pb.Tensor(dtype=dtype_to_proto(wire.dtype), shape=array.shape, data=array.tobytes())


def tensor_from_proto(t: tensor_pb.Tensor, what: str = "tensor") -> WireArray:
    dtype = dtype_from_proto(t.dtype, f"{what} dtype")
    return WireArray(array_from_buffer(t.data, dtype, tuple(t.shape), what), dtype)


def slice_id_to_proto(key: SliceKey) -> tensor_pb.SliceId:
    return tensor_pb.SliceId(key=key.key, part=key.part)


def slice_id_from_proto(s: tensor_pb.SliceId) -> SliceKey:
    return SliceKey(s.key, s.part)


def slice_tensor_to_proto(key: SliceKey, wire: WireArray, version: int = 0) -> tensor_pb.SliceTensor:
    return tensor_pb.SliceTensor(id=slice_id_to_proto(key), tensor=tensor_to_proto(wire), version=version,
                                 encoding=encoding_to_proto(wire.encoding))


def slice_tensor_from_proto(s: tensor_pb.SliceTensor) -> tuple[SliceKey, WireArray]:
    key = slice_id_from_proto(s.id)
    what = f"slice {quote(str(key))}"
    wire = tensor_from_proto(s.tensor, what)
    return key, wire._replace(encoding=encoding_from_proto(s.encoding, f"{what} encoding"))


# ---- stamps, job config ----

def stamp_to_proto(stamp: Stamp) -> ps_pb.Stamp:
    return ps_pb.Stamp(worker_id=stamp.worker_id, generation=stamp.generation, clock=stamp.clock,
                       lr=stamp.lr, schedule_id=stamp.schedule, schedule_seq=stamp.schedule_seq,
                       schedule_floor=stamp.schedule_floor)


def stamp_from_proto(s: ps_pb.Stamp) -> Stamp:
    if not s.worker_id:
        raise InvalidArgumentError("stamp.worker_id: got '', expected the worker's id")
    if s.HasField("lr"):
        check_lr("stamp.lr", s.lr)
    return Stamp(s.worker_id, s.generation, s.clock, s.lr if s.HasField("lr") else None,
                 s.schedule_id, s.schedule_seq, s.schedule_floor)


def job_to_proto(job: JobConfig) -> ps_pb.JobConfig:
    o = job.optimizer
    return ps_pb.JobConfig(
        mode=mode_to_proto(job.mode), staleness=job.staleness, backup_workers=job.backup_workers,
        wire_dtype=dtype_to_proto(job.wire_dtype) if job.wire_dtype else tensor_pb.DTYPE_UNSPECIFIED,
        nonfinite=nonfinite_to_proto(job.nonfinite), job_id=job.job_id, averaged=job.averaged,
        optimizer=ps_pb.OptimizerConfig(
            name=optimizer_to_proto(o.name), lr=o.lr, momentum=o.momentum, dampening=o.dampening,
            nesterov=o.nesterov,
            weight_decay=o.weight_decay, beta1=o.betas[0], beta2=o.betas[1], eps=o.eps, amsgrad=o.amsgrad,
            lr_decay=o.lr_decay, initial_accumulator_value=o.initial_accumulator_value))


def job_from_proto(p: ps_pb.JobConfig) -> JobConfig:
    o = p.optimizer
    return JobConfig(
        mode=mode_from_proto(p.mode, "config.mode"), staleness=p.staleness, backup_workers=p.backup_workers,
        wire_dtype="" if p.wire_dtype == tensor_pb.DTYPE_UNSPECIFIED
        else dtype_from_proto(p.wire_dtype, "config.wire_dtype"),
        nonfinite=nonfinite_from_proto(p.nonfinite, "config.nonfinite"), job_id=p.job_id,
        averaged=tuple(p.averaged),
        optimizer=OptimizerConfig(
            name=optimizer_from_proto(o.name, "config.optimizer.name"), lr=o.lr, momentum=o.momentum,
            dampening=o.dampening, nesterov=o.nesterov,
            weight_decay=o.weight_decay, betas=(o.beta1, o.beta2), eps=o.eps, amsgrad=o.amsgrad,
            lr_decay=o.lr_decay, initial_accumulator_value=o.initial_accumulator_value))


# ---- layout ----

def param_spec_to_proto(p: ParamSpec) -> sched_pb.ParamSpec:
    return sched_pb.ParamSpec(key=p.key, dtype=dtype_to_proto(p.dtype), shape=p.shape)


def param_spec_from_proto(p: sched_pb.ParamSpec) -> ParamSpec:
    return ParamSpec(p.key, dtype_from_proto(p.dtype, f"param {quote(p.key)} dtype"), tuple(p.shape))


def layout_to_proto(layout: Layout) -> sched_pb.Layout:
    return sched_pb.Layout(
        version=layout.version, params=[param_spec_to_proto(p) for p in layout.params],
        servers=layout.servers, slice_bytes=layout.slice_bytes,
        slices=[sched_pb.LayoutSlice(key=s.key, part=s.part, server=s.server, offset=s.offset,
                                     numel=s.numel) for s in layout.slices], replicas=layout.replicas,
        row_owners=layout.row_owners)


def layout_from_proto(p: sched_pb.Layout) -> Layout:
    return Layout(
        params=tuple(param_spec_from_proto(x) for x in p.params), servers=tuple(p.servers),
        slice_bytes=p.slice_bytes, version=p.version,
        slices=tuple(LayoutSlice(s.key, s.part, s.server, s.offset, s.numel) for s in p.slices),
        replicas=p.replicas, row_owners=tuple(p.row_owners))


# ---- Exchange frames ----
# A data frame is the protobuf encoding of ExchangeRequest{data: bytes} or ExchangeResponse{data:
# bytes} (both field 2): tag 0x12 (field 2, length-delimited), a varint length, the bytes. We write
# and read that encoding ourselves so a 4 MiB chunk is copied once, not three times through message
# objects, while staying an ordinary protobuf message for any other client.

_DATA_TAG = 0x12


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def byte_view(buf: bytes | memoryview | np.ndarray) -> memoryview:
    """The raw bytes of `buf` (C order) as a flat view, copying only a non-contiguous array."""
    if isinstance(buf, np.ndarray):
        # Through a flat uint8 array: memoryview.cast refuses shapes with a 0 in them, like (0, 4).
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8).data
    view = memoryview(buf)
    return view.cast("B") if view.nbytes else memoryview(b"")


def encode_data_frame(parts: Iterable[bytes | memoryview | np.ndarray]) -> bytes:
    """One data frame carrying the concatenation of `parts` (one copy, by bytes.join)."""
    views = [p if isinstance(p, bytes) else byte_view(p) for p in parts]
    size = sum(len(v) for v in views)
    return b"".join([bytes((_DATA_TAG,)) + _varint(size), *views])


def decode_data_frame(frame: bytes) -> memoryview | None:
    """The payload of a data frame as a zero-copy view, or None when it is another kind of frame."""
    if not frame or frame[0] != _DATA_TAG:
        return None
    size, shift, pos = 0, 0, 1
    while True:
        if pos >= len(frame) or shift > 63:
            raise PayloadSizeError(f"data frame: truncated length prefix ({len(frame)} bytes)")
        byte = frame[pos]
        size |= (byte & 0x7F) << shift
        pos += 1
        shift += 7
        if not byte & 0x80:
            break
    if pos + size != len(frame):
        raise PayloadSizeError(f"data frame: prefix says {size} bytes, frame holds {len(frame) - pos}")
    return memoryview(frame)[pos:]


def encode_frame(message: ps_pb.ExchangeRequest | ps_pb.ExchangeResponse) -> bytes:
    return message.SerializeToString()


M = typing.TypeVar("M", ps_pb.ExchangeRequest, ps_pb.ExchangeResponse)


def _decode(message: M, frame: bytes) -> M:
    try:
        message.ParseFromString(frame)
    except DecodeError as err:  # bytes the peer sent: its error, not ours
        raise InvalidArgumentError(f"Exchange frame: {len(frame)} bytes are not an "
                                   f"{type(message).__name__} ({err})") from None
    return message


def decode_request_frame(frame: bytes) -> ps_pb.ExchangeRequest:
    """A client's Exchange message (the server's side of the stream)."""
    return _decode(ps_pb.ExchangeRequest(), frame)


def decode_response_frame(frame: bytes) -> ps_pb.ExchangeResponse:
    """A server's Exchange message (the client's side of the stream)."""
    return _decode(ps_pb.ExchangeResponse(), frame)


# ---- cluster views (scheduler messages) ----

_STATE_TO_PROTO = {NodeState.LIVE: sched_pb.NODE_STATE_LIVE, NodeState.DEAD: sched_pb.NODE_STATE_DEAD,
                   NodeState.LEFT: sched_pb.NODE_STATE_LEFT}
_STATE_FROM_PROTO = {v: k for k, v in _STATE_TO_PROTO.items()}


def node_to_proto(node: Node) -> sched_pb.Node:
    return sched_pb.Node(node_id=node.node_id, role=role_to_proto(node.role), rank=node.rank,
                         address=node.address, state=_STATE_TO_PROTO[node.state], generation=node.generation)


def node_from_proto(p: sched_pb.Node) -> Node:
    # A state this version does not know (a newer scheduler) is safest read as not live.
    state = _STATE_FROM_PROTO.get(p.state, NodeState.DEAD)
    return Node(p.node_id, role_from_proto(p.role, f"node {p.node_id!r} role"), p.rank, p.address, state,
                p.generation)


def view_to_proto(view: ClusterView) -> sched_pb.ClusterView:
    lost = [sched_pb.ServerLoss(address=loss.address, layout_version=loss.layout_version, reason=loss.reason)
            for loss in view.lost]
    copies = [sched_pb.PartitionCopy(partition=c.partition, source=c.source, target=c.target,
                                     switched_at=c.switched_at) for c in view.copies]
    slice_copies = [sched_pb.SliceCopy(source=c.source, target=c.target, switched_at=c.switched_at,
                                       slices=[slice_id_to_proto(k) for k in sorted(c.slices)])
                    for c in view.slice_copies]
    return sched_pb.ClusterView(generation=view.generation, nodes=[node_to_proto(n) for n in view.nodes],
                                layout_version=view.layout_version, lost=lost, copies=copies,
                                slice_copies=slice_copies)


def view_from_proto(p: sched_pb.ClusterView) -> ClusterView:
    lost = tuple(ServerLoss(loss.address, loss.layout_version, loss.reason) for loss in p.lost)
    copies = tuple(PartitionCopy(c.partition, c.source, c.target, c.switched_at) for c in p.copies)
    slice_copies = tuple(SliceCopy(c.source, c.target, frozenset(slice_id_from_proto(k) for k in c.slices),
                                   c.switched_at) for c in p.slice_copies)
    nodes = tuple(node_from_proto(n) for n in p.nodes)
    return ClusterView(p.generation, nodes, p.layout_version, lost, copies, slice_copies)


# ---- load (issue 20: `pshard status`, `pshard rebalance`) ----


def counters_into_proto(counters: Counters, request: sched_pb.HeartbeatRequest) -> None:
    """A server's load counters into its heartbeat."""
    request.bytes_in, request.bytes_out = counters.bytes_in, counters.bytes_out
    request.partitions.extend(
        sched_pb.PartitionCounters(partition=p, rows=n, bytes=counters.partition_bytes.get(p, 0))
        for p, n in sorted(counters.rows.items()))


def counters_from_proto(request: sched_pb.HeartbeatRequest) -> Counters:
    return Counters(request.bytes_in, request.bytes_out, {p.partition: p.rows for p in request.partitions},
                    {p.partition: p.bytes for p in request.partitions})


def load_to_proto(load: ServerLoad) -> sched_pb.ServerLoad:
    return sched_pb.ServerLoad(
        address=load.address, bytes_in_per_s=load.bytes_in_per_s, bytes_out_per_s=load.bytes_out_per_s,
        partitions=[sched_pb.PartitionLoad(partition=p, rows_per_s=rate,
                                           bytes=load.partition_bytes.get(p, 0))
                    for p, rate in sorted(load.rows_per_s.items())])


def load_from_proto(p: sched_pb.ServerLoad) -> ServerLoad:
    return ServerLoad(p.address, p.bytes_in_per_s, p.bytes_out_per_s,
                      {q.partition: q.rows_per_s for q in p.partitions},
                      {q.partition: q.bytes for q in p.partitions})


# ---- registration ----

class RegisterArgs(NamedTuple):
    """A RegisterRequest in Python's terms: the arguments of `Membership.register`."""

    role: str
    address: str
    node_id: str | None
    rank_hint: int | None
    last_generation: int


def register_to_proto(role: str, address: str, node_id: str | None = None, rank_hint: int | None = None,
                      last_generation: int = 0, layout: Layout | None = None) -> sched_pb.RegisterRequest:
    # None leaves an optional field absent; proto3 presence tells "no hint" from rank 0.
    return sched_pb.RegisterRequest(role=role_to_proto(role), address=address, node_id=node_id,
                                    rank_hint=rank_hint, last_generation=last_generation,
                                    layout=layout_to_proto(layout) if layout is not None else None)


def register_from_proto(p: sched_pb.RegisterRequest) -> RegisterArgs:
    if p.HasField("node_id") and not p.node_id:
        raise InvalidArgumentError("node_id: got '', expected a node id or no node_id field "
                                   "(the scheduler assigns one)")
    return RegisterArgs(role_from_proto(p.role), p.address,
                        p.node_id if p.HasField("node_id") else None,
                        p.rank_hint if p.HasField("rank_hint") else None, p.last_generation)
