"""An in-process cluster for the coordinator's service tests: a real scheduler, real parameter servers,
serving workers on threads (pshard.worker.serve) and a ClusterCoordinator for the test's own thread.
Every address is a port the OS picked; every wait has a deadline."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from pshard.common.cluster.spec import ClusterSpec
from pshard.common.job import JobConfig
from pshard.coordinator.coordinator import DEFAULT_JOB, ClusterCoordinator
from pshard.ps_server.service import ServerThread, start_server_thread
from pshard.ps_server.settings import ServerSettings
from pshard.scheduler.service import SchedulerHandle, start_scheduler_thread
from pshard.worker.config import TrainConfig
from pshard.worker.serve import run_serving
from pshard.worker.session import ClusterSession

WAIT_S = 20.0


def free_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{sock.getsockname()[1]}"


@dataclass
class Cluster:
    scheduler: SchedulerHandle
    servers: list[ServerThread]
    chief: str
    workers: list[str]
    threads: list[threading.Thread] = field(default_factory=list)
    exits: dict[str, int] = field(default_factory=dict)

    def spec(self, task_type: str, index: int, scheduler: str | None = None) -> ClusterSpec:
        return ClusterSpec(task_type, index, scheduler=(scheduler or self.scheduler.address,),
                           chief=(self.chief,), ps=tuple(s.address for s in self.servers),
                           worker=tuple(self.workers))

    def start_worker(self, index: int, scheduler: str | None = None, threads: int = 0) -> threading.Thread:
        """Serving worker `index` on a thread; `scheduler`: the address it reaches the scheduler at (a
        CuttableLink's, to cut it off); `threads`: its --threads (torch's, which are this process's)."""
        cfg = TrainConfig(spec=self.spec("worker", index, scheduler), job=JobConfig(), data_dir="",
                          startup_timeout_s=WAIT_S, step_timeout_s=WAIT_S, threads=threads)

        def serve() -> None:
            self.exits[cfg.spec.node_id] = run_serving(cfg)

        thread = threading.Thread(target=serve, name=f"serving-worker-{index}", daemon=True)
        thread.start()
        self.threads.append(thread)
        return thread

    def coordinator(self, job: JobConfig = DEFAULT_JOB, **kwargs: Any) -> ClusterCoordinator:
        session = ClusterSession(self.spec("chief", 0), startup_timeout_s=WAIT_S, step_timeout_s=WAIT_S)
        return ClusterCoordinator(job, session=session, **kwargs)


@contextmanager
def cluster(workers: int = 2, servers: int = 1, heartbeat_timeout_s: float = 2.0,
            settings: ServerSettings | None = None) -> Iterator[Cluster]:
    scheduler = start_scheduler_thread(heartbeat_interval_s=heartbeat_timeout_s / 5,
                                       heartbeat_timeout_s=heartbeat_timeout_s)
    ps = [start_server_thread(settings or ServerSettings(), "127.0.0.1:0") for _ in range(servers)]
    c = Cluster(scheduler, ps, free_address(), [free_address() for _ in range(workers)])
    try:
        yield c
    finally:
        for thread in c.threads:
            thread.join(WAIT_S)
        for server in ps:
            server.stop(grace_s=0.2)
        scheduler.stop()
