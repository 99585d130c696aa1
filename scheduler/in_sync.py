"""Which backups hold a full copy of which primary's slices (docs/architecture.md, 9 Failures). Pure.

A primary reports, with each heartbeat, the backups that acknowledged the state of every slice it
is primary of: from then on it acknowledges no step before they have it too, so they hold
everything it acknowledged. Only such a backup may be promoted. A copy stops counting as soon as
the scheduler learns something that may have emptied it, before any report could say so:

- the backup died, left or registered again (a new process holds nothing);
- the primary registered again (its old incarnation's backups copied a state that is gone);
- the ring moved, and the backup is no longer one of the primary's (the primary tells it to drop
  its copies).

Each report names the backup's incarnation (its generation), so a report about an incarnation that
is gone, or one sent before the ring moved, cannot mark a new or dropped copy in sync.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Collection, Mapping

log = logging.getLogger("pshard.scheduler")

# Role changes counted (pshard_scheduler_role_changes_total): a backup caught up, a copy stopped
# counting, a backup was promoted, a primary's slices were lost for want of a copy, a server that left
# handed its slices to its backup (a drain), a server that registered for a running job took slices of
# the primary it had caught up with (a join).
IN_SYNC, OUT_OF_SYNC, PROMOTED, LOST, DRAINED, JOINED = (
    "in_sync", "out_of_sync", "promoted", "lost", "drained", "joined")


class InSyncCopies:
    def __init__(self) -> None:
        self._copies: dict[str, dict[str, int]] = {}  # primary address -> {backup address: generation}
        self.changes: collections.Counter[str] = collections.Counter()

    def of(self, primary: str) -> frozenset[str]:
        """The addresses holding an in-sync copy of `primary`'s slices."""
        return frozenset(self._copies.get(primary, {}))

    def report(self, primary: str, copies: Mapping[str, int], current: Callable[[str, int], bool],
               backups: Collection[str]) -> None:
        """`primary` says `copies` (backup address -> its generation) hold all its slices.

        `current(address, generation)`: that incarnation is the live one; `backups`: the primary's
        backups in the present ring. Anything else in the report is stale and ignored.
        """
        held = {a: g for a, g in copies.items() if a != primary and a in backups and current(a, g)}
        before = self._copies.get(primary, {})
        for address in held.keys() - before.keys():
            self.changes[IN_SYNC] += 1
            log.info("ROLE: %s is an in-sync backup of %s (holds a copy of all its slices)", address, primary)
        for address in before.keys() - held.keys():
            self._out(primary, address, "its primary no longer reports it in sync")
        if held:
            self._copies[primary] = held
        else:
            self._copies.pop(primary, None)

    def forget(self, address: str, why: str) -> None:
        """A new process, or none, at `address`: it holds no copy, and its own backups copied a state
        that is gone."""
        self.reset(address, why)
        for primary, copies in list(self._copies.items()):
            if address in copies:
                del copies[address]
                self._out(primary, address, why)
                if not copies:
                    del self._copies[primary]

    def reset(self, primary: str, why: str) -> None:
        """`primary`'s copies no longer cover all its slices (it took over more)."""
        for backup in self._copies.pop(primary, {}):
            self._out(primary, backup, f"its primary {why}")

    def keep_only(self, primary: str, backups: Collection[str]) -> None:
        """The ring moved: copies on servers no longer `primary`'s backups are being dropped."""
        copies = self._copies.get(primary)
        if not copies:
            return
        for address in [a for a in copies if a not in backups]:
            del copies[address]
            self._out(primary, address, "it is no longer a backup of it (the ring changed)")
        if not copies:
            del self._copies[primary]

    def primaries(self) -> tuple[str, ...]:
        return tuple(self._copies)

    def _out(self, primary: str, backup: str, why: str) -> None:
        self.changes[OUT_OF_SYNC] += 1
        log.warning("ROLE: %s no longer counts as a copy of %s: %s", backup, primary, why)
