"""Who may call what: the method→roles table and the one server interceptor that enforces it.

`Authorizer` runs in front of every handler of a secured server (scheduler, parameter server,
the scheduler a chief hosts). It names the caller from the peer certificate's
``spiffe://pshard/<role>/<id>`` (`pshard.common.security.identity`) or, failing that, from a token in the
``authorization: Bearer`` metadata, then:

- no credential (or an unknown token, or a certificate naming no role, or one the CRL revokes)
  → UNAUTHENTICATED;
- a role the method does not allow → PERMISSION_DENIED;

both before the handler runs, so nothing in the store changes, and both are counted in
`AuthRefusals`. Handlers read the caller with `caller()` for the checks only they can make
(registering under one's own id, leaving only for oneself, who sets the job configuration).

Health checks stay open: probes (Docker, Kubernetes) carry no credential. docs/architecture.md,
13 Security, has the table in prose.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from pshard.common.errors import PermissionDeniedError
from pshard.common.security.identity import Identity, TokenTable, identity_from_pem
from pshard.common.security.revocation import RevocationList

log = logging.getLogger("pshard.auth")

_SCHED = "/pshard.api.v1.SchedulerService/"
_PS = "/pshard.api.v1.ParameterServerService/"
_SPARSE = "/pshard.api.v1.SparseTablesService/"
OPEN_PREFIXES = ("/grpc.health.v1.Health/",)

NODES = frozenset({"ps", "chief", "worker", "evaluator", "scheduler", "admin"})
TRAINERS = frozenset({"chief", "worker"})
READERS = TRAINERS | {"evaluator", "admin"}
# Checkpoint, export: the chief or an admin only (issue 11). The scheduler coordinates no checkpoint
# itself and gets no file writes on the servers.
OPERATORS = frozenset({"chief", "admin"})
# Roles that see worker ids in GetStats (workers need the quorum to wait for each other).
SEES_WORKER_IDS = frozenset({"chief", "worker", "ps", "scheduler", "admin"})
# Roles that may set a job's configuration with the first Declare. worker-0 plays the chief in
# a cluster without one (docs/architecture.md, 2 Cluster configuration): see `may_configure`.
CONFIGURERS = frozenset({"chief", "admin"})

# The one table: method → roles allowed to call it. A method missing here is refused to all but admin.
ALLOWED: dict[str, frozenset[str]] = {
    _SCHED + "Register": NODES - {"admin", "scheduler"},
    _SCHED + "Heartbeat": NODES - {"admin", "scheduler"},
    _SCHED + "Leave": NODES - {"scheduler"},
    _SCHED + "Watch": NODES,
    _SCHED + "Barrier": NODES - {"scheduler"},
    # ps: only to give the layout back to a restarted scheduler (scheduler.servicer checks the rest).
    _SCHED + "ProposeLayout": TRAINERS | {"admin", "ps"},
    _SCHED + "GetLayout": NODES,
    _PS + "Declare": TRAINERS | {"admin"},
    _PS + "Push": TRAINERS,
    _PS + "PushPull": TRAINERS,
    _PS + "Exchange": TRAINERS | {"evaluator"},  # an evaluator's Exchange pulls; fencing refuses its pushes
    _PS + "Pull": READERS,
    _PS + "OpenTransport": TRAINERS | {"evaluator", "ps"},  # ps: its replication link (replica_tcp)
    _PS + "GetStats": NODES,
    _PS + "Checkpoint": OPERATORS,
    _PS + "SaveCheckpointPart": OPERATORS,
    # Every trainer asks before its Declare (worker.checkpoint_coordinator.restore); a configured server
    # ignores it,
    # and the directory must lie in the server's --global-checkpoint-dir (ps_server.checkpoints.guard).
    _PS + "RestoreCheckpoint": OPERATORS | TRAINERS,
    _PS + "Replicate": frozenset({"ps"}),  # a primary's steps to its backups
    _SPARSE + "DeclareTable": TRAINERS | {"admin"},
    _SPARSE + "PullRows": READERS,
    _SPARSE + "PushRows": TRAINERS,
    _SPARSE + "PushPullRows": TRAINERS,
    _SPARSE + "OpenTableStream": TRAINERS | {"evaluator"},
    _SPARSE + "ExportTable": OPERATORS,
    _SPARSE + "CheckpointTables": OPERATORS,
    _SPARSE + "GetTableStats": NODES,
    # A serving worker runs what its coordinator, the chief, schedules (pshard.coordinator).
    "/pshard.api.v1.WorkerService/Run": frozenset({"chief", "admin"}),
    "/pshard.api.v1.WorkerService/Serve": frozenset({"chief", "admin"}),  # Run's calls, on one stream
}

_caller: contextvars.ContextVar[Identity | None] = contextvars.ContextVar("pshard_caller", default=None)
# The refusal counter of the server handling the call and the call's method, so handlers' own refusals
# are counted too, under the same method label as the interceptor's.
_counter: contextvars.ContextVar[tuple[AuthRefusals, str] | None] = contextvars.ContextVar(  # type: ignore[name-defined]
    "pshard_refusals", default=None)


def caller() -> Identity | None:
    """The authenticated caller of the RPC being handled; None when the server runs without security."""
    return _caller.get()


def allowed(method: str, role: str) -> bool:
    if method.startswith(OPEN_PREFIXES):
        return True
    return role in ALLOWED.get(method, frozenset({"admin"}))


def may_configure(who: Identity | None) -> bool:
    """Whether `who` may set a job's configuration (None: security is off, anyone may)."""
    return who is None or who.role in CONFIGURERS or (who.role == "worker" and who.node_id == "worker-0")


