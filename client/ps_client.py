"""PSClient: talks to every parameter server of a job, in parallel, one stream each per step.

Every call is batched per server (all of this worker's slices for that server in
one Exchange stream) and the servers are contacted concurrently. Payloads of any
size travel as 4 MiB frames. Pushes, pulls and declarations are idempotent on the
server (a (worker, clock, slice) is applied at most once; the first declaration
wins), so a call that fails with UNAVAILABLE is retried until its deadline: unary calls by
gRPC's own retry policy (`pshard.common.rpc.retry`), the Exchange stream by a loop here within
`retry_budget_s`. A server past its in-flight byte budget (OverloadedError, RESOURCE_EXHAUSTED) is
retried after the wait it asks for, jittered, until the call's own deadline (`_backing_off`). Nothing
else is retried, except one resend under a newer generation after a re-registration overtook a
request (`_call_stamped`).

Push and pull bytes take a faster path when the server offers one (`transport`, negotiated per
server at the first step: shared memory on the same host, else a raw TCP socket; see
client/fast_session.py and docs/architecture.md, 11 Transports). gRPC stays the control plane and
the fallback: a call whose fast path breaks is sent again over gRPC, where the server drops what
had already landed.
"""

from __future__ import annotations

import functools
import logging
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TypeVar

import grpc
import numpy as np
from pshard.client.compressing import PullDecoder, PushEncoder
from pshard.client.connections import NOT_YET_WAIT_S, ServerConnections, server_behind
from pshard.client.fast_session import TABLE_ROOM_BYTES
from pshard.client.forking import ProcessOwned
from pshard.client.tables import TableClient
from pshard.common.cluster.layout import DEFAULT_SLICE_BYTES, Layout, LayoutSlice, ParamSpec, plan_layout
from pshard.common.compression import PullPack
from pshard.common.errors import (
    InvalidArgumentError,
    OverloadedError,
    PSError,
    PullBaseLostError,
    PullTimeoutError,
    ShapeMismatchError,
    SliceMovedError,
    StaleGenerationError,
    UnavailableError,
    UnknownKeyError,
)
from pshard.common.job import JobConfig
from pshard.common.malloc import keep_stream_buffers
from pshard.common.rpc.options import CHUNK_BYTES, EXCHANGE_METHOD, identity
from pshard.common.rpc.retry import Backoff
from pshard.common.rpc.status import error_from_rpc_error, raise_from_rpc_error
from pshard.common.security.credentials import SecurityConfig
from pshard.common.sparse import TableConfig
from pshard.common.types import SliceKey, Stamp
from pshard.common.wire import codec
from pshard.common.wire.dtypes import PARAM_DTYPES
from pshard.common.wire.fastwire import PeerSilent, TransportBroken
from pshard.common.wire.framing import SliceReader, pack_frames
from pshard.common.wire.liveness import DEFAULT_DEAD_AFTER_S
from pshard.common.wire.shm import DEFAULT_SHM_DIR, align

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import parameter_server_pb2_grpc as pb_grpc
from pshard.api.v1 import tensor_pb2 as tensor_pb

log = logging.getLogger("pshard.client")

T = TypeVar("T")
# The RPC deadline outlives the wait the server is granted (header.timeout_ms) by this much, so a
# pull that cannot be satisfied ends with the server's error naming whom it waited for, instead
# of a bare client-side DEADLINE_EXCEEDED racing it, and the server has time to send the slices.
DEADLINE_SLACK_S = 5.0
# Below this many bytes per server, a step is one unary PushPull call: a bidi stream costs about
# twice a unary call's fixed overhead, which dominates small payloads. Above, Exchange's 4 MiB
# frames win.
SMALL_PAYLOAD_BYTES = 1 << 20
# Waits until this worker's generation is newer than the first argument, at most the second (in
# seconds); True once it is. The SchedulerClient provides it (see worker/session.py).
GenerationWait = Callable[[int, float], bool]
TRANSPORTS = ("auto", "shm", "tcp", "grpc")


@dataclass(frozen=True)
class PushResult:
    applied: int
    dropped: int
    # Versions of the slices pulled back (fused push_pull), lowest first; empty for a plain push.
    min_version: int = 0
    max_version: int = 0


def _result(summaries: Sequence[pb.ExchangeSummary]) -> PushResult:
    versions = [v for s in summaries for v in s.versions]
    return PushResult(sum(s.applied for s in summaries), sum(s.dropped for s in summaries),
                      min(versions, default=0), max(versions, default=0))


