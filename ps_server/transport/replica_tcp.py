"""The replication link over the raw TCP fast path (docs/architecture.md, 9 Failures and 11 Transports).

Between servers that share no memory, a primary's Replicate batches go over the backup's fast-path
listener, as a worker's requests do: a session negotiated with `OpenTransport` (its secret handed
out over the authenticated gRPC channel; TLS when the job has it), then one REQUEST frame per batch
whose header (`EXCHANGE_OP_REPLICATE`) carries the records without their bytes, and whose data are
the records' arrays back to back (each record's value, then its optimizer arrays by name). The
backup receives them into the session's request region and copies them out into its copies; the
REPLY frame says which slices it needs whole. No protobuf encoding of megabytes on either side.

A link that breaks (reset, timeout, bad frame) raises `TransportBroken`: the caller resends the
same batch over gRPC, and the backup's replay is idempotent (a state at a version it holds is
just taken again). Each link carries one call at a time; a backup has a few (calls in flight).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable, Sequence

import grpc
import numpy as np
from pshard.common.errors import InvalidArgumentError, PSError, rebuild
from pshard.common.rpc.status import error_from_rpc_error
from pshard.common.types import SliceKey
from pshard.common.wire import codec
from pshard.common.wire.fastwire import (
    REPLY,
    REQUEST,
    FastPortSilent,
    Inbox,
    TransportBroken,
    open_session,
    send_frame,
)
from pshard.common.wire.liveness import DEFAULT_DEAD_AFTER_S
from pshard.ps_server.core.store import SliceMeta
from pshard.ps_server.handlers.dense import ParameterServerHandlers
from pshard.ps_server.replication.records import Record, record_from_proto
from pshard.ps_server.replication.table_wire import frame_keys
from pshard.ps_server.replication.tables import hold_rows

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import parameter_server_pb2_grpc as pb_grpc

log = logging.getLogger("pshard.ps.replication")

# The session's request region: a batch's arrays must fit (a backup without slices of its own grants
# up to 16 MiB, fastpath._SLACK_BYTES); a larger batch (one huge slice's state) goes over gRPC.
REGION_BYTES = 16 * 2**20
_TIMEOUT_S = 30.0  # as a Replicate call's (replica_link._CALL_TIMEOUT_S)
_DOWN_S = 30.0  # after a link fails, gRPC only for this long, then try again
_REFUSED_S = 300.0  # after a backup refused a link (it offers no tcp, or no session to servers)
_REFUSALS = ("FAILED_PRECONDITION", "PERMISSION_DENIED", "UNIMPLEMENTED")


class TcpLink:
    """One connected session to a backup's fast-path listener; one call at a time."""

    def __init__(self, sock: socket.socket, node_id: str) -> None:
        self._sock = sock
        self._inbox = Inbox(sock)
        self._node_id = node_id

    @classmethod
    def open(cls, stub: pb_grpc.ParameterServerServiceStub, address: str, node_id: str,
             ssl_context: ssl.SSLContext | None, timeout_s: float = _TIMEOUT_S,
             dead_after_s: float = DEFAULT_DEAD_AFTER_S) -> TcpLink:
        """Negotiate and connect; TransportBroken (or the server's PSError) if not possible."""
        try:
            reply = stub.OpenTransport(pb.OpenTransportRequest(
                worker_id=node_id, kind=pb.TRANSPORT_KIND_TCP, request_bytes=REGION_BYTES, reply_bytes=0),
                timeout=timeout_s)
        except grpc.RpcError as err:
            raise error_from_rpc_error(err) from err
        hello = pb.TransportHello(session=reply.session, secret=reply.secret).SerializeToString()
        try:
            sock = open_session(address, reply.port, hello, timeout_s, ssl_context, dead_after_s)
        except OSError as err:
            raise TransportBroken(f"replication link to {address} (port {reply.port}): {err}") from None
        return cls(sock, node_id)

    def call(self, request: pb.ReplicateRequest, arrays: Sequence[np.ndarray]) -> pb.ReplicateResponse:
        """The batch `request` (records without bytes) with `arrays`, in record order; its answer."""
        header = frame_header(self._node_id, request, arrays)
        try:
            send_frame(self._sock, REQUEST, header.SerializeToString(), arrays)
            kind, meta, data_len = self._inbox.frame_head()
        except OSError as err:  # reset, timeout
            raise TransportBroken(f"replication link: {err}") from None
        if kind != REPLY or data_len:
            raise TransportBroken(f"replication link: expected a reply frame, got kind {kind} with "
                                  f"{data_len} data bytes")
        reply = pb.TransportReply.FromString(meta)
        if reply.error_type:
            raise rebuild(reply.error_type, reply.error_message, reply.error_facts)
        return pb.ReplicateResponse(need_state=reply.need_state)

    def close(self) -> None:
        self._sock.close()


