"""Which of a layout's servers the job has lost, and the error a worker that needs one raises.

With replicas, a server that dies before any live backup holds an in-sync copy of what it serves is
never failed over (the copy may lack acknowledged updates): the scheduler refuses, and its views name
the server (`ClusterView.lost`). A worker re-routing a failed step would otherwise wait for a newer
layout that never comes, until the step's deadline, and end with an error that names no loss
(docs/architecture.md, 9 Failures). Pure: views and layouts in, an error out.
"""

from __future__ import annotations

from collections.abc import Sequence

from pshard.common.cluster.layout import Layout
from pshard.common.cluster.view import ClusterView, ServerLoss
from pshard.common.errors import SlicesLostError

_KEYS_SHOWN = 8


def serves(layout: Layout, address: str) -> bool:
    """Whether `layout` routes any slice or table row partition to the server at `address`."""
    if address not in layout.servers:
        return False
    index = layout.servers.index(address)
    return bool(layout.slices_on(index) or layout.partitions_on(index))


def lost_in(view: ClusterView, layout: Layout) -> tuple[ServerLoss, ...]:
    """The losses `view` names whose server `layout` still routes slices or row partitions to."""
    return tuple(loss for loss in view.lost if serves(layout, loss.address))


def slices_lost_error(losses: Sequence[ServerLoss], layout: Layout) -> SlicesLostError:
    """The error of a step under `layout`, which routes to the servers of `losses`: what each held,
    that it is gone, and what to do. Facts: `server` (their addresses, comma-separated) and
    `layout_version` (the newest layout in which one was lost)."""
    held = "; ".join(_what_was_lost(loss, layout) for loss in losses)
    return SlicesLostError(
        f"{held}. They and every update they received are gone, and no resend can bring them back: restore "
        "the job from its last checkpoint (restart the servers on their --checkpoint-dir, with --resume "
        "under 'pshard launch'), or start the job again",
        server=",".join(loss.address for loss in losses),
        layout_version=max(loss.layout_version for loss in losses))


def _what_was_lost(loss: ServerLoss, layout: Layout) -> str:
    index = layout.servers.index(loss.address)
    held, partitions = layout.slices_on(index), layout.partitions_on(index)
    keys = sorted({s.key for s in held})
    shown = ", ".join(keys[:_KEYS_SHOWN]) + (f" and {len(keys) - _KEYS_SHOWN} more"
                                             if len(keys) > _KEYS_SHOWN else "")
    numel = sum(s.numel for s in held)
    total = sum(p.numel for p in layout.params)
    return (f"parameter server {index} ({loss.address}) is lost, its failover refused ({loss.reason}): it "
            f"served {len(held)} slice(s) of {len(keys)} parameter(s) ({shown or 'none'}; {numel} of the "
            f"model's {total} values) and table row partition(s) {list(partitions)} in layout version "
            f"{loss.layout_version}")
