"""The client of sparse embedding tables: one request per server per call, over the connections
PSClient shares with it (client/connections.py).

Ids of a call are de-duplicated first (sorted, with the inverse): a pull sends each distinct id
once and scatters the rows back to every position that asked; a push sums the gradients of
repeated ids (what torch's coalesce does) and sends one row per distinct id. The distinct ids are
split by the server that holds them (pshard.common.sparse.server_of, the same hash the servers
use) and every server is called at once, on the connections' thread pool. A push to a sync table goes
to every server, empty where the server holds none of the ids: each server's clock waits for it.

Unless the client's transport is "grpc", requests ride the connections' fast-path session with each
server (shared memory on one host, raw TCP or TLS between hosts; EXCHANGE_OP_TABLE, served by
ps_server.transport.table_fast), the one the dense steps use; else, or when a request is larger than the
session's table room, over gRPC. A session that breaks is dropped (the connections negotiate again
after a pause); a pull then completes over gRPC, while a push fails with UnavailableError, since it may
have been applied and async pushes are not idempotent.

With replicas, or with more row partitions than servers (`pshard rebalance` may move them), a sync
table's push is held by its server pending until every worker pushed that clock, and is not replicated
meanwhile: the client keeps each sync push until pulls at a later clock
have read every row partition since (or, after a few clocks, asks the partitions it did not read,
with a pull of no ids), and sends the pushes it keeps again, in clock order, to the servers of a
new layout before anything else of that table (docs/architecture.md, 9 Failures). Servers drop
what they have or applied, by (worker, clock) per partition.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import grpc
import numpy as np
import numpy.typing as npt
from pshard.client.connections import NOT_YET_WAIT_S, server_behind
from pshard.client.fast_session import TABLE_ROOM_BYTES, FastPath
from pshard.common.cluster.layout import Layout
from pshard.common.errors import (
    InvalidArgumentError,
    LayoutNotYetError,
    PartitionMovedError,
    UnavailableError,
    UnknownKeyError,
)
from pshard.common.rpc.status import error_from_rpc_error
from pshard.common.sparse import TableConfig, put_rows, server_of, take_rows
from pshard.common.types import Stamp
from pshard.common.wire import codec
from pshard.common.wire.fastwire import TransportBroken
from pshard.common.wire.shm import align
from pshard.common.wire.sparse_codec import decode_rows, encode_grads, spec_to_proto

from pshard.api.v1 import parameter_server_pb2 as ps_pb
from pshard.api.v1 import sparse_pb2 as pb
from pshard.api.v1 import sparse_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from pshard.client.ps_client import PSClient

T = TypeVar("T")
# What one server gets: pushed (ids, gradients) or (), pulled ids or None, and where pulled rows go:
# that array, or when positions are given (last), rows `positions` of it.
_Request = tuple[Sequence[np.ndarray], "np.ndarray | None", "np.ndarray | None", "np.ndarray | None"]


def _movable(layout: Layout) -> bool:
    """Row partitions of `layout` may change servers while a sync clock is pending on them: by a failover
    (replicas), or by `pshard rebalance` (more partitions than servers, with replicas or without). The
    pending sum is the old server's alone, so the workers keep their pushes to send them again."""
    return bool(layout.replicas) or layout.partition_count > len(layout.servers)


class _Sent(NamedTuple):
    """A table request sent on a fast-path session, whose reply is still to read."""

    fast: FastPath
    header: ps_pb.ExchangeHeader
    target: np.ndarray  # uint8 view of where the pulled rows go (empty for a push), or the call's rows
    push: bool
    positions: np.ndarray | None  # the rows of `target` the pulled rows go to, in order
log = logging.getLogger("pshard.worker")
_SLACK_S = 5.0  # past the request's own timeout, as PSClient's calls allow
_INT64 = codec.dtype_to_proto("int64")
# Gradient rows cast to bfloat16 travel as its bits (uint16: numpy has no bfloat16).
_GRAD_DTYPES = {"uint16": codec.dtype_to_proto("bfloat16")}
# Sync pushes kept per table past which the oldest is confirmed by a pull of no ids (see _Kept).
_KEPT_CLOCKS = 4
# Numbers (rows x dim) up to which a call's rows pass through buffers kept per thread (8 MB of float32).
_BUFFER_NUMBERS = 1 << 21
# Runs of repeated ids left for _run_sums to sum whole, one at a time, rather than a row per round.
_FEW_RUNS = 32