def frame_header(node_id: str, request: pb.ReplicateRequest, arrays: Sequence[np.ndarray]
                 ) -> pb.ExchangeHeader:
    """The REQUEST frame's header for a batch: the records, and each array as a pushed slice (so the
    backup's connection receives them into its region as it receives a worker's gradients)."""
    header = pb.ExchangeHeader(op=pb.EXCHANGE_OP_REPLICATE, replicate=request)
    header.stamp.worker_id = node_id
    header.push.extend(pb.SliceMeta(id=codec.slice_id_to_proto(key), shape=a.shape,
                                    dtype=codec.dtype_to_proto(a.dtype.name))
                       for key, a in _keyed(request, arrays))
    return header


def _keyed(request: pb.ReplicateRequest, arrays: Sequence[np.ndarray]) -> list[tuple[SliceKey, np.ndarray]]:
    keys = [codec.slice_id_from_proto(r.id) for r in request.records if r.state and not r.segment
            for _ in range(1 + len(r.opt_arrays))]
    keys += frame_keys(request.tables)  # table rows' columns (ps_server/replication/table_wire.py)
    if len(keys) != len(arrays):
        raise ValueError(f"replication link: {len(arrays)} arrays for {len(keys)} in the records")
    return list(zip(keys, arrays, strict=True))


