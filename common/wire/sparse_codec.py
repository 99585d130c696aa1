"""TableConfig <-> the wire's TableSpec (proto/pshard/api/v1/sparse.proto), and a table's stored rows
-> float32, for client and server alike.

Unset proto fields (0, the _UNSPECIFIED enum values) mean the TableConfig defaults, so a client in
another language may send only the name and dim.

Rows of a table with a narrow `row_dtype` are stored and pulled as opaque bytes (TableConfig.row_layout),
little-endian: float16 values; bfloat16 values (the top 16 bits of a float32); int8, dim unsigned bytes q
then the row's float16 scale and offset, a value being offset + scale * q. `decode_rows` reads them
back as float32, exactly what the server computes with (ps_server/tables/rowcodec.py writes them).
"""

from __future__ import annotations

import numpy as np
from pshard.common.sparse import TableConfig
from pshard.common.wire import codec

from pshard.api.v1 import sparse_pb2 as pb

_DTYPES: dict[int, str] = {pb.TABLE_DTYPE_FLOAT32: "float32", pb.TABLE_DTYPE_FLOAT64: "float64"}
_INITS: dict[int, str] = {pb.TABLE_INITIALIZER_ZEROS: "zeros", pb.TABLE_INITIALIZER_UNIFORM: "uniform",
          pb.TABLE_INITIALIZER_NORMAL: "normal"}
_OPTIMIZERS: dict[int, str] = {pb.TABLE_OPTIMIZER_SGD: "sgd", pb.TABLE_OPTIMIZER_ADAGRAD: "adagrad",
               pb.TABLE_OPTIMIZER_ADAM: "adam", pb.TABLE_OPTIMIZER_LAZY_ADAM: "lazy_adam"}
_UNITS: dict[int, str] = {pb.TTL_UNIT_CLOCKS: "clocks", pb.TTL_UNIT_SECONDS: "seconds"}
_POLICIES: dict[int, str] = {pb.CAP_POLICY_LRU: "lru", pb.CAP_POLICY_LFU: "lfu"}
_MODES: dict[int, str] = {pb.TABLE_MODE_ASYNC: "async", pb.TABLE_MODE_SYNC: "sync"}
_DEFAULT = TableConfig("default", 1)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _back(table: dict[int, str]) -> dict[str, int]:
    return {v: k for k, v in table.items()}


def _named(table: dict[int, str], value: int, default: str) -> str:
    # An enum value this server does not know stays a number, which TableConfig then refuses by name.
    return table.get(value, default if value == 0 else str(value))


def spec_to_proto(config: TableConfig) -> pb.TableSpec:
    return pb.TableSpec(
        name=config.name, dim=config.dim, dtype=_back(_DTYPES)[config.dtype],  # type: ignore[arg-type]
        initializer=_back(_INITS)[config.initializer],  # type: ignore[arg-type]
        init_scale=config.init_scale, seed=config.seed,
        optimizer=_back(_OPTIMIZERS)[config.optimizer],  # type: ignore[arg-type]
        lr=config.lr, beta1=config.betas[0], beta2=config.betas[1], eps=config.eps,
        initial_accumulator_value=config.initial_accumulator_value, admit_after=config.admit_after,
        admit_prob=config.admit_prob, ttl=config.ttl, ttl_unit=_back(_UNITS)[config.ttl_unit],  # type: ignore[arg-type]
        max_rows=config.max_rows, cap_policy=_back(_POLICIES)[config.cap_policy],  # type: ignore[arg-type]
        log_evictions=config.log_evictions, allow_nonfinite=config.allow_nonfinite,
        mode=_back(_MODES)[config.mode], admit_memory_mb=config.admit_memory_mb,  # type: ignore[arg-type]
        row_dtype=config.row_dtype, compression="" if config.compression == "none" else config.compression,
        memory_mb=config.memory_mb)


def spec_from_proto(spec: pb.TableSpec) -> TableConfig:
    """The TableConfig of `spec`; InvalidArgumentError naming the table and field if it is not valid."""
    return TableConfig(
        name=spec.name, dim=spec.dim, dtype=_named(_DTYPES, spec.dtype, _DEFAULT.dtype),
        initializer=_named(_INITS, spec.initializer, _DEFAULT.initializer),
        init_scale=spec.init_scale, seed=spec.seed,
        optimizer=_named(_OPTIMIZERS, spec.optimizer, _DEFAULT.optimizer),
        lr=spec.lr, betas=(spec.beta1 or _DEFAULT.betas[0], spec.beta2 or _DEFAULT.betas[1]),
        eps=spec.eps or _DEFAULT.eps, initial_accumulator_value=spec.initial_accumulator_value,
        admit_after=max(spec.admit_after, 1), admit_prob=spec.admit_prob or 1.0, ttl=spec.ttl,
        ttl_unit=_named(_UNITS, spec.ttl_unit, _DEFAULT.ttl_unit), max_rows=spec.max_rows,
        cap_policy=_named(_POLICIES, spec.cap_policy, _DEFAULT.cap_policy),
        log_evictions=spec.log_evictions, allow_nonfinite=spec.allow_nonfinite,
        mode=_named(_MODES, spec.mode, _DEFAULT.mode),
        admit_memory_mb=spec.admit_memory_mb or _DEFAULT.admit_memory_mb,
        row_dtype=spec.row_dtype or _DEFAULT.row_dtype, compression=spec.compression or _DEFAULT.compression,
        memory_mb=spec.memory_mb)


def encode_grads(config: TableConfig, rows: np.ndarray) -> np.ndarray:
    """Gradient rows as they travel (TableConfig.grad_dtype): cast to 2 bytes a value where the table
    compresses its pushes (bfloat16 rounded to nearest even, as the dense cast), else `rows` itself."""
    if config.compression == "bf16":
        return codec.f32_to_bf16(np.asarray(rows, np.float32))
    if config.compression == "fp16":
        return rows.astype("<f2")
    return rows


def decode_grads(config: TableConfig, wire: np.ndarray) -> np.ndarray:
    """float32 (or the table's dtype) rows of gradients as `encode_grads` sent them."""
    if config.compression == "bf16":
        return codec.bf16_to_f32(wire)
    if config.compression == "fp16":
        return wire.astype(np.float32)
    return wire


def decode_rows(config: TableConfig, stored: np.ndarray) -> np.ndarray:
    """float32 (n, dim) of rows in `config`'s stored form, (n, width) as TableConfig.row_layout; rows of a
    table that is not narrow are returned as they are."""
    if not config.narrow:
        return stored
    dim = config.dim
    raw = np.ascontiguousarray(stored, np.uint8)
    if config.row_dtype == "float16":
        return raw.view("<f2").astype(np.float32)
    if config.row_dtype == "bfloat16":
        return (raw.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    tail = np.ascontiguousarray(raw[:, dim:]).view("<f2")  # (n, 2): scale, offset
    # In float64 (exact), clipped to float32's range, rounded once: the server's rowcodec.decode_int8.
    scale, offset = tail[:, 0:1].astype(np.float64), tail[:, 1:2].astype(np.float64)
    return np.clip(offset + scale * raw[:, :dim], -_FLOAT32_MAX, _FLOAT32_MAX).astype(np.float32)