def may_act_as(who: Identity | None, node_id: str) -> bool:
    """Whether `who` may speak for node `node_id` (register, leave, push under its id)."""
    return who is None or who.role == "admin" or who.may_be(node_id)


class AuthRefusals:
    """Refused calls by (status, method): the counter that tests and metrics read."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()

    def add(self, status: str, method: str) -> None:
        with self._lock:
            self._counts[(status, method)] += 1

    def total(self, status: str | None = None) -> int:
        with self._lock:
            return sum(n for (s, _), n in self._counts.items() if status is None or s == status)

    def snapshot(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._counts)


def _identify(context: grpc.aio.ServicerContext, tokens: TokenTable | None) -> Identity | None:
    pem = context.auth_context().get("x509_pem_cert")
    if pem:
        found = identity_from_pem(pem[0])
        if found is not None:
            return found
    if tokens is None:
        return None
    for key, value in context.invocation_metadata() or ():
        if key == "authorization" and isinstance(value, str) and value.startswith("Bearer "):
            return tokens.identity_of(value[len("Bearer "):])
    return None


class Authorizer(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses unauthenticated and unauthorised calls before their handler runs; see the module doc."""

    def __init__(self, tokens: TokenTable | None, refusals: AuthRefusals | None = None,
                 revocations: RevocationList | None = None) -> None:
        self._tokens = tokens
        self.refusals = refusals if refusals is not None else AuthRefusals()
        self._revocations = revocations

    async def _admit(self, method: str, context: grpc.aio.ServicerContext) -> Identity:
        _counter.set((self.refusals, method))
        if self._revocations is not None and self._revoked(context):
            self.refusals.add("UNAUTHENTICATED", method)
            log.warning("refused %s from %s: its certificate is revoked", method, context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, f"{method}: the certificate is revoked")
        who = _identify(context, self._tokens)
        if who is None:
            self.refusals.add("UNAUTHENTICATED", method)
            log.warning("refused %s from %s: no valid certificate or token", method, context.peer())
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                f"{method}: no valid credential (a pshard certificate or token is required)")
        elif not allowed(method, who.role):
            self.refusals.add("PERMISSION_DENIED", method)
            log.warning("refused %s from %s (%s): role not allowed", method, who, context.peer())
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{method}: role {who.role!r} may not call it")
        assert who is not None
        return who

    def _revoked(self, context: grpc.aio.ServicerContext) -> bool:
        # gRPC has verified the chain but cannot check a CRL (pshard.common.security.revocation).
        assert self._revocations is not None
        pem = context.auth_context().get("x509_pem_cert")
        return bool(pem) and self._revocations.revoked(pem[0])

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.startswith(OPEN_PREFIXES):
            return handler
        admit = self._admit
        if handler.unary_unary is not None:
            inner_uu = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                _caller.set(await admit(method, context))
                return await inner_uu(request, context)
            return handler._replace(unary_unary=unary_unary)
        if handler.unary_stream is not None:
            inner_us = handler.unary_stream

            async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                _caller.set(await admit(method, context))
                async for reply in inner_us(request, context):
                    yield reply
            return handler._replace(unary_stream=unary_stream)
        if handler.stream_unary is not None:
            inner_su = handler.stream_unary

            async def stream_unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                _caller.set(await admit(method, context))
                return await inner_su(requests, context)
            return handler._replace(stream_unary=stream_unary)
        inner_ss = handler.stream_stream

        async def stream_stream(requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            _caller.set(await admit(method, context))
            async for reply in inner_ss(requests, context):
                yield reply
        return handler._replace(stream_stream=stream_stream)


# ---- checks only a handler can make (the request names the node) ----

def check_acts_as(node_id: str, what: str) -> None:
    """PERMISSION_DENIED for a request about node `node_id` from a credential that names another."""
    who = caller()
    if not may_act_as(who, node_id):
        refused(what)
        raise PermissionDeniedError(f"{what}: credential {who} may not act as node {node_id!r}")


def refused(what: str, status: str = "PERMISSION_DENIED") -> None:
    """Count a refusal a handler decided (the interceptor counts its own); `what` is for the log."""
    current = _counter.get()
    if current is not None:
        counter, method = current
        counter.add(status, method)
        log.warning("refused %s (%s) from %s: %s", method, what, caller(), status)


def sees_worker_ids() -> bool:
    """Whether the caller may see which workers there are (GetStats)."""
    who = caller()
    return who is None or who.role in SEES_WORKER_IDS
