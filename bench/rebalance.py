"""A zipf(1.1) table rebalanced live (issue 20): the hottest server's load against the mean, before and after
`pshard rebalance`, and the time its moves took.

A scheduler planning 8 row partitions per server, 3 servers without replicas, and 2 clients pushing integer
gradients to an async table (SGD at lr 1, zero rows) as fast as they can. Each push draws 256 ids: a row
partition by zipf(1.1) over the 24 partitions' ranks, the 8 hottest on ps-0 (as a hash that happened to put
the hot ids together would), then an id of it at random. The load is what the scheduler measures from the
servers' heartbeats (`pshard status`'s LOAD table, rows/s over about 10 s): the hottest server starts at
>= 2x the mean. Then `pshard rebalance` plans the moves and makes them while the clients push: each is a
catch-up copy of the partition to a server that holds none of it, then a switch (no replicas: no server
holds a copy before), planned to --threshold 1.1 (the rates measured move by a few percent between
windows). After the moves and a new 10 s window, the load again (bar: the hottest within 1.2x the
mean). The clients then check that nothing was lost: the rows must be minus the sum of every
acknowledged gradient, exactly.

With --auto, no command: the scheduler runs with --rebalance-auto 1.1 --rebalance-cooldown 10 and moves
the partitions one by one on its own; the figures are the loads it rated last before its first move, the
loads once its decision says nothing is left to move, and the time from the first push to then.

    python -m bench.rebalance [--partitions-per-server 8] [--clients 2] [--auto]  (make bench-rebalance,
                                                                                    make bench-rebalance-auto)
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np

from bench.common import REPO, emit

BAR = 1.2
# The plan's threshold, below the bar: the measured rates move by a few percent from one window to the
# next (a plan to 1.2 measured 1.203 after), so the plan aims lower than the figure is held to.
THRESHOLD = 1.1
WINDOW_S = 12.0  # the scheduler rates loads over about 10 s of reports: a window after each change
# --auto: the scheduler's cool-down between its moves, about a rating window (its default, 60 s, suits a
# long job better than a bench: fewer moves made on rates a move just changed).
AUTO_COOLDOWN_S = 10.0
ZIPF_S = 1.1
DIM = 8
IDS_PER_PARTITION = 4000
DRAWS = 256  # ids a push draws (repeats summed by the client)


def _start(plan: Any, task: Any, argv: list[str]) -> subprocess.Popen[str]:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "TF_CONFIG": plan.tf_config(task)}
    return subprocess.Popen([sys.executable, "-m", *argv, "--log-level", "WARNING"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)


def zipf_weights(layout: Any) -> np.ndarray:
    """Each row partition's share of the draws: zipf(1.1) over ranks, the hottest third on server 0, the
    next third on server 1 (as tests/unit/test_moves.py's plan test)."""
    n, count = len(layout.servers), layout.partition_count
    per = count // n
    rank = [per * (layout.row_owner(p)) + sorted(layout.partitions_on(layout.row_owner(p))).index(p)
            for p in range(count)]
    weights = np.array([1 / (r + 1) ** ZIPF_S for r in rank])
    return weights / weights.sum()


def partition_ids(count: int) -> list[np.ndarray]:
    """IDS_PER_PARTITION ids of each row partition, from the table's id space."""
    from pshard.common.sparse import server_of

    ids = np.arange(count * IDS_PER_PARTITION * 2, dtype=np.int64)
    part = server_of(ids, count)
    return [ids[part == p][:IDS_PER_PARTITION] for p in range(count)]


def server_loads(scheduler: str, servers: tuple[str, ...]) -> list[float]:
    """Rows/s of each server, as the scheduler rates them (`pshard status`)."""
    from pshard.status import fetch

    loads = {load.address: sum(load.rows_per_s.values()) for load in fetch(scheduler, 10.0).loads}
    return [loads.get(s, 0.0) for s in servers]


def _wait(what: str, predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"rebalance bench: {what} within {timeout_s} s")
        time.sleep(0.2)


class Pushers:
    """Clients pushing zipf-drawn integer gradients until stopped, summing what was acknowledged."""

    def __init__(self, plan: Any, count: int, partitions_per_server: int) -> None:
        from pshard.client.ps_client import PSClient
        from pshard.common.cluster.layout import ParamSpec
        from pshard.common.cluster.scheduler_client import SchedulerClient
        from pshard.common.sparse import TableConfig

        self.table = TableConfig("emb", DIM, optimizer="sgd", lr=1.0, initializer="zeros")
        self.scheds = [SchedulerClient(plan.scheduler, "worker", node_id=f"worker-{i}", rank_hint=i,
                                       own_address=plan.trainers[i].address, connect_timeout_s=30.0)
                       for i in range(count)]
        for s in self.scheds:
            s.register()
        self.layout = self.scheds[0].propose_layout([ParamSpec("bias", "float32", (4,))],
                                                    servers=list(plan.ps))
        assert self.layout.partition_count == 3 * partitions_per_server
        self.clients = [PSClient(list(plan.ps), f"worker-{i}", layout=self.layout,
                                 generation=lambda s=self.scheds[i]: s.generation, timeout_s=60.0,
                                 transport="auto", relayout=self.scheds[i].newer_layout, reroute_wait_s=10.0)
                        for i in range(count)]
        self.weights = zipf_weights(self.layout)
        self.ids = partition_ids(self.layout.partition_count)
        self.every = np.sort(np.concatenate(self.ids))
        self.acked = np.zeros((len(self.every), DIM), np.float64)
        self.pushes = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(count)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _run(self, i: int) -> None:
        client = self.clients[i]
        rng = np.random.default_rng([i, 20])
        try:
            client.declare_table(self.table)
            while not self._stop.is_set():
                parts = rng.choice(len(self.ids), size=DRAWS, p=self.weights)
                ids = np.array([self.ids[p][rng.integers(IDS_PER_PARTITION)] for p in parts], np.int64)
                grads = rng.integers(-3, 4, size=(DRAWS, DIM)).astype(np.float32)
                client.push_rows(self.table.name, ids, grads)  # returns once acknowledged
                with self._lock:
                    np.add.at(self.acked, np.searchsorted(self.every, ids), grads)
                    self.pushes += 1
        except BaseException as e:  # the main thread reports it
            self._errors.append(e)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)
        if self._errors:
            raise self._errors[0]

    def conserved(self) -> bool:
        final = self.clients[0].pull_rows(self.table.name, self.every)
        return bool(np.array_equal(final, -self.acked.astype(np.float32)))

    def close(self) -> None:
        for c in self.clients:
            c.close()
        for s in self.scheds:
            s.close()


