"""Which parameter server a job has lost (docs/architecture.md, 9 Failures). Pure: views and times in.

Without replicas, a server the scheduler declared dead takes its slices with it, and every update
they received since its last checkpoint. Workers would otherwise wait for it until a step's deadline
(minutes) and end with an error that names nobody. A server that comes back within the grace (a
launcher or compose restart, restoring its checkpoint) is not lost: the job goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

from pshard.common.cluster.layout import Layout
from pshard.common.cluster.view import ClusterView, NodeState


@dataclass(frozen=True)
class LostServer:
    node_id: str
    address: str
    state: str  # "dead" or "left"
    gone_s: float  # since this watch first saw it gone
    message: str


class ServerWatch:
    def __init__(self, layout: Layout, grace_s: float) -> None:
        self._layout = layout
        self._grace_s = grace_s
        self._gone_since: dict[str, float] = {}  # address -> first seen gone

    def observe(self, view: ClusterView, now: float, *, leaving_ok: bool = False) -> LostServer | None:
        """Note which of the layout's servers `view` shows gone; the first gone past the grace.

        `leaving_ok`: servers that left on purpose are not lost (once training is over, servers run
        with --exit-when-done leave when the job is done).
        """
        servers = {n.address: n for n in view.nodes if n.role == "ps" and n.address in self._layout.servers
                   and self._needed(n.address)}
        for address, node in servers.items():
            if node.state is NodeState.LIVE or (leaving_ok and node.state is NodeState.LEFT):
                self._gone_since.pop(address, None)
            else:
                self._gone_since.setdefault(address, now)
        for address, since in sorted(self._gone_since.items(), key=lambda item: item[1]):
            if now - since >= self._grace_s:
                node = servers[address]
                return LostServer(node.node_id, address, node.state.value, now - since,
                                  self._describe(node.node_id, address, node.state, now - since))
        return None

    def _needed(self, address: str) -> bool:
        """With replicas a failover leaves a dead server without slices: the job no longer needs it."""
        return not self._layout.replicas or bool(self._layout.slices_on(self._layout.servers.index(address)))

    def _describe(self, node_id: str, address: str, state: NodeState, gone_s: float) -> str:
        index = self._layout.servers.index(address)
        held = self._layout.slices_on(index)
        keys = sorted({s.key for s in held})
        numel = sum(s.numel for s in held)
        total = sum(p.numel for p in self._layout.params)
        shown = ", ".join(keys[:8]) + (f" and {len(keys) - 8} more" if len(keys) > 8 else "")
        how = "declared dead by the scheduler" if state is NodeState.DEAD else "left the cluster"
        return (f"parameter server {node_id} at {address} is gone: {how} and not back within "
                f"{gone_s:.1f} s. It held {len(held)} slice(s), {numel} of the model's {total} values "
                f"({shown}); " + ("no live server held an in-sync copy of them (the scheduler logs "
                "FAILOVER IMPOSSIBLE), so" if self._layout.replicas else "with no replica,")
                + f" those values and every update to them since its last checkpoint are lost. Restart it "
                f"on {address} with its --checkpoint-dir to resume from that checkpoint")
