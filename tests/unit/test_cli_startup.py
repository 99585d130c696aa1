"""Every `pshard` command answers --help and a usage error before it imports torch, numba or grpc.

Those imports take seconds on a loaded host, so a command that made them first would keep its user
waiting that long to learn a flag's name. The check counts modules, not seconds: each command runs in a
fresh interpreter (as `pshard <command>` does, through pshard.cli) and the test reads which heavy
modules it loaded, which is steady under any load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pshard.cli import COMMANDS

# What no parser may need: each costs from a hundred ms (prometheus_client) or a few (grpc, protobuf) to
# seconds (torch, numba) on a loaded host.
HEAVY = ("torch", "numba", "grpc", "google.protobuf", "pshard.api", "tqdm", "sklearn", "matplotlib",
         "prometheus_client")

# One usage error per command, and the exit status it ends with (health: 1, Docker reserves 2).
USAGE_ERRORS: dict[str, tuple[list[str], int]] = {
    "scheduler": (["--heartbeat-interval-ms", "0"], 2),
    "ps": (["--max-inflight-mb", "0"], 2),
    "worker": (["--epochs", "0"], 2),
    "launch": (["--ps", "0"], 2),
    "run": ([], 2),  # no TF_CONFIG: no role to run
    "health": (["127.0.0.1:1", "--timeout-s", "0"], 1),
    "status": (["--timeout-s", "0"], 2),
    "drain": ([], 2),  # no SERVER
    "rebalance": (["--timeout-s", "0"], 2),
    "plot": ([], 2),  # no RUN.jsonl
    "evaluate": ([], 2),  # no MODEL
    "certs": (["--days", "0"], 2),
    "checkpoint": (["list"], 2),  # no root
}

CHILD = """
import contextlib, io, json, sys
from pshard.cli import main

codes = []
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            codes.append(main(argv))
        except SystemExit as stop:
            codes.append(stop.code)
heavy = [m for m in json.loads(sys.argv[2]) if any(n == m or n.startswith(m + ".") for n in sys.modules)]
print(json.dumps({"codes": codes, "heavy": heavy}))
"""


def run_commands(*argvs: list[str]) -> dict[str, list[object]]:
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(argvs), json.dumps(HEAVY)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def test_every_command_has_a_usage_error_here():
    assert sorted(USAGE_ERRORS) == sorted(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_and_a_usage_error_come_before_the_heavy_imports(command: str):
    argv, status = USAGE_ERRORS[command]

    result = run_commands([command, "--help"], [command, *argv])

    assert result == {"codes": [0, status], "heavy": []}


def test_the_dispatchers_own_help_and_usage_error_import_nothing_heavy():
    result = run_commands(["--help"], ["no-such-command"])

    assert result == {"codes": [0, 2], "heavy": []}