def rebalance(partitions_per_server: int = 8, clients: int = 2, threshold: float = THRESHOLD
              ) -> dict[str, object]:
    with _Cluster(partitions_per_server, clients) as cluster:
        plan, pushers = cluster.plan, cluster.start_pushing()
        _wait("every server rated", lambda: all(server_loads(plan.scheduler, plan.ps)), 60)
        time.sleep(WINDOW_S)  # a full rating window of pushes
        before = server_loads(plan.scheduler, plan.ps)
        started = time.monotonic()
        command = [sys.executable, "-m", "pshard", "rebalance", "--scheduler", plan.scheduler, "--insecure",
                   "--timeout-s", "60", "--threshold", str(threshold)]
        out = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
        took_s = time.monotonic() - started
        if out.returncode != 0:
            raise RuntimeError(f"rebalance bench: pshard rebalance exited {out.returncode}: {out.stderr}")
        moves = [float(s) for s in re.findall(r"moved from server .* in ([0-9.]+) s$", out.stdout, re.M)]
        time.sleep(WINDOW_S)  # the moved partitions' rates from their new servers, a full window
        after = server_loads(plan.scheduler, plan.ps)
        pushers.stop()
        conserved = pushers.conserved()
        pushes = pushers.pushes
    return {"servers": 3, "replicas": 0, "row_partitions": 3 * partitions_per_server, "clients": clients,
            "zipf_s": ZIPF_S, "loads_before_rows_per_s": [round(x, 1) for x in before],
            "hottest_over_mean_before": round(max(before) / (sum(before) / 3), 3),
            "loads_after_rows_per_s": [round(x, 1) for x in after],
            "hottest_over_mean_after": round(max(after) / (sum(after) / 3), 3), "bar": BAR,
            "threshold": threshold,
            "moves": len(moves), "move_s": [round(s, 3) for s in moves], "rebalance_s": round(took_s, 3),
            "pushes": pushes, "conserved": conserved}


