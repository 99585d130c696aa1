"""Helpers for tests that run a service's entry point as a real process.

Every wait has a deadline; a port in use is a socket the test itself holds on 127.0.0.1:0.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 30.0  # a fresh interpreter importing grpc and numpy on busy cores


def child_env(**extra: str) -> dict[str, str]:
    """The test's environment without its own TF_CONFIG, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    return {**env, **extra}


def run(argv: Sequence[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *argv], cwd=REPO, env=env or child_env(), capture_output=True,
                          text=True, timeout=WAIT_S)


@contextlib.contextmanager
def port_in_use() -> Iterator[int]:
    """A port another socket listens on for the duration."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether process `pid` has a handler installed for `sig` (Linux: /proc/<pid>/status SigCgt)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    return False


def wait_until_catching(process: subprocess.Popen[Any], sig: signal.Signals,
                        timeout_s: float = WAIT_S) -> None:
    """Until `process` has a handler for `sig`: its start-up has begun, but not necessarily ended."""
    deadline = time.monotonic() + timeout_s
    while not catches(process.pid, sig):
        if process.poll() is not None:
            raise AssertionError(f"exited with {process.returncode} before handling {sig.name}")
        if time.monotonic() > deadline:
            raise AssertionError(f"no {sig.name} handler within {timeout_s:g} s")
        time.sleep(0.001)  # polls a kernel file; the start-up it races takes hundreds of ms


def sigterm_during_start_up(module: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Start `python -m <module> --bind 127.0.0.1:0`, SIGTERM it as soon as its handler is installed
    (imports still going on), and return (exit code, stdout, stderr)."""
    process = subprocess.Popen([sys.executable, "-m", module, "--bind", "127.0.0.1:0"], cwd=REPO,
                               env=env or child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    wait_until_catching(process, signal.SIGTERM)  # the first line of __main__ ran; imports go on
    out, err = terminate_quietly(process)
    return process.returncode, out, err


def terminate_quietly(process: subprocess.Popen[str]) -> tuple[str, str]:
    """SIGTERM `process` and return its (stdout, stderr); it is killed if it outlives WAIT_S."""
    try:
        process.send_signal(signal.SIGTERM)
        return process.communicate(timeout=WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=WAIT_S)
