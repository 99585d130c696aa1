"""Dispatch per serving worker: one `Serve` stream to it, the calls taken for it sent down the stream, their
answers read back in order and reported.

The stream carries up to four calls at a time (`DEPTH`), sent two to a message (`BATCH`): the worker runs
calls one at a time, and answers a message's calls in one message once it ran them all. While it runs one
batch the next waits there, so it starts as soon as the first is answered instead of a dispatch round
trip later (the reply, the coordinator's wakeup, its next call): on a loaded machine that round trip is a
process wakeup on each side. Two calls to a message halve the messages each way, and a message costs
both processes more CPU in gRPC than the Python around a call (docs/architecture.md, 15 Coordinator, has
the figures). A call beyond the first of a batch, or beyond the first batch out, is taken only while no
worker waits for one (ClosureQueue.take, `ahead`), so a queue shorter than the workers is spread over
them, and a lone call goes at once, alone. A stream runs its calls in the order they were sent, so a
per-worker iterator's items come in order.

Why a stream and not a unary `Run` per call: each unary call opened an HTTP/2 stream, went through the
server's interceptors and hopped from the worker's event loop to a thread and back; on 2 cores those
microseconds are taken from training (docs/architecture.md, 15 Coordinator, has the figures). The
worker runs a stream's calls on its service loop itself (pshard.worker.serve).

Who does what: gRPC's request thread pulls `_Feed`, which takes the next calls from the queue when a
batch fits under DEPTH; the dispatcher's own thread opens the stream, reads the answers and settles them.

A worker that breaks the stream (UNAVAILABLE: SIGKILLed, restarted) or that the scheduler declares dead
while it runs calls (cut off) loses the calls out on it: each goes back to the front of the queue under
its schedule id (ClosureQueue.lost) and another worker runs it. The servers count each of its pushes once
whichever run sends it first (the schedule record). A worker that is unreachable but still live for the
scheduler gets a new stream once its channel is ready again.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
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
DEPTH = 4  # calls in flight per worker: the batch it runs and the next
BATCH = 2  # calls in one message at most
# A broken stream's gRPC codes that mean the worker, not the call, is the problem: run its calls elsewhere.
_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class _Feed:
    """One stream's requests (gRPC's request thread iterates it) and the calls out on it, oldest first."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self._d = dispatcher
        self._cond = threading.Condition()
        self.out: OrderedDict[int, Closure] = OrderedDict()
        self._open = True
        self._first = True

    def __iter__(self) -> _Feed:
        return self

    def __next__(self) -> pb.ServeRequest:
        d = self._d
        while True:
            with self._cond:
                while self._open and len(self.out) > DEPTH - BATCH:
                    self._cond.wait(_TAKE_S)
                if not self._open or d.gone.is_set():
                    raise StopIteration  # half-closes the stream: the worker answers what it has and ends it
                ahead = bool(self.out)
            closure = d.queue.take(d.node_id, _TAKE_S, ahead)
            if closure is None:
                continue
            batch = [closure]
            while len(batch) < BATCH:  # what is queued already, never a wait for more
                more = d.queue.take(d.node_id, 0.0, ahead=True)
                if more is None:
                    break
                batch.append(more)
            with self._cond:
                if not self._open:  # the stream broke while the calls were being taken
                    d.lose(batch)
                    raise StopIteration
                for taken in batch:
                    self.out[taken.schedule_id] = taken
                first, self._first = self._first, False
            return d.request(batch, first)

    def answered(self, schedule_id: int) -> Closure:
        """The oldest call out, which `schedule_id` answers (a stream answers in order)."""
        with self._cond:
            sid, closure = self.out.popitem(last=False)
            self._cond.notify_all()
        if sid != schedule_id:
            raise RuntimeError(f"{self._d.node_id}: answered schedule {schedule_id}, expected {sid}")
        return closure

    def close(self) -> list[Closure]:
        """No more calls on this stream; the calls still out (lost with it)."""
        with self._cond:
            self._open = False
            out, self.out = list(self.out.values()), OrderedDict()
            self._cond.notify_all()
        return out


