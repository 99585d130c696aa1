"""The primary's lease from the scheduler (ps_server/core/lease.py): when a server stops taking writes."""

from __future__ import annotations

import pytest
from pshard.common.errors import FencedError, UnavailableError
from pshard.ps_server.core.lease import FRACTION, SchedulerLease


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def now(self) -> float:
        return self.t


def test_a_server_that_never_heard_from_a_scheduler_is_never_fenced() -> None:
    clock = Clock()
    lease = SchedulerLease(clock.now)
    clock.t += 1e6
    assert not lease.armed and not lease.expired()
    lease.check("push")  # nothing raised


def test_the_lease_runs_from_the_answered_heartbeats_sending_and_ends_before_the_schedulers_timeout() -> None:
    clock = Clock()
    lease = SchedulerLease(clock.now)
    assert lease.renew(sent_at=99.0, timeout_s=5.0) is False
    assert lease.expires_at == pytest.approx(99.0 + FRACTION * 5.0) and FRACTION < 1
    clock.t = 99.0 + FRACTION * 5.0 - 0.01
    lease.check("push")
    clock.t = 99.0 + FRACTION * 5.0
    with pytest.raises(FencedError) as caught:
        lease.check("push by 'w0' at clock 7")
    err = caught.value
    # Re-routed like an unreachable server, by type; the facts say how long and against what.
    assert isinstance(err, UnavailableError) and err.status == "FAILED_PRECONDITION"
    assert "push by 'w0' at clock 7" in str(err) and err.facts == {"silent_ms": 3000, "timeout_ms": 5000}
    assert lease.fenced == 1


def test_an_answer_lifts_the_fence_and_a_late_answer_to_an_older_heartbeat_never_shortens_it() -> None:
    clock = Clock()
    lease = SchedulerLease(clock.now)
    lease.renew(sent_at=100.0, timeout_s=1.0)
    clock.t = 101.0
    assert lease.expired()
    assert lease.renew(sent_at=100.9, timeout_s=1.0) is True  # it was fenced until now
    assert not lease.expired()
    lease.renew(sent_at=100.2, timeout_s=1.0)  # an answer that took long: the newer one still counts
    assert lease.expires_at == pytest.approx(100.9 + FRACTION)
    with pytest.raises(ValueError, match="timeout_s: got 0"):
        lease.renew(sent_at=101.0, timeout_s=0)


def test_a_write_waits_for_a_renewal_until_the_lease_lapses_one_timeout_after_its_end() -> None:
    clock = Clock()
    lease = SchedulerLease(clock.now)
    assert lease.lapses_at is None and not lease.lapsed()
    lease.renew(sent_at=100.0, timeout_s=2.0)
    assert lease.lapses_at == pytest.approx(100.0 + FRACTION * 2.0 + 2.0)
    clock.t = 100.0 + FRACTION * 2.0 + 1.9
    assert lease.expired() and not lease.lapsed()
    clock.t += 0.1
    assert lease.lapsed()
