"""One rule says when a client's call to a server that is down fails at once instead of waiting for it
(pshard.client.connections.ServerConnections.fails_fast_under): the client can ask the scheduler for a
newer layout and the layout keeps backups to fail over to. PSClient, its fast paths and the tables client
all ask it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pshard.client.connections import ServerConnections
from pshard.common.cluster.layout import Layout, ParamSpec, plan_layout
from pshard.common.security.credentials import SecurityConfig

SERVERS = ("127.0.0.1:1", "127.0.0.1:2")  # nothing listens: the rule opens no connection
PARAMS = [ParamSpec("w", "float32", (64, 8))]


def _no_newer(layout: Layout, timeout_s: float) -> Layout | None:
    return None


@contextmanager
def _connections(rerouting: bool) -> Iterator[ServerConnections]:
    connections = ServerConnections(SERVERS, "worker-0", SecurityConfig(insecure=True), timeout_s=5.0,
                                    transport="grpc", shm_dir="", relayout=_no_newer if rerouting else None)
    try:
        yield connections
    finally:
        connections.close()


def test_a_call_fails_fast_only_where_it_can_re_route_to_a_replicated_layouts_backup() -> None:
    replicated, plain = plan_layout(PARAMS, SERVERS, replicas=1), plan_layout(PARAMS, SERVERS)
    with _connections(rerouting=True) as rerouting, _connections(rerouting=False) as fixed:
        assert rerouting.fails_fast_under(replicated)
        assert not rerouting.fails_fast_under(plain)  # no backup to fail over to: wait for the server
        assert not rerouting.fails_fast_under(None)
        assert not fixed.fails_fast_under(replicated)  # no newer layout can come: wait for the server
        assert not rerouting.fails_fast  # routed by no layout yet
        rerouting.use_layout(replicated)
        assert rerouting.fails_fast
