"""The codec: numpy/torch <-> protobuf bit for bit, bfloat16 rounding, casts, Exchange data frames,
the wire's enums and optional fields, and the dtype registry's agreement with the stubs."""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable
from typing import Any, TypeVar

import hypothesis.extra.numpy as hnp
import numpy as np
import pytest
import torch
from google.protobuf.message import Message
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pshard.common.cluster.layout import ParamSpec, plan_layout
from pshard.common.cluster.view import ROLES, ClusterView, Node, NodeState
from pshard.common.errors import DTypeMismatchError, EmptyRequestError, InvalidArgumentError, PayloadSizeError
from pshard.common.job import MODES, NONFINITE, OPTIMIZERS, WIRE_DTYPES, JobConfig, OptimizerConfig
from pshard.common.types import SliceKey, Stamp
from pshard.common.wire import codec, dtypes
from pshard.common.wire.codec import WireArray

from pshard.api.v1 import parameter_server_pb2 as ps_pb
from pshard.api.v1 import scheduler_pb2 as sched_pb
from pshard.api.v1 import tensor_pb2 as tensor_pb

M = TypeVar("M", bound=Message)
FLOATS = ("float32", "float64", "float16", "bfloat16")
SHAPES = hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)
# Every bit pattern of a float dtype (NaN payloads, signalling NaNs) comes from its same-width uint.
_BITS: dict[str, np.dtype[Any]] = {"float32": np.dtype("<u4"), "float64": np.dtype("<u8"),
                                   "float16": np.dtype("<u2"), "bfloat16": np.dtype("<u2")}


def wire_arrays(dtype: str) -> st.SearchStrategy[WireArray]:
    storage = codec.numpy_dtype(dtype)
    return hnp.arrays(_BITS.get(dtype, storage), SHAPES).map(lambda a: WireArray(a.view(storage), dtype))


def assert_same_bits(got: WireArray, want: WireArray) -> None:
    assert got.dtype == want.dtype
    assert got.array.dtype == codec.numpy_dtype(want.dtype)
    assert got.array.shape == want.array.shape
    assert got.array.tobytes() == want.array.tobytes()


