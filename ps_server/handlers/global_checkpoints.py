"""A server's side of global checkpoints: write its part, restore from a committed checkpoint.

Transport-free handlers (GlobalCheckpoints); their thin gRPC servicer is
ps_server/transport/global_checkpoint_servicer.py. The coordinator
(worker.checkpoint_coordinator) asks every server for its part at a clock boundary, then commits the
checkpoint with a manifest (ps_server.checkpoints.global_part, docs/architecture.md 9 Failures).

Non-blocking parts (issue 22): in phase CAPTURE the server copies its slices and tables in memory
(a snapshot at the clock, then the tables' rows under their locks) and answers; the files are
written in the background while training goes on, and phase DURABLE waits for them and answers
their checksums, for the coordinator's manifest. One part is captured or written at a time (each
holds a copy of the shard): the next capture waits for the previous write.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import enum
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path

from pshard.common import checkpoint_store as ckpt
from pshard.common.errors import InvalidArgumentError, LayoutConflictError, checkpoint_write_error
from pshard.common.job import JobConfig
from pshard.common.types import SliceKey
from pshard.ps_server.checkpoints import guard
from pshard.ps_server.checkpoints.global_part import (
    PartImage,
    capture_part,
    restore_tables,
    shard_snapshot,
    write_image,
)
from pshard.ps_server.checkpoints.images import Pace
from pshard.ps_server.core.store import ShardStore
from pshard.ps_server.handlers.dense import ParameterServerHandlers
from pshard.ps_server.handlers.tables import TableHandlers
from pshard.ps_server.tables.table import SparseTable

log = logging.getLogger("pshard.ps")

WRITER_NICE = 10  # the writer thread's nice, over the server's
_PAUSE_LIMIT_S = 120.0  # the test hook's wait; the test SIGKILLs the server long before


class Phase(enum.IntEnum):
    """parameter_server.proto's CheckpointPhase."""

    BOTH = 0  # capture and write, answer when durable
    CAPTURE = 1  # answer once captured; written in the background
    DURABLE = 2  # wait for the background write a CAPTURE started


