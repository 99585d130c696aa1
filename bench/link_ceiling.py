"""What a shaped link of the multi-host bed really carries: plain Python TCP streams, timed together.

`streams(bed, [("w0", "ps0"), ("ps1", "w0")], seconds)` starts every stream at one instant (an absolute
time.monotonic(), one clock for every process of the machine) and lets each send for `seconds`; a
receiver counts what arrived and answers the count once the sender shut its side, so a stream's MB/s
includes the drain of the queues in between. Run one stream for one direction's ceiling, two crossing
one host for what its link carries both ways at once (a worker pushes up while it pulls down).
`qdisc_stats` reads tc's counters (sent, dropped, overlimits) of a host's shaped link, both ends, and
`cpu_seconds` a process's user+system time from /proc: what the bench reports beside each figure.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import MB
from bench.hostbed import HostBed

# Drains the stream into one buffer until EOF, then answers the count: "<bytes>\n".
_RECEIVER = """
import socket, sys
listener = socket.create_server((sys.argv[1], 0))
print(listener.getsockname()[1], flush=True)
sock, _ = listener.accept()
view, got = memoryview(bytearray(1 << 20)), 0
while n := sock.recv_into(view):
    got += n
sock.sendall(f"{got}\\n".encode())
"""

# Sends 1 MiB buffers from the given instant for the given seconds, shuts its side, waits for the count:
# prints {"bytes": what arrived, "seconds": from the start to the count}.
_SENDER = """
import json, socket, sys, time
host, port, start_at, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
payload = memoryview(bytearray(b"\\x5a" * (1 << 20)))
sock = socket.create_connection((host, port), timeout=120)
while (wait := start_at - time.monotonic()) > 0:
    time.sleep(wait)
while time.monotonic() < start_at + seconds:
    sock.sendall(payload)
sock.shutdown(socket.SHUT_WR)
got = int(sock.makefile().readline())
print(json.dumps({"bytes": got, "seconds": time.monotonic() - start_at}), flush=True)
"""


def streams(bed: HostBed, pairs: Sequence[tuple[str, str]], seconds: float = 3.0) -> list[dict[str, object]]:
    """One TCP stream per (source host, destination host), all at once: each one's MB/s."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports = []
        for _, dst in pairs:
            receiver = bed.spawn(dst, [sys.executable, "-c", _RECEIVER, bed.hosts[dst].address],
                                 stderr=subprocess.PIPE)
            procs.append(receiver)
            assert receiver.stdout is not None
            ports.append(receiver.stdout.readline().decode().strip())
        start_at = time.monotonic() + 1.0  # every sender connected and waiting by then
        senders = [bed.spawn(src, [sys.executable, "-c", _SENDER, bed.hosts[dst].address, port,
                                   repr(start_at), repr(seconds)], stderr=subprocess.PIPE)
                   for (src, dst), port in zip(pairs, ports, strict=True)]
        procs += senders
        figures = []
        for (src, dst), sender in zip(pairs, senders, strict=True):
            out, err = sender.communicate(timeout=seconds + 60)
            if sender.returncode != 0:
                raise RuntimeError(f"stream {src} -> {dst} failed ({sender.returncode}): "
                                   f"{err.decode()[-2000:]}")
            result = json.loads(out.decode().strip().splitlines()[-1])
            figures.append({"from": src, "to": dst, "bytes": result["bytes"],
                            "mb_per_s": round(result["bytes"] / MB / result["seconds"], 1)})
        return figures
    finally:
        for proc in procs:
            bed.kill(proc)


def qdisc_stats(bed: HostBed, host: str) -> dict[str, dict[str, int]]:
    """tc's counters of `host`'s shaping: "up" is its eth0 (what it sends), "down" its bridge port."""
    ends = {"up": (bed.hosts[host].netns, "eth0"),
            "down": (bed.names.bridge_ns, bed.names.bridge_port(bed.hosts[host].index))}
    stats = {}
    for way, (netns, dev) in ends.items():
        out = subprocess.run(["tc", "-n", netns, "-s", "-j", "qdisc", "show", "dev", dev],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        [qdisc] = [q for q in json.loads(out) if q.get("root")]
        stats[way] = {k: int(qdisc.get(k, 0)) for k in ("bytes", "drops", "overlimits", "requeues")}
    return stats


def stats_delta(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]
                ) -> dict[str, dict[str, int]]:
    return {way: {k: v - before[way][k] for k, v in counts.items()} for way, counts in after.items()}


def cpu_seconds(pid: int) -> tuple[float, float] | None:
    """(CPU seconds run, seconds waited runnable on a run queue) of process `pid` so far, all its threads
    (/proc/PID/task/*/schedstat); None once it is gone. The wait is what a busy machine costs a process
    that uses little CPU itself: each wake-up queues behind the other runnable threads."""
    ran = waited = 0.0
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for task in tasks:
        try:
            fields = Path(f"/proc/{pid}/task/{task}/schedstat").read_text().split()
        except OSError:
            continue  # a thread that ended meanwhile
        ran += int(fields[0]) / 1e9
        waited += int(fields[1]) / 1e9
    return ran, waited


class CpuSampler:
    """Samples named processes every `every_s` on a thread, until `stop()`: each one's mean and peak CPU in
    cores (a peak near 1.0 on a process whose work is one thread says that thread is the limit) and the
    share of the time its threads waited runnable for a CPU (summed over threads: it can exceed 1)."""

    def __init__(self, pids: dict[str, int], every_s: float = 0.25) -> None:
        self._pids, self._every_s = pids, every_s
        self._samples: dict[str, list[tuple[float, float, float]]] = {name: [] for name in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._sample()
            if self._stop.wait(self._every_s):
                # The span ends at stop() whatever this thread's last wake-up: on a loaded host it may
                # have had no second one, and a process then had no figures at all.
                self._sample()
                return

    def _sample(self) -> None:
        for name, pid in self._pids.items():
            if (used := cpu_seconds(pid)) is not None:
                self._samples[name].append((time.monotonic(), *used))

    def stop(self) -> dict[str, dict[str, float]]:
        self._stop.set()
        self._thread.join(timeout=10)
        out = {}
        for name, samples in self._samples.items():
            if len(samples) < 2:
                continue
            span = samples[-1][0] - samples[0][0]
            # Summed over the threads alive at each sample: one that ends takes its counts with it, so a
            # step down is no use and is left out (the figures are then a little low, never high).
            steps = [(b[0] - a[0], max(0.0, b[1] - a[1]), max(0.0, b[2] - a[2]))
                     for a, b in itertools.pairwise(samples)]
            out[name] = {"mean_cores": round(sum(s[1] for s in steps) / span, 2),
                         "peak_cores": round(max(s[1] / s[0] for s in steps), 2),
                         "runqueue_wait": round(sum(s[2] for s in steps) / span, 2)}
        return out
