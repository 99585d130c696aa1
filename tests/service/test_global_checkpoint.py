"""Global checkpoints (docs/architecture.md, 9 Failures) on real in-process servers over gRPC.

Reshard: sync training with 2 workers is deterministic (each clock's update is the optimizer
applied once to the mean of the same two gradients; a + b == b + a in IEEE arithmetic, and
every optimizer works element by element, so how the elements are cut into slices changes
nothing). A checkpoint taken on 2 servers and restored onto 3 or 1 must therefore continue to
exactly the weights of the run that stayed on 2 servers: the comparison is bit for bit.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common import checkpoint_store as ckpt
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.errors import LayoutConflictError
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.sparse import TableConfig
from pshard.ps_server.service import ServerThread
from pshard.ps_server.settings import ServerSettings
from pshard.worker import checkpoint_coordinator as checkpoints

from pshard.cli import main as cli_main
from tests.service.conftest import WAIT_S

JOB = JobConfig(mode="sync", optimizer=OptimizerConfig(name="adam", lr=0.05), job_id="reshard")
WORKERS = ("w0", "w1")
# "big" is cut into several slices (a slice bound of 256 bytes), "bias" stays whole.
INITIAL = {"big": np.linspace(-1.0, 1.0, 300, dtype=np.float32).reshape(20, 15),
           "bias": np.arange(7, dtype=np.float32)}
SLICE_BYTES = 256
TABLE = TableConfig("emb", 4, optimizer="adagrad", lr=0.1, seed=3)
IDS = np.arange(0, 400, 3, dtype=np.int64)


def gradient(weights: dict[str, np.ndarray], worker: str, clock: int) -> dict[str, np.ndarray]:
    """Deterministic, different per worker and clock, and dependent on the weights."""
    scale = np.float32(1.0 + 0.5 * WORKERS.index(worker))
    return {k: (np.sin(w * np.float32(clock + 1)) * scale).astype(np.float32) for k, w in weights.items()}


def cluster_of(new_client: Callable[..., PSClient], addresses: Sequence[str]) -> list[PSClient]:
    """One client per worker, on the layout of INITIAL over `addresses`."""
    layout = plan_layout([ParamSpec(k, "float32", v.shape) for k, v in INITIAL.items()], addresses,
                         SLICE_BYTES)
    return [new_client(addresses, w, layout=layout) for w in WORKERS]


def cluster(start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient], n: int,
            root: Path) -> list[PSClient]:
    """`root`: the servers' --global-checkpoint-dir, the only place they write and read checkpoints."""
    servers = [start_server(ServerSettings(static_quorum={w: 0 for w in WORKERS},
                                           global_checkpoint_dir=str(root))) for _ in range(n)]
    return cluster_of(new_client, [s.address for s in servers])


def train(clients: Sequence[PSClient], first: int, steps: int) -> dict[str, np.ndarray]:
    """Both workers train clocks first..first+steps-1 concurrently; the weights after."""
    results: dict[str, dict[str, np.ndarray]] = {}
    errors: list[BaseException] = []

    def run(client: PSClient) -> None:
        try:
            weights = client.pull(first)
            for clock in range(first, first + steps):
                weights = client.push_pull(gradient(weights, client.worker_id, clock), clock)
            results[client.worker_id] = weights
        except BaseException as err:  # reported by the test thread
            errors.append(err)

    threads = [threading.Thread(target=run, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 3)
    assert not any(t.is_alive() for t in threads), "training did not finish in time"
    assert not errors, errors
    np.testing.assert_array_equal(results["w0"]["big"], results["w1"]["big"])
    return results["w0"]


def touch_table(client: PSClient, clock: int) -> np.ndarray:
    """Push a deterministic row gradient for IDS; the rows after."""
    grads = np.outer(np.cos(IDS.astype(np.float32) + clock), np.arange(1, 5, dtype=np.float32))
    client.push_rows(TABLE.name, IDS, grads.astype(np.float32), clock)
    return client.pull_rows(TABLE.name, IDS, clock)


def start_job(clients: Sequence[PSClient], root: Path | None = None) -> int:
    clock = 0
    if root is not None:
        restored = checkpoints.restore(clients[0], root, JOB)
        assert restored is not None
        clock = restored
    for c in clients:
        c.declare(INITIAL, JOB)
    clients[0].declare_table(TABLE)
    return clock


@dataclass(frozen=True)
class Taken:
    root: Path  # holds one checkpoint, at clock 4, written by 2 servers
    weights: dict[str, np.ndarray]  # at clock 4
    rows: np.ndarray  # of IDS at clock 4
    reference: dict[str, np.ndarray]  # the run that stayed on 2 servers, 3 clocks later
    reference_rows: np.ndarray  # and its rows after one more table push


@pytest.fixture
def taken(start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient], tmp_path: Path
          ) -> Taken:
    clients = cluster(start_server, new_client, 2, tmp_path / "ckpt")
    start_job(clients)
    weights = train(clients, 0, 4)
    rows = touch_table(clients[0], 0)
    # The chief (w0) checkpoints between its steps; w1 has already pushed clock 4. That gradient is not
    # in the checkpoint: after the restore w1 pushes clock 4 again and must not be dropped as a duplicate.
    clients[1].wait(clients[1].push(gradient(weights, "w1", 4), 4))
    checkpoint = checkpoints.save(clients[0], tmp_path / "ckpt", 4)
    assert checkpoint.clock == 4 and checkpoint.servers == 2
    reference_rows = touch_table(clients[0], 1)
    return Taken(tmp_path / "ckpt", weights, rows, train(clients, 4, 3), reference_rows)


