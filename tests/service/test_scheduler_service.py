"""The scheduler over real gRPC: one server on 127.0.0.1 port 0 per test."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pshard.common.cluster.layout import Layout, ParamSpec
from pshard.common.cluster.replicas import fail_over
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.cluster.view import NodeState
from pshard.common.errors import (
    BarrierTimeoutError,
    LayoutConflictError,
    PullTimeoutError,
    StaleGenerationError,
)
from pshard.common.rpc.status import ERROR_TYPE_KEY, raise_from_rpc_error
from pshard.scheduler.service import SchedulerHandle, start_scheduler_thread

from pshard.api.v1 import scheduler_pb2 as pb
from pshard.api.v1 import scheduler_pb2_grpc as pb_grpc

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 10.0  # generous upper bound for anything that should happen within a few heartbeats


@pytest.fixture
def scheduler() -> Iterator[SchedulerHandle]:
    handle = start_scheduler_thread(heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0)
    yield handle
    handle.stop()


@pytest.fixture
def stub(scheduler: SchedulerHandle) -> Iterator[pb_grpc.SchedulerServiceStub]:
    with grpc.insecure_channel(scheduler.address) as channel:
        yield pb_grpc.SchedulerServiceStub(channel)


@pytest.fixture
def clients(scheduler: SchedulerHandle) -> Iterator[list[SchedulerClient]]:
    made: list[SchedulerClient] = []
    yield made
    for client in made:
        client.close()


WORKER = pb.ROLE_WORKER


def new_client(clients: list[SchedulerClient], address: str, role: str, index: int) -> SchedulerClient:
    client = SchedulerClient(address, role, own_address=f"127.0.0.1:{7100 + index}",
                             node_id=f"{role}-{index}", rank_hint=index, connect_timeout_s=WAIT_S)
    clients.append(client)
    client.register()
    return client


def test_health_service_reports_serving(scheduler):
    with grpc.insecure_channel(scheduler.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)

    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_register_assigns_rank_and_generation(stub):
    first = stub.Register(pb.RegisterRequest(role=WORKER, address="w0:1"), timeout=WAIT_S)
    second = stub.Register(pb.RegisterRequest(role=WORKER, address="w1:1"), timeout=WAIT_S)
    ps = stub.Register(pb.RegisterRequest(role=pb.ROLE_PS, address="p0:1", node_id="ps-0", rank_hint=0),
                       timeout=WAIT_S)

    assert (first.node_id, first.rank, second.rank, ps.rank) == ("worker-0", 0, 1, 0)
    assert first.generation < second.generation < ps.generation == ps.view.generation
    assert (ps.heartbeat_interval_ms, ps.heartbeat_timeout_ms) == (50, 1000)
    assert [n.node_id for n in ps.view.nodes] == ["ps-0", "worker-0", "worker-1"]


def test_register_with_a_role_this_version_does_not_know_is_invalid_naming_it(stub):
    with pytest.raises(grpc.RpcError) as info:
        stub.Register(pb.RegisterRequest(role=99, address="x:1"), timeout=WAIT_S)  # type: ignore[arg-type]

    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "role: got enum value 99" in info.value.details()


def test_rank_hint_zero_is_a_hint_and_no_hint_takes_the_lowest_free_rank(stub):
    stub.Register(pb.RegisterRequest(role=WORKER, node_id="worker-1", rank_hint=1), timeout=WAIT_S)
    hinted = stub.Register(pb.RegisterRequest(role=WORKER, node_id="a", rank_hint=0), timeout=WAIT_S)
    unhinted = stub.Register(pb.RegisterRequest(role=WORKER, node_id="b"), timeout=WAIT_S)

    assert (hinted.rank, unhinted.rank) == (0, 2)


def test_watch_streams_the_current_view_then_each_newer_one(stub):
    stub.Register(pb.RegisterRequest(role=WORKER, node_id="worker-0", rank_hint=0), timeout=WAIT_S)
    stream = stub.Watch(pb.WatchRequest(), timeout=WAIT_S)
    try:
        current = next(stream).view
        reg = stub.Register(pb.RegisterRequest(role=WORKER, node_id="worker-1", rank_hint=1),
                            timeout=WAIT_S)
        newer = next(stream).view
    finally:
        stream.cancel()

    assert [n.node_id for n in current.nodes] == ["worker-0"]
    assert newer.generation == reg.generation > current.generation
    assert [n.node_id for n in newer.nodes] == ["worker-0", "worker-1"]


def test_silent_node_is_declared_dead(scheduler, stub, clients):
    watcher = new_client(clients, scheduler.address, "worker", 0)
    silent = stub.Register(pb.RegisterRequest(role=WORKER, node_id="worker-1", rank_hint=1), timeout=WAIT_S)

    view = watcher.wait_for_view(
        lambda v: (n := v.node("worker-1")) is not None and n.state is NodeState.DEAD, timeout_s=WAIT_S)

    assert view.generation > silent.generation
    assert view.live_workers() == {"worker-0": watcher.generation}
    with pytest.raises(grpc.RpcError) as info:
        stub.Heartbeat(pb.HeartbeatRequest(node_id="worker-1", generation=silent.generation), timeout=WAIT_S)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "declared dead" in info.value.details()


def test_stale_generation_is_fenced_with_both_values(stub):
    old = stub.Register(pb.RegisterRequest(role=WORKER, node_id="worker-1"), timeout=WAIT_S)
    new = stub.Register(pb.RegisterRequest(role=WORKER, node_id="worker-1"), timeout=WAIT_S)

    with pytest.raises(grpc.RpcError) as info:
        stub.Heartbeat(pb.HeartbeatRequest(node_id="worker-1", generation=old.generation), timeout=WAIT_S)

    err = info.value
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert f"generation {old.generation}" in err.details()
    assert f"generation {new.generation}" in err.details()
    assert (ERROR_TYPE_KEY, "StaleGenerationError") in tuple(err.trailing_metadata())
    with pytest.raises(StaleGenerationError):
        raise_from_rpc_error(err)


def test_barrier_releases_when_everyone_arrives(scheduler, clients):
    a = new_client(clients, scheduler.address, "worker", 0)
    b = new_client(clients, scheduler.address, "worker", 1)

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(c.barrier, "start", 2, WAIT_S) for c in (a, b)]
        generations = [f.result(timeout=WAIT_S * 2) for f in futures]

    assert generations[0] == generations[1] > 0
    # The name is reusable: the next round needs both again.
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(c.barrier, "start", 2, WAIT_S) for c in (a, b)]
        assert all(f.result(timeout=WAIT_S * 2) for f in futures)


def test_barrier_timeout_names_the_missing_node(scheduler, clients):
    a = new_client(clients, scheduler.address, "worker", 0)
    new_client(clients, scheduler.address, "worker", 1)

    with pytest.raises(BarrierTimeoutError) as info:
        a.barrier("checkpoint", 2, timeout_s=0.3)

    assert "barrier 'checkpoint' round 1: 1 of 2 arrived" in str(info.value)
    assert "not arrived: worker-1 (live)" in str(info.value)


PARAMS = [ParamSpec("fc1.weight", "float32", (256, 128)), ParamSpec("fc1.bias", "float32", (256,))]


def test_layout_first_proposal_wins_over_rpc(scheduler, clients):
    for i in range(2):
        new_client(clients, scheduler.address, "ps", i)
    a = new_client(clients, scheduler.address, "worker", 0)
    b = new_client(clients, scheduler.address, "worker", 1)

    first = a.propose_layout(PARAMS, slice_bytes=64 * 1024)
    second = b.propose_layout(list(reversed(PARAMS)), slice_bytes=1024, servers=["elsewhere:1"])
    fetched = b.get_layout(timeout_s=WAIT_S)

    assert first.version == 1
    assert first.servers == ("127.0.0.1:7100", "127.0.0.1:7101")  # the live ps nodes, in rank order
    assert second == first == fetched
    assert b.wait_for_view(lambda v: v.layout_version == 1, timeout_s=WAIT_S)
    with pytest.raises(LayoutConflictError) as info:
        b.propose_layout([ParamSpec("fc1.weight", "float32", (256, 64)), PARAMS[1]])
    assert "'fc1.weight'" in str(info.value)
    assert "(256, 128)" in str(info.value) and "(256, 64)" in str(info.value)


def test_get_layout_waits_for_the_first_proposal(scheduler, clients):
    a = new_client(clients, scheduler.address, "worker", 0)
    b = new_client(clients, scheduler.address, "worker", 1)

    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(b.get_layout, WAIT_S)
        proposed = a.propose_layout(PARAMS, servers=["127.0.0.1:7100"])
        assert waiting.result(timeout=WAIT_S * 2) == proposed


def test_get_layout_times_out_when_nobody_proposes(scheduler, clients):
    a = new_client(clients, scheduler.address, "worker", 0)

    with pytest.raises(PullTimeoutError, match="layout: none proposed"):
        a.get_layout(timeout_s=0.2)


def test_clients_reregister_after_a_scheduler_restart_keeping_ranks():
    first = start_scheduler_thread(heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0)
    made: list[SchedulerClient] = []
    second: SchedulerHandle | None = None
    try:
        w0 = new_client(made, first.address, "worker", 0)
        w1 = new_client(made, first.address, "worker", 1)
        before = w0.wait_for_view(lambda v: len(v.live_workers()) == 2, timeout_s=WAIT_S).generation
        old_generations = (w0.generation, w1.generation)

        first.stop()
        # The same port number, free again after the graceful stop: the clients' address stays valid.
        second = start_scheduler_thread(f"127.0.0.1:{first.port}", heartbeat_interval_s=0.05,
                                        heartbeat_timeout_s=1.0)
        for client, old in zip((w0, w1), old_generations, strict=True):
            client.wait_for_view(lambda v, c=client, old=old: c.generation > old
                                 and (n := v.node(c.node_id)) is not None and n.generation == c.generation,
                                 timeout_s=WAIT_S)
        after = w0.wait_for_view(
            lambda v: v.live_workers() == {"worker-0": w0.generation, "worker-1": w1.generation},
            timeout_s=WAIT_S)

        assert (w0.rank, w1.rank) == (0, 1)
        assert after.generation > before
        assert [n.rank for n in after.live("worker")] == [0, 1]
    finally:
        for client in made:
            client.close()
        if second is not None:
            second.stop()
        first.stop()


def test_a_restarted_scheduler_gets_the_layout_back_from_its_servers_not_a_fresh_plan():
    """The chief restarted just before the scheduler (issue hlay): no member could give the layout back,
    and the new chief's proposal was planned afresh (version 1) over servers at a later version."""
    first = start_scheduler_thread(heartbeat_interval_s=0.05, heartbeat_timeout_s=1.0)
    made: list[SchedulerClient] = []
    second: SchedulerHandle | None = None
    held: list[Layout | None] = [None]  # what the servers route by (a fresh server holds none)
    try:
        servers = []
        for i in range(2):
            client = SchedulerClient(first.address, "ps", own_address=f"127.0.0.1:{7100 + i}",
                                     node_id=f"ps-{i}", rank_hint=i, connect_timeout_s=WAIT_S,
                                     offer_layout=lambda: held[0])
            made.append(client)
            client.register()
            servers.append(client)
        planned = new_client(made, first.address, "worker", 0).propose_layout(PARAMS, replicas=1)
        moved, _ = fail_over(planned, 0, {1})  # as the scheduler's failovers left it
        held[0] = dataclasses.replace(moved, version=3)
        for client in servers:
            client.report_in_sync({}, 3)

        first.stop()
        second = start_scheduler_thread(f"127.0.0.1:{first.port}", heartbeat_interval_s=0.05,
                                        heartbeat_timeout_s=1.0)
        for client in servers:  # each registers again with the new scheduler, offering its layout
            client.wait_for_view(lambda v: v.layout_version == 3, timeout_s=WAIT_S)
        chief = SchedulerClient(second.address, "chief", own_address="127.0.0.1:7200", node_id="chief-0",
                                connect_timeout_s=WAIT_S)  # a fresh process: it holds no layout
        made.append(chief)
        chief.register()

        assert chief.propose_layout(PARAMS, replicas=1) == held[0]
        assert chief.get_layout(timeout_s=WAIT_S) == held[0]
    finally:
        for client in made:
            client.close()
        if second is not None:
            second.stop()
        first.stop()


