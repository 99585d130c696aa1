"""Membership values <-> protobuf, shared by the scheduler's servicer and its client.

(Layouts and tensors are converted by `ps_common.codec`.)
"""

from __future__ import annotations

from ps_api.v1 import scheduler_pb2 as pb
from scheduler.membership import ClusterView, Node, NodeState

_STATE_TO_PROTO = {NodeState.LIVE: pb.LIVE, NodeState.DEAD: pb.DEAD, NodeState.LEFT: pb.LEFT}
_STATE_FROM_PROTO = {v: k for k, v in _STATE_TO_PROTO.items()}


def node_to_proto(node: Node) -> pb.Node:
    return pb.Node(node_id=node.node_id, role=node.role, rank=node.rank, address=node.address,
                   state=_STATE_TO_PROTO[node.state], generation=node.generation)


def node_from_proto(p: pb.Node) -> Node:
    # A state this version does not know (a newer scheduler) is safest read as not live.
    state = _STATE_FROM_PROTO.get(p.state, NodeState.DEAD)
    return Node(p.node_id, p.role, p.rank, p.address, state, p.generation)


def view_to_proto(view: ClusterView) -> pb.ClusterView:
    return pb.ClusterView(generation=view.generation, nodes=[node_to_proto(n) for n in view.nodes],
                          layout_version=view.layout_version)


def view_from_proto(p: pb.ClusterView) -> ClusterView:
    return ClusterView(p.generation, tuple(node_from_proto(n) for n in p.nodes), p.layout_version)
