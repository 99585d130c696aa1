"""Payloads of any size, declaration, checkpoint restarts and retries through real servers."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.rpc.options import CHUNK_BYTES, DEFAULT_MAX_MESSAGE_BYTES
from pshard.common.wire import codec
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb

WAIT_S = 10.0
ASYNC_SGD = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=1.0))


def _integer_grads(params: dict[str, np.ndarray], seed: int) -> dict[str, np.ndarray]:
    """Small integers: every update is exact in any float dtype, so results compare bit for bit."""
    rng = np.random.default_rng(seed)
    return {k: rng.integers(-3, 4, v.shape).astype(v.dtype) for k, v in params.items()}


# ---- payloads of any size ----

def test_big_and_many_small_tensors_round_trip_through_two_servers(start_server, new_client, wire):
    servers = [start_server() for _ in range(2)]
    rng = np.random.default_rng(0)
    params = {"big": rng.integers(-100, 100, (1500, 2100)).astype(np.float32)}  # 12.6 MiB: > one message
    params |= {f"layer{i}.w": rng.integers(-9, 9, (i + 1, 7)).astype(np.float32) for i in range(40)}
    params |= {"half": np.arange(10, dtype=np.float16), "double": np.arange(5, dtype=np.float64) / 3,
               "scalar": np.array(2.5, np.float32), "empty": np.zeros((0, 4), np.float32)}
    assert params["big"].nbytes > CHUNK_BYTES
    client = new_client(servers, "w0")
    grads = _integer_grads(params, seed=1)

    declared = client.declare(params, ASYNC_SGD)
    stepped = client.push_pull(grads, 0)
    pulled = client.pull(1)

    for key, value in params.items():
        assert declared[key].dtype == value.dtype and declared[key].shape == value.shape, key
        np.testing.assert_array_equal(declared[key], value, err_msg=key)
        np.testing.assert_array_equal(stepped[key], value - grads[key], err_msg=key)
        np.testing.assert_array_equal(pulled[key], value - grads[key], err_msg=key)
    # The big tensor is spread over both servers, and each holds exactly its share of the layout.
    assert {s.server for s in client.layout.slices_of("big")} == {0, 1}
    stored = [wire.stats(s).bytes_stored for s in servers]
    half_bytes = sum(v.nbytes for v in params.values() if v.dtype == np.float16)
    assert stored == [b + half_bytes * (i == client.layout.slices_of("half")[0].server)
                      for i, b in enumerate(client.layout.bytes_per_server())]  # float16: float32 master
    assert min(stored) > params["big"].nbytes // 3


def test_large_model_moves_without_hitting_a_message_size_limit(start_server, new_client):
    # Over gRPC (shared memory has no message limit), twice its message limit proves the chunking;
    # bench/dense.py drives bigger models between processes (256 MiB took 18 s of make test on 2 busy cores).
    server = start_server(ServerSettings(static_quorum={"w0": 0}))
    client = new_client([server], "w0", transport="grpc")
    n = 2 * DEFAULT_MAX_MESSAGE_BYTES // 4
    params = {"embedding": np.tile(np.arange(1024, dtype=np.float32), n // 1024),
              "head": np.ones(10, np.float32)}
    grads = {"embedding": np.full(n, 2, np.float32), "head": np.ones(10, np.float32)}

    declared = client.declare(params, JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=1.0)))
    stepped = client.push_pull(grads, 0)
    pulled = client.pull(1)

    # np.array_equal, not np.testing: the latter takes seconds on 64 M elements.
    assert np.array_equal(declared["embedding"], params["embedding"])
    expected = params["embedding"] - 2
    for out in (stepped, pulled):
        assert np.array_equal(out["embedding"], expected)
        assert np.array_equal(out["head"], np.zeros(10, np.float32))
    assert client.last_result.applied == len(client.layout.slices)


# ---- declare ----

def test_declare_is_idempotent_and_the_first_declaration_wins(start_server, new_client, wire):
    server = start_server()
    first, second = new_client([server], "w0"), new_client([server], "w1")
    ones = {"a": np.ones((2, 3), np.float32), "b": np.ones(5, np.float32)}
    twos = {k: v * 2 for k, v in ones.items()}

    got_first = first.declare(ones, ASYNC_SGD)
    got_second = second.declare(twos, ASYNC_SGD)
    got_again = first.declare(twos, ASYNC_SGD)

    for got in (got_first, got_second, got_again):
        for key in ones:
            np.testing.assert_array_equal(got[key], ones[key])
    assert wire.stats(server).slices == 2


def test_declare_over_unary_and_exchange_reports_what_it_created(start_server, wire):
    server = start_server()
    frames = [wire.header_frame(op=pb.EXCHANGE_OP_DECLARE, config=codec.job_to_proto(ASYNC_SGD),
                                push=[wire.meta("a", "float32", [3]), wire.meta("b", "float32", [2])]),
              wire.data_frame(np.full(3, 7, np.float32), np.full(2, 8, np.float32))]

    unary = wire.declare(server, ASYNC_SGD, {"a": np.full(3, 1, np.float32)})
    streamed = wire.exchange(server, frames)
    again = wire.exchange(server, frames)

    assert list(unary.created) == [True]
    np.testing.assert_array_equal(wire.array(unary.slices[0]), np.full(3, 1, np.float32))
    assert list(wire.summary(streamed).created) == [False, True]
    assert list(wire.summary(again).created) == [False, False]
    for answer in (streamed, again):
        payload = b"".join(bytes(codec.decode_data_frame(f)) for f in answer[:-1])
        np.testing.assert_array_equal(np.frombuffer(payload, np.float32), [1, 1, 1, 8, 8])


# ---- restarts ----

ADAM_SYNC = JobConfig(mode="sync", optimizer=OptimizerConfig(name="adam", lr=0.05, weight_decay=0.01))


def _train(client, params, clocks: range) -> dict[str, np.ndarray]:
    weights = {}
    for clock in clocks:
        weights = client.push_pull(_grads_at(params, clock), clock)
    return weights


def _grads_at(params: dict[str, np.ndarray], clock: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + clock)
    return {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in params.items()}


def test_server_restarted_from_its_checkpoint_continues_like_an_uninterrupted_one(
        start_server, new_client, wire, tmp_path):
    rng = np.random.default_rng(7)
    params = {"w": rng.standard_normal((30, 20)).astype(np.float32), "b": np.zeros(20, np.float32)}
    quorum = {"w0": 0}
    reference = new_client([start_server(ServerSettings(static_quorum=quorum))], "w0")
    reference.declare(params, ADAM_SYNC)
    expected = _train(reference, params, range(6))
    settings = ServerSettings(static_quorum=quorum, checkpoint_dir=str(tmp_path))
    before = start_server(settings)
    client = new_client([before], "w0")
    client.declare(params, ADAM_SYNC)
    _train(client, params, range(3))
    client.checkpoint()
    stored = wire.read(before, params, clock=3)
    stats = wire.stats(before)
    before.stop()

    after = start_server(settings)
    resumed = new_client([after], "w0")
    restored = resumed.declare({k: np.zeros_like(v) for k, v in params.items()}, ADAM_SYNC)

    # Same weights (first declaration wins: the checkpoint's), versions, clocks and counters...
    assert wire.read(after, params, clock=3) == stored
    for key, (data, _) in stored.items():
        assert restored[key].tobytes() == data
    again = wire.stats(after)
    assert (again.min_version, again.max_version, dict(again.worker_clocks), again.pushes_applied) == (
        3, 3, {"w0": 2}, stats.pushes_applied)
    # ...and optimizer state: Adam's moments and step counts carry on bit for bit.
    final = _train(resumed, params, range(3, 6))
    for key in params:
        assert final[key].tobytes() == expected[key].tobytes(), key


class _RetryLogged(logging.Handler):
    """Notices PSClient's warning that it is retrying a call that failed with UNAVAILABLE."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        import threading

        self.seen = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "retrying" in record.getMessage():
            self.seen.set()


