"""Fuzzing a live scheduler: every RPC with generated, mutated and raw requests.

After every case: the scheduler's thread is alive, health answers SERVING, the status was a proper
refusal (never UNKNOWN or INTERNAL, no hang), a refused request left the cluster view and the layout
exactly as they were, and RSS stays within budget. ProposeLayout is fuzzed with `restore` too (a
scheduler that restarted takes the layout a member holds): its seeds include the stored layout.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message import Message
from pshard.common.rpc.options import channel_options
from pshard.scheduler.service import SERVICE_NAME, SchedulerHandle, start_scheduler_thread

from pshard.api.v1 import scheduler_pb2 as pb
from pshard.api.v1 import scheduler_pb2_grpc as pb_grpc
from pshard.api.v1 import tensor_pb2
from tests.fuzz.harness import (
    NO_HANG_S,
    WAITING_CALL_S,
    Outcome,
    assert_proper_status,
    assert_rss_within,
    assert_serving,
    call,
    describe,
    rss_bytes,
    run_cases,
    waits,
)
from tests.fuzz.strategies import messages, mutated, raw_bytes

SCHEDULER = pb.DESCRIPTOR.services_by_name["SchedulerService"]
WORKER, PS, CHIEF = pb.ROLE_WORKER, pb.ROLE_PS, pb.ROLE_CHIEF
METHODS = list(SCHEDULER.methods)
CASES = 160  # per test and kind of case: 8 methods x 3 kinds


@dataclass
class LiveScheduler:
    handle: SchedulerHandle
    channel: grpc.Channel
    rss_baseline: int
    valid: dict[str, list[Message]]
    view: pb.ClusterView | None = None
    layout: pb.Layout | None = None

    def current_layout(self) -> pb.Layout:
        return pb_grpc.SchedulerServiceStub(self.channel).GetLayout(pb.GetLayoutRequest(timeout_ms=20),
                                                                    timeout=NO_HANG_S).layout

    def current_view(self) -> pb.ClusterView:
        stream = pb_grpc.SchedulerServiceStub(self.channel).Watch(pb.WatchRequest(), timeout=NO_HANG_S)
        try:
            return next(iter(stream)).view
        finally:
            stream.cancel()

    def check(self, method: MethodDescriptor, payload: bytes, what: str) -> Outcome:
        # Calls that wait by design get a short deadline, which the scheduler answers at once.
        waiting = waits(method)
        outcome = call(self.channel, method, payload, WAITING_CALL_S if waiting else NO_HANG_S)
        what = f"{method.name}({what})"
        assert_proper_status(outcome, what, may_wait=waiting)
        assert self.handle.thread.is_alive(), f"after {what}: the scheduler's thread ended"
        assert_serving(self.channel, SERVICE_NAME, what)
        view = self.current_view()
        # Generations only grow, and stay within an int64 (another language's client) with room to grow.
        assert self.view is None or view.generation >= self.view.generation, f"after {what}: generation fell"
        assert view.generation < 2**63, f"after {what}: generation {view.generation} is past int64"
        layout = self.current_layout()
        if outcome.refused:
            assert view == self.view, f"{what} was refused ({outcome.code.name}) but the view changed"
            assert layout == self.layout, f"{what} was refused ({outcome.code.name}) but the layout changed"
        self.view, self.layout = view, layout
        assert_rss_within(self.rss_baseline, what)
        return outcome


def valid_requests(stub: pb_grpc.SchedulerServiceStub) -> dict[str, list[Message]]:
    """Requests the scheduler accepts, made against its real state: the seeds of the mutations."""
    worker = stub.Register(pb.RegisterRequest(role=WORKER, address="127.0.0.1:7200", node_id="worker-0"),
                           timeout=NO_HANG_S)
    ps = stub.Register(pb.RegisterRequest(role=PS, address="127.0.0.1:7100", node_id="ps-0", rank_hint=0),
                       timeout=NO_HANG_S)
    leaver = stub.Register(pb.RegisterRequest(role=WORKER, address="127.0.0.1:7209", node_id="worker-9"),
                           timeout=NO_HANG_S)
    params = [pb.ParamSpec(key="fc1.weight", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[10, 4]),
              pb.ParamSpec(key="fc1.bias", dtype=tensor_pb2.DTYPE_FLOAT32, shape=[10])]
    # The job's layout, so that restores (a member's copy of it) have something to agree or disagree with.
    first = pb.ProposeLayoutRequest(params=params, slice_bytes=64, servers=["127.0.0.1:7100"])
    layout = stub.ProposeLayout(first, timeout=NO_HANG_S).layout
    return {
        "Register": [pb.RegisterRequest(role=WORKER, address="127.0.0.1:7201", node_id="worker-1",
                                        rank_hint=1, last_generation=ps.generation),
                     pb.RegisterRequest(role=CHIEF, address="127.0.0.1:7202")],
        "Heartbeat": [pb.HeartbeatRequest(node_id="worker-0", generation=worker.generation, clock=3),
                      pb.HeartbeatRequest(node_id="ps-0", generation=ps.generation)],
        "Leave": [pb.LeaveRequest(node_id="worker-9", generation=leaver.generation)],
        "Watch": [pb.WatchRequest(after_generation=0), pb.WatchRequest(after_generation=ps.generation)],
        "Barrier": [pb.BarrierRequest(name="start", count=1, node_id="worker-0", timeout_ms=20),
                    pb.BarrierRequest(name="ckpt", count=2, node_id="ps-0", timeout_ms=1)],
        "ProposeLayout": [pb.ProposeLayoutRequest(params=params, slice_bytes=64, servers=["127.0.0.1:7100"]),
                          pb.ProposeLayoutRequest(params=list(reversed(params))),
                          pb.ProposeLayoutRequest(restore=layout)],
        "GetLayout": [pb.GetLayoutRequest(timeout_ms=20)],
        # Refused here (no server reports an in-sync backup to move to: see REFUSED_SEEDS), but
        # well-formed: its mutations reach the checks past parsing.
        "MovePartition": [pb.MovePartitionRequest(partition=0, target="127.0.0.1:7100",
                                                  layout_version=layout.version),
                          pb.MovePartitionRequest(partition=1, target="127.0.0.1:7101")],
    }


# A move needs a replicated layout and an in-sync backup, which this scheduler (nobody heartbeats) never
# has: its seeds are refused, cleanly, like every case.
REFUSED_SEEDS = frozenset({"MovePartition"})


@pytest.fixture(scope="module")
def live() -> Iterator[LiveScheduler]:
    # Nobody heartbeats here: a timeout of an hour keeps expiry from changing the view mid-case.
    handle = start_scheduler_thread(heartbeat_interval_s=1.0, heartbeat_timeout_s=3600.0)
    try:
        with grpc.insecure_channel(handle.address, options=channel_options()) as channel:
            valid = valid_requests(pb_grpc.SchedulerServiceStub(channel))
            scheduler = LiveScheduler(handle, channel, rss_bytes(), valid)
            scheduler.view, scheduler.layout = scheduler.current_view(), scheduler.current_layout()
            yield scheduler
    finally:
        handle.stop()


def test_the_valid_seeds_are_accepted(live):
    """The mutations start from requests that work (else the fuzzer would only test refusals)."""
    for name, requests in live.valid.items():
        method = SCHEDULER.methods_by_name[name]
        for request in requests:
            outcome = live.check(method, request.SerializeToString(), describe(request))
            if name in REFUSED_SEEDS:
                assert outcome.refused, (name, outcome)
                continue
            assert outcome.code in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED), (name, outcome)


def method_id(method: MethodDescriptor) -> str:
    return method.name


@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_generated_requests_are_refused_cleanly(live, method):
    run_cases(messages(method.input_type),
              lambda m: live.check(method, m.SerializeToString(), describe(m)), CASES, f"gen-{method.name}")


@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_mutated_valid_requests_are_refused_cleanly(live, method):
    run_cases(mutated(live.valid[method.name]),
              lambda m: live.check(method, m.SerializeToString(), describe(m)), CASES, f"mut-{method.name}")


@pytest.mark.parametrize("method", METHODS, ids=method_id)
def test_raw_bytes_are_refused_cleanly(live, method):
    run_cases(raw_bytes(live.valid[method.name]),
              lambda raw: live.check(method, raw, describe(raw)), CASES, f"raw-{method.name}")
