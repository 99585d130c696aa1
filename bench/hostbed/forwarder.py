"""A host's link through user space, for delay and loss: this kernel has no netem (``tc qdisc ... netem``
answers "Specified qdisc kind is unknown") and no tc actions, so a forwarder does what netem would.

The host's end is a TAP device named eth0 in the host's namespace, the bridge's end another TAP device in
the bridge's namespace; this process holds both and copies Ethernet frames between them, dropping each
with probability `loss` and delivering the others `delay_ms` late (in order). It reads new settings as
JSON lines on stdin (``{"delay_ms": 50, "loss": 0.05}``) and exits when stdin closes (its bed is gone) or
after --max-seconds, whichever comes first, so it never outlives the bed that started it.

    python -m bench.hostbed.forwarder --bridge-ns NS --bridge-tap NAME --host-ns NS [--delay-ms 0] [--loss 0]
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import heapq
import json
import os
import random
import selectors
import struct
import sys
import time
from dataclasses import dataclass, field

_TUNSETIFF = 0x400454CA
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_CLONE_NEWNET = 0x40000000
_FRAME = 65536


def enter_netns(netns: str) -> None:
    """Enter network namespace `netns` (Python 3.11 has no os.setns)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {netns}: {os.strerror(err)}")
    finally:
        os.close(fd)


def open_tap(netns: str, name: str) -> int:
    """A new TAP device `name` in `netns`, non-blocking; it lives as long as the returned descriptor."""
    enter_netns(netns)
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH22x", name.encode(), _IFF_TAP | _IFF_NO_PI))
    return fd


@dataclass
class Impairment:
    delay_ms: float = 0.0
    loss: float = 0.0

    def update(self, line: str) -> None:
        settings = json.loads(line)
        delay, loss = float(settings.get("delay_ms", self.delay_ms)), float(settings.get("loss", self.loss))
        if delay < 0 or not 0 <= loss <= 1:
            raise ValueError(f"impairment: got delay_ms={delay}, loss={loss}; "
                             "want delay_ms >= 0, 0 <= loss <= 1")
        self.delay_ms, self.loss = delay, loss


@dataclass
class Direction:
    """Frames read from `src` waiting to be written to `dst`, by due time (seq keeps them in order)."""
    src: int
    dst: int
    queue: list[tuple[float, int, bytes]] = field(default_factory=list)
    seq: int = 0
    dropped: int = 0

    def take(self, frame: bytes, now: float, impairment: Impairment, rng: random.Random) -> None:
        if impairment.loss and rng.random() < impairment.loss:
            self.dropped += 1
            return
        self.seq += 1
        heapq.heappush(self.queue, (now + impairment.delay_ms / 1000, self.seq, frame))

    def flush(self, now: float) -> None:
        while self.queue and self.queue[0][0] <= now:
            _, _, frame = heapq.heappop(self.queue)
            try:
                os.write(self.dst, frame)
            except BlockingIOError:  # the other end's queue is full: a real link drops too
                self.dropped += 1
            except OSError:  # the device is down (link_down): frames are lost, as on a cable pulled out
                self.dropped += 1

    def next_due(self) -> float | None:
        return self.queue[0][0] if self.queue else None


def forward(a: int, b: int, impairment: Impairment, deadline: float, seed: int = 0) -> None:
    rng = random.Random(seed)
    directions = {a: Direction(a, b), b: Direction(b, a)}
    sel = selectors.DefaultSelector()
    for fd in (a, b):
        sel.register(fd, selectors.EVENT_READ)
    control = sys.stdin.fileno()
    sel.register(control, selectors.EVENT_READ)
    pending = b""
    while (now := time.monotonic()) < deadline:
        dues = [d for d in (x.next_due() for x in directions.values()) if d is not None]
        timeout = max(0.0, min([*dues, deadline]) - now)
        for key, _ in sel.select(timeout):
            fd = int(key.fd)
            if fd == control:
                # os.read, not sys.stdin's buffered readline: a second line already buffered would wait
                # for the next wake-up.
                chunk = os.read(control, 4096)
                if not chunk:
                    return  # the bed closed our stdin or died
                *lines, pending = (pending + chunk).split(b"\n")
                for line in lines:
                    impairment.update(line.decode())
                continue
            for _ in range(64):  # a burst per wake-up, bounded so the other direction gets its turn
                try:
                    frame = os.read(fd, _FRAME)
                except (BlockingIOError, OSError):
                    break
                directions[fd].take(frame, time.monotonic(), impairment, rng)
        now = time.monotonic()
        for direction in directions.values():
            direction.flush(now)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hostbed.forwarder",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--bridge-ns", required=True, help="the bed's bridge namespace")
    parser.add_argument("--bridge-tap", required=True, help="name of the TAP device made in --bridge-ns")
    parser.add_argument("--host-ns", required=True, help="the host's namespace (its TAP device is eth0)")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay each way (default 0)")
    parser.add_argument("--loss", type=float, default=0.0, help="probability of dropping a frame (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the drops (default 0)")
    parser.add_argument("--max-seconds", type=float, default=3600.0,
                        help="exit after this long (default 3600)")
    args = parser.parse_args(argv)
    impairment = Impairment()
    impairment.update(json.dumps({"delay_ms": args.delay_ms, "loss": args.loss}))
    bridge_end = open_tap(args.bridge_ns, args.bridge_tap)
    host_end = open_tap(args.host_ns, "eth0")
    print("ready", flush=True)
    forward(host_end, bridge_end, impairment, time.monotonic() + args.max_seconds, args.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
