"""Prometheus metrics of every pshard service, served on ``--metrics-port``.

Names follow Prometheus conventions: ``pshard_`` prefix, base units (seconds, bytes), ``_total``
for counters. Most values are read at scrape time from what the services already keep (the
store's stats, the handlers' counters, the membership view) by custom collectors, so the request
path pays nothing for them. What is not kept anywhere else (bytes and latency per transport,
refused requests) goes into `RequestMetrics`: plain integer adds and one bisect per request, no
lock (the server's requests run on one event loop; a scrape reads a consistent-enough copy).

Each process builds its own `CollectorRegistry` (`new_registry`), never the global one, so that
servers started in one test process do not collide.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from pshard.common import errors
from pshard.common.cluster.view import TRAINER_ROLES, ClusterView, NodeState

log = logging.getLogger("pshard.metrics")
T = TypeVar("T")

# Seconds: from a small push+pull on the same host (~100 µs) to a sync step waiting for a slow peer.
LATENCY_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


# Clocks behind the fastest worker; SSP keeps them at most its staleness bound (+1 while it waits).
STALENESS_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 32.0, 64.0)


def new_registry() -> CollectorRegistry:
    """A registry of this process's own (never the library's global one)."""
    # No auto_describe: it would collect at registration, on the event loop the collectors wait for.
    return CollectorRegistry()


@dataclass
class MetricsServer:
    port: int
    _close: Callable[[], None]

    def close(self) -> None:
        self._close()


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    """Serve ``/metrics`` over HTTP on host:port (port 0 picks a free one) in a daemon thread."""
    host = host.strip("[]") or "0.0.0.0"
    server, thread = start_http_server(port, addr=host, registry=registry)
    bound = int(server.server_address[1])

    def close() -> None:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5.0)

    log.info("metrics on http://%s:%d/metrics", host, bound)
    return MetricsServer(bound, close)


def bind_host(bind: str) -> str:
    """The host part of a HOST:PORT listen address ('[::1]:7000' -> '::1')."""
    return bind.rsplit(":", 1)[0].strip("[]") or "0.0.0.0"


def on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], T], timeout_s: float = 5.0) -> T:
    """`fn()` run on `loop`, whose state it reads, from the scrape's HTTP thread."""

    async def call() -> T:
        return fn()

    return asyncio.run_coroutine_threadsafe(call(), loop).result(timeout_s)


# ---- a histogram cheap enough for every request ----


class LatencyHistogram:
    """Cumulative buckets as Prometheus wants them, filled by one bisect and two adds."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, total = [], 0
        for bound, count in zip((*self.buckets, math.inf), list(self.counts), strict=True):
            total += count
            out.append(("+Inf" if bound == math.inf else repr(bound), float(total)))
        return out


@dataclass
class _Traffic:
    bytes_in: int = 0
    bytes_out: int = 0
    latency: LatencyHistogram = field(default_factory=LatencyHistogram)


@dataclass
class _Unpacked:
    packed_bytes: int = 0
    dense_bytes: int = 0
    seconds: float = 0.0


class RequestMetrics:
    """Bytes, latency and refusals of one server's requests, by transport and method."""

    def __init__(self) -> None:
        self._traffic: dict[tuple[str, str], _Traffic] = {}
        self.refused: dict[str, int] = {}  # gRPC status name -> requests answered with it
        self.served = 0  # every request, of any kind (--exit-when-done waits for them to stop)
        # Clocks each stamped push/pull is behind the fastest clock seen: what SSP's staleness bounds.
        self.fastest_clock = 0
        self.staleness = LatencyHistogram(STALENESS_BUCKETS)
        # Compressed pushes unpacked (docs/guide/compression.md), by encoding: bytes that arrived, the float32
        # bytes they stood for, and the seconds spent unpacking them.
        self.unpacked: dict[str, _Unpacked] = {}

    def record_unpack(self, encoding: str, packed_bytes: int, dense_bytes: int, seconds: float) -> None:
        done = self.unpacked.get(encoding)
        if done is None:
            done = self.unpacked[encoding] = _Unpacked()
        done.packed_bytes += packed_bytes
        done.dense_bytes += dense_bytes
        done.seconds += seconds

    def record(
        self,
        transport: str,
        method: str,
        bytes_in: int,
        bytes_out: int,
        seconds: float,
        error_type: str | None = None,
        clock: int | None = None,
    ) -> None:
        """One finished request; `error_type`: the PSError class it was refused with, if any;
        `clock`: its stamp's, for a push or pull."""
        self.served += 1
        if clock is not None:
            if clock > self.fastest_clock:
                self.fastest_clock = clock
            self.staleness.observe(self.fastest_clock - clock)
        traffic = self._traffic.get((transport, method))
        if traffic is None:
            traffic = self._traffic[(transport, method)] = _Traffic()
        traffic.bytes_in += bytes_in
        traffic.bytes_out += bytes_out
        traffic.latency.observe(seconds)
        if error_type:
            status = status_of(error_type)
            self.refused[status] = self.refused.get(status, 0) + 1

    def items(self) -> list[tuple[tuple[str, str], _Traffic]]:
        return list(self._traffic.items())


