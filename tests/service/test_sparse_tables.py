"""Sparse tables through real parameter servers: conservation under concurrent clients, admission and
eviction, bad input, checkpoint round trip and export."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np
import pytest
from pshard.client.ps_client import PSClient
from pshard.common.errors import (
    InvalidArgumentError,
    LayoutConflictError,
    MessageTooLargeError,
    UnknownKeyError,
)
from pshard.common.job import JobConfig
from pshard.common.limits import Limits
from pshard.common.sparse import TableConfig
from pshard.ps_server.service import ServerThread
from pshard.ps_server.settings import ServerSettings
from pshard.ps_server.tables.table import SparseTable, initial_rows

from pshard.api.v1 import sparse_pb2 as pb
from pshard.api.v1 import sparse_pb2_grpc as pb_grpc

from .conftest import WAIT_S

StartServer = Callable[..., ServerThread]
NewClient = Callable[..., PSClient]


@pytest.mark.parametrize("transport", ["auto", "grpc"])  # auto: the fast-path session (shm on one host)
def test_async_pushes_of_8_concurrent_clients_are_all_conserved(
        start_server: StartServer, new_client: NewClient, transport: str) -> None:
    servers = [start_server(), start_server()]
    config = TableConfig("emb", 8, initializer="uniform", init_scale=1.0, optimizer="sgd", lr=1.0)
    universe = np.concatenate([np.arange(300), [2**62, -(2**62), -1]]).astype(np.int64)
    sums = [np.zeros((len(universe), 8)) for _ in range(8)]
    errors: list[BaseException] = []

    def work(w: int) -> None:
        try:
            client = new_client(servers, f"w{w}", transport=transport)
            client.declare_table(config)
            rng = np.random.default_rng(w)
            for step in range(25):
                pos = rng.integers(0, len(universe), 64)  # repeats: the client sums them
                grads = rng.integers(-3, 4, (64, 8)).astype(np.float32)
                client.pull_rows("emb", universe[pos], clock=step)
                client.push_rows("emb", universe[pos], grads, clock=step)
                np.add.at(sums[w], pos, grads)
        except BaseException as e:  # surfaced below, with the thread's traceback
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S * 6)
    assert not errors and not any(t.is_alive() for t in threads)
    reader = new_client(servers, "reader", transport=transport)
    reader.declare_table(config)
    expected = initial_rows(config, universe) - sum(sums)
    np.testing.assert_allclose(reader.pull_rows("emb", universe), expected, rtol=0, atol=1e-4)
    assert reader.tables.transports == ["shm" if transport == "auto" else "grpc"] * 2
    per_server = [s.rows for s in reader.tables.stats("emb")]
    assert sum(per_server) == len(universe) and min(per_server) > 0.3 * len(universe)


def test_admission_ttl_and_caps_through_a_server(start_server: StartServer, new_client: NewClient) -> None:
    client = new_client([start_server()], "w")
    one = np.ones((1, 2), np.float32)
    admit = TableConfig("admit", 2, lr=1.0, admit_after=2)
    client.declare_table(admit)
    init = initial_rows(admit, np.array([7], np.int64))
    assert client.push_rows("admit", np.array([7]), one) == 0
    np.testing.assert_array_equal(client.pull_rows("admit", np.array([7])), init)
    assert client.push_rows("admit", np.array([7]), one) == 1
    np.testing.assert_array_equal(client.pull_rows("admit", np.array([7])), init - 1)

    client.declare_table(TableConfig("ttl", 2, ttl=2))
    client.push_rows("ttl", np.array([1]), one, clock=1)
    client.push_rows("ttl", np.array([2]), one, clock=4)  # id 1 is 3 clocks old
    assert [(s.rows, s.evicted) for s in client.tables.stats("ttl")] == [(1, 1)]

    for policy, gone in (("lru", 1), ("lfu", 3)):
        client.declare_table(TableConfig(policy, 2, max_rows=3, cap_policy=policy))
        for clock, i in enumerate([1, 1, 1, 2, 2, 3, 4]):
            client.push_rows(policy, np.array([i]), one, clock=clock)
        stats = client.tables.stats(policy)[0]
        assert (stats.rows, stats.evicted) == (3, 1)
        live = {i for i in (1, 2, 3, 4) if not np.array_equal(
            client.pull_rows(policy, np.array([i]), clock=99), initial_rows(client.tables.configs[policy],
                                                                              np.array([i], np.int64)))}
        assert gone not in live


def _stub(server: ServerThread) -> pb_grpc.SparseTablesServiceStub:
    return pb_grpc.SparseTablesServiceStub(grpc.insecure_channel(server.address))


def test_bad_input_gets_a_status_naming_table_and_id_and_changes_nothing(start_server: StartServer,
                                                                         new_client: NewClient) -> None:
    server = start_server(ServerSettings(limits=Limits(max_request_bytes=64 * 1024)))
    client = new_client([server], "w")
    client.declare_table(TableConfig("t", 4, lr=1.0))
    ids = np.array([5, 6], np.int64)
    before = client.pull_rows("t", ids)
    stub = _stub(server)
    good = np.zeros((2, 4), np.float32)
    nan = good.copy()
    nan[1, 2] = np.nan
    cases = [
        (pb.PushRowsRequest(table="t", ids=ids.tobytes()[:13], grads=good.tobytes()), "INVALID_ARGUMENT",
         "table 't': ids are 13 bytes"),
        (pb.PushRowsRequest(table="t", ids=ids.tobytes(), grads=good[:, :3].tobytes()), "INVALID_ARGUMENT",
         "2 rows of dim 4"),
        (pb.PushRowsRequest(table="nope", ids=ids.tobytes(), grads=good.tobytes()), "NOT_FOUND",
         "table 'nope'"),
        (pb.PushRowsRequest(table="t", ids=ids.tobytes(), grads=nan.tobytes()), "INVALID_ARGUMENT",
         "gradient of id 6 holds nan"),
        (pb.PushRowsRequest(table="t", ids=np.array([5, 5]).tobytes(), grads=good.tobytes()),
         "INVALID_ARGUMENT", "id 5 appears more than once"),
        # 5000 rows of 16 bytes are 80 kB, past the 64 KiB limit.
        (pb.PullRowsRequest(table="t", ids=np.arange(5000, dtype=np.int64).tobytes()), "RESOURCE_EXHAUSTED",
         "table 't'"),
    ]
    for request, code, text in cases:
        call = stub.PullRows if isinstance(request, pb.PullRowsRequest) else stub.PushRows
        with pytest.raises(grpc.RpcError) as err:
            call(request, timeout=WAIT_S)
        assert err.value.code().name == code and text in err.value.details(), err.value.details()
    # The same refusals over the fast-path session: the server's class and message, the session still usable.
    with pytest.raises(InvalidArgumentError, match="gradient of id 6 holds nan"):
        client.push_rows("t", ids, nan)
    with pytest.raises(MessageTooLargeError, match="table 't'"):
        client.pull_rows("t", np.arange(5000))
    assert client.tables.transports == ["shm"]
    np.testing.assert_array_equal(client.pull_rows("t", ids), before)
    assert client.tables.stats("t")[0].steps == 0
    with pytest.raises(UnknownKeyError, match="table 'nope'"):
        client.tables.stats("nope")
    with pytest.raises(LayoutConflictError, match="table 't'"):
        client.declare_table(TableConfig("t", 5))
    with pytest.raises(grpc.RpcError) as err:
        # protoc's stubs take only the enum's members; proto3 enums are open, so 9 goes on the wire.
        spec = pb.TableSpec(name="u", dim=2, optimizer=9)  # type: ignore[arg-type]
        stub.DeclareTable(pb.DeclareTableRequest(spec=spec), timeout=WAIT_S)
    assert err.value.code().name == "INVALID_ARGUMENT" and "table 'u': optimizer" in err.value.details()
    with pytest.raises(InvalidArgumentError, match="ids: got dtype float64"):
        client.pull_rows("t", np.array([1.5]))


def test_checkpoint_round_trip_and_export(start_server: StartServer, new_client: NewClient,
                                          tmp_path: Path) -> None:
    settings = ServerSettings(checkpoint_dir=str(tmp_path))
    server = start_server(settings)
    client = new_client([server], "w")
    config = TableConfig("emb", 4, optimizer="lazy_adam", lr=0.1, ttl=1000, initializer="normal")
    replica = SparseTable(config)  # the same history applied in-process: what the server must hold
    rng = np.random.default_rng(0)
    client.declare_table(config)
    client.declare({"dense": np.zeros(3, np.float32)}, JobConfig(mode="async"))  # tables and dense, one job
    for step in range(1, 6):
        ids = rng.choice(50, 20, replace=False).astype(np.int64)
        grads = rng.normal(size=(20, 4)).astype(np.float32)
        client.push_rows("emb", ids, grads, clock=step)
        replica.push(ids, grads, clock=step)
    assert client.tables.checkpoint()[0].endswith(".tables.json")
    client.push_rows("emb", ids, grads, clock=6)
    replica.push(ids, grads, clock=6)
    client.checkpoint()  # the server's checkpoint writes its tables too
    server.stop(grace_s=0.2)

    again = start_server(settings)
    client = new_client([again], "w2")
    client.declare_table(config)
    client.declare({"dense": np.zeros(3, np.float32)}, JobConfig(mode="async"))
    ids = replica.index.ids[replica.index.live_rows()]
    np.testing.assert_array_equal(client.pull_rows("emb", ids, clock=6), replica.pull(ids, clock=6))
    assert client.pull(0)["dense"].tolist() == [0, 0, 0]
    assert client.tables.stats("emb")[0].steps == replica.step
    grads = np.ones((len(ids), 4), np.float32)  # moments and per-row steps survived: same next update
    client.push_rows("emb", ids, grads, clock=7)
    replica.push(ids, grads, clock=7)
    np.testing.assert_allclose(client.pull_rows("emb", ids, clock=7), replica.pull(ids, clock=7), rtol=1e-6)

    export = client.tables.export("emb")[0]
    got_ids, got_rows = np.load(export.ids_path), np.load(export.rows_path)
    assert export.rows == len(got_ids) == len(ids)
    np.testing.assert_array_equal(got_rows, replica.pull(got_ids, clock=7))


def test_table_requests_ride_the_dense_fast_path_session_and_the_old_stream_is_never_offered(
        start_server: StartServer, new_client: NewClient) -> None:
    server = start_server()
    # An older client asks for the table stream: port 0 sends it to gRPC.
    assert _stub(server).OpenTableStream(pb.OpenTableStreamRequest(), timeout=WAIT_S).port == 0
    client = new_client([server], "w0", transport="tcp")
    client.declare_table(TableConfig("t", 4, initializer="zeros", optimizer="sgd", lr=1.0))
    ids = np.array([1, 2**40, -5], np.int64)
    client.push_rows("t", ids, np.ones((3, 4), np.float32))
    np.testing.assert_array_equal(client.push_pull_rows("t", ids[:1], np.ones((1, 4), np.float32), ids),
                                  [[-2.0] * 4, [-1.0] * 4, [-1.0] * 4])
    assert client.tables.transports == ["tcp"] and client.transports == ["tcp"]  # one session, the dense one
    assert server.running.fast.transports() == {"w0": "tcp"}


@pytest.mark.parametrize("transport", ["auto", "grpc"])  # auto: the fast-path session (shm on one host)
def test_an_evaluators_pulls_leave_the_row_counts_as_they_were(start_server: StartServer,
                                                               new_client: NewClient, transport: str) -> None:
    servers = [start_server(), start_server()]
    config = TableConfig("emb", 4, optimizer="sgd", lr=1.0)
    trainer = new_client(servers, "w0", transport=transport)
    trainer.declare_table(config)
    trained = np.arange(0, 2000, 3, dtype=np.int64)
    trainer.push_rows("emb", trained, np.ones((len(trained), 4), np.float32))
    before = [s.rows for s in trainer.tables.stats("emb")]
    evaluator = new_client(servers, "evaluator-0", transport=transport)
    evaluator.declare_table(config)
    unseen = np.arange(10**6, 10**6 + 100_000, dtype=np.int64)  # large enough to leave the event loop
    np.testing.assert_array_equal(evaluator.pull_rows("emb", unseen), initial_rows(config, unseen))
    np.testing.assert_array_equal(evaluator.pull_rows("emb", trained), initial_rows(config, trained) - 1)
    assert [s.rows for s in trainer.tables.stats("emb")] == before and sum(before) == len(trained)
    assert evaluator.tables.transports == ["shm" if transport == "auto" else "grpc"] * 2