@pytest.fixture
def retry_logged():
    handler = _RetryLogged()
    logger = logging.getLogger("pshard.client")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def test_client_retries_while_the_server_restarts_on_its_port_and_the_push_applies_once(
        start_server, new_client, wire, tmp_path, retry_logged):
    settings = ServerSettings(static_quorum={"w0": 0, "w1": 0}, checkpoint_dir=str(tmp_path))
    first = start_server(settings)
    port = first.port
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=1.0))
    params = {"a": np.zeros(4, np.float32), "b": np.zeros(3, np.float32)}
    w0, w1 = new_client([first], "w0"), new_client([first], "w1")
    for client in (w0, w1):
        client.declare(params, job)
    g0 = {k: np.full_like(v, 6) for k, v in params.items()}
    g1 = {k: np.full_like(v, 2) for k, v in params.items()}

    with ThreadPoolExecutor(1) as pool:
        step = pool.submit(w0.push_pull, g0, 0)  # w0's gradient goes in; its pull waits for w1
        wire.wait_stats(first, lambda s: s.pulls_waiting == 1 and dict(s.worker_clocks) == {"w0": 0},
                        "w0 pushed clock 0 and waits")
        wire.stub(first).Checkpoint(pb.CheckpointRequest(), timeout=WAIT_S)
        first.stop(grace_s=0.1)  # w0's stream fails with UNAVAILABLE
        assert retry_logged.seen.wait(WAIT_S)

        second = start_server(settings, bind=f"127.0.0.1:{port}")
        w1.push_pull(g1, 0)

        weights = step.result(timeout=WAIT_S)

    # The resent gradient of (w0, clock 0) was a duplicate of the checkpointed one: the mean is of two.
    for key in params:
        np.testing.assert_array_equal(weights[key], np.full_like(params[key], -4))
    assert (w0.last_result.applied, w0.last_result.dropped) == (0, len(params))
    stats = wire.stats(second)
    assert (stats.min_version, stats.pushes_applied) == (1, 2 * len(params))
