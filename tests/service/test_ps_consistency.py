"""The consistency contract (docs/architecture.md, 5 Consistency) through real servers and real channels."""

from __future__ import annotations

import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.wire import codec
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb

WAIT_S = 10.0
SGD_1 = OptimizerConfig(name="sgd", lr=1.0)


def _pulled_floats(frames: list[bytes]) -> np.ndarray:
    """The float32 values carried by the data frames of an Exchange answer."""
    payloads = [codec.decode_data_frame(f) for f in frames]
    return np.frombuffer(b"".join(bytes(p) for p in payloads if p is not None), np.float32)


# ---- sync ----

def test_sync_training_matches_single_process_sgd_on_the_union_batch(start_server, new_client):
    steps, lr, momentum = 4, 0.1, 0.9
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    inputs, targets = torch.randn(steps, 8, 5), torch.randn(steps, 8, 3)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr, momentum=momentum)
    for step in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(inputs[step]), targets[step]).backward()
        optimizer.step()
    servers = [start_server(ServerSettings(static_quorum={"w0": 0, "w1": 0})) for _ in range(2)]
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=lr, momentum=momentum))
    initial = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    clients = [new_client(servers, f"w{rank}") for rank in range(2)]

    def train(rank: int) -> dict[str, np.ndarray]:
        local = copy.deepcopy(model)
        weights = clients[rank].declare(initial, job)
        half = slice(4 * rank, 4 * rank + 4)  # disjoint halves of every union batch
        for step in range(steps):
            local.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
            local.zero_grad()
            torch.nn.functional.mse_loss(local(inputs[step, half]), targets[step, half]).backward()
            weights = clients[rank].push_pull({k: p.grad.numpy() for k, p in local.named_parameters()}, step)
        return weights

    with ThreadPoolExecutor(2) as pool:
        results = [f.result(timeout=WAIT_S) for f in [pool.submit(train, r) for r in range(2)]]

    for key, expected in reference.state_dict().items():
        for weights in results:
            np.testing.assert_allclose(weights[key], expected.numpy(), rtol=0, atol=1e-6)
    assert {len(client.layout.slices_on(i)) for client in clients for i in range(2)} == {1}  # both servers


def test_duplicate_push_counts_once_in_the_sync_mean(start_server, wire):
    server = start_server(ServerSettings(static_quorum={"w0": 0, "w1": 0}))
    wire.declare(server, JobConfig(mode="sync", optimizer=SGD_1), {"a": np.zeros(4, np.float32)})
    push = wire.stub(server).Push

    first = push(wire.push_request("w0", 0, {"a": np.full(4, 6, np.float32)}), timeout=WAIT_S)
    again = push(wire.push_request("w0", 0, {"a": np.full(4, 6, np.float32)}), timeout=WAIT_S)
    push(wire.push_request("w1", 0, {"a": np.full(4, 2, np.float32)}), timeout=WAIT_S)

    assert (first.applied, first.dropped, again.applied, again.dropped) == (1, 0, 0, 1)
    assert wire.read(server, ["a"], clock=1)["a"] == (np.full(4, -4, np.float32).tobytes(), 1)  # mean(6, 2)


# ---- async ----

def test_async_loses_no_update_from_concurrent_workers(start_server, new_client, wire):
    workers, clocks = 8, 30
    server = start_server()
    job = JobConfig(mode="async", optimizer=SGD_1)
    initial = {"w": np.full(1000, 5000.0, np.float32), "b": np.arange(3, dtype=np.float32)}

    def grads(rank: int, clock: int) -> dict[str, np.ndarray]:
        # Integers: float32 sums them exactly in any order, so the result must match exactly.
        return {"w": (np.arange(1000, dtype=np.float32) % 7) + rank - (clock % 3),
                "b": np.full(3, rank * clock % 5, np.float32)}

    clients = [new_client([server], f"w{rank}") for rank in range(workers)]

    def train(rank: int) -> None:
        clients[rank].declare(initial, job)
        for clock in range(clocks):
            if clock % 2:
                clients[rank].wait(clients[rank].push(grads(rank, clock), clock))
            else:
                clients[rank].push_pull(grads(rank, clock), clock)

    with ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(train, r) for r in range(workers)]:
            future.result(timeout=3 * WAIT_S)

    final = clients[0].pull(clocks)
    for key, value in initial.items():
        total = sum(grads(r, c)[key] for r in range(workers) for c in range(clocks))
        np.testing.assert_array_equal(final[key], value - total)
    stats = wire.stats(server)
    assert (stats.pushes_applied, stats.pushes_dropped) == (workers * clocks * 2, 0)
    assert dict(stats.worker_clocks) == {f"w{r}": clocks - 1 for r in range(workers)}


