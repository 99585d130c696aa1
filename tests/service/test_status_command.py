"""``pshard status`` against a live job (real processes on 127.0.0.1), checked against the servers'
own GetStats and the scheduler's view; and its pure summary of who a stuck clock waits for."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from typing import Any

import grpc
from pshard.common.cluster.view import ClusterView, Node, NodeState, ServerLoss

from pshard.api.v1 import parameter_server_pb2 as pb
from pshard.api.v1 import parameter_server_pb2_grpc as pb_grpc
from pshard.status import DrainReport, JoinReport, ServerReport, render, summarise
from tests.e2e.harness import ROOT, TIMEOUTS, LocalCluster, Procs, wait_until


def status(scheduler: str, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "pshard", "status", "--scheduler", scheduler, *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def get_stats(address: str) -> pb.GetStatsResponse:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.ParameterServerServiceStub(channel).GetStats(pb.GetStatsRequest(), timeout=10)


def test_status_of_a_live_job_matches_the_servers_stats_and_names_who_a_stuck_clock_waits_for(
        procs: Procs) -> None:
    # A long heartbeat timeout: the stopped worker stays a member, so the sync clock waits for it.
    cluster = LocalCluster(procs, num_ps=2, num_workers=2, heartbeat_timeout_ms=60_000)
    cluster.start_servers()
    scheduler = cluster.task("scheduler").address
    workers = [cluster.start_worker(i, "--mode", "sync", "--lr", "0.05", "--epochs", "50", *TIMEOUTS)
               for i in range(2)]
    wait_until(lambda: cluster.steps_logged("worker-1") >= 3, 60, "worker-1 to train")
    workers[1].signal_group(signal.SIGSTOP)
    try:
        # SIGSTOP can land between worker-1's pushes to the two servers. A server that got its
        # push then answers worker-0's next pull at once and has nothing waiting, so only the
        # servers with a waiting pull must name worker-1, and at least one must wait.
        def stuck() -> dict[str, Any] | None:
            report = json.loads(status(scheduler, "--json"))
            waiting = [s for s in report["servers"] if s["pulls_waiting"]]
            return report if waiting and all(s["waits_for"] == ["worker-1"] for s in waiting) else None

        report = wait_until(stuck, 60, "a server to wait for the stopped worker")
        assert report is not None
        for server in report["servers"]:
            stats = get_stats(server["address"])
            assert server["slices"] == stats.slices > 0
            assert server["bytes_stored"] == stats.bytes_stored
            assert (server["min_version"], server["max_version"]) == (stats.min_version, stats.max_version)
            assert server["worker_clocks"] == dict(stats.worker_clocks)
            assert server["transports"] == dict(stats.worker_transports)
        members = {m["node_id"]: m for m in report["members"]}
        assert sorted(m["node_id"] for m in members.values() if m["role"] == "ps") == ["ps-0", "ps-1"]
        # On the stuck server worker-1 is a clock behind. A member's clock is the highest it pushed to any
        # server, so its lag is 1, or 0 when SIGSTOP caught worker-1 between its pushes to the two servers.
        waiting = next(s for s in report["servers"] if s["pulls_waiting"])
        assert waiting["worker_clocks"]["worker-0"] == waiting["worker_clocks"]["worker-1"] + 1
        assert members["worker-1"]["state"] == "live"
        assert members["worker-0"]["lag"] == 0
        behind = members["worker-0"]["clock"] - members["worker-1"]["clock"]
        assert members["worker-1"]["lag"] == behind and behind in (0, 1)

        text = status(scheduler)
        clock = next(s["min_version"] for s in report["servers"] if s["pulls_waiting"])
        assert f"clock {clock} waits for worker-1" in text
        assert f"generation {report['generation']}" in text
    finally:
        workers[1].signal_group(signal.SIGCONT)
    for proc in workers:
        assert proc.wait(180) == 0, proc.output()


def node(node_id: str, role: str, rank: int = 0) -> Node:
    return Node(node_id, role, rank, f"h:{rank}", NodeState.LIVE, 1)


def test_ssp_waits_only_on_workers_past_the_staleness_bound() -> None:
    view = ClusterView(3, (node("ps-0", "ps"), node("w0", "chief"), node("w1", "worker", 1),
                           node("w2", "worker", 2)))
    server = ServerReport("ps-0", "h:0", mode="ssp", staleness=2, pulls_waiting=1,
                          worker_clocks={"w0": 10, "w1": 7, "w2": 9}, transports={"w0": "shm"})
    status = summarise("h:1", view, [server])
    assert status.servers[0].waits_for == ("w1",)
    assert {m.node_id: m.lag for m in status.members} == {"ps-0": None, "w0": 0, "w1": 3, "w2": 1}
    assert {m.node_id: m.transports for m in status.members}["w0"] == ("shm",)
    assert "ps-0: 1 pull(s) wait for w1 (more than 2 clocks behind the fastest)" in render(status)


def test_async_waits_for_nobody() -> None:
    view = ClusterView(1, (node("w0", "chief"), node("w1", "worker", 1)))
    server = ServerReport("ps-0", "h:0", mode="async", pulls_waiting=0, worker_clocks={"w0": 5, "w1": 1})
    assert summarise("h", view, [server]).servers[0].waits_for == ()


def test_the_transport_of_each_worker_server_pair_is_shown() -> None:
    # Chosen per peer (issue 24): shared memory with the server on the worker's host, raw TCP to the others.
    view = ClusterView(1, (node("ps-0", "ps"), node("ps-1", "ps", 1), node("w0", "chief"),
                           node("w1", "worker", 1)))
    servers = [ServerReport("ps-0", "h:0", mode="sync", worker_clocks={"w0": 3, "w1": 3},
                            transports={"w0": "tcp", "w1": "shm"}),
               ServerReport("ps-1", "h:1", mode="sync", worker_clocks={"w0": 3, "w1": 3},
                            transports={"w0": "tcp"})]
    status = summarise("h", view, servers)
    assert status.pairs == {"w0": {"ps-0": "tcp", "ps-1": "tcp"}, "w1": {"ps-0": "shm", "ps-1": "grpc"}}
    assert json.loads(status.to_json())["pairs"] == status.pairs
    text = render(status).splitlines()
    header = next(i for i, line in enumerate(text) if line.startswith("TRANSPORT"))
    assert [line.split() for line in text[header:header + 3]] == [
        ["TRANSPORT", "ps-0", "ps-1"], ["w0", "tcp", "tcp"], ["w1", "shm", "grpc"]]


def test_drains_in_progress_and_done_are_shown_with_from_to_and_time() -> None:
    view = ClusterView(9, (Node("ps-0", "ps", 0, "127.0.0.1:7101", NodeState.LIVE, 1),
                           Node("ps-1", "ps", 1, "127.0.0.1:7102", NodeState.LEFT, 8)), layout_version=3)
    drains = [DrainReport("ps-1", "127.0.0.1:7102", "127.0.0.1:7103", 4, (1, 4), 3, 0.42, True),
              DrainReport("ps-2", "127.0.0.1:7103", "", 0, (), 0, 12.5, False)]
    text = render(summarise("127.0.0.1:7000", view, [], drains=drains))
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("DRAIN "))
    assert lines[header].split() == ["DRAIN", "STATE", "FROM", "TO", "SLICES", "LAYOUT", "TIME", "PARTITIONS"]
    assert lines[header + 1].split() == ["ps-1", "done", "127.0.0.1:7102", "127.0.0.1:7103", "4", "3", "0.42",
                                         "s", "1,4"]
    assert lines[header + 2].split() == ["ps-2", "in", "progress", "127.0.0.1:7103", "-", "0", "-", "12.50",
                                         "s", "-"]
    assert "DRAIN" not in render(summarise("127.0.0.1:7000", view, []))


def test_joins_catching_up_backing_up_done_and_rolled_back_are_shown_with_bytes_left_and_time() -> None:
    view = ClusterView(9, (Node("ps-0", "ps", 0, "127.0.0.1:7101", NodeState.LIVE, 1),
                           Node("ps-1", "ps", 1, "127.0.0.1:7102", NodeState.LIVE, 1),
                           Node("ps-2", "ps", 2, "127.0.0.1:7103", NodeState.LIVE, 7)), layout_version=4)
    joins = [JoinReport("ps-2", "127.0.0.1:7103", "127.0.0.1:7102", 3, (5,), 3 * 2**20, 4, 1.25, True),
             JoinReport("ps-3", "127.0.0.1:7104", "127.0.0.1:7103", 0, (), 0, 0, 2.5, False, bytes_left=2048),
             JoinReport("ps-3", "127.0.0.1:7104", "", 0, (), 0, 0, 0.75, False, "was declared dead"),
             JoinReport("ps-4", "127.0.0.1:7105", "127.0.0.1:7101", 2, (0, 6), 4096, 5, 3.5, False,
                        bytes_left=1024)]
    lines = render(summarise("127.0.0.1:7000", view, [], joins=joins)).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("JOIN "))
    assert lines[header].split() == ["JOIN", "STATE", "FROM", "TO", "SLICES", "BYTES", "LEFT", "LAYOUT",
                                     "TIME", "PARTITIONS"]
    assert lines[header + 1].split() == ["ps-2", "done", "127.0.0.1:7102", "127.0.0.1:7103", "3", "3.0",
                                         "MiB", "-", "4", "1.25", "s", "5"]
    assert lines[header + 2].split() == ["ps-3", "catching", "up", "127.0.0.1:7103", "127.0.0.1:7104", "0",
                                         "-", "2.0", "KiB", "-", "2.50", "s", "-"]
    assert lines[header + 3].split() == ["ps-3", "rolled", "back", "-", "127.0.0.1:7104", "0", "-", "-", "-",
                                         "0.75", "s", "(was", "declared", "dead)"]
    # Switched, its backups still copying what it took: the partitions it took, and the bytes left.
    assert lines[header + 4].split() == ["ps-4", "backing", "up", "127.0.0.1:7101", "127.0.0.1:7105", "2",
                                         "4.0", "KiB", "1.0", "KiB", "5", "3.50", "s", "0,6"]
    assert "JOIN" not in render(summarise("127.0.0.1:7000", view, []))


def test_servers_whose_failover_was_refused_are_shown_as_lost_with_why() -> None:
    view = ClusterView(9, (Node("ps-0", "ps", 0, "127.0.0.1:7101", NodeState.LIVE, 1),
                           Node("ps-1", "ps", 1, "127.0.0.1:7102", NodeState.DEAD, 2)), layout_version=2,
                       lost=(ServerLoss("127.0.0.1:7102", 2, "no live server holds an in-sync copy"),))
    status = summarise("127.0.0.1:7000", view, [])
    lines = render(status).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("LOST "))
    assert lines[header + 1].split()[:3] == ["127.0.0.1:7102", "2", "no"]
    assert lines[header + 1].endswith("no live server holds an in-sync copy")
    assert json.loads(status.to_json())["lost"] == [
        {"address": "127.0.0.1:7102", "layout_version": 2, "reason": "no live server holds an in-sync copy"}]
    assert "LOST" not in render(summarise("127.0.0.1:7000", ClusterView(9, view.nodes, 2), []))
