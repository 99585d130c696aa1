"""The launcher's plan of a local cluster (pure): free ports, every task's TF_CONFIG, every child's argv.

Nothing here starts a process; `pshard.launcher.supervisor` does. Children run the installed
package (``python -m pshard.<service>`` with this interpreter), so they import the same pshard
as the launcher whatever the current directory, with no PYTHONPATH of ours.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from pshard.common.logs import DEFAULT_LOG_LEVEL

TASK_PLACEHOLDER = "{task}"
# What the launcher does when the scheduler or a parameter server dies, as Kubernetes'
# restartPolicy: never (stop the job) or on-failure (start it again, on the same address).
RESTART_POLICIES = ("never", "on-failure")


# ---- ports and the cluster plan ----


def join_address(host: str, port: int) -> str:
    """``('127.0.0.1', 7000)`` -> ``'127.0.0.1:7000'``; IPv6 hosts get brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports that were free on `host` a moment ago.

    Every socket stays bound until all ports are read, so the ports differ from each other. They
    are closed before the children bind them, which leaves a short window in which another
    program could take one; the child then fails to bind, and the launcher reports that.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(family, socket.SOCK_STREAM)
            sockets.append(sock)
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


@dataclass(frozen=True)
class Task:
    """One process of the cluster: its TF_CONFIG task and address."""

    task_type: str
    index: int
    address: str

    @property
    def name(self) -> str:
        """'scheduler' (there is only one), else the node id, e.g. 'ps-0' or 'worker-1'."""
        return "scheduler" if self.task_type == "scheduler" else f"{self.task_type}-{self.index}"


@dataclass(frozen=True)
class ClusterPlan:
    """Addresses of every task; the same cluster JSON goes into each child's TF_CONFIG."""

    scheduler: str
    ps: tuple[str, ...]
    worker: tuple[str, ...]
    chief: tuple[str, ...] = ()

    @classmethod
    def allocate(cls, num_ps: int, num_workers: int, *, chief: bool = False, host: str = "127.0.0.1",
                 ports: Callable[[int, str], list[int]] = free_ports) -> ClusterPlan:
        """A plan on free ports of `host`: one scheduler, `num_ps` servers, an optional chief and
        `num_workers` workers. Workers get addresses too because TF_CONFIG names every task."""
        if num_ps < 1:
            raise ValueError(f"num_ps: got {num_ps}, expected at least 1")
        if num_workers < 0 or num_workers + chief < 1:
            raise ValueError(f"num_workers: got {num_workers} (chief={chief}), expected at least one "
                             "training process")
        addresses = [join_address(host, p) for p in ports(1 + num_ps + int(chief) + num_workers, host)]
        ps_end = 1 + num_ps
        chief_end = ps_end + int(chief)
        return cls(scheduler=addresses[0], ps=tuple(addresses[1:ps_end]),
                   chief=tuple(addresses[ps_end:chief_end]), worker=tuple(addresses[chief_end:]))

    def cluster(self) -> dict[str, list[str]]:
        jobs = {"scheduler": [self.scheduler], "ps": list(self.ps)}
        if self.chief:
            jobs["chief"] = list(self.chief)
        jobs["worker"] = list(self.worker)
        return jobs

    def tf_config(self, task: Task) -> str:
        return json.dumps({"cluster": self.cluster(), "task": {"type": task.task_type, "index": task.index}})

    @property
    def servers(self) -> list[Task]:
        """The scheduler and the parameter servers: started first, and health-checked."""
        return [Task("scheduler", 0, self.scheduler), *(Task("ps", i, a) for i, a in enumerate(self.ps))]

    @property
    def trainers(self) -> list[Task]:
        """The chief (if any) and the workers, in data-rank order."""
        return [*(Task("chief", i, a) for i, a in enumerate(self.chief)),
                *(Task("worker", i, a) for i, a in enumerate(self.worker))]


# ---- what each child runs ----


