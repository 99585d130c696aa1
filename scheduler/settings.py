"""The scheduler's defaults, apart from the service so that its command line (`pshard scheduler --help`,
`pshard launch`) reads them without importing grpc, or numpy: plain numbers, no imports."""

from __future__ import annotations

DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0
# Servers' loads are rates over about this much of their reports (pshard.common.cluster.loads.WINDOW_S).
DEFAULT_LOAD_WINDOW_S = 10.0
# The automatic rebalance (scheduler/auto_rebalance.py): off unless given a threshold; between its moves.
DEFAULT_REBALANCE_COOLDOWN_S = 60.0