def status_of(error_type: str) -> str:
    """The gRPC status name a PSError class (by name) is answered with."""
    cls = getattr(errors, error_type, None)
    status = (
        getattr(cls, "status", None) if isinstance(cls, type) and issubclass(cls, errors.PSError) else None
    )
    return status if isinstance(status, str) else "UNKNOWN"


# ---- parameter server ----


class _StoreStats(Protocol):
    slices: int
    bytes_stored: int
    pushes_applied: int
    pushes_dropped: int
    late_gradients_dropped: int
    worker_clocks: dict[str, int]
    min_version: int
    max_version: int


class _TableStats(Protocol):
    rows: int
    admitted: int
    evicted: int
    admission_bytes: int
    admission_halvings: int
    row_bytes: int
    ram_rows: int
    ram_bytes: int
    disk_rows: int
    disk_bytes: int
    spilled: int
    fetched: int


class _Tables(Protocol):
    """ps_server.handlers.tables.TableHandlers, as the metrics read it."""

    def all_stats(self) -> Mapping[str, _TableStats]: ...


class _Refusals(Protocol):
    """common.security.auth.AuthRefusals: refused calls by (gRPC status, method), read under its own lock."""

    def snapshot(self) -> dict[tuple[str, str], int]: ...


def auth_refused_family(refusals: _Refusals) -> CounterMetricFamily:
    """pshard_auth_refused_total{code,method}. Methods are the service's own: calls to an unknown
    method are not counted, so a stranger cannot grow the label set."""
    family = CounterMetricFamily(
        "pshard_auth_refused",
        "Calls refused without a valid credential (UNAUTHENTICATED) or for the caller's role "
        "(PERMISSION_DENIED), by method",
        labels=["code", "method"],
    )
    for (code, method), count in sorted(refusals.snapshot().items()):
        family.add_metric([code, method], count)
    return family


class _ServerStats(Protocol):
    @property
    def job(self) -> Any: ...
    @property
    def store(self) -> _StoreStats | None: ...
    @property
    def pulls_served(self) -> int: ...
    @property
    def pulls_waiting(self) -> int: ...
    @property
    def pulls_timed_out(self) -> int: ...
    @property
    def transports(self) -> Mapping[str, str]: ...
    @property
    def replication_lag(self) -> int: ...
    @property
    def failovers(self) -> int: ...


def clock_lags(clocks: Mapping[str, int]) -> dict[str, int]:
    """Each worker's clock behind the fastest one (0 for the fastest)."""
    fastest = max(clocks.values(), default=0)
    return {worker: fastest - clock for worker, clock in clocks.items()}


