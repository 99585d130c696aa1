"""One error hierarchy for all of pshard.

Core modules raise these; `ps_common.rpc_status` maps them to gRPC status codes in one
place and the client maps them back, so a caller catches the same class whether
the error happened locally or on a server. Messages carry the values involved:
``key 'fc1.weight': got shape (10, 5), store has (10, 4)``.

This module must not import grpc: pure cores use it.
"""

from __future__ import annotations


class PSError(Exception):
    """Base class. `status` names the gRPC status code (a string keeps grpc out of core code)."""

    status = "INTERNAL"


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


class UnknownNodeError(PSError):
    status = "NOT_FOUND"


class FutureClockError(PSError):
    """A push or pull stamped with a clock the server cannot have reached yet."""

    status = "OUT_OF_RANGE"


class StaleGenerationError(PSError):
    """Fencing: a request from an older incarnation of a node, or from a node not live in the view."""

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

    def __init__(self, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class ClusterConfigError(PSError):
    """Bad TF_CONFIG or flags. Entry points print it and exit non-zero."""

    status = "INVALID_ARGUMENT"


class UnavailableError(PSError):
    """A peer could not be reached within the retry budget."""

    status = "UNAVAILABLE"


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


def error_classes() -> dict[str, type[PSError]]:
    """Every PSError subclass by name, so a client can re-raise the server's class."""
    found: dict[str, type[PSError]] = {}
    stack: list[type[PSError]] = [PSError]
    while stack:
        cls = stack.pop()
        found[cls.__name__] = cls
        stack.extend(cls.__subclasses__())
    return found
