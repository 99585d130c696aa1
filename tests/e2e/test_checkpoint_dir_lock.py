"""One job per checkpoint directory: two launches (or two servers) on one directory at once.

Without the lock the second job started, and the two deleted each other's checkpoint files while
both exited 0. Several servers of one launch share its --checkpoint-dir (a sub-directory each).
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.e2e.harness import Procs, start_launcher

pytestmark = pytest.mark.e2e

TIMEOUT_S = 90

WAIT_AT_GATE = textwrap.dedent('''
    import sys, time
    from pathlib import Path
    print("waiting", flush=True)
    deadline = time.monotonic() + 80
    while not Path(sys.argv[1]).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
''')


def test_a_second_launch_on_a_held_checkpoint_dir_is_refused_naming_the_first(procs: Procs,
                                                                              tmp_path: Path) -> None:
    script, gate, shared = tmp_path / "wait.py", tmp_path / "gate", tmp_path / "ckpt"
    script.write_text(WAIT_AT_GATE)
    first = start_launcher(procs, "--ps", "2", "--workers", "1", "--checkpoint-dir", str(shared),
                           "--job-id", "job-a", str(script), str(gate))
    first.wait_for_line(r"^\[worker-0\] waiting$", TIMEOUT_S)  # its two servers hold ps-0/ and ps-1/

    second = start_launcher(procs, "--ps", "1", "--workers", "1", "--checkpoint-dir", str(shared),
                            "--job-id", "job-b", str(script), str(gate))
    assert second.wait(TIMEOUT_S) == 2, second.output()
    refusal = "\n".join(second.lines)
    assert f"--checkpoint-dir: '{shared}' is in use by job job-a (launcher, pid {first.pid} on " in refusal
    assert "[ps-0]" not in refusal  # refused before anything started

    gate.write_text("")
    assert first.wait(TIMEOUT_S) == 0, first.output()
    # The first job's lock went with it: the next job on the directory starts.
    third = start_launcher(procs, "--ps", "1", "--workers", "1", "--checkpoint-dir", str(shared),
                           "--job-id", "job-c", str(script), str(gate))
    assert third.wait(TIMEOUT_S) == 0, third.output()


def test_a_second_server_on_a_held_checkpoint_dir_refuses_to_start(procs: Procs, tmp_path: Path) -> None:
    shared = tmp_path / "ckpt"
    args = ("-m", "pshard.ps_server", "--insecure", "--bind", "127.0.0.1:0", "--checkpoint-dir", str(shared))
    first = procs.python("ps-a", *args, env={"PSHARD_JOB_ID": "job-a"})
    first.wait_for_line(r"listening on port \d+", TIMEOUT_S)
    second = procs.python("ps-b", *args, env={"PSHARD_JOB_ID": "job-b"})
    assert second.wait(TIMEOUT_S) == 2, second.output()
    assert f"is in use by job job-a (ps, pid {first.pid} on " in "\n".join(second.lines), second.output()
    first.kill()  # SIGKILL: the lock expires with its holder
    third = procs.python("ps-c", *args)
    third.wait_for_line(r"listening on port \d+", TIMEOUT_S)