def bf16_bits(values: np.ndarray) -> np.ndarray:
    """Reference: torch's own float32 -> bfloat16 conversion, as raw bits."""
    return torch.from_numpy(values.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def is_bf16_nan(bits: np.ndarray) -> np.ndarray:
    return ((bits & 0x7F80) == 0x7F80) & ((bits & 0x007F) != 0)


# ---- numpy <-> proto ----

@pytest.mark.parametrize("dtype", dtypes.NAMES)
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_tensor_round_trips_bit_for_bit_for_every_dtype(dtype: str, data: st.DataObject) -> None:
    wire = data.draw(wire_arrays(dtype))

    encoded = codec.tensor_to_proto(wire).SerializeToString()

    back = codec.tensor_from_proto(tensor_pb.Tensor.FromString(encoded))

    assert_same_bits(back, wire)


@pytest.mark.parametrize("dtype", dtypes.NAMES)
def test_dtype_enum_round_trips_and_names_agree_with_numpy(dtype: str) -> None:
    assert codec.dtype_from_proto(codec.dtype_to_proto(dtype)) == dtype
    if dtype != "bfloat16":
        assert codec.dtype_name_of(np.zeros(1, codec.numpy_dtype(dtype))) == dtype


def test_wire_bytes_are_little_endian_whatever_the_input_byte_order() -> None:
    values = np.arange(6, dtype=">f4").reshape(2, 3)

    t = codec.tensor_to_proto(WireArray(values, "float32"))

    assert t.data == values.astype("<f4").tobytes()
    assert list(t.shape) == [2, 3]


def test_non_contiguous_arrays_travel_in_c_order() -> None:
    values = np.arange(12, dtype=np.int32).reshape(3, 4).T

    back = codec.tensor_from_proto(codec.tensor_to_proto(WireArray(values, "int32")))

    np.testing.assert_array_equal(back.array, values)


def test_decoded_array_is_a_read_only_view_of_the_message_bytes() -> None:
    t = codec.tensor_to_proto(WireArray(np.ones(4, np.float32), "float32"))

    back = codec.tensor_from_proto(t)

    assert not back.array.flags.writeable


@pytest.mark.parametrize(("dtype", "shape", "nbytes", "need"), [
    ("float32", (2, 3), 23, 24), ("float32", (2, 3), 25, 24), ("float64", (), 0, 8),
    ("bfloat16", (0, 5), 2, 0), ("bool", (7,), 8, 7),
])
def test_wrong_byte_length_is_a_payload_size_error_naming_both_counts(
        dtype: str, shape: tuple[int, ...], nbytes: int, need: int) -> None:
    t = tensor_pb.Tensor(dtype=codec.dtype_to_proto(dtype), shape=shape, data=b"\0" * nbytes)

    with pytest.raises(PayloadSizeError, match=rf"got {nbytes} bytes.*need {need}\b"):
        codec.tensor_from_proto(t, "slice 'fc.w'")


def test_negative_dimension_is_invalid() -> None:
    t = tensor_pb.Tensor(dtype=tensor_pb.DTYPE_FLOAT32, shape=[-1, 4], data=b"")

    with pytest.raises(InvalidArgumentError, match=re.escape("(-1, 4)")):
        codec.tensor_from_proto(t)


@pytest.mark.parametrize("enum", [tensor_pb.DTYPE_UNSPECIFIED, 99])
def test_unknown_dtype_enum_is_a_dtype_mismatch_naming_the_value(enum: int) -> None:
    # protoc's stubs take only the enum's members; proto3 enums are open, so any int32 goes on the wire.
    t = tensor_pb.Tensor(dtype=enum, shape=[1], data=b"\0")  # type: ignore[arg-type]

    with pytest.raises(DTypeMismatchError, match=rf"enum value {enum}\b"):
        codec.tensor_from_proto(t)


def test_unknown_dtype_name_and_numpy_dtype_are_dtype_mismatches() -> None:
    with pytest.raises(DTypeMismatchError, match="complex64"):
        codec.dtype_to_proto("complex64")
    with pytest.raises(DTypeMismatchError, match="complex64"):
        codec.dtype_name_of(np.zeros(1, np.complex64))


def test_slice_tensor_round_trips_with_its_key() -> None:
    wire = WireArray(np.arange(5, dtype=np.float16), "float16")

    key, back = codec.slice_tensor_from_proto(codec.slice_tensor_to_proto(SliceKey("fc.w", 3), wire, 7))

    assert key == SliceKey("fc.w", 3)
    assert_same_bits(back, wire)


def test_slice_tensor_size_error_names_the_slice() -> None:
    s = tensor_pb.SliceTensor(id=tensor_pb.SliceId(key="fc.w", part=2),
                              tensor=tensor_pb.Tensor(dtype=tensor_pb.DTYPE_FLOAT32, shape=[2],
                                                      data=b"\0" * 7))

    with pytest.raises(PayloadSizeError, match=re.escape("slice 'fc.w[2]'")):
        codec.slice_tensor_from_proto(s)


# ---- torch ----

TORCH_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16",
                torch.bfloat16: "bfloat16", torch.int8: "int8", torch.int16: "int16", torch.int32: "int32",
                torch.int64: "int64", torch.uint8: "uint8", torch.bool: "bool"}
_TORCH_BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.float16: torch.int16,
               torch.bfloat16: torch.int16}


def torch_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_TORCH_BITS[t.dtype]) if t.dtype in _TORCH_BITS else t


# The worker moves tensors through worker/device.py; these two are the codec's contract spelled in
# torch, kept here because only tests need them.
def torch_to_wire(tensor: torch.Tensor) -> WireArray:
    """CPU torch tensor -> WireArray without a copy when it is contiguous."""
    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return WireArray(t.view(torch.int16).numpy().view(np.uint16), "bfloat16")
    array = t.numpy()
    return WireArray(array, codec.dtype_name_of(array))


def wire_to_torch(wire: WireArray) -> torch.Tensor:
    array = wire.array if wire.array.flags.writeable else wire.array.copy()
    if wire.dtype == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


@pytest.mark.parametrize("torch_dtype", list(TORCH_DTYPES), ids=str)
def test_dtype_registry_names_the_torch_dtype(torch_dtype: torch.dtype) -> None:
    info = dtypes.of_torch(torch_dtype)

    assert info.name == TORCH_DTYPES[torch_dtype]
    assert getattr(torch, info.torch_name) is torch_dtype
    assert torch.empty(0, dtype=torch_dtype).element_size() == info.itemsize