def _stable_sort(flat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(order, flat[order]) with order a stable argsort of the int64 `flat`. When the ids span less
    than 2**(63 - log2 n), as ids of real tables mostly do, each id's offset and its position share
    one int64 and a plain sort does it: half the time of numpy's stable argsort (a timsort)."""
    n = len(flat)
    bits = max(n - 1, 1).bit_length()
    if n > 1:
        low, high = int(flat.min()), int(flat.max())
        span = high - low
        # Narrower still (a table of a few million rows, a batch of thousands): the same keys in 32
        # bits sort in half the time of 64 (4,096 of them: 57 against 110 us here).
        dtype = (np.uint32 if bits < 32 and span < 1 << (32 - bits) else
                 np.int64 if span < 1 << (63 - bits) else None)
        if dtype is not None:
            key: npt.NDArray[np.integer[Any]] = (flat - low).astype(dtype, copy=False)
            key <<= bits
            key |= np.arange(n, dtype=key.dtype)
            key.sort()
            order = (key & dtype((1 << bits) - 1)).astype(np.int64, copy=False)
            key >>= bits
            key = key.astype(np.int64, copy=False)
            key += low
            return order, key
    order = np.argsort(flat, kind="stable")
    return order, flat[order]


def _run_sums(flat: np.ndarray, order: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Rows of `flat` summed over runs, run k being rows order[starts[k]:starts[k + 1]] (the last to the
    end), each added to the sum of the ones before it, in order. Round d adds the d-th row of every
    run that long, and once few runs are left the longest are summed whole: np.add.reduceat pays per
    run, 740 us for 4,096 Zipf ids (2,400 runs), against about 210 us here."""
    lengths = np.diff(starts, append=len(order))
    out = take_rows(flat, order[starts])
    deep = np.flatnonzero(lengths > 1)
    depth = 1
    while len(deep) > _FEW_RUNS:
        acc = take_rows(out, deep)
        acc += take_rows(flat, order[starts[deep] + depth])
        put_rows(out, deep, acc)
        depth += 1
        deep = deep[lengths[deep] > depth]
    for k in deep.tolist():
        out[k] = np.add.reduce(flat[order[starts[k]:starts[k] + lengths[k]]], axis=0)
    return out


@dataclass
class _Kept:
    """A sync push kept until every row partition applied it: its server held it pending, unreplicated,
    and a failover would lose it (docs/architecture.md, 9 Failures)."""

    clock: int
    push_id: int
    ids: np.ndarray
    grads: np.ndarray
    unread: set[int]  # partitions no pull at a later clock has read since
    version: int  # the layout version it was last sent with


class _Split:
    """Distinct ids of a call grouped by the server that holds them, and where each position came from.

    `ids` holds the distinct ids server by server (ascending within each: the server checks
    distinctness in one pass then), so a server's ids, rows and gradients are the contiguous
    `part(s)` of the call's arrays: they are sent and received in place, with no per-server copy.
    `inverse` maps each position of the call's ids to its row in `ids`."""

    def __init__(self, ids: np.ndarray, n_servers: int, owners: np.ndarray | None = None) -> None:
        """`owners`: the server of each row partition, when a failover or a move placed them
        (Layout.row_owners): its length is the number of partitions, which may exceed n_servers."""
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise InvalidArgumentError(f"ids: got dtype {ids.dtype}, expected integers (int64)")
        flat = ids.reshape(-1).astype(np.int64, copy=False)
        self.shape = ids.shape
        n = len(flat)
        # np.unique's own work, keeping the sort for the gradients' sum (np.unique would sort again).
        order, ordered = _stable_sort(flat)  # repeated ids stay in call order (summed in it)
        new = np.empty(n, bool)
        new[:1] = True
        np.not_equal(ordered[1:], ordered[:-1], out=new[1:])
        repeats = not new.all()
        unique = ordered[new] if repeats else ordered
        partitions = len(owners) if owners is not None else n_servers
        owner = server_of(unique, partitions)
        counts = np.bincount(owner, minlength=partitions)
        self.partitions = set(np.flatnonzero(counts).tolist())  # the row partitions of the ids
        if owners is not None:
            owner = owners[owner]
            counts = np.bincount(owner, minlength=n_servers)
        # A stable sort of small integers is a radix sort: ids stay ascending within each server.
        group = np.argsort(owner.astype(np.int16 if n_servers < 2**15 else np.int64), kind="stable")
        self._bounds = [0, *np.cumsum(counts).tolist()]
        self.ids = unique[group]
        self._group = group
        self.inverse = np.empty(n, np.int64)
        if repeats:
            # The call's gradients, sorted by id, sum over these runs (coalesce).
            self._sorted: tuple[np.ndarray, np.ndarray] | None = (order, np.flatnonzero(new))
            self._source = None
            where = np.empty(len(group), np.int64)
            where[group] = np.arange(len(group))
            self.inverse[order] = where[np.cumsum(new) - 1]
        else:  # position order[group[k]] of the call holds the k-th id sent: one scatter
            self._sorted = None
            self._source = order[group]
            self.inverse[self._source] = np.arange(n)

    @property
    def source(self) -> np.ndarray | None:
        """Without repeated ids: the position of the call that each id sent (in `ids` order)."""
        return self._source

    def part(self, s: int) -> slice:
        return slice(self._bounds[s], self._bounds[s + 1])

    def coalesce(self, flat: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Rows of `flat` (one per position of the call) as rows of `ids` in `out`, repeated ids summed
        (in call order): a gather without repeats (cheaper than a scatter), sums over the runs of the
        sorted ids with them (_run_sums)."""
        if self._source is not None:
            return take_rows(flat, self._source, out)
        assert self._sorted is not None
        order, starts = self._sorted
        return take_rows(_run_sums(flat, order, starts), self._group, out)


class TableClient:
    def __init__(self, client: PSClient) -> None:
        """Tables over `client`'s connections (its channels, fast-path sessions, pool and routing layout)."""
        self._client = client
        self._conn = client.connections
        self._stubs: list[pb_grpc.SparseTablesServiceStub] = []
        self.configs: dict[str, TableConfig] = {}
        # What each server's last table request used: "shm", "tcp" or "grpc".
        self.transports: list[str] = []
        for server in range(len(self._conn.servers)):
            self._server_added(server)
        self._conn.on_server_added.append(self._server_added)
        # The last few calls' ids and their splits: a push is most often of the ids just pulled.
        self._splits: list[tuple[np.ndarray, _Split]] = []
        self._split_owners: tuple[int, ...] = ()  # the row owners the splits were made for
        # Idempotence keys of pushes: from the clock in microseconds, so a restarted worker's are new.
        self._push_ids = itertools.count(time.time_ns() // 1000)
        self.reroutes = 0  # table requests sent again after a failover
        self._kept: dict[str, list[_Kept]] = {}  # sync tables' pushes not known applied everywhere
        self._kept_lock = threading.Lock()
        self.resent = 0  # kept sync pushes sent again after a failover
        self.not_yet = 0  # sync pushes refused by a server that had not received their layout yet
        # Per thread, arrays of rows kept between calls (see _buffer).
        self._local = threading.local()

    def _server_added(self, server: int) -> None:
        self._stubs.append(pb_grpc.SparseTablesServiceStub(self._conn.channels[server]))
        self.transports.append("grpc")

    def declare(self, config: TableConfig) -> None:
        """Declare the table on every server (the first declaration wins; a different one is refused)."""
        request = pb.DeclareTableRequest(spec=spec_to_proto(config))
        self._each(lambda s, stub: stub.DeclareTable(request, timeout=self._conn.timeout_s))
        self.configs[config.name] = config

    def pull(self, table: str, ids: np.ndarray, clock: int = 0) -> np.ndarray:
        """Rows of `ids` (any shape, repeats allowed): an array of shape ids.shape + (dim,)."""
        return self._routed(table, lambda layout: self._pull(table, ids, clock, layout))

    def push(self, table: str, ids: np.ndarray, grads: np.ndarray, clock: int = 0) -> int:
        """Apply `grads` (ids.shape + (dim,)) to the rows of `ids`, repeated ids summed; rows stored."""
        return self._pushed(table, ids, grads, clock,
                            lambda layout, push_id: self._push(table, ids, grads, clock, push_id, layout))

    def push_pull(self, table: str, ids: np.ndarray, grads: np.ndarray, pull_ids: np.ndarray,
                  clock: int = 0) -> np.ndarray:
        """Push as `push`, then pull `pull_ids` as `pull`, in one round trip per server."""
        rows, read = self._pushed(
            table, ids, grads, clock,
            lambda layout, push_id: self._push_pull(table, ids, grads, pull_ids, clock, push_id, layout))
        self._read(table, clock + 1, read)  # its pull was at clock + 1
        return rows

    def _pushed(self, table: str, ids: np.ndarray, grads: np.ndarray, clock: int,
                send: Callable[[Layout | None, int], T]) -> T:
        """`send(layout, push_id)` under one idempotence key, on each layout `_routed` tries; then the
        push is kept (`_keep`) with the layout that carried it."""
        push_id = next(self._push_ids)  # the same on a resend: a server that applied it drops it
        used: list[Layout | None] = [None]  # the layout of the attempt that succeeded

        def call(layout: Layout | None) -> T:
            used[0] = layout
            return send(layout, push_id)

        result = self._routed(table, call)
        self._keep(table, ids, grads, clock, push_id, used[0])
        return result

    # ---- sync pushes kept for a failover ----

    def _keep(self, table: str, ids: np.ndarray, grads: np.ndarray, clock: int, push_id: int,
              layout: Layout | None) -> None:
        """Keep an acknowledged sync push (layouts whose partitions may move) until every partition applied
        it; `layout`: the one it was sent with (a newer one gets it again, _resend)."""
        if layout is None or not _movable(layout) or self._config(table).mode != "sync":
            return
        kept = _Kept(clock, push_id, np.array(ids, copy=True), np.array(grads, copy=True),
                     set(range(len(layout.servers))), layout.version)
        with self._kept_lock:
            pushes = self._kept.setdefault(table, [])
            pushes.append(kept)
            oldest = pushes[0] if len(pushes) > _KEPT_CLOCKS else None
        if oldest is not None:
            self._routed(table, lambda layout: self._confirm(table, oldest, layout))

    def _read(self, table: str, clock: int, partitions: set[int]) -> None:
        """A sync pull at `clock` read `partitions`: the kept pushes of clocks below are applied there."""
        with self._kept_lock:
            pushes = self._kept.get(table)
            if not pushes:
                return
            for kept in pushes:
                if kept.clock < clock:
                    kept.unread -= partitions
            pushes[:] = [k for k in pushes if k.unread]

    def _confirm(self, table: str, kept: _Kept, layout: Layout | None) -> None:
        """Wait until the partitions no pull read since `kept` applied it: a pull of no ids at its next
        clock from each of their servers (a server then waits for every partition it serves)."""
        if layout is None:
            return
        servers = sorted({layout.row_owner(p) for p in kept.unread})
        request = pb.PullRowsRequest(table=table, ids=b"", clock=kept.clock + 1,
                                     worker_id=self._client.worker_id)
        for s in servers:
            self._rpc(s, lambda s, stub: stub.PullRows(request, timeout=self._conn.timeout_s))
        self._read(table, kept.clock + 1, set(kept.unread))

    def _resend(self, table: str, layout: Layout | None) -> None:
        """Send the kept sync pushes that went out with another layout again, in clock order, before
        the table's next request: a new owner of their partition needs them (servers drop the rest)."""
        if layout is None:
            return
        with self._kept_lock:
            pushes = [k for k in self._kept.get(table, ()) if k.version != layout.version]
        for kept in pushes:
            self._push(table, kept.ids, kept.grads, kept.clock, kept.push_id, layout)
            kept.version = layout.version
            self.resent += 1

    def _routed(self, table: str, call: Callable[[Layout | None], T]) -> T:
        """`call(layout)`, again on each newer layout the scheduler publishes after a server failed it:
        a failover moved its row partitions to their backup (Layout.row_owners). A push resent keeps
        its idempotence key, so a server that applied it before drops it. The kept sync pushes of
        `table` sent with an older layout go first (_resend)."""
        conn = self._conn
        deadline = time.monotonic() + conn.timeout_s
        while True:
            layout = conn.layout
            try:
                self._resend(table, layout)
                return call(layout)
            except (UnavailableError, UnknownKeyError) as err:
                left = deadline - time.monotonic()
                if (isinstance(err, LayoutNotYetError) or server_behind(err, layout)) and left > 0 \
                        and not conn.closed.is_set():
                    self.not_yet += 1
                    conn.closed.wait(min(NOT_YET_WAIT_S, left))  # the server learns the layout soon
                    continue
                moved = isinstance(err, UnavailableError | PartitionMovedError)
                # Without replicas a server that went is not failed over, but a partition moved by
                # `pshard rebalance` is served elsewhere all the same.
                rerouted = conn.fails_fast_under(layout) or (
                    conn.can_reroute and layout is not None and isinstance(err, PartitionMovedError))
                if not moved or not rerouted or layout is None or left <= 0 or conn.closed.is_set():
                    raise
                newer = conn.newer_layout(layout, left)
                if newer is not None:
                    log.warning("FAILOVER: layout %d -> %d; resending a table request (%s)", layout.version,
                                newer.version, err)
                    conn.set_layout(newer)
                    self.reroutes += 1
                elif conn.layout is layout:  # the heir may not know the new layout yet
                    log.warning("table request failed (%s); no newer layout yet, sending it again", err)
                    if conn.closed.wait(min(0.5, max(0.0, deadline - time.monotonic()))):
                        raise

    def _pull(self, table: str, ids: np.ndarray, clock: int, layout: Layout | None) -> np.ndarray:
        config = self._config(table)
        split = self._split(ids, layout)
        worker = self._client.worker_id
        parts = [split.part(s) for s in range(len(self._stubs))]
        source = split.source
        requests: list[_Request | None]
        if source is None:  # repeated ids: the distinct rows land in a buffer, then gathered
            rows = self._buffer("pulled", config, len(split.ids), stored=True)
            requests = [((), split.ids[p], rows[p], None) if p.stop > p.start else None for p in parts]
        else:  # each server's rows are scattered from the reply straight to the positions that asked
            dtype, width = config.row_layout  # narrow rows arrive as stored, decoded at the end
            rows = np.empty((len(source), width), dtype)
            requests = [((), split.ids[p], rows, source[p]) if p.stop > p.start else None for p in parts]

        def slow(s: int, stub: pb_grpc.SparseTablesServiceStub) -> int:
            ids = split.ids[parts[s]]
            reply = stub.PullRows(pb.PullRowsRequest(table=table, ids=ids.tobytes(), clock=clock,
                                                     worker_id=worker), timeout=self._conn.timeout_s)
            if source is None:
                rows[parts[s]] = self._rows(config, reply.rows, len(ids))
            else:
                put_rows(rows, source[parts[s]], self._rows(config, reply.rows, len(ids)))
            return 0

        self._calls(table, clock, requests, slow)
        self._read(table, clock, split.partitions)
        if source is None:
            rows = take_rows(rows, split.inverse)
        return decode_rows(config, rows).reshape(*split.shape, config.dim)

    def _push(self, table: str, ids: np.ndarray, grads: np.ndarray, clock: int, push_id: int,
              layout: Layout | None) -> int:
        config = self._config(table)
        split = self._split(ids, layout)
        version = layout.version if layout is not None else 0
        summed = encode_grads(config, self._coalesce(config, split, grads))

        parts = [split.part(s) for s in range(len(self._stubs))]

        def slow(s: int, stub: pb_grpc.SparseTablesServiceStub) -> int:
            ids, rows = split.ids[parts[s]], summed[parts[s]]
            reply = stub.PushRows(pb.PushRowsRequest(table=table, ids=ids.tobytes(), grads=rows.tobytes(),
                                                     clock=clock, worker_id=self._client.worker_id,
                                                     push_id=push_id, layout_version=version,
                                                     **self._schedule()),
                                  timeout=self._conn.timeout_s)
            return int(reply.stored)

        sync = config.mode == "sync"
        serving = self._serving(layout)
        return sum(self._calls(table, clock, [((split.ids[p], summed[p]), None, None, None)
                                              if (sync and s in serving) or p.stop > p.start else None
                                              for s, p in enumerate(parts)], slow, push_id, version))

    def _push_pull(self, table: str, ids: np.ndarray, grads: np.ndarray, pull_ids: np.ndarray, clock: int,
                   push_id: int, layout: Layout | None) -> tuple[np.ndarray, set[int]]:
        """The pulled rows, and the row partitions they were read from."""
        config = self._config(table)
        split = self._split(ids, layout)
        summed = encode_grads(config, self._coalesce(config, split, grads))
        want = self._split(pull_ids, layout)
        version = layout.version if layout is not None else 0
        rows = self._buffer("pulled", config, len(want.ids), stored=True)

        parts = [(split.part(s), want.part(s)) for s in range(len(self._stubs))]

        def slow(s: int, stub: pb_grpc.SparseTablesServiceStub) -> int:
            part, wanted = parts[s]
            pull_ids = want.ids[wanted]
            reply = stub.PushPullRows(pb.PushPullRowsRequest(
                table=table, push_ids=split.ids[part].tobytes(), grads=summed[part].tobytes(),
                pull_ids=pull_ids.tobytes(), clock=clock, worker_id=self._client.worker_id, push_id=push_id,
                **self._schedule(),
                layout_version=version),
                timeout=self._conn.timeout_s)
            rows[wanted] = self._rows(config, reply.rows, len(pull_ids))
            return 0

        sync = config.mode == "sync"
        serving = self._serving(layout)
        self._calls(table, clock, [((split.ids[p], summed[p]), want.ids[w], rows[w], None)
                                   if (sync and s in serving) or p.stop > p.start or w.stop > w.start
                                   else None for s, (p, w) in enumerate(parts)], slow, push_id, version)
        pulled = decode_rows(config, take_rows(rows, want.inverse))
        return pulled.reshape(*want.shape, config.dim), want.partitions

    def export(self, table: str) -> list[pb.ExportTableResponse]:
        """Every server writes its rows of `table` as ids.npy and rows.npy; where they are."""
        return self._each(lambda s, stub: stub.ExportTable(pb.ExportTableRequest(table=table),
                                                           timeout=self._conn.timeout_s))

    def checkpoint(self) -> list[str]:
        return self._each(lambda s, stub: stub.CheckpointTables(
            pb.CheckpointTablesRequest(), timeout=self._conn.timeout_s).path)

    def stats(self, table: str) -> list[pb.GetTableStatsResponse]:
        return self._each(lambda s, stub: stub.GetTableStats(pb.GetTableStatsRequest(table=table),
                                                             timeout=self._conn.timeout_s))

    # ---- helpers ----

    @staticmethod
    def _owners(layout: Layout | None) -> tuple[int, ...]:
        """The server of each row partition: its own, unless a failover moved it (Layout.row_owners)."""
        return layout.row_owners if layout is not None else ()

    def _serving(self, layout: Layout | None) -> set[int]:
        """The servers serving some row partition (a sync push goes to each, even empty)."""
        owners = self._owners(layout)
        return set(owners) if owners else set(range(len(self._stubs)))

    def _split(self, ids: np.ndarray, layout: Layout | None) -> _Split:
        """`ids` split by the servers of `layout` (one layout per request: a sync push names it)."""
        ids = np.asarray(ids)
        owners = self._owners(layout)
        if owners != self._split_owners:  # a failover moved rows: the splits are stale
            self._splits, self._split_owners = [], owners
        for seen, split in self._splits:
            if seen.shape == ids.shape and seen.dtype == ids.dtype and np.array_equal(seen, ids):
                return split
        split = _Split(ids, len(self._stubs), np.array(owners, np.int64) if owners else None)
        self._splits = [(ids.copy(), split), *self._splits[:1]]
        return split

    def _schedule(self) -> dict[str, int]:
        """A scheduled call's push (pshard.coordinator sets PSClient.scheduled while it runs one)."""
        schedule_id, seq, floor = self._client.scheduled
        return {"schedule_id": schedule_id, "schedule_seq": seq, "schedule_floor": floor}

    def _config(self, table: str) -> TableConfig:
        config = self.configs.get(table)
        if config is None:
            raise UnknownKeyError(f"table {table!r}: declare it with this client first (declare_table)")
        return config

    def _coalesce(self, config: TableConfig, split: _Split, grads: np.ndarray) -> np.ndarray:
        grads = np.asarray(grads, dtype=config.np_dtype)
        if grads.shape != (*split.shape, config.dim):
            raise InvalidArgumentError(f"push of table {config.name!r}: gradients of shape {grads.shape}, "
                                       f"expected ids' shape {split.shape} + ({config.dim},)")
        return split.coalesce(np.ascontiguousarray(grads.reshape(-1, config.dim)),
                              self._buffer("pushed", config, len(split.ids)))

    def _buffer(self, name: str, config: TableConfig, n: int, stored: bool = False) -> np.ndarray:
        """An (n, dim) array for this thread's call, reused by its next calls: the rows only pass
        through it (they are copied into the request, or out into the caller's array), and fresh
        arrays of a MB would come from pages the allocator gave back, a fault every 4 KB. `stored`:
        rows as the server sends them, (n, width) of TableConfig.row_layout (narrow rows' bytes)."""
        buffers: dict[tuple[str, str], np.ndarray] = self._local.__dict__.setdefault("buffers", {})
        dtype, width = config.row_layout if stored else (config.np_dtype, config.dim)
        numbers = n * width
        if numbers > _BUFFER_NUMBERS:
            return np.empty((n, width), dtype)
        buffer = buffers.get((name, dtype.name))
        if buffer is None or len(buffer) < numbers:
            size = max(numbers, 2 * len(buffer)) if buffer is not None else numbers
            buffer = buffers[(name, dtype.name)] = np.empty(size, dtype)
        return buffer[:numbers].reshape(n, width)

    @staticmethod
    def _rows(config: TableConfig, raw: bytes, n: int) -> np.ndarray:
        """The rows of a reply as stored (TableConfig.row_layout: narrow ones are decoded by the caller)."""
        dtype, width = config.row_layout
        if len(raw) != n * config.row_bytes:
            raise InvalidArgumentError(f"table {config.name!r}: the server sent {len(raw)} bytes for "
                                       f"{n} rows of dim {config.dim} ({config.row_dtype})")
        return np.frombuffer(raw, dtype).reshape(n, width)

    def _calls(self, table: str, clock: int, requests: Sequence[_Request | None],
               slow: Callable[[int, pb_grpc.SparseTablesServiceStub], int], push_id: int = 0,
               layout_version: int = 0) -> list[int]:
        """One request per server (`requests[s]`: pushed (ids, gradients) or (), pulled ids or None and
        the rows they go to; None: nothing for that server); the rows stored by each.

        Fast-path requests are all sent before the first reply is read, on this thread (no hand-off to
        the pool and back: two thread wake-ups per server). A server with no session, or a request
        larger than its table room, is called over gRPC by `slow(s, stub)`, on the pool; so is a pull
        alone whose session broke or was unavailable (a pull changes nothing: safe to ask again).
        The first error, in server order, wins after every call has ended."""
        n = len(requests)
        stored = [0] * n
        errors: list[BaseException | None] = [None] * n
        sent: list[tuple[int, _Sent]] = []
        grpc_servers: list[int] = []
        for s, request in enumerate(requests):
            if request is None:
                continue
            try:
                started = self._fast_start(s, table, clock, *request, push_id=push_id,
                                           layout_version=layout_version)
            except (TransportBroken, UnavailableError) as err:
                if request[0]:
                    errors[s] = err
                else:
                    grpc_servers.append(s)
                continue
            except BaseException as err:
                errors[s] = err
                continue
            if started is None:
                grpc_servers.append(s)
            else:
                sent.append((s, started))

        inline = grpc_servers[:1] if not sent else []  # gRPC alone: the first call runs on this thread
        others = {s: self._conn.pool.submit(self._rpc, s, slow) for s in grpc_servers[len(inline):]}
        try:
            for s, started in sent:
                try:
                    stored[s] = self._fast_finish(s, table, started)
                except (TransportBroken, UnavailableError) as err:
                    if requests[s][0]:  # type: ignore[index]
                        errors[s] = err
                    else:
                        inline.append(s)
                except BaseException as err:
                    errors[s] = err
            for s in inline:
                try:
                    stored[s] = self._rpc(s, slow)
                except BaseException as err:
                    errors[s] = err
        finally:
            if others:
                futures.wait(others.values())
        for s, future in others.items():
            error = future.exception()
            if error is None:
                stored[s] = future.result()
            else:
                errors[s] = error
        for error in errors:
            if error is not None:
                raise error
        return stored

    def _fast_start(self, s: int, table: str, clock: int, push: Sequence[np.ndarray],
                    pull_ids: np.ndarray | None, rows: np.ndarray | None,
                    positions: np.ndarray | None, push_id: int = 0, layout_version: int = 0) -> _Sent | None:
        """Send one request over server `s`'s fast-path session: push (ids, gradients) when given, then
        pull `pull_ids` into `rows` (into rows[positions] when given). None: no session, or the request
        does not fit its table room (the caller sends it over gRPC). A session that breaks is dropped,
        and raises UnavailableError (TransportBroken for a pull alone: it is safe to send again)."""
        fast = self._conn.session(s)
        buffers = [*push, *(() if pull_ids is None else (pull_ids,))]
        pulled = 0 if rows is None else rows.nbytes if positions is None else (
            len(positions) * rows.shape[1] * rows.itemsize)
        if fast is None or sum(align(b.nbytes) for b in buffers) > TABLE_ROOM_BYTES or (
                pulled > TABLE_ROOM_BYTES):
            self.transports[s] = "grpc"
            return None
        header = ps_pb.ExchangeHeader(
            op=ps_pb.EXCHANGE_OP_TABLE, table=ps_pb.TableRequest(table=table, push=bool(push),
                                                                 pull=pull_ids is not None, push_id=push_id,
                                                                 layout_version=layout_version),
            stamp=codec.stamp_to_proto(Stamp(self._client.worker_id, self._client.generation, clock,
                                             None, *self._client.scheduled)),
            push=[ps_pb.SliceMeta(dtype=_INT64 if b.dtype == np.int64 else _GRAD_DTYPES.get(
                b.dtype.name) or codec.dtype_to_proto(b.dtype.name), shape=b.shape) for b in buffers])
        if rows is None:
            target = np.zeros(0, np.uint8)
        else:
            target = rows if positions is not None else rows.reshape(-1).view(np.uint8)
        try:
            fast.start(header, buffers, self._conn.timeout_s + _SLACK_S)
        except TransportBroken as err:
            raise self._broken_call(s, fast, err, bool(push), table) from err
        return _Sent(fast, header, target, bool(push), positions)

    def _fast_finish(self, s: int, table: str, sent: _Sent) -> int:
        """The rows stored by the request `_fast_start` sent; its pulled rows are in place."""
        target, positions = sent.target, sent.positions
        due = target.nbytes if positions is None else len(positions) * target.shape[1] * target.itemsize

        def place(index: int, raw: np.ndarray) -> None:
            if raw.nbytes != due:
                raise TransportBroken(f"table {table!r}: {raw.nbytes} bytes of rows, {due} due")
            if positions is None:
                np.copyto(target, raw)
            else:
                put_rows(target, positions, raw.view(target.dtype).reshape(len(positions), -1))

        try:
            summary = sent.fast.finish(sent.header, place,
                                       lambda index: target if positions is None else None)
        except TransportBroken as err:
            raise self._broken_call(s, sent.fast, err, sent.push, table) from err
        self.transports[s] = sent.fast.kind
        return int(summary.applied)

    def _broken_call(self, s: int, fast: FastPath, err: TransportBroken, push: bool,
                     table: str) -> BaseException:
        """Drop a broken session; what its call raises: UnavailableError for a push (it may have been
        applied), else the TransportBroken itself."""
        self._broken(s, fast, err)
        if push:
            return UnavailableError(f"push of table {table!r} to {self._client.servers[s]}: the "
                                    f"{fast.kind} transport broke ({err}); the push may have been "
                                    "applied or not")
        return err

    def _broken(self, s: int, fast: object, err: BaseException) -> None:
        log.warning("server %s: %s transport broke under a table request (%s)", self._conn.servers[s],
                    getattr(fast, "kind", "?"), err)
        self._conn.broke(s, fast)  # gRPC until a new try is due
        self.transports[s] = "grpc"

    def _rpc(self, s: int, call: Callable[[int, pb_grpc.SparseTablesServiceStub], T]) -> T:
        """call(s, server s's stub), with a gRPC error turned into pshard's own."""
        try:
            return call(s, self._stubs[s])
        except grpc.RpcError as err:
            raise error_from_rpc_error(err) from err

    def _each(self, call: Callable[[int, pb_grpc.SparseTablesServiceStub], T]) -> list[T]:
        """call(s, stub) for every server serving rows at once (after a failover not the dead one: its
        heir serves its rows), the first on this thread (a hand-off to the pool and back costs two
        thread wake-ups); the first error wins, after every call has ended. Routed by the client's live
        layout: one the client has not caught up on would send it to a server cut off since, for its
        whole deadline (issue 24)."""
        servers = sorted(self._serving(self._client.live_layout()))
        others = [self._conn.pool.submit(self._rpc, s, call) for s in servers[1:]]
        try:
            first = self._rpc(servers[0], call)
        finally:
            if others:
                futures.wait(others)
        return [first, *(f.result() for f in others)]
