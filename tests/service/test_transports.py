"""The consistency contract on every transport (shm, tcp, grpc), and the fast paths' own promises:
no torn reads, a break mid-step completes over gRPC with nothing lost or applied twice, the
choice shows in the stats (docs/architecture.md, 11 Transports)."""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.errors import (
    FutureClockError,
    PSError,
    PullTimeoutError,
    StaleGenerationError,
    UnknownKeyError,
)
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.wire import shm
from pshard.ps_server.settings import ServerSettings

WAIT_S = 10.0
SGD_1 = OptimizerConfig(name="sgd", lr=1.0)
TRANSPORTS = ("shm", "tcp", "grpc")


@pytest.fixture
def shm_dir(tmp_path: Path) -> Iterator[str]:
    """A directory of its own on tmpfs (as /dev/shm is in production), so leaks are visible."""
    base = Path(shm.DEFAULT_SHM_DIR)
    if not (base.is_dir() and os.access(base, os.W_OK)):
        yield str(tmp_path)
        return
    path = Path(tempfile.mkdtemp(prefix="pshard-test-", dir=base))
    yield str(path)
    leftovers = list(path.iterdir())
    for child in leftovers:
        child.unlink()
    path.rmdir()
    assert leftovers == [], "segments left behind"


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def serve(shm_dir, start_server):
    def start(**settings: object):
        return start_server(ServerSettings(shm_dir=shm_dir, **settings))  # type: ignore[arg-type]
    return start


@pytest.fixture
def client(shm_dir, new_client, transport):
    """client(servers, worker_id, **kwargs): a PSClient that must end up on `transport`."""
    made = []

    def make(servers, worker_id, **kwargs):
        c = new_client(servers, worker_id, transport=transport, shm_dir=shm_dir, **kwargs)
        made.append(c)
        return c

    yield make
    for c in made:  # the path asked for is the one that carried the calls
        if c.layout is not None:
            assert c.transports == [transport] * len(c.servers)


# ---- the contract, on every transport ----

def test_sync_steps_average_every_workers_gradient_on_two_servers(serve, client, wire, transport):
    servers = [serve(static_quorum={"w0": 0, "w1": 0}) for _ in range(2)]
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.5))
    params = {"a": np.zeros(1000, np.float32), "b": np.zeros((300, 1000), np.float32)}
    workers = [client(servers, f"w{rank}") for rank in range(2)]
    steps = 3

    def train(rank: int) -> dict[str, np.ndarray]:
        weights = workers[rank].declare(params, job)
        for step in range(steps):
            grads = {k: np.full(v.shape, rank + 1 + step, np.float32) for k, v in weights.items()}
            weights = workers[rank].push_pull(grads, step)
        return weights

    with ThreadPoolExecutor(2) as pool:
        results = [f.result(timeout=WAIT_S) for f in [pool.submit(train, r) for r in range(2)]]
    # Step s averages 1 + s and 2 + s: the weights go down by 0.5 * (1.5 + s) per step.
    expected = -0.5 * sum(1.5 + s for s in range(steps))
    for weights in results:
        for value in weights.values():
            np.testing.assert_array_equal(value, np.full(value.shape, expected, np.float32))
    stats = [wire.stats(s) for s in servers]
    if transport != "grpc":
        assert all(s.worker_transports == {"w0": transport, "w1": transport} for s in stats)
    else:
        assert all(not s.worker_transports for s in stats)


def test_async_loses_no_update_from_concurrent_workers(serve, client):
    server = serve()
    job = JobConfig(mode="async", optimizer=SGD_1)
    workers = [client([server], f"w{rank}") for rank in range(3)]
    for w in workers:
        w.declare({"a": np.zeros(10_000, np.float32)}, job)
    steps = 20

    def train(rank: int) -> None:
        for step in range(steps):
            workers[rank].push_pull({"a": np.ones(10_000, np.float32)}, step)

    with ThreadPoolExecutor(3) as pool:
        for f in [pool.submit(train, r) for r in range(3)]:
            f.result(timeout=WAIT_S)
    np.testing.assert_array_equal(workers[0].pull(steps)["a"], np.full(10_000, -3 * steps, np.float32))


