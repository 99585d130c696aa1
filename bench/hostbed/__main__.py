"""``python -m bench.hostbed``: make a bed by hand and keep it until Ctrl-C, or sweep leftovers.

    python -m bench.hostbed up sched ps0 ps1 w0 w1 [--forwarded w1]   # prints each host's namespace, address
    python -m bench.hostbed sweep                                      # beds whose owner is dead

While `up` holds it: ``ip netns exec <namespace> <command>`` runs a command on a host (for a private /dev/shm
too, see HostBed.command). Ctrl-C or SIGTERM tears it down.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading

from bench.hostbed.bed import HostBed, skip_reason, sweep


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hostbed", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="make a bed of HOST... and hold it until Ctrl-C")
    up.add_argument("hosts", metavar="HOST", nargs="+", help="host names: a lowercase letter, then [a-z0-9-]")
    up.add_argument("--forwarded", action="append", default=[], metavar="HOST",
                    help="a host whose link goes through the delay/loss forwarder (repeatable)")
    sub.add_parser("sweep", help="tear down the beds whose owning process is gone")
    args = parser.parse_args(argv)
    if (reason := skip_reason()) is not None:
        print(f"python -m bench.hostbed: {reason}", file=sys.stderr)
        return 2
    if args.command == "sweep":
        print("swept:", " ".join(sweep()) or "nothing")
        return 0
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with HostBed(args.hosts, forwarded=args.forwarded) as bed:
        for host in bed.hosts.values():
            print(f"{host.name}\t{host.netns}\t{host.address}{'  (forwarded)' if host.forwarded else ''}")
        print("holding the bed; Ctrl-C to tear it down", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
