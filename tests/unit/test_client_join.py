"""A worker's connections follow the layout's servers (issue 20, a server joining a running job): a layout
that adds a server opens its channel, stubs and fast-path slot before any call is routed by it, and a
layout that re-orders or replaces one of the servers this worker knows is refused, changing nothing.
Channels connect lazily, so nothing here needs a server running."""

from __future__ import annotations

import dataclasses

import pytest
from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.errors import LayoutConflictError

SPECS = [ParamSpec(f"w{i}", "float32", (64, 64)) for i in range(6)]
SERVERS = ("127.0.0.1:1", "127.0.0.1:2")
JOINER = "127.0.0.1:3"


@pytest.fixture
def client() -> PSClient:
    layout = plan_layout(SPECS, SERVERS, slice_bytes=1 << 20, replicas=1)
    with PSClient(SERVERS, "worker-0", layout=layout, transport="grpc") as client:
        client.tables.declare  # noqa: B018  # the tables client exists before the layout grows
        yield client


def test_a_layout_adding_a_server_connects_to_it_before_anything_is_routed_there(client: PSClient) -> None:
    grown = dataclasses.replace(plan_layout(SPECS, (*SERVERS, JOINER), slice_bytes=1 << 20, replicas=1),
                                version=client.layout.version + 1)
    assert grown.slices_on(2), "the test needs slices on the new server"
    client.set_layout(grown)
    assert client.servers == (*SERVERS, JOINER)
    assert len(client.connections.channels) == len(client._stubs) == len(client._exchange) == 3
    assert len(client.tables._stubs) == len(client.tables.transports) == 3
    assert client.transports == ["grpc"] * 3
    assert client.connections.sessions() == [None] * 3


def test_a_layout_replacing_a_known_server_is_refused_and_changes_nothing(client: PSClient) -> None:
    before = client.layout
    other = dataclasses.replace(plan_layout(SPECS, (SERVERS[0], JOINER), slice_bytes=1 << 20, replicas=1),
                                version=before.version + 1)
    with pytest.raises(LayoutConflictError, match=r"server 1 is 127\.0\.0\.1:3, this worker's server 1 is "
                                                   r"127\.0\.0\.1:2"):
        client.set_layout(other)
    assert client.layout is before
    assert client.servers == SERVERS
    assert len(client.connections.channels) == len(client._stubs) == 2
