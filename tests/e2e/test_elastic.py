"""Elastic workers with real processes (docs/architecture.md, 3 Membership and 8 Workers): a worker
joins a running sync job, another leaves one early, and the job keeps its clocks and its accuracy.

The shard plan is fixed in clocks (worker.elastic): digits' 1437 training images in union batches of
2 x 32 make 23 clocks an epoch however many workers split them, so every original worker trains every
clock and the servers take exactly the planned number.
"""

from __future__ import annotations

import signal

import grpc
import pytest

from pshard.api.v1.parameter_server_pb2 import GetStatsRequest, GetStatsResponse
from pshard.api.v1.parameter_server_pb2_grpc import ParameterServerServiceStub
from tests.e2e.harness import (
    STARTUP_TIMEOUT_S,
    SYNC,
    TIMEOUTS,
    LocalCluster,
    Procs,
    assert_trained,
    chief_accuracy,
    wait_until,
)

pytestmark = pytest.mark.e2e

RUN = ("--epochs", "8", "--batch-size", "32")
PROGRESS_TIMEOUT_S = 45
# Sync on digits measures 0.96-0.98 (tests/e2e/test_failures.py); chance is 0.10.
DIGITS_ACCURACY_BAR = 0.90


def server_stats(cluster: LocalCluster) -> list[GetStatsResponse]:
    stats = []
    for address in cluster.plan.ps:
        with grpc.insecure_channel(address) as channel:
            stats.append(ParameterServerServiceStub(channel).GetStats(GetStatsRequest(), timeout=10))
    return stats


def assert_clocks(cluster: LocalCluster, planned: int, workers: dict[str, int]) -> None:
    """Every slice took exactly `planned` clocks; each worker's last push was the clock given."""
    for address, stats in zip(cluster.plan.ps, server_stats(cluster), strict=True):
        assert (stats.min_version, stats.max_version) == (planned, planned), (address, stats)
        clocks = {w: stats.worker_clocks[w] for w in workers}
        assert clocks == workers, (address, dict(stats.worker_clocks))


def test_a_worker_joins_a_running_sync_job_and_trains_its_piece_of_every_later_clock(procs: Procs) -> None:
    # Heartbeats that outlast the pause below: the originals are held while the new worker starts, so
    # that it joins mid-training however slow the machine is, and must not be declared dead meanwhile.
    cluster = LocalCluster(procs, heartbeat_timeout_ms=60_000)
    cluster.start_servers()
    planned = 8 * 23
    originals = [cluster.start_worker(i, *SYNC, *RUN, *TIMEOUTS) for i in (0, 1)]
    for name in ("worker-0", "worker-1"):
        def logged(name: str = name) -> bool:  # the default binds this iteration's name
            return cluster.steps_logged(name) >= 5

        wait_until(logged, PROGRESS_TIMEOUT_S, f"{name} to log 5 training steps")

    for proc in originals:
        proc.signal_group(signal.SIGSTOP)
    try:
        stopped_at = cluster.steps_logged("worker-0")
        assert stopped_at < planned - 20, f"the job was nearly over before the join:\n{originals[0].output()}"
        # The job's own TF_CONFIG (two workers) with an index beyond it: a new worker, not a listed one.
        joiner = procs.python(
            "worker-2", "-m", "pshard.worker", "--data-dir", str(cluster.data_dir), "--model", "mlp",
            "--seed", "0", "--metrics", str(cluster.metrics("worker-2")), "--log-every", "1",
            *SYNC, *RUN, *TIMEOUTS, "--join", "--task-index", "2",
            tf_config=cluster.plan.tf_config(cluster.task("worker-1")))
        joiner.wait_for_line(r"joined the running job at clock \d+", STARTUP_TIMEOUT_S * 2)
    finally:
        for proc in originals:
            proc.signal_group(signal.SIGCONT)

    finals = [assert_trained(p) for p in (*originals, joiner)]
    joined = finals[2]
    assert chief_accuracy(*finals) > DIGITS_ACCURACY_BAR, finals
    # The originals trained every clock; the new worker every clock from the one it joined at.
    assert [int(f["steps"]) for f in finals[:2]] == [planned, planned], finals
    assert int(joined["steps"]) > 0 and int(joined["steps"]) + int(joined["skipped"]) == planned, finals
    assert int(joined["skipped"]) >= stopped_at, finals
    assert joined.get("failed") is None and "test_accuracy" not in joined, finals
    # Sync clocks stayed consistent: every slice took exactly the planned clocks (none taken twice, none
    # waiting for the newcomer past its end), and all three pushed the last one.
    assert_clocks(cluster, planned, dict.fromkeys(("worker-0", "worker-1", "worker-2"), planned - 1))


def test_a_worker_that_leaves_early_shrinks_the_quorum_and_the_others_finish_the_job(procs: Procs) -> None:
    cluster = LocalCluster(procs, num_workers=3)
    cluster.start_servers()
    planned = 8 * 15  # 1437 images in union batches of 3 x 32
    workers = [cluster.start_worker(i, *SYNC, *RUN, *TIMEOUTS) for i in (0, 1)]
    leaver = cluster.start_worker(2, *SYNC, *RUN, *TIMEOUTS, "--max-steps", "30")

    finals = [assert_trained(p) for p in (*workers, leaver)]
    assert chief_accuracy(*finals) > DIGITS_ACCURACY_BAR, finals
    assert [int(f["steps"]) for f in finals] == [planned, planned, 30], finals
    # It left at the boundary of clock 30; the two others took its share from there on, and no clock
    # waited for it (the job would have hung for the step timeout and failed).
    assert_clocks(cluster, planned, {"worker-0": planned - 1, "worker-1": planned - 1, "worker-2": 29})