@pytest.mark.parametrize("servers", [3, 1])
def test_checkpoint_of_two_servers_continues_identically_on_another_number(
        taken: Taken, servers: int,
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient]) -> None:
    root, reference, reference_rows = taken.root, taken.reference, taken.reference_rows
    clients = cluster(start_server, new_client, servers, taken.root)
    assert len({s.server for s in clients[0].layout.slices_of("big")}) == servers  # really re-cut  # type: ignore[union-attr]
    assert start_job(clients, root) == 4
    stats = clients[0].stats()
    assert [(s.min_version, s.max_version) for s in stats] == [(4, 4)] * servers
    assert sum(s.slices for s in stats) == len(clients[0].layout.slices)  # type: ignore[union-attr]
    rows = touch_table(clients[0], 1)
    after = train(clients, 4, 3)
    for key in INITIAL:
        np.testing.assert_array_equal(after[key], reference[key], err_msg=key)
    np.testing.assert_array_equal(rows, reference_rows)


def test_restore_refuses_another_jobs_checkpoint_unless_resumed(
        taken: Taken,
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient]) -> None:
    root = taken.root
    other = JobConfig(mode="sync", optimizer=JOB.optimizer, job_id="another")
    clients = cluster(start_server, new_client, 2, taken.root)
    with pytest.raises(LayoutConflictError, match=r"'reshard'.*'another'"):
        checkpoints.restore(clients[0], root, other)
    assert checkpoints.restore(clients[0], root, other, resume=True) == 4


def test_a_server_holding_a_model_keeps_it(
        taken: Taken,
        start_server: Callable[..., ServerThread], new_client: Callable[..., PSClient]) -> None:
    clients = cluster(start_server, new_client, 2, taken.root)
    start_job(clients)
    assert checkpoints.restore(clients[0], taken.root, JOB) == 4
    assert [s.max_version for s in clients[0].stats()] == [0, 0]
    np.testing.assert_array_equal(clients[0].pull(0)["bias"], INITIAL["bias"])


def test_retention_keeps_the_newest_k(start_server: Callable[..., ServerThread],
                                      new_client: Callable[..., PSClient], tmp_path: Path) -> None:
    clients = cluster(start_server, new_client, 2, tmp_path / "ckpt")
    start_job(clients)
    root = tmp_path / "ckpt"
    for clock in range(4):
        if clock:
            train(clients, clock - 1, 1)
        checkpoints.save(clients[0], root, clock, keep=2)
    committed, torn = ckpt.scan(root, verify=True)
    assert [c.clock for c in committed] == [2, 3] and torn == []
    assert sorted(p.name.split("-")[1] for p in root.iterdir()) == ["000000000002", "000000000003"]


def test_export_writes_a_torch_state_dict_and_the_tables(taken: Taken, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    out = tmp_path / "export"
    assert cli_main(["checkpoint", "export", str(taken.root), "--out", str(out)]) == 0
    state = torch.load(out / "model.pt", weights_only=True)
    assert sorted(state) == sorted(INITIAL)
    for key, value in taken.weights.items():
        assert state[key].shape == INITIAL[key].shape and state[key].dtype == torch.float32
        np.testing.assert_array_equal(state[key].numpy(), value, err_msg=key)
    ids, rows = np.load(out / "tables" / "emb" / "ids.npy"), np.load(out / "tables" / "emb" / "rows.npy")
    order = np.argsort(ids)
    np.testing.assert_array_equal(ids[order], IDS)
    np.testing.assert_array_equal(rows[order], taken.rows)
    # A plain state_dict: a torch module with those parameters loads it as it is.
    module = torch.nn.Module()
    for key, value in INITIAL.items():
        module.register_parameter(key, torch.nn.Parameter(torch.zeros(value.shape)))
    module.load_state_dict(state)


def test_checkpoint_list_and_prune_commands(start_server: Callable[..., ServerThread],
                                            new_client: Callable[..., PSClient], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    clients = cluster(start_server, new_client, 1, tmp_path / "ckpt")
    start_job(clients)
    root = tmp_path / "ckpt"
    for clock in range(3):
        if clock:
            train(clients, clock - 1, 1)
        checkpoints.save(clients[0], root, clock)
    (root / "ckpt-000000000009-0badc0de").mkdir()  # a torn one: no manifest
    assert cli_main(["checkpoint", "list", str(root), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [c["clock"] for c in listed["committed"]] == [0, 1, 2]
    assert [Path(t["path"]).name for t in listed["torn"]] == ["ckpt-000000000009-0badc0de"]
    assert cli_main(["checkpoint", "prune", str(root), "--keep-checkpoints", "1"]) == 0
    assert [c.clock for c in ckpt.scan(root)[0]] == [2]
    assert cli_main(["checkpoint", "export", str(root), "--clock", "0", "--out", str(tmp_path / "x")]) == 1
    assert "no committed checkpoint at clock 0" in capsys.readouterr().err
