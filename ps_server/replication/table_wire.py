"""Table-row batches (ps_server/replication/table_rows.py) on the wire: parameter_server.proto's TableReplica.

Between servers on one host the columns do not travel in the call: the primary gathers them straight
into a segment file of the shared-memory directory (`RowSegment`, one per backup, reused call after
call: one call per backup is in flight at a time, and the backup copies the rows into its replica
before it answers), and the call carries where they lie. The segments are replica_shm's (named so
that a dead primary's files are swept; unlinked once the backup has them mapped). A backup that
cannot map them (another host, no shared memory) says so, and the rows go inline from then on.
Between hosts, when the backup offers a raw TCP link (ps_server/transport/replica_tcp.py), the columns are the
link frame's data instead (`frame_columns`): received into the session's request region, which the
backup reads as it would a segment, and copies out of before it answers.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from pshard.common.errors import InvalidArgumentError
from pshard.common.sparse import TableConfig
from pshard.common.types import SliceKey
from pshard.common.wire.sparse_codec import spec_from_proto, spec_to_proto
from pshard.ps_server.replication.shm import ArraySpec, SegmentMaps, _aligned, _Segment
from pshard.ps_server.replication.table_rows import RowBatch
from pshard.ps_server.tables.table import SparseTable

from pshard.api.v1 import parameter_server_pb2 as pb

_ID = np.dtype("<i8")
_MIN_SEGMENT = 4 * 2**20
# Table rows a backup applies on its event loop: their ids' bytes (8 each), 65,536 rows.
_LOOP_ROW_BYTES = 8 << 16


@functools.lru_cache(maxsize=64)
def _columns(config: TableConfig) -> tuple[tuple[str, np.dtype, tuple[int, ...]], ...]:
    """The per-row arrays of a table of `config`, in name order (the segment order)."""
    return tuple((name, a.dtype, shape) for name, (a, shape) in sorted(SparseTable(config).columns().items()))


@functools.lru_cache(maxsize=64)
def row_bytes(config: TableConfig) -> int:
    """Bytes of one row's id and columns."""
    return 8 + sum(dtype.itemsize * int(np.prod(shape, dtype=np.int64))
                   for _, dtype, shape in _columns(config))


def column_specs(config: TableConfig, rows: int) -> list[ArraySpec]:
    return [(name, dtype.name, (rows, *shape)) for name, dtype, shape in _columns(config)]


def batch_into_proto(b: RowBatch, msg: pb.TableReplica, segment: str = "", offset: int = 0,
                     inline: bool = True) -> None:
    """Fill `msg` with `b`; its columns lie in `segment` at `offset` when given, else inline, or,
    not `inline`, nowhere: they go as a link frame's data (`frame_columns`)."""
    msg.spec.CopyFrom(spec_to_proto(b.config))
    msg.ids = b.ids.astype(_ID, copy=False).tobytes()
    if segment:
        msg.segment, msg.offset = segment, offset
    elif inline:
        columns_into_proto(b, msg)
    msg.deleted = b.deleted.astype(_ID, copy=False).tobytes()
    msg.step, msg.clock, msg.evicted, msg.admitted = b.step, b.clock, b.evicted, b.admitted
    msg.seen_ids = b.seen_ids.astype(_ID, copy=False).tobytes()
    msg.seen_counts = b.seen_counts.astype("<i4", copy=False).tobytes()
    msg.rng_state = b.rng_state
    msg.admit_epoch = b.admit_epoch
    for worker, keys in b.pushes.items():
        entry = msg.pushes[worker]
        entry.ids.extend(k for k, _ in keys)
        entry.partitions.extend(p for _, p in keys)
    if b.applied:
        msg.applied_clocks.update(b.applied)
    if b.scheduled is not None:
        msg.has_scheduled = True
        msg.scheduled.update(b.scheduled)
        msg.schedule_floor = b.schedule_floor
        for p, kept in b.scheduled_parts.items():
            msg.scheduled_partitions[p].last.update(kept)
    for ids, kept in b.restored:
        msg.restored_scheduled.add(ids=ids.astype(_ID, copy=False).tobytes(), last=kept)


def columns_into_proto(b: RowBatch, msg: pb.TableReplica) -> None:
    for name, column in b.columns.items():
        msg.columns[name] = np.ascontiguousarray(column).tobytes()


def frame_columns(b: RowBatch) -> list[np.ndarray]:
    """`b`'s columns as a link frame carries them: raw bytes, in the segment's (name) order, so that
    one description of a table's columns (`_columns`) reads them on either side."""
    return [np.ascontiguousarray(b.columns[name]).reshape(-1).view(np.uint8)
            for name, _, _ in _columns(b.config)]


def small_batch(msgs: Sequence[pb.TableReplica]) -> bool:
    """Whether a backup applies these rows on its event loop: a step's rows are copied once into the
    replicas (as fast as a push of them), where a thread hop each way would cost more; a big copy (a
    new backup's) goes to a thread."""
    return sum(len(msg.ids) for msg in msgs) <= _LOOP_ROW_BYTES


def frame_keys(msgs: Sequence[pb.TableReplica]) -> list[SliceKey]:
    """A name for each array `frame_columns` puts in a frame for `msgs` (those not in a segment),
    for the frame's header and the backup's error messages."""
    return [SliceKey(f"{msg.spec.name}.{name}") for msg in msgs if not msg.segment
            for name, _, _ in _columns(spec_from_proto(msg.spec))]


