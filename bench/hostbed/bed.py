"""The bed itself: network namespaces as hosts on a bridge, built with `ip` and `tc`, torn down always.

See the package's docstring (bench/hostbed/__init__.py) for the API and what was checked on this kernel.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.hostbed.names import PREFIX, BedNames, is_token, new_token, token_of

REPO = Path(__file__).resolve().parents[2]
STATE_ROOT = Path(os.environ.get("PSHARD_HOSTBED_STATE", "/run/pshard-hostbed"))
CMD_TIMEOUT_S = 20.0
# A bogus MAC for cut(): frames to it are flooded by the bridge and dropped by every host (not theirs).
_NOWHERE_MAC = "02:00:00:de:ad:01"
# Each process on a host gets the host's /dev/shm: a directory of the bed's tmpfs, bound over /dev/shm in
# the mount namespace `ip netns exec` makes (private: nothing mounted there is seen outside).
_WITH_SHM = 'mount --bind "$0" /dev/shm && exec "$@"'


class BedError(RuntimeError):
    """A bed could not be built or changed; the message names the command and what it said."""


def skip_reason() -> str | None:
    """Why no bed can be made here (for pytest.skip), or None when one can."""
    if os.geteuid() != 0:
        return "the multi-host bed needs root (network namespaces, a bridge, mounts); run as root, as CI does"
    for tool in ("ip", "tc", "mount"):
        if shutil.which(tool) is None:
            return f"the multi-host bed needs `{tool}` (iproute2 / util-linux), not found on PATH"
    if not Path("/dev/net/tun").exists():
        return "the multi-host bed needs /dev/net/tun for its delay/loss forwarder"
    return None


def _run(argv: Sequence[str], timeout_s: float = CMD_TIMEOUT_S) -> str:
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise BedError(f"`{' '.join(argv)}` took over {timeout_s:g}s") from None
    if done.returncode != 0:
        raise BedError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (to tell it from a later process with the same id), or None."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


@dataclass(frozen=True)
class Host:
    name: str
    index: int
    address: str
    netns: str
    shm_dir: Path
    forwarded: bool  # its link goes through the user-space forwarder (delay, loss)


class HostBed:
    """N hosts on one bridge; a context manager. `hosts` are names (lowercase, e.g. "ps0");
    `forwarded` names the hosts whose link goes through the delay/loss forwarder (see `impair`)."""

    def __init__(self, hosts: Sequence[str], *, forwarded: Iterable[str] = (), shm_size: str = "4g",
                 token: str | None = None) -> None:
        if len(set(hosts)) != len(hosts) or not hosts:
            raise ValueError(f"hosts: got {list(hosts)}, want at least one, each name once")
        self.names = BedNames(token or new_token())
        self.state_dir = STATE_ROOT / self.names.token
        self.forwarded = set(forwarded)
        unknown = self.forwarded - set(hosts)
        if unknown:
            raise ValueError(f"forwarded: got {sorted(unknown)}, not among hosts {list(hosts)}")
        self.hosts = {name: Host(name, i, self.names.address(i), self.names.host_ns(name),
                                 self.state_dir / "shm" / name, name in self.forwarded)
                      for i, name in enumerate(hosts)}
        self._shm_size = shm_size
        self._forwarders: dict[str, subprocess.Popen[str]] = {}
        self._spawned: list[subprocess.Popen[bytes]] = []
        self._up = False

    # -- life cycle ------------------------------------------------------------------------------

    def __enter__(self) -> HostBed:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        # The state directory comes first, whole (renamed into place with its owner): the sweep deletes any
        # namespace of ours without one, and a bed whose owner is not alive.
        STATE_ROOT.mkdir(parents=True, exist_ok=True)
        draft = STATE_ROOT / f".{self.names.token}"
        draft.mkdir()
        me = os.getpid()
        owner = {"pid": me, "start": _start_time(me), "hosts": list(self.hosts)}
        (draft / "owner.json").write_text(json.dumps(owner))
        draft.rename(self.state_dir)
        self._up = True
        atexit.register(self.down)
        try:
            shm = self.state_dir / "shm"
            shm.mkdir()
            _run(["mount", "-t", "tmpfs", "-o", f"size={self._shm_size},mode=1777", f"{PREFIX}shm", str(shm)])
            _run(["ip", "netns", "add", self.names.bridge_ns])
            br = ["ip", "-n", self.names.bridge_ns]
            _run([*br, "link", "add", "name", "br0", "type", "bridge"])
            _run([*br, "link", "set", "br0", "up"])
            for host in self.hosts.values():
                self._add_host(host)
        except BaseException:
            self.down()
            raise

    def _add_host(self, host: Host) -> None:
        host.shm_dir.mkdir(mode=0o1777)
        _run(["ip", "netns", "add", host.netns])
        _run(["ip", "-n", host.netns, "link", "set", "lo", "up"])
        port = self.names.bridge_port(host.index)
        br = ["ip", "-n", self.names.bridge_ns]
        if host.forwarded:
            self._start_forwarder(host, port)
        else:
            # Made inside the bridge's namespace with its peer sent straight to the host's: no interface of
            # a bed ever appears in the machine's own namespace.
            _run([*br, "link", "add", "name", port, "type", "veth", "peer", "name",
                  self.names.host_link(host.index), "netns", host.netns])
            _run(["ip", "-n", host.netns, "link", "set", self.names.host_link(host.index), "name", "eth0"])
        _run([*br, "link", "set", port, "master", "br0", "up"])
        _run(["ip", "-n", host.netns, "addr", "add", f"{host.address}/{self.names.subnet().prefixlen}",
              "dev", "eth0"])
        _run(["ip", "-n", host.netns, "link", "set", "eth0", "up"])

    def _start_forwarder(self, host: Host, port: str) -> None:
        argv = [sys.executable, "-m", "bench.hostbed.forwarder", "--bridge-ns", self.names.bridge_ns,
                "--bridge-tap", port, "--host-ns", host.netns]
        proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        self._forwarders[host.name] = proc
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "ready" once both TAP devices exist; EOF if it failed
        if line.strip() != "ready":
            raise BedError(f"forwarder of {host.name} did not start (exit {proc.wait(5)}): {line!r}")

    def down(self) -> None:
        """Kill every process in the bed's namespaces, delete them, unmount the shm tmpfs: idempotent."""
        if not self._up:
            return
        self._up = False
        for proc in self._spawned:
            self.kill(proc)
        for forwarder in self._forwarders.values():
            with contextlib.suppress(OSError):
                os.killpg(forwarder.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                forwarder.wait(10)
        teardown(self.names.token, [h.netns for h in self.hosts.values()] + [self.names.bridge_ns])
        with contextlib.suppress(Exception):
            atexit.unregister(self.down)

    # -- processes ---------------------------------------------------------------------------------

    def command(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` as run on `host`: its network namespace and its own /dev/shm. The process keeps the pid
        of the returned command (ip and sh exec into it)."""
        h = self.hosts[host]
        return ["ip", "netns", "exec", h.netns, "sh", "-c", _WITH_SHM, str(h.shm_dir), *argv]

    def spawn(self, host: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: Path | None = None, stdin: int | None = subprocess.DEVNULL,
              stdout: int | None = subprocess.PIPE, stderr: int | None = subprocess.STDOUT
              ) -> subprocess.Popen[bytes]:
        """Start `argv` on `host` in a session of its own (so `kill` takes its children too)."""
        proc = subprocess.Popen(self.command(host, argv), env=None if env is None else dict(env), cwd=cwd,
                                stdin=stdin, stdout=stdout, stderr=stderr, start_new_session=True)
        self._spawned.append(proc)
        return proc

    def run(self, host: str, argv: Sequence[str], timeout_s: float = CMD_TIMEOUT_S) -> str:
        """Run `argv` on `host` to its end and return its stdout; BedError if it fails."""
        return _run(self.command(host, argv), timeout_s)

    @staticmethod
    def kill(proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL `proc`'s whole process group and reap it."""
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)

    # -- the network -------------------------------------------------------------------------------

    def _port(self, host: str) -> str:
        return self.names.bridge_port(self.hosts[host].index)

    def link_down(self, host: str) -> None:
        """Cut `host` off: the bridge's end of its link goes down. The host's processes live on and its own
        interface stays up with its routes, so what it sends is lost silently, as with a pulled cable."""
        _run(["ip", "-n", self.names.bridge_ns, "link", "set", self._port(host), "down"])

    def link_up(self, host: str) -> None:
        _run(["ip", "-n", self.names.bridge_ns, "link", "set", self._port(host), "up"])

    def cut(self, a: str, b: str) -> None:
        """Silently drop everything between hosts `a` and `b` only (both ways); each still reaches the rest.
        Done with a permanent neighbour entry for the other's address that names no one's MAC (this kernel
        has no tc classifiers or actions, and no iptables)."""
        for src, dst in ((a, b), (b, a)):
            _run(["ip", "-n", self.hosts[src].netns, "neigh", "replace", self.hosts[dst].address,
                  "lladdr", _NOWHERE_MAC, "nud", "permanent", "dev", "eth0"])

    def heal(self, a: str, b: str) -> None:
        """Undo `cut(a, b)`: the entries go, and ARP finds the real addresses again."""
        for src, dst in ((a, b), (b, a)):
            with contextlib.suppress(BedError):  # not cut: nothing to undo
                _run(["ip", "-n", self.hosts[src].netns, "neigh", "del", self.hosts[dst].address,
                      "dev", "eth0"])

    def shape(self, host: str, rate_mbit: float, *, burst_kb: int = 256, latency_ms: int = 50) -> None:
        """Limit `host`'s link to `rate_mbit` each way with tc tbf (on its eth0 and its bridge port)."""
        tbf = ["tbf", "rate", f"{rate_mbit}mbit", "burst", f"{burst_kb}kb", "latency", f"{latency_ms}ms"]
        _run(["tc", "-n", self.hosts[host].netns, "qdisc", "replace", "dev", "eth0", "root", *tbf])
        _run(["tc", "-n", self.names.bridge_ns, "qdisc", "replace", "dev", self._port(host), "root", *tbf])

    def unshape(self, host: str) -> None:
        for netns, dev in ((self.hosts[host].netns, "eth0"), (self.names.bridge_ns, self._port(host))):
            with contextlib.suppress(BedError):
                _run(["tc", "-n", netns, "qdisc", "del", "dev", dev, "root"])

    def impair(self, host: str, *, delay_ms: float = 0.0, loss: float = 0.0) -> None:
        """Delay each frame of `host`'s link by `delay_ms` each way and drop each with probability `loss`.
        Only for hosts made with `forwarded=`: their link goes through the user-space forwarder."""
        proc = self._forwarders.get(host)
        if proc is None:
            raise ValueError(f"impair: host {host!r} has no forwarder; make the bed with "
                             f"forwarded=[{host!r}]")
        if delay_ms < 0 or not 0 <= loss <= 1:
            raise ValueError(f"impair: got delay_ms={delay_ms}, loss={loss}; "
                             "want delay_ms >= 0, 0 <= loss <= 1")
        assert proc.stdin is not None
        proc.stdin.write(json.dumps({"delay_ms": delay_ms, "loss": loss}) + "\n")
        proc.stdin.flush()

    # -- certificates ------------------------------------------------------------------------------

    def certs(self, certs_dir: Path, nodes: Mapping[str, Sequence[str]]) -> None:
        """Per-host certificates from one CA in `certs_dir`, as a user makes them: ``pshard certs --host <ip>
        NODE...`` once per host. `nodes` maps a host to its nodes (``{"ps0": ["ps/ps-0"], ...}``); the host's
        name is in the SANs too."""
        for host, host_nodes in nodes.items():
            h = self.hosts[host]
            _run([sys.executable, "-m", "pshard", "certs", "--dir", str(certs_dir), "--host", h.address,
                  "--host", h.name, *host_nodes], timeout_s=60)


def _netns_list() -> list[str]:
    out = _run(["ip", "netns", "list"])
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def teardown(token: str, namespaces: Iterable[str]) -> None:
    """SIGKILL every process in `namespaces`, delete them and the bed's state (its shm tmpfs): what `down`
    and the sweep both do. Never raises: a teardown does all it can."""
    namespaces = list(namespaces)
    for netns in namespaces:
        with contextlib.suppress(BedError):
            for pid in _run(["ip", "netns", "pids", netns]).split():
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
    for netns in namespaces:
        with contextlib.suppress(BedError):
            _run(["ip", "netns", "del", netns])
    state = STATE_ROOT / token
    shm = state / "shm"
    if shm.is_mount():
        with contextlib.suppress(BedError):
            _run(["umount", "-l", str(shm)])
    shutil.rmtree(state, ignore_errors=True)


def _owner_alive(state: Path) -> bool:
    try:
        owner = json.loads((state / "owner.json").read_text())
    except (OSError, ValueError):
        return False
    return _start_time(int(owner["pid"])) == owner.get("start")


def sweep() -> list[str]:
    """Tear down every bed whose owner process is gone (a test killed with SIGKILL, a crashed bench);
    beds of live owners (other people's runs) are left alone. Returns the tokens swept."""
    states = [state for state in STATE_ROOT.glob("*") if is_token(state.name)]
    live = {state.name for state in states if _owner_alive(state)}
    by_token: dict[str, list[str]] = {}
    for netns in _netns_list():
        token = token_of(netns)
        if token is not None and token not in live:
            by_token.setdefault(token, []).append(netns)
    for state in states:
        if state.name not in live:
            by_token.setdefault(state.name, [])
    for token, namespaces in by_token.items():
        teardown(token, namespaces)
    return sorted(by_token)
