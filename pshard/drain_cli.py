"""`pshard drain SERVER`: an operator drains a parameter server of a running job (issue 20).

The scheduler hands everything the server serves to its in-sync backup under a new layout version (a
planned failover, scheduler/membership.py `leave`), and the workers re-route; the server, told by its
next heartbeat that it left, stops and exits 0 (ps_server/__main__.py). Without replicas, it first copies
everything to the servers `plan_drain` spreads it over, then switches it all under one layout version
(scheduler/drain_copies.py). While no copy holds everything yet, the scheduler refuses and changes
nothing, and this command asks again until --timeout-s. With security on, it needs an admin credential.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence

from pshard.admin import add_scheduler_argument, first_watch, parse_admin_args, scheduler_stub
from pshard.common.argtypes import positive_float
from pshard.common.cluster.replicas import NoInSyncCopyError
from pshard.common.cluster.view import ClusterView, Node, NodeState
from pshard.common.errors import InvalidArgumentError, PSError
from pshard.common.security.credentials import SecurityConfig, add_security_arguments

PROG = "pshard drain"
# Between tries: a server's in-sync report rides on its heartbeats (ps_server/drain.py).
_RETRY_S = 0.25


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Drain a parameter server of a running job: the "
                                "scheduler hands its slices and table rows to its in-sync backup (without "
                                "replicas: copies them to the other servers first, then switches them all "
                                "at once), the workers re-route, and the server leaves the job and exits 0.")
    p.add_argument("server", metavar="SERVER",
                   help="the server to drain: its node id (ps-1) or its address (HOST:PORT), as 'pshard "
                        "status' lists them")
    add_scheduler_argument(p)
    p.add_argument("--timeout-s", metavar="S", type=positive_float, default=60.0,
                   help="how long to wait for a copy of everything the server serves to be held (its "
                        "backup's, or the other servers' without replicas; default 60)")
    add_security_arguments(p)
    return p


def pick(view: ClusterView, server: str) -> Node:
    """The live parameter server `server` names (node id or address) in `view`."""
    servers = [n for n in view.nodes if n.role == "ps"]
    node = next((n for n in servers if server in (n.node_id, n.address)), None)
    if node is None:
        raise InvalidArgumentError(f"server: got {server!r}, the job's servers are "
                                   f"{[f'{n.node_id} ({n.address})' for n in servers]}")
    if node.state is not NodeState.LIVE:
        raise InvalidArgumentError(f"server {node.node_id} ({node.address}): it is "
                                   f"{node.state.name.lower()}, not live; there is nothing to drain")
    return node


def drain(scheduler: str, server: str, timeout_s: float, security: SecurityConfig,
          now: Callable[[], float] = time.monotonic) -> tuple[Node, int]:
    """Drain `server`; the node drained and the layout version that moved what it served."""
    import grpc

    from pshard.api.v1 import scheduler_pb2
    from pshard.common.rpc.status import error_from_rpc_error
    from pshard.common.wire.codec import view_from_proto

    started = now()
    with scheduler_stub(scheduler, security) as stub:
        view = view_from_proto(first_watch(stub, timeout_s).view)
        node = pick(view, server)
        request = scheduler_pb2.LeaveRequest(node_id=node.node_id, generation=node.generation)
        while True:
            try:
                reply = stub.Leave(request, timeout=timeout_s)
            except grpc.RpcError as e:
                err = error_from_rpc_error(e)
                if isinstance(err, NoInSyncCopyError) and now() - started < timeout_s:
                    time.sleep(_RETRY_S)
                    continue
                raise err from None
            return node, view_from_proto(reply.view).layout_version


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    args, scheduler, security = parse_admin_args(build_parser(prog), argv)
    try:
        node, version = drain(scheduler, args.server, args.timeout_s, security)
    except PSError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 1
    print(f"{prog}: {node.node_id} ({node.address}) drained: layout version {version} has what it served on "
          "other servers; it leaves the job and exits", flush=True)
    return 0
