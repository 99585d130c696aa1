"""A serving worker's handler of `Run`, transport-free: one scheduled call at a time, to a RunResponse.

The function is resolved by name (pshard.coordinator.functions), its arguments decoded against this
worker's context (variables, its own iterators), and whatever it raises comes back as a FunctionError
with the worker's traceback: the coordinator re-raises it (ScheduledFunctionError), the worker goes on
serving. The first call declares the coordinator's job on the servers from this worker too (a Declare
is idempotent: the coordinator's values, declared first, stay), so its PSClient knows every variable.
"""

from __future__ import annotations

import logging
import threading
import traceback

import numpy as np
from pshard.client.ps_client import PSClient
from pshard.common.errors import InvalidArgumentError
from pshard.common.wire import codec
from pshard.coordinator import functions, values
from pshard.coordinator.context import WorkerContext

from pshard.api.v1 import coordinator_pb2 as pb

log = logging.getLogger("pshard.worker")


class CallRunner:
    """Runs scheduled calls on `client`, one at a time, keeping the worker's context between them."""

    def __init__(self, client: PSClient, worker_id: str) -> None:
        self._client = client
        self._worker_id = worker_id
        # Not redundant beside InOrder's asyncio FIFO (pshard.worker.serve): a Run cancelled mid-call (the
        # coordinator closed its channel, or its RPC broke) leaves that FIFO at once, while its function goes
        # on in its thread, which cannot be cancelled. The next call (re-dispatched once the worker is
        # reachable again) would then run beside it on the same WorkerContext; this lock makes it wait.
        self._lock = threading.Lock()
        self._ctx: WorkerContext | None = None
        self.calls = 0

    def run(self, request: pb.RunRequest, answer: pb.RunResponse | None = None) -> pb.RunResponse:
        """The call's outcome, in `answer` when given (a Serve stream's response's own, spared a copy)."""
        if answer is None:
            answer = pb.RunResponse()
        with self._lock:
            self.calls += 1
            ctx = self._context(request)
            ctx.progress = request.resume_at  # what it reports if it fails before it runs
            try:
                fn = functions.resolve(request.function, "function")
                with ctx.running(request.schedule_id, request.schedule_floor, request.resume_at):
                    args, kwargs = values.decode_call(request, ctx)
                    result = fn(*args, **kwargs)
                answer.result.CopyFrom(values.encode(result, "result", handles=False))
            except Exception as err:  # the function's own failure: reported, and this worker serves on
                log.warning("schedule %d (%s) raised %s: %s", request.schedule_id, request.function,
                            type(err).__name__, err)
                answer.error.CopyFrom(pb.FunctionError(
                    type=f"{type(err).__module__}.{type(err).__qualname__}", message=str(err),
                    traceback=traceback.format_exc()))
            answer.worker_id, answer.schedule_id = self._worker_id, request.schedule_id
            answer.pushes_applied, answer.pushes_dropped = ctx.pushes_applied, ctx.pushes_dropped
            answer.progress = ctx.progress
            return answer

    def _context(self, request: pb.RunRequest) -> WorkerContext:
        if self._ctx is None:
            if not request.HasField("job"):
                raise InvalidArgumentError(f"schedule {request.schedule_id}: RunRequest.job: got none on "
                                           "this worker's first call, expected the coordinator's job")
            job = request.job
            config = codec.job_from_proto(job)
            layout = self._client.layout
            assert layout is not None  # connected on the scheduler's layout before serving
            self._client.declare({p.key: np.zeros(p.shape, p.dtype) for p in layout.params}, config)
            self._ctx = WorkerContext(self._client, config)
        return self._ctx
