"""`python -m pshard.ps_server` (`pshard ps`) as a real process: usage, start-up errors, serving, stopping."""

from __future__ import annotations

import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.job import JobConfig
from pshard.common.rpc.health import probe
from pshard.ps_server.checkpoints.shard import load_shard
from pshard.ps_server.service import SERVICE_NAME

from tests.service.entrypoints import (
    REPO,
    WAIT_S,
    child_env,
    port_in_use,
    sigterm_during_start_up,
    terminate_quietly,
)


def _env() -> dict[str, str]:
    # The installed package (`pip install -e .`), not the repository's folders on PYTHONPATH.
    return child_env()


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pshard.ps_server", *args], cwd=REPO, env=env or _env(),
                          capture_output=True, text=True, timeout=WAIT_S)


def test_help_exits_0_and_lists_the_flags():
    result = _run("--help")

    assert result.returncode == 0, result.stderr
    for flag in ("--bind", "--mode", "--workers", "--checkpoint-dir", "--max-message-mb"):
        assert flag in result.stdout


@pytest.mark.parametrize(("tf_config", "field"), [
    ({"cluster": {"ps": ["127.0.0.1:7000"]}, "task": {"type": "ps"}}, "task.index"),
    ({"cluster": {"ps": ["127.0.0.1"]}, "task": {"type": "ps", "index": 0}}, "cluster.ps[0]"),
    ({"cluster": {"ps": ["127.0.0.1:7000"], "worker": ["127.0.0.1:7001"]}, "task": {"type": "worker",
                                                                                   "index": 0}}, "task.type"),
])
def test_bad_tf_config_exits_2_naming_the_field(tf_config, field):
    result = _run(env={**_env(), "TF_CONFIG": json.dumps(tf_config)})

    assert result.returncode == 2, (result.returncode, result.stderr)
    assert f"error: {field}" in result.stderr, result.stderr


def test_an_unusable_checkpoint_dir_exits_2_naming_the_flag_and_the_path(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")

    result = _run("--bind", "127.0.0.1:0", "--checkpoint-dir", str(not_a_dir / "ckpt"))

    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "--checkpoint-dir" in result.stderr and str(not_a_dir / "ckpt") in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def _read_lines(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def test_server_process_serves_and_stops_gracefully_on_sigterm_with_a_final_checkpoint(tmp_path):
    stderr = open(tmp_path / "stderr.log", "w+")  # noqa: SIM115 - the process writes it until the end
    process = subprocess.Popen(
        [sys.executable, "-m", "pshard.ps_server", "--bind", "127.0.0.1:0", "--mode", "async",
         "--checkpoint-dir", str(tmp_path / "ckpt")],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=stderr, text=True)
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True).start()
    try:
        line = lines.get(timeout=WAIT_S)
        match = re.search(r"listening on port (\d+)", line or "")
        assert match, f"first line {line!r}; stderr: {stderr.seek(0) or stderr.read()}"
        address = f"127.0.0.1:{match.group(1)}"
        for service in ("", SERVICE_NAME):
            serving, reason = probe(address, service, timeout_s=WAIT_S)
            assert serving, reason
        with PSClient([address], "w0", timeout_s=WAIT_S, retry_budget_s=WAIT_S) as client:
            client.declare({"a": np.zeros(4, np.float32)}, JobConfig(mode="async"))  # the --mode defaults
            stepped = client.push_pull({"a": np.ones(4, np.float32)}, 0)

        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=WAIT_S)

        assert code == 0, stderr.seek(0) or stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=WAIT_S)
        stderr.close()
    np.testing.assert_array_equal(stepped["a"], np.full(4, -0.01, np.float32))
    snapshot = load_shard(tmp_path / "ckpt", "shard")
    assert snapshot is not None, "no final checkpoint"
    [saved] = snapshot.slices
    assert (saved.key.key, saved.version, saved.clocks) == ("a", 1, {"w0": 0})
    np.testing.assert_array_equal(saved.value, stepped["a"])


# ---- start-up failures are one line and exit 2; a stop at any moment is quiet ----

def _one_error_line(result: subprocess.CompletedProcess[str], prog: str = "python -m pshard.ps_server",
                    ) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.startswith(f"{prog}: error: "), result.stderr
    return result.stderr.strip()


def test_a_port_in_use_is_one_line_naming_the_address():
    with port_in_use() as port:
        result = _run("--bind", f"127.0.0.1:{port}")

    assert _one_error_line(result).endswith(f"cannot listen on 127.0.0.1:{port}: address already in use")