def batch_to_proto(b: RowBatch) -> pb.TableReplica:
    msg = pb.TableReplica()
    batch_into_proto(b, msg)
    return msg


def batch_from_proto(msg: pb.TableReplica, maps: SegmentMaps | None = None, primary: str = "",
                     frame: Iterator[np.ndarray] | None = None) -> RowBatch:
    """The batch of `msg`; its columns are views of the message's bytes, of `primary`'s segment in
    `maps`, or, with `frame` (a link frame's arrays as received, next ones first), of the frame's
    (install copies them). OSError: the segment cannot be mapped here."""
    config = spec_from_proto(msg.spec)
    ids = np.frombuffer(msg.ids, _ID)
    known = {name: (dtype, shape) for name, dtype, shape in _columns(config)}
    if msg.segment:
        if maps is None:
            raise OSError("no shared-memory directory")
        columns = maps.arrays(primary, msg.segment, msg.offset, column_specs(config, len(ids)))
    elif frame is not None:
        columns = {name: _from_frame(config, name, next(frame, None), (len(ids), *shape), dtype)
                   for name, dtype, shape in _columns(config)}
    else:
        columns = {}
        for name, raw in msg.columns.items():
            if name not in known:
                raise InvalidArgumentError(f"table replica {config.name!r}: unknown column {name!r}")
            dtype, shape = known[name]
            columns[name] = np.frombuffer(raw, dtype.newbyteorder("<")).reshape(len(ids), *shape)
    if set(columns) != set(known):
        raise InvalidArgumentError(f"table replica {config.name!r}: columns {sorted(columns)}, "
                                   f"expected {sorted(known)}")
    return RowBatch(config, ids, columns, np.frombuffer(msg.deleted, _ID), msg.step, msg.clock, msg.evicted,
                    msg.admitted, np.frombuffer(msg.seen_ids, _ID), np.frombuffer(msg.seen_counts, "<i4"),
                    msg.rng_state,
                    {w: list(zip(p.ids, p.partitions, strict=True)) for w, p in msg.pushes.items()},
                    dict(msg.applied_clocks) if config.mode == "sync" else None, msg.admit_epoch,
                    dict(msg.scheduled) if msg.has_scheduled else None, msg.schedule_floor,
                    {p: dict(kept.last) for p, kept in msg.scheduled_partitions.items()},
                    _restored(config, msg))


def _restored(config: TableConfig, msg: pb.TableReplica) -> list[tuple[np.ndarray, dict[int, int]]]:
    """The batch's restored records (`restored_scheduled`), their ids checked to be whole int64s."""
    out = []
    for i, r in enumerate(msg.restored_scheduled):
        if len(r.ids) % _ID.itemsize:
            raise InvalidArgumentError(f"table replica {config.name!r}: restored_scheduled[{i}].ids: got "
                                       f"{len(r.ids)} bytes, expected a multiple of {_ID.itemsize} "
                                       "(int64 ids)")
        out.append((np.frombuffer(r.ids, _ID), dict(r.last)))
    return out


def _from_frame(config: TableConfig, name: str, raw: np.ndarray | None, shape: tuple[int, ...],
                dtype: np.dtype) -> np.ndarray:
    want = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    if raw is None or raw.nbytes != want:
        got = "none" if raw is None else f"{raw.nbytes} bytes"
        raise InvalidArgumentError(f"table replica {config.name!r} column {name!r}: the frame has {got}, "
                                   f"its rows take {want}")
    return np.frombuffer(raw, dtype.newbyteorder("<")).reshape(shape)


class RowSegment:
    """Primary side, one per same-host backup: the segment a call's columns are gathered into. Lives
    on the event loop; `start` before each call's captures, `acknowledged` after its reply."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._dir = Path(directory)
        self._segment: _Segment | None = None
        self._position = 0
        self._size = 0

    @property
    def name(self) -> str:
        return self._segment.name if self._segment is not None else ""

    def start(self, need: int) -> None:
        """Room for `need` bytes of columns (OSError if the directory cannot hold them)."""
        if self._segment is None or self._size < need:
            self.reset()
            size = max(_MIN_SEGMENT, 2 * need)
            self._segment, self._size = _Segment(self._dir, size), size
        self._position = 0

    def alloc(self, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
        assert self._segment is not None
        count = int(np.prod(shape, dtype=np.int64))
        out = np.frombuffer(self._segment.map, dtype, count, self._position).reshape(shape)
        self._position += _aligned(count * dtype.itemsize)
        return out

    @property
    def position(self) -> int:
        return self._position

    def acknowledged(self) -> None:
        """The backup has the segment mapped: the file can go (a dead primary then leaves nothing)."""
        if self._segment is not None and not self._segment.opened:
            self._segment.opened = True
            self._segment.unlink()

    def reset(self) -> None:
        """Later calls use a fresh segment (a new backup process cannot open an unlinked file)."""
        if self._segment is not None:
            self._segment.unlink()  # its mapping goes with the last view of it
            self._segment = None
            self._size = 0

    close = reset


def needed_bytes(config: TableConfig, rows: int) -> int:
    return sum(_aligned(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
               for _, dtype, shape in column_specs(config, rows))
