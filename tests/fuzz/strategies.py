"""Hypothesis strategies for protobuf requests, built by walking the message descriptors.

Nothing here names a message or an RPC of pshard's protos: a field added, removed or turned
`optional`, a message or an RPC added, is fuzzed the next run. Every field type is drawn within the
range its wire type allows (int32/sint32/sfixed32, int64/sint64/sfixed64, uint32/fixed32,
uint64/fixed64: setting a value outside raises in protobuf, so nothing reaches a server), with its
edge values weighted up. Values lean towards what breaks services: the extremes of each integer
type, NaN and infinities, empty, huge and non-ASCII strings, unknown enum numbers (open enums only:
a closed enum refuses them on assignment), nested and repeated messages, maps (message-valued ones
included), oneofs, repeated fields with many copies of one element, and valid requests with a few
fields overwritten or cleared.

A few field names get a safer distribution (the checks run the server in this process, so a shape
must never ask it for a few GiB it could actually obtain): tensor dims are tiny or beyond any
allocation, and waits are short. Those values too are cut to the field's range.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, Literal

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st
from pshard.common.cluster.layout import ITEMSIZE

_F = FieldDescriptor
INT_EXTREMES: dict[int, tuple[int, int, tuple[int, ...]]] = {
    # cpp_type: (min, max, values that break code)
    _F.CPPTYPE_INT32: (-(2**31), 2**31 - 1, (0, 1, -1, 2**31 - 1, -(2**31))),
    _F.CPPTYPE_INT64: (-(2**63), 2**63 - 1, (0, 1, -1, 2**62, 2**63 - 1, -(2**63), 2**32)),
    _F.CPPTYPE_UINT32: (0, 2**32 - 1, (0, 1, 2**31, 2**32 - 1)),
    _F.CPPTYPE_UINT64: (0, 2**64 - 1, (0, 1, 2**62, 2**62 + 1, 2**63 - 1, 2**63, 2**64 - 1)),
}
ABSURD_FLOATS = (math.nan, math.inf, -math.inf, 0.0, -0.0, 1e30, -1e30, 1e308, 5e-324, 1.0)
# Tensor dims: products are either a few thousand elements or beyond any allocation (>= 2**62).
SHAPE_DIMS = (0, 1, 2, 3, 4, 12, -1, 2**62, 2**63 - 1, -(2**63), 2**64 - 1)
WAITS_MS = (0, 1, 20)
NAMES = ("", "w", "b", "w0", "w1", "worker", "worker-0", "ps", "ps-0", "chief", "evaluator", "scheduler",
         "127.0.0.1:1", "start", "fc1.weight")
HUGE_CHARS = (70_000, 1_000_000)
MANY = (1_000, 3_000)


def is_repeated(field: FieldDescriptor) -> bool:
    flag = getattr(field, "is_repeated", None)
    return bool(flag) if flag is not None else field.label == _F.LABEL_REPEATED


def is_map(field: FieldDescriptor) -> bool:
    return (field.message_type is not None and is_repeated(field)
            and field.message_type.GetOptions().map_entry)


def int_range(field: FieldDescriptor) -> tuple[int, int]:
    """The values an integer field can hold (protobuf refuses any other on assignment)."""
    low, high, _ = INT_EXTREMES[field.cpp_type]
    return low, high


def in_range(field: FieldDescriptor, values: Sequence[int]) -> tuple[int, ...]:
    low, high = int_range(field)
    return tuple(v for v in values if low <= v <= high)


def ints(cpp_type: int) -> st.SearchStrategy[int]:
    low, high, extremes = INT_EXTREMES[cpp_type]
    return weighted((3, st.sampled_from(extremes)), (2, st.integers(max(low, -3), min(high, 16))),
                    (1, st.integers(low, high)))


def is_closed(enum_field: FieldDescriptor) -> bool:
    """A closed enum (proto2, or editions' CLOSED) refuses unknown numbers on assignment."""
    closed = getattr(enum_field.enum_type, "is_closed", None)
    return bool(closed) if closed is not None else enum_field.file.syntax == "proto2"


@st.composite
def weighted(draw: st.DrawFn, *choices: tuple[int, st.SearchStrategy[Any]]) -> Any:
    """One of `choices`, each (weight, strategy): keeps the expensive extremes rare but present."""
    at = draw(st.integers(0, sum(w for w, _ in choices) - 1))
    for w, strategy in choices:
        if at < w:
            return draw(strategy)
        at -= w
    raise AssertionError("unreachable")


def strings() -> st.SearchStrategy[str]:
    return weighted(
        (10, st.sampled_from(NAMES)),
        (10, st.text(max_size=24)),
        (3, st.sampled_from(("\u00e9t\u00e9", "\u6f22\u5b57", "\U0001f600" * 3, "a\x00b", "../../etc/passwd",
                             "%s%n", "\u202e" + "x" * 8))),
        (1, st.builds(lambda n, c: c * n, st.sampled_from(HUGE_CHARS), st.sampled_from("x\u00e9"))),
    )


def scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    """A value for one non-message field (one element, for a repeated one)."""
    name, cpp = field.name, field.cpp_type
    if field.type == _F.TYPE_ENUM:
        known = st.sampled_from([v.number for v in field.enum_type.values])
        if is_closed(field):
            return known
        return st.one_of(known, st.sampled_from((-1, 99, 2**31 - 1, -(2**31))))
    if name == "shape" and cpp in INT_EXTREMES:
        return st.sampled_from(in_range(field, SHAPE_DIMS))
    if name.endswith("timeout_ms") and cpp in INT_EXTREMES:
        return st.one_of(st.sampled_from(in_range(field, WAITS_MS)), st.just(int_range(field)[1]))
    if cpp in INT_EXTREMES:
        return ints(cpp)
    if cpp in (_F.CPPTYPE_DOUBLE, _F.CPPTYPE_FLOAT):
        width: Literal[32, 64] = 32 if cpp == _F.CPPTYPE_FLOAT else 64
        return st.one_of(st.sampled_from(ABSURD_FLOATS), st.floats(width=width))
    if cpp == _F.CPPTYPE_BOOL:
        return st.booleans()
    if field.type == _F.TYPE_BYTES:
        return st.one_of(st.binary(max_size=64), st.sampled_from((b"", b"\x00" * 48, b"\xff" * 4096)))
    return strings()


def _size(value: Any) -> int:
    if isinstance(value, Message):
        return value.ByteSize()
    return len(value) if isinstance(value, str | bytes) else 8


def _repeat(element: st.SearchStrategy[Any], depth: int) -> st.SearchStrategy[list[Any]]:
    """A few elements, or one element many times (duplicates a service must not multiply work for).

    Many copies only near the top and only of small elements: a request stays a few MiB at most.
    """
    few = st.lists(element, max_size=4)
    if depth > 1:
        return few
    return weighted((9, few), (1, st.builds(lambda x, n: [x] * (n if _size(x) <= 1024 else 2),
                                            element, st.sampled_from(MANY))))


def messages(descriptor: Descriptor, depth: int = 0, presence: float = 0.5) -> st.SearchStrategy[Message]:
    """Messages of `descriptor`'s type, each field set with probability `presence` (recursively)."""
    return _messages(descriptor, depth, round(presence * 8))


# Strategies are built once per (type, depth): building them on every draw costs more than drawing.
@functools.cache
def _messages(descriptor: Descriptor, depth: int, presence_in_8: int) -> st.SearchStrategy[Message]:
    cls = message_factory.GetMessageClass(descriptor)
    plain = [(f, _value(f, depth)) for f in descriptor.fields
             if f.containing_oneof is None and (f.message_type is None or depth < 4 or is_repeated(f))]
    oneofs = [(o.name, st.sampled_from([(f, _value(f, depth)) for f in o.fields]))
              for o in descriptor.oneofs]
    eighths = st.integers(0, 7)

    carries_payload = has_payload(descriptor)

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        message = cls()
        for field, value in plain:
            if draw(eighths) < presence_in_8:
                _assign(message, field, draw(value))
        for _, choice in oneofs:
            if draw(eighths) < presence_in_8:
                field, value = draw(choice)
                _assign(message, field, draw(value))
        if carries_payload and draw(st.booleans()):
            fit_payload(message)
        return message

    return build()


def has_payload(descriptor: Descriptor) -> bool:
    """A tensor-like message: an enum `dtype`, integer `shape` dims and `data` bytes."""
    fields = descriptor.fields_by_name
    return ("dtype" in fields and "shape" in fields and "data" in fields
            and fields["dtype"].type == _F.TYPE_ENUM and fields["shape"].cpp_type in INT_EXTREMES
            and fields["data"].type == _F.TYPE_BYTES)


def payload_bytes(message: Message) -> int | None:
    """Bytes a {dtype, shape, data} message's shape and dtype call for (None: not computable)."""
    dtype = message.DESCRIPTOR.fields_by_name["dtype"].enum_type.values_by_number.get(message.dtype)
    itemsize = ITEMSIZE.get(dtype.name.lower()) if dtype is not None else None
    if itemsize is None or any(d < 0 for d in message.shape):
        return None
    return math.prod(message.shape) * itemsize


def fit_payload(message: Message) -> None:
    """Give a tensor exactly the bytes its shape asks for, so checks past the size check are reached."""
    size = payload_bytes(message)
    if size is not None and size <= 4096:
        message.data = bytes(size)


def _assign(message: Message, field: FieldDescriptor, value: Any) -> None:
    """Set (extend, for repeated and map fields) `field` of `message` to `value`.

    Message values are copied in (CopyFrom, add()): protobuf refuses to assign a message object to a
    field, a map entry or a repeated element ("Message objects may not be assigned")."""
    if is_map(field):
        target = getattr(message, field.name)
        if field.message_type.fields_by_name["value"].message_type is not None:
            for key, item in value.items():
                target[key].CopyFrom(item)
        else:
            target.update(value)
    elif is_repeated(field):
        target = getattr(message, field.name)
        if field.message_type is not None:
            for item in value:
                target.add().CopyFrom(item)
        else:
            target.extend(value)
    elif field.message_type is not None:
        getattr(message, field.name).CopyFrom(value)
    else:
        setattr(message, field.name, value)


@functools.cache
def _value(field: FieldDescriptor, depth: int) -> st.SearchStrategy[Any]:
    """What one field is set to: a scalar, a message, or a list (a dict for a map field)."""
    if is_map(field):
        entry = field.message_type.fields_by_name
        return st.dictionaries(scalar(entry["key"]), _value(entry["value"], depth + 1), max_size=4)
    if field.message_type is not None:
        if depth >= 4:  # deep enough: an empty message (or none) still exercises the presence checks
            child: st.SearchStrategy[Any] = st.builds(message_factory.GetMessageClass(field.message_type))
        else:
            child = messages(field.message_type, depth + 1)
        return _repeat(child, depth) if is_repeated(field) else child
    if is_repeated(field) and field.name == "shape":
        # Tiny or absurd dims, and sometimes more dims than numpy allows (64).
        return weighted((9, st.lists(scalar(field), max_size=6)),
                        (1, st.lists(st.just(1), min_size=33, max_size=70)))
    if is_repeated(field):
        return _repeat(scalar(field), depth)
    return scalar(field)


@st.composite
def mutated(draw: st.DrawFn, valid: Sequence[Message]) -> Message:
    """One of the `valid` requests with one to three fields overwritten, extended or cleared."""
    base = draw(st.sampled_from(valid))
    message = type(base)()
    message.CopyFrom(base)
    donors = [v for v in valid if v is not base and v.DESCRIPTOR is base.DESCRIPTOR]
    for _ in range(draw(st.integers(1, 3))):
        if donors and draw(st.integers(0, 3)) == 0:
            _splice(draw, message, draw(st.sampled_from(donors)))
        else:
            _mutate_one(draw, message, depth=0)
    return message


def _splice(draw: st.DrawFn, message: Message, donor: Message) -> None:
    """One field of another valid request in place of this one's: each is valid, together maybe not."""
    fields = [f for f, _ in donor.ListFields()]
    if fields:
        field = draw(st.sampled_from(fields))
        message.ClearField(field.name)
        _assign(message, field, getattr(donor, field.name))


def _mutate_one(draw: st.DrawFn, message: Message, depth: int) -> None:
    fields = list(message.DESCRIPTOR.fields)
    if not fields:
        return
    field = draw(st.sampled_from(fields))
    set_message = (field.message_type is not None and not is_repeated(field)
                   and message.HasField(field.name))
    if set_message and draw(st.booleans()):
        _mutate_one(draw, getattr(message, field.name), depth + 1)  # one level down, keeping the rest
        return
    how = draw(st.sampled_from(("set", "clear", "append"))) if is_repeated(field) else draw(
        st.sampled_from(("set", "set", "clear")))
    if how == "clear":
        message.ClearField(field.name)
        return
    if how == "set" and is_repeated(field):
        message.ClearField(field.name)
    _assign(message, field, draw(_value(field, depth)))
    if has_payload(message.DESCRIPTOR) and draw(st.booleans()):
        fit_payload(message)


@st.composite
def raw_bytes(draw: st.DrawFn, valid: Sequence[Message]) -> bytes:
    """Bytes that are rarely a valid message: random, or a valid encoding with bytes flipped or cut."""
    if not valid or draw(st.booleans()):
        return draw(st.binary(max_size=256))
    data = bytearray(draw(st.sampled_from(valid)).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        kind = draw(st.sampled_from(("flip", "cut", "insert", "varint")))
        if kind == "flip":
            data[at] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:  # a varint that never ends, or a length that claims more than there is
            data[at:at] = b"\xff" * draw(st.integers(1, 11))
    return bytes(data)


def requests(descriptor: Descriptor, valid: Sequence[Message]) -> st.SearchStrategy[Message]:
    """Generated from scratch, or mutated from a valid request when there is one."""
    if not valid:
        return messages(descriptor)
    return st.one_of(messages(descriptor), mutated(valid))
