"""Tables with 8- and 16-bit rows (row_dtype, issue 22): stored narrow, updated in float32 and rounded once
per push as a numpy/torch reference does, pulled as stored, and copied bit for bit by replicas and
checkpoints."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from pshard.common.cluster.spec import ClusterSpec
from pshard.common.errors import CheckpointError, InvalidArgumentError
from pshard.common.job import JobConfig
from pshard.common.sparse import TableConfig
from pshard.common.wire.sparse_codec import decode_rows, spec_from_proto, spec_to_proto
from pshard.ps_server.replication.table_rows import capture, install
from pshard.ps_server.replication.table_wire import batch_from_proto, batch_to_proto
from pshard.ps_server.tables import row_optim, rowcodec
from pshard.ps_server.tables.files import export_table, load_tables, save_tables
from pshard.ps_server.tables.table import SparseTable, initial_rows
from pshard.worker.config import CTR_MODEL, TrainConfig
from pshard.worker.ctr import build_ctr_model
from pshard.worker.ctr_flags import add_ctr_arguments, ctr_settings

from pshard.api.v1 import sparse_pb2 as pb

DIM, STEPS = 12, 8
NARROW = ("float16", "bfloat16", "int8")


def _config(row_dtype: str, **kw: object) -> TableConfig:
    return TableConfig("emb", DIM, row_dtype=row_dtype, initializer="normal", init_scale=0.5, lr=0.05,
                       seed=3, **kw)  # type: ignore[arg-type]


def _round(config: TableConfig, rows: np.ndarray, ids: np.ndarray, versions: np.ndarray) -> np.ndarray:
    """The reference rounding: torch's conversions for 16 bits; int8 through its tested core."""
    if config.row_dtype == "float16":
        return torch.from_numpy(rows).half().float().numpy()
    if config.row_dtype == "bfloat16":
        return torch.from_numpy(rows).bfloat16().float().numpy()
    q, scale, offset = rowcodec.encode_int8(rows, ids, versions, config.seed)
    return rowcodec.decode_int8(q, scale, offset)


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
@pytest.mark.parametrize("row_dtype", NARROW)
def test_pushes_apply_in_float32_and_round_once_as_a_numpy_reference(row_dtype: str, optimizer: str) -> None:
    config = _config(row_dtype, optimizer=optimizer)
    table = SparseTable(config)
    ids = np.array([-9, 2, 40, 7001], np.int64)
    ref = _round(config, initial_rows(config, ids), ids, np.zeros(len(ids), np.int64))
    acc = np.zeros_like(ref)
    lr, eps = np.float32(config.lr), np.float32(config.eps)
    rng = np.random.default_rng(0)
    for step in range(1, STEPS + 1):
        grads = rng.standard_normal((len(ids), DIM)).astype(np.float32)
        table.push(ids, grads)
        if optimizer == "sgd":
            ref = ref - grads * lr
        else:
            acc += grads * grads
            ref = ref - (grads / (np.sqrt(acc) + eps)) * lr
        ref = _round(config, ref.astype(np.float32), ids, np.full(len(ids), step, np.int64))
        pulled = table.pull(ids)
        assert pulled.dtype == np.uint8 and pulled.shape == (len(ids), config.row_bytes)
        assert decode_rows(config, pulled).tobytes() == ref.tobytes(), step
    if optimizer == "adagrad":  # optimizer state stays float32, unrounded
        assert table.state["sum"].dtype == np.float32
        assert table.state["sum"][table.index.lookup(ids)].tobytes() == acc.tobytes()


@pytest.mark.parametrize("optimizer", ["adam", "lazy_adam"])
@pytest.mark.parametrize("row_dtype", ["bfloat16", "int8"])
def test_adam_updates_the_decoded_rows_with_float32_moments(row_dtype: str, optimizer: str) -> None:
    config = _config(row_dtype, optimizer=optimizer)
    table = SparseTable(config)
    ids = np.array([4, 8, 15], np.int64)
    ref = _round(config, initial_rows(config, ids), ids, np.zeros(len(ids), np.int64))
    state = {name: np.zeros((len(ids), DIM), np.float32) for name in row_optim.STATE_NAMES[optimizer]}
    rng = np.random.default_rng(2)
    for step in range(1, STEPS + 1):
        grads = rng.standard_normal((len(ids), DIM)).astype(np.float32)
        table.push(ids, grads)
        steps: int | np.ndarray = np.full(len(ids), step) if optimizer == "lazy_adam" else step
        ref = row_optim.apply(config, ref.copy(), grads, state, steps, np.empty_like(ref))
        ref = _round(config, ref, ids, np.full(len(ids), step, np.int64))
        assert decode_rows(config, table.pull(ids)).tobytes() == ref.tobytes(), step
    rows = table.index.lookup(ids)
    for name, array in state.items():
        assert table.state[name].dtype == np.float32
        assert table.state[name][rows].tobytes() == array.tobytes(), name


