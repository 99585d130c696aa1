"""Checkpoints carry the job's identity (issue 10): a server restores only a checkpoint of the same job;
another job's is set aside unless the server was started with --resume (ServerSettings.resume), and
either choice is logged loudly. Real servers on 127.0.0.1:0 sharing one checkpoint directory."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from pshard.common.errors import JobConflictError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb

from .conftest import WAIT_S

MODEL = {"w": np.arange(6, dtype=np.float32)}
SGD = OptimizerConfig(name="sgd", lr=1.0)


def job(job_id: str) -> JobConfig:
    return JobConfig(mode="async", optimizer=SGD, job_id=job_id)


def _declared_values(server, wire, job_id: str) -> np.ndarray:
    reply = wire.declare(server, job(job_id), MODEL)
    return wire.array(reply.slices[0])


def _trained_checkpoint(start_server, wire, directory) -> np.ndarray:
    """Job 'run-1' trains one step and checkpoints into `directory`; its weights."""
    server = start_server(ServerSettings(checkpoint_dir=str(directory), static_quorum={"w0": 0}))
    wire.declare(server, job("run-1"), MODEL)
    wire.stub(server).Push(wire.push_request("w0", 0, {"w": np.full(6, 0.5, np.float32)}), timeout=WAIT_S)
    wire.stub(server).Checkpoint(pb.CheckpointRequest(), timeout=WAIT_S)
    trained = MODEL["w"] - 0.5
    server.stop(grace_s=0.2)
    return trained


def test_another_jobs_checkpoint_is_not_restored(start_server, wire, tmp_path, caplog):
    trained = _trained_checkpoint(start_server, wire, tmp_path)
    caplog.set_level(logging.WARNING, logger="pshard.ps")

    server = start_server(ServerSettings(checkpoint_dir=str(tmp_path), static_quorum={"w0": 0}))

    np.testing.assert_array_equal(_declared_values(server, wire, "run-2"), MODEL["w"])
    assert not np.array_equal(trained, MODEL["w"])
    stats = wire.stats(server)
    assert (stats.pushes_applied, dict(stats.worker_clocks)) == (0, {})  # the old run's clocks are gone too
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "NOT RESTORING" in message and "'run-1'" in message and "'run-2'" in message
    assert "--resume" in message
    # A worker of the new run is not fenced by the old run's generations: its push at clock 0 lands.
    wire.stub(server).Push(wire.push_request("w0", 0, {"w": np.ones(6, np.float32)}), timeout=WAIT_S)
    assert wire.stats(server).pushes_applied == 1


def test_the_same_jobs_checkpoint_is_restored(start_server, wire, tmp_path, caplog):
    trained = _trained_checkpoint(start_server, wire, tmp_path)
    caplog.set_level(logging.WARNING, logger="pshard.ps")

    server = start_server(ServerSettings(checkpoint_dir=str(tmp_path), static_quorum={"w0": 0}))

    np.testing.assert_array_equal(_declared_values(server, wire, "run-1"), trained)
    assert any("job 'run-1' resumes from its checkpoint" in r.getMessage() for r in caplog.records)


def test_resume_continues_another_jobs_checkpoint_loudly(start_server, wire, tmp_path, caplog):
    trained = _trained_checkpoint(start_server, wire, tmp_path)
    caplog.set_level(logging.WARNING, logger="pshard.ps")

    server = start_server(ServerSettings(checkpoint_dir=str(tmp_path), static_quorum={"w0": 0}, resume=True))

    np.testing.assert_array_equal(_declared_values(server, wire, "run-2"), trained)
    assert any("RESUMING ANOTHER JOB (--resume)" in r.getMessage() and "'run-1'" in r.getMessage()
               for r in caplog.records)
    # From now on it is run-2's: its checkpoints say so, and a restart restores them for run-2.
    wire.stub(server).Checkpoint(pb.CheckpointRequest(), timeout=WAIT_S)
    server.stop(grace_s=0.2)
    again = start_server(ServerSettings(checkpoint_dir=str(tmp_path), static_quorum={"w0": 0}))
    np.testing.assert_array_equal(_declared_values(again, wire, "run-2"), trained)


def test_a_resumed_job_is_not_fenced_by_the_other_jobs_generations(start_server, wire, tmp_path):
    """run-1's worker w0 was at generation 7; run-2's scheduler starts over and hands w0 generation 1.
    The resumed shard must take run-2's w0 as it is, not as an old incarnation of run-1's w0."""
    first = start_server(ServerSettings(checkpoint_dir=str(tmp_path), static_quorum={"w0": 7}))
    wire.declare(first, job("run-1"), MODEL)
    wire.stub(first).Push(wire.push_request("w0", 0, {"w": np.full(6, 0.5, np.float32)}, generation=7),
                          timeout=WAIT_S)
    wire.stub(first).Checkpoint(pb.CheckpointRequest(), timeout=WAIT_S)
    first.stop(grace_s=0.2)

    server = start_server(ServerSettings(checkpoint_dir=str(tmp_path), static_quorum={"w0": 1}, resume=True))
    np.testing.assert_array_equal(_declared_values(server, wire, "run-2"), MODEL["w"] - 0.5)

    reply = wire.stub(server).Push(wire.push_request("w0", 1, {"w": np.ones(6, np.float32)}, generation=1),
                                   timeout=WAIT_S)
    assert reply.applied == 1


def _live_server_of_run_1(start_server, wire, **settings) -> tuple[object, np.ndarray]:
    server = start_server(ServerSettings(static_quorum={"w0": 0}, **settings))
    wire.declare(server, job("run-1"), MODEL)
    wire.stub(server).Push(wire.push_request("w0", 0, {"w": np.full(6, 0.5, np.float32)}), timeout=WAIT_S)
    return server, MODEL["w"] - 0.5


def test_a_new_job_on_live_servers_of_another_is_refused_naming_both(start_server, wire, new_client):
    server, trained = _live_server_of_run_1(start_server, wire)

    refusal = r"job 'run-2': this server holds the parameters of job 'run-1' \(slice versions 1\.\.1\).*resu"
    with pytest.raises(JobConflictError, match=refusal):
        new_client([server], "w0").declare({"w": np.zeros(6, np.float32)}, job("run-2"))
    np.testing.assert_array_equal(_declared_values(server, wire, "run-1"), trained)  # run-1 unharmed


def test_a_new_job_on_live_servers_started_with_resume_continues_their_weights(start_server, wire, new_client,
                                                                                caplog):
    server, trained = _live_server_of_run_1(start_server, wire, resume=True)
    caplog.set_level(logging.WARNING, logger="pshard.ps")

    held = new_client([server], "w0").declare({"w": np.zeros(6, np.float32)}, job("run-2"))

    np.testing.assert_array_equal(held["w"], trained)
    assert any("RESUMING ANOTHER JOB (--resume)" in r.getMessage() and "'run-1'" in r.getMessage()
               for r in caplog.records)