def test_duplicate_exchange_and_unary_pushes_are_applied_once(start_server, wire):
    server = start_server()
    wire.declare(server, JobConfig(mode="async", optimizer=SGD_1), {"a": np.zeros(4, np.float32)})
    exchange = [wire.header_frame(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=wire.stamp("w0", 0),
                                  push=[wire.meta("a", "float32", [4])], pull=[wire.slice_id("a")]),
                wire.data_frame(np.ones(4, np.float32))]
    unary = wire.push_request("w0", 1, {"a": np.full(4, 2, np.float32)})

    first, again = wire.exchange(server, exchange), wire.exchange(server, exchange)
    pushed, pushed_again = (wire.stub(server).Push(unary, timeout=WAIT_S) for _ in range(2))

    assert [(s.applied, s.dropped) for s in (wire.summary(first), wire.summary(again))] == [(1, 0), (0, 1)]
    np.testing.assert_array_equal(_pulled_floats(first), np.full(4, -1, np.float32))
    np.testing.assert_array_equal(_pulled_floats(again), np.full(4, -1, np.float32))
    assert [(r.applied, r.dropped) for r in (pushed, pushed_again)] == [(1, 0), (0, 1)]
    assert wire.read(server, ["a"], clock=2)["a"] == (np.full(4, -3, np.float32).tobytes(), 2)
    stats = wire.stats(server)
    assert (stats.pushes_applied, stats.pushes_dropped) == (2, 2)


# ---- bounded staleness ----

def test_ssp_pull_waits_for_the_slowest_worker_and_its_push_releases_it(start_server, new_client, wire):
    server = start_server(ServerSettings(static_quorum={"fast": 0, "slow": 0}))
    job = JobConfig(mode="ssp", staleness=1, optimizer=SGD_1)
    fast, slow = new_client([server], "fast"), new_client([server], "slow")
    for client in (fast, slow):
        client.declare({"a": np.zeros(4, np.float32)}, job)
    ones = {"a": np.ones(4, np.float32)}
    slow.push_pull(ones, 0)  # slow is at clock 1
    fast.push_pull(ones, 0)
    fast.push_pull(ones, 1)  # a pull at clock 2 = slow's clock + s: answered at once
    released = threading.Event()

    def fast_step() -> np.ndarray:
        out = fast.push_pull(ones, 2)["a"]  # a pull at clock 3 needs everybody at clock 3 - s = 2
        released.set()
        return out

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(fast_step)
        stats = wire.wait_stats(server, lambda s: s.pulls_waiting == 1, "fast's pull at clock 3 parked")
        assert not released.is_set()
        assert stats.worker_clocks["fast"] == 2  # its push went in; only the pull waits

        slow.push_pull(ones, 1)

        assert released.wait(WAIT_S)
        # Every update of clocks <= c - s - 1 = 1 is in the read: fast 0, 1, 2 and slow 0, 1.
        np.testing.assert_array_equal(future.result(timeout=WAIT_S), np.full(4, -5, np.float32))


# ---- waiting pulls cost no threads ----

