"""A raw TCP stream for sparse-table requests: the same handlers as gRPC, without gRPC's per-call cost.

A table request is small metadata and one block of bytes each way (ids, gradient rows, pulled
rows): over gRPC, each costs about as much CPU as an echo of its bytes through grpcio, which caps
a 2-core machine far below what numpy does with the rows. Here a connection carries frames of
ps_common.fastwire (header, metadata, raw data): the metadata is a TableStreamRequest (or Reply),
the data the gradients (or the pulled rows), read and written with no re-encoding.

A worker asks for the port and a secret over gRPC (OpenTableStream, on the channel it already
trusts); a connection's first frame must carry the secret, else it is closed. Each connection
runs one request at a time, whose data may be at most the server's request limit (a bigger one
closes the connection: the stream cannot be resynchronised without reading it). Refusals are
replies naming the error (status, class, message) and leave the table unchanged, as over gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import secrets
import ssl

import numpy as np
from google.protobuf.message import DecodeError
from pshard.common.codec import byte_view
from pshard.common.errors import InvalidArgumentError, PSError
from pshard.common.fastwire import (
    HEADER_BYTES,
    HELLO,
    REPLY,
    REQUEST,
    TransportBroken,
    decode_header,
    encode_header,
)
from pshard.ps_server.table_handlers import TableHandlers

from pshard.api.v1 import sparse_pb2 as pb

log = logging.getLogger("pshard.ps")
_EMPTY = np.zeros(0, np.uint8)


class TableStreamServer:
    def __init__(self, handlers: TableHandlers, host: str, max_request_bytes: int,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        """`ssl_context`: with TLS on, the stream runs over mutual TLS, as the dense fast path does."""
        self._handlers = handlers
        self._ssl = ssl_context
        self._host = host
        self._max = max_request_bytes
        self.secret = secrets.token_bytes(16)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()

    async def port(self) -> int:
        """The listener's port, started at the first call."""
        if self._server is None:
            self._server = await asyncio.start_server(
                self._serve, self._host, 0, ssl=self._ssl,
                ssl_handshake_timeout=10.0 if self._ssl is not None else None)
        return int(self._server.sockets[0].getsockname()[1])

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._connections):
                writer.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            kind, meta, n = await _frame_head(reader)
            if kind != HELLO or n or not hmac.compare_digest(meta, self.secret):
                return
            while True:
                kind, meta, n = await _frame_head(reader)
                if kind != REQUEST or n > self._max:
                    log.warning("table stream: closing a connection that sent a frame of kind %d with %d "
                                "bytes of data (limit %d)", kind, n, self._max)
                    return
                data = await reader.readexactly(n) if n else b""
                reply, rows = await self._handle(meta, data)
                raw = byte_view(rows)
                writer.write(encode_header(REPLY, len(reply), raw.nbytes) + reply)
                if raw.nbytes:
                    writer.write(raw)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, TransportBroken):
            pass  # the worker went away; its requests so far were answered
        except asyncio.CancelledError:
            pass  # the server is stopping: the connection just ends
        finally:
            self._connections.discard(writer)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _handle(self, meta: bytes, data: bytes) -> tuple[bytes, np.ndarray]:
        h = self._handlers
        try:
            try:
                r = pb.TableStreamRequest.FromString(meta)
            except DecodeError as err:
                raise InvalidArgumentError(f"table stream: {len(meta)} bytes are not a TableStreamRequest "
                                           f"({err})") from None
            stored, rows = 0, _EMPTY
            if r.op == pb.TABLE_STREAM_OP_PULL:
                rows = await h.pull(r.table, r.ids, r.clock, r.worker_id)
            elif r.op == pb.TABLE_STREAM_OP_PUSH:
                stored = await h.push(r.table, r.ids, data, r.clock, r.worker_id)
            elif r.op == pb.TABLE_STREAM_OP_PUSH_PULL:
                stored, rows = await h.push_pull(r.table, r.ids, data, r.pull_ids, r.clock, r.worker_id)
            else:
                raise InvalidArgumentError(f"table stream: op {r.op} of table {r.table[:256]!r} is not "
                                           "one of PULL, PUSH, PUSH_PULL")
            return pb.TableStreamReply(stored=stored).SerializeToString(), rows
        except PSError as err:
            return pb.TableStreamReply(error_status=err.status, error_message=str(err),
                                       error_type=type(err).__name__).SerializeToString(), _EMPTY


async def _frame_head(reader: asyncio.StreamReader) -> tuple[int, bytes, int]:
    kind, meta_len, data_len = decode_header(await reader.readexactly(HEADER_BYTES))
    return kind, await reader.readexactly(meta_len), data_len
