"""Zero lost updates with replicas, async (issue 10, docs/architecture.md 9 Failures).

Real processes: a scheduler and three servers with `--replicas 1`; eight concurrent clients push
integer gradients with SGD at lr 1 while one server is SIGKILLed mid-run. The scheduler declares it
dead, promotes its backup, the clients re-route and resend what was not acknowledged. Integer
gradients sum exactly in float32, in any order, so the final values must equal the initial ones
minus the sum of every acknowledged gradient, exactly: a lost update, or one applied twice, shows.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import Layout, ParamSpec
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.errors import PullTimeoutError
from pshard.common.job import JobConfig, OptimizerConfig

from tests.e2e.harness import LocalCluster, Procs, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]  # the run itself is bounded by RUN_TIMEOUT_S

CLIENTS = 8
PUSHES = 60  # per client
KILL_AFTER = 120  # acknowledged pushes in all, before the SIGKILL
SHAPES = {"a": (2000,), "b": (700,), "c": (50,)}
JOB = JobConfig(mode="async", optimizer=OptimizerConfig(name="sgd", lr=1.0))
STEP_TIMEOUT_S = 60.0
RUN_TIMEOUT_S = 180.0


def _newer_layout(sched: SchedulerClient) -> Callable[[Layout, float], Layout | None]:
    def relayout(layout: Layout, timeout_s: float) -> Layout | None:
        try:
            sched.wait_for_view(lambda view: view.layout_version > layout.version, timeout_s)
        except PullTimeoutError:
            return None
        newer = sched.get_layout(timeout_s=max(1.0, timeout_s))
        return newer if newer.version > layout.version else None
    return relayout


def _grads(client: int, push: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([client, push])
    return {k: rng.integers(-3, 4, size=s).astype(np.float32) for k, s in SHAPES.items()}


def test_async_clients_lose_no_acknowledged_update_when_a_server_is_sigkilled(procs: Procs) -> None:
    cluster = LocalCluster(procs, num_ps=3, num_workers=CLIENTS)
    started = cluster.start_servers("--replicas", "1")
    scheduler = cluster.plan.scheduler
    ps = [cluster.task(f"ps-{i}").address for i in range(3)]
    scheds = [SchedulerClient(scheduler, "worker", own_address=cluster.task(f"worker-{i}").address,
                              node_id=f"worker-{i}", rank_hint=i, connect_timeout_s=30.0)
              for i in range(CLIENTS)]
    for s in scheds:
        s.register()
    specs = [ParamSpec(k, "float32", s) for k, s in SHAPES.items()]
    layout = scheds[0].propose_layout(specs, slice_bytes=1024, servers=ps, replicas=1)
    assert layout.replicas == 1 and layout.slices_on(1)
    clients = [PSClient(ps, f"worker-{i}", layout=layout, generation=lambda s=scheds[i]: s.generation,
                        timeout_s=STEP_TIMEOUT_S, transport="auto", relayout=_newer_layout(scheds[i]),
                        reroute_wait_s=10.0) for i in range(CLIENTS)]
    initial = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}
    acked = {k: np.zeros(s, np.float64) for k, s in SHAPES.items()}
    lock = threading.Lock()
    count = [0]

    def run(i: int) -> None:
        clients[i].declare(initial, JOB, slice_bytes=1024)
        for push in range(PUSHES):
            grads = _grads(i, push)
            clients[i].wait(clients[i].push(grads, push))  # returns once acknowledged
            with lock:
                for k, g in grads.items():
                    acked[k] += g
                count[0] += 1

    try:
        with ThreadPoolExecutor(CLIENTS) as pool:
            futures = [pool.submit(run, i) for i in range(CLIENTS)]
            wait_until(lambda: count[0] >= KILL_AFTER or any(f.done() for f in futures), RUN_TIMEOUT_S,
                       f"{KILL_AFTER} acknowledged pushes")
            # Only a copy the scheduler counts in sync is promoted: killed before that, ps-1's slices
            # are refused a failover (FAILOVER IMPOSSIBLE) and every push to them waits out its deadline.
            # Under load the report can come after the pushes counted above, so the kill waits for it.
            in_sync = f"is an in-sync backup of {ps[1]}"
            wait_until(lambda: any(in_sync in line for line in started[0].lines), RUN_TIMEOUT_S,
                       f"the scheduler counting a backup of ps-1 ({ps[1]}) in sync")
            os.kill(started[2].pid, signal.SIGKILL)  # started: scheduler, ps-0, ps-1, ps-2: ps-1
            for f in futures:
                f.result(timeout=RUN_TIMEOUT_S)
        assert count[0] == CLIENTS * PUSHES
        final = clients[0].pull(PUSHES)
        for key, value in final.items():
            np.testing.assert_array_equal(value, initial[key] - acked[key].astype(np.float32), err_msg=key)
        assert scheds[0].get_layout(timeout_s=5.0).version > layout.version, "no failover happened"
        assert sum(c.reroutes for c in clients) > 0
    finally:
        for c in clients:
            c.close()
        for s in scheds:
            s.close()
