"""argparse value types shared by the entry points, so every flag of a kind fails the same way."""

from __future__ import annotations

import argparse


def positive_float(text: str) -> float:
    """A number > 0 (seconds, usually); NaN and inf-like nonsense are refused with the text given."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"got {text!r}, expected a number > 0")
    return value


def positive_int(text: str) -> int:
    """A whole number > 0 (milliseconds, counts)."""
    if not (text.isascii() and text.isdigit() and int(text) > 0):
        raise argparse.ArgumentTypeError(f"got {text!r}, expected a whole number > 0")
    return int(text)


def listen_address(text: str) -> str:
    """``HOST:PORT`` to listen on, port 0..65535 (0: any free port); ``[::]:7000`` for IPv6."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not (port.isascii() and port.isdigit() and int(port) <= 65535):
        raise argparse.ArgumentTypeError(f"got {text!r}, expected HOST:PORT with a port in 0..65535 "
                                         "(0 picks a free port)")
    return text
