"""A serving worker's thread hops per call (pshard.worker.serve), once it is ready: none on a coordinator's
Serve stream (each call runs on the service loop itself: a hop to a thread and back cost more CPU than
gRPC's own work), one on a unary Run (the function runs on a thread, beside other calls that may come in
either order). The readiness check, an Event set once at start-up, costs no hop of its own (it took one per
call: a thread-pool round trip on every scheduled step's critical path)."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np
import pytest
from pshard.worker import serve

from pshard.api.v1 import coordinator_pb2 as pb
from pshard.api.v1 import coordinator_pb2_grpc as pb_grpc
from tests.service import coordinator_functions as f
from tests.service.coordinator_cluster import WAIT_S, cluster


def test_a_ready_worker_runs_a_streams_calls_with_no_hop_and_a_unary_run_with_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hops: Counter[str] = Counter()
    to_thread = asyncio.to_thread

    async def counted(func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        hops[getattr(func, "__qualname__", "")] += 1
        return await to_thread(func, *args, **kwargs)

    monkeypatch.setattr(serve.asyncio, "to_thread", counted)
    with cluster(workers=1) as c:
        c.start_worker(0)
        with c.coordinator() as coordinator:
            coordinator.create_variable("v", np.zeros(1, np.float32))
            coordinator.schedule(f.noop).fetch()  # the worker is ready from here on
            hops.clear()
            for _ in range(5):
                coordinator.schedule(f.noop).fetch()
            streamed = (hops["CallRunner.run"], hops["Event.wait"])

            with grpc.insecure_channel(c.workers[0]) as channel:
                run = pb_grpc.WorkerServiceStub(channel).Run
                for sid in range(1 << 40, (1 << 40) + 3):  # ids no coordinator of this test gives out
                    request = pb.RunRequest(schedule_id=sid, function=f"{f.__name__}:worker_id")
                    answer = run(request, timeout=WAIT_S)
                    assert (answer.schedule_id, answer.result.string_value) == (sid, "worker-0")
    assert streamed == (0, 0)
    assert (hops["CallRunner.run"], hops["Event.wait"]) == (3, 0)
