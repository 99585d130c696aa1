"""One error hierarchy for all of pshard.

Core modules raise these; `common.rpc.status` maps them to gRPC status codes in one
place and the client maps them back, so a caller catches the same class whether
the error happened locally or on a server. Messages carry the values involved:
``key 'fc1.weight': got shape (10, 5), store has (10, 4)``.

Messages quote bounded prefixes of what they refuse (`quote`), and every message is bounded whole
(`bounded`, applied by PSError itself): a status message travels as a gRPC header, and one that
echoed a 100 kB worker id or key went past gRPC's metadata limit, so the caller saw
RESOURCE_EXHAUSTED (which clients retry) instead of the refusal.

This module must not import grpc: pure cores use it.
"""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Mapping

# Characters of a caller's text an error message quotes before cutting it (its length is then given).
QUOTE_CHARS = 64
# UTF-8 bytes of a whole message: gRPC sends it percent-encoded (up to 3 bytes per byte) as a header,
# whose limit is 8 KiB; the head and the tail are kept, as they name the field and the values.
MESSAGE_BYTES = 2048
_TAIL_BYTES = 512


def quote(value: str, limit: int = QUOTE_CHARS) -> str:
    """`repr(value)`, of its first `limit` characters and its length when it is longer."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def bounded(message: str) -> str:
    """`message`, or its head and tail within MESSAGE_BYTES with how many characters were cut."""
    if len(message) * 4 <= MESSAGE_BYTES:  # short enough whatever its characters
        return message
    data = message.encode("utf-8", "backslashreplace")
    if len(data) <= MESSAGE_BYTES:
        return message
    head = data[:MESSAGE_BYTES - _TAIL_BYTES - 64].decode("utf-8", "ignore")
    tail = data[-_TAIL_BYTES:].decode("utf-8", "ignore")
    return f"{head} [... {len(message) - len(head) - len(tail)} of {len(message)} characters cut ...] {tail}"


Fact = str | int
_FACTS_BYTES = 4096  # a reply's facts, encoded: a few names and numbers, never a payload


class PSError(Exception):
    """Base class. `status` names the gRPC status code (a string keeps grpc out of core code).

    `facts`: what a caller may decide on (a table, a partition, a layout version), by name; they cross
    every transport beside the message (`facts_json`, `rebuild`), so no caller parses message text.
    """

    status = "INTERNAL"

    def __init__(self, message: object = "", *args: object, **facts: Fact) -> None:
        super().__init__(bounded(str(message)), *args)
        self.facts: dict[str, Fact] = dict(facts)


class InvalidArgumentError(PSError):
    status = "INVALID_ARGUMENT"


class EmptyRequestError(InvalidArgumentError):
    """A request that names no slices, no role, etc."""


class ShapeMismatchError(InvalidArgumentError):
    pass


class DTypeMismatchError(InvalidArgumentError):
    pass


class PayloadSizeError(InvalidArgumentError):
    """Byte length does not match dtype and shape, or a stream sent more/fewer bytes than announced."""


class UnknownKeyError(PSError):
    status = "NOT_FOUND"


class PartitionMovedError(UnknownKeyError):
    """Rows of a table partition that this server does not serve under the layout the request was routed
    with (a failover moved it, or the request predates one): the client re-routes with a newer layout."""

    def __init__(self, message: str = "", *, table: str = "", partition: int = -1, layout_version: int = 0,
                 **facts: Fact) -> None:
        super().__init__(message, table=table, partition=partition, layout_version=layout_version, **facts)


class SliceMovedError(UnknownKeyError):
    """A dense slice that this server no longer owns: a layout switch (a drain, a join) moved it away while
    the request waited for its copies to settle, or before it came. Never acknowledged here: the client
    re-routes with a newer layout and sends the step again (the new owner drops what it already has)."""

    def __init__(self, message: str = "", *, key: str = "", layout_version: int = 0, **facts: Fact) -> None:
        super().__init__(message, key=key, layout_version=layout_version, **facts)


class LayoutNotYetError(UnknownKeyError):
    """A request routed with a layout newer than this server has received: the client sends it again in a
    moment, once the scheduler's view has reached the server."""

    def __init__(self, message: str = "", *, table: str = "", routed_version: int = 0, known_version: int = 0,
                 **facts: Fact) -> None:
        super().__init__(message, table=table, routed_version=routed_version, known_version=known_version,
                         **facts)