class ServerCollector(Collector):
    """A parameter server's metrics, read from its handlers' stats at scrape time."""

    def __init__(
        self,
        stats: Callable[[], _ServerStats],
        requests: RequestMetrics,
        checkpoint_files: Sequence[Path] = (),
        tables: Callable[[], Mapping[str, _TableStats]] | None = None,
        refusals: _Refusals | None = None,
    ) -> None:
        """`checkpoint_files`: what a checkpoint of this server rewrites last (the shard's manifest, the
        tables' pointer); the newest one's mtime is the last checkpoint's time."""
        self._stats = stats
        self._requests = requests
        self._checkpoint_files = tuple(checkpoint_files)
        self._tables = tables
        self._refusals = refusals

    def collect(self) -> Iterator[Any]:
        yield from request_families(self._requests, "ps")
        stats = self._stats()
        waiting = GaugeMetricFamily(
            "pshard_ps_pulls_waiting", "Pulls waiting for their consistency condition"
        )
        waiting.add_metric([], stats.pulls_waiting)
        yield waiting
        yield _counter("pshard_ps_pulls_served", "Pulls answered", stats.pulls_served)
        yield _counter(
            "pshard_ps_pulls_timed_out", "Pulls that waited past their deadline", stats.pulls_timed_out
        )
        transports = GaugeMetricFamily(
            "pshard_ps_worker_transport",
            "1 per worker and the fast path its session uses (absent: gRPC)",
            labels=["worker", "transport"],
        )
        for worker, kind in sorted(stats.transports.items()):
            transports.add_metric([worker, kind], 1)
        yield transports
        # Replication (docs/architecture.md, 9 Failures).
        yield _gauge("pshard_ps_replication_lag_records",
                     "Replication records the slowest backup has yet to acknowledge", stats.replication_lag)
        yield _counter("pshard_failovers_total",
                       "Times this server was promoted to primary of a dead server's slices", stats.failovers)
        yield from self._store_families(stats.store)
        if self._tables is not None:
            yield from table_families(self._tables())
        if self._refusals is not None:
            yield auth_refused_family(self._refusals)
        if self._checkpoint_files:
            age = GaugeMetricFamily(
                "pshard_ps_checkpoint_age_seconds",
                "Seconds since this server's last checkpoint (absent: none yet)",
            )
            saved = [mtime for mtime in map(_mtime, self._checkpoint_files) if mtime is not None]
            if saved:
                age.add_metric([], max(0.0, time.time() - max(saved)))
            yield age

    @staticmethod
    def _store_families(store: _StoreStats | None) -> Iterable[Any]:
        if store is None:
            return
        yield _gauge("pshard_ps_slices", "Slices this server holds", store.slices)
        yield _gauge("pshard_ps_stored_bytes", "Bytes of the values this server holds", store.bytes_stored)
        yield _counter("pshard_ps_pushes_applied", "Gradients applied", store.pushes_applied)
        yield _counter(
            "pshard_ps_pushes_dropped", "Gradients dropped (late ones included)", store.pushes_dropped
        )
        yield _counter(
            "pshard_ps_late_gradients_dropped",
            "Gradients dropped because their clock had already closed (duplicates and stragglers)",
            store.late_gradients_dropped,
        )
        yield _gauge(
            "pshard_ps_sync_clock_min",
            "Lowest slice version (the sync clock every slice reached)",
            store.min_version,
        )
        yield _gauge("pshard_ps_sync_clock_max", "Highest slice version", store.max_version)
        clock = GaugeMetricFamily(
            "pshard_ps_worker_clock", "Last clock each worker pushed", labels=["worker"]
        )
        lag = GaugeMetricFamily(
            "pshard_ps_worker_clock_lag", "Clocks each worker is behind the fastest one", labels=["worker"]
        )
        lags = clock_lags(store.worker_clocks)
        for worker, value in sorted(store.worker_clocks.items()):
            clock.add_metric([worker], value)
            lag.add_metric([worker], lags[worker])
        yield clock
        yield lag
        spread = max(lags.values(), default=0)
        yield _gauge(
            "pshard_ps_clock_spread",
            "Fastest minus slowest worker clock: what SSP's staleness bounds",
            spread,
        )


