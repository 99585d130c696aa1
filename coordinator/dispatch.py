"""Dispatch threads per serving worker: take a call, run it there over gRPC, report how it ended.

Two per worker (`DEPTH`): the worker runs calls one at a time, and a second call sent while the first
runs waits there and starts as soon as the first returns, instead of a dispatch round trip later (the
reply to the coordinator, its next Run): on a loaded machine that round trip is a process wakeup on
each side, a third of a training step's gap to a worker-driven loop. The second thread takes a call only
while no worker waits for one (ClosureQueue.take, `ahead`), so a queue shorter than the workers is
spread over them as before. A worker lost with both calls loses both: each goes back to the queue. The
two calls may reach the worker in either order, so each names the call taken for that worker before it
(`RunRequest.after`) and the worker runs it only after that one (pshard.worker.serve): its calls run in
the order they were taken, as with one call in flight (a per-worker iterator's items in order).

A worker that breaks the call (UNAVAILABLE: SIGKILLed, restarted) or that the scheduler declares dead
while the call runs (cut off) loses it: the call goes back to the front of the queue under its schedule
id (ClosureQueue.lost) and another worker runs it. The servers count each of its pushes once whichever
run sends it first (the schedule record). A worker that is unreachable but still live for the scheduler
is retried once its channel is ready again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import grpc
from pshard.common.errors import ScheduledFunctionError
from pshard.common.security.credentials import SecurityConfig
from pshard.coordinator import values
from pshard.coordinator.closures import Closure, ClosureQueue

from pshard.api.v1 import coordinator_pb2 as pb
from pshard.api.v1 import coordinator_pb2_grpc as pb_grpc
from pshard.api.v1 import parameter_server_pb2 as ps_pb

log = logging.getLogger("pshard.coordinator")
_TAKE_S = 0.5  # how long a dispatcher waits for a call before it looks at its worker's state again
DEPTH = 2  # calls in flight per worker: the one it runs and the next
# A broken call's gRPC codes that mean the worker, not the call, is the problem: run it elsewhere.
_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class Dispatcher:
    """Runs calls of `queue` on the worker at `address` until `stop()` or until the worker is gone."""

    def __init__(self, node_id: str, address: str, queue: ClosureQueue, job: ps_pb.JobConfig,
                 security: SecurityConfig, on_change: Callable[[], None]) -> None:
        self.node_id = node_id
        self.address = address
        self._queue = queue
        self._job = job
        self._on_change = on_change
        self.gone = threading.Event()  # the scheduler no longer has this incarnation live
        self.reachable = True
        self._channel = security.channel(address)
        self._run = pb_grpc.WorkerServiceStub(self._channel).Run
        # Slot 0 runs the worker's call; the others send the next ones ahead (`take(..., ahead=True)`).
        self.threads = [threading.Thread(target=self._loop, args=(slot > 0,), daemon=True,
                                         name=f"dispatch-{node_id}-{slot}") for slot in range(DEPTH)]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        self.gone.set()
        # Breaks a call in flight (CANCELLED): it is lost and runs again elsewhere. The call blocks rather
        # than polling a future: each future of a channel with no other call started a thread of its own.
        self._channel.close()

    def _loop(self, ahead: bool) -> None:
        try:
            while not self.gone.is_set():
                if not self.reachable and not self._await_reachable():
                    continue
                closure = self._queue.take(self.node_id, _TAKE_S, ahead)
                if closure is not None:
                    self._dispatch(closure)
        finally:
            self.reachable = False
            self._channel.close()
            self._on_change()

    def _dispatch(self, closure: Closure) -> None:
        request = pb.RunRequest()
        request.CopyFrom(closure.request)
        request.schedule_floor = self._queue.floor()
        request.after = closure.after
        request.job.CopyFrom(self._job)
        try:
            response = self._run(request)
        except ValueError:  # stop() closed the channel before the call started
            self._queue.lost(closure.schedule_id, self.node_id)
            return
        except grpc.RpcError as err:
            code = err.code()  # type: ignore[attr-defined]
            if self.gone.is_set():
                # Cut off: the scheduler declared it dead (stop() broke the call); its run may still push,
                # counted once.
                log.warning("schedule %d: %s was declared dead while running it; running it again elsewhere",
                            closure.schedule_id, self.node_id)
                self._queue.lost(closure.schedule_id, self.node_id)
                return
            if code in _LOST:
                log.warning("schedule %d: %s broke the call (%s); running it again elsewhere",
                            closure.schedule_id, self.node_id, code.name)
                self._queue.lost(closure.schedule_id, self.node_id)
                self.reachable = False
                self._on_change()
                return
            self._queue.fail(closure.schedule_id, self.node_id, ScheduledFunctionError(
                f"schedule {closure.schedule_id} ({closure.remote.function}) on {self.node_id}: the call "
                f"failed with {code.name}: {err.details()}",  # type: ignore[attr-defined]
                function=closure.remote.function, schedule_id=closure.schedule_id, worker=self.node_id))
            return
        self._settle(closure, response)

    def _settle(self, closure: Closure, response: pb.RunResponse) -> None:
        if response.WhichOneof("outcome") == "error":
            e = response.error
            self._queue.fail(closure.schedule_id, self.node_id, ScheduledFunctionError(
                f"schedule {closure.schedule_id} ({closure.remote.function}) raised on {self.node_id}: "
                f"{e.type}: {e.message}\n--- the worker's traceback ---\n{e.traceback}",
                function=closure.remote.function, schedule_id=closure.schedule_id, worker=self.node_id,
                error_type=e.type), response.progress)
            return
        self._queue.finish(closure.schedule_id, self.node_id, values.decode(response.result, None, "result"),
                           response.progress)

    def _await_reachable(self) -> bool:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=_TAKE_S)
        except (grpc.FutureTimeoutError, ValueError):  # not ready yet, or stop() closed the channel
            return False
        self.reachable = True
        self._on_change()
        return True
