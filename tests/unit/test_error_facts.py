"""Errors cross every transport as a type, a message and facts (docs/architecture.md §1): callers decide on
the type and read the facts, never the message's text."""

from __future__ import annotations

import json

import pytest
from pshard.common import errors
from pshard.common.errors import LayoutNotYetError, OverloadedError, PartitionMovedError, facts_json, rebuild


@pytest.mark.parametrize("err", [
    PartitionMovedError("moved", table="emb", partition=3, layout_version=7),
    LayoutNotYetError("not yet", table="emb", routed_version=8, known_version=7),
    errors.UnknownKeyError("slice moved", key="w/0", layout_version=4),
    errors.ShapeMismatchError("key 'w': got shape (2,), store has (3,)"),
], ids=lambda e: type(e).__name__)
def test_an_error_comes_back_as_its_class_with_its_message_and_facts(err: errors.PSError) -> None:
    back = rebuild(type(err).__name__, str(err), facts_json(err))

    assert type(back) is type(err)
    assert str(back) == str(err)
    assert back.facts == err.facts


def test_the_re_route_errors_are_unknown_keys_to_callers_that_predate_them() -> None:
    assert issubclass(PartitionMovedError, errors.UnknownKeyError)
    assert issubclass(LayoutNotYetError, errors.UnknownKeyError)
    assert PartitionMovedError.status == LayoutNotYetError.status == "NOT_FOUND"


@pytest.mark.parametrize("raw", ["", "not json", "[1, 2]", json.dumps({"x": "y" * 5000}),
                                 json.dumps({"partition": True, "a b": 1, "ok": [1]})])
def test_facts_a_peer_sends_that_are_not_names_to_str_or_int_are_dropped(raw: str) -> None:
    back = rebuild("PartitionMovedError", "m", raw)

    assert isinstance(back, PartitionMovedError)
    assert back.facts == {"table": "", "partition": -1, "layout_version": 0}


def test_facts_a_class_does_not_take_still_give_the_class() -> None:
    back = rebuild("OverloadedError", "busy", json.dumps({"unheard_of": 1}))

    assert isinstance(back, OverloadedError)


def test_an_unknown_class_name_falls_back() -> None:
    assert type(rebuild("NoSuchError", "m")) is errors.PSError
    assert type(rebuild("NoSuchError", "m", fallback=errors.UnavailableError)) is errors.UnavailableError
