"""``python -m pshard.launcher``: a whole pshard cluster as real OS processes on one host (DESIGN §10).

    python -m pshard.launcher --ps 2 --workers 2 -- --mode sync --epochs 2 --output runs/model.pt

starts ``python -m pshard.scheduler`` and N ``python -m pshard.ps_server``, waits until each answers its gRPC
health check, then starts M ``python -m pshard.worker`` (plus a chief with ``--chief``). Each child
gets its own TF_CONFIG naming the whole cluster on free ports of ``--host``. Every line a child
writes is printed prefixed with its name (``[ps-0] ...``). The exit status is the workers': 0
only when every worker exited 0. A failing child, Ctrl-C or SIGTERM stops every child: SIGTERM
to its process group, SIGKILL after ``--grace-s``.

Each child runs in a session (process group) of its own, for two reasons: Ctrl-C in a terminal
reaches the launcher alone, so the launcher decides the order of shutdown; and signalling the
group also reaches whatever the child started itself (data-loader processes), so nothing is
left behind as an orphan.

The pure parts (port allocation, the cluster plan and its TF_CONFIGs, the child commands, line
prefixing) are separate from `Supervisor`, which owns the processes.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import json
import os
import queue
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TextIO

from pshard.common.argtypes import positive_float
from pshard.common.health import probe

PROG = "python -m pshard.launcher"
# The repository root: children import `scheduler`, `ps_server` and `worker` from the same tree
# as the launcher, whatever the current directory.
ROOT = Path(__file__).resolve().parents[1]
TASK_PLACEHOLDER = "{task}"
_PROBE_INTERVAL_S = 0.2
_PROBE_TIMEOUT_S = 2.0
# After a child exits, how long its output thread may keep reading: a grandchild that inherited
# the pipe could hold it open indefinitely, and must not delay the exit report.
_DRAIN_TIMEOUT_S = 2.0
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# ---- ports and the cluster plan (pure) ----


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


# ---- what each child runs (pure) ----


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
    startup_timeout_s: float = 60.0
    grace_s: float = 10.0


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
        else:
            argv = [python, "-m", "pshard.ps_server", "--bind", task.address]
            if options.checkpoint_dir:
                argv += ["--checkpoint-dir", str(Path(options.checkpoint_dir) / task.name)]
        specs.append(ChildSpec(task.name, tuple(argv), _child_env(plan, task), task.address))
    for task in plan.trainers:
        args = [a.replace(TASK_PLACEHOLDER, task.name) for a in options.worker_args]
        specs.append(ChildSpec(task.name, (*options.worker_cmd, *args), _child_env(plan, task)))
    return specs


def _child_env(plan: ClusterPlan, task: Task) -> dict[str, str]:
    # Unbuffered: otherwise a child's output reaches the launcher in 8 KiB blocks, late and
    # out of order with the other children's.
    return {"TF_CONFIG": plan.tf_config(task), "PYTHONUNBUFFERED": "1"}


def child_environment(added: Mapping[str, str], base: Mapping[str, str]) -> dict[str, str]:
    """`base` with `added` laid over it and the repository root first on PYTHONPATH."""
    env = {**base, **added}
    path = [str(ROOT), *(p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT))]
    env["PYTHONPATH"] = os.pathsep.join(path)
    return env


# ---- output (pure) ----

# A carriage return ends a line too: a progress bar redraws itself with them, and unprefixed
# redraws would run into the other children's lines.
_LINE_END = re.compile(r"\r\n|\r|\n")


class LinePrefixer:
    """Cuts a child's output bytes into lines, each prefixed with the child's name.

    Bytes may arrive split anywhere, even inside a UTF-8 character; undecodable bytes become
    U+FFFD rather than an error. Blank lines are dropped: once prefixed they carry nothing.
    """

    def __init__(self, name: str) -> None:
        self.prefix = f"[{name}] "
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""

    def feed(self, data: bytes) -> list[str]:
        """The complete lines that `data` finishes; the rest waits for more."""
        parts = _LINE_END.split(self._pending + self._decoder.decode(data))
        self._pending = parts.pop()
        return [self.prefix + p for p in parts if p.strip()]

    def close(self) -> list[str]:
        """The last, unterminated line, if any."""
        last = self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        return [self.prefix + p for p in _LINE_END.split(last) if p.strip()]


def describe_exit(code: int | None) -> str:
    """``0``, ``3``, ``SIGKILL`` (a negative Popen code), or ``not-started``."""
    if code is None:
        return "not-started"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal-{-code}"
    return str(code)


def summary_line(codes: Mapping[str, int | None], status: int) -> str:
    """``launcher: exit 1: worker-0=0 worker-1=2``: each trainer's exit, then the launcher's."""
    parts = " ".join(f"{name}={describe_exit(code)}" for name, code in codes.items())
    return f"launcher: exit {status}: {parts}"


def status_of(code: int) -> int:
    """The launcher's exit status for a failing child's Popen code (a signal -> 128 + signal)."""
    if code < 0:
        return 128 - code
    return code if 0 < code < 256 else 1


# ---- processes ----

# ("exit", child name, Popen returncode) or ("signal", signal name, signal number).
Event = tuple[str, str, int]


class Supervisor:
    """Starts children, relays their output prefixed, reports their exits, and stops them.

    One thread per child reads its output; another waits for its exit and posts it to `events`,
    which the signal handlers post to as well, so the main thread waits on one queue for all.
    """

    def __init__(self, out: TextIO, grace_s: float) -> None:
        self._out = out
        self._out_lock = threading.Lock()
        self.grace_s = grace_s
        # SimpleQueue, because its put() is safe to call from a signal handler.
        self.events: queue.SimpleQueue[Event] = queue.SimpleQueue()
        self.children: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, spec: ChildSpec, base_env: Mapping[str, str]) -> None:
        proc = subprocess.Popen(spec.argv, env=child_environment(spec.env, base_env), cwd=os.getcwd(),
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        self.children[spec.name] = proc
        pump = threading.Thread(target=self._pump, args=(spec.name, proc), name=f"out-{spec.name}",
                                daemon=True)
        pump.start()
        threading.Thread(target=self._wait, args=(spec.name, proc, pump), name=f"wait-{spec.name}",
                         daemon=True).start()

    def say(self, message: str) -> None:
        self.emit([f"launcher: {message}"])

    def emit(self, lines: Sequence[str]) -> None:
        if lines:
            with self._out_lock:
                self._out.write("".join(line + "\n" for line in lines))
                self._out.flush()

    def stop(self, names: Iterable[str] | None = None) -> None:
        """SIGTERM each child's process group, then SIGKILL it after the grace period.

        The SIGKILL goes to every group, even of children that already exited: it reaches what
        they left behind in their group.
        """
        names = list(self.children if names is None else names)
        for name in names:
            if self.children[name].returncode is None:
                self._signal_group(name, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        for name in names:
            try:
                self.children[name].wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.say(f"{name} still running {self.grace_s:g}s after SIGTERM; sending SIGKILL")
        for name in names:
            self._signal_group(name, signal.SIGKILL)
            try:
                self.children[name].wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                self.say(f"{name} (pid {self.children[name].pid}) survived SIGKILL")

    def _signal_group(self, name: str, sig: signal.Signals) -> None:
        # start_new_session made the child the leader of its own group: pgid == pid.
        with contextlib.suppress(ProcessLookupError, PermissionError):  # gone: nothing to stop
            os.killpg(self.children[name].pid, sig)

    def _pump(self, name: str, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        prefixer = LinePrefixer(name)
        # os.read returns what is there, not a full buffer: lines are relayed as they come.
        while chunk := os.read(proc.stdout.fileno(), 65536):
            self.emit(prefixer.feed(chunk))
        self.emit(prefixer.close())

    def _wait(self, name: str, proc: subprocess.Popen[bytes], pump: threading.Thread) -> None:
        code = proc.wait()
        # The child's last lines come before the report of its exit.
        pump.join(timeout=_DRAIN_TIMEOUT_S)
        self.events.put(("exit", name, code))


class _Stopped(Exception):
    """The launcher was asked to stop (Ctrl-C, SIGTERM, SIGHUP)."""

    def __init__(self, sig: int) -> None:
        super().__init__(signal.Signals(sig).name)
        self.sig = sig


def _await_healthy(sup: Supervisor, servers: Sequence[ChildSpec], timeout_s: float) -> str | None:
    """None once every server answers SERVING; else why not (a server exited, or the deadline)."""
    deadline = time.monotonic() + timeout_s
    pending = {s.name: s.health_address for s in servers if s.health_address}
    reasons: dict[str, str] = {}
    while True:
        for name, address in list(pending.items()):
            remaining = deadline - time.monotonic()
            serving, reasons[name] = probe(address, timeout_s=max(0.1, min(_PROBE_TIMEOUT_S, remaining)))
            if serving:
                del pending[name]
        if not pending:
            return None
        if time.monotonic() >= deadline:
            return (f"not healthy within {timeout_s:g}s: "
                    + "; ".join(f"{name}: {reasons[name]}" for name in pending))
        try:
            # Waiting on the event queue doubles as the probe interval and notices at once a
            # server that exits (a bad flag, a port taken) instead of waiting out the deadline.
            kind, name, value = sup.events.get(timeout=_PROBE_INTERVAL_S)
        except queue.Empty:
            continue
        if kind == "signal":
            raise _Stopped(value)
        return f"{name} exited ({describe_exit(value)}) before it was healthy"


def _supervise(sup: Supervisor, specs: Sequence[ChildSpec], options: Options,
               environ: Mapping[str, str], codes: dict[str, int | None]) -> int:
    servers = [s for s in specs if s.health_address]
    trainers = [s for s in specs if not s.health_address]
    for spec in servers:
        sup.start(spec, environ)
    problem = _await_healthy(sup, servers, options.startup_timeout_s)
    if problem is not None:
        sup.say(f"{problem}; stopping everything")
        return 1
    sup.say(f"scheduler and {len(servers) - 1} parameter server(s) healthy; "
            f"starting {len(trainers)} worker(s)")
    for spec in trainers:
        sup.start(spec, environ)
    while any(codes[t.name] is None for t in trainers):
        try:
            # A timeout, so that a signal handler runs promptly even where a blocked get() would
            # not be interrupted by the signal.
            kind, name, value = sup.events.get(timeout=0.5)
        except queue.Empty:
            continue
        if kind == "signal":
            raise _Stopped(value)
        if name not in codes:
            sup.say(f"{name} exited ({describe_exit(value)}) while workers were training; "
                    "stopping everything")
            return 1
        codes[name] = value
        if value != 0:
            sup.say(f"{name} failed ({describe_exit(value)}); stopping everything")
            return status_of(value)
    return 0


def run(options: Options, out: TextIO | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Run the cluster until the workers finish; returns the launcher's exit status."""
    out = sys.stdout if out is None else out
    environ = os.environ if environ is None else environ
    plan = ClusterPlan.allocate(options.ps, options.workers, chief=options.chief, host=options.host)
    specs = child_specs(plan, options)
    codes: dict[str, int | None] = {t.name: None for t in plan.trainers}
    sup = Supervisor(out, options.grace_s)
    sup.say("cluster " + json.dumps(plan.cluster()))
    previous = _install_signal_handlers(sup.events)
    status = 1
    try:
        status = _supervise(sup, specs, options, environ, codes)
    except _Stopped as stop:
        sup.say(f"got {stop}; stopping everything")
        status = 128 + stop.sig
    finally:
        # Trainers first: servers stopped under running workers would only make them fail noisily.
        trainers = [name for name in sup.children if name in codes]
        sup.stop(trainers)
        sup.stop([name for name in sup.children if name not in codes])
        _restore_signal_handlers(previous)
        for name in codes:
            if codes[name] is None and name in sup.children:
                codes[name] = sup.children[name].returncode
        sup.emit([summary_line(codes, status)])
    return status