class TcpLinks:
    """Primary side: the links to each backup, opened on first use; `None` from `take` while a
    backup's link is down (the caller goes over gRPC)."""

    def __init__(self, node_id: str, stub: Callable[[str], pb_grpc.ParameterServerServiceStub],
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._node_id = node_id
        self._stub = stub
        self._ssl = ssl_context
        self._idle: dict[str, list[TcpLink]] = {}
        self._down: dict[str, float] = {}  # address -> when to try again
        self._announced: set[str] = set()  # backups whose link's transport was logged
        self._lock = threading.Lock()
        self.region_bytes = REGION_BYTES
        self.calls = 0  # batches that went over a link (for tests and stats)
        # A backup silent this long breaks the link (common.wire.liveness): the job's heartbeat timeout.
        self.dead_after_s = DEFAULT_DEAD_AFTER_S

    def take(self, address: str) -> TcpLink | None:
        """An idle link to `address`, opened if needed; None while its links are down."""
        with self._lock:
            if self._down.get(address, 0.0) > time.monotonic():
                return None
            idle = self._idle.get(address)
            if idle:
                return idle.pop()
        try:
            link = TcpLink.open(self._stub(address), address, self._node_id, self._ssl,
                                dead_after_s=self.dead_after_s)
        except PSError as err:
            if isinstance(err, FastPortSilent):  # each try would wait as long again
                log.warning("replication: %s; over gRPC for %.0fs", err, _REFUSED_S)
                with self._lock:
                    self._down[address] = time.monotonic() + _REFUSED_S
            elif getattr(err, "status", "") in _REFUSALS:  # the backup offers no tcp (its --transport)
                log.info("replication: %s offers no tcp link (%s); over gRPC", address, err)
                with self._lock:
                    self._down[address] = time.monotonic() + _REFUSED_S
            else:
                self.broke(address, err)
            return None
        with self._lock:
            first = address not in self._announced
            self._announced.add(address)
        if first:  # the bytes' real path, once per backup (the gRPC fallback is logged when it happens)
            log.info("replication: batches to %s over raw TCP%s", address, " with TLS" if self._ssl else "")
        return link

    def give_back(self, address: str, link: TcpLink) -> None:
        """`link` answered its call: reuse it."""
        with self._lock:
            self.calls += 1
            self._idle.setdefault(address, []).append(link)

    def broke(self, address: str, err: Exception, link: TcpLink | None = None) -> None:
        """`link` failed (or none could be opened): gRPC for a while."""
        log.warning("replication: tcp link to %s failed (%s); over gRPC for %.0fs", address, err, _DOWN_S)
        if link is not None:
            link.close()
        with self._lock:
            self._down[address] = time.monotonic() + _DOWN_S
            for idle in self._idle.pop(address, []):
                idle.close()

    def close(self, address: str | None = None) -> None:
        with self._lock:
            gone = [a for a in self._idle if address is None or a == address]
            links = [link for a in gone for link in self._idle.pop(a)]
        for link in links:
            link.close()


# ---- backup side: called by the fast-path server for an EXCHANGE_OP_REPLICATE request ----

def records_from_frame(request: pb.ReplicateRequest, metas: Sequence[SliceMeta],
                       views: Sequence[np.ndarray]) -> list[Record]:
    """The batch's records with their arrays copied out of the session's region (reused by the
    next request). InvalidArgumentError when the arrays do not match the records."""
    out: list[Record] = []
    index = 0
    for msg in request.records:
        key = codec.slice_id_from_proto(msg.id)
        if msg.segment or not msg.state:  # shared memory, or an update inline: as over gRPC
            out.append(record_from_proto(msg))
            continue
        names = ["", *sorted(msg.opt_arrays)]
        arrays: dict[str, np.ndarray] = {}
        for name in names:
            t = msg.value if name == "" else msg.opt_arrays[name]
            if index >= len(views):
                raise InvalidArgumentError(f"replicate {key}: fewer arrays than its records announce")
            meta, view = metas[index], views[index]
            dtype = codec.dtype_from_proto(t.dtype, f"replica {key} dtype")
            if meta.key != key or meta.dtype != dtype or tuple(meta.shape) != tuple(t.shape):
                raise InvalidArgumentError(f"replicate {key} {name or 'value'}: array {meta.key} "
                                           f"{meta.dtype}{list(meta.shape)}, record {dtype}{list(t.shape)}")
            arrays[name] = np.array(view.view(codec.numpy_dtype(dtype)).reshape(tuple(t.shape)), copy=True)
            index += 1
        opt = {**dict(msg.opt_ints), **dict(msg.opt_floats), **{n: a for n, a in arrays.items() if n}}
        out.append(Record(0, key, msg.version, True, arrays[""], 0, dict(msg.clocks),
                          codec.dtype_from_proto(msg.dtype), opt, dict(msg.floors),
                          scheduled=dict(msg.scheduled)))
    if index != len(views):
        raise InvalidArgumentError(f"replicate: {len(views)} arrays, its records announce {index}")
    return out


async def serve_replicate(handlers: ParameterServerHandlers, header: pb.ExchangeHeader,
                          metas: Sequence[SliceMeta], views: Sequence[np.ndarray]) -> pb.TransportReply:
    """Replay a batch that came over a fast-path session, as the Replicate call does."""
    request = header.replicate
    if request.tables:
        return await _serve_rows(handlers, request, views)
    config = codec.job_from_proto(request.config)

    def apply() -> list[SliceKey]:
        return handlers.replicate(config, records_from_frame(request, metas, views), request.primary,
                                  False, request.segments)

    # Bytes in the frame are copied into the copies: off the event loop. States in shared memory are
    # only mapped (a view each): at once, a thread hop would cost more.
    mapped = all(r.segment for r in request.records)
    need = apply() if mapped else await asyncio.get_running_loop().run_in_executor(None, apply)
    return pb.TransportReply(need_state=[codec.slice_id_to_proto(k) for k in need])


async def _serve_rows(handlers: ParameterServerHandlers, request: pb.ReplicateRequest,
                      views: Sequence[np.ndarray]) -> pb.TransportReply:
    """Hold a batch of table rows whose columns are the frame's data (ps_server/replication/tables.py).
    The views are of the session's region, which the next request reuses: `apply` copies the rows
    out before the reply lets the primary send it."""
    if request.records or request.release or request.release_tables:
        raise InvalidArgumentError("replicate: a link frame carries table rows or slice records, not both")
    if await hold_rows(handlers.table_replication, request, views):  # only rows not in shared memory
        raise InvalidArgumentError("replicate: table rows in shared memory came over a link")
    return pb.TransportReply()
