"""A client's re-route after a layout switch (issue 20: `pshard rebalance`, a drain, a join): a server
refusing a row partition or a dense slice by a layout older than the client's has not received the switch
yet, so the request goes again in a moment instead of waiting for a newer layout that is not coming (it held
table pushes 10 s after the last move of bench.rebalance, and a dense step gave up: a drain without replicas
failed its worker with SliceMovedError under load)."""

from __future__ import annotations

import dataclasses

import pytest
from pshard.client.connections import server_behind
from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.errors import LayoutNotYetError, PartitionMovedError, SliceMovedError, UnavailableError


def _layout(version: int):
    layout = plan_layout([ParamSpec("w", "float32", (4,))], ("127.0.0.1:1", "127.0.0.1:2"))
    return dataclasses.replace(layout, version=version)


@pytest.mark.parametrize("refused", [
    PartitionMovedError("moved", table="emb", partition=3, layout_version=2),
    SliceMovedError("moved", key="w", layout_version=2),
])
def test_a_server_on_an_older_layout_than_the_client_is_behind_and_is_asked_again(refused) -> None:
    assert server_behind(refused, _layout(3))


def test_a_server_on_the_clients_layout_or_a_newer_one_means_a_newer_layout_to_wait_for() -> None:
    assert not server_behind(PartitionMovedError("moved", layout_version=3), _layout(3))
    assert not server_behind(PartitionMovedError("moved", layout_version=4), _layout(3))
    assert not server_behind(SliceMovedError("moved", key="w", layout_version=3), _layout(3))
    assert not server_behind(PartitionMovedError("moved"), _layout(3))  # no version said
    assert not server_behind(UnavailableError("gone"), _layout(3))
    assert not server_behind(LayoutNotYetError("not yet", known_version=2), _layout(3))
    assert not server_behind(PartitionMovedError("moved", layout_version=2), None)


def test_a_dense_step_refused_by_a_server_behind_the_switch_is_sent_again_not_failed() -> None:
    """The step the client re-routed by layout 3 reaches the new owner before that server learned layout 3:
    it refuses by layout 2. The client sends it again shortly (no newer layout is coming) and it lands."""
    layout = _layout(3)
    with PSClient(list(layout.servers), "w0", layout=layout, relayout=lambda known, timeout_s: None,
                  timeout_s=5.0) as client:
        refusals = [SliceMovedError("moved", key="w", layout_version=2)] * 2
        sent: list[int] = []

        def step(routed) -> str:
            sent.append(routed.version)
            if refusals:
                raise refusals.pop()
            return "applied"

        assert client._rerouting(step) == "applied"
        assert sent == [3, 3, 3] and client.not_yet == 2 and client.reroutes == 0
