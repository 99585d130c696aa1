"""A certificate that does not name the address its holder is reached by is named in seconds by the
side that refuses it (issue 24): a worker registering with such a scheduler ends its wait with the
fix, instead of "still waiting for the scheduler" for the whole start-up timeout. A real TLS scheduler
and a real registering SchedulerClient, as worker.session wires them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.errors import UnavailableError
from pshard.common.security.ca import issue, make_ca
from pshard.common.security.identity import Identity
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