def test_ssp_pull_waits_for_the_slowest_worker_and_its_push_releases_it(serve, client, wire):
    server = serve(static_quorum={"fast": 0, "slow": 0})
    job = JobConfig(mode="ssp", staleness=1, optimizer=SGD_1)
    fast, slow = client([server], "fast"), client([server], "slow")
    for c in (fast, slow):
        c.declare({"a": np.zeros(4, np.float32)}, job)
    ones = {"a": np.ones(4, np.float32)}
    slow.push_pull(ones, 0)
    fast.push_pull(ones, 0)
    fast.push_pull(ones, 1)  # a pull at clock 2 = slow's clock + s: answered at once
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(lambda: fast.push_pull(ones, 2)["a"])  # needs everybody at clock 2
        wire.wait_stats(server, lambda s: s.pulls_waiting == 1, "fast's pull at clock 3 parked")
        assert not future.done()
        slow.push_pull(ones, 1)
        np.testing.assert_array_equal(future.result(timeout=WAIT_S), np.full(4, -5, np.float32))


def test_a_duplicate_push_is_dropped_and_changes_nothing(serve, client, wire):
    server = serve()
    c = client([server], "w0")
    c.declare({"a": np.zeros(8, np.float32), "b": np.zeros(3, np.float32)},
              JobConfig(mode="async", optimizer=SGD_1))
    grads = {"a": np.ones(8, np.float32), "b": np.ones(3, np.float32)}
    first = c.push_pull(grads, 0)
    assert (c.last_result.applied, c.last_result.dropped) == (2, 0)
    again = c.push_pull(grads, 0)
    assert (c.last_result.applied, c.last_result.dropped) == (0, 2)
    for key in grads:
        np.testing.assert_array_equal(again[key], first[key])
    assert wire.stats(server).pushes_dropped == 2


def _rejections(server, make) -> list[tuple[type[PSError], str]]:
    """What each bad request gets from `server` through a client made by make(servers, worker_id)."""
    job = JobConfig(mode="sync", optimizer=SGD_1)
    params = {"a": np.zeros(8, np.float32)}
    ok = make([server], "w0")
    ok.declare(params, job)
    fenced = make([server], "w1", generation=0)
    fenced.declare(params, job)  # declarations carry no stamp; its pushes do
    # A layout naming a slice the server never saw (a reader needs no declaration of its own).
    stranger = make([server], "w0", layout=plan_layout(
        [ParamSpec("a", "float32", (8,)), ParamSpec("zz", "float32", (8,))], ok.servers))
    cases = [lambda: ok.push_pull({"a": np.ones(8, np.float32)}, 5),
             lambda: fenced.push_pull({"a": np.ones(8, np.float32)}, 0),
             lambda: stranger.pull(0, ["a", "zz"])]
    got = []
    for call in cases:
        with pytest.raises(PSError) as caught:
            call()
        got.append((type(caught.value), str(caught.value)))
    return got


def test_bad_input_gets_the_same_error_as_over_grpc_and_changes_nothing(serve, client, new_client, wire,
                                                                        transport):
    quorum = {"w0": 0, "w1": 1}  # w1 registered as generation 1: its generation-0 stamps are fenced off
    here = serve(static_quorum=quorum)
    reference = serve(static_quorum=quorum)
    got = _rejections(here, client)
    expected = _rejections(reference, lambda servers, worker, **kw: new_client(
        servers, worker, transport="grpc", **kw))
    assert [cls for cls, _ in got] == [FutureClockError, StaleGenerationError, UnknownKeyError]
    assert got == expected
    assert wire.read(here, ["a"])["a"] == (np.zeros(8, np.float32).tobytes(), 0)
    stats = wire.stats(here)
    assert (stats.pushes_applied, stats.pushes_dropped) == (0, 0)


def test_a_pull_past_its_deadline_names_the_missing_workers(serve, client):
    server = serve(static_quorum={"w0": 0, "w1": 0, "w2": 0})
    c = client([server], "w0", timeout_s=0.5)
    c.declare({"a": np.zeros(4, np.float32)}, JobConfig(mode="sync", optimizer=SGD_1))
    with pytest.raises(PullTimeoutError, match=r"waiting for workers \['w1', 'w2'\] to reach clock 0"):
        c.push_pull({"a": np.ones(4, np.float32)}, 0)


