"""The one stale-generation recovery: PSClient resends once under the generation it re-registered with.

After a scheduler restart a server can learn a worker's new generation before the worker's own
Register reply arrives, and refuses the old stamp. `await_generation` (ClusterSession provides it
from the SchedulerClient) lets the client wait for that reply and resend; pushes are idempotent.
"""

from __future__ import annotations

import numpy as np
import pytest
from pshard.common.errors import StaleGenerationError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.ps_server.settings import ServerSettings

JOB = JobConfig(mode="sync", optimizer=OptimizerConfig(name="sgd", lr=1.0))
PARAMS = {"w": np.zeros(4, np.float32)}
GRADS = {"w": np.ones(4, np.float32)}


def test_a_refused_step_is_resent_once_the_new_generation_arrives(start_server, new_client):
    server = start_server(ServerSettings(static_quorum={"w0": 2}))  # the server knows generation 2
    current = [1]  # ...while our Register reply (generation 2) is still on its way
    waited: list[int] = []

    def await_generation(stamped: int, timeout_s: float) -> bool:
        waited.append(stamped)
        current[0] = 2  # the reply arrives
        return True

    client = new_client([server], "w0", generation=lambda: current[0], await_generation=await_generation)
    client.declare(PARAMS, JOB)
    weights = client.push_pull(GRADS, 0)

    assert waited == [1]
    np.testing.assert_array_equal(weights["w"], -GRADS["w"])
    assert client.last_result is not None and client.last_result.applied == 1


def test_without_a_newer_generation_the_refusal_stands(start_server, new_client):
    server = start_server(ServerSettings(static_quorum={"w0": 2}))
    client = new_client([server], "w0", generation=1, await_generation=lambda stamped, timeout_s: False)
    client.declare(PARAMS, JOB)

    with pytest.raises(StaleGenerationError, match="got generation 1, but generation 2"):
        client.push_pull(GRADS, 0)
