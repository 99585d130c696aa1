"""`python -m pshard.scheduler` (`pshard scheduler`) as a real process: start-up errors, log level, stopping.

The serving path and a bad TF_CONFIG are in test_scheduler_service.py; this is what every entry point
must do alike (one clean line and exit 2 for a start-up problem, a quiet stop on SIGTERM at any moment).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import pytest
from pshard.common.rpc.health import probe

from tests.service.entrypoints import (
    REPO,
    WAIT_S,
    child_env,
    port_in_use,
    run,
    sigterm_during_start_up,
)

PROG = "python -m pshard.scheduler"


def one_error_line(result: subprocess.CompletedProcess[str], prog: str = PROG) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"{prog}: error: "), result.stderr
    return result.stderr.strip()


@pytest.mark.parametrize("cluster", [
    {"scheduler": ["127.0.0.1:7000"], "ps": ["127.0.0.1:7100"], "worker": ["127.0.0.1:7200"]},
    # No scheduler entry: worker 0 hosts the scheduler, in-process, from the worker command.
    {"ps": ["127.0.0.1:7100"], "worker": ["127.0.0.1:7200"]},
], ids=["scheduler-entry", "worker-0-hosts"])
def test_a_workers_tf_config_is_refused_in_one_line(cluster):
    tf_config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}})

    result = run(["-m", "pshard.scheduler"], env=child_env(TF_CONFIG=tf_config))

    assert "task.type: got 'worker' (index 0)" in one_error_line(result)


def test_the_scheduler_task_in_any_case_is_accepted_up_to_the_listen_check():
    with port_in_use() as port:
        tf_config = json.dumps({"cluster": {"scheduler": [f"127.0.0.1:{port}"], "ps": ["127.0.0.1:7100"]},
                                "task": {"type": "Scheduler", "index": "0"}})
        result = run(["-m", "pshard.scheduler"], env=child_env(TF_CONFIG=tf_config))

    # Past the role check: it went on to listen on its TF_CONFIG port, which the test holds.
    assert one_error_line(result).endswith(f"cannot listen on 127.0.0.1:{port}: address already in use")


def test_a_port_in_use_is_one_line_naming_the_address():
    with port_in_use() as port:
        result = run(["-m", "pshard.scheduler", "--bind", f"127.0.0.1:{port}"])

    assert one_error_line(result).endswith(f"cannot listen on 127.0.0.1:{port}: address already in use")


def test_the_pshard_command_names_itself():
    with port_in_use() as port:
        result = run(["-m", "pshard", "scheduler", "--bind", f"127.0.0.1:{port}"])

    one_error_line(result, prog="pshard scheduler")


def test_sigterm_during_start_up_is_a_quiet_stop():
    code, _, err = sigterm_during_start_up("pshard.scheduler")

    assert (code, err) == (0, "")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_log_level_warning_keeps_a_served_and_stopped_scheduler_silent():
    address = f"127.0.0.1:{_free_port()}"
    process = subprocess.Popen(
        [sys.executable, "-m", "pshard.scheduler", "--bind", address, "--log-level", "WARNING"],
        cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while not (outcome := probe(address, timeout_s=1.0))[0]:
            assert process.poll() is None, process.communicate(timeout=WAIT_S)
            assert time.monotonic() < deadline, outcome[1]
            time.sleep(0.05)

        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=WAIT_S)

    assert (process.returncode, out, err) == (0, "", "")


def test_an_unknown_log_level_is_a_usage_error():
    result = run(["-m", "pshard.scheduler", "--log-level", "chatty"])

    assert result.returncode == 2 and "--log-level" in result.stderr


def test_a_metrics_port_in_use_is_one_line_naming_the_address():
    with port_in_use() as port:
        result = run(["-m", "pshard.scheduler", "--bind", "127.0.0.1:0", "--metrics-port", str(port)])

    assert one_error_line(result).endswith(f"cannot listen on 127.0.0.1:{port}: address already in use")
