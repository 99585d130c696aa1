"""The log says which transport replication really uses (issue 24): a primary's batches to a backup
that offers its raw TCP listener are announced as going over raw TCP, once per backup, not as gRPC.
A real server (the backup) and the primary's real link pool."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from pshard.common.rpc.serving import ServerThread
from pshard.ps_server.replication.link import stub_cache, tcp_links
from pshard.ps_server.settings import ServerSettings


def test_the_first_link_to_a_backup_is_logged_as_raw_tcp_once(start_server: Callable[..., ServerThread],
                                                               caplog: pytest.LogCaptureFixture) -> None:
    backup = start_server(ServerSettings(transport="tcp"))
    links = tcp_links("ps-0", stubs=stub_cache())
    with caplog.at_level(logging.INFO, logger="pshard.ps.replication"):
        first = links.take(backup.address)
        second = links.take(backup.address)  # another idle-less take: a second session, not announced
    try:
        assert first is not None and second is not None
        said = [r.getMessage() for r in caplog.records if r.name == "pshard.ps.replication"]
        assert said == [f"replication: batches to {backup.address} over raw TCP"], said
    finally:
        for link in (first, second):
            if link is not None:
                link.close()
