"""pshard workers: the PSClient, the torch integration and the training CLI."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pshard.client.ps_client import PSClient
    from pshard.worker.sampler import ShardSampler
    from pshard.worker.session import ClusterSession
    from pshard.worker.torch_api import PSTrainer

__all__ = ["ClusterSession", "PSClient", "PSTrainer", "ShardSampler"]
_PUBLIC = {"PSClient": "pshard.client.ps_client", "PSTrainer": "pshard.worker.torch_api",
           "ShardSampler": "pshard.worker.sampler", "ClusterSession": "pshard.worker.session"}


def __getattr__(name: str) -> Any:
    # The public names, imported on first use (PSClient needs numpy and grpc only, no torch): `python -m
    # pshard.worker` imports this package before its first line runs, and that line installs the
    # signal handlers that make a stop during start-up quiet.
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
