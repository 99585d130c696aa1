"""A client whose servers are not there says so: a warning naming each within seconds, and an error at
its deadline naming them, rather than a bare DEADLINE_EXCEEDED that reads like slow peers."""

from __future__ import annotations

import logging
import socket
import time

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.errors import PullTimeoutError
from pshard.common.job import JobConfig


def _closed_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


def test_a_declare_to_servers_nobody_runs_names_each_of_them(caplog: pytest.LogCaptureFixture) -> None:
    servers = [_closed_port(), _closed_port()]
    caplog.set_level(logging.WARNING, logger="pshard.client")
    started = time.monotonic()
    with PSClient(servers, "worker-0", timeout_s=2.0) as client, \
            pytest.raises(PullTimeoutError) as failure:
        client.declare({"w": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}, JobConfig())
    for address in servers:
        assert f"parameter server {address} unreachable" in caplog.text
        assert address in str(failure.value)
    assert "unreachable until the deadline (2 s)" in str(failure.value)
    assert time.monotonic() - started < 30  # the call's deadline plus slack, not minutes
