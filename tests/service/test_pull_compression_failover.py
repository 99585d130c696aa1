"""Compressed pulls across a real failover (issue 19): a scheduler and two parameter server processes,
`--replicas 1`, two sync workers pulling `topk:0.05` in this process over real channels.

Once the scheduler reports server 0 an in-sync backup of server 1, server 1 is SIGKILLed. The promoted
backup holds no pull copies (they are never replicated), so the next compressed pull of server 1's
slices is refused with PullBaseLostError before anything of the step applies, and resent whole. The
servers' weights must then be bit-identical to the same steps on servers that never failed (sync
mode's union batch, each push applied once), and a whole pull gives every worker exactly those values.
The same refusal and resend for one server SIGKILLed and started again from its checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import Layout, ParamSpec, plan_layout
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.compression import Compression
from pshard.common.errors import PullTimeoutError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.ps_server.service import ServerThread
from pshard.ps_server.settings import ServerSettings

from tests.e2e.harness import LocalCluster, Procs, wait_healthy

WAIT_S = 20.0
WORKERS = ("worker-0", "worker-1")
NUMEL = 20_000
SLICE_BYTES = 16_000  # five slices, spread over both servers
JOB = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.5),
                compression=Compression("topk:1", pull="topk:0.05"))
STEPS_BEFORE, STEPS_AFTER = 3, 2


def _initial() -> dict[str, np.ndarray]:
    return {"a": np.random.default_rng(0).standard_normal(NUMEL, dtype=np.float32)}


def _grads(worker: int, clock: int) -> dict[str, np.ndarray]:
    return {"a": np.random.default_rng(100 * clock + worker).standard_normal(NUMEL, dtype=np.float32)}


def _step(pool: ThreadPoolExecutor, clients: list[PSClient], clock: int) -> list[np.ndarray]:
    steps = [pool.submit(c.push_pull, _grads(i, clock), clock) for i, c in enumerate(clients)]
    return [step.result()["a"] for step in steps]


def _pull_whole(pool: ThreadPoolExecutor, clients: list[PSClient], clock: int) -> list[np.ndarray]:
    """Every worker's copy dropped, then pulled: the servers' values, whole."""
    for client in clients:
        assert client.pull_compression is not None and client.layout is not None
        client.pull_compression.lost(client.layout.slices)
    pulls = [pool.submit(c.pull, clock) for c in clients]
    return [p.result()["a"] for p in pulls]


def _bases(client: PSClient, server: str) -> list[int]:
    """The worker's count of compressed pulls of each slice `server` serves."""
    layout, decoder = client.layout, client.pull_compression
    assert layout is not None and decoder is not None
    index = layout.servers.index(server)
    return [decoder.pack(s).base for s in layout.slices_on(index)]


@pytest.fixture
def reference(start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient]
              ) -> Iterator[np.ndarray]:
    """The same steps on two in-process servers that never fail, without replicas: their weights."""
    servers = [start_server(ServerSettings(static_quorum=dict.fromkeys(WORKERS, 0))) for _ in range(2)]
    layout = plan_layout([ParamSpec("a", "float32", (NUMEL,))], [s.address for s in servers],
                         slice_bytes=SLICE_BYTES)
    clients = [new_client(servers, w, layout=layout, transport="grpc") for w in WORKERS]
    for client in clients:
        client.declare(_initial(), JOB)
    with ThreadPoolExecutor(2) as pool:
        for clock in range(STEPS_BEFORE + STEPS_AFTER):
            _step(pool, clients, clock)
        yield _pull_whole(pool, clients, STEPS_BEFORE + STEPS_AFTER - 1)[0]


