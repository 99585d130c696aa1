"""Non-blocking and incremental global checkpoints (issue 22) over gRPC.

In-process servers: a checkpoint taken in the background, then an incremental one over it, restore
onto another server count exactly the weights and rows the job had. Real server processes: one
SIGKILLed while it writes its part in the background, with training going on meanwhile, leaves the
previous checkpoint as the latest valid one. The kill is made deterministic by the servers' test hook
(PSHARD_TEST_CHECKPOINT_PAUSE_DIR), as in test_global_checkpoint_torn.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from pshard.client.ps_client import PSClient
from pshard.common import checkpoint_store as ckpt
from pshard.common.errors import PSError
from pshard.ps_server.service import ServerThread
from pshard.worker import checkpoint_coordinator as checkpoints

from pshard.cli import main as cli_main
from tests.e2e.harness import Procs, wait_until
from tests.service.conftest import WAIT_S
from tests.service.test_global_checkpoint import (
    IDS,
    INITIAL,
    JOB,
    TABLE,
    cluster,
    cluster_of,
    start_job,
    touch_table,
    train,
)
from tests.service.test_global_checkpoint_torn import _server


def test_a_background_incremental_chain_restores_the_job_onto_another_server_count(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient],
        tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    clients = cluster(start_server, new_client, 2, root)
    start_job(clients)
    train(clients, 0, 2)
    touch_table(clients[0], 2)
    base = checkpoints.save_in_background(clients[0], root, 2).result(WAIT_S * 3)
    weights = train(clients, 2, 2)
    few = IDS[:4]  # 4 of the table's rows change after the base: only they are written again
    clients[0].push_rows(TABLE.name, few, np.ones((4, 4), np.float32), 4)
    head = checkpoints.save_in_background(clients[0], root, 4, parent=base).result(WAIT_S * 3)
    assert head.parent == base.path.name and head.depth == 1
    assert sum(len(np.load(p)) for p in head.path.glob("part-*.tables-*/t0/ids.npy")) == len(few)
    rows = clients[0].pull_rows(TABLE.name, IDS, 4)

    fresh = cluster(start_server, new_client, 3, root)
    assert start_job(fresh, root) == 4
    restored = fresh[0].pull(4)
    for key in INITIAL:
        np.testing.assert_array_equal(restored[key], weights[key], err_msg=key)
    np.testing.assert_array_equal(fresh[0].pull_rows(TABLE.name, IDS, 4), rows)


def test_a_server_killed_during_a_background_checkpoint_leaves_the_previous_one_the_latest(
        procs: Procs, tmp_path: Path, new_client: Callable[..., PSClient]) -> None:
    pause = tmp_path / "pause"
    pause.mkdir()
    root = tmp_path / "ckpt"
    addresses = [_server(procs, "ps-0", root),
                 _server(procs, "ps-1", root, {"PSHARD_TEST_CHECKPOINT_PAUSE_DIR": str(pause)})]
    clients = cluster_of(new_client, addresses)
    for c in clients:
        c.declare(INITIAL, JOB)
    train(clients, 0, 2)
    previous = checkpoints.save(clients[0], root, 2)
    train(clients, 2, 2)

    (pause / "armed").touch()
    pending = checkpoints.save_in_background(clients[0], root, 4, parent=previous)
    # The save returned once the parts were captured: server 1 is still writing, and training goes on.
    wait_until(lambda: (pause / "part-1.dense.reached").exists(), WAIT_S, "server 1 to pause in its part")
    assert not pending.done()
    train(clients, 4, 3)
    assert not pending.done()
    procs.started[1].signal_group(signal.SIGKILL)
    error = pending.exception(WAIT_S * 3)
    assert isinstance(error, PSError), error

    committed, torn = ckpt.scan(root, verify=True)
    assert [c.path for c in committed] == [previous.path]
    assert len(torn) == 1
    assert re.search(r"ckpt-000000000004-.*no MANIFEST\.json", f"{torn[0].path} {torn[0].reason}")
    assert ckpt.latest(root) == previous
    assert json.loads((torn[0].path / "part-0.json").read_text())["parent"] == previous.path.name


def test_the_chiefs_checkpointer_chains_in_the_background_and_the_cli_compacts_and_exports_a_chain(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient],
        tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    clients = cluster(start_server, new_client, 2, root)
    start_job(clients)
    checkpointer = checkpoints.Checkpointer(clients[0], str(root), None, background=True, full_every=3)
    for clock in (2, 4, 6, 8):
        train(clients, clock - 2, 2)
        touch_table(clients[0], clock)
        checkpointer.take(clock)
    last = checkpointer.settle()
    committed, torn = ckpt.scan(root, verify=True)
    assert not torn and last == committed[-1]
    assert [(c.clock, c.depth) for c in committed] == [(2, 0), (4, 1), (6, 2), (8, 0)]

    head = committed[2]
    assert cli_main(["checkpoint", "export", str(head.path), "--out", str(tmp_path / "chain")]) == 0
    assert cli_main(["checkpoint", "compact", str(root), "--clock", "6"]) == 0
    folded = [c for c in ckpt.scan(root)[0] if c.clock == 6 and c.parent is None]
    assert len(folded) == 1
    assert cli_main(["checkpoint", "export", str(folded[0].path), "--out", str(tmp_path / "full")]) == 0
    for name in ("ids.npy", "rows.npy"):
        chain, full = (np.load(tmp_path / d / "tables" / TABLE.name / name) for d in ("chain", "full"))
        assert len(chain) == len(IDS) and chain.tobytes() == full.tobytes()
    chain_model, full_model = (torch.load(tmp_path / d / "model.pt") for d in ("chain", "full"))
    assert all(torch.equal(chain_model[k], full_model[k]) for k in INITIAL)