def table_families(tables: Mapping[str, _TableStats]) -> Iterator[Any]:
    """Rows, admissions, evictions, admission counts and row bytes of each sparse table (labelled by name)."""
    rows = GaugeMetricFamily("pshard_table_rows", "Rows a sparse table holds here", labels=["table"])
    admitted = CounterMetricFamily(
        "pshard_table_admissions",
        "Rows a sparse table created for ids it had not held (checkpoint restores not counted)",
        labels=["table"],
    )
    evicted = CounterMetricFamily(
        "pshard_table_evictions", "Rows a sparse table evicted (cap or ttl)", labels=["table"]
    )
    sketch = GaugeMetricFamily(
        "pshard_table_admission_bytes",
        "Memory of a sparse table's admission counts (fixed by admit_memory_mb; 0: admit_after=1)",
        labels=["table"],
    )
    halvings = CounterMetricFamily(
        "pshard_table_admission_halvings",
        "Times a sparse table's admission counts were halved (decay: how fast sightings fade)",
        labels=["table"],
    )
    row_bytes = GaugeMetricFamily(
        "pshard_table_row_bytes",
        "Bytes of a sparse table's row values as stored and pulled (row_dtype; optimizer state not counted)",
        labels=["table"],
    )
    tier_rows = GaugeMetricFamily(
        "pshard_table_tier_rows", "Rows of a sparse table in RAM and on its disk tier (memory_mb)",
        labels=["table", "tier"],
    )
    tier_bytes = GaugeMetricFamily(
        "pshard_table_tier_bytes",
        "Bytes of a sparse table's rows (values, optimizer state, stamps) in RAM and on its disk tier",
        labels=["table", "tier"],
    )
    spilled = CounterMetricFamily(
        "pshard_table_spilled_rows", "Rows a sparse table moved from RAM to its disk tier", labels=["table"]
    )
    fetched = CounterMetricFamily(
        "pshard_table_fetched_rows", "Rows a sparse table read back from its disk tier on touch",
        labels=["table"]
    )
    for name, stats in sorted(tables.items()):
        tier_rows.add_metric([name, "ram"], stats.ram_rows)
        tier_rows.add_metric([name, "disk"], stats.disk_rows)
        tier_bytes.add_metric([name, "ram"], stats.ram_bytes)
        tier_bytes.add_metric([name, "disk"], stats.disk_bytes)
        spilled.add_metric([name], stats.spilled)
        fetched.add_metric([name], stats.fetched)
        rows.add_metric([name], stats.rows)
        row_bytes.add_metric([name], stats.row_bytes)
        admitted.add_metric([name], stats.admitted)
        evicted.add_metric([name], stats.evicted)
        sketch.add_metric([name], stats.admission_bytes)
        halvings.add_metric([name], stats.admission_halvings)
    yield from (rows, admitted, evicted, sketch, halvings, row_bytes, tier_rows, tier_bytes, spilled, fetched)


def request_families(requests: RequestMetrics, service: str) -> Iterator[Any]:
    bytes_in = CounterMetricFamily(
        f"pshard_{service}_received_bytes", "Request bytes received", labels=["transport", "method"]
    )
    bytes_out = CounterMetricFamily(
        f"pshard_{service}_sent_bytes", "Reply bytes sent", labels=["transport", "method"]
    )
    latency = HistogramMetricFamily(
        f"pshard_{service}_request_duration_seconds",
        "Time from a request's arrival to its reply, waiting included",
        labels=["transport", "method"],
    )
    for (transport, method), traffic in sorted(requests.items()):
        bytes_in.add_metric([transport, method], traffic.bytes_in)
        bytes_out.add_metric([transport, method], traffic.bytes_out)
        latency.add_metric([transport, method], traffic.latency.cumulative(), traffic.latency.sum)
    refused = CounterMetricFamily(
        f"pshard_{service}_refused_requests", "Requests refused, by gRPC status", labels=["code"]
    )
    for code, count in sorted(requests.refused.items()):
        refused.add_metric([code], count)
    staleness = HistogramMetricFamily(
        f"pshard_{service}_request_staleness_clocks",
        "Clocks a push or pull's stamp is behind the fastest clock seen (SSP's staleness)",
    )
    staleness.add_metric([], requests.staleness.cumulative(), requests.staleness.sum)
    yield from (bytes_in, bytes_out, latency, refused, staleness)
    yield from _unpack_families(requests, service)


def _unpack_families(requests: RequestMetrics, service: str) -> Iterator[Any]:
    packed = CounterMetricFamily(f"pshard_{service}_packed_gradient_bytes",
                                 "Compressed gradient bytes received, by encoding", labels=["encoding"])
    dense = CounterMetricFamily(f"pshard_{service}_unpacked_gradient_bytes",
                                "Float32 bytes the compressed gradients unpacked to", labels=["encoding"])
    seconds = CounterMetricFamily(f"pshard_{service}_unpack_seconds",
                                  "Time spent unpacking compressed gradients", labels=["encoding"])
    for encoding, done in sorted(requests.unpacked.items()):
        packed.add_metric([encoding], done.packed_bytes)
        dense.add_metric([encoding], done.dense_bytes)
        seconds.add_metric([encoding], done.seconds)
    yield from (packed, dense, seconds)


