"""The coordinator's scheduling state, transport-free: calls waiting, calls running where, the first error.

Pure core: no grpc, no threads of its own, the clock injected. The dispatch threads (two per serving worker,
pshard.coordinator.dispatch: one for the call it runs, one for the call it runs next) `take` a call, run it,
and report `finish`, `fail` or `lost`; the user's thread calls `put`, `join` and `done`. A call lost with its
worker goes back to the front of the queue under the same schedule id, so whichever run's pushes reach a
server first count and the others' are dropped there (ps_server.core.store: the schedule record). The first
run that finishes gives the call its result; any later one is ignored.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pshard.common.errors import CancelledCallError, NoWorkersError, PSError, PullTimeoutError

from pshard.api.v1 import coordinator_pb2 as pb


class RemoteValue:
    """The future result of a scheduled call (TensorFlow's RemoteValue): `fetch()` waits for it."""

    def __init__(self, schedule_id: int, function: str, resume_at: int = 0) -> None:
        self.schedule_id = schedule_id
        self.function = function
        self._ready = threading.Event()
        self._result: Any = None
        self._error: PSError | None = None
        self.worker = ""  # the worker whose run gave the result
        # How far the call's work got (WorkerContext.resume): from `resume_at`, as that run reported it.
        self.progress = resume_at

    def fetch(self, timeout_s: float | None = None) -> Any:
        """The call's result once it has one; raises its error (the function's, or why it never ran).
        PullTimeoutError naming the call after `timeout_s` (None: wait as long as it takes)."""
        if not self._ready.wait(timeout_s):
            raise PullTimeoutError(f"fetch: schedule {self.schedule_id} ({self.function}) has no result "
                                   f"after {timeout_s:g} s", schedule_id=self.schedule_id)
        if self._error is not None:
            raise self._error
        return self._result

    def done(self) -> bool:
        return self._ready.is_set()

    def succeeded(self) -> bool:
        """It has a result (no error)."""
        return self._ready.is_set() and self._error is None

    def _settle(self, result: Any, error: PSError | None, worker: str, progress: int | None = None) -> None:
        self._result, self._error, self.worker = result, error, worker
        if progress is not None:
            self.progress = max(self.progress, progress)
        self._ready.set()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"RemoteValue(schedule_id={self.schedule_id}, function={self.function!r}, {state})"


@dataclass
class Closure:
    """One scheduled call: what to run (a RunRequest without floor and job) and where its result goes."""

    request: pb.RunRequest
    remote: RemoteValue
    runs: list[str] = field(default_factory=list)  # the workers it was dispatched to, in order

    @property
    def schedule_id(self) -> int:
        return self.request.schedule_id


class ClosureQueue:
    """Calls waiting and running. `no_worker_s`: how long calls may wait with no worker left before `join`
    gives up (the coordinator passes one heartbeat timeout: a dead worker is declared after another);
    `startup_s`: how long they wait for the first worker to come (workers start slower than a script)."""

    def __init__(self, no_worker_s: float, clock: Callable[[], float] = time.monotonic,
                 startup_s: float = 60.0, first_id: int = 1) -> None:
        self._cond = threading.Condition()
        self._clock = clock
        self._no_worker_s = no_worker_s
        self._startup_s = startup_s
        self._pending: deque[Closure] = deque()
        self._running: dict[int, tuple[Closure, str]] = {}
        # The floor in O(log n): a heap of the unfinished ids, those that ended dropped from its top lazily.
        # A scan of the waiting calls cost each dispatch 2.5 ms with 10,000 of them (under the lock).
        self._unfinished: list[int] = []
        self._ended: set[int] = set()
        self._error: PSError | None = None
        self._next_id = first_id
        self._workers: set[str] = set()
        self._no_worker_since: float | None = clock()
        self._seen_workers: set[str] = set()
        self._idle = 0  # dispatchers waiting in take() for a call of their own (not ahead)
        self.redispatched = 0

    # ---- the user's side ----

    def next_id(self) -> int:
        with self._cond:
            sid = self._next_id
            self._next_id += 1
            return sid

    def number_above(self, schedule_id: int) -> None:
        """Number the calls to come above `schedule_id` (a restored checkpoint's last call: the servers'
        records of its calls would drop the pushes of a call of ours under one of their ids)."""
        with self._cond:
            self._next_id = max(self._next_id, schedule_id + 1)

    def put(self, closure: Closure) -> None:
        """Queue a call; raises the first unhandled error of an earlier call instead (TensorFlow's rule)."""
        with self._cond:
            if self._error is not None:
                raise self._error
            self._pending.append(closure)
            heapq.heappush(self._unfinished, closure.schedule_id)
            self._cond.notify_all()

    def done(self) -> bool:
        """Every call has finished (or failed); raises an unhandled error as `join` does."""
        with self._cond:
            self._raise_error()
            return not self._pending and not self._running

    def join(self, timeout_s: float | None = None) -> None:
        """Wait until every call finished. Raises the first error once the calls running beside it have
        ended too (and forgets it: handled, with theirs), NoWorkersError when calls wait with no worker for
        `no_worker_s`, PullTimeoutError after `timeout_s`."""
        deadline = None if timeout_s is None else self._clock() + timeout_s
        with self._cond:
            while True:
                if not self._running:
                    self._raise_error()
                if not self._pending and not self._running:
                    return
                now = self._clock()
                limit = self._no_worker_s if self._seen_workers else self._startup_s
                if self._no_worker_since is not None and now - self._no_worker_since >= limit:
                    raise self._no_workers(now)
                if deadline is not None and now >= deadline:
                    raise PullTimeoutError(f"join: {self._unfinished_text()} after {timeout_s:g} s")
                waits = [0.5]
                if self._no_worker_since is not None:
                    waits.append(self._no_worker_since + limit - now)
                if deadline is not None:
                    waits.append(deadline - now)
                self._cond.wait(max(0.0, min(waits)))

    # ---- the dispatchers' side ----

    def take(self, worker: str, timeout_s: float, ahead: bool = False) -> Closure | None:
        """The next call for `worker` (now running there), or None after `timeout_s` without one. `ahead`:
        for a worker busy with a call already (it runs it next, without waiting for a dispatch round trip),
        so only while no dispatcher waits for a call: an idle worker takes it first."""
        with self._cond:
            if ahead:
                if not self._pending or self._idle:
                    self._cond.wait(timeout_s)
                if not self._pending or self._idle:
                    return None
            else:
                self._idle += 1
                try:
                    if not self._pending:
                        self._cond.wait(timeout_s)
                finally:
                    self._idle -= 1
                if not self._pending:
                    return None
            closure = self._pending.popleft()
            if self._pending and not self._idle and not ahead:
                self._cond.notify_all()  # calls left and no idle worker: one can go ahead
            closure.runs.append(worker)
            if len(closure.runs) > 1:
                self.redispatched += 1
            self._running[closure.schedule_id] = (closure, worker)
            return closure

    @property
    def idle(self) -> int:
        """Dispatchers waiting for a call of their own (their worker runs none)."""
        with self._cond:
            return self._idle

    def floor(self) -> int:
        """The smallest schedule id not yet finished (every id below it has): servers drop its pushes."""
        with self._cond:
            while self._unfinished and self._unfinished[0] in self._ended:
                self._ended.discard(heapq.heappop(self._unfinished))
            return self._unfinished[0] if self._unfinished else self._next_id

    def finish(self, schedule_id: int, worker: str, result: Any, progress: int | None = None) -> bool:
        """A run of `schedule_id` on `worker` returned `result`; False if the call had a result already.
        `progress`: how far the run's work got (RunResponse.progress)."""
        return self._settle(schedule_id, worker, result, None, progress)

    def fail(self, schedule_id: int, worker: str, error: PSError, progress: int | None = None) -> bool:
        """A run raised: the call fails with `error`, which is kept for join() and schedule(), and the calls
        still waiting are cancelled (TensorFlow's rule: after an error some calls may not run)."""
        if not self._settle(schedule_id, worker, None, error, progress):
            return False
        with self._cond:
            if self._error is None:
                self._error = error
            cancelled, self._pending = list(self._pending), deque()
            self._ended.update(c.schedule_id for c in cancelled)
            self._cond.notify_all()
        for closure in cancelled:
            closure.remote._settle(None, CancelledCallError(
                f"schedule {closure.schedule_id} ({closure.remote.function}) was cancelled: schedule "
                f"{schedule_id} failed first ({error})", schedule_id=closure.schedule_id), "")
        return True

    def lost(self, schedule_id: int, worker: str) -> None:
        """`worker` is gone with the call: back to the front of the queue, same schedule id."""
        with self._cond:
            running = self._running.get(schedule_id)
            if running is None or running[1] != worker:
                return  # finished meanwhile, or already re-dispatched
            del self._running[schedule_id]
            self._pending.appendleft(running[0])
            self._cond.notify_all()

    def set_workers(self, workers: set[str]) -> None:
        """The workers able to take calls now (the dispatchers' view)."""
        with self._cond:
            self._seen_workers |= workers
            self._workers = set(workers)
            if workers:
                self._no_worker_since = None
            elif self._no_worker_since is None:
                self._no_worker_since = self._clock()
            self._cond.notify_all()

    # ---- internals ----

    def _settle(self, schedule_id: int, worker: str, result: Any, error: PSError | None,
                progress: int | None = None) -> bool:
        with self._cond:
            running = self._running.pop(schedule_id, None)
            closure = running[0] if running else self._take_pending(schedule_id)
            if closure is None:
                return False
            self._ended.add(schedule_id)
            self._cond.notify_all()
        closure.remote._settle(result, error, worker, progress)
        return True

    def _take_pending(self, schedule_id: int) -> Closure | None:
        for closure in self._pending:
            if closure.schedule_id == schedule_id:
                self._pending.remove(closure)
                return closure
        return None

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _no_workers(self, now: float) -> NoWorkersError:
        assert self._no_worker_since is not None
        seen = ", ".join(sorted(self._seen_workers)) or "none ever registered"
        return NoWorkersError(
            f"join: {self._unfinished_text()}, and no serving worker for {now - self._no_worker_since:.1f} s "
            f"(workers seen: {seen}); start workers with 'pshard worker --serve'",
            unfinished=len(self._pending) + len(self._running))

    def _unfinished_text(self) -> str:
        ids = sorted([c.schedule_id for c in self._pending] + list(self._running))
        shown = ", ".join(map(str, ids[:8])) + (", ..." if len(ids) > 8 else "")
        return f"{len(ids)} scheduled call(s) unfinished (schedule ids {shown})"
