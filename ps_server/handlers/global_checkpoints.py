"""A server's side of global checkpoints: write its part, restore from a committed checkpoint.

Transport-free handlers (GlobalCheckpoints); their thin gRPC servicer is
ps_server/transport/global_checkpoint_servicer.py. The coordinator
(worker.checkpoint_coordinator) asks every server for its part at a clock boundary, then commits the
checkpoint with a manifest (ps_server.checkpoints.global_part, docs/architecture.md 9 Failures).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path

from pshard.common import checkpoint_store as ckpt
from pshard.common.errors import InvalidArgumentError, LayoutConflictError, checkpoint_write_error
from pshard.common.job import JobConfig
from pshard.common.types import SliceKey
from pshard.ps_server.checkpoints import guard
from pshard.ps_server.checkpoints.global_part import restore_tables, shard_snapshot, write_part
from pshard.ps_server.core.store import ShardStore
from pshard.ps_server.handlers.dense import ParameterServerHandlers
from pshard.ps_server.handlers.tables import TableHandlers
from pshard.ps_server.tables.files import save_tables
from pshard.ps_server.tables.table import SparseTable

log = logging.getLogger("pshard.ps")

_PAUSE_LIMIT_S = 120.0  # the test hook's wait; the test SIGKILLs the server long before


class GlobalCheckpoints:
    def __init__(self, handlers: ParameterServerHandlers, tables: TableHandlers | None,
                 pause_dir: str | None = None, root: str | None = None) -> None:
        """`root`: the only directory checkpoints are written and read under (--global-checkpoint-dir);
        None refuses them (ps_server.checkpoints.guard)."""
        self._handlers = handlers
        self._root = root
        self._tables = tables
        self._pause_dir = Path(pause_dir) if pause_dir else None
        self._writing = asyncio.Lock()  # one part at a time: each holds a copy of the shard

    async def save_part(self, requested: str, clock: int, ranges: Mapping[SliceKey, ckpt.Range], server: int,
                        timeout_s: float | None, listed: int | None = None
                        ) -> tuple[list[ckpt.FileEntry], int, int]:
        """Write this server's part once every slice reached `clock`; (files, min and max version).

        Everything the request names is checked first, so a refusal is immediate and writes nothing
        (`listed`: how many ranges the request gave, to refuse duplicates)."""
        directory = guard.confine(self._root, requested)
        guard.check_ranges(ranges, len(ranges) if listed is None else listed)
        store = self._handlers.store
        guard.check_held(ranges, {slot.key: slot.value.size for slot in store.slots()})
        stats = store.stats()
        guard.check_clock(clock, stats.max_version, max(stats.worker_clocks.values(), default=0))
        if not directory.is_dir():
            raise InvalidArgumentError(f"checkpoint part: directory {str(directory)!r} does not exist on "
                                       "this server (global checkpoints need a file system the servers "
                                       "share)")
        snap = await self._handlers.snapshot_at(clock, timeout_s)
        versions = [s.version for s in snap.slices] or [clock]
        if snap.config.mode == "sync" and (min(versions) != clock or max(versions) != clock):
            # A sync checkpoint is one clock boundary on every slice of every server, or it is not consistent.
            raise LayoutConflictError(
                f"checkpoint at clock {clock}: slices are at versions {min(versions)}..{max(versions)}, "
                "not at one clock boundary; take global checkpoints from the chief between its steps")
        async with self._writing, self._locked_tables() as tables:
            try:
                files = await asyncio.get_running_loop().run_in_executor(
                    None, lambda: write_part(directory, server, snap, ranges,
                                             write_tables=_table_writer(tables), between=self._pause(server)))
            except OSError as err:  # a full or read-only disk: its errno, not UNKNOWN
                raise checkpoint_write_error(err, directory) from None
        log.info("checkpoint part %d at clock %d written to %s (%d files)", server, clock, directory,
                 len(files))
        return files, min(versions), max(versions)

    async def restore(self, requested: str, job: JobConfig, ranges: Mapping[SliceKey, ckpt.Range],
                      server: int, servers: int, resume: bool, listed: int | None = None,
                      row_owners: Sequence[int] = ()) -> tuple[bool, int, int, int]:
        """Configure this empty server from the committed checkpoint in `requested` (inside the root);
        (restored, clock, slices, table rows). False when it already holds a model: nothing changes."""
        directory = guard.confine(self._root, requested)
        guard.check_ranges(ranges, len(ranges) if listed is None else listed)
        guard.check_servers(server, servers, row_owners)
        checkpoint = ckpt.load_manifest(directory, verify=True)
        theirs = checkpoint.job
        if theirs.job_id != job.job_id:
            if not resume:
                raise LayoutConflictError(
                    f"restore: the checkpoint in {directory} is of job {theirs.job_id!r}, this is job "
                    f"{job.job_id!r}; pass resume to continue another job's checkpoint")
            log.warning("RESUMING ANOTHER JOB: the checkpoint in %s is of job %r, this is job %r",
                        directory, theirs.job_id, job.job_id)
        if _without_id(theirs) != _without_id(job):
            raise LayoutConflictError(f"restore: the checkpoint in {directory} was taken with {theirs}, "
                                      f"this job runs {job}")
        if self._handlers.has_store:  # already configured: spare reading the checkpoint
            return False, checkpoint.clock, 0, 0
        quorum = self._handlers.quorum
        # Read and re-cut off the event loop; the install (under the config lock) re-checks that no
        # Declare or other restore got there first.
        store = await asyncio.get_running_loop().run_in_executor(
            None, lambda: ShardStore.restore(shard_snapshot(checkpoint, job, ranges, quorum)))
        restored = await self._handlers.install_restored(lambda: store)
        if not restored:
            return False, checkpoint.clock, 0, 0
        rows = 0
        if self._tables is not None:
            for table in await asyncio.get_running_loop().run_in_executor(
                    None, restore_tables, checkpoint, server, servers, self._tables.make, row_owners):
                rows += len(table)
                self._tables.add(table)
        log.warning("restored the global checkpoint %s (clock %d, written by %d servers): %d slices, "
                    "%d table rows as server %d of %d", directory, checkpoint.clock, checkpoint.servers,
                    len(ranges), rows, server, servers)
        return True, checkpoint.clock, len(ranges), rows

    @contextlib.asynccontextmanager
    async def _locked_tables(self) -> AsyncIterator[list[SparseTable]]:
        if self._tables is None:
            yield []
            return
        async with self._tables.all_locked() as tables:
            yield tables

    def _pause(self, server: int) -> Callable[[str], None] | None:
        folder = self._pause_dir
        if folder is None:
            return None

        def pause(stage: str) -> None:
            if not (folder / "armed").exists():  # the test arms it for the one checkpoint it tears
                return
            (folder / f"part-{server}.{stage}.reached").touch()
            deadline = time.monotonic() + _PAUSE_LIMIT_S
            while not (folder / "continue").exists() and time.monotonic() < deadline:
                time.sleep(0.05)  # test hook only: polls a file the test creates (or is killed here)
        return pause


def _without_id(job: JobConfig) -> JobConfig:
    return dataclasses.replace(job, job_id="")


def _table_writer(tables: list[SparseTable]) -> Callable[[Path, str], Path | None] | None:
    if not tables:
        return None
    return lambda directory, name: save_tables(directory, name, tables)