# ---- scheduler ----


class _Move(Protocol):
    partition: int
    source: str
    target: str
    bytes_left: int

    @property
    def bytes_copied(self) -> int: ...


class _MoveStats(Protocol):
    """scheduler/partition_moves.py's MoveStats."""

    finished: Mapping[str, int]
    buckets: tuple[tuple[str, float], ...]
    seconds_sum: float
    in_progress: tuple[_Move, ...]
    automatic: int


class SchedulerCollector(Collector):
    """The scheduler's membership, read from its current view at scrape time."""

    def __init__(self, view: Callable[[], ClusterView], refusals: _Refusals | None = None,
                 role_changes: Callable[[], Mapping[str, int]] | None = None,
                 moves: Callable[[], _MoveStats] | None = None) -> None:
        self._view = view
        self._refusals = refusals
        self._role_changes = role_changes
        self._moves = moves

    def collect(self) -> Iterator[Any]:
        if self._refusals is not None:
            yield auth_refused_family(self._refusals)
        view = self._view()
        yield _gauge("pshard_scheduler_generation", "Generation of the current cluster view", view.generation)
        yield _gauge(
            "pshard_scheduler_layout_version",
            "Version of the parameter layout (0: none yet)",
            view.layout_version,
        )
        members = GaugeMetricFamily(
            "pshard_scheduler_members", "Nodes by role and state", labels=["role", "state"]
        )
        counts: dict[tuple[str, str], int] = {}
        for node in view.nodes:
            key = (node.role, node.state.name.lower())
            counts[key] = counts.get(key, 0) + 1
        for (role, state), count in sorted(counts.items()):
            members.add_metric([role, state], count)
        yield members
        clock = GaugeMetricFamily(
            "pshard_scheduler_worker_clock", "Clock each live trainer last reported", labels=["node", "role"]
        )
        lag = GaugeMetricFamily(
            "pshard_scheduler_worker_clock_lag",
            "Clocks behind the fastest live trainer",
            labels=["node", "role"],
        )
        trainers = [n for n in view.nodes if n.role in TRAINER_ROLES and n.state is NodeState.LIVE]
        lags = clock_lags({n.node_id: n.clock for n in trainers})
        for node in trainers:
            clock.add_metric([node.node_id, node.role], node.clock)
            lag.add_metric([node.node_id, node.role], lags[node.node_id])
        yield clock
        yield lag
        if self._role_changes is not None:  # replication (docs/architecture.md, 9 Failures)
            changes = CounterMetricFamily(
                "pshard_scheduler_role_changes",
                "Replica role changes: a backup in or out of sync, promoted, a primary lost with no copy, a "
                "drain or a join",
                labels=["change"])
            for change, count in sorted(self._role_changes().items()):
                changes.add_metric([change], count)
            yield changes
        if self._moves is not None:
            yield from move_families(self._moves())


def move_families(stats: _MoveStats) -> Iterator[Any]:
    """Moves done and their durations (issue 20: partition moves of `pshard rebalance`, drains and joins), and
    the bytes copied and left of each move in progress."""
    done = CounterMetricFamily("pshard_scheduler_moves", "Moves done: row partitions moved to a backup "
                               "(rebalance), servers drained (drain) and servers joined (join)",
                               labels=["kind"])
    for kind in ("drain", "join", "rebalance"):
        done.add_metric([kind], stats.finished.get(kind, 0))
    yield done
    yield CounterMetricFamily("pshard_scheduler_auto_rebalance_moves", "Row partition moves the automatic "
                              "rebalance started (pshard scheduler --rebalance-auto)", value=stats.automatic)
    yield HistogramMetricFamily("pshard_scheduler_move_seconds", "Duration of each move done: a rebalance "
                                "from its switch to its new server's backups holding it, a drain from its "
                                "first ask to its hand-over", buckets=list(stats.buckets),
                                sum_value=stats.seconds_sum)
    labels = ["partition", "source", "target"]
    copied = GaugeMetricFamily("pshard_scheduler_move_bytes_copied",
                               "Bytes of a moving partition its new server's backups hold so far",
                               labels=labels)
    left = GaugeMetricFamily("pshard_scheduler_move_bytes_left",
                             "Bytes of a moving partition its new server's backups still lack",
                             labels=labels)
    for move in stats.in_progress:
        names = [str(move.partition), move.source, move.target]
        copied.add_metric(names, move.bytes_copied)
        left.add_metric(names, move.bytes_left)
    yield copied
    yield left