def test_many_waiting_pulls_do_not_block_the_pushes_that_release_them(start_server, wire):
    unary_pulls, stream_pulls = 64, 16
    server = start_server(ServerSettings(static_quorum={"w0": 0, "w1": 0}))
    wire.declare(server, JobConfig(mode="sync", optimizer=SGD_1), {"a": np.zeros(4, np.float32)})
    push = wire.stub(server).Push
    push(wire.push_request("w0", 0, {"a": np.full(4, 2, np.float32)}), timeout=WAIT_S)
    pull = pb.PullRequest(stamp=wire.stamp("w0", 1), slices=[wire.slice_id("a")],
                          timeout_ms=int(WAIT_S * 1000))
    stream = [wire.header_frame(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=wire.stamp("w0", 1),
                                pull=[wire.slice_id("a")], timeout_ms=int(WAIT_S * 1000))]

    with ThreadPoolExecutor(stream_pulls) as pool:
        unary = [wire.stub(server).Pull.future(pull, timeout=2 * WAIT_S) for _ in range(unary_pulls)]
        streams = [pool.submit(wire.exchange, server, stream, 2 * WAIT_S) for _ in range(stream_pulls)]
        wire.wait_stats(server, lambda s: s.pulls_waiting == unary_pulls + stream_pulls, "every pull parked")

        reply = push(wire.push_request("w1", 0, {"a": np.full(4, 4, np.float32)}), timeout=WAIT_S)

        assert reply.applied == 1
        expected = np.full(4, -3, np.float32)
        for future in unary:
            [got] = future.result(timeout=WAIT_S).slices
            assert got.version == 1 and got.tensor.data == expected.tobytes()
        for future in streams:
            frames = future.result(timeout=WAIT_S)
            assert list(wire.summary(frames).versions) == [1]
            np.testing.assert_array_equal(_pulled_floats(frames), expected)
    assert wire.stats(server).pulls_waiting == 0


def test_quorum_change_releases_a_waiting_sync_pull_at_once(start_server, wire):
    server = start_server(ServerSettings(static_quorum={"w0": 0, "w1": 0}))
    wire.declare(server, JobConfig(mode="sync", optimizer=SGD_1), {"a": np.zeros(4, np.float32)})
    wire.stub(server).Push(wire.push_request("w0", 0, {"a": np.full(4, 2, np.float32)}), timeout=WAIT_S)
    # The pull's own deadline is far beyond the test's: only the quorum change can answer it in time.
    pull = wire.stub(server).Pull.future(pb.PullRequest(
        stamp=wire.stamp("w0", 1), slices=[wire.slice_id("a")], timeout_ms=600_000), timeout=600)
    wire.wait_stats(server, lambda s: s.pulls_waiting == 1, "w0's pull parked")

    server.call(lambda: server.running.handlers.set_quorum({"w0": 0}))  # w1 left

    [got] = pull.result(timeout=WAIT_S).slices
    assert (got.version, got.tensor.data) == (1, np.full(4, -2, np.float32).tobytes())
    assert list(wire.stats(server).quorum) == ["w0"]


# ---- wire compression ----

def _rounded(values: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    return torch.from_numpy(values).to(dtype).float().numpy()


@pytest.mark.parametrize(("wire_dtype", "torch_dtype", "rtol"), [
    ("float16", torch.float16, 2.0**-11), ("bfloat16", torch.bfloat16, 2.0**-8)])
def test_wire_compression_round_trips_with_the_wire_dtypes_precision(start_server, new_client, wire,
                                                                    wire_dtype, torch_dtype, rtol):
    server = start_server()
    client = new_client([server], "w0")
    values = np.array([1 / 3, -2 / 3, 1e-3, 1234.567, 0.1, -7.0, 2.5, 0.0], np.float32)
    grads = np.array([0.2, -1 / 7, 3.14159, 1e-2, -100.3, 5.0, 0.0, 1 / 9], np.float32)

    declared = client.declare({"a": values, "z": np.zeros(8, np.float32)},
                              JobConfig(mode="async", optimizer=SGD_1, wire_dtype=wire_dtype))
    stepped = client.push_pull({"a": np.zeros(8, np.float32), "z": grads}, 0)

    # Exactly the wire dtype's rounding, and within its precision of the float32 values.
    np.testing.assert_array_equal(declared["a"], _rounded(values, torch_dtype))
    np.testing.assert_allclose(declared["a"], values, rtol=rtol, atol=0)
    assert not np.array_equal(declared["a"], values)  # it did travel compressed
    # The gradient travelled rounded too: 0 - 1 * rounded(g) is already representable on the way back.
    np.testing.assert_array_equal(stepped["z"], -_rounded(grads, torch_dtype))
    np.testing.assert_allclose(stepped["z"], -grads, rtol=rtol, atol=0)
    assert stepped["a"].dtype == np.float32
    # The server keeps float32 master copies: compression is on the wire only.
    assert wire.stats(server).bytes_stored == 16 * 4