class UnknownNodeError(PSError):
    status = "NOT_FOUND"


class NodeLeftError(UnknownNodeError):
    """A request from a node that left the cluster, or that an operator drained (`pshard drain`): a
    node may register again to rejoin; a drained server stops instead."""


class FutureClockError(PSError):
    """A push or pull stamped with a clock the server cannot have reached yet."""

    status = "OUT_OF_RANGE"


class StaleGenerationError(PSError):
    """Fencing: a request from an older incarnation of a node, or from a node not live in the view."""

    status = "FAILED_PRECONDITION"


class PartitionTakenError(StaleGenerationError):
    """A primary's replication batch with rows of a row partition that a move or a join gave the backup
    since: the primary applied them before it knew. Refused whole, so the primary never acknowledges them
    (the worker resends them to the new server); the primary forwards that partition's rows no more."""


class PullBaseLostError(PSError):
    """A compressed pull whose base (the worker's count of the slice's pulls it applied) is not the
    server's: a reply lost on the way, or a server that never served this worker the slice (restarted, a
    new primary). Nothing of the request was applied; the worker pulls the slice whole and goes on."""

    status = "FAILED_PRECONDITION"


class LayoutConflictError(PSError):
    """A proposed layout or declaration disagrees with the one already stored."""

    status = "FAILED_PRECONDITION"


class JobConflictError(LayoutConflictError):
    """A Declare of one job on servers that hold another job's parameters (a new run needs its own
    servers, or must say it resumes the other); the message names both job ids."""


class CheckpointError(PSError):
    """A global checkpoint cannot be written or read (torn, foreign, or not matching the model or the
    layout a request gives): the state it needs is not there, so FAILED_PRECONDITION, never INTERNAL."""

    status = "FAILED_PRECONDITION"


class CheckpointSpaceError(CheckpointError):
    """A checkpoint cannot be written for want of space (a full disk or quota): RESOURCE_EXHAUSTED."""

    status = "RESOURCE_EXHAUSTED"


def checkpoint_write_error(err: OSError, where: str | os.PathLike[str]) -> CheckpointError:
    """The error of a checkpoint write that failed with `err` under `where`: the file and the errno
    named (``ENOSPC``, ``EROFS``, ...), RESOURCE_EXHAUSTED for a full disk, else FAILED_PRECONDITION."""
    path = os.fsdecode(err.filename) if err.filename else os.fspath(where)
    code = errno.errorcode.get(err.errno or 0, f"errno {err.errno}")
    message = f"checkpoint: cannot write {path!r}: {code} ({err.strerror or err})"
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return CheckpointSpaceError(message)
    return CheckpointError(message)


class PullTimeoutError(PSError):
    """A wait (pull, barrier, checkpoint) passed its deadline; the message names what it waited for."""

    status = "DEADLINE_EXCEEDED"


class BarrierTimeoutError(PullTimeoutError):
    pass


class MessageTooLargeError(PSError):
    status = "RESOURCE_EXHAUSTED"


class QuotaExceededError(PSError):
    """A count or rate limit of a service is used up (members per job, registrations per minute)."""

    status = "RESOURCE_EXHAUSTED"


class OverloadedError(PSError):
    """A server's in-flight byte budget is used up; `retry_after_ms` says when to come back."""

    status = "RESOURCE_EXHAUSTED"

    def __init__(self, message: str = "", retry_after_ms: int | None = None, **facts: Fact) -> None:
        super().__init__(message, **facts)
        self.retry_after_ms = retry_after_ms


class ClusterConfigError(PSError):
    """Bad TF_CONFIG or flags. Entry points print it and exit non-zero."""

    status = "INVALID_ARGUMENT"