# ---- no torn reads ----

@pytest.mark.parametrize("transport", ["shm", "tcp"], indirect=True)
def test_pulls_racing_updates_each_see_exactly_one_version(serve, client, new_client, transport):
    """Every update adds -1 to every element, so a slice read across two versions is not constant."""
    server = serve()
    job = JobConfig(mode="async", optimizer=SGD_1)
    size = 4 * 2**20  # 16 MB: copies long enough for a racing update to land in the middle
    writer = new_client([server], "writer", transport="grpc")
    writer.declare({"a": np.zeros(size, np.float32)}, job)
    reader = client([server], "reader", layout=writer.layout)
    slices = writer.layout.slices_on(0)
    assert len(slices) > 1
    stop = threading.Event()
    updates = 0

    def write() -> None:
        nonlocal updates
        ones = {"a": np.ones(size, np.float32)}
        while not stop.is_set() and updates < 200:
            writer.push(ones, updates).result(WAIT_S)
            updates += 1

    out = {"a": np.empty(size, np.float32)}
    seen = set()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(write)
        try:
            for _ in range(30):
                value = reader.pull(0, out=out)["a"]
                for s in slices:  # each slice is read under its own lock, at its own version
                    part = value[s.offset:s.offset + s.numel]
                    assert (part == part[0]).all(), f"a pull of slice {s.slice_key} mixed two versions"
                    version = -int(part[0])
                    assert reader.last_pull.min_version <= version <= reader.last_pull.max_version
                    seen.add(version)
        finally:
            stop.set()
            future.result(timeout=WAIT_S)
    assert len(seen) > 1, "the pulls never raced an update"


def test_sync_training_is_bit_identical_on_every_transport(serve, new_client, shm_dir):
    rng = np.random.default_rng(7)
    params = {"a": rng.standard_normal(5000, dtype=np.float32),
              "b": rng.standard_normal((700, 1000), dtype=np.float32)}
    grads = [[{k: rng.standard_normal(v.shape, dtype=np.float32) for k, v in params.items()}
              for _ in range(3)] for _ in range(2)]
    job = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1, momentum=0.9))
    finals = {}
    for transport in TRANSPORTS:
        servers = [serve(static_quorum={"w0": 0, "w1": 0}) for _ in range(2)]
        workers = [new_client(servers, f"w{r}", transport=transport, shm_dir=shm_dir) for r in range(2)]

        def train(rank: int, client) -> dict[str, np.ndarray]:
            weights = client.declare(params, job)
            for step, g in enumerate(grads[rank]):
                weights = client.push_pull(g, step)
            return weights

        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(train, r, w) for r, w in enumerate(workers)]
            finals[transport] = [f.result(timeout=WAIT_S) for f in futures]
        assert all(w.transports == [transport] * 2 for w in workers)
    for transport in TRANSPORTS:
        for weights in finals[transport]:
            for key, value in weights.items():
                assert value.tobytes() == finals["grpc"][0][key].tobytes(), f"{transport}: {key} differs"


@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
def test_wire_compression_gives_the_same_weights_on_every_transport(serve, new_client, shm_dir, wire_dtype):
    rng = np.random.default_rng(3)
    params = {"a": rng.standard_normal(300_000, dtype=np.float32),
              "b": rng.standard_normal(7, dtype=np.float32)}
    grads = {k: rng.standard_normal(v.shape, dtype=np.float32) for k, v in params.items()}
    job = JobConfig(mode="async", optimizer=SGD_1, wire_dtype=wire_dtype)
    got = {}
    for transport in TRANSPORTS:
        c = new_client([serve()], "w0", transport=transport, shm_dir=shm_dir)
        c.declare(params, job)
        got[transport] = c.push_pull(grads, 0)
        assert c.transports == [transport]
    for transport in TRANSPORTS:
        for key in params:
            assert got[transport][key].tobytes() == got["grpc"][key].tobytes(), f"{transport}: {key}"
