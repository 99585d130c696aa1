"""Assemble and run a parameter server: gRPC handlers, health, graceful stop.

`serve()` runs inside an asyncio loop (python -m pshard.ps_server); `start_server_thread()`
runs one in a background thread with its own loop, for tests and embedding.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pshard.common.cluster import ClusterSpec
from pshard.common.rpc import DEFAULT_MAX_MESSAGE_BYTES, server_options
from pshard.common.scheduler_client import SchedulerClient
from pshard.common.view import ClusterView
from pshard.ps_server.quorum import QuorumFollower
from pshard.ps_server.servicer import ParameterServerServicer, ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb

log = logging.getLogger("pshard.ps")

SERVICE_NAME = "pshard.api.v1.ParameterServer"


def _handlers(servicer: ParameterServerServicer) -> grpc.GenericRpcHandler:
    unary = grpc.unary_unary_rpc_method_handler
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Declare": unary(servicer.Declare, pb.DeclareRequest.FromString,
                         pb.DeclareResponse.SerializeToString),
        "Push": unary(servicer.Push, pb.PushRequest.FromString, pb.PushResponse.SerializeToString),
        "Pull": unary(servicer.Pull, pb.PullRequest.FromString, pb.PullResponse.SerializeToString),
        "PushPull": unary(servicer.PushPull, pb.PushPullRequest.FromString,
                          pb.PullResponse.SerializeToString),
        "GetStats": unary(servicer.GetStats, pb.GetStatsRequest.FromString,
                          pb.GetStatsResponse.SerializeToString),
        "Checkpoint": unary(servicer.Checkpoint, pb.CheckpointRequest.FromString,
                            pb.CheckpointResponse.SerializeToString),
        # No (de)serializers: frames are encoded by ps_common.codec, one copy per chunk.
        "Exchange": grpc.stream_stream_rpc_method_handler(servicer.Exchange),
    })


@dataclass
class RunningServer:
    server: grpc.aio.Server
    servicer: ParameterServerServicer
    health: health.aio.HealthServicer  # type: ignore[name-defined]
    port: int
    stopped: asyncio.Event = field(default_factory=asyncio.Event)

    async def stop(self, grace_s: float = 5.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        self.stopped.set()


async def start(settings: ServerSettings, bind: str = "127.0.0.1:0",
                max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> RunningServer:
    loop = asyncio.get_running_loop()
    servicer = ParameterServerServicer(settings, loop)
    server = grpc.aio.server(options=server_options(max_message_bytes))
    server.add_generic_rpc_handlers([_handlers(servicer)])
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(bind)
    if port == 0:
        raise OSError(f"could not bind {bind}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("parameter server listening on port %d", port)
    return RunningServer(server, servicer, health_servicer, port)


@dataclass
class ServerThread:
    """A parameter server on its own event loop in a daemon thread."""

    port: int
    running: RunningServer
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(self, fn: Callable[[], object]) -> object:
        """Run `fn` on the server's loop (e.g. set_quorum) and return its result."""
        async def run() -> object:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=10)

    def set_quorum(self, quorum: Mapping[str, int]) -> None:
        self.call(lambda: self.running.servicer.set_quorum(quorum))

    def stop(self, grace_s: float = 1.0) -> None:
        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self.running.stop(grace_s), self.loop).result(timeout=grace_s + 10)
        self.thread.join(timeout=10)


def start_server_thread(settings: ServerSettings, bind: str = "127.0.0.1:0",
                        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> ServerThread:
    started: dict[str, object] = {}
    ready = threading.Event()

    def main() -> None:
        async def run() -> None:
            try:
                started["running"] = await start(settings, bind, max_message_bytes)
                started["loop"] = asyncio.get_running_loop()
            except BaseException as err:  # surface start-up failures to the caller
                started["error"] = err
                ready.set()
                return
            ready.set()
            running: RunningServer = started["running"]  # type: ignore[assignment]
            await running.stopped.wait()

        asyncio.run(run())

    thread = threading.Thread(target=main, name=f"ps-server-{bind}", daemon=True)
    thread.start()
    if not ready.wait(timeout=30):
        raise TimeoutError(f"parameter server on {bind} did not start within 30 s")
    if "error" in started:
        raise started["error"]  # type: ignore[misc]
    running: RunningServer = started["running"]  # type: ignore[assignment]
    return ServerThread(running.port, running, started["loop"], thread)  # type: ignore[arg-type]


def follow_scheduler(running: RunningServer, spec: ClusterSpec,
                     loop: asyncio.AbstractEventLoop) -> SchedulerClient:
    """Register this server with the scheduler and apply every cluster view to the store.

    Registration retries in the client's own thread (the scheduler may start after us);
    views arrive on the client's Watch thread and are handed to the event loop.
    """
    servicer = running.servicer
    servicer.follow_views()
    # Workers a restarted scheduler forgot are waited for while they re-register (see quorum.py);
    # the grace is set from the scheduler's heartbeat timeout once we are registered.
    follower = QuorumFollower(grace_s=10.0, now=time.monotonic)

    def install(view: ClusterView | None = None) -> None:
        servicer.set_quorum(follower.apply(view), view.generation if view is not None else None)
        deadline = follower.next_deadline()
        if deadline is not None:
            loop.call_later(max(0.0, deadline - time.monotonic()) + 0.01, install)

    def on_view(view: ClusterView) -> None:
        loop.call_soon_threadsafe(install, view)

    client = SchedulerClient(spec.scheduler_address, "ps", own_address=spec.own_address or "",
                             node_id=spec.node_id, rank_hint=spec.task_index, on_view=on_view,
                             connect_timeout_s=300.0)

    def register() -> None:
        try:
            registration = client.register()
            follower.grace_s = 2 * client.heartbeat_timeout_s
            log.info("registered with scheduler %s as %s (rank %d, generation %d)", spec.scheduler_address,
                     registration.node_id, registration.rank, registration.generation)
        except Exception:
            log.exception("could not register with scheduler %s", spec.scheduler_address)

    threading.Thread(target=register, name="ps-register", daemon=True).start()
    return client


async def checkpoint_every(running: RunningServer, interval_s: float) -> None:
    """Periodic shard checkpoints, so a killed server loses at most `interval_s` of training."""
    while True:
        await asyncio.sleep(interval_s)
        if running.servicer.has_store:
            try:
                path, version = await running.servicer.checkpoint(0, interval_s)
                log.info("checkpoint at version %d: %s", version, path)
            except Exception:
                log.exception("periodic checkpoint failed")