@pytest.mark.parametrize(("row_dtype", "row_bytes"), [("float32", 4 * DIM), ("float16", 2 * DIM),
                                                      ("bfloat16", 2 * DIM), ("int8", DIM + 4)])
def test_a_row_takes_its_stored_bytes(row_dtype: str, row_bytes: int) -> None:
    table = SparseTable(_config(row_dtype, optimizer="adagrad"))
    ids = np.arange(1000, dtype=np.int64)
    table.push(ids, np.ones((len(ids), DIM), np.float32))
    assert table.config.row_bytes == row_bytes
    assert table.values.nbytes == len(table.values) * row_bytes
    assert table.state["sum"].dtype == np.float32 and table.state["sum"].shape[1] == DIM


@pytest.mark.parametrize("row_dtype", NARROW)
def test_a_pull_of_an_absent_id_reads_the_row_a_push_would_start_from(row_dtype: str) -> None:
    config = _config(row_dtype)
    table = SparseTable(config)
    ids = np.array([5, 6], np.int64)
    before = table.pull(ids)
    assert len(table) == 0
    table.push(ids, np.zeros((2, DIM), np.float32))  # sgd with a zero gradient: the value stays
    decoded = decode_rows(config, table.pull(ids))
    if row_dtype != "int8":  # rounding a rounded row again is exact
        assert decoded.tobytes() == decode_rows(config, before).tobytes()
    else:  # int8 draws again (update count 1): within one level of the row's scale
        scale = table.pull(ids)[:, DIM:DIM + 2].copy().view("<f2").astype(np.float32)
        assert np.all(np.abs(decoded - decode_rows(config, before)) <= scale * 1.0001)


@pytest.mark.parametrize("row_dtype", NARROW)
def test_replicas_and_checkpoints_hold_the_primary_s_stored_bytes(row_dtype: str, tmp_path: Path) -> None:
    config = _config(row_dtype, optimizer="adagrad")
    primary, replica = SparseTable(config), SparseTable(config)
    ids = np.arange(-50, 50, 3, dtype=np.int64)
    rng = np.random.default_rng(1)
    for _ in range(3):
        primary.push(ids, rng.standard_normal((len(ids), DIM)).astype(np.float32))
    install(replica, batch_from_proto(batch_to_proto(capture(primary, ids))))
    save_tables(tmp_path, "shard", [primary])
    (loaded,) = load_tables(tmp_path, "shard", SparseTable)
    for other in (replica, loaded):
        assert other.pull(ids).tobytes() == primary.pull(ids).tobytes()
        assert other.state["sum"][other.index.lookup(ids)].tobytes() == (
            primary.state["sum"][primary.index.lookup(ids)].tobytes())
    # A further push rounds alike on both (int8's draws are of the seed, id and update count).
    grads = rng.standard_normal((len(ids), DIM)).astype(np.float32)
    primary.push(ids, grads)
    loaded.push(ids, grads)
    assert loaded.pull(ids).tobytes() == primary.pull(ids).tobytes()
    _, rows_path, n = export_table(primary, tmp_path / "export")
    exported = np.load(rows_path)
    assert exported.dtype == np.float32 and n == len(ids)
    assert np.array_equal(np.sort(exported, axis=0), np.sort(decode_rows(config, primary.pull(ids)), axis=0))


def test_a_checkpoint_of_int8_rows_in_layout_1_loads_re_rounded_and_another_width_is_refused(
        tmp_path: Path) -> None:
    """int8 rows saved before the float16 pair (layout 1: q, then a float32 scale and offset, dim + 8
    bytes) load as rows of this layout within one of its levels of what they stood for, their counts
    kept; rows of a width no layout has are refused naming the table, the shape and the expected one."""
    config = _config("int8", optimizer="adagrad")
    table = SparseTable(config)
    ids = np.arange(40, dtype=np.int64) * 5
    table.push(ids, np.ones((len(ids), DIM), np.float32))
    save_tables(tmp_path, "shard", [table])
    (values_path,) = tmp_path.glob("shard.tables-*/t0/values.npy")
    rng = np.random.default_rng(4)
    old = np.empty((len(ids), DIM + 8), np.uint8)
    old[:, :DIM] = rng.integers(0, 256, (len(ids), DIM))
    tail = np.stack([rng.uniform(1e-4, 0.1, len(ids)), rng.uniform(-5, 5, len(ids))], axis=1)
    old[:, DIM:] = tail.astype("<f4").view(np.uint8)
    np.save(values_path, old)
    meant = rowcodec.decode_int8(old[:, :DIM], tail[:, 0].astype(np.float32), tail[:, 1].astype(np.float32))
    (loaded,) = load_tables(tmp_path, "shard", SparseTable)
    rows = loaded.index.lookup(ids)
    stored = loaded.values[rows]
    assert stored.shape == (len(ids), DIM + 4)
    level = stored[:, DIM:DIM + 2].copy().view("<f2").astype(np.float32)
    assert np.all(np.abs(decode_rows(config, stored) - meant) <= level * 1.0001)
    assert (loaded.count[rows] == 1).all()
    np.save(values_path, old[:, :DIM + 6])
    refusal = rf"table 'emb': rows of shape \({DIM + 6},\).*expected \({DIM + 4},\)"
    with pytest.raises(CheckpointError, match=refusal):
        load_tables(tmp_path, "shard", SparseTable)


