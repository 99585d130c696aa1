"""The one seam between the request handlers and replication (docs/architecture.md, 9 Failures).

The dense handlers (ps_server/handlers/dense.py) see a server's slices' replication only as a
`SliceReplication`, the table handlers (ps_server/handlers/tables.py) its rows' only as a
`RowReplication`. A job started without `--replicas` gets `NO_SLICE_REPLICATION` and
`NO_ROW_REPLICATION`, which acknowledge at once and refuse nothing: the handlers run one code path
either way. With replicas, the primary's `Replicator` (dense.py) and `TableReplication` (tables.py)
are the implementations; how their batches reach a backup is behind `Link` (backends.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

import numpy as np
from pshard.common.errors import InvalidArgumentError
from pshard.common.types import SliceKey

if TYPE_CHECKING:
    from pshard.ps_server.core.store import ShardStore
    from pshard.ps_server.tables.table import SparseTable

    from pshard.api.v1 import parameter_server_pb2 as pb


class SliceReplication(Protocol):
    """What the dense handlers ask of the replication of this server's slices (the primary side)."""

    def attach(self, store: ShardStore) -> None:
        """Replicate `store`'s slices from now on (the server's store, once configured)."""

    def seed(self, keys: Iterable[SliceKey]) -> None:
        """Make each of `keys` (new, or promoted after a failover) due to every backup lacking it."""

    async def settle(self, keys: Iterable[SliceKey] | None, deadline: float) -> None:
        """Return once every step so far of `keys` (None: of every slice) is on every backup."""

    async def hand_off(self) -> None:
        """Between the slices of one request: let the senders start copying the slice just applied."""

    def lag(self) -> int:
        """Slices whose newest step the slowest backup has yet to acknowledge."""


class RowReplication(Protocol):
    """What the table handlers ask of the replication of this server's table rows (both sides)."""

    def placed(self, name: str, what: str) -> None:
        """Refuse a request while the layout this server knows does not list it (a joiner before its
        switch, which a worker knowing the switch already reaches): LayoutNotYetError, sent again soon."""

    def check(self, table: SparseTable, ids: np.ndarray, what: str) -> None:
        """Refuse ids of partitions this server does not serve (PartitionMovedError)."""

    def fresh(self, name: str, ids: np.ndarray, worker: str, push_id: int) -> np.ndarray | None:
        """Which of a push's `ids` to apply: None, all; else a mask without the ones applied already."""

    def kept(self, table: SparseTable, ids: np.ndarray, what: str) -> None:
        """After the backups acknowledged a push: refuse it (PartitionMovedError) when a move took one of
        its ids' partitions from this server meanwhile (its new server may lack the rows)."""

    def served(self) -> frozenset[int] | None:
        """The row partitions this server serves (None: it knows no layout, nothing is checked)."""

    def routed(self, name: str, version: int) -> None:
        """Refuse a sync push routed with a layout other than the one this server serves by."""

    def partitions(self, ids: np.ndarray) -> int | np.ndarray:
        """The row partition of each of `ids` (one number when this server serves one)."""

    def partition_count(self) -> int:
        """How many row partitions `partitions` numbers ids into (0: none, every id is -1's)."""

    def changed(self, name: str, ids: np.ndarray, worker: str = "", push_id: int = 0,
                clocked: bool = False) -> None:
        """Rows of `name` changed: every backup gets them (and the push's idempotence key)."""

    async def settle(self, deadline: float) -> None:
        """Return once every backup holds every change marked so far."""

    def apply(self, request: pb.ReplicateRequest, frame: Sequence[np.ndarray] | None = None) -> bool:
        """Backup side: hold a primary's batch of rows; True when it must resend the columns inline."""


class _NoSliceReplication:
    """A job without replicas: every step is acknowledged as soon as it is applied."""

    def attach(self, store: ShardStore) -> None:
        pass

    def seed(self, keys: Iterable[SliceKey]) -> None:
        pass

    async def settle(self, keys: Iterable[SliceKey] | None, deadline: float) -> None:
        pass

    async def hand_off(self) -> None:
        pass  # no sender to yield to: the next slice applies at once

    def lag(self) -> int:
        return 0


class _NoRowReplication:
    """A job without replicas: this server serves every id it is sent, and holds no one's rows."""

    def placed(self, name: str, what: str) -> None:
        pass

    def check(self, table: SparseTable, ids: np.ndarray, what: str) -> None:
        pass

    def fresh(self, name: str, ids: np.ndarray, worker: str, push_id: int) -> np.ndarray | None:
        return None  # no push is resent to an heir: each is applied once

    def kept(self, table: SparseTable, ids: np.ndarray, what: str) -> None:
        pass

    def served(self) -> frozenset[int] | None:
        return None

    def routed(self, name: str, version: int) -> None:
        pass

    def partitions(self, ids: np.ndarray) -> int | np.ndarray:
        return -1  # ps_server.tables.sync.OWN: not partitioned

    def partition_count(self) -> int:
        return 0

    def changed(self, name: str, ids: np.ndarray, worker: str = "", push_id: int = 0,
                clocked: bool = False) -> None:
        pass

    async def settle(self, deadline: float) -> None:
        pass

    def apply(self, request: pb.ReplicateRequest, frame: Sequence[np.ndarray] | None = None) -> bool:
        raise InvalidArgumentError("replicate: this server replicates no table rows (no --replicas)")


NO_SLICE_REPLICATION: SliceReplication = _NoSliceReplication()
NO_ROW_REPLICATION: RowReplication = _NoRowReplication()
