"""The one table of element types: every fact pshard keeps about a dtype is a field here.

A dtype has one logical name (numpy's and torch's: "float32", "bfloat16", ...) used in
ParamSpec, JobConfig.wire_dtype and the codec's WireArray. Numpy has no bfloat16: a bfloat16
array is held as its raw 16-bit patterns (uint16), so the numpy dtype alone does not name a
dtype. Pure: numpy only, no torch (the parameter server has none) and no generated code (the
proto enum numbers are plain ints here; tests/unit/test_codec.py checks them against the stubs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from pshard.common.errors import DTypeMismatchError


@dataclass(frozen=True)
class DtypeInfo:
    name: str
    # Storage in numpy and byte order on the wire ("<": little-endian, whatever the host).
    numpy: np.dtype
    # The Dtype enum number in proto/pshard/api/v1/tensor.proto.
    proto: int
    # A parameter server stores and trains slices of this dtype (bfloat16 models declare float32).
    param: bool = False
    # Parameters of this dtype are updated in a master copy of this dtype ("" = in place), as
    # mixed-precision training does: float16 steps smaller than its spacing are not lost.
    master: str = ""
    # May be a job's wire_dtype: gradients and pulled weights travel cast to it.
    wire_cast: bool = False

    @property
    def itemsize(self) -> int:
        return self.numpy.itemsize

    @property
    def torch_name(self) -> str:
        """The attribute of the `torch` module with this dtype (torch's names are numpy's)."""
        return self.name


_ALL = (
    DtypeInfo("float32", np.dtype("<f4"), 1, param=True),
    DtypeInfo("float64", np.dtype("<f8"), 2, param=True),
    DtypeInfo("float16", np.dtype("<f2"), 3, param=True, master="float32", wire_cast=True),
    DtypeInfo("bfloat16", np.dtype("<u2"), 4, wire_cast=True),
    DtypeInfo("int8", np.dtype("i1"), 5),
    DtypeInfo("int16", np.dtype("<i2"), 6),
    DtypeInfo("int32", np.dtype("<i4"), 7),
    DtypeInfo("int64", np.dtype("<i8"), 8),
    DtypeInfo("uint8", np.dtype("u1"), 9),
    DtypeInfo("bool", np.dtype("?"), 10),
)

DTYPES: dict[str, DtypeInfo] = {d.name: d for d in _ALL}
NAMES = tuple(DTYPES)
# What a parameter server stores and trains.
PARAM_DTYPES = tuple(d.name for d in _ALL if d.param)
# What a job's wire_dtype may be ("" = slices travel as stored).
WIRE_DTYPES = ("", *(d.name for d in _ALL if d.wire_cast))
# The dtypes a server's optimizers compute in: every parameter dtype's master (or itself).
MASTER_DTYPES = tuple(dict.fromkeys(d.master or d.name for d in _ALL if d.param))

_BY_PROTO = {d.proto: d for d in _ALL}
# bfloat16 is left out: its numpy storage (uint16) is not its name.
_BY_NUMPY = {d.numpy.newbyteorder("="): d for d in _ALL if d.name != "bfloat16"}


def info(name: str) -> DtypeInfo:
    """The facts of dtype `name`; DTypeMismatchError naming it when pshard has no such dtype."""
    try:
        return DTYPES[name]
    except KeyError:
        raise DTypeMismatchError(f"dtype: got {name!r}, expected one of {NAMES}") from None


def from_proto(number: int, field: str = "dtype") -> DtypeInfo:
    """The dtype of a Dtype enum number; DTypeMismatchError naming `field` for 0 or an unknown one."""
    try:
        return _BY_PROTO[number]
    except KeyError:
        raise DTypeMismatchError(f"{field}: got enum value {number}, expected one of {NAMES}") from None


def of_numpy(dtype: np.dtype) -> DtypeInfo:
    """The dtype of a numpy array of this numpy dtype, either byte order. uint16 has none: numpy's
    uint16 arrays are bfloat16 only where a WireArray says so."""
    found = _BY_NUMPY.get(np.dtype(dtype).newbyteorder("="))
    if found is None:
        raise DTypeMismatchError(f"dtype: numpy {dtype} has no wire type; expected one of {NAMES}")
    return found


def of_torch(dtype: object) -> DtypeInfo:
    """The dtype of a torch dtype (torch.float32 prints as "torch.float32"), without importing torch."""
    return info(str(dtype).removeprefix("torch."))


def numpy_dtype(name: str) -> np.dtype:
    return info(name).numpy


def master_dtype(dtype: np.dtype) -> np.dtype:
    """The numpy dtype a server keeps a parameter of numpy dtype `dtype` in (float16 -> float32)."""
    d = of_numpy(dtype)
    return info(d.master).numpy if d.master else d.numpy
