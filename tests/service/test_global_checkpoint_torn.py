"""A server SIGKILLed while it writes its part of a global checkpoint (docs/architecture.md, 9 Failures).

Real server processes. The kill is made deterministic by the servers' test hook
(PSHARD_TEST_CHECKPOINT_PAUSE_DIR): once the test arms it, server 1 stops between the files of
its part and says so with a marker file; the test then SIGKILLs it there. The torn checkpoint has
no manifest; a restore onto fresh servers takes the previous, committed one and reports the torn
one.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common import checkpoint_store as ckpt
from pshard.common.errors import PSError
from pshard.ps_server.service import ServerThread
from pshard.ps_server.settings import ServerSettings
from pshard.worker import checkpoint_coordinator as checkpoints

from tests.e2e.harness import PYTHON, Procs, wait_until
from tests.service.conftest import WAIT_S
from tests.service.test_global_checkpoint import INITIAL, JOB, WORKERS, cluster_of, train


def _server(procs: Procs, name: str, root: Path, env: dict[str, str] | None = None) -> str:
    proc = procs.start(name, [PYTHON, "-m", "pshard.ps_server", "--bind", "127.0.0.1:0",
                              "--workers", ",".join(WORKERS), "--global-checkpoint-dir", str(root)], env=env)
    port = proc.wait_for_line(r"parameter server listening on port (\d+)", WAIT_S * 3).group(1)
    return f"127.0.0.1:{port}"


def test_server_killed_mid_checkpoint_leaves_a_torn_one_that_is_reported_and_skipped(
        procs: Procs, tmp_path: Path, start_server: Callable[..., ServerThread],
        new_client: Callable[..., PSClient], caplog: pytest.LogCaptureFixture) -> None:
    pause = tmp_path / "pause"
    pause.mkdir()
    root = tmp_path / "ckpt"
    addresses = [_server(procs, "ps-0", root),
                 _server(procs, "ps-1", root, {"PSHARD_TEST_CHECKPOINT_PAUSE_DIR": str(pause)})]
    clients = cluster_of(new_client, addresses)
    for c in clients:
        c.declare(INITIAL, JOB)
    at_two = train(clients, 0, 2)
    checkpoints.save(clients[0], root, 2)
    train(clients, 2, 2)

    (pause / "armed").touch()
    failed: list[BaseException] = []

    def save() -> None:
        try:
            checkpoints.save(clients[0], root, 4)
        except BaseException as err:  # expected: server 1 dies under it
            failed.append(err)

    saver = threading.Thread(target=save)
    saver.start()
    wait_until(lambda: (pause / "part-1.dense.reached").exists(), WAIT_S, "server 1 to pause in its part")
    procs.started[1].signal_group(signal.SIGKILL)
    saver.join(WAIT_S * 3)
    assert not saver.is_alive(), "the save did not end after its server was killed"
    assert failed and isinstance(failed[0], PSError), failed

    committed, torn = ckpt.scan(root, verify=True)
    assert [c.clock for c in committed] == [2]
    assert len(torn) == 1
    assert re.search(r"ckpt-000000000004-.*no MANIFEST\.json", f"{torn[0].path} {torn[0].reason}")
    assert (torn[0].path / "part-1.npz").exists()  # really torn half way: the dense file was written

    # Fresh servers, three this time: the previous checkpoint is what comes back.
    settings = ServerSettings(static_quorum={w: 0 for w in WORKERS}, global_checkpoint_dir=str(root))
    servers = [start_server(settings).address for _ in range(3)]
    fresh = cluster_of(new_client, servers)
    with caplog.at_level(logging.WARNING, logger="pshard.worker"):
        assert checkpoints.restore(fresh[0], root, JOB) == 2
    assert any("IGNORING TORN CHECKPOINT" in r.getMessage() and "ckpt-000000000004" in r.getMessage()
               for r in caplog.records)
    for c in fresh:
        c.declare(INITIAL, JOB)
    restored = fresh[0].pull(2)
    for key in INITIAL:
        np.testing.assert_array_equal(restored[key], at_two[key], err_msg=key)
