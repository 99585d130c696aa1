"""Replication and failover through real servers and channels (docs/architecture.md, 9 Failures).

Three servers, replicas 1: every server's slices are copied to the next one in ring order before a
push is acknowledged. The backups must hold bit-identical weights, optimizer state, versions and
clocks; after a primary is stopped and its backup promoted, training resumes on the new layout and
ends bit-for-bit where an undisturbed run without replication ends.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import Layout, ParamSpec, plan_layout
from pshard.common.cluster.replicas import fail_over
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.rpc.serving import ServerThread
from pshard.ps_server.replication.dense import Replicator
from pshard.ps_server.replication.link import grpc_sender, tcp_links
from pshard.ps_server.settings import ServerSettings
from pshard.ps_server.transport import fastpath

from tests.e2e.harness import wait_until

WAIT_S = 10.0
WORKERS = ("w0", "w1")
ADAM = JobConfig(mode="sync", optimizer=OptimizerConfig(name="adam", lr=0.01))
SHAPES = {"a": (300,), "b": (64, 8), "c": (5,), "d": (700,)}


def _initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _grads(worker: str, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([WORKERS.index(worker), step])
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def _layout(addresses: Sequence[str], replicas: int) -> Layout:
    specs = [ParamSpec(k, "float32", s) for k, s in SHAPES.items()]
    return plan_layout(specs, addresses, slice_bytes=1024, replicas=replicas)


def _replicated(start_server: Callable[..., ServerThread], n: int, shm_dir: Path | None = None,
                backup_transport: str = "auto", tcp: bool = False) -> list[ServerThread]:
    """`n` servers, each forwarding to the next in ring order (what follow_scheduler sets up from views);
    with `shm_dir`, through shared memory there, else inline in the Replicate calls, or with `tcp`
    over raw TCP links to the backups' fast-path listeners. A backup whose transport offers no
    shared memory refuses the segments."""
    shm = {} if shm_dir is None else {"shm_dir": str(shm_dir), "transport": backup_transport}
    servers = [start_server(ServerSettings(replicas=1, static_quorum=dict.fromkeys(WORKERS, 0), **shm))
               for _ in range(n)]
    for i, server in enumerate(servers):
        handlers = server.running.handlers
        backup = servers[(i + 1) % n].address

        def wire(handlers=handlers, server=server, backup=backup) -> None:
            replicator = Replicator(server.address, grpc_sender(), server.loop,
                                    shm_dir=None if shm_dir is None else str(shm_dir),
                                    links=tcp_links(server.address) if tcp else None)
            handlers.enable_replication(replicator)
            replicator.set_backups([backup])
        server.call(wire)
    return servers


def _replicator(server: ServerThread) -> Replicator:
    """The replication `_replicated` gave `server`."""
    replicator = server.running.handlers.replication
    assert isinstance(replicator, Replicator)
    return replicator


def _train(clients: dict[str, PSClient], steps: range, job: JobConfig,
           initial: dict[str, np.ndarray] | None = None) -> dict[str, dict[str, np.ndarray]]:
    def run(worker: str) -> dict[str, np.ndarray]:
        client = clients[worker]
        weights = client.declare(initial, job) if initial is not None else {}
        for step in steps:
            weights = client.push_pull(_grads(worker, step), step)
        return weights

    with ThreadPoolExecutor(len(clients)) as pool:
        futures = {w: pool.submit(run, w) for w in clients}
        return {w: f.result(timeout=4 * WAIT_S) for w, f in futures.items()}


def _assert_backups_identical(servers: list[ServerThread]) -> int:
    """Every primary slice equals its copy on the next server, bit for bit; the number compared."""
    compared = 0
    for i, server in enumerate(servers):
        backup = servers[(i + 1) % len(servers)].running.handlers.replica_set
        for slot in server.running.handlers.store.slots():
            [copy] = [s for s in backup._slots.values() if s.key == slot.key]
            assert copy.version == slot.version and copy.last_clock == slot.last_clock
            assert copy.value.tobytes() == slot.value.tobytes(), slot.key
            assert copy.opt_state.keys() == slot.opt_state.keys()
            for name, value in slot.opt_state.items():
                other = copy.opt_state[name]
                if isinstance(value, np.ndarray):
                    assert other.tobytes() == value.tobytes(), (slot.key, name)
                else:
                    assert other == value, (slot.key, name)
            compared += 1
    return compared


@pytest.fixture
def reference(start_server, new_client) -> dict[str, np.ndarray]:
    """Eight sync steps on three servers without replication."""
    servers = [start_server(ServerSettings(static_quorum=dict.fromkeys(WORKERS, 0))) for _ in range(3)]
    layout = _layout([s.address for s in servers], 0)
    clients = {w: new_client(servers, w, layout=layout) for w in WORKERS}
    result = _train(clients, range(8), ADAM, _initial())
    assert result["w0"].keys() == result["w1"].keys()
    return result["w0"]


@pytest.mark.parametrize(("shm", "tcp"), [(False, False), (True, False), (True, True)],
                         ids=["inline", "shm", "shm-over-tcp-link"])
def test_backups_hold_the_primaries_state_bit_for_bit(start_server, new_client, reference, shm, tcp,
                                                      tmp_path):
    servers = _replicated(start_server, 3, tmp_path if shm else None, tcp=tcp)
    layout = _layout([s.address for s in servers], 1)
    clients = {w: new_client(servers, w, layout=layout) for w in WORKERS}
    _train(clients, range(4), ADAM, _initial())
    assert _assert_backups_identical(servers) == len(layout.slices)
    # The view moves server 0's backup from server 1 to server 2: server 2 gets the whole state, and
    # server 1 is told to drop its now stale copies.
    mine = {s.key for s in servers[0].running.handlers.store.slots()}
    servers[0].call(lambda: _replicator(servers[0]).set_backups([servers[2].address]))
    held = servers[2].running.handlers.replica_set
    wait_until(lambda: mine <= set(held.keys()), WAIT_S, "server 2 to hold server 0's slices")
    stale = servers[1].running.handlers.replica_set
    wait_until(lambda: not mine & set(stale.keys()), WAIT_S, "server 1 to drop server 0's copies")
    _train(clients, range(4, 6), ADAM)
    for slot in servers[0].running.handlers.store.slots():
        assert held._slots[slot.key].value.tobytes() == slot.value.tobytes()
        # Through shared memory the copy is a read-only view of the primary's segment, not bytes of its own.
        assert held._slots[slot.key].value.flags.writeable is not shm
    assert list(tmp_path.glob("*.seg")) == []  # each segment unlinked once its backup had opened it
    if tcp:  # the calls that name the segments went over the raw links, with no bytes of their own
        for server in servers:
            assert _replicator(server)._links.calls > 0
            assert not _replicator(server)._links._down
            traffic = dict(server.running.handlers.requests.items())
            assert ("tcp", "Replicate") in traffic and traffic["tcp", "Replicate"].bytes_in == 0


def _replicated_bytes(server: ServerThread, transport: str) -> int:
    """Bytes of Replicate requests `server` received over `transport`."""
    return sum(t.bytes_in for (kind, method), t in server.running.handlers.requests.items()
               if (kind, method) == (transport, "Replicate"))


def test_without_shared_memory_the_states_go_over_raw_tcp_links(start_server, new_client, reference):
    servers = _replicated(start_server, 3, tcp=True)
    layout = _layout([s.address for s in servers], 1)
    clients = {w: new_client(servers, w, layout=layout) for w in WORKERS}
    result = _train(clients, range(8), ADAM, _initial())
    assert _assert_backups_identical(servers) == len(layout.slices)
    for server in servers:
        assert _replicator(server)._links.calls > 0
        assert not _replicator(server)._links._down  # no batch fell back to gRPC
        assert _replicated_bytes(server, "tcp") > 0  # the records' bytes came in tcp frames
    for key, expected in reference.items():
        assert result["w0"][key].tobytes() == expected.tobytes(), key


def test_a_tcp_link_reset_mid_batch_resends_the_batch_over_grpc(start_server, new_client, reference,
                                                               monkeypatch):
    servers = _replicated(start_server, 3, tcp=True)
    layout = _layout([s.address for s in servers], 1)
    clients = {w: new_client(servers, w, layout=layout) for w in WORKERS}
    _train(clients, range(2), ADAM, _initial())
    serve = fastpath.serve_replicate
    broken: list[str] = []

    async def reset_once(handlers, header, metas, views):
        # The whole batch is in (the backup may apply it too): the link is reset before the reply.
        if not broken:
            primary = header.replicate.primary
            broken.append(primary)
            server = next(s for s in servers if s.running.handlers is handlers)
            assert server.running.fast.disconnect(primary) == 1
        return await serve(handlers, header, metas, views)

    monkeypatch.setattr(fastpath, "serve_replicate", reset_once)
    result = _train(clients, range(2, 8), ADAM)
    assert broken, "no batch went over a tcp link after the first steps"
    [primary] = [s for s in servers if s.address == broken[0]]
    links = _replicator(primary)._links
    assert list(links._down) == [_replicator(primary).backups[0]]  # gRPC from then on
    for key, expected in reference.items():  # nothing lost, nothing doubled
        assert result["w0"][key].tobytes() == expected.tobytes(), key
    assert _assert_backups_identical(servers) == len(layout.slices)


def test_a_backup_that_cannot_map_the_segments_gets_the_states_inline(start_server, new_client, tmp_path):
    servers = _replicated(start_server, 3, tmp_path, backup_transport="grpc")
    layout = _layout([s.address for s in servers], 1)
    clients = {w: new_client(servers, w, layout=layout) for w in WORKERS}
    _train(clients, range(3), ADAM, _initial())
    assert _assert_backups_identical(servers) == len(layout.slices)
    for server in servers:
        [backup] = _replicator(server)._backups.values()
        assert not backup.link.segmented  # fell back for good


@pytest.mark.parametrize("shm", [False, True], ids=["inline", "shm"])
def test_a_promoted_backup_continues_bit_for_bit_and_drops_resent_pushes(start_server, new_client, reference,
                                                                         shm, tmp_path):
    servers = _replicated(start_server, 3, tmp_path if shm else None)
    addresses = [s.address for s in servers]
    layout = _layout(addresses, 1)
    assert layout.slices_on(1), "the test needs slices on the server it stops"
    clients = {w: new_client(servers, w, layout=layout) for w in WORKERS}
    _train(clients, range(4), ADAM, _initial())
    # Clock 4 half done: w0's push reached every server (server 1 holds it, unreplicated, pending).
    clients["w0"].wait(clients["w0"].push(_grads("w0", 4), 4))
    servers[1].stop(grace_s=0)
    moved, _ = fail_over(layout, 1, {0, 2})
    # The view without server 1 (follow_scheduler): each survivor backs the other up; server 0's
    # slices are copied whole to server 2, server 2's (its own and the promoted ones) to server 0.
    for me, other in ((0, 2), (2, 0)):
        servers[me].call(lambda me=me, other=other: _replicator(servers[me]).set_backups(
            [addresses[other]]))
    # The workers re-route: the whole step again on the new layout (duplicates are dropped), then on.
    for client in clients.values():
        client.set_layout(moved)
    # A worker restarted now declares its initial values: the heir answers with the trained copy
    # (promoting it), never a fresh slice, and the others' training is unchanged.
    initial = _initial()
    declared = new_client(servers, "w9", layout=moved).declare(initial, ADAM)
    for s in layout.slices_on(1):
        part = slice(s.offset, s.offset + s.numel)
        assert declared[s.key].reshape(-1)[part].tobytes() != initial[s.key].reshape(-1)[part].tobytes(), s
    result = _train(clients, range(4, 8), ADAM)
    for worker in WORKERS:
        for key, expected in reference.items():
            assert result[worker][key].tobytes() == expected.tobytes(), (worker, key)
    assert servers[2].running.handlers.promotions == len(layout.slices_on(1))
    stats = servers[2].call(servers[2].running.handlers.stats)
    assert stats.failovers == 1 and stats.replication_lag == 0  # every step acknowledged by now
    # The replica count is back: the survivors hold each other's slices, promoted ones included.
    assert _assert_backups_identical([servers[0], servers[2]]) == len(layout.slices)


def test_a_primary_declared_dead_that_comes_back_refuses_and_the_workers_re_route(start_server, new_client,
                                                                                  reference):
    servers = _replicated(start_server, 3)
    addresses = [s.address for s in servers]
    layout = _layout(addresses, 1)
    moved, _ = fail_over(layout, 1, {0, 2})
    moved = dataclasses.replace(moved, version=layout.version + 1)
    published = threading.Event()  # the scheduler's failover layout, once "published"

    def relayout(current: Layout, timeout_s: float) -> Layout | None:
        return moved if published.wait(timeout_s) and moved.version > current.version else None

    clients = {w: new_client(servers, w, layout=layout, relayout=relayout, reroute_wait_s=WAIT_S)
               for w in WORKERS}
    _train(clients, range(4), ADAM, _initial())
    # Server 1 was declared dead (a pause), and is back, live in the view again (so every server's
    # backups are as before): the new layout holds nothing of it. Its old slices must not take a step.
    servers[1].call(lambda: servers[1].running.handlers.set_ownership(moved.version, frozenset()))
    published.set()
    result = _train(clients, range(4, 8), ADAM)
    for worker in WORKERS:
        assert clients[worker].reroutes == 1
        for key, expected in reference.items():
            assert result[worker][key].tobytes() == expected.tobytes(), (worker, key)
    assert {s.version for s in servers[1].running.handlers.store.slots()} == {4}


def test_a_promoted_backup_drops_a_scheduled_call_re_dispatched_after_the_primary_died(start_server,
                                                                                        new_client):
    # A coordinator's call ran on w0 and its push was applied (and acknowledged, so replicated); the primary
    # died before the call's result came back, so the coordinator runs it again on w1, same schedule id.
    job = dataclasses.replace(ADAM, mode="async")
    servers = _replicated(start_server, 3)
    layout = _layout([s.address for s in servers], 1)
    clients = {w: new_client(servers, w, layout=layout) for w in WORKERS}
    for client in clients.values():
        client.declare(_initial(), job)
    call = ((1 << 32) + 5, 0, 1 << 32)  # (schedule id, push number, floor), as WorkerContext stamps them
    clients["w0"].scheduled = call
    first = clients["w0"].wait(clients["w0"].push(_grads("w0", 0), 0))
    assert first.applied == len(layout.slices) and first.dropped == 0
    before = clients["w0"].pull(0)
    servers[1].stop(grace_s=0)
    moved, _ = fail_over(layout, 1, {0, 2})
    clients["w1"].set_layout(moved)
    clients["w1"].scheduled = call
    again = clients["w1"].wait(clients["w1"].push(_grads("w0", 0), 0))
    assert (again.applied, again.dropped) == (0, len(layout.slices))  # the heir's slices included
    after = clients["w1"].pull(0)
    for key, value in before.items():
        assert after[key].tobytes() == value.tobytes(), key
