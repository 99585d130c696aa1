"""Compressed pulls on every transport (issue 19): a real server sends each worker the packed change
since that worker's copy, keeps the rest, and its own value stays exact; a lost base is re-pulled whole."""

from __future__ import annotations

import numpy as np
import pytest
from pshard.common.compression import Compression
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.ps_server.settings import ServerSettings

SGD_1 = OptimizerConfig(name="sgd", lr=1.0)
# topk:1 sends every element of a push as it is: the server's value is then exactly params - sum(grads).
JOB = JobConfig(mode="async", optimizer=SGD_1,
                compression=Compression("topk:1", (("b", "none"),), pull="topk:0.05"))
NUMEL = 300_000


def _setup(start_server, new_client, tmp_path, transport):
    rng = np.random.default_rng(11)
    params = {"a": rng.standard_normal(NUMEL, dtype=np.float32),
              "b": rng.standard_normal(7, dtype=np.float32)}
    server = start_server(ServerSettings(shm_dir=str(tmp_path)))
    client = new_client([server], "w0", transport=transport, shm_dir=str(tmp_path))
    client.declare(params, JOB, slice_bytes=400_000)  # "a" is cut in three slices, each pulled on its own
    return rng, params, server, client


def _server_state(server, client):
    """The server's value of "a" and its copy of what w0 holds, slice by slice."""
    handlers = server.running.handlers
    value, held = np.empty(NUMEL, np.float32), np.empty(NUMEL, np.float32)
    for s in (s for s in client.layout.slices if s.key == "a"):
        [(part, _)] = handlers.store.read([s.slice_key])
        value[s.offset:s.offset + s.numel] = part.reshape(-1)
        held[s.offset:s.offset + s.numel] = handlers.pull_copies.copy_of("w0", s.slice_key)
    return value, held


@pytest.mark.parametrize("transport", ["shm", "tcp", "grpc"])
def test_a_worker_gets_the_packed_change_and_the_server_stays_exact(start_server, new_client, tmp_path,
                                                                    transport):
    rng, params, server, client = _setup(start_server, new_client, tmp_path, transport)
    want = {k: v.copy() for k, v in params.items()}
    assert client.pull(0)["a"].tobytes() == params["a"].tobytes()  # the first pull comes whole
    for clock in range(4):
        grads = {k: rng.standard_normal(v.shape, dtype=np.float32) for k, v in params.items()}
        got = client.push_pull(grads, clock)
        want = {k: want[k] - grads[k] for k in want}
        value, held = _server_state(server, client)
        assert value.tobytes() == want["a"].tobytes()  # the server applied the pushes exactly
        assert got["a"].tobytes() == held.tobytes()  # the worker's copy is the server's copy of it
        assert got["b"].tobytes() == want["b"].tobytes()  # its rule: uncompressed, so pulled whole
        assert not np.array_equal(got["a"], value)  # an approximation: 5 % of the change a pull
    assert client.transports == [transport]
    decoder = client.pull_compression
    assert decoder is not None and decoder.bytes_before / decoder.bytes_after > 3  # 10x after the first
    # What the worker lacks is on the server, not lost: enough pulls with no push bring it all.
    for _ in range(40):
        got = client.pull(4)
    assert np.abs(got["a"] - value).max() < 1e-5 * np.abs(value).max()


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_a_lost_base_is_pulled_whole_and_the_push_applies_once(start_server, new_client, tmp_path, transport):
    rng, params, server, client = _setup(start_server, new_client, tmp_path, transport)
    grads = {k: rng.standard_normal(v.shape, dtype=np.float32) for k, v in params.items()}
    client.push_pull(grads, 0)
    decoder = client.pull_compression
    assert decoder is not None
    # As if a reply had been lost: the worker's count is not the server's any more.
    for s in (s for s in client.layout.slices if s.key == "a"):
        decoder._bases[s.slice_key] += 1
    grads2 = {k: rng.standard_normal(v.shape, dtype=np.float32) for k, v in params.items()}
    got = client.push_pull(grads2, 1)

    value, held = _server_state(server, client)
    assert value.tobytes() == (params["a"] - grads["a"] - grads2["a"]).tobytes()  # once, not twice
    assert got["a"].tobytes() == value.tobytes() == held.tobytes()  # whole again, and the copy restarts
    assert all(decoder.pack(s).base == 1 for s in client.layout.slices if s.key == "a")


