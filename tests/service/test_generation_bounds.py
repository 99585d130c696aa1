"""Issue 23, item 3: the generation space cannot be exhausted, and a fenced worker stops at once.

- worker-1's own certificate registering with `last_generation = 2**62 - 2` is refused
  INVALID_ARGUMENT naming the field and both values, and the scheduler's generation stays where it was
  (it used to jump there, and the next changes went past what the servers accept);
- a worker whose id a newer incarnation took (the same certificate registering again) is fenced out:
  its step in flight ends within a few heartbeats, not at the step deadline (it took 129 s).

A real scheduler and parameter server with mutual TLS, on 127.0.0.1:0.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from pshard.common.cluster.layout import ParamSpec
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.cluster.spec import ClusterSpec
from pshard.common.errors import PSError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.security.ca import CertFiles, ensure
from pshard.common.security.identity import Identity
from pshard.ps_server.service import start_server_thread
from pshard.ps_server.settings import ServerSettings
from pshard.scheduler.service import SchedulerHandle, start_scheduler_thread
from pshard.worker.session import ClusterSession

from pshard.api.v1 import scheduler_pb2 as spb
from pshard.api.v1 import scheduler_pb2_grpc as spb_grpc

from .conftest import WAIT_S

NODES = [Identity("scheduler", "scheduler-0"), Identity("ps", "ps-0"), Identity("worker", "worker-0"),
         Identity("worker", "worker-1")]
STEP_TIMEOUT_S = 60.0  # what a fenced worker's step used to wait out


@pytest.fixture
def pki(tmp_path: Path) -> dict[str, CertFiles]:
    return {i.node_id: files for i, files in ensure(tmp_path, NODES).items()}


@pytest.fixture
def scheduler(pki: dict[str, CertFiles]) -> Iterator[SchedulerHandle]:
    handle = start_scheduler_thread(heartbeat_interval_s=0.2, heartbeat_timeout_s=5.0,
                                    security=pki["scheduler-0"].security("scheduler", "scheduler-0"))
    yield handle
    handle.stop(grace_s=0.2)


def generation(scheduler: SchedulerHandle) -> int:
    return scheduler.call(lambda: scheduler.running.servicer.membership.generation)


def test_a_worker_cannot_push_the_generation_towards_the_servers_limit(
        scheduler: SchedulerHandle, pki: dict[str, CertFiles]) -> None:
    stub = spb_grpc.SchedulerServiceStub(pki["worker-1"].security().channel(scheduler.address))
    stub.Register(spb.RegisterRequest(role=spb.ROLE_WORKER, address="w1:1", node_id="worker-1"),
                  timeout=WAIT_S)
    before = generation(scheduler)

    with pytest.raises(grpc.RpcError) as refused:
        stub.Register(spb.RegisterRequest(role=spb.ROLE_WORKER, address="w1:1", node_id="worker-1",
                                          last_generation=2**62 - 2), timeout=WAIT_S)

    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = refused.value.details() or ""
    assert "last_generation" in details and str(2**62 - 2) in details and str(before) in details
    assert generation(scheduler) == before


def test_a_fenced_worker_ends_its_step_within_heartbeats_not_at_the_deadline(
        scheduler: SchedulerHandle, pki: dict[str, CertFiles]) -> None:
    server = start_server_thread(ServerSettings(static_quorum={"worker-0": 0, "worker-1": 0},
                                                pull_timeout_s=STEP_TIMEOUT_S),
                                 security=pki["ps-0"].security("ps", "ps-0"))
    spec = ClusterSpec("worker", 0, scheduler=(scheduler.address,), ps=(server.address,),
                       worker=("127.0.0.1:1", "127.0.0.1:2"))
    session = ClusterSession(spec, startup_timeout_s=WAIT_S, step_timeout_s=STEP_TIMEOUT_S,
                             security=pki["worker-0"].security("worker", "worker-0"), transport="grpc")
    usurper: SchedulerClient | None = None
    try:
        session.register()
        client = session.connect(session.propose_layout([ParamSpec("w", "float32", (4,))]))
        client.declare({"w": np.zeros(4, np.float32)},
                       JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1)))
        client.push({"w": np.ones(4, np.float32)}, clock=0).result(WAIT_S)
        ended: list[BaseException] = []

        def step() -> None:  # waits for worker-1's push of clock 0, which never comes
            try:
                client.pull(clock=1)
            except BaseException as e:  # the test reads it
                ended.append(e)

        waiting = threading.Thread(target=step, daemon=True)
        waiting.start()
        # The same certificate registers worker-0 again: a newer incarnation fences this one out.
        usurper = SchedulerClient(scheduler.address, "worker", node_id="worker-0",
                                  security=pki["worker-0"].security("worker", "worker-0"))
        usurper.register()
        fenced_at = time.monotonic()

        waiting.join(STEP_TIMEOUT_S)
        took_s = time.monotonic() - fenced_at
        assert not waiting.is_alive()
        assert took_s < 10.0, f"the fenced worker's step ended {took_s:.1f} s after it was fenced"
        assert ended and isinstance(session.fenced, PSError)
    finally:
        if usurper is not None:
            usurper.close()
        session.close()
        server.stop(grace_s=0.2)
