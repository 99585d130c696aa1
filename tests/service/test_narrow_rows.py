"""A live parameter server process with bfloat16 and int8 tables (row_dtype, issue 22): the rows a pull
sends are the stored bytes (2 bytes a value; a byte a value plus a scale and an offset), the client
decodes them to float32, and both match a numpy reference of the same rounding; /metrics shows the
bytes per row."""

from __future__ import annotations

import grpc
import numpy as np
import torch
from pshard.client.ps_client import PSClient
from pshard.common.rpc.options import channel_options
from pshard.common.sparse import TableConfig
from pshard.common.wire.sparse_codec import decode_rows
from pshard.ps_server.tables import rowcodec
from pshard.ps_server.tables.table import initial_rows

from pshard.api.v1 import sparse_pb2 as pb
from pshard.api.v1 import sparse_pb2_grpc as pb_grpc
from tests.e2e.harness import Procs
from tests.service.test_metrics_endpoints import metrics_port, scrape, value

from .conftest import WAIT_S

DIM = 16


def _reference(config: TableConfig, ids: np.ndarray, grads: list[np.ndarray]) -> np.ndarray:
    """The rows after sgd pushes of `grads`, each applied in float32 and rounded once (torch's bfloat16
    conversion; int8 through rowcodec's core with the row's update count)."""
    def rounded(rows: np.ndarray, version: int) -> np.ndarray:
        if config.row_dtype == "bfloat16":
            return torch.from_numpy(rows).bfloat16().float().numpy()
        q, scale, offset = rowcodec.encode_int8(rows, ids, np.full(len(ids), version), config.seed)
        return rowcodec.decode_int8(q, scale, offset)

    rows = rounded(initial_rows(config, ids), 0)
    for version, g in enumerate(grads, 1):
        rows = rounded((rows - g * np.float32(config.lr)).astype(np.float32), version)
    return rows


def test_bfloat16_and_int8_rows_are_pulled_as_stored_and_decoded_as_a_numpy_reference(procs: Procs) -> None:
    ps = procs.python("ps", "-m", "pshard.ps_server", "--bind", "127.0.0.1:0", "--metrics-port", "0")
    address = "127.0.0.1:" + ps.wait_for_line(r"pshard ps: listening on port (\d+)", 60).group(1)
    ids = np.array([-7, 3, 11, 2**40, 99], np.int64)
    rng = np.random.default_rng(5)
    grads = [rng.standard_normal((len(ids), DIM)).astype(np.float32) for _ in range(3)]
    configs = {rd: TableConfig(f"emb_{rd}", DIM, row_dtype=rd, lr=0.1, seed=4, init_scale=0.5)
               for rd in ("float32", "bfloat16", "int8")}
    with PSClient([address], "w0", timeout_s=WAIT_S, retry_budget_s=WAIT_S) as client, \
            grpc.insecure_channel(address, options=channel_options()) as channel:
        stub = pb_grpc.SparseTablesServiceStub(channel)
        for config in configs.values():
            client.declare_table(config)
            for clock, g in enumerate(grads):
                assert client.push_rows(config.name, ids, g, clock=clock) == len(ids)
        order = np.argsort(ids)
        for rd, row_bytes in (("float32", 4 * DIM), ("bfloat16", 2 * DIM), ("int8", DIM + 4)):
            config = configs[rd]
            pulled = client.pull_rows(config.name, ids, clock=3)  # the client's fast path (shm here)
            assert pulled.dtype == np.float32 and pulled.shape == (len(ids), DIM)
            # The bytes on the wire: one row of row_bytes per id, decoding to what the client returned.
            reply = stub.PullRows(pb.PullRowsRequest(table=config.name, ids=ids[order].tobytes(), clock=3),
                                  timeout=WAIT_S)
            assert len(reply.rows) == len(ids) * row_bytes, rd
            wire = np.frombuffer(reply.rows, np.uint8).reshape(len(ids), row_bytes)
            assert decode_rows(config, wire).tobytes() == pulled[order].tobytes(), rd
            if rd != "float32":
                assert pulled.tobytes() == _reference(config, ids, grads).tobytes(), rd
            assert value(scrape(metrics_port(ps)), "pshard_table_row_bytes", table=config.name) == row_bytes
