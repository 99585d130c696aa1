"""The raw TCP fast path's port can be pinned (`pshard ps --fast-port N`, env PSHARD_FAST_PORT), so a
firewall between hosts can let it through (issue 24); a pinned port that is taken says so, naming it.
A firewall that silently drops the port costs one short wait, then gRPC carries the steps."""

from __future__ import annotations

import ctypes
import logging
import socket
import struct
import time
from collections.abc import Callable

import numpy as np
import pytest
from pshard.client import connections
from pshard.client.ps_client import PSClient
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.ps_server.__main__ import build_parser
from pshard.ps_server.service import ServerThread
from pshard.ps_server.settings import ServerSettings

_SO_ATTACH_FILTER = 26  # linux/filter.h (Python's socket module does not name it)


def _free_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return int(sock.getsockname()[1])


def test_a_pinned_fast_port_carries_the_workers_sessions(start_server: Callable[..., ServerThread],
                                                         new_client: Callable[..., PSClient]) -> None:
    port = _free_port()
    server = start_server(ServerSettings(transport="tcp", fast_port=port))
    assert server.running.fast.port == port
    client = new_client([server], "worker-0", transport="tcp")
    client.declare({"w": np.zeros(8, np.float32)}, JobConfig(mode="async", optimizer=OptimizerConfig(lr=1.0)))
    client.push_pull({"w": np.ones(8, np.float32)}, 0)
    assert client.transports == ["tcp"]


def test_a_pinned_fast_port_that_is_taken_names_it_and_the_fix(start_server: Callable[..., ServerThread]
                                                               ) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port} .*--fast-port"):
            start_server(ServerSettings(transport="tcp", fast_port=port))


def test_the_flag_and_its_environment_variable(monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert build_parser().parse_args([]).fast_port == 0
    assert build_parser().parse_args(["--fast-port", "7001"]).fast_port == 7001
    monkeypatch.setenv("PSHARD_FAST_PORT", "7002")
    assert build_parser().parse_args([]).fast_port == 7002
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--fast-port", "70000"])
    assert "--fast-port" in capsys.readouterr().err


def _drop_everything(listener: socket.socket) -> ctypes.Array[ctypes.c_char]:
    """A classic BPF filter on the listening socket that keeps no packet: its SYNs vanish in the
    kernel unanswered, as behind a firewall that drops the port (gRPC's port is another socket).
    The program's memory, which the kernel copied, is returned to keep the pointer honest."""
    program = ctypes.create_string_buffer(struct.pack("HBBI", 0x06, 0, 0, 0))  # BPF_RET|BPF_K 0
    listener.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, struct.pack("HL", 1, ctypes.addressof(program)))
    return program


def test_a_silently_dropped_fast_port_costs_one_short_wait_then_steps_go_over_grpc(
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient],
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    server = start_server(ServerSettings(transport="tcp"))
    _drop_everything(server.running.fast._listener)  # type: ignore[arg-type]  # the server's own port
    monkeypatch.setattr(connections, "FAST_PATH_RETRY_S", 0.0)  # a broken path would be tried every step
    client = new_client([server], "worker-0", transport="tcp", timeout_s=2.0)
    client.declare({"w": np.zeros(8, np.float32)}, JobConfig(mode="async", optimizer=OptimizerConfig(lr=1.0)))
    with caplog.at_level(logging.WARNING, logger="pshard.client"):
        client.push_pull({"w": np.ones(8, np.float32)}, 0)  # the one wait: at most the connect timeout
        start = time.monotonic()
        for clock in range(1, 6):
            client.push_pull({"w": np.ones(8, np.float32)}, clock)
        steps_s = time.monotonic() - start
    assert client.transports == ["grpc"]
    assert steps_s < 2.0, f"5 steps took {steps_s:.1f} s: the dropped port was tried again"
    silent = [r for r in caplog.records if "gave no answer" in r.getMessage()]
    assert len(silent) == 1 and "--fast-port" in silent[0].getMessage()
