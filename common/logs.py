"""Logging set-up shared by every entry point: one format, one `--log-level` flag."""

from __future__ import annotations

import argparse
import logging
import sys

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LOG_LEVEL = "INFO"
_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def add_log_level_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default=DEFAULT_LOG_LEVEL, type=str.upper, choices=LOG_LEVELS,
                        help=f"logging level on stderr (default {DEFAULT_LOG_LEVEL})")


def configure_logging(level: str = DEFAULT_LOG_LEVEL) -> None:
    """Log to stderr (stdout is for results: the worker's final line, `pshard status --json`)."""
    logging.basicConfig(level=level.upper(), stream=sys.stderr, format=_FORMAT, force=True)
