"""The multi-host bed does what its docstring says (bench/hostbed): hosts that reach each other and nothing
else, a /dev/shm per host, silent link cuts, pairwise cuts, tbf shaping, user-space delay and loss, and
teardown that leaves nothing, also after an exception or a SIGKILLed owner."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench.hostbed import BedError, HostBed, sweep
from bench.hostbed.bed import STATE_ROOT, _netns_list
from tests.e2e.harness import ROOT, wait_until
from tests.hosts.conftest import Bed

# A TCP server on every address of its host: prints its port, then echoes each connection's bytes back
# (sink=1: reads to EOF and answers the byte count instead).
_SERVER = """
import socket, sys, threading
s = socket.socket(); s.bind(("0.0.0.0", 0)); s.listen(16)
print(s.getsockname()[1], flush=True)
def serve(c):
    with c:
        if sys.argv[1] == "sink":
            n = 0
            while data := c.recv(1 << 20):
                n += len(data)
            c.sendall(str(n).encode())
        else:
            while data := c.recv(65536):
                c.sendall(data)
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""


def start_server(bed: HostBed, host: str, mode: str = "echo") -> tuple[subprocess.Popen[bytes], str]:
    proc = bed.spawn(host, [sys.executable, "-c", _SERVER, mode], stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    port = proc.stdout.readline().decode().strip()
    assert port.isdigit(), f"server on {host} did not start: {port!r}"
    return proc, f"{bed.hosts[host].address}:{port}"


def on(bed: HostBed, host: str, code: str, timeout_s: float = 20.0) -> str:
    return bed.run(host, [sys.executable, "-c", code], timeout_s=timeout_s).strip()


def connect_code(address: str, timeout_s: float) -> str:
    """Code that prints how the connection to `address` went: 'ok <seconds>' or the error's class."""
    host, port = address.rsplit(":", 1)
    return ("import socket, time\nt = time.monotonic()\n"
            f"try:\n    s = socket.create_connection(({host!r}, {port}), timeout={timeout_s})\n"
            "    s.sendall(b'x'); assert s.recv(1) == b'x'\n    print('ok', time.monotonic() - t)\n"
            "except OSError as e:\n    print(type(e).__name__)\n")


def test_hosts_reach_each_other_by_address_and_nothing_outside(hostbed: Bed) -> None:
    bed = hostbed(["a", "b"])
    _, address = start_server(bed, "b")
    assert on(bed, "a", connect_code(address, 5)).startswith("ok")
    # No way out: a host's only route is the bed's /24, and no interface of the bed is in the machine's
    # namespace.
    routes = on(bed, "a", "import subprocess; print(subprocess.run(['ip', 'route'], capture_output=True, "
                          "text=True).stdout)")
    assert routes.splitlines() == [f"{bed.names.subnet()} dev eth0 proto kernel scope link src "
                                   f"{bed.hosts['a'].address}"], routes
    assert not [name for name in os.listdir("/sys/class/net") if bed.names.owns(name)]


def test_dev_shm_is_one_per_host_shared_by_its_processes_and_seen_nowhere_else(hostbed: Bed) -> None:
    bed = hostbed(["a", "b"])
    name = f"pshard-bed-probe-{bed.names.token}"
    on(bed, "a", f"open('/dev/shm/{name}', 'w').write('a')")
    assert on(bed, "a", f"print(open('/dev/shm/{name}').read())") == "a"  # another process, same host
    assert on(bed, "b", f"import os; print(os.path.exists('/dev/shm/{name}'))") == "False"
    assert not Path("/dev/shm", name).exists()  # the machine's own /dev/shm


def test_link_down_loses_traffic_silently_and_link_up_restores_it(hostbed: Bed) -> None:
    bed = hostbed(["a", "b"])
    _, address = start_server(bed, "b")
    host, port = address.rsplit(":", 1)
    # One connection across the cut: while down, nothing arrives and no error is raised (the host's
    # interface stays up); once up again, TCP's retransmission delivers the same bytes.
    client = bed.spawn("a", [sys.executable, "-u", "-c", (
        "import socket, sys\n"
        f"s = socket.create_connection(({host!r}, {port}), timeout=5)\n"
        "print('connected', flush=True); sys.stdin.readline()\n"
        "s.settimeout(1.5); s.sendall(b'1')\n"
        "try:\n    print('got', s.recv(1), flush=True)\n"
        "except TimeoutError:\n    print('silent', flush=True)\n"
        "s.settimeout(30)\nprint('late', s.recv(1), flush=True)\n")], stdin=subprocess.PIPE)
    assert client.stdout is not None
    assert client.stdout.readline().strip() == b"connected"
    bed.link_down("b")
    assert client.stdin is not None
    client.stdin.write(b"go\n")
    client.stdin.flush()
    assert client.stdout.readline().strip() == b"silent"
    bed.link_up("b")
    assert client.stdout.readline().strip() == b"late b'1'"


def test_cut_separates_one_pair_only_until_healed(hostbed: Bed) -> None:
    bed = hostbed(["a", "b", "c"])
    _, at_b = start_server(bed, "b")
    _, at_c = start_server(bed, "c")
    bed.cut("a", "b")
    assert on(bed, "a", connect_code(at_b, 1)) == "TimeoutError"  # dropped, not refused
    assert on(bed, "a", connect_code(at_c, 5)).startswith("ok")
    assert on(bed, "c", connect_code(at_b, 5)).startswith("ok")
    bed.heal("a", "b")
    assert on(bed, "a", connect_code(at_b, 5)).startswith("ok")


def test_shape_limits_a_hosts_link_to_its_rate(hostbed: Bed) -> None:
    bed = hostbed(["a", "b"])
    _, address = start_server(bed, "b", "sink")
    host, port = address.rsplit(":", 1)
    send = ("import socket, time\n"
            f"s = socket.create_connection(({host!r}, {port}), timeout=20)\n"
            "t = time.monotonic(); s.sendall(bytes(4_000_000)); s.shutdown(socket.SHUT_WR)\n"
            "n = int(s.recv(64)); print(n * 8 / 1e6 / (time.monotonic() - t))\n")
    bed.shape("b", rate_mbit=80)
    shaped = float(on(bed, "a", send))
    assert 40 < shaped < 80 * 1.15, f"{shaped:.0f} Mbit/s through an 80 Mbit/s tbf"
    bed.unshape("b")
    assert float(on(bed, "a", send)) > 3 * 80  # veth runs at memory speed


def test_a_forwarded_link_delays_and_drops(hostbed: Bed) -> None:
    bed = hostbed(["a", "f"], forwarded=["f"])
    _, address = start_server(bed, "a")
    assert on(bed, "f", connect_code(address, 5)).startswith("ok")
    bed.impair("f", delay_ms=100)
    # Connect and one echo: two round trips, each through the forwarder twice (100 ms each way).
    took = float(on(bed, "f", connect_code(address, 5)).split()[1])
    assert 0.4 <= took < 2.0, took
    bed.impair("f", loss=1.0)
    assert on(bed, "f", connect_code(address, 1)) == "TimeoutError"
    bed.impair("f", delay_ms=0, loss=0)
    assert on(bed, "f", connect_code(address, 5)).startswith("ok")
    with pytest.raises(ValueError, match="loss=1\\.5"):
        bed.impair("f", loss=1.5)
    with pytest.raises(ValueError, match="no forwarder"):
        bed.impair("a", delay_ms=1)


def _bed_gone(bed: HostBed) -> bool:
    return not [n for n in _netns_list() if bed.names.owns(n)] and not bed.state_dir.exists()


def test_an_exception_inside_the_bed_tears_everything_down(hostbed: Bed) -> None:
    hostbed(["x"])  # only for the skip and the sweep: this test makes its own bed
    bed = HostBed(["a", "f"], forwarded=["f"])
    with pytest.raises(KeyboardInterrupt), bed:
        proc, _ = start_server(bed, "a")
        raise KeyboardInterrupt
    assert proc.poll() is not None
    assert _bed_gone(bed)
    assert not bed.hosts["a"].shm_dir.exists()


def test_a_bad_command_names_itself_and_leaves_the_bed_usable(hostbed: Bed) -> None:
    bed = hostbed(["a"])
    with pytest.raises(BedError, match="no-such-command"):
        bed.run("a", ["no-such-command"])
    assert on(bed, "a", "print(1)") == "1"


def test_sweep_takes_a_dead_owners_bed_and_leaves_live_ones(hostbed: Bed) -> None:
    mine = hostbed(["a"])
    owner = subprocess.Popen(
        [sys.executable, "-c", "from bench.hostbed import HostBed\nimport time\nb = HostBed(['a']); b.up()\n"
                               "print(b.names.token, flush=True); time.sleep(120)"],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert owner.stdout is not None
    token = owner.stdout.readline().strip()
    assert (STATE_ROOT / token).exists()
    assert token not in sweep()  # its owner lives
    owner.kill()
    owner.wait(10)
    assert token in sweep()
    wait_until(lambda: not (STATE_ROOT / token).exists(), 5, "the dead owner's state to go")
    assert not [n for n in _netns_list() if n.startswith(f"pb{token}")]
    assert mine.state_dir.exists() and not _bed_gone(mine)


def test_the_command_line_holds_a_bed_until_sigterm_then_tears_it_down(hostbed: Bed) -> None:
    hostbed(["x"])  # only for the skip and the sweep: the command makes its own bed
    cli = subprocess.Popen([sys.executable, "-m", "bench.hostbed", "up", "a", "b", "--forwarded", "b"],
                           cwd=ROOT, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert cli.stdout is not None
        rows = [cli.stdout.readline().split() for _ in range(3)]
        assert [r[0] for r in rows[:2]] == ["a", "b"] and rows[2][0] == "holding", rows
        netns = rows[0][1]
        assert netns in _netns_list()
        cli.send_signal(signal.SIGTERM)
        assert cli.wait(30) == 0
        assert not [n for n in _netns_list() if n.startswith(netns.rsplit("-", 1)[0])]
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait(10)
