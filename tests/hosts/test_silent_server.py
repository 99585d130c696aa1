"""Every transport notices a dead peer (issue 24), on the multi-host bed: a worker's sync step in flight
over raw TCP to a real parameter server on another host, whose link is then taken down (the server lives
on, answering no one), breaks within twice the liveness figure (the job's heartbeat timeout), not at the
step's deadline. Real processes on their own hosts; the worker's log says when its path broke."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from bench.hostbed import HostBed

Bed = Callable[..., HostBed]
DEAD_AFTER_S = 2.0
STEP_TIMEOUT_S = 60.0  # what the call would wait for before keepalives
PORT = 7100  # the host's own namespace: nothing else listens there

# One worker of a two-worker sync quorum: its step waits on the server for the other worker's gradient.
_WORKER = f"""
import logging, sys
import numpy as np
from pshard.client.ps_client import PSClient
from pshard.common.job import JobConfig, OptimizerConfig
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
client = PSClient([sys.argv[1]], "worker-0", transport="tcp", timeout_s={STEP_TIMEOUT_S},
                  dead_after_s={DEAD_AFTER_S})
client.declare({{"w": np.zeros(1000, np.float32)}}, JobConfig(mode="sync", optimizer=OptimizerConfig(lr=0.1)))
client.push_pull({{"w": np.ones(1000, np.float32)}}, 0)
"""


def _lines(proc: subprocess.Popen[bytes]) -> queue.Queue[tuple[float, str]]:
    """Each line `proc` writes, with when it was read (time.monotonic())."""
    out: queue.Queue[tuple[float, str]] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            out.put((time.monotonic(), raw.decode(errors="replace").rstrip()))

    threading.Thread(target=read, daemon=True).start()
    return out


def _first(lines: queue.Queue[tuple[float, str]], text: str, timeout_s: float, seen: list[str]) -> float:
    """When the first line containing `text` came; AssertionError with the output at the timeout."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            at, line = lines.get(timeout=left)
        except queue.Empty:
            break
        seen.append(line)
        if text in line:
            return at
    raise AssertionError(f"no line with {text!r} within {timeout_s:g} s:\n" + "\n".join(seen))


def test_a_step_in_flight_to_a_server_whose_host_is_cut_off_breaks_within_twice_the_heartbeat_timeout(
        hostbed: Bed) -> None:
    bed = hostbed(["ps0", "w0"])
    address = f"{bed.hosts['ps0'].address}:{PORT}"
    server = bed.spawn("ps0", [sys.executable, "-m", "pshard.ps_server", "--bind", address, "--no-scheduler",
                               "--workers", "worker-0,worker-1", "--transport", "tcp", "--insecure"])
    worker = bed.spawn("w0", [sys.executable, "-u", "-c", _WORKER, address])
    seen: list[str] = []
    try:
        lines = _lines(worker)
        _first(lines, "push and pull over tcp", 60.0, seen)  # the step's request goes out on it now
        bed.link_down("ps0")
        cut = time.monotonic()
        broke = _first(lines, "tcp transport broke (tcp transport: TimeoutError", 4 * DEAD_AFTER_S + 5, seen)
        noticed = broke - cut
        assert noticed <= 2 * DEAD_AFTER_S, f"noticed {noticed:.1f} s after the cut:\n" + "\n".join(seen)
    finally:
        bed.kill(worker)
        bed.kill(server)
