"""TableConfig.compression (issue 19): which casts a table's row pushes may travel in, how the setting
travels in the spec, and the CTR demo taking the job's --compression cast for its table."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from pshard.common.cluster.spec import ClusterSpec
from pshard.common.compression import Compression
from pshard.common.errors import InvalidArgumentError
from pshard.common.job import JobConfig
from pshard.common.sparse import TableConfig
from pshard.common.wire.sparse_codec import decode_grads, encode_grads, spec_from_proto, spec_to_proto
from pshard.worker.config import CTR_MODEL, TrainConfig
from pshard.worker.ctr import build_ctr_model
from pshard.worker.ctr_flags import add_ctr_arguments, ctr_settings

from pshard.api.v1 import sparse_pb2 as pb


@pytest.mark.parametrize(("compression", "torch_dtype"), [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_a_cast_halves_the_rows_and_widens_back_as_torch_rounds(compression: str,
                                                                torch_dtype: torch.dtype) -> None:
    config = TableConfig("t", 8, compression=compression)
    rows = np.random.default_rng(0).standard_normal((5, 8), dtype=np.float32) * 100
    wire = encode_grads(config, rows)
    assert wire.dtype == config.grad_dtype and wire.nbytes == rows.nbytes // 2
    want = torch.from_numpy(rows).to(torch_dtype).float().numpy()
    got = decode_grads(config, wire)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_none_sends_the_rows_as_they_are() -> None:
    config = TableConfig("t", 4)
    rows = np.ones((2, 4), np.float32)
    assert encode_grads(config, rows) is rows and config.grad_dtype == np.float32


def test_compression_travels_in_the_spec_and_a_bad_one_is_refused_naming_field_and_value() -> None:
    for compression in ("none", "bf16", "fp16"):
        config = TableConfig("t", 2, compression=compression)
        assert spec_from_proto(spec_to_proto(config)) == config
    assert spec_from_proto(pb.TableSpec(name="t", dim=2)).compression == "none"  # unset: none
    with pytest.raises(InvalidArgumentError, match=r"table 't': compression: got 'topk:0.01', expected one"):
        TableConfig("t", 2, compression="topk:0.01")
    with pytest.raises(InvalidArgumentError, match=r"compression: got 'sign'"):
        spec_from_proto(pb.TableSpec(name="t", dim=2, compression="sign"))
    with pytest.raises(InvalidArgumentError, match=r"got 'bf16', expected 'none' with dtype 'float64'"):
        TableConfig("t", 2, dtype="float64", compression="bf16")


@pytest.mark.parametrize(("flag", "want"), [("bf16", "bf16"), ("fp16", "fp16"), ("topk:0.01", "none"),
                                            ("none", "none")])
def test_the_ctr_demo_pushes_its_rows_in_the_jobs_cast(flag: str, want: str) -> None:
    parser = argparse.ArgumentParser()
    add_ctr_arguments(parser)
    args = parser.parse_args([])
    args.seed, args.model, args.output = 0, CTR_MODEL, None
    spec = ClusterSpec.from_tf_config(json.dumps({"cluster": {"worker": ["127.0.0.1:1"]},
                                                  "task": {"type": "worker", "index": 0}}))
    job = JobConfig(mode="async", compression=Compression(flag))
    cfg = TrainConfig(spec=spec, job=job, data_dir="", model=CTR_MODEL, **ctr_settings(args, spec))
    assert build_ctr_model(cfg, 3).embedding.config.compression == want
