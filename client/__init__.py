"""pshard.client: what users import to talk to parameter servers, from any training code.

`PSClient` (ps_client.py) talks to every server of a job: declare, push, pull, wait; `TableClient`
(tables.py) does the same for sparse tables; both are handed one ServerConnections (connections.py:
channels, fast-path sessions, the thread pool, the routing layout); fast_session.py is the worker's
side of the fast paths (same-host shared memory, raw TCP). numpy and grpc only: no torch, no server, no
scheduler service (tests/unit/test_layers.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pshard.client.ps_client import PSClient
    from pshard.client.tables import TableClient

__all__ = ["PSClient", "TableClient"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so that importing one module of the package (fast_session, say) does not
    # load them all.
    if name == "PSClient":
        from pshard.client.ps_client import PSClient

        return PSClient
    if name == "TableClient":
        from pshard.client.tables import TableClient

        return TableClient
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
