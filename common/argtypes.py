"""argparse value types shared by the entry points, so every flag of a kind fails the same way.

Every numeric flag of every entry point takes one of these: a value out of its range is a usage
error (one line, exit status 2) before anything starts, never a traceback at the first use (a
``--max-message-mb 100000`` overflowed gRPC's int32 channel argument) nor a silent nonsense (a
negative interval or replica count was accepted). Each range is stated in the refusal.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

# Upper bound of a count or a number of milliseconds: an int32, what gRPC and most C APIs take.
MAX_INT = 2**31 - 1
# Upper bound of a number of seconds (about 31 years): asyncio's timers and time.monotonic() + s stay exact.
MAX_SECONDS = 1e9


def int_range(low: int, high: int = MAX_INT) -> Callable[[str], int]:
    """A whole number in low..high (digits only, an optional leading minus)."""
    def parse(text: str) -> int:
        digits = text[1:] if text.startswith("-") else text
        value = int(text) if digits.isascii() and digits.isdigit() and len(digits) <= 30 else None
        if value is None or not low <= value <= high:
            raise argparse.ArgumentTypeError(f"got {text[:40]!r}, expected a whole number in {low}..{high}")
        return value

    parse.__name__ = f"int in {low}..{high}"
    return parse


def float_range(low: float, high: float = MAX_SECONDS, *, above_low: bool = False) -> Callable[[str], float]:
    """A finite number in [low, high] (in (low, high] with `above_low`); NaN and inf are refused."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and (value > low if above_low else value >= low) and value <= high):
            bound = f"> {low:g}" if above_low else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"got {text[:40]!r}, expected a number {bound} and <= {high:g}")
        return value

    parse.__name__ = f"number in {'(' if above_low else '['}{low:g}, {high:g}]"
    return parse


# Backups per slice: each on a server of its own, and a layout has at most 256 servers (the
# scheduler's MembershipLimits.max_layout_servers).
MAX_REPLICAS = 255

_positive_int = int_range(1)
_replicas = int_range(0, MAX_REPLICAS)
_non_negative_int = int_range(0)
_positive_float = float_range(0.0, above_low=True)
_non_negative_float = float_range(0.0)
_load_ratio = float_range(1.0, 1e6)


def positive_int(text: str) -> int:
    """A whole number in 1..MAX_INT (milliseconds, counts)."""
    return _positive_int(text)


def non_negative_int(text: str) -> int:
    """A whole number in 0..MAX_INT (counts where 0 means none or off)."""
    return _non_negative_int(text)


def positive_float(text: str) -> float:
    """A finite number in (0, MAX_SECONDS] (seconds, usually; rates)."""
    return _positive_float(text)


def non_negative_float(text: str) -> float:
    """A finite number in [0, MAX_SECONDS] (seconds where 0 means off; decays)."""
    return _non_negative_float(text)


def load_ratio(text: str) -> float:
    """A finite number >= 1 (times the mean load: a rebalance threshold)."""
    return _load_ratio(text)


def replicas(text: str) -> int:
    """Backups per slice, 0..MAX_REPLICAS (whether the job has that many servers is checked later)."""
    return _replicas(text)


def listen_address(text: str) -> str:
    """``HOST:PORT`` to listen on, port 0..65535 (0: any free port); ``[::]:7000`` for IPv6."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit() and int(port) <= 65535):
        raise argparse.ArgumentTypeError(f"got {text!r}, expected HOST:PORT with a port in 0..65535 "
                                         "(0 picks a free port)")
    return text
