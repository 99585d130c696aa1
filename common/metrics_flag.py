"""``--metrics-port``, the flag every service takes (its metrics: pshard.common.metrics).

Apart from the metrics themselves so that a command's parser loads no prometheus_client: its --help and
usage errors come before that import.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping


def metrics_port(text: str) -> int:
    if not (text.isascii() and text.isdigit() and int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"got {text!r}, expected a port in 0..65535 (0 picks a free port)")
    return int(text)


METRICS_PORT_ENV = "PSHARD_METRICS_PORT"


def add_metrics_argument(parser: argparse._ActionsContainer, host: str = "the --bind host",
                         environ: Mapping[str, str] | None = None) -> None:
    """--metrics-port, defaulting to $PSHARD_METRICS_PORT: one setting for every container of a job."""
    env = os.environ if environ is None else environ
    parser.add_argument(
        "--metrics-port",
        metavar="PORT",
        type=metrics_port,
        default=env.get(METRICS_PORT_ENV) or None,  # argparse runs a string default through `type`
        help=f"serve Prometheus metrics at http://HOST:PORT/metrics, HOST being {host} "
        f"(0 picks a free port, printed at start; default: ${METRICS_PORT_ENV}, else no metrics)",
    )
