"""Table rows replicated over the raw TCP link between servers that share no memory
(docs/architecture.md, 9 Failures and 11 Transports).

Three real servers, replicas 1, no shared memory, each offering its fast-path listener: every batch
of rows goes to the backup as a link frame whose data are the columns, and no Replicate call goes
over gRPC; when the link breaks under a batch (before or after the backup applied it), the batch
goes again over gRPC, and the backup's replica still equals its primary's table byte for byte.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.rpc.serving import ServerThread
from pshard.ps_server.core.store import SliceMeta
from pshard.ps_server.handlers.dense import ParameterServerHandlers
from pshard.ps_server.replication.table_rows import all_ids
from pshard.ps_server.tables.table import SparseTable
from pshard.ps_server.transport import fastpath

from pshard.api.v1 import parameter_server_pb2 as ps_pb
from tests.service.test_table_replication import CONFIG, IDS, _grads, _layout, _replicated, _rows, _state


def _replicate_calls(server: ServerThread, transport: str) -> int:
    """Bytes of Replicate requests `server` received over `transport` (the fast path records its
    sessions' Replicate frames, the gRPC servicer its calls)."""
    return sum(t.bytes_in for (kind, method), t in server.running.handlers.requests.items()
               if (kind, method) == (transport, "Replicate"))


def _assert_replicas_exact(servers: Sequence[ServerThread]) -> None:
    """Each backup holds what its primary holds, byte for byte (rows, optimizer state, metadata)."""
    for i, server in enumerate(servers):
        primary = server.running.tables.find("emb")
        replica = _rows(servers[(i + 1) % 3]).replicas.table(server.address, "emb")
        assert primary is not None and replica is not None
        held = np.sort(all_ids(primary))
        assert len(held) and np.array_equal(held, np.sort(all_ids(replica))), i
        assert _state(primary, held) == _state(replica, held), i
        assert (primary.step, primary.clock) == (replica.step, replica.clock), i


def _push(client, reference: SparseTable, step: int) -> None:
    ids = IDS[step % 2::2] if step % 3 else IDS
    grads = _grads(step, len(ids))
    client.push_rows("emb", ids, grads)  # returns once the backups hold its rows
    reference.push(ids, grads)


def _job(start_server, new_client) -> tuple[list[ServerThread], PSClient, SparseTable]:
    """Three servers offering only raw TCP between them, a client over gRPC, the table declared, and
    a local table that takes the same pushes."""
    servers, layout = _replicated(start_server, _layout, tcp=True)
    client = new_client(servers, "w0", layout=layout, transport="grpc")
    client.declare_table(CONFIG)
    return servers, client, SparseTable(CONFIG)


def test_without_shared_memory_the_rows_go_over_the_raw_tcp_link(start_server, new_client) -> None:
    servers, client, reference = _job(start_server, new_client)
    for step in range(4):
        _push(client, reference, step)
        _assert_replicas_exact(servers)
    for server in servers:
        links = _rows(server)._links
        assert links is not None and links.calls > 0
        assert not links._down  # no batch fell back to gRPC
        assert _replicate_calls(server, "tcp") > 0  # the rows' bytes came in link frames
        assert _replicate_calls(server, "grpc") == 0  # and none in gRPC calls
    assert client.pull_rows("emb", IDS).tobytes() == reference.pull(IDS).tobytes()


@pytest.mark.parametrize("applied", [False, True], ids=["before-apply", "after-apply"])
def test_a_link_broken_under_a_batch_resends_it_over_grpc_and_the_replica_stays_exact(
        start_server, new_client, monkeypatch, applied: bool) -> None:
    servers, client, reference = _job(start_server, new_client)
    for step in range(2):
        _push(client, reference, step)
    primary, backup = servers[1], servers[2]
    assert _replicate_calls(backup, "tcp") > 0 and _replicate_calls(backup, "grpc") == 0
    serve = fastpath.serve_replicate
    broken: list[int] = []

    async def reset_once(handlers: ParameterServerHandlers, header: ps_pb.ExchangeHeader,
                         metas: Sequence[SliceMeta], views: Sequence[np.ndarray]) -> ps_pb.TransportReply:
        if broken or header.replicate.primary != primary.address or handlers is not backup.running.handlers:
            return await serve(handlers, header, metas, views)
        broken.append(sum(len(t.ids) for t in header.replicate.tables) // 8)
        assert backup.running.fast.disconnect(primary.address) == 1
        # The abort is scheduled on this loop: one yield lets it run before a reply could be written,
        # so the primary sees the link break whether or not the batch was applied.
        await asyncio.sleep(0)
        if not applied:
            return ps_pb.TransportReply()  # never reaches the primary: the batch must come again
        return await serve(handlers, header, metas, views)

    monkeypatch.setattr(fastpath, "serve_replicate", reset_once)
    for step in range(2, 6):
        _push(client, reference, step)
        _assert_replicas_exact(servers)
    assert broken and broken[0] > 0, "no batch of rows went over the link after the first steps"
    links = _rows(primary)._links
    assert links is not None and list(links._down) == [backup.address]  # gRPC from then on
    assert _replicate_calls(backup, "grpc") > 0
    assert client.pull_rows("emb", IDS).tobytes() == reference.pull(IDS).tobytes()
