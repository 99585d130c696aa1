"""`python -m pshard.worker` as a user meets it: start-up problems are one line and exit 2, a stop is quiet.

Real processes; the ports are either held by the test itself or free ones nobody listens on, so
a worker waiting for its scheduler waits until the test stops it.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.service.entrypoints import (
    REPO,
    WAIT_S,
    child_env,
    port_in_use,
    run,
    terminate_quietly,
    wait_until_catching,
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tf_config(task_type: str = "worker", index: int = 0, *, scheduler: bool = True,
              worker_port: int | None = None) -> str:
    cluster = {"ps": [f"127.0.0.1:{_free_port()}"],
               "worker": [f"127.0.0.1:{worker_port or _free_port()}"]}
    if scheduler:
        cluster["scheduler"] = [f"127.0.0.1:{_free_port()}"]
    return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": index}})


def one_error_line(result: subprocess.CompletedProcess[str], *, names: str,
                   prog: str = "python -m pshard.worker") -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines
    assert names in lines[0], lines
    assert "final:" not in result.stdout  # it never started


def test_a_parameter_servers_tf_config_is_refused_in_one_line():
    result = run(["-m", "pshard.worker"], env=child_env(TF_CONFIG=tf_config("ps")))

    one_error_line(result, names="task.type: got 'ps'")


def test_a_model_path_under_a_file_is_refused_before_training(tmp_path: Path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = run(["-m", "pshard.worker", "--output", str(blocker / "model.pt")],
                 env=child_env(TF_CONFIG=tf_config()))

    one_error_line(result, names=f"--output: cannot write '{blocker / 'model.pt'}'")


def test_a_metrics_path_that_is_a_directory_is_refused(tmp_path: Path):
    result = run(["-m", "pshard.worker", "--metrics", str(tmp_path)], env=child_env(TF_CONFIG=tf_config()))

    one_error_line(result, names="--metrics: cannot write")


def test_a_chief_that_cannot_host_the_scheduler_on_its_port_says_so_in_one_line():
    with port_in_use() as port:
        # No scheduler task: worker 0 hosts the scheduler at its own address, which is taken.
        config = tf_config(scheduler=False, worker_port=port)
        result = run(["-m", "pshard", "worker"], env=child_env(TF_CONFIG=config))

    one_error_line(result, prog="pshard worker", names=f"hosts the scheduler at 127.0.0.1:{port}")
    assert "address already in use" in result.stderr


def test_an_unknown_log_level_is_a_usage_error():
    result = run(["-m", "pshard.worker", "--log-level", "LOUD"], env=child_env(TF_CONFIG=tf_config()))

    assert result.returncode == 2
    assert "--log-level" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize(("flag", "value"), [("--epochs", "0"), ("--startup-timeout-s", "0"),
                                             ("--step-timeout-s", "nan"), ("--threads", "-1")])
def test_a_number_out_of_range_is_a_usage_error_naming_the_flag(flag: str, value: str):
    result = run(["-m", "pshard.worker", flag, value], env=child_env(TF_CONFIG=tf_config()))

    assert result.returncode == 2
    assert flag in result.stderr and repr(value)[1:-1] in result.stderr and "Traceback" not in result.stderr


def _start(env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "pshard.worker", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_sigterm_during_start_up_is_a_quiet_stop():
    process = _start(child_env(TF_CONFIG=tf_config()))
    wait_until_catching(process, signal.SIGTERM)  # the first lines of __main__ ran; torch loads

    out, err = terminate_quietly(process)

    assert (process.returncode, out, err) == (128 + signal.SIGTERM, "", "")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_while_waiting_for_the_scheduler_is_quiet_and_reported_in_the_final_line(
        tmp_path: Path, sig: signal.Signals):
    # The scheduler's address is a free port nobody listens on: registering waits (up to the
    # start-up timeout, far longer than this test) until the signal.
    process = _start(child_env(TF_CONFIG=tf_config()), "--data-dir", str(tmp_path / "none"),
                     "--log-level", "INFO", "--startup-timeout-s", str(WAIT_S * 2))
    try:
        assert process.stderr is not None
        for line in process.stderr:  # bounded: the process ends at the latest at its timeout
            if "training images" in line:  # data loaded; registering comes next
                break
        process.send_signal(sig)
        out, err = process.communicate(timeout=WAIT_S)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=WAIT_S)

    assert process.returncode == 128 + sig, err
    assert "Traceback" not in err and "error:" not in err, err
    (final,) = [line for line in out.splitlines() if line.startswith("final:")]
    assert final.startswith("final: role=chief failed=stopped "), out
