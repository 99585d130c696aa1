"""The scheduler's defaults, apart from the service so that its command line (`pshard scheduler --help`,
`pshard launch`) reads them without importing grpc; and its automatic rebalance policy, parsed once from
the flags."""

from __future__ import annotations

from pshard.common.cluster.loads import WINDOW_S
from pshard.scheduler.auto_rebalance import DEFAULT_COOLDOWN_S, RebalancePolicy

DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0
DEFAULT_LOAD_WINDOW_S = WINDOW_S
DEFAULT_REBALANCE_COOLDOWN_S = DEFAULT_COOLDOWN_S


def rebalance_policy(threshold: float | None, cooldown_s: float | None,
                     window_s: float = DEFAULT_LOAD_WINDOW_S) -> RebalancePolicy | None:
    """`--rebalance-auto THRESHOLD`, `--rebalance-cooldown SECONDS` and `--load-window-s` as the policy; None
    (off) without a threshold."""
    if threshold is None:
        return None
    cooldown = DEFAULT_REBALANCE_COOLDOWN_S if cooldown_s is None else cooldown_s
    return RebalancePolicy(threshold, cooldown_s=cooldown, window_s=window_s)
