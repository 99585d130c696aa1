"""A worker's leave while its heartbeat thread registers it again goes from the new incarnation.

Seen on the namespace hosts (tests/hosts/test_worker_cut_off.py under load): worker-1's host was cut off,
the scheduler declared it dead, the link came back, and its heartbeat thread registered it again
(generation 3 -> 8) just as its main thread, out of data, left. The leave was built while the
registration was on its way, with generation 3, and reached the scheduler after it: refused as stale,
so the worker ended `failed=leave` with exit 1. The other order is as wrong: a leave that lands first,
then the registration, brings the node back after it left, and its peers wait for it.

The race is made certain here: the registration, once started, waits (up to a second) for the leave to
be sent. Every call goes to a real scheduler.
"""

from __future__ import annotations

import threading

from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.cluster.view import ClusterView, NodeState
from pshard.scheduler.service import SchedulerHandle

from pshard.api.v1 import scheduler_pb2 as pb

from .conftest import WAIT_S

HOLD_S = 1.0


class RegistersSlowly:
    """The client's stub, with one difference once armed: a Register waits until a Leave was sent (or
    HOLD_S passed), as a registration whose answer is still on its way when the leave is built."""

    def __init__(self, stub: object) -> None:
        self._stub = stub
        self.armed = False
        self.registering = threading.Event()
        self.leave_sent = threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self._stub, name)

    def Register(self, request: pb.RegisterRequest, **kwargs: object) -> pb.RegisterResponse:
        if self.armed:
            self.registering.set()
            self.leave_sent.wait(HOLD_S)
        return self._stub.Register(request, **kwargs)  # type: ignore[attr-defined, no-any-return]

    def Leave(self, request: pb.LeaveRequest, **kwargs: object) -> pb.LeaveResponse:
        self.leave_sent.set()
        return self._stub.Leave(request, **kwargs)  # type: ignore[attr-defined, no-any-return]


def _state(view: ClusterView, node_id: str) -> NodeState | None:
    node = view.node(node_id)
    return node.state if node is not None else None


def test_a_leave_racing_a_reregistration_leaves_from_the_new_incarnation(
        quick_scheduler: SchedulerHandle) -> None:
    client = SchedulerClient(quick_scheduler.address, "worker", "127.0.0.1:7200", node_id="worker-1",
                             rank_hint=1)
    try:
        proxy = RegistersSlowly(client._stub)
        client._stub = proxy  # type: ignore[assignment]
        client.register()
        first = client.generation
        proxy.armed = True
        # What the heartbeat thread does on NOT_FOUND (the scheduler declared this node dead).
        again = threading.Thread(target=client._reregister, args=(first,), name="heartbeat")
        again.start()
        assert proxy.registering.wait(WAIT_S)
        client.leave()  # raised StaleGenerationError, or left before the registration brought it back
        again.join(WAIT_S)
        assert not again.is_alive()
        assert client.generation > first, "the registration did not happen"
        # Left for good: neither live again (the registration after the leave) nor still live.
        view = client.wait_for_view(lambda v: _state(v, "worker-1") is NodeState.LEFT, WAIT_S)
        assert "worker-1" not in view.live_workers()
    finally:
        client.close()


def test_no_registration_follows_a_leave(quick_scheduler: SchedulerHandle) -> None:
    client = SchedulerClient(quick_scheduler.address, "worker", "127.0.0.1:7201", node_id="worker-2",
                             rank_hint=2)
    try:
        client.register()
        first = client.generation
        client.leave()
        client._reregister(first)  # a heartbeat refused while leaving, answered after the leave
        assert client.generation == first
        assert _state(client.wait_for_view(lambda v: _state(v, "worker-2") is NodeState.LEFT, WAIT_S),
                      "worker-2") is NodeState.LEFT
    finally:
        client.close()
