"""Issue 10, points 6 and 7, through a real server on 127.0.0.1:0: non-finite gradients (reject, skip,
allow) for dense slices, per-worker step times, and the report of a sync clock stalled by a worker that
stopped pushing (docs/architecture.md, 9 Failures)."""

from __future__ import annotations

import logging
import time

import grpc
import numpy as np
import pytest
from pshard.common.errors import InvalidArgumentError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.rpc.status import ERROR_TYPE_KEY
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb

from .conftest import WAIT_S

MODEL = {"w": np.arange(12, dtype=np.float32).reshape(3, 4) / 7, "b": np.linspace(-1, 1, 5, dtype=np.float32)}
SGD = OptimizerConfig(name="sgd", lr=1.0)


def _weights(server, wire, worker="reader"):
    return wire.read(server, MODEL, worker=worker)


def _bad(value: float) -> dict[str, np.ndarray]:
    w = np.ones((3, 4), np.float32)
    w[1, 2] = value
    w[2, 3] = np.nan
    return {"b": np.ones(5, np.float32), "w": w}


@pytest.mark.parametrize("mode", ["async", "sync"])
@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_reject_refuses_the_whole_push_naming_key_and_first_bad_index(start_server, wire, mode, value):
    server = start_server(ServerSettings(default_job=JobConfig(mode=mode, optimizer=SGD),
                                         static_quorum={"w0": 0}))
    wire.declare(server, None, MODEL)
    before = _weights(server, wire)
    stats_before = wire.stats(server)

    with pytest.raises(grpc.RpcError) as caught:
        wire.stub(server).Push(wire.push_request("w0", 0, _bad(value)), timeout=WAIT_S)

    err = caught.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "'w'" in err.details() and "(1, 2)" in err.details(), err.details()
    assert dict(err.trailing_metadata() or ()).get(ERROR_TYPE_KEY) == InvalidArgumentError.__name__
    # Nothing of it applied: not the finite 'b' pushed alongside either, and no clock moved.
    assert _weights(server, wire) == before
    after = wire.stats(server)
    assert (after.pushes_applied, dict(after.worker_clocks)) == (stats_before.pushes_applied, {})
    # The same clock may then be pushed with finite values (the refused push left no trace).
    wire.stub(server).Push(wire.push_request("w0", 0, {"w": np.ones((3, 4), np.float32)}), timeout=WAIT_S)
    assert wire.stats(server).pushes_applied == 1