def _install_signal_handlers(events: queue.SimpleQueue[Event]) -> dict[int, object]:
    if threading.current_thread() is not threading.main_thread():
        return {}  # only the main thread may set handlers; an embedding caller owns signals

    def handle(signum: int, frame: FrameType | None) -> None:
        events.put(("signal", signal.Signals(signum).name, signum))

    return {sig: signal.signal(sig, handle) for sig in _STOP_SIGNALS}


def _restore_signal_handlers(previous: Mapping[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]


# ---- command line ----


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        if not (text.isdigit() and int(text) >= minimum):
            raise argparse.ArgumentTypeError(f"got {text!r}, expected a whole number >= {minimum}")
        return int(text)

    parse.__name__ = "count"
    return parse




def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        usage=f"{PROG} [options] [--] [WORKER_ARG ...]",
        description="Run a local pshard cluster as real processes: a scheduler, N parameter servers "
        "and M workers on free ports of one host, each with its own TF_CONFIG. Workers start once "
        "the scheduler and every server are healthy. Output lines are prefixed with the process "
        "name. Exit status: 0 only if every worker exited 0.",
        epilog="Arguments after '--' (and any the launcher does not know) go to every worker; "
        f"'{TASK_PLACEHOLDER}' in them becomes the worker's name, e.g. "
        f"--metrics runs/metrics-{TASK_PLACEHOLDER}.jsonl. "
        f"Example: {PROG} --ps 2 --workers 2 -- --mode sync --epochs 2 --output runs/model.pt")
    parser.add_argument("--ps", metavar="N", type=_count(1), default=2,
                        help="number of parameter servers (default 2)")
    parser.add_argument("--workers", metavar="M", type=_count(0), default=2,
                        help="number of worker tasks (default 2)")
    parser.add_argument("--chief", action="store_true",
                        help="also run a chief task (TF_CONFIG type 'chief': the worker that evaluates "
                             "and saves), in addition to the M workers")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address every process binds and is reached at (default 127.0.0.1)")
    parser.add_argument("--scheduler-interval-ms", metavar="MS", type=_count(1), default=1000,
                        help="heartbeat interval the scheduler asks of nodes (default 1000)")
    parser.add_argument("--scheduler-timeout-ms", metavar="MS", type=_count(1), default=5000,
                        help="a node silent for this long is declared dead and leaves the sync quorum "
                             "(default 5000)")
    parser.add_argument("--checkpoint-dir", metavar="DIR",
                        help="parameter servers checkpoint their shards to DIR/ps-<i>")
    parser.add_argument("--worker-cmd", metavar="CMD", default=None,
                        help="command that runs one worker, split like a shell does "
                             f"(default: '{Path(sys.executable).name} -m worker' with this Python)")
    parser.add_argument("--startup-timeout-s", metavar="S", type=positive_float, default=60.0,
                        help="longest wait for the scheduler and servers to become healthy (default 60)")
    parser.add_argument("--grace-s", metavar="S", type=positive_float, default=10.0,
                        help="time between SIGTERM and SIGKILL when stopping a process (default 10)")
    return parser


