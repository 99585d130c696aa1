"""pshard_auth_refused_total on the /metrics of a token-secured parameter server and scheduler (on
127.0.0.1:0): calls refused for a missing credential or the caller's role show up by code and method."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from pshard.common.metrics import MetricsServer, serve_scheduler_metrics, serve_server_metrics
from pshard.common.security.credentials import SecurityConfig
from pshard.ps_server.service import start_server_thread
from pshard.ps_server.settings import ServerSettings
from pshard.scheduler.service import start_scheduler_thread

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import parameter_server_pb2_grpc as pb_grpc
from pshard.api.v1 import scheduler_pb2 as spb
from pshard.api.v1 import scheduler_pb2_grpc as spb_grpc

from .conftest import WAIT_S, Wire
from .test_metrics_endpoints import scrape, value

PS = "/pshard.api.v1.ParameterServerService/"


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens"
    path.write_text("worker worker-secret-0123456789\nscheduler scheduler-secret-0123456789\n")
    return path


@pytest.fixture
def metrics() -> Iterator[list[MetricsServer]]:
    served: list[MetricsServer] = []
    yield served
    for server in served:
        server.close()


def refused(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        call()  # type: ignore[operator]
    return caught.value.code()  # type: ignore[no-any-return, attr-defined]


def test_a_servers_refused_calls_are_counted_by_code_and_method(
        token_file: Path, metrics: list[MetricsServer]) -> None:
    server = start_server_thread(ServerSettings(), security=SecurityConfig(token_file=token_file, role="ps"))
    try:
        running = server.running
        metrics.append(serve_server_metrics(running.handlers, server.loop, "127.0.0.1:0", 0,
                                            tables=running.tables, refusals=running.refusals))
        port = metrics[0].port
        assert value(scrape(port), "pshard_auth_refused_total", code="UNAUTHENTICATED",
                     method=PS + "Push") is None

        grad = Wire.push_request("worker-0", 0, {"w": np.ones(4, np.float32)})
        stranger = pb_grpc.ParameterServerServiceStub(grpc.insecure_channel(server.address))
        for _ in range(2):
            assert refused(lambda: stranger.Push(grad, timeout=WAIT_S)) == grpc.StatusCode.UNAUTHENTICATED
        worker = pb_grpc.ParameterServerServiceStub(
            SecurityConfig(token_file=token_file, role="worker").channel(server.address))
        assert refused(lambda: worker.Checkpoint(pb.CheckpointRequest(), timeout=WAIT_S)) == \
            grpc.StatusCode.PERMISSION_DENIED

        samples = scrape(port)
        assert value(samples, "pshard_auth_refused_total", code="UNAUTHENTICATED", method=PS + "Push") == 2
        assert value(samples, "pshard_auth_refused_total", code="PERMISSION_DENIED",
                     method=PS + "Checkpoint") == 1
        assert sum(v for (name, _), v in samples.items() if name == "pshard_auth_refused_total") == 3
    finally:
        server.stop(grace_s=0.2)


def test_a_schedulers_refused_calls_are_counted(token_file: Path, metrics: list[MetricsServer]) -> None:
    handle = start_scheduler_thread(security=SecurityConfig(token_file=token_file, role="scheduler"))
    try:
        running = handle.running
        view = running.servicer.membership.view
        metrics.append(serve_scheduler_metrics(view, handle.loop, "127.0.0.1:0", 0, running.refusals))
        stranger = spb_grpc.SchedulerServiceStub(grpc.insecure_channel(handle.address))
        request = spb.RegisterRequest(role=spb.ROLE_WORKER, address="", node_id="worker-0")
        assert refused(lambda: stranger.Register(request, timeout=WAIT_S)) == grpc.StatusCode.UNAUTHENTICATED

        samples = scrape(metrics[0].port)
        counted = {dict(labels)["method"]: v for (name, labels), v in samples.items()
                   if name == "pshard_auth_refused_total"}
        assert counted == {"/pshard.api.v1.SchedulerService/Register": 1}
        assert value(samples, "pshard_scheduler_generation") is not None  # the scheduler's own, still there
    finally:
        handle.stop(grace_s=0.2)
