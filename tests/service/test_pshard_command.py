"""`pshard <command>` as a real process: each subcommand runs its service, under its own name.

`pshard run` is checked by what it starts: a ps task's TF_CONFIG gives a serving parameter server,
a scheduler task's a serving scheduler, each answering its health check and stopping on SIGTERM.
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

from tests.service.entrypoints import REPO, WAIT_S, child_env, run


def pshard(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run(["-m", "pshard", *args], env=child_env(**env))


@pytest.mark.parametrize("command", ["scheduler", "ps", "worker", "launch", "health"])
def test_every_subcommands_help_exits_0_under_its_own_name(command):
    result = pshard(command, "--help")

    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"usage: pshard {command} "), result.stdout


def test_run_help_says_which_command_each_role_starts():
    result = pshard("run", "--help")

    assert result.returncode == 0
    assert "'pshard scheduler'" in result.stdout and "'pshard ps'" in result.stdout


def _free_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize(("task_type", "service"), [
    ("ps", "pshard.api.v1.ParameterServerService"),
    ("Scheduler", "pshard.api.v1.SchedulerService"),
])
def test_run_starts_the_service_tf_configs_task_names(task_type, service):
    address = _free_address()
    role = task_type.lower()
    cluster = {"scheduler": [address if role == "scheduler" else "127.0.0.1:1"],
               "ps": [address if role == "ps" else "127.0.0.1:2"]}
    tf_config = json.dumps({"cluster": cluster, "task": {"type": task_type, "index": 0}})
    argv = ["--bind", address] + (["--no-scheduler"] if role == "ps" else [])
    process = subprocess.Popen([sys.executable, "-m", "pshard", "run", *argv], cwd=REPO,
                               env=child_env(TF_CONFIG=tf_config), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + WAIT_S
        while not (outcome := probe(address, service, timeout_s=1.0))[0]:
            assert process.poll() is None and time.monotonic() < deadline, (outcome[1], process.poll())
            time.sleep(0.05)  # a refused connection fails at once; the server is still importing

        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=WAIT_S)

    assert process.returncode == 0, err
    assert "Traceback" not in err
