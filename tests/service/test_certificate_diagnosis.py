"""A certificate that does not name the address its holder is reached by is named in seconds by the
side that refuses it (issue 24): a worker registering with such a scheduler ends its wait with the
fix, instead of "still waiting for the scheduler" for the whole start-up timeout. A server refuses a
scheduler presenting another node's certificate (one of the job's CA, but a worker's). Real TLS
schedulers and real registering SchedulerClients, as worker.session and ps_server.service wire them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.errors import PermissionDeniedError, UnavailableError
from pshard.common.security.ca import issue, make_ca
from pshard.common.security.identity import Identity, may_serve_scheduler
from pshard.scheduler.service import start_scheduler_thread
from pshard.worker.waiting import Peer, PeerWait, certificate_refused

STARTUP_S = 60.0  # the registration's own timeout: the diagnosis must come long before it


def test_a_scheduler_certificate_without_the_address_ends_the_wait_in_seconds_with_the_fix(
        tmp_path: Path) -> None:
    make_ca(tmp_path)
    # Issued for the scheduler's other host only: workers reach it at 127.0.0.1.
    scheduler = start_scheduler_thread(
        security=issue(tmp_path, Identity("scheduler", "scheduler-0"), hosts=["10.20.30.40"]).security(
            "scheduler", "scheduler-0"))
    worker = issue(tmp_path, Identity("worker", "worker-0")).security("worker", "worker-0")
    client = SchedulerClient(scheduler.address, "worker", node_id="worker-0", connect_timeout_s=STARTUP_S,
                             security=worker)
    try:
        assert certificate_refused(scheduler.address, worker.client_ssl_context()) is not None
        started = time.monotonic()
        with pytest.raises(UnavailableError) as caught, PeerWait(
                "registering", lambda: [Peer("the scheduler", scheduler.address, listens=True)], client.close,
                tls=worker.client_ssl_context):
            client.register()
        assert time.monotonic() - started < 10.0
        message = str(caught.value)
        assert f"the scheduler at {scheduler.address}: its TLS certificate is refused here" in message
        assert "pshard certs --host 127.0.0.1" in message
    finally:
        client.close()
        scheduler.stop(grace_s=0.2)


def test_a_certificate_naming_the_address_is_accepted(tmp_path: Path) -> None:
    make_ca(tmp_path)
    scheduler = start_scheduler_thread(
        security=issue(tmp_path, Identity("scheduler", "scheduler-0")).security("scheduler", "scheduler-0"))
    worker = issue(tmp_path, Identity("worker", "worker-0")).security("worker", "worker-0")
    try:
        assert certificate_refused(scheduler.address, worker.client_ssl_context()) is None
    finally:
        scheduler.stop(grace_s=0.2)


@pytest.mark.parametrize(("identity", "host_task", "allowed"), [
    (Identity("scheduler", "scheduler-0"), "", True),
    (Identity("scheduler"), "chief-0", True),
    (Identity("chief", "chief-0"), "chief-0", True),  # the chief hosts the scheduler in-process
    (Identity("worker", "worker-0"), "worker-0", True),
    (Identity("worker", "worker-0"), "", False),  # the cluster has a scheduler task: a worker is no scheduler
    (Identity("worker", "worker-1"), "worker-0", False),
    (Identity("chief", "chief-0"), "worker-0", False),
    (Identity("ps", "ps-0"), "", False),
    (Identity("admin"), "", False),
    (None, "", False),
])
def test_who_may_serve_the_scheduler(identity: Identity | None, host_task: str, allowed: bool) -> None:
    assert may_serve_scheduler(identity, host_task) is allowed


def test_a_server_refuses_a_scheduler_presenting_a_workers_certificate(tmp_path: Path) -> None:
    make_ca(tmp_path)
    impostor = start_scheduler_thread(
        security=issue(tmp_path, Identity("worker", "worker-1")).security("worker", "worker-1"))
    server = issue(tmp_path, Identity("ps", "ps-0")).security("ps", "ps-0")
    client = SchedulerClient(impostor.address, "ps", node_id="ps-0", connect_timeout_s=10.0, security=server,
                             scheduler_host="")
    try:
        with pytest.raises(PermissionDeniedError) as caught:
            client.register()
        assert (f"scheduler at {impostor.address}: its certificate names worker/worker-1, expected scheduler"
                in str(caught.value))
        assert client.closed  # no heartbeats to it, no views from it
    finally:
        client.close()
        impostor.stop(grace_s=0.2)


def test_a_server_registers_with_the_schedulers_own_certificate(tmp_path: Path) -> None:
    make_ca(tmp_path)
    scheduler = start_scheduler_thread(
        security=issue(tmp_path, Identity("scheduler", "scheduler-0")).security("scheduler", "scheduler-0"))
    server = issue(tmp_path, Identity("ps", "ps-0")).security("ps", "ps-0")
    client = SchedulerClient(scheduler.address, "ps", node_id="ps-0", connect_timeout_s=10.0, security=server,
                             scheduler_host="")
    try:
        assert client.register().node_id == "ps-0"
    finally:
        client.close()
        scheduler.stop(grace_s=0.2)
