"""The `hostbed` fixture: multi-host beds of network namespaces (bench/hostbed), torn down after the test.

    def test_x(hostbed):
        bed = hostbed(["sched", "ps0", "w0"], forwarded=["w0"])

Skips, with the reason, where no bed can be made (not root, no `ip`/`tc`): CI runs as root, so it runs
there. Beds left by a run that was SIGKILLed are swept once per session, before the first bed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

import pytest

from bench.hostbed import HostBed, skip_reason, sweep

# The fixture's type: hostbed(hosts, forwarded=()) -> a bed that is up, torn down after the test.
Bed = Callable[..., HostBed]
_swept = False


@pytest.fixture
def hostbed() -> Iterator[Bed]:
    global _swept
    if (reason := skip_reason()) is not None:
        pytest.skip(reason)
    if not _swept:
        sweep()
        _swept = True
    beds: list[HostBed] = []

    def make(hosts: Sequence[str], *, forwarded: Iterable[str] = ()) -> HostBed:
        bed = HostBed(hosts, forwarded=forwarded)
        beds.append(bed)
        bed.up()
        return bed

    try:
        yield make
    finally:
        for bed in beds:
            bed.down()