@pytest.mark.parametrize("torch_dtype", list(TORCH_DTYPES), ids=str)
@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_torch_tensor_round_trips_bit_for_bit(torch_dtype: torch.dtype, data: st.DataObject) -> None:
    name = TORCH_DTYPES[torch_dtype]
    bits = data.draw(wire_arrays(name)).array
    tensor = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16) if name == "bfloat16" \
        else torch.from_numpy(bits)

    wire = torch_to_wire(tensor)
    back = wire_to_torch(codec.tensor_from_proto(codec.tensor_to_proto(wire)))

    assert wire.dtype == name
    assert isinstance(back, torch.Tensor)
    assert back.dtype == torch_dtype
    assert back.shape == tensor.shape
    assert torch.equal(torch_bits(back), torch_bits(tensor))


def test_bfloat16_travels_as_its_uint16_bit_pattern() -> None:
    tensor = torch.tensor([1.0, -2.0, float("inf")], dtype=torch.bfloat16)

    wire = torch_to_wire(tensor)

    assert wire.array.dtype == np.uint16
    assert wire.array.tolist() == [0x3F80, 0xC000, 0x7F80]


def test_torch_to_wire_shares_memory_with_a_contiguous_cpu_tensor() -> None:
    tensor = torch.zeros(4)

    wire = torch_to_wire(tensor)
    tensor[1] = 5.0

    assert wire.array[1] == 5.0


def test_non_contiguous_torch_tensor_keeps_its_logical_order() -> None:
    tensor = torch.arange(6, dtype=torch.int64).reshape(2, 3).T

    back = wire_to_torch(codec.tensor_from_proto(codec.tensor_to_proto(torch_to_wire(tensor))))

    assert torch.equal(back, tensor)


def test_wire_to_torch_of_a_received_tensor_is_writable() -> None:
    back = wire_to_torch(codec.tensor_from_proto(codec.tensor_to_proto(
        WireArray(np.ones(3, np.float32), "float32"))))

    back.add_(1.0)  # torch would warn about, then scribble on, a read-only buffer

    assert back.tolist() == [2.0, 2.0, 2.0]


# ---- bfloat16 rounding ----

_SPECIAL_F32 = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # +-0, +-inf
                0x00000001, 0x807FFFFF, 0x00008000, 0x00018000,  # subnormals, incl. ties
                0x3F808000, 0x3F818000, 0xBF808000, 0x3F807FFF, 0x3F808001,  # ties to even, either side
                0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF,  # overflow to inf at the top
                0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF]  # NaNs (quiet, signalling)
f32_bits = st.one_of(st.sampled_from(_SPECIAL_F32), st.integers(0, 2**32 - 1),
                     st.integers(0, 0x007FFFFF), st.integers(0, 2**16 - 1).map(lambda h: h << 16 | 0x8000))


@settings(max_examples=300, deadline=None)
@given(st.lists(f32_bits, max_size=64))
@example(_SPECIAL_F32)
def test_f32_to_bf16_rounds_exactly_as_torch(bits: list[int]) -> None:
    values = np.array(bits, dtype=np.uint32).view(np.float32)

    got, want = codec.f32_to_bf16(values), bf16_bits(values)

    assert got.dtype == np.uint16
    nan = np.isnan(values)
    # NaN bits are not portable (torch's vector kernel writes 0xFFFF, its scalar path 0x7FC0): NaN stays NaN.
    assert is_bf16_nan(got[nan]).all()
    assert [hex(b) for b in got[~nan]] == [hex(b) for b in want[~nan]]


def test_bf16_to_f32_widens_every_bit_pattern_as_torch_does() -> None:
    bits = np.arange(2**16, dtype=np.uint16)

    got = codec.bf16_to_f32(bits)
    want = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()

    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_every_bfloat16_value_survives_widening_and_rounding_back() -> None:
    bits = np.arange(2**16, dtype=np.uint16)
    bits = bits[~is_bf16_nan(bits)]

    assert np.array_equal(codec.f32_to_bf16(codec.bf16_to_f32(bits)), bits)


@pytest.mark.parametrize("value", [1.5, np.nan, -np.inf])
def test_bfloat16_conversions_keep_a_0d_shape(value: float) -> None:
    bits = codec.f32_to_bf16(np.array(value, dtype=np.float32))
    wide = codec.bf16_to_f32(bits)

    assert isinstance(bits, np.ndarray) and bits.shape == ()
    assert isinstance(wide, np.ndarray) and wide.shape == ()
    np.testing.assert_array_equal(wide, np.float32(value))