@dataclass(frozen=True)
class Options:
    """The launcher's settings, as parsed from its command line."""

    ps: int = 2
    workers: int = 2
    chief: bool = False
    host: str = "127.0.0.1"
    heartbeat_interval_ms: int = 1000
    heartbeat_timeout_ms: int = 5000
    checkpoint_dir: str | None = None
    worker_cmd: tuple[str, ...] = (sys.executable, "-m", "pshard.worker")
    worker_args: tuple[str, ...] = ()
    script: str | None = None  # `pshard launch ... train.py`: worker_cmd runs it (checked before start)
    # `pshard launch --coordinator SCRIPT`: the chief runs SCRIPT (a ClusterCoordinator, with worker_args as
    # its arguments) and the workers run `pshard worker --serve` (docs/guide/coordinator.md).
    coordinator: str | None = None
    startup_timeout_s: float = 60.0
    grace_s: float = 10.0
    log_level: str = DEFAULT_LOG_LEVEL  # the launcher's, and its servers'
    restart: str = "never"  # one of RESTART_POLICIES; trainers are never restarted
    max_restarts: int = 3  # per server, over the whole run
    restart_backoff_s: float = 1.0  # before the first restart of a server; doubles with each, up to 30 s
    checkpoint_interval_s: float = 0.0  # servers' periodic checkpoints (0: only at shutdown)
    # The run's identity, given to every child as PSHARD_JOB_ID ("" = none): the CLI makes a new one
    # per launch, so that a re-run with the same --checkpoint-dir starts fresh instead of mixing runs.
    job_id: str = ""
    resume: bool = False  # servers continue another job's checkpoint (ps --resume)
    # Backups per slice (docs/architecture.md, 9 Failures): ps --replicas, and PSHARD_REPLICAS for the
    # trainers (the default of their --replicas), so a custom --worker-cmd gets no unknown flag.
    replicas: int = 0
    # mTLS for every channel: each child gets its certificate from here (`pshard certs` layout,
    # <node id>.pem); None = no TLS (with --insecure, said loudly by every child).
    certs_dir: str | None = None
    # ps-i's raw TCP fast path listens on fast_port + i (ps --fast-port), to open in a firewall; 0: any.
    fast_port: int = 0
    # scheduler --row-partitions-per-server: table row partitions per server in the layout.
    row_partitions_per_server: int = 1
    # scheduler --rebalance-auto and --rebalance-cooldown (None: off, and the scheduler's default).
    rebalance_auto: float | None = None
    rebalance_cooldown_s: float | None = None


@dataclass(frozen=True)
class RestartDecision:
    restart: bool
    delay_s: float
    reason: str  # for the launcher's log line


def restart_decision(options: Options, code: int, restarts_so_far: int) -> RestartDecision:
    """Whether a server that exited with Popen code `code` is started again, and after how long.

    on-failure restarts a non-zero exit or a death by signal, like Kubernetes' restartPolicy, but a
    bounded number of times: a server that cannot stay up must end the job, not loop.
    """
    if options.restart != "on-failure":
        return RestartDecision(False, 0.0, "--restart is never")
    if code == 0:
        return RestartDecision(False, 0.0, "it exited 0, which on-failure does not restart")
    if restarts_so_far >= options.max_restarts:
        return RestartDecision(False, 0.0, f"it was already restarted {restarts_so_far} time(s), "
                                           f"the most --max-restarts allows")
    delay = min(30.0, options.restart_backoff_s * 2 ** restarts_so_far)
    return RestartDecision(True, delay, f"restart {restarts_so_far + 1} of {options.max_restarts}")


def trainer_restart_decision(options: Options, code: int, restarts_so_far: int) -> RestartDecision:
    """Whether a trainer that exited with Popen code `code` is started again: under on-failure only
    when a signal killed it (a negative code), as TFJob's ExitCode policy retries 128 + signal; an exit
    code of its own (a diverged run, bad flags) would only fail again."""
    if code >= 0:
        return RestartDecision(False, 0.0, "a trainer that exits by itself is not restarted")
    return restart_decision(options, code, restarts_so_far)