# What the automatic policy's status says once it has nothing left to move (scheduler/auto_rebalance.py).
SETTLED = ("balanced:", "no single partition move", "the best move")


def auto_rebalance(partitions_per_server: int = 8, clients: int = 2, threshold: float = THRESHOLD,
                   cooldown_s: float = AUTO_COOLDOWN_S, timeout_s: float = 600.0) -> dict[str, object]:
    """The same job with `pshard scheduler --rebalance-auto THRESHOLD --rebalance-cooldown S`: no command,
    the scheduler moves partitions one by one on its own. `before`: the loads the scheduler rated last on
    the first layout (what its first move acted on); `after`: once its decision says there is nothing left
    to move, on a full window of samples; `settle_s`: from the clients' first push to then."""
    from pshard.status import fetch

    with _Cluster(partitions_per_server, clients, ("--rebalance-auto", str(threshold),
                                                  "--rebalance-cooldown", f"{cooldown_s:g}")) as cluster:
        plan, pushers = cluster.plan, cluster.start_pushing()
        started = time.monotonic()
        before: list[float] = []
        first_move_s = 0.0
        while True:
            status = fetch(plan.scheduler, 10.0)
            auto = status.auto_rebalance
            if auto is None or not auto.enabled:
                raise RuntimeError("rebalance bench: the scheduler runs no automatic rebalance")
            if status.layout_version == pushers.layout.version:
                before = server_loads(plan.scheduler, plan.ps)
            elif not first_move_s:
                first_move_s = time.monotonic() - started
            if auto.moves and auto.reason.startswith(SETTLED) and not auto.eligible_in_s:
                break
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"rebalance bench: the automatic rebalance did not settle within "
                                   f"{timeout_s} s: {auto.reason}")
            time.sleep(0.5)
        settle_s = time.monotonic() - started
        after = server_loads(plan.scheduler, plan.ps)
        pushers.stop()
        conserved = pushers.conserved()
    return {"servers": 3, "replicas": 0, "row_partitions": 3 * partitions_per_server, "clients": clients,
            "zipf_s": ZIPF_S, "loads_before_rows_per_s": [round(x, 1) for x in before],
            "hottest_over_mean_before": round(max(before) / (sum(before) / 3), 3),
            "loads_after_rows_per_s": [round(x, 1) for x in after],
            "hottest_over_mean_after": round(max(after) / (sum(after) / 3), 3), "bar": BAR,
            "threshold": threshold, "cooldown_s": cooldown_s, "moves": auto.moves,
            "first_move_s": round(first_move_s, 1), "settle_s": round(settle_s, 1),
            "pushes": pushers.pushes, "conserved": conserved}