def test_reject_is_the_default_on_the_wire(start_server, wire):
    # A Declare whose JobConfig leaves nonfinite unset (an older client) gets reject.
    server = start_server(ServerSettings(static_quorum={"w0": 0}))
    request = pb.DeclareRequest(slices=[wire.tensor(k, v) for k, v in MODEL.items()])
    request.config.mode = pb.CONSISTENCY_MODE_ASYNC
    request.config.optimizer.name = pb.OPTIMIZER_SGD
    request.config.optimizer.lr = 1.0
    wire.stub(server).Declare(request, timeout=WAIT_S)
    with pytest.raises(grpc.RpcError) as caught:
        wire.stub(server).Push(wire.push_request("w0", 0, _bad(np.inf)), timeout=WAIT_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_skip_drops_and_counts_async(start_server, wire):
    server = start_server(ServerSettings(default_job=JobConfig(mode="async", optimizer=SGD, nonfinite="skip"),
                                         static_quorum={"w0": 0}))
    wire.declare(server, None, MODEL)
    before = _weights(server, wire)

    wire.stub(server).Push(wire.push_request("w0", 0, _bad(np.inf)), timeout=WAIT_S)

    after = _weights(server, wire)
    assert after["w"] == before["w"]  # dropped
    b = np.frombuffer(after["b"][0], np.float32)
    np.testing.assert_array_equal(b, MODEL["b"] - 1)  # the finite gradient beside it applied
    stats = wire.stats(server)
    assert (stats.nonfinite_dropped, stats.pushes_applied) == (1, 1)


def test_skip_in_sync_lets_the_clock_complete_with_a_zero_contribution(start_server, wire):
    server = start_server(ServerSettings(default_job=JobConfig(mode="sync", optimizer=SGD, nonfinite="skip"),
                                         static_quorum={"w0": 0, "w1": 0}))
    wire.declare(server, None, MODEL)
    wire.stub(server).Push(wire.push_request("w0", 0, _bad(np.nan)), timeout=WAIT_S)
    wire.stub(server).Push(wire.push_request("w1", 0, {"w": np.full((3, 4), 2, np.float32),
                                                       "b": np.full(5, 2, np.float32)}), timeout=WAIT_S)

    after = _weights(server, wire)
    # w: mean of w1's 2 and w0's skipped (zero) gradient; b: mean of 1 and 2.
    np.testing.assert_array_equal(np.frombuffer(after["w"][0], np.float32).reshape(3, 4), MODEL["w"] - 1)
    np.testing.assert_array_equal(np.frombuffer(after["b"][0], np.float32), MODEL["b"] - 1.5)
    assert after["w"][1] == after["b"][1] == 1
    assert wire.stats(server).nonfinite_dropped == 1


def test_allow_applies_them(start_server, wire):
    job = JobConfig(mode="async", optimizer=SGD, nonfinite="allow")
    server = start_server(ServerSettings(default_job=job, static_quorum={"w0": 0}))
    wire.declare(server, None, MODEL)
    wire.stub(server).Push(wire.push_request("w0", 0, _bad(np.inf)), timeout=WAIT_S)
    w = np.frombuffer(_weights(server, wire)["w"][0], np.float32).reshape(3, 4)
    assert np.isneginf(w[1, 2]) and np.isnan(w[2, 3])
    assert wire.stats(server).nonfinite_dropped == 0


def test_nonfinite_setting_is_validated():
    with pytest.raises(InvalidArgumentError, match="nonfinite: got 'drop'"):
        JobConfig(nonfinite="drop")


# ---- point 6: step times and hang reports ----

def test_step_times_and_a_stalled_sync_clock_name_the_missing_worker(start_server, wire, caplog):
    server = start_server(ServerSettings(default_job=JobConfig(mode="sync", optimizer=SGD),
                                         static_quorum={"fast": 0, "slow": 0}, hang_report_s=0.3))
    wire.declare(server, None, MODEL)
    grads = {"w": np.ones((3, 4), np.float32), "b": np.ones(5, np.float32)}
    for clock in range(4):
        for worker in ("fast", "slow"):
            wire.stub(server).Push(wire.push_request(worker, clock, grads), timeout=WAIT_S)
    # 'slow' stalls: only 'fast' pushes clock 4, and its pull of clock 5 parks.
    caplog.set_level(logging.WARNING, logger="pshard.ps")
    wire.stub(server).Push(wire.push_request("fast", 4, grads), timeout=WAIT_S)
    pull = wire.stub(server).Pull.future(pb.PullRequest(stamp=wire.stamp("fast", 5),
                                                        slices=[wire.slice_id("w")]), timeout=WAIT_S)
    started = time.monotonic()

    stats = wire.wait_stats(server, lambda s: len(s.hangs) == 2, "both slices reported stalled")

    assert {(h.key, h.clock, tuple(h.waiting_for)) for h in stats.hangs} == {
        ("w", 4, ("slow",)), ("b", 4, ("slow",))}
    assert all(0.3 < h.stalled_s < WAIT_S for h in stats.hangs)
    # The pull is still waiting: the report comes before any deadline fires.
    assert not pull.done() and time.monotonic() - started < WAIT_S
    deadline = time.monotonic() + WAIT_S
    while not any("sync clock 4" in r.getMessage() and "slow" in r.getMessage() for r in caplog.records):
        assert time.monotonic() < deadline, [r.getMessage() for r in caplog.records]
        time.sleep(0.05)
    # Per-worker step times: 4 intervals each for 'fast' (clocks 0..4), 3 for 'slow'.
    assert stats.step_times["fast"].steps == 4 and stats.step_times["slow"].steps == 3
    times = stats.step_times["fast"]
    assert 0 <= times.p50_s <= times.p90_s <= times.p99_s <= times.max_s

    # 'slow' comes back: the clock completes, the pull is answered, the report clears.
    wire.stub(server).Push(wire.push_request("slow", 4, grads), timeout=WAIT_S)
    assert pull.result(timeout=WAIT_S).slices[0].version == 5
    assert not wire.stats(server).hangs


@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc"])
def test_reject_on_every_transport(start_server, new_client, transport, tmp_path):
    # The check lives in the store, so the fast paths refuse exactly what gRPC refuses.
    server = start_server(ServerSettings(shm_dir=str(tmp_path), static_quorum={"w0": 0}))
    client = new_client([server], "w0", transport=transport, shm_dir=str(tmp_path))
    client.declare({"w": np.zeros(1000, np.float32)}, JobConfig(mode="async", optimizer=SGD))
    grad = np.ones(1000, np.float32)
    grad[737] = np.nan

    with pytest.raises(InvalidArgumentError, match=r"key 'w.*index \(737,\)"):
        client.push_pull({"w": grad}, 0)

    assert client.transports == [transport]
    np.testing.assert_array_equal(client.pull(0)["w"], np.zeros(1000, np.float32))
