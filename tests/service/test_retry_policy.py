"""One retry policy: gRPC's service-config retries with wait_for_ready for unary calls, `Backoff` for streams.

Real schedulers and parameter servers on ports the OS picked; a server that "starts later" takes a
port that was free a moment before, after the client has verifiably failed to reach it.
"""

from __future__ import annotations

import json
import random
import socket
import threading
from collections.abc import Callable

import grpc
import pytest
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.errors import UnavailableError
from pshard.common.rpc.options import channel_options
from pshard.common.rpc.retry import (
    MAX_ATTEMPTS,
    PARAMETER_SERVER_RETRIED,
    SCHEDULER_RETRIED,
    Backoff,
    RetryPolicy,
    scheduler_channel_options,
    service_config,
)
from pshard.scheduler.service import start_scheduler_thread

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import parameter_server_pb2_grpc as pb_grpc
from tests.service.conftest import WAIT_S


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _when_unreachable(channel: grpc.Channel) -> threading.Event:
    """Set once `channel` tried to connect and failed (TRANSIENT_FAILURE)."""
    failed = threading.Event()

    def seen(state: grpc.ChannelConnectivity) -> None:
        if state is grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            failed.set()

    channel.subscribe(seen, try_to_connect=False)
    return failed


# ---- the service config ----


def test_only_idempotent_methods_retry_and_within_grpcs_cap() -> None:
    config = json.loads(service_config("pshard.api.v1.SchedulerService", SCHEDULER_RETRIED))
    (method,) = config["methodConfig"]
    assert {n["method"] for n in method["name"]} == set(SCHEDULER_RETRIED)
    assert "Heartbeat" not in SCHEDULER_RETRIED  # its own loop resends; a late one carries stale progress
    assert "Exchange" not in PARAMETER_SERVER_RETRIED  # a stream: retried by hand
    assert method["retryPolicy"]["maxAttempts"] <= MAX_ATTEMPTS == 5
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    assert ("grpc.enable_retries", 1) in scheduler_channel_options()


def test_a_policy_grpc_would_refuse_is_refused_here() -> None:
    with pytest.raises(ValueError, match="max_attempts: got 6"):
        RetryPolicy(max_attempts=6)


# ---- the backoff of the stream loops ----


def test_backoff_grows_to_its_cap_with_jitter_and_starts_over_after_reset() -> None:
    policy = RetryPolicy(initial_backoff_s=0.1, max_backoff_s=0.4, multiplier=2)
    backoff = Backoff(policy, rng=random.Random(7))
    delays = [backoff.next_delay() for _ in range(5)]
    for delay, base in zip(delays, [0.1, 0.2, 0.4, 0.4, 0.4], strict=True):
        assert 0.5 * base <= delay <= 1.5 * base
    backoff.reset()
    assert backoff.next_delay() <= 1.5 * 0.1


def test_backoff_wait_ends_at_once_when_stopped() -> None:
    stop = threading.Event()
    stop.set()
    assert Backoff(RetryPolicy(initial_backoff_s=60, max_backoff_s=60), stop=stop).wait() is True


# ---- unary calls wait for a server that is not up yet ----


def test_register_waits_for_a_scheduler_that_starts_later() -> None:
    port = _free_port()
    client = SchedulerClient(f"127.0.0.1:{port}", "worker", node_id="worker-0", rank_hint=0,
                             connect_timeout_s=WAIT_S)
    unreachable = _when_unreachable(client._channel)
    outcome: dict[str, object] = {}
    registering = threading.Thread(target=lambda: outcome.update(reg=client.register()), daemon=True)
    scheduler = None
    try:
        registering.start()
        assert unreachable.wait(WAIT_S), "the client never tried the absent scheduler"
        scheduler = start_scheduler_thread(f"127.0.0.1:{port}")
        registering.join(WAIT_S)
        assert not registering.is_alive()
        assert client.rank == 0 and client.generation >= 1
    finally:
        client.close()
        if scheduler is not None:
            scheduler.stop()


def test_register_gives_up_after_its_connect_timeout_naming_the_scheduler() -> None:
    address = f"127.0.0.1:{_free_port()}"
    expected = rf"scheduler {address}: Register got no answer within 0.5 s"
    with (SchedulerClient(address, "worker", node_id="worker-0", connect_timeout_s=0.5) as client,
          pytest.raises(UnavailableError, match=expected)):
        client.register()


def test_a_ps_call_waits_for_a_server_that_starts_later(start_server: Callable[..., object],
                                                        new_client: Callable[..., object]) -> None:
    address = f"127.0.0.1:{_free_port()}"
    client = new_client([address], "w0")
    unreachable = _when_unreachable(client._channels[0])  # type: ignore[attr-defined]
    outcome: dict[str, object] = {}
    asking = threading.Thread(target=lambda: outcome.update(stats=client.stats()),  # type: ignore[attr-defined]
                              daemon=True)
    asking.start()
    assert unreachable.wait(WAIT_S), "the client never tried the absent server"
    start_server(bind=address)
    asking.join(WAIT_S)

    assert not asking.is_alive()
    assert len(outcome["stats"]) == 1  # type: ignore[arg-type]


# ---- a channel's connections are its own ----


def test_a_new_channel_reaches_a_server_restarted_where_another_channel_saw_it_die(
        start_server: Callable[..., object]) -> None:
    # gRPC's global subchannel pool handed a new channel the connection state of an older one with
    # the same target and options: "connection refused" and its backoff, so the new channel's first
    # call failed at once though the server was up (CI: a port an earlier test's server had held).
    first = start_server()
    address = first.address  # type: ignore[attr-defined]
    with grpc.insecure_channel(address, options=channel_options()) as old:
        stats = pb_grpc.ParameterServerServiceStub(old).GetStats
        stats(pb.GetStatsRequest(), timeout=WAIT_S)
        first.stop(grace_s=0)  # type: ignore[attr-defined]
        with pytest.raises(grpc.RpcError) as died:
            stats(pb.GetStatsRequest(), timeout=WAIT_S)
        assert died.value.code() is grpc.StatusCode.UNAVAILABLE  # the old channel now backs off
        start_server(bind=address)  # the same address, as a restarted server gets it
        with grpc.insecure_channel(address, options=channel_options()) as new:
            # No wait_for_ready: the call fails at once if it is handed the old channel's state.
            response = pb_grpc.ParameterServerServiceStub(new).GetStats(pb.GetStatsRequest(), timeout=WAIT_S)
    assert response.slices == 0
