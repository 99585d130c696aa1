"""A heartbeat refused for the generation this process itself just left behind does not fence it.

Seen in CI (issue 20's drain through a scheduler SIGKILL): ps-1's leave reached the restarted scheduler,
which did not know it, so ps-1 registered again (generation 11) from the drain's thread, while the
heartbeat thread had built its request with generation 1. The scheduler refused that heartbeat as
stale, the client took it for a newer incarnation of its node id, fenced itself out for good, and the
drain failed with the server exiting 1. A refusal naming an older generation than the process's own is
its own leftover; only one naming its current generation is a fence.
"""

from __future__ import annotations

import threading

from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.scheduler.service import SchedulerHandle

from pshard.api.v1 import scheduler_pb2 as pb

from .conftest import WAIT_S


class RegistersBeforeTheHeartbeatLands:
    """The client's stub, with one difference: the first heartbeat waits until this process has
    registered again (as a drain's leave does from another thread), so it lands with the generation
    the process just left behind. Every call goes to the real scheduler."""

    def __init__(self, stub: object, client: SchedulerClient) -> None:
        self._stub, self._client = stub, client
        self.held = threading.Event()
        self.stale_sent = threading.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self._stub, name)

    def Heartbeat(self, request: pb.HeartbeatRequest, **kwargs: object) -> pb.HeartbeatResponse:
        if not self.held.is_set():
            self.held.set()
            self._client._reregister(request.generation)  # what hand_over does after UnknownNodeError
            assert self._client.generation != request.generation
            try:
                return self._stub.Heartbeat(request, **kwargs)  # type: ignore[attr-defined, no-any-return]
            finally:
                self.stale_sent.set()
        return self._stub.Heartbeat(request, **kwargs)  # type: ignore[attr-defined, no-any-return]


def test_a_heartbeat_refused_for_the_generation_this_process_left_behind_does_not_fence_it(
        quick_scheduler: SchedulerHandle) -> None:
    answered: list[float] = []  # when each heartbeat answered was sent
    three = threading.Event()

    def on_answer(sent_at: float, timeout_s: float) -> None:
        answered.append(sent_at)
        if len(answered) >= 3:
            three.set()

    client = SchedulerClient(quick_scheduler.address, "ps", "127.0.0.1:7100", node_id="ps-0", rank_hint=0,
                             on_answer=on_answer)
    try:
        proxy = RegistersBeforeTheHeartbeatLands(client._stub, client)
        client._stub = proxy  # type: ignore[assignment]
        client.register()
        assert proxy.stale_sent.wait(WAIT_S), "no heartbeat was sent"
        now = client.generation
        # Heartbeats go on with the new generation, and the client is not fenced out (a fenced client's
        # heartbeat thread ends: three answers never come).
        assert three.wait(WAIT_S), f"heartbeats stopped after the stale one; fenced: {client.fenced}"
        assert client.fenced is None, client.fenced
        assert client.generation == now
    finally:
        client.close()
