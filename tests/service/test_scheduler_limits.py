"""Scheduler limits over real gRPC: refused requests get a proper status and move no state (issue 7)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pshard.common.rpc.serving import start_in_thread
from pshard.common.rpc.status import ERROR_TYPE_KEY
from pshard.scheduler import service
from pshard.scheduler.membership import MembershipLimits
from pshard.scheduler.service import SchedulerHandle, start_scheduler_thread

from pshard.api.v1 import scheduler_pb2 as pb
from pshard.api.v1 import scheduler_pb2_grpc as pb_grpc
from pshard.api.v1 import tensor_pb2

WAIT_S = 10.0
WORKER, PS = pb.ROLE_WORKER, pb.ROLE_PS


@pytest.fixture
def scheduler() -> Iterator[SchedulerHandle]:
    handle = start_scheduler_thread(heartbeat_interval_s=0.05, heartbeat_timeout_s=5.0)
    yield handle
    handle.stop()


@pytest.fixture
def channel(scheduler: SchedulerHandle) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(scheduler.address) as channel:
        yield channel


def first_view(stub: pb_grpc.SchedulerServiceStub) -> pb.ClusterView:
    return next(iter(stub.Watch(pb.WatchRequest(), timeout=WAIT_S))).view


def assert_serving(channel: grpc.Channel) -> None:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=WAIT_S)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def refusal(call: grpc.RpcError) -> tuple[grpc.StatusCode, str, str]:
    assert isinstance(call, grpc.Call)
    kind = dict(call.trailing_metadata() or ()).get(ERROR_TYPE_KEY, "")
    return call.code(), call.details() or "", str(kind)


def test_register_with_last_generation_2_64_minus_1_is_refused_and_the_scheduler_goes_on(channel):
    """Defect 2: this Register used to break every later Register, Heartbeat and Watch for good."""
    stub = pb_grpc.SchedulerServiceStub(channel)
    reg = stub.Register(pb.RegisterRequest(role=WORKER, address="w0:1", node_id="worker-0"), timeout=WAIT_S)
    before = first_view(stub)

    with pytest.raises(grpc.RpcError) as info:
        stub.Register(pb.RegisterRequest(role=WORKER, address="w1:1", node_id="worker-1",
                                         last_generation=2**64 - 1), timeout=WAIT_S)

    code, details, _ = refusal(info.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details == (f"last_generation of node 'worker-1': got {2**64 - 1}, expected at most "
                       f"{2**62 - 2**40} (the servers' stamp limit {2**62} less {2**40} generations "
                       "of headroom)")
    assert first_view(stub) == before  # nobody admitted, the generation did not move
    stub.Heartbeat(pb.HeartbeatRequest(node_id="worker-0", generation=reg.generation), timeout=WAIT_S)
    again = stub.Register(pb.RegisterRequest(role=WORKER, address="w1:1", node_id="worker-1"),
                          timeout=WAIT_S)
    assert again.generation == before.generation + 1
    assert first_view(stub).generation == again.generation
    assert_serving(channel)


def test_a_restart_generation_at_the_bound_still_fits_every_reply(channel):
    """The highest jump a restarted scheduler takes leaves 2**40 generations below the servers' limit."""
    stub = pb_grpc.SchedulerServiceStub(channel)
    ceiling = 2**62 - 2**40

    # A worker: a server coming back to a restarted scheduler may not leave until the job's layout is back
    # (what it serves would have no owner), and the generations are the same for every role.
    reg = stub.Register(pb.RegisterRequest(role=WORKER, address="w:1", last_generation=ceiling),
                        timeout=WAIT_S)
    stub.Heartbeat(pb.HeartbeatRequest(node_id=reg.node_id, generation=reg.generation, clock=2**62),
                   timeout=WAIT_S)
    left = stub.Leave(pb.LeaveRequest(node_id=reg.node_id, generation=reg.generation), timeout=WAIT_S)

    assert reg.generation == ceiling + 1
    assert first_view(stub).generation == left.view.generation == ceiling + 2


@pytest.mark.parametrize(("method", "raw"), [
    ("Register", b"\xff\xff\xff"),
    ("Register", b"\x12\x02\xff\xfe"),  # address is not UTF-8
    ("Heartbeat", b"\x0a\x05ab"),  # truncated
    ("Barrier", b"\x08"),
])
def test_unparseable_request_bytes_are_invalid_argument(channel, method, raw):
    call = channel.unary_unary(f"/pshard.api.v1.SchedulerService/{method}",
                               request_serializer=lambda b: b, response_deserializer=lambda b: b)

    with pytest.raises(grpc.RpcError) as info:
        call(raw, timeout=WAIT_S)

    code, details, _ = refusal(info.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(f"/pshard.api.v1.SchedulerService/{method}: not a valid request")
    assert_serving(channel)


def test_unparseable_watch_request_is_invalid_argument(channel):
    call = channel.unary_stream("/pshard.api.v1.SchedulerService/Watch",
                                request_serializer=lambda b: b, response_deserializer=lambda b: b)

    with pytest.raises(grpc.RpcError) as info:
        list(call(b"\xff\xff", timeout=WAIT_S))

    assert refusal(info.value)[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_a_layout_that_would_plan_billions_of_slices_is_refused_at_once(channel):
    stub = pb_grpc.SchedulerServiceStub(channel)
    stub.Register(pb.RegisterRequest(role=PS, address="p:1"), timeout=WAIT_S)  # so Watch has a view
    huge = pb.ParamSpec(key="w", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[2**40])

    with pytest.raises(grpc.RpcError) as info:
        stub.ProposeLayout(pb.ProposeLayoutRequest(params=[huge], slice_bytes=64, servers=["p:1"]),
                           timeout=WAIT_S)

    code, details, _ = refusal(info.value)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith("layout slices (slice_bytes 64): got 68719476736, expected at most")
    assert first_view(stub).layout_version == 0


def test_registrations_past_the_rate_are_resource_exhausted_with_a_retry_hint():
    limits = MembershipLimits(registrations_per_minute=1, registration_burst=2)
    handle = start_in_thread(lambda: service.start(heartbeat_timeout_s=5.0, limits=limits), name="limited")
    try:
        with grpc.insecure_channel(handle.address) as channel:
            stub = pb_grpc.SchedulerServiceStub(channel)
            for i in range(2):
                stub.Register(pb.RegisterRequest(role=WORKER, address=f"w{i}:1"), timeout=WAIT_S)
            before = first_view(stub)

            with pytest.raises(grpc.RpcError) as info:
                stub.Register(pb.RegisterRequest(role=WORKER, address="w2:1"), timeout=WAIT_S)

            code, details, kind = refusal(info.value)
            assert (code, kind) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QuotaExceededError")
            assert details.startswith("registrations: more than 1 a minute (burst 2); retry in ")
            assert first_view(stub) == before
            assert_serving(channel)
    finally:
        handle.stop()