class GlobalCheckpoints:
    def __init__(self, handlers: ParameterServerHandlers, tables: TableHandlers | None,
                 pause_dir: str | None = None, root: str | None = None, write_mb_s: float = 0.0) -> None:
        """`root`: the only directory checkpoints are written and read under (--global-checkpoint-dir);
        None refuses them (ps_server.checkpoints.guard). `write_mb_s`: the pace of background writes'
        tables (0: unpaced)."""
        self._write_mb_s = write_mb_s
        self._handlers = handlers
        self._root = root
        self._tables = tables
        self._pause_dir = Path(pause_dir) if pause_dir else None
        self._writing = asyncio.Lock()  # one part at a time: each holds a copy of the shard
        self._restoring = asyncio.Lock()
        # This server process's name in its parts: an incremental part refers only to its own writes.
        self._writer = uuid.uuid4().hex
        self._background: dict[Path, asyncio.Task[tuple[list[ckpt.FileEntry], int, int]]] = {}
        # Parts are written on a thread of their own, at a lower CPU priority: on a busy host its
        # hashing and copying yield to the requests of the training it runs beside.
        self._writer_thread = concurrent.futures.ThreadPoolExecutor(1, "checkpoint-writer", _lower_priority)

    async def save_part(self, requested: str, clock: int, ranges: Mapping[SliceKey, ckpt.Range], server: int,
                        timeout_s: float | None, listed: int | None = None, parent: str = "",
                        phase: Phase = Phase.BOTH) -> tuple[list[ckpt.FileEntry], int, int]:
        """Write this server's part once every slice reached `clock`; (files, min and max version).
        `parent`: a committed checkpoint the part completes (incremental); `phase`: see Phase (CAPTURE
        answers no files).

        Everything the request names is checked first, so a refusal is immediate and writes nothing
        (`listed`: how many ranges the request gave, to refuse duplicates)."""
        directory = guard.confine(self._root, requested)
        if phase == Phase.DURABLE:
            return await self._durable(directory)
        base = guard.confine(self._root, parent, "parent") if parent else None
        if base is not None and not (base / ckpt.MANIFEST).is_file():
            raise InvalidArgumentError(f"parent: {str(base)!r} holds no {ckpt.MANIFEST}: an incremental part "
                                       "completes a committed checkpoint")
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
        loop = asyncio.get_running_loop()
        await self._writing.acquire()  # released once the part is written, in the background or not
        try:
            async with self._locked_tables() as tables:
                count = self._tables.replication.partition_count() if self._tables is not None else 0
                image = await loop.run_in_executor(
                    None, lambda: capture_part(server, snap, ranges, tables, base, self._writer, count))
        except BaseException:
            self._writing.release()
            raise
        pace = Pace(self._write_mb_s) if phase == Phase.CAPTURE and self._write_mb_s > 0 else None
        write = self._write(directory, server, clock, image, (min(versions), max(versions)), pace)
        if phase == Phase.CAPTURE:
            self._background[directory] = task = asyncio.create_task(write)
            task.add_done_callback(_log_failure)
            log.info("checkpoint part %d at clock %d captured (%.1f MB), writing to %s in the background",
                     server, clock, image.nbytes / 2**20, directory)
            return [], min(versions), max(versions)
        return await write

    async def _write(self, directory: Path, server: int, clock: int, image: PartImage,
                     versions: tuple[int, int], pace: Pace | None) -> tuple[list[ckpt.FileEntry], int, int]:
        try:
            files = await asyncio.get_running_loop().run_in_executor(
                self._writer_thread, lambda: write_image(directory, image, self._pause(server), pace))
        except OSError as err:  # a full or read-only disk: its errno, not UNKNOWN
            raise checkpoint_write_error(err, directory) from None
        finally:
            self._writing.release()
        log.info("checkpoint part %d at clock %d written to %s (%d files%s)", server, clock, directory,
                 len(files), ", incremental" if image.meta["parent"] else "")
        return files, *versions

    async def _durable(self, directory: Path) -> tuple[list[ckpt.FileEntry], int, int]:
        """The files of the background write into `directory`, once durable (asked once)."""
        task = self._background.get(directory)
        if task is None:
            raise ckpt.CheckpointError(f"checkpoint part: no background write into {str(directory)!r} on "
                                          "this server (ask with phase CAPTURE first; a restarted server "
                                          "forgot it)")
        result = await asyncio.shield(task)  # a caller's timeout leaves the write going
        self._background.pop(directory, None)
        return result

    async def restore(self, requested: str, job: JobConfig, ranges: Mapping[SliceKey, ckpt.Range],
                      server: int, servers: int, resume: bool, listed: int | None = None,
                      row_owners: Sequence[int] = ()) -> tuple[bool, int, int, int]:
        """Configure this empty server from the committed checkpoint in `requested` (inside the root);
        (restored, clock, slices, table rows). False when it already holds a model: nothing changes."""
        directory = guard.confine(self._root, requested)
        guard.check_ranges(ranges, len(ranges) if listed is None else listed)
        guard.check_servers(server, servers, row_owners)
        links = ckpt.chain(ckpt.load_manifest(directory))  # every link verified, or refused naming its file
        checkpoint = links[0]
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
        async with self._restoring:  # one at a time: a second finds the first's model and reads nothing
            if self._handlers.has_store:  # already configured: spare reading the checkpoint
                return False, checkpoint.clock, 0, 0
            quorum = self._handlers.quorum
            # Read and re-cut off the event loop, the tables too (two restores filling a disk-tier table's
            # directory at once would clash: hence one at a time); the install (under the config lock)
            # re-checks that no Declare got there first.
            loop = asyncio.get_running_loop()
            store = await loop.run_in_executor(
                None, lambda: ShardStore.restore(shard_snapshot(checkpoint, job, ranges, quorum, links)))
            tables = [] if self._tables is None else await loop.run_in_executor(
                None, restore_tables, checkpoint, server, servers, self._tables.make, row_owners, links)

            def install() -> ShardStore:
                # The tables with the slices, in one step of the loop: an in-sync report in between would
                # count a backup holding the restored slices as a copy while the rows were still to come.
                self._add_tables(tables)
                return store

            if not await self._handlers.install_restored(install):
                return False, checkpoint.clock, 0, 0
        rows = sum(len(table) for table in tables)
        log.warning("restored the global checkpoint %s (clock %d, written by %d servers): %d slices, "
                    "%d table rows as server %d of %d", directory, checkpoint.clock, checkpoint.servers,
                    len(ranges), rows, server, servers)
        return True, checkpoint.clock, len(ranges), rows

    def _add_tables(self, tables: Sequence[SparseTable]) -> None:
        """Hold restored `tables`: all of them, or (one of their names declared already) none."""
        if self._tables is None:
            return
        for table in tables:
            if self._tables.find(table.config.name) is not None:
                raise InvalidArgumentError(f"table {table.config.name!r} is already declared on this server")
        for table in tables:
            self._tables.add(table)

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


def _lower_priority() -> None:
    with contextlib.suppress(OSError, AttributeError):  # Linux sets a thread's nice by its id; elsewhere not
        own = os.getpriority(os.PRIO_PROCESS, 0)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), min(19, own + WRITER_NICE))


def _log_failure(task: asyncio.Task[object]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background checkpoint part failed: %s", task.exception())
