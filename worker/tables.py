"""The client of sparse embedding tables: one request per server per call, over PSClient's channels.

Ids of a call are de-duplicated first (np.unique with its inverse): a pull sends each distinct id
once and scatters the rows back to every position that asked; a push sums the gradients of
repeated ids (what torch's coalesce does) and sends one row per distinct id. The distinct ids are
split by the server that holds them (pshard.common.sparse.server_of, the same hash the servers
use) and every server is called at once, on PSClient's thread pool. A push to a sync table goes
to every server, empty where the server holds none of the ids: each server's clock waits for it.

Unless the client's transport is "grpc", requests travel over the server's raw TCP table stream
(ps_server.table_stream) once OpenTableStream handed out its port, else over gRPC. A stream that
breaks is dropped (tried again after a pause); a pull then completes over gRPC, while a push fails
with UnavailableError, since it may have been applied and async pushes are not idempotent.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import grpc
import numpy as np
from pshard.common.errors import (
    InvalidArgumentError,
    PSError,
    UnavailableError,
    UnknownKeyError,
    error_classes,
)
from pshard.common.fastwire import HELLO, REPLY, REQUEST, Inbox, TransportBroken, send_frame
from pshard.common.rpc_status import error_from_rpc_error
from pshard.common.sparse import TableConfig, server_of
from pshard.common.sparse_codec import spec_to_proto

from pshard.api.v1 import sparse_pb2 as pb
from pshard.api.v1 import sparse_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from pshard.worker.client import PSClient

T = TypeVar("T")
log = logging.getLogger("pshard.worker")
_STREAM_RETRY_S = 5.0
_NONE = np.zeros(0, np.uint8)


class _Stream:
    """One connection to a server's table stream; one request at a time."""

    def __init__(self, host: str, port: int, secret: bytes, timeout_s: float,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self._sock = socket.create_connection((host, port), timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ssl_context is not None:  # TLS on: the server's certificate is checked as gRPC checks it
            self._sock = ssl_context.wrap_socket(self._sock, server_hostname=host)
        self._inbox = Inbox(self._sock)
        self._lock = threading.Lock()
        send_frame(self._sock, HELLO, secret)

    def call(self, request: pb.TableStreamRequest, data: np.ndarray, rows: np.ndarray | None) -> int:
        """Send `request` with `data`; the pulled rows land in `rows`; the rows stored. PSErrors are
        the server's refusals; TransportBroken or OSError mean the stream is unusable."""
        with self._lock:
            send_frame(self._sock, REQUEST, request.SerializeToString(), [data] if data.nbytes else [])
            kind, meta, n = self._inbox.frame_head()
            reply = pb.TableStreamReply.FromString(meta)
            if kind != REPLY:
                raise TransportBroken(f"table stream: a frame of kind {kind} where a reply was due")
            if reply.error_type:
                cls = error_classes().get(reply.error_type, PSError)
                raise cls(reply.error_message)
            want = rows.nbytes if rows is not None else 0
            if n != want:
                raise TransportBroken(f"table stream: a reply of {n} bytes where {want} were due")
            if rows is not None and n:
                self._inbox.read_into(rows)
            return int(reply.stored)

    def close(self) -> None:
        self._sock.close()


class _Split:
    """Distinct ids of a call, where each came from, and which server holds each."""

    def __init__(self, ids: np.ndarray, n_servers: int) -> None:
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise InvalidArgumentError(f"ids: got dtype {ids.dtype}, expected integers (int64)")
        flat = ids.reshape(-1).astype(np.int64, copy=False)
        self.shape = ids.shape
        self.unique, self.inverse = np.unique(flat, return_inverse=True)
        owner = server_of(self.unique, n_servers)
        order = np.argsort(owner, kind="stable")
        bounds = np.searchsorted(owner[order], np.arange(n_servers + 1))
        # Positions (in `unique`) of each server's ids.
        self.parts = [order[bounds[s]:bounds[s + 1]] for s in range(n_servers)]

    @property
    def has_repeats(self) -> bool:
        return len(self.unique) < len(self.inverse)


class TableClient:
    def __init__(self, client: PSClient) -> None:
        self._client = client
        self._stubs = [pb_grpc.SparseTablesServiceStub(c) for c in client._channels]
        self.configs: dict[str, TableConfig] = {}
        n = len(self._stubs)
        self._streams: list[_Stream | None] = [None] * n
        self._stream_retry_at = [0.0] * n
        self._stream_locks = [threading.Lock() for _ in range(n)]
        self.transports = ["grpc"] * n  # what each server's table requests use: "tcp" or "grpc"

    def declare(self, config: TableConfig) -> None:
        """Declare the table on every server (the first declaration wins; a different one is refused)."""
        request = pb.DeclareTableRequest(spec=spec_to_proto(config))
        self._each(lambda s, stub: stub.DeclareTable(request, timeout=self._client._timeout_s))
        self.configs[config.name] = config

    def pull(self, table: str, ids: np.ndarray, clock: int = 0) -> np.ndarray:
        """Rows of `ids` (any shape, repeats allowed): an array of shape ids.shape + (dim,)."""
        config = self._config(table)
        split = _Split(ids, len(self._stubs))
        rows = np.empty((len(split.unique), config.dim), config.np_dtype)

        def call(s: int, stub: pb_grpc.SparseTablesServiceStub) -> None:
            part = split.parts[s]
            if not len(part):
                return
            ids = split.unique[part].tobytes()
            stream = self._stream(s)
            if stream is not None:
                landed = np.empty((len(part), config.dim), config.np_dtype)
                sent = pb.TableStreamRequest(op=pb.TABLE_STREAM_OP_PULL, table=table, ids=ids, clock=clock,
                                             worker_id=self._client.worker_id)
                try:
                    stream.call(sent, _NONE, landed)
                    rows[part] = landed
                    return
                except (TransportBroken, OSError) as err:
                    self._drop_stream(s, err)  # a pull changes nothing: it is safe to ask again over gRPC
            request = pb.PullRowsRequest(table=table, ids=ids, clock=clock, worker_id=self._client.worker_id)
            reply = stub.PullRows(request, timeout=self._client._timeout_s)
            rows[part] = self._rows(config, reply.rows, len(part))

        self._each(call)
        return rows[split.inverse].reshape(*split.shape, config.dim)

    def push(self, table: str, ids: np.ndarray, grads: np.ndarray, clock: int = 0) -> int:
        """Apply `grads` (ids.shape + (dim,)) to the rows of `ids`, repeated ids summed; rows stored."""
        config = self._config(table)
        split = _Split(ids, len(self._stubs))
        summed = self._coalesce(config, split, grads)

        def call(s: int, stub: pb_grpc.SparseTablesServiceStub) -> int:
            part = split.parts[s]
            if not len(part) and config.mode != "sync":
                return 0
            stream = self._stream(s)
            if stream is not None:
                sent = pb.TableStreamRequest(op=pb.TABLE_STREAM_OP_PUSH, table=table,
                                             ids=split.unique[part].tobytes(), clock=clock,
                                             worker_id=self._client.worker_id)
                return self._on_stream(s, stream, sent, summed[part], None)
            reply = stub.PushRows(pb.PushRowsRequest(table=table, ids=split.unique[part].tobytes(),
                                                     grads=summed[part].tobytes(), clock=clock,
                                                     worker_id=self._client.worker_id),
                                  timeout=self._client._timeout_s)
            return int(reply.stored)

        return sum(self._each(call))

    def push_pull(self, table: str, ids: np.ndarray, grads: np.ndarray, pull_ids: np.ndarray,
                  clock: int = 0) -> np.ndarray:
        """Push as `push`, then pull `pull_ids` as `pull`, in one round trip per server."""
        config = self._config(table)
        split = _Split(ids, len(self._stubs))
        summed = self._coalesce(config, split, grads)
        want = _Split(pull_ids, len(self._stubs))
        rows = np.empty((len(want.unique), config.dim), config.np_dtype)

        def call(s: int, stub: pb_grpc.SparseTablesServiceStub) -> None:
            part, wanted = split.parts[s], want.parts[s]
            if not (len(part) or len(wanted) or config.mode == "sync"):
                return
            stream = self._stream(s)
            if stream is not None:
                landed = np.empty((len(wanted), config.dim), config.np_dtype)
                sent = pb.TableStreamRequest(
                    op=pb.TABLE_STREAM_OP_PUSH_PULL, table=table, ids=split.unique[part].tobytes(),
                    pull_ids=want.unique[wanted].tobytes(), clock=clock, worker_id=self._client.worker_id)
                self._on_stream(s, stream, sent, summed[part], landed)
                rows[wanted] = landed
            else:
                reply = stub.PushPullRows(pb.PushPullRowsRequest(
                    table=table, push_ids=split.unique[part].tobytes(), grads=summed[part].tobytes(),
                    pull_ids=want.unique[wanted].tobytes(), clock=clock, worker_id=self._client.worker_id),
                    timeout=self._client._timeout_s)
                rows[wanted] = self._rows(config, reply.rows, len(wanted))

        self._each(call)
        return rows[want.inverse].reshape(*want.shape, config.dim)

    def export(self, table: str) -> list[pb.ExportTableResponse]:
        """Every server writes its rows of `table` as ids.npy and rows.npy; where they are."""
        return self._each(lambda s, stub: stub.ExportTable(pb.ExportTableRequest(table=table),
                                                           timeout=self._client._timeout_s))

    def checkpoint(self) -> list[str]:
        return self._each(lambda s, stub: stub.CheckpointTables(
            pb.CheckpointTablesRequest(), timeout=self._client._timeout_s).path)

    def stats(self, table: str) -> list[pb.GetTableStatsResponse]:
        return self._each(lambda s, stub: stub.GetTableStats(pb.GetTableStatsRequest(table=table),
                                                             timeout=self._client._timeout_s))

    # ---- helpers ----

    def _config(self, table: str) -> TableConfig:
        config = self.configs.get(table)
        if config is None:
            raise UnknownKeyError(f"table {table!r}: declare it with this client first (declare_table)")
        return config

    @staticmethod
    def _coalesce(config: TableConfig, split: _Split, grads: np.ndarray) -> np.ndarray:
        grads = np.asarray(grads, dtype=config.np_dtype)
        if grads.shape != (*split.shape, config.dim):
            raise InvalidArgumentError(f"push of table {config.name!r}: gradients of shape {grads.shape}, "
                                       f"expected ids' shape {split.shape} + ({config.dim},)")
        flat = grads.reshape(-1, config.dim)
        summed = np.zeros((len(split.unique), config.dim), config.np_dtype)
        if split.has_repeats:
            np.add.at(summed, split.inverse, flat)
        else:
            summed[split.inverse] = flat
        return summed

    @staticmethod
    def _rows(config: TableConfig, raw: bytes, n: int) -> np.ndarray:
        if len(raw) != n * config.dim * config.np_dtype.itemsize:
            raise InvalidArgumentError(f"table {config.name!r}: the server sent {len(raw)} bytes for "
                                       f"{n} rows of dim {config.dim}")
        return np.frombuffer(raw, config.np_dtype).reshape(n, config.dim)

    def _stream(self, s: int) -> _Stream | None:
        """Server `s`'s table stream, opened at the first call; None: use gRPC."""
        if self._client._transport == "grpc":
            return None
        with self._stream_locks[s]:
            stream = self._streams[s]
            if stream is not None or time.monotonic() < self._stream_retry_at[s]:
                return stream
            try:
                offer = self._stubs[s].OpenTableStream(pb.OpenTableStreamRequest(),
                                                       timeout=self._client._timeout_s)
                if not offer.port:
                    self._stream_retry_at[s] = float("inf")  # the server offers gRPC only
                    return None
                host = self._client.servers[s].rsplit(":", 1)[0].strip("[]")
                security = self._client.security
                stream = _Stream(host, offer.port, offer.secret, self._client._timeout_s,
                                 security.client_ssl_context() if security.tls else None)
            except (grpc.RpcError, OSError, TransportBroken) as err:
                log.info("table stream to %s not opened (%s); using gRPC", self._client.servers[s], err)
                self._stream_retry_at[s] = time.monotonic() + _STREAM_RETRY_S
                return None
            self._streams[s] = stream
            self.transports[s] = "tcp"
            return stream

    def _drop_stream(self, s: int, err: BaseException) -> None:
        with self._stream_locks[s]:
            stream, self._streams[s] = self._streams[s], None
            self._stream_retry_at[s] = time.monotonic() + _STREAM_RETRY_S
            self.transports[s] = "grpc"
        if stream is not None:
            stream.close()
            log.warning("table stream to %s broke (%s); using gRPC for a while", self._client.servers[s], err)

    def _on_stream(self, s: int, stream: _Stream, request: pb.TableStreamRequest, data: np.ndarray,
                   rows: np.ndarray | None) -> int:
        """A push over the stream; a broken stream is UnavailableError (the push may have landed)."""
        try:
            return stream.call(request, data, rows)
        except (TransportBroken, OSError) as err:
            self._drop_stream(s, err)
            raise UnavailableError(f"push of table {request.table!r} to {self._client.servers[s]}: the "
                                   f"stream broke ({err}); the push may have been applied or not") from err

    def close(self) -> None:
        for s in range(len(self._streams)):
            with self._stream_locks[s]:
                stream, self._streams[s] = self._streams[s], None
            if stream is not None:
                stream.close()

    def _each(self, call: Callable[[int, pb_grpc.SparseTablesServiceStub], T]) -> list[T]:
        def run(s: int) -> T:
            try:
                return call(s, self._stubs[s])
            except grpc.RpcError as err:
                raise error_from_rpc_error(err) from err

        return self._client._all_servers(run)
