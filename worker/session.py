"""`ClusterSession`: one task's part in the cluster protocol, shared by the trainer and the evaluator.

    host the scheduler (the chief, or worker 0, of a cluster without a scheduler task)
    register -> trainers propose the layout / the evaluator waits for it -> a PSClient on it
    trainers: barrier "start" -> every server counts every worker (sync and ssp)
    ... the caller trains or evaluates, reporting its clock ...
    leave (the chief first waits until its peers are done)

Heartbeats and the Watch stream run in the SchedulerClient's threads, and so does re-registering
after a scheduler restart. The one stale-generation recovery is the PSClient's resend, which
waits here for the re-registration (`_await_generation`). See docs/architecture.md, sections 3
(Membership) and 9 (Failures).

Each step runs as a named stage: a failure raises `StageError`, which names it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

from pshard.client.ps_client import PSClient
from pshard.common.cluster.layout import Layout, ParamSpec
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.cluster.spec import ClusterSpec
from pshard.common.cluster.view import TRAINER_ROLES, ClusterView, NodeState
from pshard.common.entry import check_can_listen
from pshard.common.errors import (
    BarrierTimeoutError,
    ClusterConfigError,
    PSError,
    PullTimeoutError,
    UnavailableError,
)
from pshard.common.failpoints import failpoint
from pshard.common.job import JobConfig
from pshard.common.rpc.bind import default_bind
from pshard.common.security.credentials import SecurityConfig, security_from_args
from pshard.worker.config import Defaults, default_job_id, stage
from pshard.worker.elastic import Roster
from pshard.worker.server_watch import LostServer, ServerWatch
from pshard.worker.waiting import Peer, PeerWait

log = logging.getLogger("pshard.worker")

_QUORUM_POLL_START_S = 0.02
_QUORUM_POLL_MAX_S = 0.5


class _Stoppable(Protocol):
    def stop(self, timeout_s: float = ...) -> None: ...


def training_over(view: ClusterView) -> bool:
    """Some worker has joined, and none is live any more."""
    trainers = [n for n in view.nodes if n.role in TRAINER_ROLES]
    return bool(trainers) and all(n.state is not NodeState.LIVE for n in trainers)


class ClusterSession:
    """Membership of one chief, worker or evaluator task; `close()` it in a `finally`."""

    def __init__(self, spec: ClusterSpec, *, startup_timeout_s: float, step_timeout_s: float,
                 transport: str = "auto", shm_dir: str = "/dev/shm",
                 security: SecurityConfig | None = None, bind: str | None = None, replicas: int = 0) -> None:
        """`security`: TLS files or tokens of this task (pshard.common.security.credentials; default plain);
        `bind`: where a hosted scheduler listens (default pshard.common.rpc.bind)."""
        self.spec = spec
        self.replicas = replicas  # proposed with the layout; the servers get the same --replicas
        self.security = (security or SecurityConfig()).for_node(spec.task_type, spec.node_id)
        self._bind = bind
        self.transport, self.shm_dir = transport, shm_dir  # for PSClient
        self.startup_timeout_s = startup_timeout_s
        self.step_timeout_s = step_timeout_s
        self.scheduler: SchedulerClient | None = None
        self.client: PSClient | None = None
        self._hosted: _Stoppable | None = None
        self._left = False
        # Set when the scheduler could not be reached to leave: the end of the run then goes by what
        # the servers show, since no view will come (docs/architecture.md, 9 Failures).
        self.scheduler_lost = False
        # Set when a parameter server the job needs is gone for good (ServerWatch): the PSClient is
        # closed then, so the step waiting on it ends now, and the run reports this instead.
        self.lost_server: LostServer | None = None
        self.fenced: PSError | None = None  # set when a newer incarnation of this node fenced it out
        self._roster = Roster()  # the view that splits a clock's union batch (worker.elastic)
        self._watch_stop = threading.Event()

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None, *,
                         startup_timeout_s: float = Defaults.STARTUP_TIMEOUT_S,
                         step_timeout_s: float = Defaults.STEP_TIMEOUT_S,
                         transport: str = Defaults.TRANSPORT) -> ClusterSession:
        """The session of the trainer task the environment describes, as `pshard launch`, compose and a
        TFJob set it: TF_CONFIG, the PSHARD_TLS_* / PSHARD_TOKEN_FILE files, PSHARD_REPLICAS and
        PSHARD_JOB_ID. Raises ClusterConfigError naming what is missing or wrong."""
        env = os.environ if environ is None else environ
        raw = env.get("TF_CONFIG")
        if not raw:
            raise ClusterConfigError(
                "TF_CONFIG: not set; a trainer without a PSClient joins the cluster TF_CONFIG describes "
                "(pshard launch, docker compose and a TFJob set it): run the script under 'pshard launch "
                "... script.py', or pass a PSClient")
        spec = ClusterSpec.from_tf_config(raw)
        if spec.task_type not in TRAINER_ROLES:
            raise ClusterConfigError(f"task.type: got {spec.task_type!r}, a training script runs as one of "
                                     f"{sorted(TRAINER_ROLES)}")
        if not spec.ps:
            raise ClusterConfigError("cluster.ps: got no parameter servers, a worker needs at least one")
        security = security_from_args(argparse.Namespace(), env, role=spec.task_type, node_id=spec.node_id)
        replicas = env.get("PSHARD_REPLICAS") or "0"
        if not replicas.isdigit():
            raise ClusterConfigError(f"PSHARD_REPLICAS: got {replicas!r}, expected a whole number >= 0")
        session = cls(spec, startup_timeout_s=startup_timeout_s, step_timeout_s=step_timeout_s,
                      transport=transport, security=security, replicas=int(replicas))
        session.job_id = env.get("PSHARD_JOB_ID") or default_job_id(spec)
        return session

    job_id = ""  # from_environment: the job's identity, for a JobConfig that names none

    def job_of(self, job: JobConfig) -> JobConfig:
        """`job`, with this session's job id when it names none (every task of a launch shares it)."""
        return job if job.job_id or not self.job_id else replace(job, job_id=self.job_id)

    def join(self, params: Sequence[ParamSpec]) -> PSClient:
        """Trainers: host the scheduler if this task must, register, agree on the layout of `params`,
        and connect. Next: declare (inside `waiting_for_servers(client.layout)`), then `await_start`."""
        self.host_scheduler_if_needed()
        self.register()
        return self.connect(self.propose_layout(params))

    @property
    def rank(self) -> int:
        """The data-parallel rank (chief first); evaluators have none and read as 0."""
        return self.spec.data_rank or 0

    @property
    def is_chief(self) -> bool:
        """The chief, or worker 0 when the cluster has none (TensorFlow's rule)."""
        spec = self.spec
        return spec.task_type == "chief" or (spec.task_type == "worker" and spec.task_index == 0
                                             and not spec.chief)

    # ---- joining ----

    def host_scheduler_if_needed(self) -> None:
        """The chief (or worker 0) of a cluster without a scheduler task runs the scheduler in-process.

        A port it cannot listen on is a ClusterConfigError (exit 2): TF_CONFIG names this address.
        """
        if not self.spec.hosts_scheduler:
            return
        bind = self._bind or default_bind(self.spec.listen_address, self.spec.own_address)
        where = (f"{self.spec.node_id} hosts the scheduler at {self.spec.scheduler_address} (the cluster "
                 "has no scheduler task)")
        try:
            check_can_listen(bind)
        except ClusterConfigError as e:
            raise ClusterConfigError(f"{where}, but {e}") from None
        with stage("scheduler", "starting the in-process scheduler"):
            # The one place a worker imports the scheduler service, and only when it hosts it.
            from pshard.scheduler.service import start_scheduler_thread

            try:
                self._hosted = start_scheduler_thread(bind, security=self.security)
            except OSError as e:  # taken between the check and the bind
                raise ClusterConfigError(f"{where}, but {e}") from None

    @property
    def hosted_scheduler(self) -> Any | None:
        """The in-process scheduler this task hosts (a scheduler.service.SchedulerHandle), if any."""
        return self._hosted

    def register(self) -> SchedulerClient:
        spec = self.spec
        with stage("register", f"registering with the scheduler at {spec.scheduler_address}"):
            rank_hint = spec.data_rank if spec.task_type in TRAINER_ROLES else spec.task_index
            sched = self.scheduler = SchedulerClient(
                spec.scheduler_address, spec.task_type, own_address=spec.own_address or "",
                node_id=spec.node_id, rank_hint=rank_hint, connect_timeout_s=self.startup_timeout_s,
                security=self.security)
            sched.add_view_callback(lambda view: self._roster.offer(view, time.monotonic()))
            host = "the scheduler" + ("" if spec.scheduler else f" (hosted by {self._scheduler_host()})")
            with self._peer_wait("registering", lambda: [Peer(host, spec.scheduler_address, listens=True)],
                                 sched.close):
                sched.register()
        return sched

    def _scheduler_host(self) -> str:
        """The task that runs the scheduler in a cluster without a scheduler task: chief 0, else worker 0."""
        return "chief-0" if self.spec.chief else "worker-0"

    def _peer_wait(self, what: str, pending: Callable[[], list[Peer]], abort: Callable[[], None]) -> PeerWait:
        # Half the start-up timeout, at most 30 s: long enough for peers started by hand one after the
        # other, short enough that an address nobody serves fails in seconds rather than minutes.
        return PeerWait(what, pending, abort, refused_grace_s=min(30.0, self.startup_timeout_s / 2),
                        tls=self.security.client_ssl_context if self.security.tls else None)

    def waiting_for_servers(self, layout: Layout) -> PeerWait:
        """Around the Declare: names the servers not answering, ends the wait for one that is gone."""
        sched, client = self._registered(), self._connected()

        def pending() -> list[Peer]:
            view = sched.view
            nodes = {n.address: n for n in view.nodes if n.role == "ps"} if view else {}
            peers = []
            for i, address in enumerate(layout.servers):
                node = nodes.get(address)
                name = node.node_id if node else f"ps-{i}"
                gone = node is not None and node.state is not NodeState.LIVE
                state = f"{node.state.value} for the scheduler" if node is not None and gone else ""
                peers.append(Peer(name, address, state, listens=True, gone=gone))
            return peers

        return self._peer_wait(f"declaring the parameters on {len(layout.servers)} server(s)", pending,
                               client.close)

    def propose_layout(self, params: Sequence[ParamSpec]) -> Layout:
        """Trainers: propose the layout of `params`; the first proposal wins and everyone gets it."""
        sched = self._registered()
        with stage("layout", "agreeing on the parameter layout"):
            return sched.propose_layout(params, servers=self.spec.ps, replicas=self.replicas)

    def await_layout(self) -> Layout:
        """Readers (the evaluator): the layout the trainers agreed on, once one has proposed it."""
        sched = self._registered()
        with stage("register", f"waiting for the layout at {self.spec.scheduler_address}"):
            return sched.get_layout(timeout_s=self.startup_timeout_s)

    def connect(self, layout: Layout) -> PSClient:
        """A PSClient on the layout's servers, stamping every request with our current generation."""
        sched = self._registered()
        # Read at every request: after a scheduler restart the SchedulerClient re-registers under a
        # new generation, and the servers refuse requests stamped with the old one (fencing).
        self.client = PSClient(layout.servers, self.spec.node_id, layout=layout,
                               generation=lambda: sched.generation, await_generation=self._await_generation,
                               timeout_s=self.step_timeout_s, transport=self.transport, shm_dir=self.shm_dir,
                               security=self.security, relayout=self._newer_layout,
                               reroute_wait_s=3 * sched.heartbeat_timeout_s,
                               dead_after_s=sched.heartbeat_timeout_s)
        sched.report_reached(self.client.reached_servers)  # the scheduler keeps a server only it cannot hear
        threading.Thread(target=self._watch_servers, args=(layout, self.client), name="server-watch",
                         daemon=True).start()
        return self.client

    def _newer_layout(self, layout: Layout, timeout_s: float) -> Layout | None:
        """The scheduler's layout once it is newer than `layout` (a failover), None at the timeout;
        SlicesLostError once the scheduler names a server `layout` needs as lost (SchedulerClient)."""
        return self._registered().newer_layout(layout, timeout_s)

    @property
    def _restores(self) -> bool:
        """Whether this task gives a restarted scheduler the layout back: the chief, or worker-0 of a
        job without one; the scheduler takes it from no other worker (docs/architecture.md, 9)."""
        spec = self.spec
        return spec.task_type == "chief" or (spec.task_type == "worker" and spec.task_index == 0
                                             and not spec.chief)

    def _restore_layout(self, layout: Layout) -> None:
        """The scheduler restarted and forgot the failovers: give it back the layout we route by."""
        try:
            kept = self._registered().restore_layout(layout)
        except PSError as e:  # the next look tries again
            log.warning("could not give the restarted scheduler layout version %d: %s", layout.version, e)
            return
        if kept.version == layout.version:
            log.warning("FAILOVER: the scheduler restarted; gave it back layout version %d", layout.version)

    def _watch_servers(self, layout: Layout, client: PSClient) -> None:
        """Fail the run within a few heartbeats of losing a server, naming it (see ServerWatch); a
        server restarted within a heartbeat timeout of being declared dead is waited for."""
        sched = self._registered()
        watch = ServerWatch(layout, grace_s=sched.heartbeat_timeout_s)
        while not self._watch_stop.wait(min(0.5, sched.heartbeat_interval_s)):
            if sched.fenced is not None:
                # A newer incarnation of this node registered: nothing this process sends counts any
                # more, so end the step in flight now rather than at its deadline (issue 23, item 3).
                self.fenced = sched.fenced
                client.close()
                return
            view = sched.view
            if (view is not None and layout.replicas and view.layout_version < layout.version
                    and self._restores):
                self._restore_layout(max((layout, client.layout or layout), key=lambda known: known.version))
            if view is not None and layout.replicas and view.layout_version > layout.version:
                # A failover moved the dead server's slices to a live backup: it is no longer needed.
                newer = self._newer_layout(layout, sched.heartbeat_timeout_s)
                if newer is not None:
                    layout, watch = newer, ServerWatch(newer, grace_s=sched.heartbeat_timeout_s)
            lost = watch.observe(view, time.monotonic(), leaving_ok=self._left) if view is not None else None
            if lost is not None:
                self.lost_server = lost
                log.error("%s", lost.message)
                client.close()
                return

    def await_start(self, clock: int, *, wait_for_quorum: bool) -> None:
        """Trainers: the start barrier (unless resuming mid-job), then every server's full quorum."""
        sched = self._registered()
        world = self.spec.world_size
        if self.spec.joining:
            # Not one of the `world` the start barrier counts. Before the job's first clock it waits
            # until they all registered, so that clock 0's quorum holds them all; later it just enters.
            if clock == 0:
                self._await_original_trainers(world)
        elif clock == 0:  # a worker restarted mid-job must not wait for a start everyone passed
            with stage("barrier", f"waiting for {world} workers at the start barrier"), \
                    self._peer_wait("the start barrier", self._missing_trainers, sched.close):
                try:
                    sched.barrier("start", count=world, timeout_s=self.startup_timeout_s)
                except BarrierTimeoutError as e:
                    # The scheduler knows only who registered; TF_CONFIG knows who should have.
                    missing = self._missing_trainers()
                    if not missing:
                        raise
                    raise BarrierTimeoutError(f"{e}; missing: " + ", ".join(
                        f"{p.name} at {p.address} ({p.state})" for p in missing)) from None
        if wait_for_quorum:
            with stage("quorum", "waiting for the servers to see every worker"):
                view = sched.view
                self._await_server_quorum(set(view.live_workers()) if view else set())

    def _await_original_trainers(self, world: int) -> None:
        sched, me = self._registered(), self.spec.node_id
        with stage("barrier", f"joining: waiting for the job's {world} workers to register"), \
                self._peer_wait("joining the job", self._missing_trainers, sched.close):
            sched.wait_for_view(lambda view: len(set(view.live_workers()) - {me}) >= world,
                                timeout_s=self.startup_timeout_s)

    def _missing_trainers(self) -> list[Peer]:
        """The trainers TF_CONFIG names that the scheduler does not have as live members."""
        spec, view = self.spec, self._registered().view
        nodes = {n.node_id: n for n in view.nodes} if view else {}
        peers = []
        for role, addresses in (("chief", spec.chief), ("worker", spec.worker)):
            for index, address in enumerate(addresses):
                node_id = f"{role}-{index}"
                node = nodes.get(node_id)
                if node_id == spec.node_id or (node is not None and node.state is NodeState.LIVE):
                    continue
                state = "not registered with the scheduler" if node is None else {
                    NodeState.DEAD: "declared dead by the scheduler", NodeState.LEFT: "already left the job",
                }[node.state]
                peers.append(Peer(node_id, address, state, gone=node is not None))
        return peers

    def _await_server_quorum(self, expected: set[str]) -> None:
        """Before clock 0, every server must count every worker, or a sync clock completes without one.

        The barrier proves the scheduler has everyone; the servers learn it from the Watch stream,
        a moment later. Polling GetStats is cheap and happens once.
        """
        client = self._connected()
        deadline = time.monotonic() + self.startup_timeout_s
        delay = _QUORUM_POLL_START_S
        while True:
            # Only servers holding slices take part in a clock; with replicas a failover can leave one
            # holding none (a restarted backup never declared), whose quorum nobody waits on.
            quorums = [set(s.quorum) for s in client.stats() if s.slices]
            if all(expected <= q for q in quorums):
                return
            if time.monotonic() > deadline:
                raise PullTimeoutError(f"after {self.startup_timeout_s:g} s the servers' quorums are "
                                       f"{[sorted(q) for q in quorums]}, expected {sorted(expected)}")
            time.sleep(delay)
            delay = min(delay * 2, _QUORUM_POLL_MAX_S)

    # ---- while running ----

    def split_view(self) -> ClusterView | None:
        """The view whose live trainers split a clock's union batch: the scheduler's latest, where a node
        a restarted scheduler has not heard from yet stays as it was for as long as the servers keep it
        in their quorum (twice the heartbeat timeout, ps_server.core.quorum), so every worker splits alike."""
        sched = self.scheduler
        if sched is None:
            return None
        return self._roster.view(time.monotonic(), 2 * sched.heartbeat_timeout_s)

    def report_clock(self, clock: int) -> None:
        self._registered().report_clock(clock)

    def wait_for_training_over(self, timeout_s: float) -> bool:
        """True once no worker is live any more; False when `timeout_s` passed first."""
        try:
            self._registered().wait_for_view(training_over, timeout_s=timeout_s)
            return True
        except PullTimeoutError:
            return False

    def _await_generation(self, stamped: int, timeout_s: float) -> bool:
        """For the PSClient: wait until we re-registered under a generation newer than `stamped`."""
        sched = self._registered()
        try:
            sched.wait_for_view(lambda _view: sched.generation > stamped or sched.fenced is not None,
                                timeout_s)
        except PullTimeoutError:
            log.warning("fenced out at generation %d and not re-registered within %g s", stamped, timeout_s)
            return False
        return sched.generation > stamped

    # ---- the end ----

    def await_peers(self) -> None:
        """The chief: until no other worker is live; gives up (saying so) when none progressed for a
        step timeout."""
        failpoint("worker.before_await_peers")
        sched = self._registered()
        me = self.spec.node_id

        def nobody_else(view: ClusterView) -> bool:
            return not set(view.live_workers()) - {me}

        with stage("peers", "waiting for the other workers to finish"):
            progress = self._peer_clocks()
            if self.scheduler_lost:
                self._await_peers_without_scheduler(progress)
                return
            while True:
                try:
                    sched.wait_for_view(nobody_else, timeout_s=self.step_timeout_s)
                    return
                except PullTimeoutError:
                    now = self._peer_clocks()
                    if now == progress:
                        view = sched.view
                        log.warning("workers %s are live but made no progress in %g s; using the weights "
                                    "as they are", sorted(set(view.live_workers()) - {me}) if view else "?",
                                    self.step_timeout_s)
                        return
                    progress = now

    def _await_peers_without_scheduler(self, progress: dict[str, int]) -> None:
        """No scheduler to say who is live: wait while the servers show the peers' clocks moving, and
        stop at the first heartbeat timeout in which none moved (the peers are done, or stuck)."""
        sched = self._registered()
        interval = max(1.0, sched.heartbeat_timeout_s)
        deadline = time.monotonic() + self.step_timeout_s * 10
        while time.monotonic() < deadline:
            time.sleep(interval)
            now = self._peer_clocks()
            if now == progress:
                break
            progress = now
        others = {w: c for w, c in progress.items() if w != self.spec.node_id}
        log.warning("scheduler %s is unreachable, so who is still training is unknown; the servers show no "
                    "progress for %g s (last clocks %s): using the weights as they are", sched.address,
                    interval, others or "none")

    def _peer_clocks(self) -> dict[str, int]:
        clocks: dict[str, int] = {}
        with contextlib.suppress(PSError):
            for stats in self._connected().stats(serving_only=True):
                for worker, clock in stats.worker_clocks.items():
                    clocks[worker] = max(clocks.get(worker, -1), clock)
        return clocks

    def leave(self) -> None:
        """Out of data: leave, so the sync quorum shrinks at this clock boundary and peers go on."""
        if self.scheduler is not None and not self._left:
            with stage("leave", "leaving the cluster"):
                try:
                    self.scheduler.leave()
                except UnavailableError as e:
                    # Training is over: a dead scheduler must not cost the run its result (the chief
                    # still evaluates and saves). Peers in sync mode go on waiting for us only until
                    # a scheduler declares us dead.
                    log.warning("could not leave the cluster, the scheduler at %s is unreachable (%s); "
                                "finishing without it", self.scheduler.address, e)
                    self.scheduler_lost = True
            self._left = True

    def leave_quietly(self) -> None:
        """After a failure: leave if we can, so nobody waits for us; the failure is reported already."""
        try:
            self.leave()
        except PSError as e:
            log.warning("%s", e)

    def close(self) -> None:
        """Close the PSClient and the scheduler client; stop a hosted scheduler. Safe to call twice."""
        self._watch_stop.set()
        if self.client is not None:
            self.client.close()
        if self.scheduler is not None:
            self.scheduler.close()
        if self._hosted is not None:
            self._hosted.stop()
            self._hosted = None

    # ---- internals ----

    def _registered(self) -> SchedulerClient:
        if self.scheduler is None:
            raise PSError("cluster session: register() first")
        return self.scheduler

    def _connected(self) -> PSClient:
        if self.client is None:
            raise PSError("cluster session: connect() first")
        return self.client
