"""Checkpoint faults of a real server process, each one line: an unreadable shard checkpoint at start
(exit 2), a full or read-only checkpoint disk under the Checkpoint RPC (RESOURCE_EXHAUSTED or
FAILED_PRECONDITION naming the file and the errno, not UNKNOWN), periodic checkpoints that fail (one
line each), a SIGTERM after them (a clean stop), and a restore that says what it restored."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.errors import CheckpointError, CheckpointSpaceError
from pshard.common.job import JobConfig

from tests.e2e.harness import Proc, Procs, wait_until
from tests.service.entrypoints import REPO, WAIT_S, child_env
from tests.service.mounts import remount_read_only, tmpfs

PS = "python -m pshard.ps_server"
# 400 KB of weights: more than the 64 KiB tmpfs holds.
BIG = 100_000


def _server(procs: Procs, ckpt: Path, *extra: str) -> tuple[Proc, str]:
    ps = procs.python("ps", "-m", "pshard.ps_server", "--bind", "127.0.0.1:0", "--checkpoint-dir", str(ckpt),
                      *extra)
    return ps, "127.0.0.1:" + ps.wait_for_line(r"pshard ps: listening on port (\d+)", WAIT_S).group(1)


def _client(address: str) -> PSClient:
    return PSClient([address], "w0", timeout_s=WAIT_S, retry_budget_s=WAIT_S, transport="grpc")


def _trained(procs: Procs, ckpt: Path, steps: int, size: int = 1000) -> Proc:
    """A server that trained `steps` pushes of a `size`-element parameter and checkpointed them."""
    ps, address = _server(procs, ckpt)
    with _client(address) as client:
        client.declare({"w": np.zeros(size, np.float32)}, JobConfig(mode="async", job_id="job"))
        for step in range(steps):
            client.push_pull({"w": np.ones(size, np.float32)}, step)
        client.checkpoint()
    return ps


def _flip_a_byte(npz: Path) -> None:
    data = bytearray(npz.read_bytes())
    data[len(data) // 2] ^= 0xFF
    npz.write_bytes(bytes(data))


@pytest.mark.parametrize(("spoil", "says"), [
    (lambda npz: npz.write_bytes(npz.read_bytes()[:300]), "cannot read .*npz \\(BadZipFile"),
    (_flip_a_byte, "cannot read .*npz \\((BadZipFile|error|ValueError)"),
    (lambda npz: npz.unlink(), "names shard\\.ckpt-[0-9a-f]+\\.npz, which is missing"),
], ids=["truncated", "byte-flipped", "missing"])
def test_an_unreadable_shard_checkpoint_is_one_line_and_exit_2(procs: Procs, tmp_path: Path, spoil: Any,
                                                                says: str) -> None:
    ckpt = tmp_path / "ckpt"
    ps = _trained(procs, ckpt, steps=3)
    ps.signal_group(signal.SIGTERM)
    assert ps.wait(WAIT_S) == 0
    (npz,) = ckpt.glob("shard.ckpt-*.npz")
    spoil(npz)
    result = subprocess.run([sys.executable, "-m", "pshard.ps_server", "--bind", "127.0.0.1:0",
                             "--checkpoint-dir", str(ckpt)], cwd=REPO, env=child_env(), capture_output=True,
                            text=True, timeout=WAIT_S)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"{PS}: error: checkpoint {ckpt / 'shard.json'}: "), line
    assert re.search(says, line), line


def test_a_restart_logs_the_checkpoint_and_version_it_restored_and_says_when_it_is_older(
        procs: Procs, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ps = _trained(procs, ckpt, steps=5)
    address = "127.0.0.1:" + ps.wait_for_line(r"pshard ps: listening on port (\d+)", WAIT_S).group(1)
    with _client(address) as client:  # trained on to version 12, but never checkpointed again
        client.declare({"w": np.zeros(1000, np.float32)}, JobConfig(mode="async", job_id="job"))
        for step in range(5, 12):
            client.push_pull({"w": np.ones(1000, np.float32)}, step)
    ps.kill()
    again, address = _server(procs, ckpt)
    line = again.wait_for_line(r"restoring checkpoint", WAIT_S).string
    (npz,) = ckpt.glob("shard.ckpt-*.npz")
    assert f"restoring checkpoint {ckpt / 'shard.json'} (arrays {npz.name}, saved " in line, line
    assert line.endswith("1 slices at version 5"), line
    with _client(address) as client:
        client.declare({"w": np.zeros(1000, np.float32)}, JobConfig(mode="async", job_id="job"))
        client.push_pull({"w": np.ones(1000, np.float32)}, 12)
    older = again.wait_for_line(r"restarted from an older checkpoint", WAIT_S).string
    assert "worker 'w0' is at clock 12, but the checkpoint restored at start" in older, older
    assert "is at version 5" in older and "after version 5 are lost" in older, older


def _refusal(client: PSClient) -> CheckpointError:
    with pytest.raises(CheckpointError) as info:
        client.checkpoint()
    return info.value


def test_a_full_then_read_only_disk_refuses_checkpoints_in_one_line_and_sigterm_stops_cleanly(
        procs: Procs, tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", size="64k") as disk:
        ps, address = _server(procs, disk, "--checkpoint-interval-s", "0.2")
        with _client(address) as client:
            client.declare({"w": np.zeros(BIG, np.float32)}, JobConfig(mode="async", job_id="job"))
            full = _refusal(client)
            assert isinstance(full, CheckpointSpaceError)
            assert re.match(rf"checkpoint: cannot write '{re.escape(str(disk))}/[^']+': ENOSPC "
                            r"\(No space left", str(full)), full
            # The periodic checkpoints fail too: one line each, no traceback.
            wait_until(lambda: sum("periodic checkpoint failed: checkpoint: cannot write" in line
                                   for line in ps.lines) >= 2, WAIT_S, "two periodic failures")
            remount_read_only(disk)
            read_only = _refusal(client)
            assert type(read_only) is CheckpointError
            assert re.match(rf"checkpoint: cannot write '{re.escape(str(disk))}[^']*': EROFS \(Read-only",
                            str(read_only)), read_only
            # PSClient maps the status back: RESOURCE_EXHAUSTED, then FAILED_PRECONDITION; never UNKNOWN.
            assert (full.status, read_only.status) == ("RESOURCE_EXHAUSTED", "FAILED_PRECONDITION")
        ps.signal_group(signal.SIGTERM)
        code = ps.wait(WAIT_S)
    output = "\n".join(ps.lines)
    assert code == 1 and "Traceback" not in output and "Event loop is closed" not in output, ps.output()
    assert re.search(r"final checkpoint failed: checkpoint: cannot write .*: EROFS", output), ps.output()
