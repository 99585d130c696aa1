"""Coordinator-driven training (docs/guide/coordinator.md): TensorFlow's ClusterCoordinator, in pshard.

The chief's `ClusterCoordinator` schedules named functions on serving workers (`pshard worker --serve`);
inside a function, `current()` is the worker's context (its PSClient, its iterators). Each call's pushes
carry its schedule id, so a call run again after its worker died counts once on the servers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pshard.coordinator.closures import RemoteValue
    from pshard.coordinator.context import RemoteTable, RemoteVariable, WorkerContext, current
    from pshard.coordinator.coordinator import ClusterCoordinator, PerWorkerDataset, Table, Variable

__all__ = ["ClusterCoordinator", "PerWorkerDataset", "RemoteTable", "RemoteValue", "RemoteVariable", "Table",
           "Variable", "WorkerContext", "current"]
_PUBLIC = {"ClusterCoordinator": "pshard.coordinator.coordinator",
           "PerWorkerDataset": "pshard.coordinator.coordinator",
           "Variable": "pshard.coordinator.coordinator",
           "Table": "pshard.coordinator.coordinator",
           "RemoteTable": "pshard.coordinator.context",
           "RemoteValue": "pshard.coordinator.closures",
           "RemoteVariable": "pshard.coordinator.context",
           "WorkerContext": "pshard.coordinator.context",
           "current": "pshard.coordinator.context"}


def __getattr__(name: str) -> Any:
    # Imported on first use: a worker importing pshard.coordinator.context needs no coordinator machinery.
    if name in _PUBLIC:
        import importlib

        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