def test_an_int8_push_whose_update_overflows_is_refused_and_changes_nothing() -> None:
    table = SparseTable(TableConfig("big", 2, row_dtype="int8", lr=1000.0))
    ids = np.array([1, 2], np.int64)
    table.push(ids, np.ones((2, 2), np.float32))
    before = {name: array.copy() for name, (array, _) in table.columns().items()}
    huge = np.array([[0, 0], [3e38, 0]], np.float32)  # finite, but 3e38 x 1000 is not
    with pytest.raises(InvalidArgumentError, match=r"table 'big'.*id 2 is not finite"):
        table.push(ids, huge)
    assert table.step == 1
    assert all(np.array_equal(a, table.columns()[name][0]) for name, a in before.items())


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])  # the compiled pass, and the numpy path
def test_an_int8_push_past_float16_s_range_is_refused_and_changes_nothing(optimizer: str) -> None:
    config = TableConfig("wide", 2, row_dtype="int8", optimizer=optimizer, lr=1000.0)
    table = SparseTable(config)
    ids = np.array([1, 2], np.int64)
    near = np.array([[0.0, 0.0], [-65000.0, 0.0]], np.float32)  # id 2 a step from float16's -65504
    table.restore_rows(ids, {"values": rowcodec.encode_rows(config, near, ids, np.ones(2, np.int64))})
    before = {name: array.copy() for name, (array, _) in table.columns().items()}
    with pytest.raises(InvalidArgumentError, match=r"table 'wide'.*id 2 .*below -65504"):
        table.push(ids, np.array([[0, 0], [2, 0]], np.float32))  # finite, but id 2 goes past -66000
    assert table.step == 0
    assert all(np.array_equal(a, table.columns()[name][0]) for name, a in before.items())


def test_row_dtype_travels_in_the_spec_and_an_unknown_one_is_refused_by_name() -> None:
    for row_dtype in ("float32", *NARROW):
        config = _config(row_dtype)
        assert spec_from_proto(spec_to_proto(config)) == config
    assert spec_from_proto(pb.TableSpec(name="t", dim=2)).row_dtype == "float32"  # unset: float32
    with pytest.raises(InvalidArgumentError, match=r"row_dtype: got 'int4'"):
        spec_from_proto(pb.TableSpec(name="t", dim=2, row_dtype="int4"))
    with pytest.raises(InvalidArgumentError, match=r"row_dtype: got 'bfloat16'.*dtype 'float64'"):
        TableConfig("t", 2, dtype="float64", row_dtype="bfloat16")
    with pytest.raises(InvalidArgumentError, match=r"row_dtype: got 'int8'.*allow_nonfinite"):
        TableConfig("t", 2, row_dtype="int8", allow_nonfinite=True)


def test_the_ctr_demo_declares_its_table_with_the_row_dtype_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    add_ctr_arguments(parser)
    args = parser.parse_args(["--table-row-dtype", "int8"])
    args.seed, args.model, args.output = 0, CTR_MODEL, None
    spec = ClusterSpec.from_tf_config(json.dumps({"cluster": {"worker": ["127.0.0.1:1"]},
                                                  "task": {"type": "worker", "index": 0}}))
    cfg = TrainConfig(spec=spec, job=JobConfig(mode="async"), data_dir="", model=CTR_MODEL,
                      **ctr_settings(args, spec))
    assert build_ctr_model(cfg, 3).embedding.config.row_dtype == "int8"
    with pytest.raises(SystemExit):
        parser.parse_args(["--table-row-dtype", "int4"])
    assert "--table-row-dtype: invalid choice: 'int4'" in capsys.readouterr().err
