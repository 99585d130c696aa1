"""Assemble and run a parameter server: handlers, their gRPC servicer, health, graceful stop.

`start()` runs inside an asyncio loop (python -m pshard.ps_server); `start_server_thread()`
runs one in a background thread with its own loop, for tests and embedding.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeAlias

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pshard.common.errors import PSError
from pshard.common.rpc.interceptors import DecodeErrors
from pshard.common.rpc.options import DEFAULT_MAX_MESSAGE_BYTES, server_options
from pshard.common.rpc.serving import ServerThread as _ServerThread
from pshard.common.rpc.serving import start_in_thread
from pshard.common.security.auth import AuthRefusals
from pshard.common.security.credentials import SecurityConfig
from pshard.ps_server.handlers.dense import ParameterServerHandlers
from pshard.ps_server.handlers.global_checkpoints import GlobalCheckpoints
from pshard.ps_server.handlers.tables import TableHandlers
from pshard.ps_server.heap import HeapTrimmer
from pshard.ps_server.settings import ServerSettings
from pshard.ps_server.transport.budget import InflightBudget, WasteTarpit
from pshard.ps_server.transport.fastpath import FastPathServer, OpenTransportMethod
from pshard.ps_server.transport.global_checkpoint_servicer import GlobalCheckpointServicer
from pshard.ps_server.transport.global_checkpoint_servicer import rpc_handlers as global_rpc_handlers
from pshard.ps_server.transport.servicer import ParameterServerServicer
from pshard.ps_server.transport.table_servicer import SparseTablesServicer
from pshard.ps_server.transport.table_servicer import rpc_handlers as table_rpc_handlers
from pshard.ps_server.transport.tarpit import Tarpit

from pshard.api.v1 import parameter_server_pb2 as pb

log = logging.getLogger("pshard.ps")

SERVICE_NAME = "pshard.api.v1.ParameterServerService"
_ENCODE_THREADS = 2


def _rpc_handlers(servicer: ParameterServerServicer) -> grpc.GenericRpcHandler:
    # No (de)serializers: the servicer gets the raw bytes, reserves their size in the in-flight
    # budget and only then parses them (and encodes large replies off the event loop).
    def unary(name: str, request_type: type[Message], method: Any) -> grpc.RpcMethodHandler:
        return grpc.unary_unary_rpc_method_handler(servicer.unary(name, request_type, method))

    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Declare": unary("Declare", pb.DeclareRequest, servicer.Declare),
        "Push": unary("Push", pb.PushRequest, servicer.Push),
        "Pull": unary("Pull", pb.PullRequest, servicer.Pull),
        "PushPull": unary("PushPull", pb.PushPullRequest, servicer.PushPull),
        "GetStats": unary("GetStats", pb.GetStatsRequest, servicer.GetStats),
        "Checkpoint": unary("Checkpoint", pb.CheckpointRequest, servicer.Checkpoint),
        "Replicate": unary("Replicate", pb.ReplicateRequest, servicer.Replicate),
        # Frames are encoded by common.wire.codec, one copy per chunk.
        "Exchange": grpc.stream_stream_rpc_method_handler(servicer.Exchange),
    })


@dataclass
class RunningServer:
    server: grpc.aio.Server
    handlers: ParameterServerHandlers
    health: health.aio.HealthServicer  # type: ignore[name-defined]
    port: int
    budget: InflightBudget
    executor: ThreadPoolExecutor
    trimmer: HeapTrimmer
    fast: FastPathServer | None = None  # the shm and tcp transports (ps_server.transport.fastpath)
    tables: TableHandlers | None = None  # sparse embedding tables (ps_server.handlers.tables)
    hang_watch: asyncio.Task[None] | None = None  # report_hangs
    refusals: AuthRefusals | None = None  # calls refused UNAUTHENTICATED/PERMISSION_DENIED (security on)
    tarpit: WasteTarpit | None = None  # peers whose wasted requests are held and refused unread

    @property
    def servicer(self) -> ParameterServerHandlers:
        """The old name of `handlers`, until __main__ uses the new one."""
        return self.handlers

    async def stop(self, grace_s: float = 5.0) -> None:
        if self.hang_watch is not None:
            self.hang_watch.cancel()
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.fast is not None:  # after gRPC: a worker whose fast path closes falls back to a server gone
            await self.fast.aclose()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.trimmer.close()


async def start(settings: ServerSettings, bind: str = "127.0.0.1:0",
                max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                security: SecurityConfig | None = None) -> RunningServer:
    """`security`: TLS files and tokens (pshard.common.security.credentials); default: plain and open."""
    security = security or SecurityConfig()
    refusals = AuthRefusals()
    handlers = ParameterServerHandlers(settings, asyncio.get_running_loop())
    budget = InflightBudget(settings.max_inflight_bytes)
    # Two threads: the machine's cores; replies waiting for them wait as coroutines, not threads.
    executor = ThreadPoolExecutor(max_workers=_ENCODE_THREADS, thread_name_prefix="ps-encode")
    trimmer = HeapTrimmer()
    tarpit = WasteTarpit(settings.waste_limit_bytes) if settings.waste_limit_bytes > 0 else None
    # The tarpit first: a flood refused by any interceptor or handler then costs no reads.
    server = grpc.aio.server(options=server_options(max_message_bytes),
                             interceptors=[*([Tarpit(tarpit, trimmer.unread_refused)] if tarpit else []),
                                           *security.server_interceptors(refusals), DecodeErrors()])
    ps_servicer = ParameterServerServicer(
        handlers, settings.chunk_bytes, budget, executor, settings.pull_timeout_s, trimmer)
    server.add_generic_rpc_handlers([_rpc_handlers(ps_servicer)])
    # Sparse tables share the port, the in-flight budget and the request wrapping of the dense service.
    tables = TableHandlers(settings)
    tables.fence = handlers  # table writes are under the server's lease, as dense ones
    handlers.after_checkpoint = tables.checkpoint
    server.add_generic_rpc_handlers([table_rpc_handlers(SparseTablesServicer(tables), ps_servicer.unary)])
    server.add_generic_rpc_handlers([global_rpc_handlers(GlobalCheckpointServicer(GlobalCheckpoints(
        handlers, tables, settings.checkpoint_pause_dir, settings.global_checkpoint_dir,
        settings.checkpoint_write_mb_s)), ps_servicer.unary,
        SERVICE_NAME)])
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = security.add_port(server, bind)
    if port == 0:
        raise OSError(f"could not bind {bind}")
    fast = FastPathServer(handlers, asyncio.get_running_loop(), transport=settings.transport,
                          shm_dir=settings.shm_dir, host=bind.rsplit(":", 1)[0].strip("[]") or "0.0.0.0",
                          ssl_context=security.server_ssl_context() if security.tls else None,
                          refusals=refusals, port=settings.fast_port)
    handlers.transport_report = fast.transports
    fast.tarpit = tarpit  # the same peers' budget: a fast-path session is a peer of its own
    fast.tables = tables  # table requests ride the same sessions (ps_server.transport.table_fast)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "OpenTransport": grpc.unary_unary_rpc_method_handler(
            OpenTransportMethod(fast).OpenTransport, pb.OpenTransportRequest.FromString,
            pb.OpenTransportResponse.SerializeToString)})])
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("parameter server listening on port %d", port)
    log.info("security: %s", security.describe())
    running = RunningServer(server, handlers, health_servicer, port, budget, executor, trimmer, fast,
                           tables=tables, refusals=refusals, tarpit=tarpit)
    if settings.hang_report_s > 0:
        running.hang_watch = asyncio.create_task(report_hangs(handlers, settings.hang_report_s))
    return running


async def report_hangs(handlers: ParameterServerHandlers, hang_report_s: float) -> None:
    """Log each sync clock stalled past `hang_report_s`: which slice, which clock, whose gradient is missing.

    Checked a few times per threshold, and logged again only when the stall changes or another
    threshold has passed, so a hang reads as a handful of lines naming the stragglers.
    """
    logged: dict[tuple[str, int, tuple[str, ...]], float] = {}
    while True:
        await asyncio.sleep(min(5.0, max(0.1, hang_report_s / 4)))
        hangs = handlers.stats().hangs
        by_stall: dict[tuple[int, tuple[str, ...]], list[str]] = {}
        for h in hangs:
            by_stall.setdefault((h.clock, h.waiting_for), []).append(h.key)
        now = time.monotonic()
        for (clock, waiting), keys in by_stall.items():
            stalled = max(h.stalled_s for h in hangs if h.clock == clock and h.waiting_for == waiting)
            ident = (keys[0], clock, waiting)
            if now - logged.get(ident, -float("inf")) < hang_report_s:
                continue
            logged[ident] = now
            log.warning("sync clock %d has waited %.1fs for a gradient from %s (slices %s%s); "
                        "the other workers are blocked until it comes", clock, stalled,
                        ", ".join(waiting) or "nobody in the quorum (quorum unknown)",
                        ", ".join(keys[:5]), f" and {len(keys) - 5} more" if len(keys) > 5 else "")
        current = {(h.key, h.clock, h.waiting_for) for h in hangs}
        for ident in [i for i in logged if i not in current]:
            del logged[ident]


# A parameter server on its own event loop in a daemon thread.
ServerThread: TypeAlias = _ServerThread[RunningServer]


def start_server_thread(settings: ServerSettings, bind: str = "127.0.0.1:0",
                        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                        security: SecurityConfig | None = None) -> ServerThread:
    return start_in_thread(lambda: start(settings, bind, max_message_bytes, security),
                           name=f"ps-server-{bind}")


async def checkpoint_every(running: RunningServer, interval_s: float) -> None:
    """Periodic shard checkpoints, so a killed server loses at most `interval_s` of training. A
    checkpoint that fails for a reason the error names (a full or read-only disk) is one line each
    time; anything else keeps its traceback (a bug)."""
    while True:
        await asyncio.sleep(interval_s)
        if running.handlers.has_store:
            try:
                path, version = await running.handlers.checkpoint(0, interval_s)
                log.info("checkpoint at version %d: %s", version, path)
            except PSError as err:
                log.error("periodic checkpoint failed: %s", err)
            except Exception:
                log.exception("periodic checkpoint failed")
        if running.tables is not None and not running.handlers.has_store:  # else the shard's wrote them
            try:
                await running.tables.checkpoint()
            except PSError as err:
                log.error("periodic checkpoint of the sparse tables failed: %s", err)
            except Exception:
                log.exception("periodic checkpoint of the sparse tables failed")