def test_a_job_without_pull_compression_pulls_whole(start_server, new_client, tmp_path):
    server = start_server(ServerSettings(shm_dir=str(tmp_path)))
    client = new_client([server], "w0", transport="tcp")
    params = {"a": np.ones(NUMEL, np.float32)}
    client.declare(params, JobConfig(mode="async", optimizer=SGD_1, compression=Compression("topk:0.01")))
    assert client.pull_compression is None
    got = client.push_pull({"a": np.ones(NUMEL, np.float32)}, 0)
    assert server.running.handlers.pull_copies.nbytes == 0
    [(value, _)] = server.running.handlers.store.read([client.layout.slices[0].slice_key])
    assert got["a"][:value.size].tobytes() == value.reshape(-1).tobytes()


@pytest.mark.parametrize("transport", ["tcp", "grpc"])
def test_sync_workers_share_the_servers_copy_and_train_on_the_same_weights(start_server, new_client, tmp_path,
                                                                           transport):
    """Sync mode: both workers pull every version, so one copy and one packing per slice serve both; each
    worker's weights are that copy, and the server's own value is exactly the union batch's SGD."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(12)
    params = {"a": rng.standard_normal(NUMEL, dtype=np.float32)}
    server = start_server(ServerSettings(shm_dir=str(tmp_path), static_quorum={"w0": 0, "w1": 0}))
    job = JobConfig(mode="sync", optimizer=SGD_1, compression=Compression("topk:1", pull="topk:0.01"))
    clients = [new_client([server], w, transport=transport, shm_dir=str(tmp_path)) for w in ("w0", "w1")]
    for client in clients:
        client.declare(params, job, slice_bytes=400_000)
    want = params["a"].copy()
    with ThreadPoolExecutor(2) as pool:
        for clock in range(3):
            grads = [rng.standard_normal(NUMEL, dtype=np.float32) for _ in clients]
            steps = [pool.submit(c.push_pull, {"a": g}, clock) for c, g in zip(clients, grads, strict=True)]
            got = [step.result()["a"] for step in steps]
            want = want - (grads[0] + grads[1]) / np.float32(2)
            value, held = _server_state(server, clients[0])
            np.testing.assert_allclose(value, want, rtol=1e-6, atol=1e-6)  # the union batch's mean
            assert got[0].tobytes() == got[1].tobytes() == held.tobytes()
            assert server.running.handlers.pull_copies.nbytes == 4 * NUMEL  # one copy, not one each


def test_a_worker_that_leaves_the_quorum_takes_its_copies_with_it(start_server, new_client, tmp_path):
    rng = np.random.default_rng(13)
    params = {"a": rng.standard_normal(NUMEL, dtype=np.float32)}
    server = start_server(ServerSettings(shm_dir=str(tmp_path), static_quorum={"w0": 0, "w1": 0}))
    job = JobConfig(mode="async", optimizer=SGD_1, compression=Compression("topk:1", pull="sign"))
    clients = [new_client([server], w, transport="tcp") for w in ("w0", "w1")]
    for client in clients:
        client.declare(params, job, slice_bytes=400_000)
        client.push_pull({"a": rng.standard_normal(NUMEL, dtype=np.float32)}, 0)
    handlers = server.running.handlers
    assert handlers.pull_copies.workers == {"w0", "w1"}
    server.call(lambda: handlers.set_quorum({"w0": 0}))  # w1 left
    assert handlers.pull_copies.workers == {"w0"}
    got = clients[0].push_pull({"a": rng.standard_normal(NUMEL, dtype=np.float32)}, 1)  # w0 goes on, packed
    assert got["a"].tobytes() == _server_state(server, clients[0])[1].tobytes()
    assert clients[0].pull_compression is not None and clients[0].pull_compression.pack(
        clients[0].layout.slices[0]).base == 2