def hosted_scheduler_collector(handle: Any) -> SchedulerCollector:
    """The scheduler metrics of a scheduler hosted in-process (`handle`: its SchedulerHandle), for
    the /metrics of the chief that hosts it (a TFJob has no scheduler pod of its own)."""
    running = handle.running
    membership = running.servicer.membership
    return SchedulerCollector(lambda: on_loop(handle.loop, membership.view), running.refusals,
                              lambda: on_loop(handle.loop, lambda: dict(membership.in_sync.changes)),
                              lambda: on_loop(handle.loop, membership.moves.stats))


# ---- worker ----


class WorkerMetrics:
    """A worker's own metrics: step latency, steps, clock, loss (registered in `registry`)."""

    def __init__(self, registry: CollectorRegistry, worker: str, role: str) -> None:
        labels = {"worker": worker, "role": role}
        self._step = Histogram(
            "pshard_worker_step_duration_seconds",
            "One training step: forward, backward, push and pull",
            labelnames=list(labels),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ).labels(**labels)
        self._push_pull = Histogram(
            "pshard_worker_push_pull_duration_seconds",
            "The push of a step's gradients and the pull of the next weights",
            labelnames=list(labels),
            buckets=LATENCY_BUCKETS,
            registry=registry,
        ).labels(**labels)
        self._values: dict[str, float] = {"steps": 0, "clock": 0, "loss": math.nan}

        worker_labels = [worker, role]
        values = self._values

        class _Values(Collector):
            def collect(self) -> Iterator[Any]:
                steps = CounterMetricFamily(
                    "pshard_worker_steps", "Training steps taken", labels=["worker", "role"]
                )
                steps.add_metric(worker_labels, values["steps"])
                clock = GaugeMetricFamily(
                    "pshard_worker_clock", "This worker's clock", labels=["worker", "role"]
                )
                clock.add_metric(worker_labels, values["clock"])
                loss = GaugeMetricFamily(
                    "pshard_worker_loss", "Loss of the last step", labels=["worker", "role"]
                )
                loss.add_metric(worker_labels, values["loss"])
                yield from (steps, clock, loss)

        registry.register(_Values())

    def step(self, seconds: float, push_pull_seconds: float, clock: int, loss: float) -> None:
        self._step.observe(seconds)
        self._push_pull.observe(push_pull_seconds)
        self._values["steps"] += 1
        self._values["clock"] = clock
        self._values["loss"] = loss


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:  # not written yet
        return None


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


# ---- entry points ----


def serve_server_metrics(
    handlers: Any,
    loop: asyncio.AbstractEventLoop,
    bind: str,
    port: int,
    checkpoint_files: Sequence[Path] = (),
    tables: _Tables | None = None,
    refusals: _Refusals | None = None,
) -> MetricsServer:
    """A parameter server's /metrics; `handlers`: its ParameterServerHandlers, `tables`: its
    TableHandlers, if any (both read on `loop`); `checkpoint_files`: see ServerCollector;
    `refusals`: its AuthRefusals."""
    registry = new_registry()
    table_stats = None if tables is None else (lambda: on_loop(loop, tables.all_stats))
    registry.register(
        ServerCollector(
            lambda: on_loop(loop, handlers.stats), handlers.requests, checkpoint_files, table_stats,
            refusals,
        )
    )
    return serve_metrics(registry, bind_host(bind), port)


def serve_scheduler_metrics(
    view: Callable[[], ClusterView],
    loop: asyncio.AbstractEventLoop,
    bind: str,
    port: int,
    refusals: _Refusals | None = None,
    role_changes: Callable[[], Mapping[str, int]] | None = None,
    moves: Callable[[], _MoveStats] | None = None,
) -> MetricsServer:
    registry = new_registry()
    changes = (lambda: on_loop(loop, role_changes)) if role_changes is not None else None
    stats = (lambda: on_loop(loop, moves)) if moves is not None else None
    registry.register(SchedulerCollector(lambda: on_loop(loop, view), refusals, changes, stats))
    return serve_metrics(registry, bind_host(bind), port)
