"""The scheduler's defaults, apart from the service so that its command line (`pshard scheduler --help`,
`pshard launch`) reads them without importing grpc."""

from __future__ import annotations

DEFAULT_HEARTBEAT_INTERVAL_S = 1.0
DEFAULT_HEARTBEAT_TIMEOUT_S = 5.0