def test_leave_marks_the_node_left_for_the_others(scheduler, clients):
    a = new_client(clients, scheduler.address, "worker", 0)
    b = new_client(clients, scheduler.address, "worker", 1)

    b.leave()

    view = a.wait_for_view(
        lambda v: (n := v.node("worker-1")) is not None and n.state is NodeState.LEFT, timeout_s=WAIT_S)
    assert view.live_workers() == {"worker-0": a.generation}


# ---- the command line, as real processes ----

def run_scheduler(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    # The test's own TF_CONFIG (if any) must not leak into the child.
    inherited = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    full_env = {**inherited, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.Popen([sys.executable, "-m", "pshard.scheduler", *args], cwd=REPO, env=full_env,
                            text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_help_exits_zero():
    with run_scheduler("--help") as proc:
        out, _ = proc.communicate(timeout=WAIT_S * 3)

    assert proc.returncode == 0
    assert "--heartbeat-timeout-ms" in out and "--tf-config" in out


def test_bad_tf_config_exits_2_naming_the_field():
    bad = json.dumps({"cluster": {"scheduler": ["sched:7000"], "worker": ["w0:7200"]},
                      "task": {"type": "worker", "index": 3}})
    with run_scheduler(env={"TF_CONFIG": bad}) as proc:
        _, err = proc.communicate(timeout=WAIT_S * 3)

    assert proc.returncode == 2
    assert err.strip() == ("python -m pshard.scheduler: error: task.index: got 3, but cluster.worker has "
                           "1 entry (valid: 0..0)")


def test_sigterm_stops_the_scheduler_gracefully():
    with run_scheduler("--bind", "127.0.0.1:0") as proc:
        lines: queue.Queue[str] = queue.Queue()
        reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stderr], daemon=True)
        reader.start()
        try:
            port = None
            while port is None:
                line = lines.get(timeout=WAIT_S * 3)
                if "listening on" in line:
                    port = int(line.split("(port ")[1].split(")")[0])
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                                  timeout=WAIT_S)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING

            proc.send_signal(signal.SIGTERM)

            assert proc.wait(timeout=WAIT_S) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=WAIT_S)
            reader.join(WAIT_S)
