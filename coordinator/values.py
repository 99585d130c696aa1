"""Arguments and results of scheduled functions <-> `Value` messages; tensors through the one codec.

What may travel: numpy arrays and torch tensors (as the codec's {dtype, shape, bytes}), Python's
bool/int/float/str/None, tuples and lists of these, variables declared through the coordinator (by name),
sparse tables declared through it (by their TableConfig) and per-worker iterators (by dataset). Anything
else is refused, naming where it sits (`args[1]`, `kwargs['lr'][0]`) and its type, before anything is
sent. Never pickle.

torch is not imported here: a tensor is recognised by its type's module, and a worker that decodes one
already has torch (it runs torch functions).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from pshard.common.errors import InvalidArgumentError, PSError
from pshard.common.sparse import TableConfig
from pshard.common.wire import codec
from pshard.common.wire.sparse_codec import spec_from_proto, spec_to_proto

from pshard.api.v1 import coordinator_pb2 as pb

# A list nested deeper than this is refused: it is a structure, not an argument.
MAX_DEPTH = 16
_ALLOWED = "a numpy array, a torch tensor, a bool, int, float, str or None, a tuple or list of those, a " \
           "coordinator variable or table, or a per-worker iterator"


@dataclass(frozen=True)
class VariableRef:
    """A variable declared through a coordinator, as it travels: its name."""

    name: str


@dataclass(frozen=True)
class TableRef:
    """A sparse table declared through a coordinator, as it travels: its config."""

    config: TableConfig


@dataclass(frozen=True)
class IteratorRef:
    """A per-worker iterator as it travels: its dataset's number, function name and arguments."""

    dataset_id: int
    dataset_fn: str
    args: tuple[Any, ...] = ()


class Handles(Protocol):
    """What a worker turns references into: its variable proxies and its own iterators."""

    def variable(self, name: str) -> Any: ...

    def iterator(self, ref: IteratorRef) -> Any: ...

    def table(self, config: TableConfig) -> Any: ...


def encode(value: Any, where: str = "value", *, handles: bool = True, depth: int = 0) -> pb.Value:
    """`value` as a Value; InvalidArgumentError naming `where` and its type when it cannot travel.
    `handles`: variables and iterators may travel (arguments; not results)."""
    if hasattr(value, "__pshard_ref__"):
        value = value.__pshard_ref__()
    if isinstance(value, (VariableRef, IteratorRef, TableRef)) and not handles:
        raise InvalidArgumentError(f"{where}: got a {type(value).__name__}, which only travels as an "
                                   "argument")
    if isinstance(value, VariableRef):
        return pb.Value(variable=value.name)
    if isinstance(value, TableRef):
        return pb.Value(table=spec_to_proto(value.config))
    if isinstance(value, IteratorRef):
        return pb.Value(iterator=pb.IteratorHandle(
            dataset_id=value.dataset_id, dataset_fn=value.dataset_fn,
            args=[encode(a, f"{where}.args[{i}]", handles=False) for i, a in enumerate(value.args)]))
    if value is None:
        return pb.Value(none=True)
    if isinstance(value, (bool, np.bool_)):
        return pb.Value(bool_value=bool(value))
    if isinstance(value, (int, np.integer)):
        if not -(2 ** 63) <= int(value) < 2 ** 63:
            raise InvalidArgumentError(f"{where}: got the int {value}, expected one that fits in 64 bits")
        return pb.Value(int_value=int(value))
    if isinstance(value, (float, np.floating)) and not isinstance(value, np.ndarray):
        return pb.Value(float_value=float(value))
    if isinstance(value, str):
        return pb.Value(string_value=value)
    if isinstance(value, (tuple, list)):
        if depth >= MAX_DEPTH:
            raise InvalidArgumentError(f"{where}: nested deeper than {MAX_DEPTH} levels")
        items = [encode(v, f"{where}[{i}]", handles=handles, depth=depth + 1) for i, v in enumerate(value)]
        return pb.Value(list=pb.ValueList(items=items), is_tuple=isinstance(value, tuple))
    if isinstance(value, np.ndarray):
        return pb.Value(tensor=_tensor(value, where))
    if _is_torch_tensor(value):
        return pb.Value(tensor=_torch_tensor(value, where), torch=True)
    raise InvalidArgumentError(f"{where}: got a {type(value).__module__}.{type(value).__qualname__}, "
                               f"expected {_ALLOWED}")


