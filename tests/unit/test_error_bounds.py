"""Error messages quote bounded prefixes of what they refuse, and every PSError's message is bounded
whole: a status message is a gRPC header, and an unbounded one turned refusals into RESOURCE_EXHAUSTED."""

from __future__ import annotations

import pytest
from pshard.common.errors import (
    MESSAGE_BYTES,
    InvalidArgumentError,
    PSError,
    StaleGenerationError,
    bounded,
    error_classes,
    quote,
)


def test_quote_gives_short_text_whole_and_a_prefix_of_long_text_with_its_length() -> None:
    assert quote("worker-1") == "'worker-1'"
    assert quote("x" * 100_000) == f"{'x' * 64!r}... (100000 characters)"
    assert quote("ab", limit=1) == "'a'... (2 characters)"


@pytest.mark.parametrize("char", ["x", "é", "\U0001f600", "\x00"])
def test_a_message_echoing_100_kB_keeps_its_head_and_tail_within_the_bound(char: str) -> None:
    message = f"push of key {char * 100_000!r}: got shape (3,), store has (4,)"
    err = InvalidArgumentError(message)
    text = str(err)
    assert len(text.encode("utf-8", "backslashreplace")) <= MESSAGE_BYTES
    assert text.startswith("push of key ") and text.endswith("got shape (3,), store has (4,)")
    assert f"of {len(message)} characters cut" in text


def test_every_error_class_is_bounded_and_short_messages_are_unchanged() -> None:
    for cls in error_classes().values():
        if cls.__module__ != PSError.__module__:  # others (elsewhere) take arguments of their own
            continue
        assert len(str(cls("y" * 50_000)).encode()) <= MESSAGE_BYTES
    assert str(StaleGenerationError("node 'w0': gone")) == "node 'w0': gone" == bounded("node 'w0': gone")
    assert str(PSError()) == ""
