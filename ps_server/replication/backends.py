"""How a batch of slice states reaches one backup: backends behind `Link` (docs/architecture.md, 9 Failures).

A backup's way is chosen once, when it becomes a backup (`link_to`), as a chain of backends that
each know how to lay a state out and how to make the call:

- `ShmBackend`: a backup on the same host maps shared-memory segments the primary copies the
  states into (ps_server/replication/shm.py), so the call carries only metadata; it goes over the
  next backend in the chain. When the directory is full or the backup cannot map the segments
  (another host, a server without shared memory) the chain drops it for good.
- `TcpBackend`: the states' bytes are the data of a frame on a raw TCP link to the backup's
  fast-path listener (ps_server/transport/replica_tcp.py), negotiated over the same channel as the
  Replicate calls; when no link is to be had, or one breaks under a call, that call goes to gRPC.
- `GrpcBackend`: a Replicate call with the bytes inline.

The backup replays a batch it may have applied already idempotently (states travel whole), so any
backend may resend what another sent. The sender (ps_server/replication/dense.py) sees only `Backend`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol, Self

import numpy as np
from pshard.common.errors import PSError
from pshard.common.types import SliceKey
from pshard.common.wire.fastwire import TransportBroken
from pshard.common.wire.shm import packed
from pshard.ps_server.core.policies import Slot
from pshard.ps_server.replication.records import state_to_proto
from pshard.ps_server.replication.shm import SegmentWriter

from pshard.api.v1 import parameter_server_pb2 as pb

log = logging.getLogger("pshard.ps.replication")

# One Replicate call carries records up to this many bytes (at least one record): a round trip costs
# milliseconds on a loaded host, so a big shard's step goes in a few calls; the servers' message
# limit (64 MiB by default) leaves room for a 4 MiB slice's state with Adam's two arrays on top.
GRPC_BATCH_BYTES = 32 * 2**20
# Through shared memory a call carries no bytes, but the copies come before it: smaller batches let
# the first slices of a step be acknowledged (and their pulls answered) while later ones are copied.
# Not smaller: each call costs a round of thread wake-ups on both servers, and on a busy 2-core host
# that CPU is the step's (4 MiB: 11 calls a step per server of the 2x2 bench, 16 MiB: 3; 135-142 ->
# 112-115 ms of server CPU per step, replicas 0 at 55-60). A batch only takes what is due meanwhile.
SHM_BATCH_BYTES = 16 * 2**20
# Over the raw TCP link (ps_server/transport/replica_tcp.py) the bytes follow the call, received into a
# region of the backup's session: batches well inside it.
TCP_BATCH_BYTES = 8 * 2**20

Send = Callable[[str, pb.ReplicateRequest], pb.ReplicateResponse]


class Link(Protocol):
    """One way to make a Replicate call to a backup: `arrays` are the records' bytes not in the message."""

    def call(self, request: pb.ReplicateRequest, arrays: Sequence[np.ndarray]) -> pb.ReplicateResponse: ...


class Links(Protocol):
    """The raw TCP links to the backups (ps_server/transport/replica_tcp.TcpLinks)."""

    region_bytes: int

    def take(self, address: str) -> Link | None: ...

    def give_back(self, address: str, link: Link) -> None: ...

    def broke(self, address: str, err: Exception, link: Link | None = None) -> None: ...

    def close(self, address: str | None = None) -> None: ...


class Backend(Link, Protocol):
    """A `Link` that also lays the states out its way; the sender's one handle on a backup's way."""

    batch_bytes: int  # a batch's bytes at most (at least one record)
    path: str  # how the bytes go, as the log says it
    segmented: bool  # states lie in segments the backup maps: a new backup process must not reuse them

    def prepare(self, slots: Sequence[Slot]) -> Backend:
        """The backend this batch of `slots` goes by: this one, or (for good) the one it falls back to."""
        ...

    def record(self, slot: Slot, arrays: list[np.ndarray]) -> pb.ReplicaRecord:
        """`slot`'s state under its lock, as this backend sends it (its bytes maybe appended to `arrays`)."""
        ...

    def acknowledged(self, keys: Iterable[SliceKey]) -> None:
        """The backup holds these states: what they occupied may be reused."""
        ...

    def refused(self) -> Backend:
        """The backup asked for states again (it could not take them this way): the backend from now on."""
        ...

    def reset(self) -> None:
        """The backup is a new process, or a call failed: nothing it held may be relied on."""
        ...

    def close(self) -> None:
        """It is no longer a backup."""
        ...


class _HoldsNothing:
    """What a backend that keeps no state between calls does: it never falls back by itself, holds
    nothing an acknowledgement frees, and has nothing to forget."""

    def prepare(self, slots: Sequence[Slot]) -> Self:
        return self

    def acknowledged(self, keys: Iterable[SliceKey]) -> None:
        pass

    def refused(self) -> Self:
        return self

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass


class GrpcBackend(_HoldsNothing):
    """Replicate calls with the states' bytes inline, over the server's channel to the backup."""

    batch_bytes = GRPC_BATCH_BYTES
    segmented = False
    path = "over gRPC"

    def __init__(self, address: str, send: Send) -> None:
        self._address = address
        self._send = send

    def record(self, slot: Slot, arrays: list[np.ndarray]) -> pb.ReplicaRecord:
        return state_to_proto(slot, None)  # encoding is the one copy

    def call(self, request: pb.ReplicateRequest, arrays: Sequence[np.ndarray]) -> pb.ReplicateResponse:
        if arrays:  # laid out for a raw link that could not take them
            fill_inline(request, arrays)
        return self._send(self._address, request)


class TcpBackend(_HoldsNothing):
    """The states' bytes as a raw TCP link's frame data; a call the link cannot carry goes to `then`."""

    batch_bytes = TCP_BATCH_BYTES
    segmented = False
    path = "over the raw TCP link (gRPC where it breaks)"

    def __init__(self, address: str, links: Links, then: Backend) -> None:
        self._address = address
        self._links = links
        self._then = then

    def record(self, slot: Slot, arrays: list[np.ndarray]) -> pb.ReplicaRecord:
        return state_to_proto(slot, None, arrays)

    def call(self, request: pb.ReplicateRequest, arrays: Sequence[np.ndarray]) -> pb.ReplicateResponse:
        reply = over_link(self._links, self._address, request, arrays)
        return reply if reply is not None else self._then.call(request, arrays)

    def close(self) -> None:
        self._links.close(self._address)
        self._then.close()


class ShmBackend:
    """States copied into shared-memory segments the backup maps; the call, metadata only, goes by `then`."""

    batch_bytes = SHM_BATCH_BYTES
    segmented = True
    path = "through shared memory"

    def __init__(self, address: str, own: str, writer: SegmentWriter, then: Backend) -> None:
        self._address = address
        self._own = own
        self._writer = writer  # the sender's alone
        self._then = then

    def prepare(self, slots: Sequence[Slot]) -> Backend:
        try:
            self._writer.reserve(slots)
        except OSError as e:  # the directory is full (a container's small /dev/shm): inline from now on
            log.warning("replication: no room for %s's segments for %s in shared memory (%s); "
                        "replicating %s", self._own, self._address, e, self._then.path)
            self._writer.close()
            return self._then.prepare(slots)
        return self

    def record(self, slot: Slot, arrays: list[np.ndarray]) -> pb.ReplicaRecord:
        return state_to_proto(slot, self._writer)

    def call(self, request: pb.ReplicateRequest, arrays: Sequence[np.ndarray]) -> pb.ReplicateResponse:
        request.segments.extend(self._writer.names)
        return self._then.call(request, arrays)

    def acknowledged(self, keys: Iterable[SliceKey]) -> None:
        self._writer.acknowledged(keys)

    def refused(self) -> Backend:
        # It cannot map our segments (another host): bytes inline from now on.
        log.warning("replication: backup %s cannot map %s's shared memory; replicating %s",
                    self._address, self._own, self._then.path)
        self._writer.close()
        return self._then

    def reset(self) -> None:
        self._writer.reset()  # the backup may hold either slot: later states go elsewhere

    def close(self) -> None:
        self._writer.close()
        self._then.close()


def link_to(address: str, own: str, send: Send, links: Links | None = None,
            shm_dir: str | None = None) -> Backend:
    """The way to the backup at `address`: through shared memory in `shm_dir` when given, over the raw
    TCP `links` when given, and over gRPC (`send`) in the end; each falls back to the next."""
    way: Backend = GrpcBackend(address, send)
    if links is not None:
        way = TcpBackend(address, links, way)
    if shm_dir is not None:
        way = ShmBackend(address, own, SegmentWriter(shm_dir), way)
    return way


def over_link(links: Links, address: str, request: pb.ReplicateRequest, arrays: Sequence[np.ndarray]
              ) -> pb.ReplicateResponse | None:
    """The backup's answer to a batch sent over a raw TCP link to it; None when no link is to be had
    (down, refused, the arrays exceed its region) or it broke under the call: the caller then sends
    the batch over gRPC, and the backup's replay of a batch it may have applied already is idempotent
    (dense states and table rows travel whole). The backup's own refusal (a PSError) is raised."""
    fits = packed([a.nbytes for a in arrays])[1] <= links.region_bytes  # as the backup lays them out
    link = links.take(address) if fits else None
    if link is None:
        return None
    try:
        reply = link.call(request, arrays)
    except TransportBroken as err:
        links.broke(address, err, link)
        return None
    except PSError:  # the backup's answer (the link is fine)
        links.give_back(address, link)
        raise
    except Exception as err:
        links.broke(address, err, link)
        raise
    links.give_back(address, link)
    return reply


def fill_inline(request: pb.ReplicateRequest, arrays: Sequence[np.ndarray]) -> None:
    """Put the raw link's `arrays` into `request`'s records (their order: `state_to_proto`), for gRPC."""
    left = iter(arrays)
    for msg in request.records:
        if msg.segment or not msg.state:
            continue
        for t in [msg.value, *(msg.opt_arrays[n] for n in sorted(msg.opt_arrays))]:
            t.data = next(left).tobytes()
