"""pshard workers: the PSClient, the torch integration and the training CLI."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pshard.worker.client import PSClient

__all__ = ["PSClient"]


def __getattr__(name: str) -> Any:
    # The public client (numpy and grpc only, no torch), imported on first use: `python -m
    # pshard.worker` imports this package before its first line runs, and that line installs the
    # signal handlers that make a stop during start-up quiet.
    if name == "PSClient":
        from pshard.worker.client import PSClient

        return PSClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
