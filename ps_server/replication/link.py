"""The gRPC side of replication (ps_server/replication/dense.py): whom this server forwards to, and how.

Backups come from the scheduler's view: the ps nodes in rank order are the ring, and this server's
backups are the next `replicas` live ones after it (pshard.common.cluster.replicas), the same rule the
scheduler applies when it promotes one. Calls go server to server under the server's own
credentials (TLS and token when the job has them); without shared memory between the two, the
batches' bytes go over a raw TCP link to the backup's fast-path listener (ps_server/transport/replica_tcp.py),
negotiated over the same channel, and over gRPC when the link cannot be had or breaks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from pshard.common.cluster.layout import Layout
from pshard.common.cluster.replicas import index_of, joining_backups
from pshard.common.cluster.view import ClusterView, NodeState
from pshard.common.rpc.options import channel_options
from pshard.common.security.credentials import SecurityConfig
from pshard.common.types import SliceKey
from pshard.ps_server.replication.backends import Send
from pshard.ps_server.transport.replica_tcp import TcpLinks

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import parameter_server_pb2_grpc as pb_grpc

# A batch is at most a few MiB; a backup that takes longer than this is retried (the records stay queued).
_CALL_TIMEOUT_S = 30.0


def backup_addresses(view: ClusterView, node_id: str, replicas: int,
                     placed: int | None = None) -> tuple[list[str], list[str]]:
    """The addresses of this server's backups in `view` (none while it is not in the view): those among
    the layout's `placed` servers (None: no layout known, every server), and the joiners beyond them
    that copy from it as well, which acknowledgements wait for only once they caught up
    (pshard.common.cluster.replicas.joining_backups)."""
    servers = {n.rank: n for n in view.nodes if n.role == "ps"}
    me = next((n for n in servers.values() if n.node_id == node_id), None)
    if me is None or replicas <= 0:
        return [], []
    size = max(servers) + 1
    live = {rank for rank, n in servers.items() if n.state is NodeState.LIVE}
    kept, joining = joining_backups(me.rank, size, replicas, live | {me.rank}, placed)
    return [servers[rank].address for rank in kept], [servers[rank].address for rank in joining]


def owned_slices(layout: Layout, address: str) -> frozenset[SliceKey] | None:
    """The slices `layout` makes the server at `address` primary of; None if it is not in the layout."""
    me = index_of(layout, address)
    return None if me is None else frozenset(s.slice_key for s in layout.slices_on(me))


Stubs = Callable[[str], pb_grpc.ParameterServerServiceStub]


def stub_cache(security: SecurityConfig | None = None) -> Stubs:
    """One cached channel per backup, under the server's own credentials."""
    security = security or SecurityConfig()
    stubs: dict[str, pb_grpc.ParameterServerServiceStub] = {}
    lock = threading.Lock()

    def stub(address: str) -> pb_grpc.ParameterServerServiceStub:
        with lock:
            found = stubs.get(address)
            if found is None:
                found = stubs[address] = pb_grpc.ParameterServerServiceStub(
                    security.channel(address, options=channel_options()))
            return found

    return stub


def grpc_sender(security: SecurityConfig | None = None, stubs: Stubs | None = None) -> Send:
    """A blocking Replicate call per (address, request), over one cached channel per backup."""
    stub = stubs or stub_cache(security)

    def send(address: str, request: pb.ReplicateRequest) -> pb.ReplicateResponse:
        # No wait_for_ready: a backup that is down fails the call at once, and the sender retries.
        return stub(address).Replicate(request, timeout=_CALL_TIMEOUT_S)

    return send


def tcp_links(node_id: str, security: SecurityConfig | None = None, stubs: Stubs | None = None) -> TcpLinks:
    """The raw TCP replication links of the server `node_id` (TLS when the job has it), negotiated
    over the same channels as its Replicate calls."""
    security = security or SecurityConfig()
    return TcpLinks(node_id, stubs or stub_cache(security),
                    security.client_ssl_context() if security.tls else None)