class UnavailableError(PSError):
    """A peer could not be reached within the retry budget."""

    status = "UNAVAILABLE"


class FencedError(UnavailableError):
    """Fencing by lease: a primary that may have been failed over (no heartbeat answered by the scheduler
    for most of its timeout) takes no write until the scheduler answers again. The caller re-routes by
    a newer layout, or sends again (a server drops what it already has). FAILED_PRECONDITION, as every
    fencing refusal, so no channel retries it blindly; its class, an UnavailableError, decides."""

    status = "FAILED_PRECONDITION"


class SlicesLostError(PSError):
    """Slices or row partitions of a parameter server the job lost: it died before any live backup held
    an in-sync copy of them, so the scheduler refused their failover, and they and every update they
    received are gone (docs/architecture.md, 9 Failures). No resend can help: the job must resume from
    a checkpoint or start again. Facts: `server` (the lost servers' addresses, comma-separated),
    `layout_version` (the newest layout in which one was lost). Not an UnavailableError: nothing retries
    it."""

    status = "DATA_LOSS"

    def __init__(self, message: str = "", *, server: str = "", layout_version: int = 0,
                 **facts: Fact) -> None:
        super().__init__(message, server=server, layout_version=layout_version, **facts)


class UnauthenticatedError(PSError):
    """A request to a secured service carried no valid credential (certificate or token)."""

    status = "UNAUTHENTICATED"


class PermissionDeniedError(PSError):
    """The caller's role or identity may not do this (a worker checkpointing, a node leaving for another)."""

    status = "PERMISSION_DENIED"


class ForkedClientError(PSError):
    """A client made in one process was used in a process forked from it (a DataLoader worker, ...):
    its channels and threads belong to the parent."""

    status = "FAILED_PRECONDITION"


class ScheduledFunctionError(PSError):
    """A function a ClusterCoordinator scheduled raised on its worker (pshard.coordinator). The message
    carries the worker's traceback; facts: `function`, `schedule_id`, `worker`, `error_type` (the
    exception's class on the worker, e.g. "builtins.ValueError")."""

    status = "ABORTED"


class NoWorkersError(UnavailableError):
    """A coordinator has scheduled functions waiting and no serving worker left to run them."""


class CancelledCallError(PSError):
    """A scheduled call that never ran: an earlier call failed and the coordinator dropped the rest."""

    status = "CANCELLED"


def error_classes() -> dict[str, type[PSError]]:
    """Every PSError subclass by name, so a client can re-raise the server's class."""
    found: dict[str, type[PSError]] = {}
    stack: list[type[PSError]] = [PSError]
    while stack:
        cls = stack.pop()
        found[cls.__name__] = cls
        stack.extend(cls.__subclasses__())
    return found


def facts_json(err: PSError) -> str:
    """`err.facts` as the wire carries them ("" when it has none): a JSON object of names to str or int."""
    return json.dumps(err.facts, sort_keys=True) if err.facts else ""


def _facts(raw: str) -> dict[str, Fact]:
    """Facts read back from a peer: only str and int values under str names, bounded; else none."""
    if not raw or len(raw) > _FACTS_BYTES:
        return {}
    try:
        decoded = json.loads(raw)
    except ValueError:
        return {}
    if not isinstance(decoded, Mapping):
        return {}
    return {str(k): v for k, v in decoded.items()
            if isinstance(v, str | int) and not isinstance(v, bool) and k.isidentifier()}


def rebuild(type_name: str, message: str, facts: str = "", fallback: type[PSError] | None = None) -> PSError:
    """The error a peer raised, from what crossed the wire: its class by name (else `fallback`, else
    PSError), its message and its facts. The one way every transport turns a refusal back into a type."""
    cls = error_classes().get(type_name) or fallback or PSError
    known = _facts(facts)
    try:
        return cls(message, **known)
    except TypeError:  # facts this version's class does not take (a newer peer): the type still decides
        return cls(message)
