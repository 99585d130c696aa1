"""The launcher's child processes: start, relay output, wait for health, stop (SIGTERM, then SIGKILL).

In the spirit of torch elastic's ``PContext``: `Supervisor` owns the processes and turns
everything that happens to them (an exit, a signal to the launcher) into events on one queue;
`run` starts a `ClusterPlan`'s servers, waits until each answers its gRPC health check, starts
the trainers, and stops everything when they are done, one fails, or the launcher is told to stop.

Each child runs in a session (process group) of its own, for two reasons: Ctrl-C in a terminal
reaches the launcher alone, so the launcher decides the order of shutdown; and signalling the
group also reaches whatever the child started itself (data-loader processes), so nothing is
left behind as an orphan.

With ``--restart on-failure`` a server (the scheduler or a parameter server) that dies is started
again on its address after a backoff, a bounded number of times, as Kubernetes' restartPolicy does:
a parameter server with a checkpoint directory restores its shard and the workers, which retry,
go on. A trainer is restarted only when a signal killed it (TFJob's ExitCode policy: 128 + signal is
retryable, an exit code of its own is the program's verdict); it rejoins at the job's current clock and
trains what its shard plan has left (docs/architecture.md, 9 Failures).

Exit statuses: the launcher's is the workers' (0 only when every one exited 0; a failing one's
code, or 128 + its signal); a stop by SIGTERM, SIGINT or SIGHUP is 128 + that signal. A worker
stops quietly with 143 on the SIGTERM the launcher sends it, which the summary line shows.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from types import FrameType
from typing import TextIO

from pshard.common.entry import LAUNCHER_PID_ENV
from pshard.common.rpc.health import probe
from pshard.common.security.credentials import security_from_args
from pshard.launcher.plan import (
    ChildSpec,
    ClusterPlan,
    Options,
    child_environment,
    child_specs,
    restart_decision,
    trainer_restart_decision,
)
from pshard.launcher.record import LaunchRecord, remove_record, write_record

_PROBE_INTERVAL_S = 0.2
_PROBE_TIMEOUT_S = 2.0
# After a child exits, how long its output thread may keep reading: a grandchild that inherited
# the pipe could hold it open indefinitely, and must not delay the exit report.
_DRAIN_TIMEOUT_S = 2.0
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


# ---- output and exit reports (pure) ----

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


# ("exit", child name, Popen returncode), ("signal", signal name, signal number), or
# ("restart", child name, restart number) once a restart's backoff is over.
Event = tuple[str, str, int]


class Stopped(Exception):
    """The launcher was asked to stop (Ctrl-C, SIGTERM, SIGHUP)."""

    def __init__(self, sig: int) -> None:
        super().__init__(signal.Signals(sig).name)
        self.sig = sig


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
        # The child asks the kernel to stop it when this process dies (pshard.common.entry).
        env = {**child_environment(spec.env, base_env), LAUNCHER_PID_ENV: str(os.getpid())}
        proc = subprocess.Popen(spec.argv, env=env, cwd=os.getcwd(),
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

    def await_healthy(self, servers: Sequence[ChildSpec], timeout_s: float) -> str | None:
        """None once every server answers SERVING; else why not (a server exited, or the deadline).

        Raises `Stopped` when the launcher is told to stop meanwhile.
        """
        deadline = time.monotonic() + timeout_s
        pending = {s.name: s.health_address for s in servers if s.health_address}
        # A TLS server's handshake needs a certificate of the job's CA: the child's own will do.
        security = {s.name: security_from_args(argparse.Namespace(), s.env) for s in servers}
        reasons: dict[str, str] = {}
        while True:
            for name, address in list(pending.items()):
                remaining = deadline - time.monotonic()
                serving, reasons[name] = probe(address, timeout_s=max(0.1, min(_PROBE_TIMEOUT_S, remaining)),
                                               security=security[name])
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
                kind, name, value = self.events.get(timeout=_PROBE_INTERVAL_S)
            except queue.Empty:
                continue
            if kind == "signal":
                raise Stopped(value)
            return f"{name} exited ({describe_exit(value)}) before it was healthy"

    def kill_group(self, name: str) -> None:
        """SIGKILL what a dead child left in its process group, before it is started again."""
        self._signal_group(name, signal.SIGKILL)

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


def _supervise(sup: Supervisor, specs: Sequence[ChildSpec], options: Options,
               environ: Mapping[str, str], codes: dict[str, int | None]) -> int:
    servers = [s for s in specs if s.health_address]
    trainers = [s for s in specs if not s.health_address]
    for spec in servers:
        sup.start(spec, environ)
    problem = sup.await_healthy(servers, options.startup_timeout_s)
    if problem is not None:
        sup.say(f"{problem}; stopping everything")
        return 1
    sup.say(f"scheduler and {len(servers) - 1} parameter server(s) healthy; "
            f"starting {len(trainers)} worker(s)")
    _announce(sup, options, servers, environ)
    for spec in trainers:
        sup.start(spec, environ)
    by_name = {s.name: s for s in specs}
    # With replicas a backup takes over the dead server's slices, and the restarted one rejoins as a backup.
    if options.restart == "on-failure" and not options.checkpoint_dir and not options.replicas:
        sup.say("--restart on-failure without --checkpoint-dir: a restarted parameter server comes back "
                "without its shard's weights")
    restarts = dict.fromkeys(by_name, 0)
    while any(codes[t.name] is None for t in trainers):
        try:
            # A timeout, so that a signal handler runs promptly even where a blocked get() would
            # not be interrupted by the signal.
            kind, name, value = sup.events.get(timeout=0.5)
        except queue.Empty:
            continue
        if kind == "signal":
            raise Stopped(value)
        if kind == "restart":
            sup.kill_group(name)
            sup.start(by_name[name], environ)
            sup.say(f"{name} restarted (restart {value} of {options.max_restarts}, "
                    f"pid {sup.children[name].pid})")
            continue
        if name not in codes:
            decision = restart_decision(options, value, restarts[name])
            if not decision.restart:
                sup.say(f"{name} exited ({describe_exit(value)}) while workers were training; not restarted: "
                        f"{decision.reason}; stopping everything")
                return 1
            restarts[name] += 1
            sup.say(f"{name} exited ({describe_exit(value)}) while workers were training; restarting it on "
                    f"{by_name[name].health_address} in {decision.delay_s:g}s ({decision.reason})")
            _restart_later(sup, name, restarts[name], decision.delay_s)
            continue
        decision = trainer_restart_decision(options, value, restarts[name])
        if decision.restart:
            restarts[name] += 1
            sup.say(f"{name} exited ({describe_exit(value)}); restarting it in {decision.delay_s:g}s "
                    f"({decision.reason}); it rejoins at the job's current clock")
            _restart_later(sup, name, restarts[name], decision.delay_s)
            continue
        codes[name] = value
        if value != 0 and options.coordinator is not None and not name.startswith("chief"):
            sup.say(f"{name} exited ({describe_exit(value)}); the coordinator runs its calls on the other "
                    "workers")
            continue
        if value != 0:
            sup.say(f"{name} failed ({describe_exit(value)}); stopping everything")
            return status_of(value)
    return 0


def _announce(sup: Supervisor, options: Options, servers: Sequence[ChildSpec],
              environ: Mapping[str, str]) -> None:
    """Say where the scheduler is and how to look at the job, and keep that for a plain `pshard status`."""
    address = next(s.health_address for s in servers if s.name == "scheduler")
    assert address is not None
    record = LaunchRecord(address, options.certs_dir, options.job_id, os.getpid())
    sup.say(f"scheduler at {address}, job {options.job_id}; see it with: {record.status_command(environ)}")
    write_record(record, environ)


def _restart_later(sup: Supervisor, name: str, number: int, delay_s: float) -> None:
    """A ("restart", name, number) event after the backoff, from a timer: the event loop never sleeps."""
    timer = threading.Timer(delay_s, sup.events.put, args=(("restart", name, number),))
    timer.daemon = True
    timer.start()


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
    except Stopped as stop:
        sup.say(f"got {stop}; stopping everything")
        status = 128 + stop.sig
    finally:
        # Trainers first: servers stopped under running workers would only make them fail noisily.
        trainers = [name for name in sup.children if name in codes]
        sup.stop(trainers)
        sup.stop([name for name in sup.children if name not in codes])
        _restore_signal_handlers(previous)
        remove_record(os.getpid(), environ)
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

    return {sig: signal.signal(sig, handle) for sig in STOP_SIGNALS}


def _restore_signal_handlers(previous: Mapping[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)  # type: ignore[arg-type]