class Dispatcher:
    """Runs calls of `queue` on the worker at `address` until `stop()` or until the worker is gone."""

    def __init__(self, node_id: str, address: str, queue: ClosureQueue, job: ps_pb.JobConfig,
                 security: SecurityConfig, on_change: Callable[[], None]) -> None:
        self.node_id = node_id
        self.address = address
        self.queue = queue
        self._job = job
        self._on_change = on_change
        self.gone = threading.Event()  # the scheduler no longer has this incarnation live
        self.reachable = True
        self._channel = security.channel(address)
        self._serve = pb_grpc.WorkerServiceStub(self._channel).Serve
        self.thread = threading.Thread(target=self._loop, daemon=True, name=f"dispatch-{node_id}")

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.gone.set()
        # Breaks the stream (CANCELLED): the calls out on it are lost and run again elsewhere.
        self._channel.close()

    def request(self, batch: list[Closure], first: bool) -> pb.ServeRequest:
        """The calls as sent, in order: the job with a stream's first call only (the worker declares it
        once)."""
        message = pb.ServeRequest()
        floor = self.queue.floor()
        for i, closure in enumerate(batch):
            request = message.more.add() if i else message.call
            request.CopyFrom(closure.request)
            request.schedule_floor = floor
        if first:
            message.call.job.CopyFrom(self._job)
        return message

    def _loop(self) -> None:
        try:
            while not self.gone.is_set():
                if not self.reachable and not self._await_reachable():
                    continue
                self._stream()
        finally:
            self.reachable = False
            self._channel.close()
            self._on_change()

    def _stream(self) -> None:
        feed = _Feed(self)
        try:
            for response in self._serve(feed):
                self._settle(feed.answered(response.answer.schedule_id), response.answer)
                for answer in response.more:
                    self._settle(feed.answered(answer.schedule_id), answer)
        except ValueError:  # stop() closed the channel before the stream started
            pass
        except grpc.RpcError as err:
            self._broken(err, feed.close())
        finally:
            self.lose(feed.close())  # the stream ended with calls out: gone with it

    def lose(self, out: list[Closure]) -> None:
        """Calls out on a stream that ended, oldest first: back to the front of the queue in that order."""
        for closure in reversed(out):
            self.queue.lost(closure.schedule_id, self.node_id)

    def _broken(self, err: grpc.RpcError, out: list[Closure]) -> None:
        code = err.code()  # type: ignore[attr-defined]
        lost = self.gone.is_set() or code in _LOST
        for closure in out:
            if self.gone.is_set():
                # Cut off: the scheduler declared it dead (stop() broke the stream); its run may still push,
                # counted once.
                log.warning("schedule %d: %s was declared dead while running it; running it again elsewhere",
                            closure.schedule_id, self.node_id)
            elif lost:
                log.warning("schedule %d: %s broke the call (%s); running it again elsewhere",
                            closure.schedule_id, self.node_id, code.name)
            else:
                self.queue.fail(closure.schedule_id, self.node_id, ScheduledFunctionError(
                    f"schedule {closure.schedule_id} ({closure.remote.function}) on {self.node_id}: the call "
                    f"failed with {code.name}: {err.details()}",  # type: ignore[attr-defined]
                    function=closure.remote.function, schedule_id=closure.schedule_id, worker=self.node_id))
        if lost:
            self.lose(out)
        if code in _LOST and not self.gone.is_set():
            self.reachable = False
            self._on_change()

    def _settle(self, closure: Closure, response: pb.RunResponse) -> None:
        if response.WhichOneof("outcome") == "error":
            e = response.error
            self.queue.fail(closure.schedule_id, self.node_id, ScheduledFunctionError(
                f"schedule {closure.schedule_id} ({closure.remote.function}) raised on {self.node_id}: "
                f"{e.type}: {e.message}\n--- the worker's traceback ---\n{e.traceback}",
                function=closure.remote.function, schedule_id=closure.schedule_id, worker=self.node_id,
                error_type=e.type), response.progress)
            return
        self.queue.finish(closure.schedule_id, self.node_id, values.decode(response.result, None, "result"),
                          response.progress)

    def _await_reachable(self) -> bool:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=_TAKE_S)
        except (grpc.FutureTimeoutError, ValueError):  # not ready yet, or stop() closed the channel
            return False
        self.reachable = True
        self._on_change()
        return True