class _Cluster:
    """A scheduler (`scheduler_args` added) and 3 servers as processes, and the clients once pushing."""

    def __init__(self, partitions_per_server: int, clients: int,
                 scheduler_args: tuple[str, ...] = ()) -> None:
        from pshard.launcher.plan import ClusterPlan

        self.plan = ClusterPlan.allocate(3, clients)
        self.partitions_per_server, self.clients = partitions_per_server, clients
        self.scheduler_args = scheduler_args
        self.pushers: Pushers | None = None
        self.procs: list[subprocess.Popen[str]] = []

    def __enter__(self) -> _Cluster:
        from pshard.common.rpc.health import probe

        plan = self.plan
        tasks = {t.name: t for t in [*plan.servers, *plan.trainers]}
        partitions = ["--row-partitions-per-server", str(self.partitions_per_server)]
        self.procs = [_start(plan, tasks["scheduler"], ["pshard.scheduler", "--bind", plan.scheduler,
                                                        *partitions, *self.scheduler_args])]
        self.procs += [_start(plan, tasks[f"ps-{i}"], ["pshard.ps_server", "--bind", address, "--transport",
                                                       "auto"]) for i, address in enumerate(plan.ps)]
        deadline = time.monotonic() + 60
        for address in [plan.scheduler, *plan.ps]:
            while not probe(address, timeout_s=1.0)[0]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rebalance bench: {address} did not start")
                time.sleep(0.1)
        return self

    def start_pushing(self) -> Pushers:
        self.pushers = Pushers(self.plan, self.clients, self.partitions_per_server)
        self.pushers.start()
        return self.pushers

    def __exit__(self, *exc: object) -> None:
        if self.pushers is not None:
            self.pushers.close()
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


def summary(fig: dict[str, object]) -> str:
    after = float(fig["hottest_over_mean_after"])  # type: ignore[arg-type]
    ok = "ok" if after <= BAR else "above"
    if "settle_s" in fig:
        return (f"zipf({ZIPF_S}) async table on 3 servers, {fig['row_partitions']} row partitions, no "
                f"replicas: hottest/mean {fig['hottest_over_mean_before']} before, {after} after "
                f"`pshard scheduler --rebalance-auto {fig['threshold']} --rebalance-cooldown "
                f"{fig['cooldown_s']:g}` settled "
                f"[bar {BAR}: {ok}]; {fig['moves']} automatic moves, the first {fig['first_move_s']} s and "
                f"settled {fig['settle_s']} s after the first push, while {fig['clients']} clients pushed; "
                f"every acknowledged push {'kept' if fig['conserved'] else 'NOT kept'}")
    return (f"zipf({ZIPF_S}) async table on 3 servers, {fig['row_partitions']} row partitions, no replicas: "
            f"hottest/mean {fig['hottest_over_mean_before']} before, {after} after `pshard rebalance "
            f"--threshold {fig['threshold']}` "
            f"[bar {BAR}: {ok}]; {fig['moves']} moves (catch-up copy + switch each) in "
            f"{fig['rebalance_s']} s "
            f"(each {fig['move_s']} s) while {fig['clients']} clients pushed; every acknowledged push "
            f"{'kept' if fig['conserved'] else 'NOT kept'}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.rebalance", description=__doc__.split("\n\n")[0])
    p.add_argument("--partitions-per-server", type=int, default=8,
                   help="row partitions per server (default 8)")
    p.add_argument("--clients", type=int, default=2, help="clients pushing (default 2)")
    p.add_argument("--threshold", type=float, default=THRESHOLD,
                   help=f"pshard rebalance --threshold, or with --auto the scheduler's --rebalance-auto "
                        f"(default {THRESHOLD}, below the bar {BAR})")
    p.add_argument("--auto", action="store_true",
                   help="no `pshard rebalance`: the scheduler's automatic policy moves the partitions")
    p.add_argument("--cooldown-s", type=float, default=AUTO_COOLDOWN_S,
                   help=f"with --auto: the scheduler's --rebalance-cooldown (default {AUTO_COOLDOWN_S:g})")
    args = p.parse_args(argv)
    if args.auto:
        fig = emit("rebalance_auto", **auto_rebalance(args.partitions_per_server, args.clients,
                                                      args.threshold, args.cooldown_s))
    else:
        fig = emit("rebalance", **rebalance(args.partitions_per_server, args.clients, args.threshold))
    print(summary(fig))
    return 0 if fig["conserved"] else 1


if __name__ == "__main__":
    sys.exit(main())
