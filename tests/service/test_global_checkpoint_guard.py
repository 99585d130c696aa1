"""Global-checkpoint requests a server refuses at once, writing and reading nothing (issues 7 and 11).

Fuzzer findings: SaveCheckpointPart(clock=2**64-1) held the call for its whole timeout (no answer in
10 s), and the directory of SaveCheckpointPart and RestoreCheckpoint was any path on the server's
host: an arbitrary file write and read. Now a part's clock is bounded by what the server knows, and
checkpoints live only under the server's --global-checkpoint-dir.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from pshard.common.job import JobConfig
from pshard.common.wire import codec
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb
from tests.service.conftest import WAIT_S

JOB = JobConfig(mode="sync", job_id="guard")
MODEL = {"w": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.ones(3, np.float32)}


def _ranges() -> list[pb.SliceRange]:
    return [pb.SliceRange(key=k, part=0, offset=0, numel=v.size, shape=list(v.shape))
            for k, v in MODEL.items()]


def _save(wire, server, directory: str, clock: int = 0, ranges: list[pb.SliceRange] | None = None,
          timeout_ms: int = 60_000) -> pb.SaveCheckpointPartResponse:
    return wire.stub(server).SaveCheckpointPart(pb.SaveCheckpointPartRequest(
        directory=directory, clock=clock, ranges=_ranges() if ranges is None else ranges, server=0,
        timeout_ms=timeout_ms), timeout=WAIT_S)


def _restore(wire, server, directory: str) -> pb.RestoreCheckpointResponse:
    return wire.stub(server).RestoreCheckpoint(pb.RestoreCheckpointRequest(
        directory=directory, config=codec.job_to_proto(JOB), ranges=_ranges(), server=0, servers=1),
        timeout=WAIT_S)


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    (root / "ckpt-0").mkdir(parents=True)
    elsewhere.mkdir()
    return root, elsewhere


@pytest.fixture
def server(start_server, wire, dirs):
    server = start_server(ServerSettings(default_job=JOB, static_quorum={"w0": 0},
                                         global_checkpoint_dir=str(dirs[0])))
    wire.declare(server, JOB, MODEL)
    return server


def test_a_part_inside_the_root_is_written(server, wire, dirs):
    reply = _save(wire, server, str(dirs[0] / "ckpt-0"))
    assert {f.name for f in reply.files} == {"part-0.npz", "part-0.json"}
    assert (dirs[0] / "ckpt-0" / "part-0.json").exists()


def test_a_clock_beyond_what_the_server_knows_is_refused_at_once(server, wire, dirs):
    before = wire.read(server, MODEL)
    started = time.monotonic()
    error = _refused(lambda: _save(wire, server, str(dirs[0] / "ckpt-0"), clock=2**64 - 1))
    assert time.monotonic() - started < 5.0  # it waited for the whole timeout (a minute here) before
    assert error.code() is grpc.StatusCode.OUT_OF_RANGE, error
    assert "18446744073709551615" in error.details() and "version is 0" in error.details(), error.details()
    assert _refused(lambda: _save(wire, server, str(dirs[0] / "ckpt-0"), clock=2)).code() is (
        grpc.StatusCode.OUT_OF_RANGE)
    assert not list((dirs[0] / "ckpt-0").iterdir())
    assert wire.read(server, MODEL) == before
    # The clock being taken is still waited for (and times out without its pushes).
    error = _refused(lambda: _save(wire, server, str(dirs[0] / "ckpt-0"), clock=1, timeout_ms=50))
    assert error.code() is grpc.StatusCode.DEADLINE_EXCEEDED, error


def test_directories_outside_the_root_are_refused_and_nothing_is_written(server, wire, dirs, tmp_path):
    root, elsewhere = dirs
    (root / "escape").symlink_to(elsewhere, target_is_directory=True)
    climbing = str(root / "ckpt-0" / ".." / ".." / "elsewhere")
    for directory, code in ((str(elsewhere), grpc.StatusCode.PERMISSION_DENIED),
                            (climbing, grpc.StatusCode.INVALID_ARGUMENT),
                            (str(root / "escape"), grpc.StatusCode.PERMISSION_DENIED),
                            ("", grpc.StatusCode.INVALID_ARGUMENT),
                            (str(root), grpc.StatusCode.PERMISSION_DENIED)):
        for rpc in (_save, _restore):
            error = _refused(lambda: rpc(wire, server, directory))  # noqa: B023
            assert error.code() is code, (directory, error)
            assert "directory" in error.details() and directory in error.details(), error.details()
    assert not list(elsewhere.iterdir()) and not (tmp_path / "part-0.npz").exists()
    assert not list((root / "ckpt-0").iterdir())


def test_ranges_that_do_not_match_the_servers_slices_are_invalid(server, wire, dirs):
    directory = str(dirs[0] / "ckpt-0")
    w, b = _ranges()
    wrong_size = pb.SliceRange(key="w", part=0, offset=0, numel=5, shape=[4, 3])
    outside = pb.SliceRange(key="w", part=0, offset=10, numel=12, shape=[4, 3])
    for ranges in ([w], [w, b, pb.SliceRange(key="x", numel=1, shape=[1])], [wrong_size, b], [outside, b],
                   [w, w, b], []):
        error = _refused(lambda: _save(wire, server, directory, ranges=ranges))  # noqa: B023
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (ranges, error)
        assert "ranges" in error.details(), error.details()
    assert not list((dirs[0] / "ckpt-0").iterdir())


def test_without_a_root_global_checkpoints_are_refused_naming_the_flag(start_server, wire, dirs):
    server = start_server(ServerSettings(default_job=JOB, static_quorum={"w0": 0}))
    wire.declare(server, JOB, MODEL)
    for call in (lambda: _save(wire, server, str(dirs[0] / "ckpt-0")),
                 lambda: _restore(wire, server, str(dirs[0] / "ckpt-0"))):
        error = _refused(call)
        assert error.code() is grpc.StatusCode.FAILED_PRECONDITION, error
        assert "--global-checkpoint-dir" in error.details(), error.details()
    assert not list((dirs[0] / "ckpt-0").iterdir())


def test_a_phase_parent_or_background_write_that_does_not_exist_is_refused_naming_it(server, wire, dirs):
    directory = str(dirs[0] / "ckpt-0")

    def save(**fields: Any) -> pb.SaveCheckpointPartResponse:
        return wire.stub(server).SaveCheckpointPart(pb.SaveCheckpointPartRequest(
            directory=directory, clock=0, ranges=_ranges(), server=0, **fields), timeout=WAIT_S)

    error = _refused(lambda: save(phase=7))
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "phase: got 7" in error.details(), error
    error = _refused(lambda: save(phase=pb.CHECKPOINT_PHASE_DURABLE))
    assert error.code() is grpc.StatusCode.FAILED_PRECONDITION, error
    assert "no background write into" in error.details(), error.details()
    error = _refused(lambda: save(parent=str(dirs[1])))
    assert error.code() is grpc.StatusCode.PERMISSION_DENIED and "parent:" in error.details(), error
    error = _refused(lambda: save(parent=directory))  # inside the root, but no committed checkpoint
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT and "holds no MANIFEST.json" in error.details()
    assert not (dirs[0] / "ckpt-0" / "part-0.json").exists()  # nothing written
    reply = save(phase=pb.CHECKPOINT_PHASE_CAPTURE)
    assert not reply.files
    assert {f.name for f in save(phase=pb.CHECKPOINT_PHASE_DURABLE).files} == {"part-0.npz", "part-0.json"}
