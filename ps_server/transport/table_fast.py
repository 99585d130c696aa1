"""Sparse-table requests on the dense fast-path sessions (EXCHANGE_OP_TABLE).

A table request travels in the same session, frames and regions as a dense step (shared memory on
one host, raw TCP or TLS between hosts; docs/architecture.md, 11 Transports and 12 Sparse tables):
the header's `push` entries describe its bytes (pushed ids, gradients, pulled ids, in that order;
parameter_server.proto's TableRequest), so the connection (ps_server.transport.fastconn) lands them in the
session's request region as it lands dense slices, and they reach the same TableHandlers as gRPC's
PullRows/PushRows/PushPullRows as views of that region, with no copy. The table writes the pulled
rows straight into the reply region, past the slots of the session's dense slices (those keep their
bytes between requests: sync mode reuses them), and they go back as the reply's one slice.

Pure adapter: no socket, no gRPC.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from pshard.common.errors import InvalidArgumentError
from pshard.common.sparse import TableConfig
from pshard.ps_server.core.store import SliceMeta
from pshard.ps_server.handlers.tables import TableHandlers

from pshard.api.v1 import parameter_server_pb2 as pb

# reply_room(nbytes) -> (offset, a uint8 view of nbytes of the reply region past the dense slots).
ReplyRoom = Callable[[int], tuple[int, np.ndarray]]


async def serve_table(tables: TableHandlers, header: pb.ExchangeHeader, metas: Sequence[SliceMeta],
                      views: Sequence[np.ndarray], reply_room: ReplyRoom) -> pb.TransportReply:
    """Run one table request whose bytes are `views` (as `metas` describe them); PSErrors are refusals."""
    request = header.table
    want = 2 * request.push + request.pull
    if len(views) != want or not want:
        raise InvalidArgumentError(f"table request of {request.table[:256]!r}: {len(views)} byte entries, "
                                   f"expected {want} (push {request.push}, pull {request.pull})")
    for index in (*((0,) if request.push else ()), *((want - 1,) if request.pull else ())):
        if metas[index].dtype != "int64":
            raise InvalidArgumentError(f"table request of {request.table[:256]!r}: ids of dtype "
                                       f"{metas[index].dtype}, expected int64")
    placed: list[tuple[int, int]] = []

    def into(config: TableConfig, n: int) -> np.ndarray:
        dtype, width = config.row_layout  # narrow rows go as stored
        nbytes = n * config.row_bytes
        offset, room = reply_room(nbytes)
        placed.append((offset, nbytes))
        return room.view(dtype).reshape(n, width)

    stamp = header.stamp
    # A scheduled call's push (pshard.coordinator) carries its schedule in the stamp, as a dense one does.
    schedule = (stamp.schedule_id, stamp.schedule_seq, stamp.schedule_floor)
    reply = pb.TransportReply()
    if request.push and request.pull:
        stored, _ = await tables.push_pull(request.table, views[0], views[1], views[2], stamp.clock,
                                           stamp.worker_id, into, request.push_id,
                                           request.layout_version, schedule)
    elif request.push:
        stored = await tables.push(request.table, views[0], views[1], stamp.clock, stamp.worker_id,
                                   request.push_id, request.layout_version, schedule)
    else:
        stored = 0
        await tables.pull(request.table, views[0], stamp.clock, stamp.worker_id, into)
    reply.summary.applied = stored
    for offset, nbytes in placed:
        reply.offsets.append(offset)
        reply.sizes.append(nbytes)
    return reply