def test_a_compressed_pull_from_a_promoted_backup_is_refused_and_resent_whole(
        procs: Procs, new_client: Callable[..., PSClient], reference: np.ndarray,
        caplog: pytest.LogCaptureFixture) -> None:
    cluster = LocalCluster(procs, num_ps=2, num_workers=2)
    scheduler, _, victim = cluster.start_servers("--replicas", "1")
    addresses = [cluster.task(f"ps-{i}").address for i in range(2)]
    members = [SchedulerClient(cluster.task("scheduler").address, "worker", node_id=w, rank_hint=i)
               for i, w in enumerate(WORKERS)]
    try:
        for member in members:
            member.register()
        members[0].wait_for_view(lambda v: len(v.live("ps")) == 2, WAIT_S)
        layouts = [m.propose_layout([ParamSpec("a", "float32", (NUMEL,))], slice_bytes=SLICE_BYTES,
                                    replicas=1) for m in members]
        assert layouts[0] == layouts[1] and all(layouts[0].slices_on(i) for i in range(2))
        clients = [new_client(addresses, w, layout=layouts[i], transport="grpc", reroute_wait_s=WAIT_S,
                              generation=lambda m=m: m.generation, relayout=_newer_layout(m),
                              dead_after_s=2.0)
                   for i, (w, m) in enumerate(zip(WORKERS, members, strict=True))]
        for client in clients:
            client.declare(_initial(), JOB)
        with ThreadPoolExecutor(2) as pool:
            for clock in range(STEPS_BEFORE):
                _step(pool, clients, clock)
            assert _bases(clients[0], addresses[1]) == [STEPS_BEFORE] * len(layouts[0].slices_on(1))
            scheduler.wait_for_line(rf"ROLE: {re.escape(addresses[0])} is an in-sync backup of "
                                    rf"{re.escape(addresses[1])}", WAIT_S)
            moved, kept = len(layouts[0].slices_on(1)), len(layouts[0].slices_on(0))
            victim.kill()

            with caplog.at_level(logging.INFO, logger="pshard.client"):
                got = _step(pool, clients, STEPS_BEFORE)
            assert all(c.layout is not None and c.layout.version > layouts[0].version for c in clients)
            refused = [r for r in caplog.records if "pulling those slices whole" in r.getMessage()]
            # Each worker's compressed pull of the moved slices was refused by the promoted backup.
            said = [r.getMessage() for r in refused]
            assert len(said) == 2, said
            assert all(m.startswith(f"server {addresses[0]}: compressed pull") for m in said), said
            # The refusal names no slice set the worker could trust, so it re-pulled every slice of that
            # request whole: the moved ones and the promoted server's own (its count restarts at 1).
            for client in clients:
                assert _bases(client, addresses[0]) == [1] * (moved + kept)
            assert got[0].tobytes() == got[1].tobytes()
            for clock in range(STEPS_BEFORE + 1, STEPS_BEFORE + STEPS_AFTER):
                _step(pool, clients, clock)
            whole = _pull_whole(pool, clients, STEPS_BEFORE + STEPS_AFTER - 1)
        # (b) What the servers hold is what servers that never failed hold; (a) each worker got it exactly.
        assert whole[0].tobytes() == reference.tobytes()
        assert whole[1].tobytes() == reference.tobytes()
        for client in clients:
            assert client.pull_compression is not None
            assert client.pull_compression.copy_of("a").tobytes() == reference.tobytes()
    finally:
        for member in members:
            member.close()


def _newer_layout(member: SchedulerClient) -> Callable[[Layout, float], Layout | None]:
    """The worker's relayout, as worker/session.py does it: the scheduler's layout once newer."""
    def newer(layout: Layout, timeout_s: float) -> Layout | None:
        try:
            member.wait_for_view(lambda view: view.layout_version > layout.version, timeout_s)
        except PullTimeoutError:
            return None
        got = member.get_layout(timeout_s=max(1.0, timeout_s))
        return got if got.version > layout.version else None
    return newer



def test_a_compressed_pull_from_a_server_restarted_from_its_checkpoint_is_resent_whole(
        procs: Procs, new_client: Callable[..., PSClient], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """A server SIGKILLed and started again at its address from its checkpoint holds no pull copies
    (they are not checkpointed): the worker's next compressed pull is refused and resent whole."""
    cluster = LocalCluster(procs, num_ps=1, num_workers=1)
    args = ("--no-scheduler", "--workers", "w0", "--checkpoint-dir", str(tmp_path / "ckpt"))
    address = cluster.task("ps-0").address
    server = cluster.start_ps(0, *args)
    wait_healthy(address, proc=server)
    job = dataclasses.replace(JOB, mode="async", job_id="job", optimizer=OptimizerConfig(name="sgd", lr=1.0))
    client = new_client([address], "w0", transport="grpc")
    want = _initial()["a"]
    client.declare({"a": want.copy()}, job)
    for clock in range(4):
        client.push_pull(_grads(0, clock), clock)
        want = want - _grads(0, clock)["a"]
        if clock == 2:
            client.checkpoint()
            saved = want
    assert _bases(client, address) == [4] * len(client.layout.slices)
    server.kill()
    again = cluster.start_ps(0, *args)
    again.wait_for_line(r"restoring checkpoint", WAIT_S)
    wait_healthy(address, proc=again)

    with caplog.at_level(logging.INFO, logger="pshard.client"):
        got = client.push_pull(_grads(0, 4), 4)["a"]
    said = [r.getMessage() for r in caplog.records if "pulling those slices whole" in r.getMessage()]
    assert len(said) == 1 and "this server holds no copy" in said[0], said
    assert _bases(client, address) == [1] * len(client.layout.slices)
    # The step after the checkpoint is lost (the server says so); the one resent applied once, and the
    # worker holds exactly the server's value, as a fresh whole pull shows.
    assert got.tobytes() == (saved - _grads(0, 4)["a"]).tobytes()
    with ThreadPoolExecutor(1) as pool:
        assert _pull_whole(pool, [client], 4)[0].tobytes() == got.tobytes()
