"""A sync server that never knew a quorum says so within seconds instead of "waiting for workers []".

That is what a script which built its own PSClient under `pshard launch` met: the servers follow the
scheduler, the script never registered there, so no clock could complete and every pull waited for
its whole deadline (120 s) for nobody in particular.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.errors import PullTimeoutError
from pshard.common.job import JobConfig
from pshard.ps_server.handlers.dense import NO_QUORUM_GRACE_S
from pshard.ps_server.service import ServerThread
from pshard.ps_server.settings import ServerSettings


def test_a_sync_pull_on_a_server_without_a_quorum_fails_fast_saying_how_to_join(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient]) -> None:
    server = start_server(ServerSettings())
    client = new_client([server], "worker-0", timeout_s=60.0)
    client.declare({"w": np.zeros(3, np.float32)}, JobConfig(mode="sync"))
    started = time.monotonic()
    refusal = (r"pull by 'worker-0' at clock \d: this server has no sync quorum after 10s.*registering "
               r"\(PSTrainer\(model, job=\.\.\.\) with no client.*--workers")
    with pytest.raises(PullTimeoutError, match=refusal):
        client.push_pull({"w": np.ones(3, np.float32)}, 0)
    assert time.monotonic() - started < NO_QUORUM_GRACE_S + 20  # not the pull's 60 s deadline


def test_a_server_that_had_a_quorum_keeps_waiting_for_it(start_server: Callable[..., ServerThread],
                                                          new_client: Callable[..., PSClient]) -> None:
    server = start_server(ServerSettings(static_quorum={"worker-0": 0, "worker-1": 0}))
    client = new_client([server], "worker-0", timeout_s=2.0)
    client.declare({"w": np.zeros(3, np.float32)}, JobConfig(mode="sync"))
    with pytest.raises(PullTimeoutError, match=r"waiting for workers \['worker-1'\] to reach clock 0"):
        client.push_pull({"w": np.ones(3, np.float32)}, 0)
