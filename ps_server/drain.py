"""Draining a parameter server (issue 20; docs/operations/scaling.md): `pshard ps --drain-on-term`.

On SIGTERM, before it stops serving, the server asks the scheduler to hand everything it serves to its
in-sync backup (SchedulerClient.hand_over, the scheduler's Membership.leave): a failover planned
instead of suffered. The scheduler publishes the new layout at once, so workers re-route without
waiting for a heartbeat timeout, and it refuses, changing nothing, while no backup holds a copy of
everything yet (a backup that joined is still copying): the server keeps serving and asks again with
its next in-sync report. A scheduler that cannot be reached (it restarts) is asked again the same
way. Writes that reach it after the switch are safe as after a false suspicion: its backup refuses
their replication once it has taken over, so they are never acknowledged, and the workers resend them
to the new primary.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from pshard.common.cluster.replicas import NoInSyncCopyError
from pshard.common.cluster.scheduler_client import SchedulerClient
from pshard.common.errors import PSError, UnavailableError

log = logging.getLogger("pshard.ps")

# Between tries: a primary sends its in-sync report with every heartbeat, recomputed this often
# (ps_server/follower.py IN_SYNC_REPORT_S); asking faster finds the scheduler unchanged.
_RETRY_S = 0.25


async def drain(client: SchedulerClient, timeout_s: float,
                now: Callable[[], float] = time.monotonic) -> int:
    """0 once the scheduler handed what this server serves to its backups (and it left the job); 1 when
    that could not be done within `timeout_s`, said in one line (the server then stops as without
    --drain-on-term, and a failover after its heartbeat timeout is what remains)."""
    loop = asyncio.get_running_loop()
    started = now()
    unreachable = False  # said once per outage
    while True:
        try:
            await loop.run_in_executor(None, client.hand_over)
        except (NoInSyncCopyError, UnavailableError) as err:
            if now() - started >= timeout_s:
                log.error("DRAIN FAILED after %.1f s (--drain-timeout-s): %s", now() - started, err)
                return 1
            if isinstance(err, UnavailableError) and not unreachable:
                # A scheduler that restarts learns the layout back from its members, and this server
                # registers again: leaving now would leave what it serves to a failover instead.
                log.warning("DRAIN: the scheduler is unreachable (%s); asking again until --drain-timeout-s",
                            err)
            unreachable = isinstance(err, UnavailableError)
            await asyncio.sleep(_RETRY_S)
            continue
        except PSError as err:
            log.error("DRAIN FAILED: %s", err)
            return 1
        log.warning("DRAINED: the scheduler handed what this server served to other servers in %.2f s; "
                    "leaving the job", now() - started)
        return 0
