"""The strategies draw a valid message of every type: every RPC of today's protos, and every field type.

No service here: a strategy that cannot build its message (a value out of its field's range, a
message object assigned where protobuf wants CopyFrom) fails in milliseconds here, not after the
live fuzz tests' set-up. The synthetic message holds every protobuf field type, closed and open
enums, a message-valued map, a oneof and nested repeated messages: a field type pshard's protos
start using later is covered already.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator

import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import Descriptor
from google.protobuf.descriptor import FieldDescriptor as F
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import pshard.api.v1
from tests.fuzz.strategies import INT_EXTREMES, in_range, int_range, is_repeated, messages, mutated, raw_bytes

EXAMPLES = 15  # per message type: the live fuzz tests draw thousands more
QUIET = settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))


def _api_messages() -> Iterator[Descriptor]:
    """Every message type of pshard's wire (nested ones included, map entries excluded)."""
    def walk(descriptor: Descriptor) -> Iterator[Descriptor]:
        if not descriptor.GetOptions().map_entry:
            yield descriptor
        for nested in descriptor.nested_types:
            yield from walk(nested)

    for module in pkgutil.iter_modules(pshard.api.v1.__path__):
        if module.name.endswith("_pb2"):
            file = importlib.import_module(f"pshard.api.v1.{module.name}").DESCRIPTOR
            for descriptor in file.message_types_by_name.values():
                yield from walk(descriptor)


API = sorted(_api_messages(), key=lambda d: d.full_name)
RPC_INPUTS = {m.input_type.full_name for module in pkgutil.iter_modules(pshard.api.v1.__path__)
              if module.name.endswith("_pb2")
              for s in importlib.import_module(f"pshard.api.v1.{module.name}").DESCRIPTOR
              .services_by_name.values() for m in s.methods}


def _every_type() -> Descriptor:
    """A message with a field of every protobuf type (proto2: its enum is closed), built at run time."""
    file = descriptor_pb2.FileDescriptorProto(name="fuzz_every_type.proto", package="fuzzcheck",
                                              syntax="proto2")
    closed = file.enum_type.add(name="Closed")
    for number, name in enumerate(("CLOSED_A", "CLOSED_B")):
        closed.value.add(name=name, number=number)
    inner = file.message_type.add(name="Inner")
    inner.field.add(name="n", number=1, type=F.TYPE_SINT64, label=F.LABEL_OPTIONAL)
    inner.field.add(name="shape", number=2, type=F.TYPE_UINT64, label=F.LABEL_REPEATED)
    outer = file.message_type.add(name="Every")
    scalars = [F.TYPE_INT32, F.TYPE_INT64, F.TYPE_UINT32, F.TYPE_UINT64, F.TYPE_SINT32, F.TYPE_SINT64,
               F.TYPE_FIXED32, F.TYPE_FIXED64, F.TYPE_SFIXED32, F.TYPE_SFIXED64, F.TYPE_FLOAT, F.TYPE_DOUBLE,
               F.TYPE_BOOL, F.TYPE_STRING, F.TYPE_BYTES]
    number = 0
    for kind in scalars:
        for label in (F.LABEL_OPTIONAL, F.LABEL_REPEATED):
            number += 1
            outer.field.add(name=f"f{number}", number=number, type=kind, label=label)
    for label in (F.LABEL_OPTIONAL, F.LABEL_REPEATED):
        number += 1
        outer.field.add(name=f"e{number}", number=number, type=F.TYPE_ENUM, type_name=".fuzzcheck.Closed",
                        label=label)
        number += 1
        outer.field.add(name=f"m{number}", number=number, type=F.TYPE_MESSAGE, type_name=".fuzzcheck.Inner",
                        label=label)
    number += 1
    outer.field.add(name="shape", number=number, type=F.TYPE_UINT32, label=F.LABEL_REPEATED)
    number += 1
    outer.field.add(name="timeout_ms", number=number, type=F.TYPE_FIXED32, label=F.LABEL_OPTIONAL)
    outer.oneof_decl.add(name="body")
    for kind, type_name in ((F.TYPE_MESSAGE, ".fuzzcheck.Inner"), (F.TYPE_SINT32, ""), (F.TYPE_STRING, "")):
        number += 1
        field = outer.field.add(name=f"o{number}", number=number, type=kind, label=F.LABEL_OPTIONAL,
                                oneof_index=0)
        if type_name:
            field.type_name = type_name
    for key, value, type_name in ((F.TYPE_STRING, F.TYPE_MESSAGE, ".fuzzcheck.Inner"),
                                  (F.TYPE_SINT64, F.TYPE_FIXED32, ""), (F.TYPE_UINT32, F.TYPE_ENUM,
                                                                      ".fuzzcheck.Closed")):
        number += 1
        entry = outer.nested_type.add(name=f"Map{number}Entry")
        entry.options.map_entry = True
        entry.field.add(name="key", number=1, type=key, label=F.LABEL_OPTIONAL)
        entry_value = entry.field.add(name="value", number=2, type=value, label=F.LABEL_OPTIONAL)
        if type_name:
            entry_value.type_name = type_name
        outer.field.add(name=f"map{number}", number=number, type=F.TYPE_MESSAGE,
                        type_name=f".fuzzcheck.Every.Map{number}Entry", label=F.LABEL_REPEATED)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return pool.FindMessageTypeByName("fuzzcheck.Every")


def _roundtrip(message: Message) -> None:
    data = message.SerializeToString()
    again = type(message).FromString(data)
    assert again.SerializeToString(deterministic=True) == message.SerializeToString(deterministic=True)


def test_every_rpc_request_has_a_strategy():
    """The fuzz tests take their RPCs from the service descriptors: all of them are message types here."""
    assert RPC_INPUTS
    assert not RPC_INPUTS - {d.full_name for d in API}


@pytest.mark.parametrize("descriptor", API, ids=lambda d: d.full_name.rsplit(".", 1)[-1])
def test_every_api_message_is_drawn_generated_mutated_and_raw(descriptor):
    empty = message_factory.GetMessageClass(descriptor)()

    @QUIET
    @given(messages(descriptor), st.data())
    def draw(message: Message, data: st.DataObject) -> None:
        _roundtrip(message)
        _roundtrip(data.draw(mutated([empty, message])))
        assert isinstance(data.draw(raw_bytes([message])), bytes)

    draw()


def test_every_field_type_is_drawn_within_its_range():
    descriptor = _every_type()
    seen: dict[str, set[object]] = {}

    @settings(QUIET, max_examples=300)
    @given(messages(descriptor, presence=0.9), st.data())
    def draw(message: Message, data: st.DataObject) -> None:
        _roundtrip(message)
        _roundtrip(data.draw(mutated([message])))
        for field, value in message.ListFields():
            items = value if is_repeated(field) and not field.message_type else [value]
            if field.cpp_type in INT_EXTREMES:
                low, high = int_range(field)
                assert all(low <= v <= high for v in items), (field.name, items)
                seen.setdefault(field.name, set()).update(items)

    draw()
    # The edges of each integer type are drawn, not just small numbers.
    for field in descriptor.fields:
        if field.cpp_type in INT_EXTREMES and field.type != F.TYPE_ENUM and field.name not in (
                "shape", "timeout_ms"):
            low, high = int_range(field)
            drawn = seen.get(field.name, set())
            assert {low, high} & drawn, (field.name, sorted(drawn)[:8])
    assert in_range(descriptor.fields_by_name["shape"], (-1, 2**32 - 1, 2**32)) == (2**32 - 1,)