@dataclass(frozen=True)
class ChildSpec:
    """A child process to start: its name, command, added environment, and health address
    (servers only; workers have no health service)."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    health_address: str | None = None


def child_specs(plan: ClusterPlan, options: Options, python: str = sys.executable) -> list[ChildSpec]:
    """Servers first (scheduler, then ps in rank order), then the trainers."""
    specs: list[ChildSpec] = []
    for task in plan.servers:
        # --bind names the address explicitly: without it the services listen on 0.0.0.0, while
        # a local cluster should stay on --host.
        if task.task_type == "scheduler":
            argv = [python, "-m", "pshard.scheduler", "--bind", task.address,
                    "--heartbeat-interval-ms", str(options.heartbeat_interval_ms),
                    "--heartbeat-timeout-ms", str(options.heartbeat_timeout_ms)]
            if options.row_partitions_per_server > 1:
                argv += ["--row-partitions-per-server", str(options.row_partitions_per_server)]
            if options.rebalance_auto is not None:
                argv += ["--rebalance-auto", f"{options.rebalance_auto:g}"]
            if options.rebalance_cooldown_s is not None:
                argv += ["--rebalance-cooldown", f"{options.rebalance_cooldown_s:g}"]
        else:
            argv = [python, "-m", "pshard.ps_server", "--bind", task.address]
            if options.replicas:
                argv += ["--replicas", str(options.replicas)]
            if options.fast_port:
                argv += ["--fast-port", str(options.fast_port + task.index)]
            shared = global_checkpoint_dir(options.worker_args)
            if shared is not None:  # servers write and read global checkpoints only under the chief's root
                argv += ["--global-checkpoint-dir", shared]
            if options.checkpoint_dir:
                argv += ["--checkpoint-dir", str(Path(options.checkpoint_dir) / task.name)]
                if options.resume:
                    argv += ["--resume"]
                if options.checkpoint_interval_s > 0:
                    argv += ["--checkpoint-interval-s", f"{options.checkpoint_interval_s:g}"]
        if options.log_level != DEFAULT_LOG_LEVEL:
            argv += ["--log-level", options.log_level]
        env = _child_env(plan, task, options.job_id, options.certs_dir)
        specs.append(ChildSpec(task.name, tuple(argv), env, task.address))
    for task in plan.trainers:
        args = [a.replace(TASK_PLACEHOLDER, task.name) for a in options.worker_args]
        if options.coordinator is not None:
            specs.append(_coordinated(plan, options, task, args, python))
            continue
        env = _child_env(plan, task, options.job_id, options.certs_dir)
        if options.replicas:
            env = {**env, "PSHARD_REPLICAS": str(options.replicas)}
        if options.script is not None:
            # What `pshard worker` sets for itself (see its module): OpenMP's busy-waiting starves the
            # gRPC threads on a host shared with servers and peers, as torchrun sets OMP_NUM_THREADS.
            env = {**env, "OMP_WAIT_POLICY": "PASSIVE"}
        specs.append(ChildSpec(task.name, (*options.worker_cmd, *args), env))
    return specs


def _coordinated(plan: ClusterPlan, options: Options, task: Task, args: Sequence[str],
                 python: str) -> ChildSpec:
    """The coordinator's job: the chief runs the script with `args`, every worker serves its functions."""
    assert options.coordinator is not None
    env = _child_env(plan, task, options.job_id, options.certs_dir)
    if options.replicas:
        env = {**env, "PSHARD_REPLICAS": str(options.replicas)}
    env = {**env, "OMP_WAIT_POLICY": "PASSIVE"}  # as for a script: see child_specs
    if task.task_type == "chief":
        return ChildSpec(task.name, (python, options.coordinator, *args), env)
    argv = [python, "-m", "pshard.worker", "--serve"]
    if options.log_level != DEFAULT_LOG_LEVEL:
        argv += ["--log-level", options.log_level]
    return ChildSpec(task.name, tuple(argv), env)


def global_checkpoint_dir(worker_args: Sequence[str]) -> str | None:
    """The trainers' --global-checkpoint-dir (absolute: the children share the launcher's directory)."""
    for i, arg in enumerate(worker_args):
        if arg == "--global-checkpoint-dir" and i + 1 < len(worker_args):
            return str(Path(worker_args[i + 1]).absolute())
        if arg.startswith("--global-checkpoint-dir="):
            return str(Path(arg.split("=", 1)[1]).absolute())
    return None


def _child_env(plan: ClusterPlan, task: Task, job_id: str = "",
               certs_dir: str | None = None) -> dict[str, str]:
    # Unbuffered: otherwise a child's output reaches the launcher in 8 KiB blocks, late and
    # out of order with the other children's.
    env = {"TF_CONFIG": plan.tf_config(task), "PYTHONUNBUFFERED": "1"}
    if job_id:
        env["PSHARD_JOB_ID"] = job_id
    if certs_dir is not None:
        env.update(tls_env(certs_dir, f"{task.task_type}-{task.index}"))
    return env


def tls_env(certs_dir: str, name: str) -> dict[str, str]:
    """The PSHARD_TLS_* variables of the node whose files `pshard certs` named `name` in `certs_dir`."""
    base = Path(certs_dir)
    return {"PSHARD_TLS_CERT": str(base / f"{name}.pem"), "PSHARD_TLS_KEY": str(base / f"{name}-key.pem"),
            "PSHARD_TLS_CA": str(base / "ca.pem"), "PSHARD_TLS_CRL": str(base / "crl.pem")}


def cert_names(plan: ClusterPlan) -> list[tuple[str, str]]:
    """(role, node id) of every task of `plan`: the certificates a secure launch needs."""
    return [(t.task_type, f"{t.task_type}-{t.index}") for t in (*plan.servers, *plan.trainers)]


def child_environment(added: Mapping[str, str], base: Mapping[str, str]) -> dict[str, str]:
    """`base` with `added` laid over it; the package is installed, so nothing is added to PYTHONPATH."""
    return {**base, **added}
