"""A dense slice's replication record and its wire form (docs/architecture.md, 9 Failures).

What travels is the slice's state after its newest step (value, optimizer state, version, per-worker
clocks, SSP floors, scheduled calls' push numbers), taken under the slice's lock, or (from older
primaries) one step's update. A state's arrays go one of three ways (ps_server/replication/backends.py):
encoded inline in the message, as the data of a raw TCP link's frame, or into shared-memory segments the
backup maps.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from pshard.common.errors import InvalidArgumentError
from pshard.common.types import SliceKey
from pshard.common.wire import codec
from pshard.ps_server.core.optimizers import SliceState
from pshard.ps_server.core.policies import Slot
from pshard.ps_server.replication.shm import ArraySpec, SegmentWriter

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import tensor_pb2 as tensor_pb


class Record(NamedTuple):
    seq: int
    key: SliceKey
    version: int  # the slice's version once applied
    state: bool  # True: the whole slice; False: one step
    value: np.ndarray  # state: the master value; step: the update
    summed: int  # step: how many gradients `value` sums
    clocks: dict[str, int]
    dtype: str = ""  # state: the declared dtype
    opt_state: SliceState | None = None
    floors: dict[str, int] | None = None
    # State through shared memory (ps_server/replication/shm.py): where its arrays lie, and what they are.
    segment: str = ""
    offset: int = 0
    specs: tuple[ArraySpec, ...] = ()
    # Schedule id -> last push number applied (Slot.scheduled): state: all of them; step: as after it.
    scheduled: dict[int, int] | None = None


def step_record(slot: Slot, update: np.ndarray, count: int, seq: int) -> Record:
    """Called under the slice's lock, before the step: `update` may be scratch or a network buffer."""
    return Record(seq, slot.key, slot.version + 1, False, np.array(update, copy=True), count,
                  dict(slot.last_clock), scheduled=dict(slot.scheduled))


def state_record(slot: Slot, seq: int) -> Record:
    """The whole slice, under its lock."""
    state = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in slot.opt_state.items()}
    return Record(seq, slot.key, slot.version, True, slot.value.copy(), 0, dict(slot.last_clock),
                  slot.dtype.name, state, dict(slot.floors), scheduled=dict(slot.scheduled))


def _tensor(v: np.ndarray, inline: bool) -> tensor_pb.Tensor:
    if inline:
        return codec.tensor_to_proto(codec.WireArray(v, v.dtype.name))
    return tensor_pb.Tensor(dtype=codec.dtype_to_proto(v.dtype.name), shape=v.shape)  # the bytes are in shm


def record_to_proto(r: Record, inline: bool | None = None) -> pb.ReplicaRecord:
    """`inline`: the arrays' bytes in the message (default: unless they lie in shared memory)."""
    inline = not r.segment if inline is None else inline
    msg = pb.ReplicaRecord(id=codec.slice_id_to_proto(r.key), version=r.version, state=r.state,
                           value=_tensor(r.value, inline), count=r.summed, clocks=r.clocks,
                           segment=r.segment, offset=r.offset, scheduled=r.scheduled or {})
    if r.state:
        msg.dtype = codec.dtype_to_proto(r.dtype)
        msg.floors.update(r.floors or {})
        for name, v in (r.opt_state or {}).items():
            if isinstance(v, np.ndarray):
                msg.opt_arrays[name].CopyFrom(_tensor(v, inline))
            elif isinstance(v, (int, np.integer)) and not isinstance(v, bool):
                msg.opt_ints[name] = int(v)
            else:
                msg.opt_floats[name] = float(v)
    return msg


def _spec(t: tensor_pb.Tensor, name: str, what: str) -> ArraySpec:
    return name, codec.dtype_from_proto(t.dtype, f"{what} dtype"), tuple(t.shape)


def record_from_proto(msg: pb.ReplicaRecord) -> Record:
    key = codec.slice_id_from_proto(msg.id)
    if msg.segment:  # arrays in shared memory: the replica set maps them (see `ReplicaSet.apply`)
        if not msg.state:
            raise InvalidArgumentError(f"replica {key}: only a state may lie in shared memory")
        specs = (_spec(msg.value, "", f"replica {key}"),
                 *(_spec(msg.opt_arrays[n], n, f"replica {key} {n}") for n in sorted(msg.opt_arrays)))
        scalars: SliceState = {**dict(msg.opt_ints), **dict(msg.opt_floats)}
        return Record(0, key, msg.version, True, np.empty(0), 0, dict(msg.clocks),
                      codec.dtype_from_proto(msg.dtype), scalars, dict(msg.floors), msg.segment, msg.offset,
                      specs, dict(msg.scheduled))
    value = codec.tensor_from_proto(msg.value, f"replica {key}").array
    if not msg.state:
        return Record(0, key, msg.version, False, value, max(1, msg.count), dict(msg.clocks),
                      scheduled=dict(msg.scheduled))
    opt: SliceState = {n: np.array(codec.tensor_from_proto(t, f"replica {key} {n}").array, copy=True)
                       for n, t in msg.opt_arrays.items()}
    opt.update(dict(msg.opt_ints))
    opt.update(dict(msg.opt_floats))
    return Record(0, key, msg.version, True, np.array(value, copy=True), 0, dict(msg.clocks),
                  codec.dtype_from_proto(msg.dtype), opt, dict(msg.floors), scheduled=dict(msg.scheduled))


def state_to_proto(slot: Slot, shm: SegmentWriter | None, arrays: list[np.ndarray] | None = None
                    ) -> pb.ReplicaRecord:
    """`slot`'s state as a record (under its lock): its arrays copied into `shm`, else appended to
    `arrays` (value, then optimizer arrays by name: the raw link's data), else encoded inline."""
    record = Record(0, slot.key, slot.version, True, slot.value, 0, dict(slot.last_clock), slot.dtype.name,
                    dict(slot.opt_state), dict(slot.floors), scheduled=dict(slot.scheduled))
    if shm is None and arrays is not None:
        arrays.append(slot.value.copy())
        arrays.extend(np.array(v, copy=True) for n, v in sorted(slot.opt_state.items())
                      if isinstance(v, np.ndarray))
        return record_to_proto(record, inline=False)
    if shm is None:
        return record_to_proto(record)  # encoding is the one copy
    segment, offset = shm.write(slot)
    return record_to_proto(record._replace(segment=segment, offset=offset))

