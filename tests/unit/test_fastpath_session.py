"""A fast-path session's reply slots (ps_server/transport/fastpath.py)."""

from __future__ import annotations

import pytest
from pshard.common.types import SliceKey
from pshard.common.wire import shm
from pshard.common.wire.fastwire import TransportBroken
from pshard.ps_server.transport.fastpath import _Session


def test_a_closed_sessions_reply_slot_is_transport_broken_not_a_write_into_its_unmapped_region():
    # A worker that goes while its sync clock waits has its session closed and its region unmapped; the
    # request's reply must end as TransportBroken (answered, logged quietly), not as a ValueError from a
    # copy into an empty region (a traceback in the server's log: seen in a fresh clone's CI run).
    session = _Session("worker-0", "shm", shm.Segment.create(4096, 4096))
    key = SliceKey("w", 0)
    assert session.slot(key, 1024) == 0
    session.close()
    with pytest.raises(TransportBroken, match="worker-0's shm session closed"):
        session.slot(key, 1024)
