"""Compressed pushes on every transport (issue 19): a real server unpacks each slice and applies exactly
what the worker's compressor sent, over shared memory, raw TCP and gRPC (unary and Exchange alike)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
from pshard.common.compression import Compression, Compressor
from pshard.common.job import JobConfig, OptimizerConfig
from pshard.common.wire import compress
from pshard.ps_server.settings import ServerSettings

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import tensor_pb2

SGD_1 = OptimizerConfig(name="sgd", lr=1.0)
TRANSPORTS = ("shm", "tcp", "grpc")


def expected(params: dict[str, np.ndarray], grads: dict[str, np.ndarray], client, name: str
             ) -> dict[str, np.ndarray]:
    """params - what the compressor sends of grads (SGD at lr 1, no residual yet at clock 0)."""
    out = {}
    for key, value in params.items():
        sent = np.zeros(value.size, np.float32)
        for s in (s for s in client.layout.slices if s.key == key):
            part = grads[key].reshape(-1)[s.offset:s.offset + s.numel]
            wire = compress.encode(Compressor.parse(name), part, s.slice_key, 0)
            sent[s.offset:s.offset + s.numel] = compress.decode(wire, s.numel, s.slice_key, 0)
        out[key] = value - sent.reshape(value.shape)
    return out


# randomk:0.5 of 600k floats is 1.2 MB, past the client's unary bound: gRPC then streams an Exchange.
@pytest.mark.parametrize(("name", "numel"), [("topk:0.01", 300_000), ("sign", 300_000),
                                             ("randomk:0.5", 600_000)])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_server_applies_exactly_what_was_sent(start_server, new_client, tmp_path, name, numel, transport):
    rng = np.random.default_rng(7)
    params = {"a": rng.standard_normal(numel, dtype=np.float32),
              "b": rng.standard_normal(7, dtype=np.float32)}
    grads = {k: rng.standard_normal(v.shape, dtype=np.float32) for k, v in params.items()}
    server = start_server(ServerSettings(shm_dir=str(tmp_path)))
    client = new_client([server], "w0", transport=transport, shm_dir=str(tmp_path))
    job = JobConfig(mode="async", optimizer=SGD_1, compression=Compression(name, (("b", "none"),)))
    client.declare(params, job, slice_bytes=400_000)  # "a" is cut in slices: each is packed alone
    got = client.push_pull(grads, 0)
    assert client.transports == [transport]
    want = expected({"a": params["a"]}, grads, client, name)
    np.testing.assert_array_equal(got["a"], want["a"])
    np.testing.assert_array_equal(got["b"], params["b"] - grads["b"])  # its rule: uncompressed
    assert client.compression is not None and client.compression.stats.ratio > 1.9
    unpacked = server.running.handlers.requests.unpacked[name.split(":")[0]]  # the server's metrics
    assert unpacked.packed_bytes == client.compression.stats.bytes_after
    assert unpacked.dense_bytes == numel * 4 and unpacked.seconds > 0


def test_a_payload_of_the_wrong_size_is_refused_and_changes_nothing(start_server, new_client, wire):
    server = start_server()
    client = new_client([server], "w0", transport="grpc")
    params = {"a": np.ones(100, np.float32)}
    client.declare(params, JobConfig(mode="async", optimizer=SGD_1))
    twelve = tensor_pb2.Tensor(dtype=tensor_pb2.DTYPE_UINT8, shape=[12], data=bytes(12))
    bad = tensor_pb2.SliceTensor(id=wire.slice_id("a"), encoding=tensor_pb2.ENCODING_TOPK, tensor=twelve)
    with pytest.raises(grpc.RpcError) as refused:
        wire.stub(server).Push(pb.PushRequest(stamp=wire.stamp("w0", 0), gradients=[bad]), timeout=10)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "key 'a': got 12 bytes of topk" in refused.value.details()
    assert client.pull(0)["a"].tobytes() == params["a"].tobytes()


def test_residuals_are_the_trainers_state_and_a_restart_says_they_are_lost(start_server, new_client, caplog):
    import torch
    from pshard.worker.torch_api import RESIDUALS, PSTrainer
    from torch import nn

    server = start_server()
    job = JobConfig(mode="async", optimizer=SGD_1, compression=Compression("topk:0.1", (("bias", "none"),)))
    torch.manual_seed(0)
    model = nn.Linear(20, 5)
    x, y = torch.randn(8, 20), torch.randn(8, 5)
    first = PSTrainer(model, new_client([server], "w0"), job)
    for _ in range(2):
        first.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        first.step()
    saved = first.state_dict()
    assert set(saved[RESIDUALS]) == {"weight"} and saved[RESIDUALS]["weight"].abs().sum() > 0
    assert "residuals" not in caplog.text

    with caplog.at_level("WARNING", logger="pshard.trainer"):
        again = PSTrainer(nn.Linear(20, 5), new_client([server], "w0"), job)  # the same worker, restarted
    assert "w0 restarted in a job that compresses gradients with error feedback: the residuals" in caplog.text
    assert again.state_dict().get(RESIDUALS, {}) == {}
    again.load_state_dict(saved)
    assert torch.equal(again.state_dict()[RESIDUALS]["weight"], saved[RESIDUALS]["weight"])


def test_averaged_buffers_are_never_compressed(start_server, new_client):
    """Their pushes are values whose mean the servers keep (BatchNorm statistics), not gradients."""
    client = new_client([start_server()], "w0")
    job = JobConfig(mode="async", optimizer=SGD_1, averaged=("bn.running_var",),
                    compression=Compression("sign"))
    client.declare({"fc.weight": np.zeros(64, np.float32), "bn.running_var": np.ones(8, np.float32)}, job)
    assert client.compression is not None and set(client.compression.plan) == {"fc.weight"}
