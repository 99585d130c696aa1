"""/metrics of a live scheduler, parameter server and worker (real processes on 127.0.0.1), read
with prometheus_client's own parser while a job trains."""

from __future__ import annotations

import json
import signal
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from pshard.api.v1 import scheduler_pb2, scheduler_pb2_grpc
from tests.e2e.harness import TIMEOUTS, LocalCluster, Proc, Procs, free_ports, wait_healthy, wait_until

PORT_LINE = r"metrics on port (\d+)"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]



def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def metrics_port(proc: Proc) -> int:
    return int(proc.wait_for_line(PORT_LINE, 60).group(1))


def start_job(cluster: LocalCluster, *worker_args: str) -> tuple[int, int, list[Proc]]:
    """Scheduler and one server with --metrics-port 0; returns their metrics ports and the workers."""
    procs, plan = cluster.procs, cluster.plan
    sched_task, ps_task = cluster.task("scheduler"), cluster.task("ps-0")
    scheduler = procs.python("scheduler", "-m", "pshard.scheduler", "--bind", sched_task.address,
                             "--heartbeat-interval-ms", "200", "--heartbeat-timeout-ms", "1500",
                             "--metrics-port", "0", tf_config=plan.tf_config(sched_task))
    ps = procs.python("ps-0", "-m", "pshard.ps_server", "--bind", ps_task.address, "--metrics-port", "0",
                      tf_config=plan.tf_config(ps_task))
    for task, proc in ((sched_task, scheduler), (ps_task, ps)):
        wait_healthy(task.address, proc=proc)
    workers = [cluster.start_worker(i, "--metrics-port", "0", "--batch-size", "16", *TIMEOUTS, *worker_args)
               for i in range(len(plan.worker))]
    return metrics_port(scheduler), metrics_port(ps), workers


def scheduler_generation(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        stream = stub.Watch(scheduler_pb2.WatchRequest(), timeout=10)
        view = next(iter(stream)).view
        stream.cancel()
        return int(view.generation)


def test_metrics_move_with_a_sync_job_and_lag_is_zero_at_its_end(procs: Procs) -> None:
    cluster = LocalCluster(procs, num_ps=1, num_workers=2)
    sched_port, ps_port, workers = start_job(cluster, "--mode", "sync", "--optimizer", "sgd", "--lr", "0.05",
                                             "--epochs", "6")
    worker_port = metrics_port(workers[0])

    def received() -> float:
        return sum(v for (name, _), v in scrape(ps_port).items() if name == "pshard_ps_received_bytes_total")

    wait_until(lambda: received() > 0, 60, "the server to receive bytes")
    first = received()
    wait_until(lambda: received() > first, 60, "the server's received bytes to grow")
    def steps() -> float:
        return value(scrape(worker_port), "pshard_worker_steps_total", worker="worker-0", role="chief") or 0.0

    wait_until(lambda: steps() > 0, 60, "the worker's step counter")
    counted = steps()
    wait_until(lambda: steps() > counted, 60, "the worker's step counter to grow")
    worker = scrape(worker_port)
    assert (value(worker, "pshard_worker_step_duration_seconds_count", worker="worker-0", role="chief")
            or 0) > 0

    for proc in workers:
        assert proc.wait(120) == 0, proc.output()
    server = scrape(ps_port)
    clocks = {dict(labels)["worker"]: v for (name, labels), v in server.items()
              if name == "pshard_ps_worker_clock"}
    lags = {dict(labels)["worker"]: v for (name, labels), v in server.items()
            if name == "pshard_ps_worker_clock_lag"}
    assert set(clocks) == {"worker-0", "worker-1"}
    assert lags == {"worker-0": 0, "worker-1": 0}, server
    assert value(server, "pshard_ps_sync_clock_min") == value(server, "pshard_ps_sync_clock_max")
    assert (value(server, "pshard_ps_sync_clock_max") or 0) > 0
    # Sync keeps every push and pull within one clock of the fastest worker.
    stamped = value(server, "pshard_ps_request_staleness_clocks_count") or 0
    assert stamped > 0 and value(server, "pshard_ps_request_staleness_clocks_bucket", le="1.0") == stamped
    sent = sum(v for (name, _), v in server.items() if name == "pshard_ps_sent_bytes_total")
    assert sent > 0 and (value(server, "pshard_ps_slices") or 0) >= 2  # at least a layer's weight and bias

    scheduler = scrape(sched_port)
    assert value(scheduler, "pshard_scheduler_generation") == scheduler_generation(
        cluster.task("scheduler").address)
    assert value(scheduler, "pshard_scheduler_members", role="ps", state="live") == 1


def test_a_killed_workers_lag_grows_until_the_scheduler_drops_it(procs: Procs) -> None:
    cluster = LocalCluster(procs, num_ps=1, num_workers=2)
    sched_port, ps_port, workers = start_job(cluster, "--mode", "async", "--optimizer", "sgd", "--lr", "0.01",
                                             "--epochs", "200")

    def lag(worker: str) -> float | None:
        return value(scrape(ps_port), "pshard_ps_worker_clock_lag", worker=worker)

    wait_until(lambda: lag("worker-1") is not None and cluster.steps_logged("worker-1") >= 5, 60,
               "worker-1 to push")
    workers[1].kill()  # SIGKILL: no Leave, the scheduler must notice the silence
    assert workers[1].popen.returncode == -signal.SIGKILL
    at_kill = lag("worker-1") or 0.0
    wait_until(lambda: (lag("worker-1") or 0) > at_kill + 5, 60, "the dead worker's lag to grow")
    wait_until(lambda: value(scrape(sched_port), "pshard_scheduler_members", role="worker",
                             state="dead") == 1, 30, "the scheduler to drop the killed worker")
    scheduler = scrape(sched_port)
    assert value(scheduler, "pshard_scheduler_worker_clock", node="worker-1", role="worker") is None
    assert value(scheduler, "pshard_scheduler_generation") == scheduler_generation(
        cluster.task("scheduler").address)


def test_a_chief_hosting_the_scheduler_serves_the_schedulers_metrics_with_its_own(procs: Procs) -> None:
    """A TFJob has no scheduler pod: the chief hosts it, and its /metrics carry the membership too."""
    chief_port, ps_port = free_ports(2)
    cluster = {"chief": [f"127.0.0.1:{chief_port}"], "ps": [f"127.0.0.1:{ps_port}"]}

    def tf_config(task_type: str) -> str:
        return json.dumps({"cluster": cluster, "task": {"type": task_type, "index": 0}})

    empty = procs.tmp_path / "empty-data"
    empty.mkdir()
    procs.python("ps-0", "-m", "pshard.ps_server", tf_config=tf_config("ps"))
    chief = procs.python("chief-0", "-m", "pshard.worker", "--data-dir", str(empty), "--model", "mlp",
                         "--mode", "async", "--epochs", "200", "--metrics-port", "0", *TIMEOUTS,
                         tf_config=tf_config("chief"))
    port = metrics_port(chief)

    def trained_and_seen() -> bool:
        samples = scrape(port)
        return ((value(samples, "pshard_worker_steps_total", worker="chief-0", role="chief") or 0) > 0
                and value(samples, "pshard_scheduler_members", role="ps", state="live") == 1
                and value(samples, "pshard_scheduler_worker_clock", node="chief-0", role="chief") is not None)

    wait_until(trained_and_seen, 60, "the chief's /metrics to show its steps and its scheduler's members")
    samples = scrape(port)
    assert value(samples, "pshard_scheduler_generation") == scheduler_generation(f"127.0.0.1:{chief_port}")
