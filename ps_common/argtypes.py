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
