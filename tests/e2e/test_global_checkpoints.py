"""Global checkpoints in real training runs (docs/architecture.md, 9 Failures): the chief writes them,
a new run on another number of servers restores the newest and continues at its clock.

The reshard equality itself (bit for bit against the run that stayed on 2 servers) is proven in
tests/service/test_global_checkpoint.py; here the flags, the chief's timing between its steps,
the restore before the Declare and retention are proven with real processes.
"""

from __future__ import annotations

import pytest
from pshard.common import checkpoint_store as ckpt

from tests.e2e.harness import SYNC, TIMEOUTS, LocalCluster, Procs, assert_trained

pytestmark = pytest.mark.e2e

RUN = ("--epochs", "1", "--batch-size", "32", "--job-id", "gck-e2e")


def test_a_run_on_three_servers_continues_the_checkpoint_a_run_on_two_took(procs: Procs) -> None:
    root = procs.tmp_path / "global"
    flags = ("--global-checkpoint-dir", str(root), "--checkpoint-every-steps", "3", "--keep-checkpoints", "2")

    first = LocalCluster(procs, num_ps=2)
    first.start_servers("--global-checkpoint-dir", str(root))
    workers = [first.start_worker(i, *SYNC, *RUN, *TIMEOUTS, *flags, "--max-steps", "10") for i in (0, 1)]
    finals = [assert_trained(w) for w in workers]
    assert [f["steps"] for f in finals] == ["10", "10"], finals
    committed, torn = ckpt.scan(root, verify=True)
    assert [(c.clock, c.servers) for c in committed] == [(6, 2), (9, 2)] and torn == []  # kept 2 of 3

    second = LocalCluster(procs, num_ps=3)
    second.start_servers("--global-checkpoint-dir", str(root))
    workers = [second.start_worker(i, *SYNC, *RUN, *TIMEOUTS, *flags, "--max-steps", "15") for i in (0, 1)]
    finals = [assert_trained(w) for w in workers]
    # Restored at clock 9: each worker skips the 9 planned steps the checkpoint holds and trains 6.
    assert [(f["steps"], f["skipped"]) for f in finals] == [("6", "9"), ("6", "9")], finals
    # Both trainers ask every server; each server takes the first restore and refuses the second.
    line = r"clock 9, written by 2 servers\) restored onto (\d) of 3 servers"
    restored = [int(w.wait_for_line(line, 1).group(1)) for w in workers]
    assert sum(restored) == 3, restored
    committed, _ = ckpt.scan(root, verify=True)
    assert [(c.clock, c.servers) for c in committed] == [(12, 3), (15, 3)]
