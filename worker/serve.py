"""`pshard worker --serve`: a worker that runs the functions a ClusterCoordinator schedules on it.

    register (its TF_CONFIG address is where it serves) -> serve WorkerService -> the coordinator's layout
    -> a PSClient on it -> run scheduled calls one at a time (pshard.coordinator.runner) -> exit when the
    coordinator (the chief task) has left or was declared dead

The worker keeps its per-worker datasets between calls. It never trains on its own: what it does is what
the coordinator's functions do. See docs/guide/coordinator.md.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import TypeVar

import grpc
import grpc.aio
from pshard.common.cluster.view import ClusterView, NodeState
from pshard.common.errors import ClusterConfigError
from pshard.common.rpc.bind import default_bind
from pshard.common.rpc.interceptors import DecodeErrors
from pshard.common.rpc.options import server_options
from pshard.common.rpc.serving import ServerThread, start_in_thread
from pshard.common.security.credentials import SecurityConfig
from pshard.coordinator.runner import CallRunner
from pshard.worker.config import TrainConfig, stage
from pshard.worker.session import ClusterSession

from pshard.api.v1 import coordinator_pb2 as pb
from pshard.api.v1 import coordinator_pb2_grpc as pb_grpc

log = logging.getLogger("pshard.worker")
# How often the serving loop looks at the coordinator's state between view changes (the view callback
# wakes it at once; this bounds a missed wake-up).
_WATCH_S = 1.0
# How long a call waits for the call the coordinator sent before it to arrive (they are sent together).
ORDER_WAIT_S = 5.0
T = TypeVar("T")


class InOrder:
    """Runs calls one at a time, each after the call it names (`RunRequest.after`), whichever arrived first.

    The coordinator keeps two calls in flight per worker (pshard.coordinator.dispatch), and two concurrent
    RPCs reach the handler in either order. Everything here runs on the server's event loop: a call marks
    itself queued and takes its place in the asyncio lock's FIFO with no await in between, so a call that
    waited for it to be queued lines up behind it. A call whose predecessor never comes (its RPC broke on
    the way) waits `wait_s` and then runs: order is lost only where a call is.
    """

    KEEP = 64  # queued ids remembered for a follower that arrives after them

    def __init__(self, wait_s: float) -> None:
        self._wait_s = wait_s
        self._lock = asyncio.Lock()  # FIFO: waiters get it in the order they asked
        self._queued: OrderedDict[int, asyncio.Event] = OrderedDict()

    def _event(self, schedule_id: int) -> asyncio.Event:
        event = self._queued.get(schedule_id)
        if event is None:
            event = self._queued[schedule_id] = asyncio.Event()
            while len(self._queued) > self.KEEP:
                self._queued.popitem(last=False)
        return event

    async def run(self, request: pb.RunRequest, fn: Callable[[pb.RunRequest], T]) -> T:
        if request.after:
            try:
                await asyncio.wait_for(self._event(request.after).wait(), self._wait_s)
            except asyncio.TimeoutError:  # not the builtin before Python 3.11
                log.warning("schedule %d: the call before it on this worker (%d) did not come within %g s; "
                            "running it now", request.schedule_id, request.after, self._wait_s)
        self._event(request.schedule_id).set()
        async with self._lock:
            return await asyncio.to_thread(fn, request)


def off_loop(fn: Callable[[], T]) -> T:
    """fn() on the loop's own thread as on a thread without one: a scheduled function that runs a loop of
    its own (asyncio.run) finds none running, as it did when calls ran on a thread. asyncio's underscored
    pair is the only way: there is no public call that hides the running loop from the code it runs (the
    public get_running_loop only reads it), and asyncio.run refuses to start beside a running loop."""
    loop = asyncio._get_running_loop()
    asyncio._set_running_loop(None)
    try:
        return fn()
    finally:
        asyncio._set_running_loop(loop)


class _Servicer(pb_grpc.WorkerServiceServicer):
    """A five-line delegate: the runner is set once the worker holds a PSClient."""

    def __init__(self, ready_timeout_s: float) -> None:
        self.runner: CallRunner | None = None
        self.ready = threading.Event()
        self._ready_timeout_s = ready_timeout_s
        self._in_order = InOrder(ORDER_WAIT_S)

    async def _runner(self, context: grpc.aio.ServicerContext) -> CallRunner:
        # Ready is the rule once serving: waiting on a thread only before then spares each call a hop.
        ready = self.ready.is_set() or await asyncio.to_thread(self.ready.wait, self._ready_timeout_s)
        if not ready or self.runner is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker: not connected to the servers yet")
        assert self.runner is not None
        return self.runner

    async def Run(self, request: pb.RunRequest, context: grpc.aio.ServicerContext) -> pb.RunResponse:
        runner = await self._runner(context)
        return await self._in_order.run(request, runner.run)

    async def Serve(self, requests: AsyncIterator[pb.ServeRequest],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ServeResponse]:
        """The coordinator's calls in the order sent, one at a time, a message's calls answered together once
        they all ran. They run on this loop itself, not on a thread: the loop serves only the coordinator,
        whose calls run one at a time anyway (the next waits in gRPC's buffer meanwhile), and a hop to a
        thread and back cost a call more CPU than gRPC's own work (docs/architecture.md, 15 Coordinator)."""
        runner = await self._runner(context)
        async for request in requests:
            response = pb.ServeResponse()
            off_loop(partial(runner.run, request.call, response.answer))  # filled in place: no copy
            for call in request.more:  # a batch: answered together, one message (pshard.coordinator.dispatch)
                off_loop(partial(runner.run, call, response.more.add()))
            yield response


@dataclass
class _Running:
    server: grpc.aio.Server
    port: int

    async def stop(self, grace_s: float) -> None:
        await self.server.stop(grace_s)


def start_worker_service(bind: str, servicer: _Servicer, security: SecurityConfig) -> ServerThread[_Running]:
    async def start() -> _Running:
        server = grpc.aio.server(options=server_options(),
                                 interceptors=[*security.server_interceptors(), DecodeErrors()])
        pb_grpc.add_WorkerServiceServicer_to_server(servicer, server)  # type: ignore[no-untyped-call]
        try:
            port = security.add_port(server, bind)
        except RuntimeError as e:
            raise OSError(f"worker: cannot serve on {bind}: {e}") from None
        await server.start()
        return _Running(server, port)

    return start_in_thread(start, name=f"worker-service-{bind}", grace_s=1.0)


class CoordinatorWatch:
    """Set once the coordinator (the chief task) has registered and then left or been declared dead; a
    worker that starts after its coordinator is gone (a slow start) learns it from its first view."""

    def __init__(self) -> None:
        self.gone = threading.Event()
        self.how = ""

    def offer(self, view: ClusterView) -> None:
        chiefs = [n for n in view.nodes if n.role == "chief"]
        if chiefs and not any(n.state is NodeState.LIVE for n in chiefs):
            self.how = chiefs[0].state.value
            self.gone.set()


def run_serving(cfg: TrainConfig) -> int:
    """Serve until the coordinator is gone; 0 then (the job's end is the coordinator's to judge)."""
    spec = cfg.spec
    if not spec.chief:
        raise ClusterConfigError("cluster.chief: got none; 'pshard worker --serve' runs the functions of "
                                 "a coordinator, which is the chief task ('pshard launch --coordinator "
                                 "SCRIPT')")
    if spec.task_type != "worker":
        raise ClusterConfigError(f"task.type: got {spec.task_type!r}, --serve is for worker tasks")
    session = ClusterSession(spec, startup_timeout_s=cfg.startup_timeout_s, step_timeout_s=cfg.step_timeout_s,
                             transport=cfg.transport, shm_dir=cfg.shm_dir, security=cfg.security,
                             replicas=cfg.replicas)
    if cfg.threads:  # as a training worker does (pshard.worker.train): the functions run torch here
        import torch

        torch.set_num_threads(cfg.threads)
    servicer = _Servicer(cfg.startup_timeout_s)
    bind = cfg.bind or default_bind(spec.listen_address, spec.own_address)
    with stage("serve", f"serving scheduled functions on {bind}"):
        service = start_worker_service(bind, servicer, cfg.security)
    watch = CoordinatorWatch()
    try:
        sched = session.register()
        sched.add_view_callback(watch.offer)
        if sched.view is not None:
            watch.offer(sched.view)
        client = session.connect(session.await_layout())
        servicer.runner = CallRunner(client, spec.node_id)
        servicer.ready.set()
        log.info("%s serving scheduled functions on %s", spec.node_id, bind)
        while not watch.gone.wait(_WATCH_S):
            if sched.closed:
                break
        log.info("%s: the coordinator %s; %d call(s) run, exiting", spec.node_id, watch.how or "is gone",
                 servicer.runner.calls)
        return 0
    finally:
        session.leave_quietly()
        service.stop(timeout_s=5.0)
        session.close()
