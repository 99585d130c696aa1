"""Assemble and run the scheduler: the Scheduler service, health, expiry, graceful stop.

`serve()` runs in an asyncio loop until told to stop (``python -m pshard.scheduler``);
`start_scheduler_thread()` runs one in a daemon thread with its own loop, for tests and for a
chief or worker 0 that hosts the scheduler in-process when the cluster has no scheduler task.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TypeAlias

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pshard.common.cluster.view import Clock
from pshard.common.rpc.interceptors import DecodeErrors
from pshard.common.rpc.options import server_options
from pshard.common.rpc.serving import ServerThread, start_in_thread
from pshard.common.security.auth import AuthRefusals
from pshard.common.security.credentials import SecurityConfig
from pshard.scheduler.auto_rebalance import RebalancePolicy
from pshard.scheduler.auto_rebalancer import AutoRebalancer
from pshard.scheduler.membership import Membership, MembershipLimits
from pshard.scheduler.servicer import SchedulerServicer
from pshard.scheduler.settings import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_LOAD_WINDOW_S,
)

from pshard.api.v1 import scheduler_pb2_grpc as pb_grpc

log = logging.getLogger("pshard.scheduler")

SERVICE_NAME = "pshard.api.v1.SchedulerService"
# Expiry runs at this fraction of the timeout, so a silent node is declared dead within 1.25x it.
_EXPIRY_FRACTION = 0.25


@dataclass
class RunningScheduler:
    server: grpc.aio.Server
    servicer: SchedulerServicer
    health: health.aio.HealthServicer  # type: ignore[name-defined]
    port: int
    expiry: asyncio.Task[None]
    stopped: asyncio.Event = field(default_factory=asyncio.Event)
    # Calls refused UNAUTHENTICATED or PERMISSION_DENIED (security on).
    refusals: AuthRefusals = field(default_factory=AuthRefusals)
    rebalance: asyncio.Task[None] | None = None  # the automatic rebalance's loop (--rebalance-auto)

    async def stop(self, grace_s: float = 2.0) -> None:
        """NOT_SERVING first (load balancers stop routing), end the Watch streams, then drain RPCs."""
        if self.stopped.is_set():
            return
        await self.health.enter_graceful_shutdown()
        self.servicer.close()
        for task in (self.expiry, self.rebalance):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await self.server.stop(grace_s)
        self.stopped.set()
        log.info("scheduler on port %d stopped", self.port)


async def start(bind: str = "127.0.0.1:0", *, heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
                heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
                clock: Clock | None = None, limits: MembershipLimits | None = None,
                security: SecurityConfig | None = None, row_partitions_per_server: int = 1,
                rebalance: RebalancePolicy | None = None, load_window_s: float = DEFAULT_LOAD_WINDOW_S
                ) -> RunningScheduler:
    """Start serving on `bind` (port 0 picks a free port); raises OSError if it cannot listen.

    `security`: TLS files and tokens (pshard.common.security.credentials); default: plain and open.
    `row_partitions_per_server`: table row partitions per server in the layout (Membership).
    `rebalance`: the automatic rebalance policy (None: off), decided on every heartbeat interval;
    `load_window_s`: the servers' loads are rates over that many seconds."""
    security = security or SecurityConfig()
    membership = Membership(heartbeat_timeout_s, clock, limits, row_partitions_per_server, load_window_s)
    rebalancer = AutoRebalancer(membership, rebalance) if rebalance is not None else None
    servicer = SchedulerServicer(membership, heartbeat_interval_s, rebalancer)
    refusals = AuthRefusals()
    server = grpc.aio.server(options=server_options(),
                             interceptors=[*security.server_interceptors(refusals), DecodeErrors()])
    pb_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    try:
        port = security.add_port(server, bind)
    except RuntimeError as e:
        raise OSError(f"scheduler: cannot listen on {bind}: {e}") from None
    if port == 0:  # older grpc releases report a failed bind this way
        raise OSError(f"scheduler: cannot listen on {bind}: port in use or address not local")
    await server.start()
    for service in ("", SERVICE_NAME):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    expiry = asyncio.create_task(servicer.run_expiry(max(heartbeat_timeout_s * _EXPIRY_FRACTION, 0.01)))
    balancing = asyncio.create_task(servicer.run_auto_rebalance(heartbeat_interval_s)) if rebalancer else None
    log.info("scheduler listening on %s (port %d); heartbeat every %g s, timeout %g s; %s",
             bind, port, heartbeat_interval_s, heartbeat_timeout_s, security.describe())
    if rebalance is not None:
        log.info("automatic rebalance on: a row partition moves when the hottest server is above %gx the "
                 "mean load (over %g s of samples), at most one move each %g s", rebalance.threshold,
                 rebalance.window_s, rebalance.cooldown_s)
    return RunningScheduler(server, servicer, health_servicer, port, expiry, refusals=refusals,
                            rebalance=balancing)


async def serve(bind: str, stop: asyncio.Event, *, heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
                heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S, grace_s: float = 2.0,
                security: SecurityConfig | None = None) -> None:
    """Serve until `stop` is set, then stop gracefully."""
    running = await start(bind, heartbeat_interval_s=heartbeat_interval_s,
                          heartbeat_timeout_s=heartbeat_timeout_s, security=security)
    try:
        await stop.wait()
    finally:
        await running.stop(grace_s)


# A scheduler running in a daemon thread with its own event loop.
SchedulerHandle: TypeAlias = ServerThread[RunningScheduler]


def start_scheduler_thread(bind: str = "127.0.0.1:0", *,
                           heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
                           heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
                           grace_s: float = 2.0, start_timeout_s: float = 10.0,
                           security: SecurityConfig | None = None,
                           row_partitions_per_server: int = 1, rebalance: RebalancePolicy | None = None,
                           load_window_s: float = DEFAULT_LOAD_WINDOW_S) -> SchedulerHandle:
    """Run a scheduler in a daemon thread; returns once it is serving (or raises why it is not)."""
    return start_in_thread(
        lambda: start(bind, heartbeat_interval_s=heartbeat_interval_s,
                      heartbeat_timeout_s=heartbeat_timeout_s, security=security,
                      row_partitions_per_server=row_partitions_per_server, rebalance=rebalance,
                      load_window_s=load_window_s),
        name=f"scheduler-{bind}", grace_s=grace_s, start_timeout_s=start_timeout_s)
