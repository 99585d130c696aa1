"""A multi-host test bed on one Linux machine: network namespaces as hosts (issue 24).

Each host is a network namespace with its own address on a bridge that lives in a namespace of its own,
and its own /dev/shm. Everything is torn down at the end, also on failure (context manager, atexit, and
`sweep()` of beds whose owner died). Needs root, `ip` and `tc`; `skip_reason()` says why not otherwise.

    from bench.hostbed import HostBed

    with HostBed(["sched", "ps0", "ps1", "w0", "w1"], forwarded=["w1"]) as bed:
        bed.hosts["ps0"].address              # "10.a.b.2": one /24 per bed, hosts from .1 in order
        proc = bed.spawn("ps0", [sys.executable, "-m", "pshard.ps_server", "--bind", f"{ip}:7100"],
                         env=env)               # a real OS process on that host (Popen, own session)
        bed.kill(proc)                          # SIGKILL its process group
        bed.run("w0", ["ls", "/dev/shm"])       # run to the end, stdout back; BedError if it fails
        bed.command("w0", argv)                 # the argv that runs `argv` there, for your own Popen
        bed.link_down("ps1"); bed.link_up("ps1")   # the host cut off silently (its processes live on)
        bed.cut("sched", "ps0"); bed.heal("sched", "ps0")  # only this pair cannot talk, both ways
        bed.shape("w0", rate_mbit=1000)         # tc tbf both ways; bed.unshape("w0")
        bed.impair("w1", delay_ms=50, loss=0.05)   # forwarded hosts only: user-space delay and loss
        bed.certs(certs_dir, {"ps0": ["ps/ps-0"], "w0": ["chief/chief-0"]})  # pshard certs --host <ip>

Pytest: the `hostbed` fixture of tests/hosts/conftest.py makes beds (`hostbed(["a", "b"], forwarded=...)`)
and skips with the reason where none can be made. Shell: ``python -m bench.hostbed --help`` (up, sweep).

What this kernel gives, checked when the bed was written (6.18, no modules loadable):
- veth, bridge, TAP and tc tbf exist; netem does not ("Specified qdisc kind is unknown"), nor do tc
  classifiers or actions (u32, flower, gact), nor iptables/nft. So delay and loss go through a user-space
  forwarder on a TAP pair (bench/hostbed/forwarder.py; a host made `forwarded` has TAP eth0, not veth,
  and its link runs at Python speed, some tens of MB/s), and a pair is cut with a neighbour entry that
  points at no one.
- /dev/shm: `ip netns exec` gives each process a private mount namespace; the bed binds the host's
  directory of its own tmpfs over /dev/shm there, so processes of one host share it and no other host (nor
  the machine) sees it (tests/hosts/test_hostbed.py proves both).

Names: every namespace and interface starts with ``pb<token>`` (6 random hex digits per bed, interface
names at most 11 characters), so beds of several people at once never meet, and the sweep only takes
beds whose owning process is dead. Traffic stays inside the bed: no interface of it is in the machine's
namespace and the bridge has no address or route out.
"""

from bench.hostbed.bed import BedError, Host, HostBed, skip_reason, sweep
from bench.hostbed.names import BedNames

__all__ = ["BedError", "BedNames", "Host", "HostBed", "skip_reason", "sweep"]