def test_a_port_in_use_from_tf_config_is_one_line_too():
    with port_in_use() as port:
        tf_config = {"cluster": {"scheduler": ["127.0.0.1:1"], "ps": [f"127.0.0.1:{port}"]},
                     "task": {"type": "ps", "index": 0}}
        result = _run("--no-scheduler", env={**_env(), "TF_CONFIG": json.dumps(tf_config)})

    assert _one_error_line(result).endswith(f"cannot listen on 127.0.0.1:{port}: address already in use")


@pytest.mark.parametrize("make_unreadable", [
    lambda manifest: manifest.write_text("{not json"),
    lambda manifest: manifest.mkdir(),
], ids=["corrupt", "a-directory"])
def test_an_unreadable_checkpoint_is_one_line_naming_the_file(tmp_path, make_unreadable):
    manifest = tmp_path / "ckpt" / "shard.json"
    manifest.parent.mkdir()
    make_unreadable(manifest)

    result = _run("--bind", "127.0.0.1:0", "--checkpoint-dir", str(manifest.parent))

    line = _one_error_line(result)
    assert "--checkpoint-dir" in line and str(manifest) in line, line


def test_a_workers_tf_config_is_refused_in_one_line_naming_the_role():
    tf_config = {"cluster": {"ps": ["127.0.0.1:7000"], "worker": ["127.0.0.1:7001"]},
                 "task": {"type": "Worker", "index": 0}}

    result = _run(env={**_env(), "TF_CONFIG": json.dumps(tf_config)})

    assert "task.type: got 'worker' (index 0)" in _one_error_line(result)


def test_the_pshard_command_names_itself_in_errors_and_usage():
    with port_in_use() as port:
        result = subprocess.run([sys.executable, "-m", "pshard", "ps", "--bind", f"127.0.0.1:{port}"],
                                cwd=REPO, env=_env(), capture_output=True, text=True, timeout=WAIT_S)
    usage = subprocess.run([sys.executable, "-m", "pshard", "ps", "--help"], cwd=REPO, env=_env(),
                           capture_output=True, text=True, timeout=WAIT_S)

    _one_error_line(result, prog="pshard ps")
    assert usage.returncode == 0 and usage.stdout.startswith("usage: pshard ps "), usage.stdout


def test_sigterm_during_start_up_is_a_quiet_stop():
    code, out, err = sigterm_during_start_up("pshard.ps_server", _env())

    assert (code, err) == (0, "")
    assert "listening" not in out  # it was stopped before it served


def test_log_level_warning_leaves_a_served_and_stopped_server_silent():
    # --workers: without a quorum of any kind the server warns (test_a_server_with_neither_workers...).
    process = subprocess.Popen(
        [sys.executable, "-m", "pshard.ps_server", "--bind", "127.0.0.1:0", "--log-level", "warning",
         "--workers", "worker-0"],
        cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True).start()
        match = re.search(r"listening on port (\d+)", lines.get(timeout=WAIT_S) or "")
        assert match
        serving, reason = probe(f"127.0.0.1:{match.group(1)}", timeout_s=WAIT_S)
        assert serving, reason
    finally:
        _, err = terminate_quietly(process)

    assert (process.returncode, err) == (0, "")


def test_pull_timeout_default_is_the_servers_own():
    from pshard.ps_server.__main__ import build_parser
    from pshard.ps_server.settings import ServerSettings

    assert build_parser().parse_args([]).pull_timeout_s == ServerSettings().pull_timeout_s


def test_sigterm_while_registering_with_an_absent_scheduler_is_a_quiet_stop():
    with socket.socket() as absent:  # bound, never listening: the scheduler is not up (yet)
        absent.bind(("127.0.0.1", 0))
        tf_config = {"cluster": {"scheduler": [f"127.0.0.1:{absent.getsockname()[1]}"],
                                 "ps": ["127.0.0.1:7100"]}, "task": {"type": "ps", "index": 0}}
        process = subprocess.Popen(
            [sys.executable, "-m", "pshard.ps_server", "--bind", "127.0.0.1:0", "--log-level", "WARNING"],
            cwd=REPO, env={**_env(), "TF_CONFIG": json.dumps(tf_config)}, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True)
        try:
            lines: queue.Queue[str | None] = queue.Queue()
            threading.Thread(target=_read_lines, args=(process.stdout, lines), daemon=True).start()
            assert "listening on port" in (lines.get(timeout=WAIT_S) or "")  # registering from now on
        finally:
            _, err = terminate_quietly(process)

    assert (process.returncode, err) == (0, "")


def test_a_metrics_port_in_use_is_one_line_naming_the_address():
    with port_in_use() as port:
        result = _run("--bind", "127.0.0.1:0", "--metrics-port", str(port))

    assert _one_error_line(result).endswith(f"cannot listen on 127.0.0.1:{port}: address already in use")
