"""A failover the scheduler refuses fails the workers within seconds, naming the lost server
(docs/architecture.md, 9 Failures).

Real processes: a scheduler and three servers with `--replicas 1`. The dense parameter `b` lives on
ps-1, whose only backup (in ring order) is ps-2. Both are SIGKILLed, ps-2 first, so that no live server
ever holds a copy of `b`: whichever death the scheduler notices first, the failover of `b` is refused
(FAILOVER IMPOSSIBLE), naming ps-1 (or ps-2, when ps-1's death was noticed first and `b` was promoted to
ps-2 before ps-2's). The client's next push, and a table push to ps-1's row partition, must end with
SlicesLostError within a heartbeat timeout and a few seconds, not at their 60 s deadline after a silent
wait for a failover that never comes.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import ParamSpec
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.errors import SlicesLostError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.sparse import TableConfig, server_of

from tests.e2e.harness import SYNC, LocalCluster, Procs
from tests.e2e.test_failures import RESTART_RUN, kill_while_running, wait_for_progress

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

HEARTBEAT_TIMEOUT_S = 1.5
STEP_TIMEOUT_S = 60.0  # the wait the client would otherwise have waited out
JOB = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=1.0))
TABLE = TableConfig("emb", 4, optimizer="sgd", lr=1.0, initializer="zeros")
SHAPES = {"a": (300,), "b": (200,)}  # placed whole: a on ps-0, b on ps-1, nothing dense on ps-2


def test_a_refused_failover_fails_the_dense_and_the_table_pushes_at_once_naming_the_server(
        procs: Procs) -> None:
    cluster = LocalCluster(procs, num_ps=3, num_workers=1,
                           heartbeat_timeout_ms=round(HEARTBEAT_TIMEOUT_S * 1000))
    started = cluster.start_servers("--replicas", "1")  # the scheduler, ps-0, ps-1, ps-2
    ps = [cluster.task(f"ps-{i}").address for i in range(3)]
    sched = SchedulerClient(cluster.plan.scheduler, "worker", own_address=cluster.task("worker-0").address,
                            node_id="worker-0", rank_hint=0, connect_timeout_s=30.0)
    sched.register()
    specs = [ParamSpec(k, "float32", s) for k, s in SHAPES.items()]
    layout = sched.propose_layout(specs, slice_bytes=1 << 20, servers=ps, replicas=1)
    assert [[s.key for s in layout.slices_on(i)] for i in range(3)] == [["a"], ["b"], []]
    client = PSClient(ps, "worker-0", layout=layout, generation=lambda: sched.generation,
                      timeout_s=STEP_TIMEOUT_S, transport="auto", relayout=sched.newer_layout,
                      reroute_wait_s=STEP_TIMEOUT_S)
    ids = np.arange(0, 300, dtype=np.int64)
    ids = ids[server_of(ids, 3) == 1][:16]  # rows of ps-1's partition only
    try:
        client.declare_table(TABLE)
        client.declare({k: np.zeros(s, np.float32) for k, s in SHAPES.items()}, JOB)
        grads = {k: np.ones(s, np.float32) for k, s in SHAPES.items()}
        client.wait(client.push(grads, 0))
        client.push_rows(TABLE.name, ids, np.ones((len(ids), 4), np.float32))
        os.kill(started[3].pid, signal.SIGKILL)  # ps-2, the only backup of ps-1
        os.kill(started[2].pid, signal.SIGKILL)  # ps-1
        killed = time.monotonic()

        pushed = client.push(grads, 1)
        with pytest.raises(SlicesLostError) as lost:
            client.wait(pushed, timeout_s=HEARTBEAT_TIMEOUT_S + 10)
        took = time.monotonic() - killed

        assert took < HEARTBEAT_TIMEOUT_S + 5, f"the push failed {took:.1f} s after the kill"
        named = str(lost.value.facts["server"]).split(",")
        assert set(named) <= {ps[1], ps[2]} and named, lost.value.facts
        assert any(f"({address}) is lost" in str(lost.value) for address in named)
        assert "parameter(s) (b;" in str(lost.value) and "--checkpoint-dir" in str(lost.value)
        # The table path: its request for ps-1's partition fails the same way, at once (the view names it).
        start = time.monotonic()
        with pytest.raises(SlicesLostError, match=r"row partition\(s\) \[1"):
            client.push_rows(TABLE.name, ids, np.ones((len(ids), 4), np.float32))
        assert time.monotonic() - start < 5.0
        assert any("FAILOVER IMPOSSIBLE" in line for line in started[0].lines)
    finally:
        client.close()
        sched.close()


def test_workers_exit_within_seconds_with_the_lost_slices_as_their_final_error(procs: Procs) -> None:
    # `pshard worker` ended at its step timeout (here 120 s) after resending every second; now its step
    # fails with SlicesLostError once the scheduler refuses the failover, and that is its last word.
    cluster = LocalCluster(procs, num_ps=3, num_workers=1,
                           heartbeat_timeout_ms=round(HEARTBEAT_TIMEOUT_S * 1000))
    servers = cluster.start_servers("--replicas", "1")  # the scheduler, ps-0, ps-1, ps-2
    flags = ("--replicas", "1", "--step-timeout-s", "120", "--startup-timeout-s", "30")
    worker = cluster.start_worker(0, *SYNC, *RESTART_RUN, *flags)
    wait_for_progress(cluster, "worker-0")

    kill_while_running(servers[3])  # ps-2, the only backup of ps-1
    kill_while_running(servers[2])  # ps-1
    killed = time.monotonic()
    code = worker.wait(60)

    assert time.monotonic() - killed < HEARTBEAT_TIMEOUT_S + 10, worker.output()
    assert code == 1, worker.output()
    final = worker.final()
    assert final is not None and final.get("failed") == "slices_lost", worker.output()
    error = [line for line in worker.lines if "pshard.worker: error:" in line]
    assert len(error) == 1 and "SlicesLostError: parameter server" in error[0], worker.output()
    lost = {cluster.task("ps-1").address, cluster.task("ps-2").address}
    assert any(f"({address}) is lost" in error[0] for address in lost), error[0]
    assert "--checkpoint-dir" in error[0], error[0]