def parse_options(argv: Sequence[str]) -> Options:
    """Launcher flags up to '--'; everything after it, and unknown flags before it, go to workers."""
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv[:split])
    if args.workers == 0 and not args.chief:
        parser.error("--workers: got 0 without --chief, expected at least one training process")
    if args.scheduler_timeout_ms <= args.scheduler_interval_ms:
        parser.error(f"--scheduler-timeout-ms: got {args.scheduler_timeout_ms}, expected more than "
                     f"--scheduler-interval-ms ({args.scheduler_interval_ms})")
    worker_cmd = Options.worker_cmd if args.worker_cmd is None else tuple(shlex.split(args.worker_cmd))
    if not worker_cmd:
        parser.error("--worker-cmd: got an empty command")
    return Options(ps=args.ps, workers=args.workers, chief=args.chief, host=args.host,
                   heartbeat_interval_ms=args.scheduler_interval_ms,
                   heartbeat_timeout_ms=args.scheduler_timeout_ms, checkpoint_dir=args.checkpoint_dir,
                   worker_cmd=worker_cmd, worker_args=(*unknown, *argv[split + 1:]),
                   startup_timeout_s=args.startup_timeout_s, grace_s=args.grace_s)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_options(sys.argv[1:] if argv is None else argv)
    try:
        return run(options)
    except OSError as e:  # no free port, or a command that cannot be started
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 1