def decode(value: pb.Value, handles: Handles | None = None, where: str = "value") -> Any:
    """The Python value of `value`; references through `handles` (a worker's), refused without one."""
    kind = value.WhichOneof("kind")
    if kind is None:
        raise InvalidArgumentError(f"{where}: got an empty Value, expected one of its kinds")
    if kind == "tensor":
        wire = codec.tensor_from_proto(value.tensor, where)
        return _to_torch(wire) if value.torch else np.array(wire.array)  # a writable copy, as torch's
    if kind == "list":
        items = [decode(v, handles, f"{where}[{i}]") for i, v in enumerate(value.list.items)]
        return tuple(items) if value.is_tuple else items
    if kind in ("variable", "iterator", "table"):
        if handles is None:
            raise InvalidArgumentError(f"{where}: got a {kind} reference, which only travels as an argument")
        if kind == "variable":
            return handles.variable(value.variable)
        if kind == "table":
            return handles.table(spec_from_proto(value.table))
        it = value.iterator
        return handles.iterator(IteratorRef(it.dataset_id, it.dataset_fn, tuple(
            decode(a, None, f"{where}.args[{i}]") for i, a in enumerate(it.args))))
    return None if kind == "none" else getattr(value, kind)


def encode_call(args: tuple[Any, ...], kwargs: dict[str, Any], fn: str
                ) -> tuple[list[pb.Value], list[pb.NamedValue]]:
    """A call's arguments, refused whole (naming `fn` and the argument) if any cannot travel."""
    if not isinstance(args, (tuple, list)):
        raise InvalidArgumentError(f"schedule({fn}): args: got a {type(args).__name__}, expected a tuple")
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise InvalidArgumentError(f"schedule({fn}): kwargs: got {type(kwargs).__name__}, expected a dict "
                                   "with str keys")
    return ([encode(a, f"schedule({fn}): args[{i}]") for i, a in enumerate(args)],
            [pb.NamedValue(name=k, value=encode(v, f"schedule({fn}): kwargs[{k!r}]"))
             for k, v in kwargs.items()])


def decode_call(request: pb.RunRequest, handles: Handles) -> tuple[list[Any], dict[str, Any]]:
    args = [decode(v, handles, f"args[{i}]") for i, v in enumerate(request.args)]
    return args, {kv.name: decode(kv.value, handles, f"kwargs[{kv.name!r}]") for kv in request.kwargs}


def _tensor(array: np.ndarray, where: str) -> Any:
    try:
        name = codec.dtype_name_of(array)
    except (PSError, KeyError, ValueError):
        raise InvalidArgumentError(f"{where}: got an array of dtype {array.dtype}, expected one the codec "
                                   "carries (float16/32/64, bfloat16, int8/16/32/64, uint8, bool)") from None
    return codec.tensor_to_proto(codec.WireArray(array, name))


def _is_torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _torch_tensor(tensor: Any, where: str) -> Any:
    import torch

    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:  # numpy has none: its 16-bit pattern, tagged, as the codec carries it
        return codec.tensor_to_proto(codec.WireArray(t.view(torch.int16).numpy().view(np.uint16), "bfloat16"))
    return _tensor(t.numpy(), where)


def _to_torch(wire: codec.WireArray) -> Any:
    import torch

    if wire.dtype == "bfloat16":
        return torch.from_numpy(np.array(wire.array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.array(wire.array))

