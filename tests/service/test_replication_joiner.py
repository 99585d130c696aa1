"""A joiner's catch-up copy through real servers and channels (issue 20: no step waits on a join).

A server joining a running job copies its donor's slices beside the donor's backup (pshard.common.cluster.
replicas.joining_backups). While it catches up it is not a copy the workers' acknowledgements depend on:
a joiner that is slow, held, or killed mid-copy stalls none of the donor's steps, and is not reported in
sync. Once it holds every slice it counts as a backup does: from then on no step is acknowledged before it
has it, so the scheduler may switch slices onto it. The same for a primary's table rows.
"""

from __future__ import annotations

import dataclasses
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.ps_server.replication.dense import Replicator
from pshard.ps_server.replication.link import grpc_sender
from pshard.ps_server.settings import ServerSettings

from tests.e2e.harness import free_port, wait_until
from tests.service.test_table_replication import CONFIG, IDS, _grads, _layout, _replicated, _rows

WAIT_S = 10.0
STEP_S = 5.0  # far above a step on two local servers, far below the request's deadline
SGD = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=0.1))
SHAPES = {"a": (300,), "b": (64, 8), "c": (5,)}


def test_a_joiner_gone_mid_copy_stalls_no_step_and_one_caught_up_holds_every_acknowledged_step(
        start_server, new_client):
    servers = [start_server(ServerSettings(replicas=1, static_quorum={"w0": 0})) for _ in range(3)]
    primary, backup, joiner = servers
    layout = plan_layout([ParamSpec(k, "float32", s) for k, s in SHAPES.items()], [primary.address],
                         slice_bytes=512)  # the workers' routing: every slice on the primary
    layout = dataclasses.replace(layout, version=1)
    gone = f"127.0.0.1:{free_port()}"  # a joiner SIGKILLed mid-copy: nothing answers there
    holder: list[Replicator] = []

    def wire() -> None:
        replicator = Replicator(primary.address, grpc_sender(), primary.loop)
        primary.running.handlers.enable_replication(replicator)
        replicator.set_backups([backup.address, gone], catching_up=[gone])
        holder.append(replicator)

    primary.call(wire)
    replicator = holder[0]
    client = new_client([primary], "w0", layout=layout)
    rng = np.random.default_rng(0)
    client.declare({k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}, SGD)
    ones = {k: np.ones(s, np.float32) for k, s in SHAPES.items()}
    with ThreadPoolExecutor(1) as pool:
        for clock in range(3):  # acknowledged once the backup has them, the joiner's copy failing meanwhile
            pool.submit(client.push_pull, ones, clock).result(timeout=STEP_S)
    owned = [s.key for s in primary.running.handlers.store.slots()]
    assert primary.call(lambda: replicator.in_sync(owned)) == [backup.address]
    assert primary.call(replicator.copy_bytes_left) > 0  # the joiner's copy, shown as left to come

    # A joiner that answers catches up, then counts: every step acknowledged from then on is on it.
    joining = [joiner.address]
    primary.call(lambda: replicator.set_backups([backup.address, *joining], catching_up=joining))
    wait_until(lambda: joiner.address in primary.call(lambda: replicator.in_sync(owned)), WAIT_S,
               "the joiner caught up")
    client.push_pull(ones, 3)
    copies = joiner.running.handlers.replica_set
    for slot in primary.running.handlers.store.slots():
        [copy] = [s for s in copies._slots.values() if s.key == slot.key]
        assert copy.version == slot.version == 4
        assert copy.value.tobytes() == slot.value.tobytes(), slot.key


def test_a_joiner_gone_mid_copy_stalls_no_table_push_and_one_caught_up_counts_in_sync(start_server,
                                                                                      new_client):
    servers, layout = _replicated(start_server, _layout)
    primary = servers[0]
    client = new_client(servers, "w0", layout=layout)
    client.declare_table(CONFIG)
    client.push_rows("emb", IDS, _grads(0, len(IDS)))  # rows to copy: an empty copy is done at once
    gone = f"127.0.0.1:{free_port()}"  # a joiner SIGKILLed mid-copy: nothing answers there
    primary.call(lambda: _rows(primary).set_backups([servers[1].address, gone], catching_up=[gone]))
    with ThreadPoolExecutor(1) as pool:
        for step in range(1, 4):
            pool.submit(client.push_rows, "emb", IDS, _grads(step, len(IDS))).result(timeout=STEP_S)
    assert primary.call(lambda: _rows(primary).in_sync()) == {servers[1].address}
    joining = [servers[2].address]
    primary.call(lambda: _rows(primary).set_backups([servers[1].address, *joining], catching_up=joining))
    wait_until(lambda: primary.call(lambda: _rows(primary).in_sync()) == {s.address for s in servers[1:]},
               WAIT_S, "the joiner to copy server 0's rows")


def test_a_joiner_of_a_server_without_slices_counts_in_sync_at_once(start_server) -> None:
    """A server serving table rows only (its job's dense slices are on others) has no slice to copy: its
    joiner holds everything at once, else it was never reported in sync and its join never switched."""
    primary, joiner = start_server(ServerSettings(replicas=1)), start_server(ServerSettings(replicas=1))
    holder: list[Replicator] = []

    def wire() -> None:
        replicator = Replicator(primary.address, grpc_sender(), primary.loop)
        primary.running.handlers.enable_replication(replicator)
        replicator.set_backups([joiner.address], catching_up=[joiner.address])
        holder.append(replicator)

    primary.call(wire)
    assert primary.call(lambda: holder[0].in_sync([])) == [joiner.address]
