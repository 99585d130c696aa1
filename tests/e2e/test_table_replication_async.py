"""Zero lost table updates with replicas, async (issue 10, docs/architecture.md 9 Failures).

Real processes: a scheduler and three servers with `--replicas 1`; six concurrent clients push integer
gradients to the rows of one sparse table (SGD at lr 1, zero initial rows) while one server is
SIGKILLed mid-run. The scheduler declares it dead and moves its row partition to its backup, which
merges its replica rows; the clients re-route and resend what was not acknowledged, each push with
its idempotence key. Integer gradients sum exactly in float32, in any order, so the final rows must
equal minus the sum of every acknowledged gradient, exactly: a lost update, or one applied twice,
shows.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import Layout, ParamSpec
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.sparse import TableConfig, server_of

from tests.e2e.harness import LocalCluster, Proc, Procs, wait_healthy, wait_until
from tests.e2e.test_replication_async import _newer_layout

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]  # the run itself is bounded by RUN_TIMEOUT_S

CLIENTS = 6
PUSHES = 50  # per client
KILL_AFTER = 90  # acknowledged pushes in all, before the SIGKILL
DIM = 8
TABLE = TableConfig("emb", DIM, optimizer="sgd", lr=1.0, initializer="zeros")
IDS = np.arange(0, 3000, 3, dtype=np.int64)
STEP_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 150.0


def _batch(client: int, push: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([client, push])
    ids = rng.choice(IDS, size=200)  # repeats: the client sums them
    return ids, rng.integers(-3, 4, size=(len(ids), DIM)).astype(np.float32)


class ReplicatedJob(NamedTuple):
    started: list[Proc]  # the scheduler, ps-0, ps-1, ps-2
    scheds: list[SchedulerClient]  # each client's registration
    layout: Layout
    clients: list[PSClient]


def job_cluster(procs: Procs, workers: int, partitions_per_server: int = 1) -> LocalCluster:
    return LocalCluster(procs, num_ps=3, num_workers=workers,
                        scheduler_args=("--row-partitions-per-server", str(partitions_per_server)))


def replicated_job(procs: Procs, workers: int, partitions_per_server: int = 1,
                   ps_args: Mapping[int, tuple[str, ...]] | None = None,
                   cluster: LocalCluster | None = None, replicas: int = 1,
                   ps_env: Mapping[int, Mapping[str, str]] | None = None) -> ReplicatedJob:
    """A scheduler and three servers with `--replicas 1` (ps-i with `ps_args[i]` too), and `workers`
    registered clients that re-route on a failover; the job's layout (a tiny dense parameter) carries
    the replica count and the row partitions (`partitions_per_server` each). `cluster`: the caller's
    (to start its scheduler again), made as `job_cluster` makes it. `replicas` 0: the same job without
    replicas; `ps_env[i]`: environment variables of ps-i (a failpoint)."""
    cluster = cluster or job_cluster(procs, workers, partitions_per_server)
    flags = ("--replicas", str(replicas)) if replicas else ()
    started = [cluster.start_scheduler(),
               *(cluster.start_ps(i, *flags, *(ps_args or {}).get(i, ()), env=(ps_env or {}).get(i))
                 for i in range(3))]
    for task, proc in zip(cluster.plan.servers, started, strict=True):
        wait_healthy(task.address, proc=proc)
    ps = [cluster.task(f"ps-{i}").address for i in range(3)]
    scheds = [SchedulerClient(cluster.plan.scheduler, "worker", node_id=f"worker-{i}", rank_hint=i,
                              own_address=cluster.task(f"worker-{i}").address, connect_timeout_s=30.0)
              for i in range(workers)]
    for s in scheds:
        s.register()
    layout = scheds[0].propose_layout([ParamSpec("bias", "float32", (4,))], servers=ps, replicas=replicas)
    assert layout.replicas == replicas
    clients = [PSClient(ps, f"worker-{i}", layout=layout, generation=lambda s=scheds[i]: s.generation,
                        timeout_s=STEP_TIMEOUT_S, transport="auto", relayout=_newer_layout(scheds[i]),
                        reroute_wait_s=10.0) for i in range(workers)]
    return ReplicatedJob(started, scheds, layout, clients)


def test_async_table_clients_lose_no_acknowledged_update_when_a_server_is_sigkilled(procs: Procs) -> None:
    started, scheds, layout, clients = replicated_job(procs, CLIENTS)
    assert layout.owners() == (0, 1, 2)
    acked = np.zeros((len(IDS), DIM), np.float64)
    lock = threading.Lock()
    count = [0]

    def run(i: int) -> None:
        clients[i].declare_table(TABLE)
        for push in range(PUSHES):
            ids, grads = _batch(i, push)
            clients[i].push_rows(TABLE.name, ids, grads)  # returns once acknowledged
            with lock:
                np.add.at(acked, np.searchsorted(IDS, ids), grads)
                count[0] += 1

    # Every server must hold rows of its own partition, so the victim's loss would show.
    assert set(server_of(IDS, 3).tolist()) == {0, 1, 2}
    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(run, i) for i in range(CLIENTS)]
            wait_until(lambda: count[0] >= KILL_AFTER or any(f.done() for f in futures), RUN_TIMEOUT_S,
                       f"{KILL_AFTER} acknowledged pushes")
            # Only a copy the scheduler counts in sync is promoted: killed before that, ps-1's partition
            # is refused a failover (FAILOVER IMPOSSIBLE) and every push to it waits out its deadline.
            # Under load the report can come after the pushes counted above, so the kill waits for it.
            in_sync = f"is an in-sync backup of {layout.servers[1]}"
            wait_until(lambda: any(in_sync in line for line in started[0].lines), RUN_TIMEOUT_S,
                       f"the scheduler counting a backup of ps-1 ({layout.servers[1]}) in sync")
            os.kill(started[2].pid, signal.SIGKILL)  # started: scheduler, ps-0, ps-1, ps-2: ps-1
            for f in futures:
                f.result(timeout=RUN_TIMEOUT_S)
        assert count[0] == CLIENTS * PUSHES
        final = clients[0].pull_rows(TABLE.name, IDS)
        np.testing.assert_array_equal(final, -acked.astype(np.float32))
        after = scheds[0].get_layout(timeout_s=5.0)
        assert after.version > layout.version and after.row_owner(1) == 2, "no failover happened"
        assert sum(c.tables.reroutes for c in clients) > 0
    finally:
        for c in clients:
            c.close()
        for s in scheds:
            s.close()