class PSClient:
    def __init__(self, servers: Sequence[str], worker_id: str, *, generation: int | Callable[[], int] = 0,
                 layout: Layout | None = None, chunk_bytes: int = CHUNK_BYTES, timeout_s: float = 120.0,
                 retry_budget_s: float = 60.0, await_generation: GenerationWait | None = None,
                 transport: str = "auto", shm_dir: str = DEFAULT_SHM_DIR,
                 security: SecurityConfig | None = None,
                 relayout: Callable[[Layout, float], Layout | None] | None = None,
                 reroute_wait_s: float = 15.0, dead_after_s: float = DEFAULT_DEAD_AFTER_S) -> None:
        """`security`: this worker's TLS files or token (pshard.common.security.credentials; default plain).
        `relayout(layout, timeout_s)`: a layout newer than `layout` once the scheduler publishes one
        (a failover), else None at the timeout; with it and a replicated layout, a step whose server
        is gone waits up to `reroute_wait_s` for the failover and is sent again on the new layout. It
        raises SlicesLostError once the scheduler names a server `layout` needs as lost (its failover
        refused), and the step ends with it at once (SchedulerClient.newer_layout does both).
        `transport`: how push and pull bytes travel (docs/architecture.md, 11 Transports): "auto"
        takes shared memory when the server proves it shares this host's `shm_dir`, else a raw TCP
        socket, else gRPC; "shm" or "tcp" only that one (else gRPC); "grpc" never negotiates.
        `dead_after_s`: a server silent this long breaks its raw TCP session (the job's heartbeat
        timeout; common.wire.liveness), and with a replicated layout the step is re-routed."""
        if transport not in TRANSPORTS:
            raise InvalidArgumentError(f"transport: got {transport!r}, expected one of {TRANSPORTS}")
        if not servers:
            raise InvalidArgumentError("servers: got none, expected at least one parameter server address")
        self.worker_id = worker_id
        self._owner = ProcessOwned(f"PSClient {worker_id!r}")  # a forked child must not use its channels
        # A callable (e.g. the SchedulerClient's `generation`) is read at every call, so requests
        # carry the newest incarnation after a re-registration.
        self._generation_source = generation if callable(generation) else None
        self._generation = 0 if callable(generation) else generation
        self.job: JobConfig | None = None
        self._chunk = chunk_bytes
        self._timeout_s = timeout_s
        self._retry_budget_s = retry_budget_s
        self._await_generation = await_generation
        self.security = (security or SecurityConfig()).for_node(worker_id.split("-", 1)[0], worker_id)
        self._dtypes: dict[str, str] = {}
        # Channels, fast-path sessions, the thread pool and the routing layout: shared with the tables client.
        self.connections = ServerConnections(
            servers, worker_id, self.security, timeout_s=timeout_s, transport=transport, shm_dir=shm_dir,
            layout=layout, relayout=relayout, reroute_wait_s=reroute_wait_s, dead_after_s=dead_after_s,
            room=self._session_room)
        self._channels = self.connections.channels  # the list itself: it grows with the layout's servers
        self._closed = self.connections.closed
        self._pool = self.connections.pool
        self._answered: dict[str, float] = {}  # server -> when it last answered a call (reached_servers)
        self._stubs: list[pb_grpc.ParameterServerServiceStub] = []
        self._exchange: list[grpc.StreamStreamMultiCallable] = []
        # The servers' addresses, by index: the start-up list, then those a newer layout added (kept in
        # step by _server_added; an attribute, not a property, since a step reads it).
        self.servers: tuple[str, ...] = self.connections.servers
        for server in range(len(self.servers)):
            self._server_added(server)
        self.connections.on_server_added.append(self._server_added)
        # What the last push_pull did (its versions are the sync clock to follow), and the last pull.
        self.last_result: PushResult | None = None
        self.last_pull: PushResult | None = None
        # Step headers by (server, parameters, wire dtype, pull), for the layout they were made for.
        self._templates: dict[tuple[int, tuple[str, ...], str, bool, bool],
                              tuple[Sequence[LayoutSlice], pb.ExchangeHeader]] = {}
        self._templates_layout: Layout | None = None
        # Calls resent because a server was past its in-flight budget (a sign to add servers).
        self.overload_retries = 0
        self._declared = False
        self.reroutes = 0  # steps sent again after a failover moved slices
        self.not_yet = 0  # steps sent again to a server that had not learned the layout switch yet
        # (schedule id, push number, floor) stamped on pushes while a scheduled call runs
        # (pshard.coordinator): the servers apply each of them once, whichever worker sends it.
        self.scheduled: tuple[int, int, int] = (0, 0, 0)
        # The job's gradient compression (set by declare); None: every slice travels as it is.
        self.compression: PushEncoder | None = None
        # Compressed pulls (JobConfig.compression.pull): this worker's copies; None: pulls come whole.
        self.pull_compression: PullDecoder | None = None

    def _server_added(self, server: int) -> None:
        self.servers = self.connections.servers
        channel = self.connections.channels[server]
        self._stubs.append(pb_grpc.ParameterServerServiceStub(channel))
        self._exchange.append(channel.stream_stream(EXCHANGE_METHOD, request_serializer=identity,
                                                    response_deserializer=identity))

    # ---- lifecycle ----

    def close(self) -> None:
        self.connections.close(owned=self._owner.here)

    def __enter__(self) -> PSClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- declare ----

    def declare(self, params: Mapping[str, np.ndarray], job: JobConfig,
                slice_bytes: int = DEFAULT_SLICE_BYTES) -> dict[str, np.ndarray]:
        """Create the parameters on their servers; returns the values the servers hold.

        Idempotent: the first worker's initial values win (like MXNet's rank-0 init), and
        every worker should load what this returns. Plans the layout unless one was given
        (the scheduler's); either way it is deterministic, so all workers agree.
        """
        specs = []
        for key, value in params.items():
            dtype = codec.dtype_name_of(value)
            if dtype not in PARAM_DTYPES:
                raise InvalidArgumentError(f"param {key!r}: dtype {dtype} cannot be trained; expected one "
                                           f"of {PARAM_DTYPES}")
            specs.append(ParamSpec(key, dtype, tuple(value.shape)))
        if self.layout is None:
            self.layout = plan_layout(specs, self.servers, slice_bytes)
        else:
            problem = self.layout.same_params(Layout(tuple(specs), self.servers, slice_bytes, ()))
            if problem:
                raise ShapeMismatchError(f"declare: {problem}")
        self.job = job
        self._dtypes = {p.key: p.dtype for p in specs}
        self._plan_compression(job, {p.key: p.numel for p in specs})
        out = {key: np.empty(value.shape, value.dtype) for key, value in params.items()}
        flat = {key: np.ascontiguousarray(value).reshape(-1) for key, value in params.items()}

        def run(server: int) -> None:
            slices = self.layout.slices_on(server)  # type: ignore[union-attr]
            if not slices:
                # A failover left it none (it is only a backup now), or the model has fewer slices than
                # there are servers (a coordinator's one variable): nothing to declare there.
                return
            header = pb.ExchangeHeader(
                op=pb.EXCHANGE_OP_DECLARE, config=codec.job_to_proto(job),
                push=[self._meta(s, self._dtypes[s.key]) for s in slices],
                timeout_ms=int(self._timeout_s * 1000))
            buffers = [flat[s.key][s.offset:s.offset + s.numel] for s in slices]
            self._exchange_call(server, header, buffers, slices, out)

        self._all_servers(run)
        self._declared = True
        return out

    def _plan_compression(self, job: JobConfig, sizes: Mapping[str, int]) -> None:
        """Each parameter's compressor; a rule matching none of them is refused here, before any step.
        Declared again (a rejoin), the residuals are kept."""
        # The averaged buffers' pushes are values to take the mean of, not gradients: never compressed.
        plan = job.compression.plan({k: n for k, n in sizes.items() if k not in job.averaged})
        lossy = {k: c for k, c in plan.items() if c.lossy}
        if self.compression is not None and self.compression.plan == lossy:
            return
        encoder = PushEncoder(plan, sizes, job.compression.error_feedback)
        self.compression = encoder if encoder.plan else None
        pull = job.compression.pull_compressor
        # Float32 parameters only: the copies add in float32 on both sides (the server refuses others).
        pulled = [k for k in encoder.plan if self._dtypes.get(k) == "float32"]
        self.pull_compression = PullDecoder(pull, pulled, sizes) if pull.lossy and pulled else None

    # ---- failover (docs/architecture.md, 9 Failures) ----

    @property
    def layout(self) -> Layout | None:
        """The layout calls are routed by (None until declare() plans one, or the scheduler's is given)."""
        return self.connections.layout

    @layout.setter
    def layout(self, layout: Layout | None) -> None:
        self.connections.use_layout(layout)

    @property
    def transports(self) -> list[str]:
        """What each server's calls ride now: "shm", "tcp" or "grpc"."""
        return self.connections.transports

    def set_layout(self, layout: Layout) -> None:
        """Route by `layout` from now on (a failover moved slices to their backups' servers)."""
        self.connections.set_layout(layout)

    @property
    def _fail_fast(self) -> bool:
        """Replicated and able to re-route: a call to a dead server fails at once instead of waiting
        for it to come back, and the step goes to the slice's new primary."""
        return self._declared and self.connections.fails_fast

    def _rerouting(self, step: Callable[[Layout], T]) -> T:
        """`step(layout)`, again on each newer layout the scheduler publishes after a server failed it.

        Resending the whole step is safe: a server drops a (worker, clock, slice) it already has, and
        a promoted backup has every step its primary acknowledged, with the same per-worker clocks.
        """
        deadline = time.monotonic() + self._timeout_s
        while True:
            layout = self._need_layout()
            try:
                return step(layout)
            except (UnavailableError, UnknownKeyError) as err:
                # A slice a layout switch moved (a drain, a join) is re-routed with replicas or without.
                moved = isinstance(err, SliceMovedError) and self.connections.can_reroute
                if not (self._fail_fast or moved) or self._closed.is_set():
                    raise
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                if server_behind(err, layout):  # re-routed there before the server learned the switch
                    self.not_yet += 1
                    if self._closed.wait(min(NOT_YET_WAIT_S, left)):
                        raise
                    continue
                newer = self.connections.newer_layout(layout, left)
                if newer is None:
                    if isinstance(err, UnknownKeyError):
                        raise  # the current layout's server lacks the slice: no resend can help
                    log.warning("step failed (%s); no failover published yet, sending it again", err)
                    if self._closed.wait(min(1.0, max(0.0, deadline - time.monotonic()))):
                        raise
                    continue
                moved = sum(a.server != b.server for a, b in zip(layout.slices, newer.slices, strict=True))
                log.warning("FAILOVER: layout %d -> %d moved %d slices to their backups (%s); resending the "
                            "step", layout.version, newer.version, moved, err)
                self.set_layout(newer)
                self.reroutes += 1

    # ---- push / pull ----

    def push(self, grads: Mapping[str, np.ndarray], clock: int, *,
             lr: float | None = None) -> Future[PushResult]:
        """Send gradients for `clock`; returns at once with a future (see `wait`). `lr`: the learning
        rate of this clock's update (an LR schedule; None = the job's)."""
        self._check_grads(grads)
        self._owner.check()
        return self._pool.submit(self._push_pull, grads, clock, None, False, lr)

    def wait(self, future: Future[T], timeout_s: float | None = None) -> T:
        return future.result(timeout=timeout_s if timeout_s is not None else self._timeout_s)

    def pull(self, clock: int, keys: Iterable[str] | None = None,
             out: Mapping[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """Fetch parameters as of `clock` (waiting as the consistency mode demands)."""
        wanted = list(keys) if keys is not None else None  # sent again after a failover
        result, self.last_pull = self._rerouting(lambda layout: self._pull(layout, clock, wanted, out))
        return result

    def pull_into(self, clock: int, keys: Iterable[str], out: Mapping[str, np.ndarray]) -> PushResult:
        """`pull` into `out`, returning the versions pulled (`last_pull` is left alone: threads that
        pull side by side each get their own)."""
        wanted = list(keys)
        return self._rerouting(lambda layout: self._pull(layout, clock, wanted, out))[1]

    def _pull(self, layout: Layout, clock: int, keys: Iterable[str] | None,
              out: Mapping[str, np.ndarray] | None) -> tuple[dict[str, np.ndarray], PushResult]:
        wanted = list(keys) if keys is not None else [p.key for p in layout.params]
        result = self._outputs(wanted, out)
        wanted_set = set(wanted)

        def run(server: int) -> pb.ExchangeSummary:
            slices = [s for s in layout.slices_on(server) if s.key in wanted_set]
            if not slices:
                return pb.ExchangeSummary()
            header = pb.ExchangeHeader(op=pb.EXCHANGE_OP_PUSH_PULL, stamp=self._stamp(clock),
                                       pull=[codec.slice_id_to_proto(s.slice_key) for s in slices],
                                       timeout_ms=int(self._timeout_s * 1000))

            def send() -> pb.ExchangeSummary:
                summary = self._fast_call(server, header, [], slices, result)
                return summary if summary is not None else self._exchange_call(server, header, [], slices,
                                                                               result)

            return send() if self.pull_compression is None else self._pulling(server, slices, header, send)

        return result, _result(self._all_servers(run))

    def push_pull(self, grads: Mapping[str, np.ndarray], clock: int,
                  out: Mapping[str, np.ndarray] | None = None, *,
                  lr: float | None = None) -> dict[str, np.ndarray]:
        """Fused step: push gradients for `clock` and receive the weights for `clock + 1`. `lr`: the
        learning rate of this clock's update (an LR schedule; None = the job's).

        Both directions share one stream per server, and the server sends each slice
        back as soon as its update is applied, so sending and receiving overlap.
        """
        self._check_grads(grads)
        result = self._outputs(list(grads), out)
        self.last_result = self._push_pull(grads, clock, result, True, lr)
        return result

    def _push_pull(self, grads: Mapping[str, np.ndarray], clock: int,
                   out: dict[str, np.ndarray] | None, pull: bool, lr: float | None = None) -> PushResult:
        # Packed once per step, outside the failover's resend: error feedback must move on once.
        packed: dict[SliceKey, codec.WireArray] = {}
        if self.compression is not None:
            flat = {k: np.ascontiguousarray(g).reshape(-1) for k, g in grads.items()}
            packed = self.compression.encode(flat, self._need_layout().slices, clock)
        return self._rerouting(lambda layout: self._push_pull_on(layout, grads, clock, out, pull, lr, packed))

    def _push_pull_on(self, layout: Layout, grads: Mapping[str, np.ndarray], clock: int,
                      out: dict[str, np.ndarray] | None, pull: bool, lr: float | None = None,
                      packed: Mapping[SliceKey, codec.WireArray] | None = None) -> PushResult:
        wire = self.job.wire_dtype if self.job else ""
        packed = packed or {}
        flat = {}
        for key, g in grads.items():
            g = np.ascontiguousarray(g).reshape(-1)
            if self.compression is not None and self.compression.compresses(key):
                flat[key] = g  # its slices travel packed
            else:
                flat[key] = codec.cast(codec.WireArray(g, self._dtypes[key]), wire).array if wire else g

        def run(server: int) -> pb.ExchangeSummary:
            slices, header = self._push_header(layout, server, flat, wire, pull, clock, lr, packed)
            if not slices:
                return pb.ExchangeSummary()
            buffers = [packed[s.slice_key].array if s.slice_key in packed
                       else flat[s.key][s.offset:s.offset + s.numel] for s in slices]
            pulled = slices if pull else []

            def send() -> pb.ExchangeSummary:
                summary = self._fast_call(server, header, buffers, pulled, out or {})
                if summary is not None:
                    return summary
                # The unary PushPull carries no pull packing: compressed pulls go as an Exchange.
                if sum(b.nbytes for b in buffers) <= SMALL_PAYLOAD_BYTES and not header.pull_packing:
                    return self._unary_push_pull(server, header, buffers, pulled, out or {})
                return self._exchange_call(server, header, buffers, pulled, out or {})

            return send() if self.pull_compression is None else self._pulling(server, pulled, header, send)

        return _result(self._all_servers(run))

    def _push_header(self, layout: Layout, server: int, flat: Mapping[str, np.ndarray], wire: str, pull: bool,
                     clock: int, lr: float | None = None,
                     packed: Mapping[SliceKey, codec.WireArray] | None = None
                     ) -> tuple[Sequence[LayoutSlice], pb.ExchangeHeader]:
        """The server's slices of `flat` and the step's header. Both are the same every step but for
        the stamp, and building the header's messages costs more than a small step's bytes: they are
        made once per (layout, parameters, wire dtype) and the header copied from a template."""
        cache_key = (server, tuple(flat), wire, pull, bool(packed))
        if self._templates_layout is not layout:
            self._templates_layout, self._templates = layout, {}
        cached = self._templates.get(cache_key)
        if cached is None:
            mine = tuple(s for s in layout.slices_on(server) if s.key in flat)
            packed = packed or {}
            # A packed slice's size is fixed by its compressor and element count, so it is cached too.
            cached = mine, pb.ExchangeHeader(
                op=pb.EXCHANGE_OP_PUSH_PULL, push=[
                    self._packed_meta(s, packed[s.slice_key]) if s.slice_key in packed
                    else self._meta(s, wire or self._dtypes[s.key]) for s in mine],
                pull=[codec.slice_id_to_proto(s.slice_key) for s in mine] if pull else [])
            self._templates[cache_key] = cached
        slices, template = cached
        header = pb.ExchangeHeader()
        header.CopyFrom(template)
        header.stamp.CopyFrom(self._stamp(clock, lr))
        header.timeout_ms = int(self._timeout_s * 1000)
        return slices, header

    def _pulling(self, server: int, pulled: Sequence[LayoutSlice], header: pb.ExchangeHeader,
                 send: Callable[[], pb.ExchangeSummary]) -> pb.ExchangeSummary:
        """`send()` with the header's pull packing set from this worker's copies (compressed pulls); once
        more with the slices whole when the server says it does not hold what the worker holds (a reply
        lost on the way, a restarted server or a new primary: it applied nothing of the request)."""
        decoder = self.pull_compression
        if decoder is None or not any(decoder.pulls(s.key) for s in pulled):
            return send()
        self._set_packing(header, decoder, pulled)
        try:
            return send()
        except PullBaseLostError as err:
            log.info("server %s: %s; pulling those slices whole", self.servers[server], err)
            decoder.lost(pulled)
            self._set_packing(header, decoder, pulled)
            return send()

    @staticmethod
    def _set_packing(header: pb.ExchangeHeader, decoder: PullDecoder, pulled: Sequence[LayoutSlice]) -> None:
        del header.pull_packing[:]
        header.pull_packing.extend(codec.pull_packs_to_proto([decoder.pack(s) for s in pulled]))

    def _place_pulled(self, s: LayoutSlice, pack: PullPack | None, raw: np.ndarray, wire_dtype: str,
                      clock: int, out: Mapping[str, np.ndarray]) -> None:
        """A pulled slice's bytes into `out`: whole (cast back from the wire dtype), or a compressed pull's
        landed on this worker's copy first."""
        if pack is None or not pack.packed:
            self._place(s, codec.WireArray(raw.view(codec.numpy_dtype(wire_dtype)), wire_dtype), out)
            return
        assert self.pull_compression is not None
        out[s.key].reshape(-1)[s.offset:s.offset + s.numel] = self.pull_compression.apply(s, pack, raw, clock)

    # ---- operations ----

    # ---- sparse tables: client.tables does the work over these channels ----

    @functools.cached_property
    def tables(self) -> TableClient:
        self._owner.check()
        return TableClient(self)

    def declare_table(self, config: TableConfig) -> None:
        self.tables.declare(config)

    def pull_rows(self, table: str, ids: np.ndarray, clock: int = 0) -> np.ndarray:
        return self.tables.pull(table, ids, clock)

    def push_rows(self, table: str, ids: np.ndarray, grads: np.ndarray, clock: int = 0) -> int:
        return self.tables.push(table, ids, grads, clock)

    def push_pull_rows(self, table: str, ids: np.ndarray, grads: np.ndarray, pull_ids: np.ndarray,
                       clock: int = 0) -> np.ndarray:
        return self.tables.push_pull(table, ids, grads, pull_ids, clock)

    def stats(self, serving_only: bool = False) -> list[pb.GetStatsResponse]:
        """Every server's stats, in server order; `serving_only`: only the servers the layout gives slices
        or row partitions, for questions about the job's progress. A server drained or failed over is
        gone, and asking it would wait out the whole deadline (a chief's last wait for its peers did).

        With a replicated layout, a serving server that does not answer within the job's dead-peer time
        counts as gone, and the question goes to the layout the scheduler publishes once it failed the
        server over: a chief whose last step ended just before a server's host was cut off still routes
        by the old layout, and its wait for its peers asked the cut-off server for its whole step timeout
        (45-120 s) before the final pull (issue 24)."""
        layout = self.layout
        if not serving_only or layout is None:
            return self._all_servers(lambda i: self._ask_stats(i, self._timeout_s, True))
        if not self._fail_fast:
            return self._each_of(self._serving(layout), lambda i: self._ask_stats(i, self._timeout_s, True))
        return self._rerouting(self._live_stats)

    def live_layout(self) -> Layout | None:
        """The layout to route an admin call by: with a replicated layout, one whose serving servers all
        answered within the dead-peer time (a newer one, the scheduler's failover, past a silent one);
        else the client's. A checkpoint or table export sent by a layout the client has not caught up
        on waits out its whole deadline on a server whose host was cut off (issue 24)."""
        if not self._fail_fast:
            return self.layout
        return self._rerouting(self._live)

    def _on_live_servers(self, ask: Callable[[int, bool], T]) -> list[T]:
        """`ask(server, wait_for_ready)` on every server at once; with a replicated layout, on the serving
        servers of `live_layout`'s layout only, and a server unreachable fails at once (re-routes)."""
        if not self._fail_fast:
            return self._all_servers(lambda i: ask(i, True))
        return self._rerouting(lambda layout: self._each_of(
            self._serving(self._live(layout)), lambda i: ask(i, False)))

    def _live(self, layout: Layout) -> Layout:
        """`layout`, once its serving servers all answered (`_live_stats`)."""
        self._live_stats(layout)
        return layout

    def _live_stats(self, layout: Layout) -> list[pb.GetStatsResponse]:
        """The stats of `layout`'s serving servers; one silent for twice the dead-peer time (as the raw
        TCP path's bound) raises UnavailableError, which `_rerouting` takes to the failed-over layout."""
        silent_s = min(self._timeout_s, 2 * self.connections.dead_after_s)
        return self._each_of(self._serving(layout), lambda i: self._ask_stats(i, silent_s, False))

    def _serving(self, layout: Layout) -> list[int]:
        """The servers `layout` gives slices or row partitions: not a drained or failed-over one."""
        return [i for i in range(len(self.servers)) if layout.slices_on(i) or layout.partitions_on(i)]

    def _each_of(self, servers: Sequence[int], fn: Callable[[int], T]) -> list[T]:
        """fn(server) for each of `servers` at once, in their order; the first error wins, after all ended."""
        self._owner.check()
        futures = [self._pool.submit(self._naming_unreachable, fn, i) for i in servers]
        return [f.result() for f in futures]

    def _ask_stats(self, server: int, timeout_s: float, wait: bool) -> pb.GetStatsResponse:
        """`wait`: for a server that cannot be reached yet, until the deadline; else a deadline passed
        is the server's silence (UnavailableError, which re-routes)."""
        try:
            return self._unary(server, lambda stub: stub.GetStats(pb.GetStatsRequest(), timeout=timeout_s,
                                                                  wait_for_ready=wait))
        except PullTimeoutError as err:
            if wait:
                raise
            raise UnavailableError(f"server {self.servers[server]}: no answer in {timeout_s:g} s ({err})"
                                   ) from err

    def checkpoint(self, at_version: int = 0) -> list[str]:
        """Each server writes its shard once every slice has reached `at_version`."""
        t = self._timeout_s
        return self._on_live_servers(lambda i, wait: self._unary(i, lambda stub: stub.Checkpoint(
            pb.CheckpointRequest(at_version=at_version, timeout_ms=int(t * 1000)),
            timeout=t + DEADLINE_SLACK_S, wait_for_ready=wait).path))

    def each_server(self, call: Callable[[int, pb_grpc.ParameterServerServiceStub], T]) -> list[T]:
        """`call(index, stub)` on every server at once, in server order (worker.checkpoint_coordinator); gRPC
        errors come back as the project's errors."""
        return self._all_servers(lambda i: self._unary(i, lambda stub: call(i, stub)))

    @property
    def timeout_s(self) -> float:
        return self._timeout_s

    # ---- fast paths (shared memory, raw TCP) ----

    def _session_room(self, server: int) -> int:
        """Room for this worker's every slice on the server, each page-aligned, in its own dtype (the wire
        dtype only ever shrinks it), and for sparse-table requests (client.tables): allocated once when a
        fast-path session is negotiated, reused by every step."""
        layout = self.layout
        dense = layout.slices_on(server) if layout is not None else ()
        return TABLE_ROOM_BYTES + sum(align(self._slice_room(s)) for s in dense)

    def _slice_room(self, s: LayoutSlice) -> int:
        """The most bytes a slice takes either way: its elements, or top-k's index and value per sent one."""
        itemsize = codec.numpy_dtype(self._param_dtype(s.key)).itemsize
        if self.compression is not None and s.key in self.compression.plan:
            itemsize = max(itemsize, 8)
        return s.numel * itemsize

    def _fast_call(self, server: int, header: pb.ExchangeHeader, buffers: Sequence[np.ndarray],
                   pulled: Sequence[LayoutSlice], out: Mapping[str, np.ndarray]) -> pb.ExchangeSummary | None:
        """The request over the server's fast path; None when there is none or it broke (the caller then
        sends the same request over gRPC: what the server already applied it drops as a duplicate)."""
        fast = self.connections.session(server)
        if fast is None:
            return None
        wire = (self.job.wire_dtype if self.job else "") or ""
        dtypes = [self._param_dtype(s.key) for s in pulled]
        wire_dtypes = [wire if wire and d in PARAM_DTYPES else d for d in dtypes]
        packs = (codec.pull_packs_from_proto(header) if header.pull_packing else None) or [None] * len(pulled)

        def place(index: int, raw: np.ndarray) -> None:
            self._place_pulled(pulled[index], packs[index], raw, wire_dtypes[index], header.stamp.clock, out)

        def direct(index: int) -> np.ndarray | None:
            s = pulled[index]
            if wire_dtypes[index] != dtypes[index] or (packs[index] is not None and packs[index].packed):
                return None
            target = out[s.key].reshape(-1)[s.offset:s.offset + s.numel]
            return target.view(np.uint8) if target.dtype == codec.numpy_dtype(dtypes[index]) else None

        try:
            return self._call_stamped(server, header.stamp, lambda: fast.call(
                header, buffers, place, direct, self._timeout_s + DEADLINE_SLACK_S))
        except TransportBroken as err:
            log.warning("server %s: %s transport broke (%s); this call completes over gRPC",
                        self.servers[server], fast.kind, err)
            self.connections.broke(server, fast)
            if isinstance(err, PeerSilent) and self._fail_fast:
                # Its host is most likely cut off: over gRPC to the same address the call would wait
                # as long again. Re-routing waits for the failover the scheduler publishes.
                raise UnavailableError(f"server {self.servers[server]}: {err}") from err
            return None

    # ---- internals ----

    def _need_layout(self) -> Layout:
        layout = self.connections.layout  # read once: every step asks three times
        if layout is None:
            raise InvalidArgumentError("no layout yet: call declare() first (or pass the scheduler's layout)")
        return layout

    @property
    def generation(self) -> int:
        return self._generation_source() if self._generation_source else self._generation

    @generation.setter
    def generation(self, value: int) -> None:
        self._generation_source = None
        self._generation = value

    def _stamp(self, clock: int, lr: float | None = None) -> pb.Stamp:
        return codec.stamp_to_proto(Stamp(self.worker_id, self.generation, clock, lr, *self.scheduled))

    @staticmethod
    def _packed_meta(s: LayoutSlice, packed: codec.WireArray) -> pb.SliceMeta:
        return pb.SliceMeta(id=codec.slice_id_to_proto(s.slice_key), dtype=codec.dtype_to_proto(packed.dtype),
                            shape=[packed.array.size], encoding=codec.encoding_to_proto(packed.encoding))

    @staticmethod
    def _meta(s: LayoutSlice, dtype: str) -> pb.SliceMeta:
        return pb.SliceMeta(id=codec.slice_id_to_proto(s.slice_key), dtype=codec.dtype_to_proto(dtype),
                            shape=[s.numel])

    def _check_grads(self, grads: Mapping[str, np.ndarray]) -> None:
        layout = self._need_layout()
        for key, g in grads.items():
            spec = layout.param(key)
            if tuple(g.shape) != spec.shape and g.size != spec.numel:
                raise ShapeMismatchError(f"gradient {key!r}: got shape {tuple(g.shape)}, parameter has "
                                         f"{spec.shape}")

    def _outputs(self, keys: Sequence[str], out: Mapping[str, np.ndarray] | None) -> dict[str, np.ndarray]:
        layout = self._need_layout()
        result: dict[str, np.ndarray] = {}
        for key in keys:
            spec = layout.param(key)
            given = out.get(key) if out else None
            if given is not None:
                if given.size != spec.numel or not given.flags.c_contiguous:
                    raise ShapeMismatchError(f"out[{key!r}]: got shape {given.shape}, expected a contiguous "
                                             f"array of {spec.shape}")
                result[key] = given
            else:
                result[key] = np.empty(spec.shape, codec.numpy_dtype(self._param_dtype(key)))
        return result

    def _all_servers(self, fn: Callable[[int], T]) -> list[T]:
        """Run fn(server) for every server concurrently; the first error wins, after all have ended."""
        self._owner.check()
        if len(self.servers) == 1:
            return [self._naming_unreachable(fn, 0)]
        futures = [self._pool.submit(self._naming_unreachable, fn, i) for i in range(len(self.servers))]
        return [f.result() for f in futures]

    def _naming_unreachable(self, fn: Callable[[int], T], server: int) -> T:
        """fn(server); a deadline passed while servers were unreachable names them, not a bare
        DEADLINE_EXCEEDED: waiting for a server nobody started looks like waiting for slow peers."""
        try:
            result = fn(server)
            self._answered[self.servers[server]] = time.monotonic()
            return result
        except PullTimeoutError as err:
            down = sorted(self.connections.unreachable)
            if not down:
                raise
            raise PullTimeoutError(
                f"parameter server(s) {', '.join(down)} (of {', '.join(self.servers)}) unreachable until "
                f"the deadline ({self._timeout_s:g} s): is each one running at that address, with the same "
                f"TLS settings as this worker? ({err})") from err

    def reached_servers(self, within_s: float) -> list[str]:
        """The servers that answered a call of this client within the last `within_s` seconds."""
        since = time.monotonic() - within_s
        return [address for address, at in list(self._answered.items()) if at >= since]

    def _unary(self, server: int, call: Callable[[pb_grpc.ParameterServerServiceStub], T]) -> T:
        """A unary call; gRPC retries it on UNAVAILABLE (the channel's retry policy)."""
        try:
            return call(self._stubs[server])
        except grpc.RpcError as err:
            raise error_from_rpc_error(err) from err

    def _stream_retrying(self, what: str, call: Callable[[], T]) -> T:
        """Retry an Exchange stream on UNAVAILABLE with jittered backoff, within the retry budget.

        gRPC does not retry a stream once frames came back, so this loop does.
        """
        start = time.monotonic()
        backoff = Backoff(stop=self._closed)
        while True:
            try:
                return call()
            except grpc.RpcError as err:
                code = err.code() if isinstance(err, grpc.Call) else None
                elapsed = time.monotonic() - start
                if code != grpc.StatusCode.UNAVAILABLE or self._closed.is_set() or self._fail_fast:
                    raise_from_rpc_error(err)
                delay = backoff.next_delay()
                if elapsed + delay > self._retry_budget_s:
                    raise UnavailableError(f"{what}: unavailable for {elapsed:.1f}s "
                                           f"(retry budget {self._retry_budget_s:.0f}s): {err.details()}"
                                           ) from err
                log.warning("%s: %s; retrying in %.2fs", what, err.details(), delay)
                if self._closed.wait(delay):
                    raise_from_rpc_error(err)

    def _unary_push_pull(self, server: int, header: pb.ExchangeHeader, buffers: Sequence[np.ndarray],
                         pulled: Sequence[LayoutSlice], out: Mapping[str, np.ndarray]) -> pb.ExchangeSummary:
        """The same step as an Exchange, as one PushPull message each way (for small payloads)."""
        request = pb.PushPullRequest(
            stamp=header.stamp, timeout_ms=header.timeout_ms, pull=header.pull,
            gradients=[tensor_pb.SliceTensor(id=m.id, tensor=tensor_pb.Tensor(dtype=m.dtype, shape=m.shape,
                                                                              data=b.tobytes()),
                                             encoding=m.encoding)
                       for m, b in zip(header.push, buffers, strict=True)])

        what = f"server {self.servers[server]}"
        response = self._call_stamped(server, request.stamp, lambda: self._backing_off(
            what, lambda left_s: self._unary(server, lambda stub: stub.PushPull(
                request, timeout=left_s + DEADLINE_SLACK_S, wait_for_ready=not self._fail_fast))))
        for s, got in zip(pulled, response.slices, strict=True):
            self._place(s, codec.slice_tensor_from_proto(got)[1], out)
        return pb.ExchangeSummary(versions=[s.version for s in response.slices],
                                  applied=response.applied, dropped=response.dropped)

    def _exchange_call(self, server: int, header: pb.ExchangeHeader, buffers: Sequence[np.ndarray],
                       pulled: Sequence[LayoutSlice], out: Mapping[str, np.ndarray]) -> pb.ExchangeSummary:
        # Large bytes over gRPC: its 4 MiB messages come from the heaps instead of fresh pages (about
        # 14k page faults per worker and dense step otherwise; pshard.common.malloc).
        keep_stream_buffers()
        what = f"server {self.servers[server]}"
        return self._call_stamped(server, header.stamp, lambda: self._backing_off(
            what, lambda left_s: self._stream_retrying(
                what, lambda: self._exchange_once(server, header, buffers, pulled, out, left_s))))

    def _backing_off(self, what: str, call: Callable[[float], T]) -> T:
        """`call(seconds left)`, again after a wait while the server says it is overloaded.

        Safe: a server applies a (worker, clock, slice) at most once, so a resent push is dropped if
        it had landed. The wait is the server's hint (or our own backoff, whichever is longer),
        stretched by up to half at random so refused clients do not come back together; the
        retries end at the call's own deadline, with the server's error.
        """
        deadline = time.monotonic() + self._timeout_s
        backoff: Backoff | None = None  # made on the first refusal: seeding its RNG costs ~13 us a call
        while True:
            try:
                return call(max(0.0, deadline - time.monotonic()))
            except OverloadedError as err:
                backoff = backoff or Backoff(stop=self._closed)
                hint_s = (err.retry_after_ms or 0) / 1000
                delay = max(hint_s * (1 + 0.5 * random.random()), backoff.next_delay())
                if time.monotonic() + delay >= deadline or self._closed.is_set():
                    raise
                self.overload_retries += 1
                log.debug("%s: %s; retrying in %.3fs", what, err, delay)
                if self._closed.wait(delay):
                    raise

    def _call_stamped(self, server: int, stamp: pb.Stamp, call: Callable[[], T]) -> T:
        """`call()`, and again under our newer generation whenever the server fenced off the old one.

        This is the one stale-generation recovery. After a scheduler restart we re-register, and a
        server can hear of our new generation (through its own Watch) before our SchedulerClient
        has the Register reply, so it refuses a request stamped with the old one. With
        `await_generation` we wait (up to the call's timeout) for the reply, then resend. Resending
        is safe: a server drops slices it already has. `stamp` is the request's own, updated in place.
        """
        while True:  # each round needs a strictly newer generation, so this ends
            try:
                return call()
            except StaleGenerationError:
                # A call can outlive more than one scheduler restart (a sync step waiting for a rejoining
                # worker): resend under each newer generation, not only the first.
                if not self._newer_generation(stamp.generation):
                    raise
                log.info("server %s: re-registered as generation %d (was %d), resending",
                         self.servers[server], self.generation, stamp.generation)
                stamp.generation = self.generation

    def _newer_generation(self, stamped: int) -> bool:
        if self.generation > stamped:
            return True
        return self._await_generation is not None and self._await_generation(stamped, self._timeout_s)

    def _param_dtype(self, key: str) -> str:
        """The parameter's dtype here: as declared, else the layout's (for a reader that never declared)."""
        return self._dtypes.get(key) or self._need_layout().param(key).dtype

    def _place(self, s: LayoutSlice, wire: codec.WireArray, out: Mapping[str, np.ndarray]) -> None:
        """Write a pulled slice into its parameter's array, undoing any wire compression."""
        values = codec.cast(wire, self._param_dtype(s.key)).array.reshape(-1)
        out[s.key].reshape(-1)[s.offset:s.offset + s.numel] = values

    def _exchange_once(self, server: int, header: pb.ExchangeHeader, buffers: Sequence[np.ndarray],
                       pulled: Sequence[LayoutSlice], out: Mapping[str, np.ndarray],
                       timeout_s: float) -> pb.ExchangeSummary:
        def frames() -> Iterator[bytes]:
            yield codec.encode_frame(pb.ExchangeRequest(header=header))
            yield from pack_frames(buffers, self._chunk, whole_slices=True)

        wire = (self.job.wire_dtype if self.job else "") or ""
        dtypes = [self._param_dtype(s.key) for s in pulled]
        wire_dtypes = [wire if wire and d in PARAM_DTYPES else d for d in dtypes]
        packs = (codec.pull_packs_from_proto(header) if header.pull_packing else None) or [None] * len(pulled)
        sizes = [self.pull_compression.nbytes(s, p) if p is not None and p.packed and self.pull_compression
                 else s.numel * codec.numpy_dtype(d).itemsize
                 for s, d, p in zip(pulled, wire_dtypes, packs, strict=True)]
        reader = SliceReader(sizes, [str(s.slice_key) for s in pulled])
        summary: pb.ExchangeSummary | None = None

        def place(index: int, buf: memoryview) -> None:
            raw = np.frombuffer(buf, dtype=np.uint8)
            self._place_pulled(pulled[index], packs[index], raw, wire_dtypes[index], header.stamp.clock, out)

        for index, buf in reader.initial():
            place(index, buf)
        call = self._exchange[server](frames(), timeout=timeout_s + DEADLINE_SLACK_S,
                                      wait_for_ready=not self._fail_fast)
        for frame in call:
            payload = codec.decode_data_frame(frame)
            if payload is None:
                message = codec.decode_response_frame(frame)
                if message.WhichOneof("body") != "summary":
                    kind = message.WhichOneof("body")
                    raise PSError(f"server {self.servers[server]}: unexpected {kind} frame")
                summary = message.summary
                continue
            for index, buf in reader.feed(payload):
                place(index, buf)
        reader.finish()
        if summary is None:
            raise PSError(f"server {self.servers[server]}: stream ended without a summary")
        return summary
