"""Row gradients pushed in bfloat16 or float16 (TableConfig.compression, issue 19): half the bytes on the
wire, widened to float32 on the servers, whose update is then exact in float32 on what was sent."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import numpy as np
import pytest
import torch
from pshard.client.ps_client import PSClient
from pshard.common.sparse import TableConfig
from pshard.ps_server.service import ServerThread
from pshard.ps_server.tables.table import initial_rows

from pshard.api.v1 import sparse_pb2 as pb
from pshard.api.v1 import sparse_pb2_grpc as pb_grpc

from .conftest import WAIT_S

StartServer = Callable[..., ServerThread]
NewClient = Callable[..., PSClient]


def sent(compression: str, grads: np.ndarray) -> np.ndarray:
    """What a gradient becomes on the wire, by torch's casts (round to nearest even), back in float32."""
    dtype = torch.bfloat16 if compression == "bf16" else torch.float16
    return torch.from_numpy(grads).to(dtype).float().numpy()


@pytest.mark.parametrize("transport", ["auto", "grpc"])  # auto: the fast-path session (shm on one host)
@pytest.mark.parametrize("compression", ["bf16", "fp16"])
def test_compressed_row_pushes_apply_exactly_what_was_sent_in_float32(
        start_server: StartServer, new_client: NewClient, compression: str, transport: str) -> None:
    servers = [start_server(), start_server()]
    config = TableConfig("emb", 16, initializer="normal", init_scale=1.0, lr=1.0, compression=compression)
    client = new_client(servers, "w0", transport=transport)
    client.declare_table(config)
    ids = np.arange(-40, 40, dtype=np.int64) * 7919
    want = initial_rows(config, ids)
    rng = np.random.default_rng(0)
    for step in range(4):
        pushed = rng.permutation(len(ids))[:50]  # distinct ids, in no order
        grads = rng.standard_normal((50, 16), dtype=np.float32) * np.float32(10.0 ** (step - 2))
        client.push_rows("emb", ids[pushed], grads, clock=step)
        want[pushed] -= sent(compression, grads)  # SGD at lr 1, in float32
    assert not np.array_equal(sent(compression, grads), grads)  # the cast did round
    np.testing.assert_array_equal(client.pull_rows("emb", ids), want)
    assert client.tables.transports == (["shm", "shm"] if transport == "auto" else ["grpc", "grpc"])


def test_a_push_in_the_wrong_width_is_refused_naming_the_compression_and_changes_nothing(
        start_server: StartServer, new_client: NewClient) -> None:
    server = start_server()
    client = new_client([server], "w0")
    client.declare_table(TableConfig("t", 4, lr=1.0, compression="bf16"))
    ids = np.array([5, 6], np.int64)
    before = client.pull_rows("t", ids)
    stub = pb_grpc.SparseTablesServiceStub(grpc.insecure_channel(server.address))
    float32_rows = np.ones((2, 4), np.float32).tobytes()  # 32 bytes where bf16 rows are 16
    with pytest.raises(grpc.RpcError) as err:
        stub.PushRows(pb.PushRowsRequest(table="t", ids=ids.tobytes(), grads=float32_rows), timeout=WAIT_S)
    assert err.value.code().name == "INVALID_ARGUMENT"
    assert "2 rows of dim 4 bf16 (compression) (16 bytes), got 32 bytes" in err.value.details()
    np.testing.assert_array_equal(client.pull_rows("t", ids), before)
    assert client.tables.stats("t")[0].steps == 0