# ---- casts (wire compression) ----

def reference_cast(wire: WireArray, dtype: str) -> np.ndarray:
    """torch's `.to(dtype)`, except float64 -> float16: torch rounds twice (via float32), pshard once."""
    if wire.dtype == "float64" and dtype == "float16":
        return wire.array.astype(np.float16)
    names = {v: k for k, v in TORCH_DTYPES.items()}
    source = torch.from_numpy(wire.array.view(np.int16)).view(torch.bfloat16) if wire.dtype == "bfloat16" \
        else torch.from_numpy(wire.array)
    out = source.to(names[dtype])
    return out.view(torch.int16).numpy().view(np.uint16) if dtype == "bfloat16" else out.numpy()


@pytest.mark.parametrize("source", FLOATS)
@pytest.mark.parametrize("target", FLOATS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_cast_between_float_dtypes_matches_torch(source: str, target: str, data: st.DataObject) -> None:
    wire = data.draw(wire_arrays(source))

    with np.errstate(over="ignore", invalid="ignore"):
        got = codec.cast(wire, target)
        want = reference_cast(wire, target)

    assert got.dtype == target
    assert got.array.dtype == codec.numpy_dtype(target)
    assert got.array.shape == wire.array.shape
    wide_got = codec.bf16_to_f32(got.array) if target == "bfloat16" else got.array
    wide_want = codec.bf16_to_f32(want) if target == "bfloat16" else want
    np.testing.assert_array_equal(np.isnan(wide_got), np.isnan(wide_want))
    ok = ~np.isnan(wide_want)
    assert wide_got[ok].tobytes() == wide_want[ok].tobytes()


def test_cast_to_the_same_dtype_is_the_identity() -> None:
    wire = WireArray(np.ones(3, np.float32), "float32")

    assert codec.cast(wire, "float32") is wire


# ---- data frames ----

FRAME_SIZES = [0, 1, 127, 128, 129, 16383, 16384, 16385, 2**21 - 1, 2**21, 3 * 2**20 + 7]


@settings(max_examples=30, deadline=None)
@given(size=st.one_of(st.sampled_from(FRAME_SIZES), st.integers(0, 4 * 2**20)),
       cuts=st.lists(st.floats(0, 1), max_size=3), seed=st.integers(0, 2**32 - 1))
def test_data_frame_is_an_ordinary_exchange_message_both_ways(size: int, cuts: list[float],
                                                               seed: int) -> None:
    payload = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    edges = [0, *sorted(int(c * size) for c in cuts), size]
    kinds: list[Callable[[bytes], bytes | memoryview | np.ndarray]] = [
        bytes, memoryview, lambda b: np.frombuffer(b, np.uint8)]
    parts = [kinds[i % 3](payload[a:b]) for i, (a, b) in enumerate(itertools.pairwise(edges))]

    frame = codec.encode_data_frame(parts)

    for message in (ps_pb.ExchangeRequest, ps_pb.ExchangeResponse):  # the client's and the server's
        parsed = message.FromString(frame)
        assert parsed.WhichOneof("body") == "data"
        assert parsed.data == payload
        assert frame == message(data=payload).SerializeToString()
    view = codec.decode_data_frame(frame)
    assert view is not None and view.obj is frame and bytes(view) == payload


def test_data_frame_takes_typed_arrays_as_their_raw_bytes() -> None:
    parts = [np.arange(3, dtype=np.float32), np.array([True, False]), np.zeros((0, 4), np.float64),
             np.array(7, np.int16), np.arange(6, dtype=np.int32).reshape(2, 3).T]

    frame = codec.encode_data_frame(parts)

    want = b"".join(np.ascontiguousarray(p).tobytes() for p in parts)
    assert ps_pb.ExchangeRequest.FromString(frame).data == want


@pytest.mark.parametrize("frame", [
    ps_pb.ExchangeRequest(header=ps_pb.ExchangeHeader(op=ps_pb.EXCHANGE_OP_PUSH_PULL, timeout_ms=5)),
    ps_pb.ExchangeResponse(summary=ps_pb.ExchangeSummary(versions=[3], applied=1)),
    ps_pb.ExchangeRequest(),
    ps_pb.ExchangeResponse(),
], ids=["header", "summary", "empty request", "empty response"])
def test_decode_data_frame_returns_none_for_other_frames(
        frame: ps_pb.ExchangeRequest | ps_pb.ExchangeResponse) -> None:
    encoded = codec.encode_frame(frame)

    assert codec.decode_data_frame(encoded) is None
    decode = codec.decode_request_frame if isinstance(frame, ps_pb.ExchangeRequest) \
        else codec.decode_response_frame
    assert decode(encoded) == frame


@pytest.mark.parametrize("size", [1, 200, 20000])
def test_truncated_data_frame_is_a_payload_size_error(size: int) -> None:
    frame = codec.encode_data_frame([b"x" * size])

    with pytest.raises(PayloadSizeError, match=rf"prefix says {size} bytes, frame holds {size - 1}"):
        codec.decode_data_frame(frame[:-1])
    with pytest.raises(PayloadSizeError, match=rf"prefix says {size} bytes, frame holds {size + 1}"):
        codec.decode_data_frame(frame + b"y")


def test_data_frame_cut_inside_its_length_prefix_is_a_payload_size_error() -> None:
    frame = codec.encode_data_frame([b"x" * 20000])  # three-byte varint

    with pytest.raises(PayloadSizeError, match="truncated length prefix"):
        codec.decode_data_frame(frame[:2])


# ---- stamps, job config, layout ----

def test_stamp_round_trips() -> None:
    stamp = Stamp("worker-1", 3, 2**40)

    assert codec.stamp_from_proto(codec.stamp_to_proto(stamp)) == stamp


def test_stamp_without_worker_id_is_invalid() -> None:
    with pytest.raises(InvalidArgumentError, match="worker_id"):
        codec.stamp_from_proto(ps_pb.Stamp(worker_id="", generation=1, clock=1))


_NONNEG = st.floats(0, 1, allow_nan=False)  # within every optimizer field's range (job.py)


@st.composite
def job_configs(draw: st.DrawFn) -> JobConfig:
    name = draw(st.sampled_from(OPTIMIZERS))
    nesterov = draw(st.booleans())
    optimizer = OptimizerConfig(
        name=name, lr=draw(_NONNEG), nesterov=nesterov,
        momentum=draw(st.floats(0.01, 0.99)) if nesterov else draw(_NONNEG),
        dampening=0.0 if nesterov else draw(_NONNEG), weight_decay=draw(_NONNEG),
        betas=(draw(st.floats(0, 0.999)), draw(st.floats(0, 0.999))), eps=draw(st.floats(1e-12, 1)),
        amsgrad=draw(st.booleans()), lr_decay=draw(_NONNEG), initial_accumulator_value=draw(_NONNEG))
    return JobConfig(mode=draw(st.sampled_from(MODES)), staleness=draw(st.integers(0, 2**20)),
                     optimizer=optimizer, backup_workers=draw(st.integers(0, 4096)),
                     wire_dtype=draw(st.sampled_from(WIRE_DTYPES)),
                     nonfinite=draw(st.sampled_from(NONFINITE)))


@settings(max_examples=50, deadline=None)
@given(job_configs())
def test_job_config_round_trips(job: JobConfig) -> None:
    p = ps_pb.JobConfig.FromString(codec.job_to_proto(job).SerializeToString())

    assert codec.job_from_proto(p) == job


def test_job_config_without_a_mode_is_invalid() -> None:
    with pytest.raises(InvalidArgumentError, match=r"config\.mode"):
        codec.job_from_proto(ps_pb.JobConfig(optimizer=ps_pb.OptimizerConfig(name=ps_pb.OPTIMIZER_SGD)))


def test_job_config_with_an_unknown_wire_dtype_names_the_field() -> None:
    p = codec.job_to_proto(JobConfig())
    p.wire_dtype = 99

    with pytest.raises(DTypeMismatchError, match=r"config\.wire_dtype"):
        codec.job_from_proto(p)


def test_layout_round_trips() -> None:
    params = [ParamSpec("fc.w", "float32", (300, 7)), ParamSpec("fc.b", "bfloat16", (7,)),
              ParamSpec("empty", "float16", (0, 3)), ParamSpec("scale", "float64", ()),
              ParamSpec("mask", "bool", (5,)), ParamSpec("ids", "int64", (2, 2))]
    layout = plan_layout(params, ["ps-0:7100", "ps-1:7100", "ps-2:7100"], slice_bytes=1024)
    layout = type(layout)(layout.params, layout.servers, layout.slice_bytes, layout.slices, version=4)

    back = codec.layout_from_proto(type(codec.layout_to_proto(layout)).FromString(
        codec.layout_to_proto(layout).SerializeToString()))

    assert back == layout
    assert back.version == 4
    assert back.slices_of("fc.w") == layout.slices_of("fc.w")


# ---- the dtype registry against the stubs ----

@pytest.mark.parametrize("name", dtypes.NAMES)
def test_dtype_registry_agrees_with_the_proto_enum(name: str) -> None:
    info = dtypes.info(name)

    assert tensor_pb.Dtype.Name(info.proto) == f"DTYPE_{name.upper()}"
    assert info.itemsize == codec.numpy_dtype(name).itemsize
    assert info.numpy == info.numpy.newbyteorder("<")  # the wire is little-endian


def test_every_proto_dtype_has_a_registry_entry() -> None:
    numbers = set(tensor_pb.Dtype.values()) - {tensor_pb.DTYPE_UNSPECIFIED}

    assert {dtypes.info(n).proto for n in dtypes.NAMES} == numbers


def test_parameter_dtypes_are_the_floats_numpy_has_and_float16_keeps_a_float32_master() -> None:
    assert dtypes.PARAM_DTYPES == ("float32", "float64", "float16")
    assert dtypes.master_dtype(np.dtype(np.float16)) == np.float32
    assert dtypes.master_dtype(np.dtype(np.float64)) == np.float64
    assert set(dtypes.MASTER_DTYPES) == {"float32", "float64"}
    assert WIRE_DTYPES == ("", "float16", "bfloat16")


# ---- enums: Python's names <-> the wire's values ----

ENUMS = [  # (python names, to_proto, from_proto, proto enum, value prefix)
    (ROLES, codec.role_to_proto, codec.role_from_proto, sched_pb.Role, "ROLE"),
    (MODES, codec.mode_to_proto, codec.mode_from_proto, ps_pb.ConsistencyMode, "CONSISTENCY_MODE"),
    (OPTIMIZERS, codec.optimizer_to_proto, codec.optimizer_from_proto, ps_pb.Optimizer, "OPTIMIZER"),
]
ENUM_IDS = ["role", "mode", "optimizer"]


@pytest.mark.parametrize(("names", "to_proto", "from_proto", "enum", "prefix"), ENUMS, ids=ENUM_IDS)
def test_enum_conversion_round_trips_every_python_name(names, to_proto, from_proto, enum, prefix) -> None:
    for name in names:
        value = to_proto(name)

        assert enum.Name(value) == f"{prefix}_{name.upper()}"
        assert from_proto(value) == name
    assert len(enum.values()) == len(names) + 1  # every wire value but UNSPECIFIED has a Python name


@pytest.mark.parametrize(("names", "to_proto", "from_proto", "enum", "prefix"), ENUMS, ids=ENUM_IDS)
def test_unknown_enum_value_from_the_wire_is_invalid_naming_field_and_value(
        names, to_proto, from_proto, enum, prefix) -> None:
    with pytest.raises(InvalidArgumentError, match=r"^register\.x: got enum value 99, expected one of"):
        from_proto(99, "register.x")


@pytest.mark.parametrize(("names", "to_proto", "from_proto", "enum", "prefix"), ENUMS, ids=ENUM_IDS)
def test_unspecified_enum_value_is_an_empty_request_naming_the_field(
        names, to_proto, from_proto, enum, prefix) -> None:
    with pytest.raises(EmptyRequestError, match=rf"^f: got {prefix}_UNSPECIFIED, expected one of"):
        from_proto(0, "f")


@pytest.mark.parametrize(("names", "to_proto", "from_proto", "enum", "prefix"), ENUMS, ids=ENUM_IDS)
def test_unknown_python_name_is_invalid_naming_it(names, to_proto, from_proto, enum, prefix) -> None:
    with pytest.raises(InvalidArgumentError, match="'nope'"):
        to_proto("nope")


def test_nonfinite_policy_round_trips_and_unset_means_reject() -> None:
    for policy in NONFINITE:
        value = codec.nonfinite_to_proto(policy)

        assert ps_pb.NonfinitePolicy.Name(value) == f"NONFINITE_POLICY_{policy.upper()}"
        assert codec.nonfinite_from_proto(value) == policy
    assert codec.nonfinite_from_proto(ps_pb.NONFINITE_POLICY_UNSPECIFIED) == "reject"
    with pytest.raises(InvalidArgumentError, match=r"config\.nonfinite: got enum value 9\b"):
        codec.nonfinite_from_proto(9, "config.nonfinite")


def test_job_config_with_an_unknown_optimizer_names_the_field_and_value() -> None:
    p = codec.job_to_proto(JobConfig())
    p.optimizer.name = 42  # type: ignore[assignment]

    with pytest.raises(InvalidArgumentError, match=r"config\.optimizer\.name: got enum value 42"):
        codec.job_from_proto(p)


def test_cluster_view_round_trips_with_roles_as_enums() -> None:
    view = ClusterView(7, tuple(Node(f"{r}-0", r, 0, f"{r}:1", NodeState.LIVE, 7) for r in ROLES), 2)

    p = sched_pb.ClusterView.FromString(codec.view_to_proto(view).SerializeToString())

    assert [n.role for n in p.nodes] == [codec.role_to_proto(r) for r in ROLES]
    assert codec.view_from_proto(p) == view


def test_node_with_an_unknown_role_names_the_node() -> None:
    p = sched_pb.Node(node_id="x-1", role=77, state=sched_pb.NODE_STATE_LIVE)  # type: ignore[arg-type]

    with pytest.raises(InvalidArgumentError, match=r"node 'x-1' role: got enum value 77"):
        codec.node_from_proto(p)


# ---- optional fields: absent is not zero ----

def wire_round_trip(message: M) -> M:
    return type(message).FromString(message.SerializeToString())


def test_rank_hint_zero_is_present_and_distinct_from_absent() -> None:
    zero = codec.register_from_proto(wire_round_trip(codec.register_to_proto("worker", "w:1", rank_hint=0)))
    absent = codec.register_from_proto(wire_round_trip(codec.register_to_proto("worker", "w:1")))

    assert zero.rank_hint == 0
    assert absent.rank_hint is None


def test_register_round_trips_every_argument() -> None:
    p = codec.register_to_proto("chief", "c:1", node_id="chief-0", rank_hint=3, last_generation=9)

    back = codec.register_from_proto(wire_round_trip(p))

    assert back == codec.RegisterArgs("chief", "c:1", "chief-0", 3, 9)


def test_register_without_node_id_lets_the_scheduler_assign_one_but_an_empty_one_is_invalid() -> None:
    assert codec.register_from_proto(sched_pb.RegisterRequest(role=sched_pb.ROLE_PS)).node_id is None

    with pytest.raises(InvalidArgumentError, match="node_id: got ''"):
        codec.register_from_proto(sched_pb.RegisterRequest(role=sched_pb.ROLE_PS, node_id=""))


def test_register_without_a_role_is_an_empty_request() -> None:
    with pytest.raises(EmptyRequestError, match="role: got ROLE_UNSPECIFIED"):
        codec.register_from_proto(sched_pb.RegisterRequest(address="w:1"))


@pytest.mark.parametrize("message", [ps_pb.PullRequest, ps_pb.PushPullRequest, ps_pb.ExchangeHeader,
                                     ps_pb.CheckpointRequest, sched_pb.BarrierRequest,
                                     sched_pb.GetLayoutRequest])
def test_timeout_zero_is_present_and_distinct_from_absent(message) -> None:
    assert codec.timeout_ms_from_proto(wire_round_trip(message(timeout_ms=0))) == 0
    assert codec.timeout_ms_from_proto(wire_round_trip(message(timeout_ms=250))) == 250
    assert codec.timeout_ms_from_proto(wire_round_trip(message())) is None


@pytest.mark.parametrize("lr", [float("nan"), -0.1, 1e9])
def test_a_stamp_with_a_bad_lr_is_refused_naming_the_field(lr: float) -> None:
    with pytest.raises(InvalidArgumentError, match=r"stamp.lr: got"):
        codec.stamp_from_proto(codec.stamp_to_proto(Stamp("w0", 0, 3, lr)))


def test_a_stamp_carries_its_lr_or_none() -> None:
    assert codec.stamp_from_proto(codec.stamp_to_proto(Stamp("w0", 2, 3, 0.25))) == Stamp("w0", 2, 3, 0.25)
    assert codec.stamp_from_proto(codec.stamp_to_proto(Stamp("w0", 2, 3))).lr is None
