"""A table client's re-route after `pshard rebalance` switched a partition (issue 20): a server refusing a
partition by a layout older than the client's has not received the switch yet, so the request goes again in
a moment instead of waiting for a newer layout that is not coming (it held pushes 10 s after the last move of
bench.rebalance)."""

from __future__ import annotations

import dataclasses

from pshard.client.tables import _server_behind
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.errors import LayoutNotYetError, PartitionMovedError, UnavailableError


def _layout(version: int):
    layout = plan_layout([ParamSpec("w", "float32", (4,))], ("a:1", "b:1"))
    return dataclasses.replace(layout, version=version)


def test_a_server_on_an_older_layout_than_the_client_is_behind_and_is_asked_again():
    refused = PartitionMovedError("moved", table="emb", partition=3, layout_version=2)
    assert _server_behind(refused, _layout(3))


def test_a_server_on_the_clients_layout_or_a_newer_one_means_a_newer_layout_to_wait_for():
    assert not _server_behind(PartitionMovedError("moved", layout_version=3), _layout(3))
    assert not _server_behind(PartitionMovedError("moved", layout_version=4), _layout(3))
    assert not _server_behind(PartitionMovedError("moved"), _layout(3))  # no version said
    assert not _server_behind(UnavailableError("gone"), _layout(3))
    assert not _server_behind(LayoutNotYetError("not yet", known_version=2), _layout(3))
    assert not _server_behind(PartitionMovedError("moved", layout_version=2), None)
