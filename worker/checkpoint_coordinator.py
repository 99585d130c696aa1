"""Coordinating global checkpoints from a worker (the chief): save at a clock boundary, restore.

Save (docs/architecture.md, 9 Failures): between two of its steps the chief asks every server of
the layout (the scheduler's) for its part at the clock it is at. In sync mode no slice can pass
that clock while the chief has not pushed it, so every part is the same clock boundary. Once
every part is on disk with its checksums, the chief writes the manifest: the commit point. A
save that fails half way leaves a directory without a manifest, which readers report and skip.
The checkpoint root must be a file system the servers and the chief share.

Non-blocking (`save_in_background`, issue 22): the chief waits only for every server to capture its
part in memory (phase CAPTURE), then trains on; a thread waits for the parts to be durable (phase
DURABLE) and commits the manifest, so a checkpoint is committed only once every file is on disk.
Incremental (`parent`): the parts hold what changed since a committed checkpoint, and the manifest
names it; a chain is folded at restore time, or into a new full one by `pshard checkpoint compact`.

Restore: before the first Declare, each server of the current layout (any number of them) is
configured from the newest committed checkpoint, its slices re-cut by the current layout and its
table rows re-placed by row hash. The Declare that follows finds the slices and keeps them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pshard.client.ps_client import DEADLINE_SLACK_S, PSClient
from pshard.common import checkpoint_store as gc
from pshard.common.cluster.layout import Layout, LayoutSlice
from pshard.common.errors import InvalidArgumentError, PermissionDeniedError, PSError
from pshard.common.job import JobConfig
from pshard.common.wire import codec

from pshard.api.v1 import parameter_server_pb2 as pb

log = logging.getLogger("pshard.worker")


def _ranges(layout: Layout, server: int) -> list[pb.SliceRange]:
    def one(s: LayoutSlice) -> pb.SliceRange:
        return pb.SliceRange(key=s.key, part=s.part, offset=s.offset, numel=s.numel,
                             shape=list(layout.param(s.key).shape))
    return [one(s) for s in layout.slices_on(server)]


def _layout(client: PSClient) -> Layout:
    if client.layout is None:
        raise InvalidArgumentError("global checkpoint: the client has no layout yet (declare, or connect "
                                   "with the scheduler's layout, first)")
    return client.layout


def _job(client: PSClient) -> JobConfig:
    _layout(client)
    if client.job is None:
        raise InvalidArgumentError("global checkpoint: declare the parameters first (the job is not known)")
    return client.job


def report_torn(torn: gc.Torn) -> None:
    log.warning("IGNORING TORN CHECKPOINT %s: %s", torn.path, torn.reason)


def save(client: PSClient, root: str | Path, clock: int, *, keep: int | None = None,
         parent: gc.Checkpoint | None = None, coordinator: Mapping[str, Any] | None = None) -> gc.Checkpoint:
    """Write a global checkpoint at `clock` under `root`; returns it once committed.

    `keep`: afterwards delete all but the newest `keep` committed checkpoints (None: keep all) and
    the links they need. `parent`: a committed checkpoint under `root` this one is incremental over.
    `coordinator`: a coordinator's own state, committed in the manifest with the weights.
    """
    _job(client)
    directory = gc.new_directory(Path(root), clock)
    replies = _parts(client, directory, clock, parent, pb.CHECKPOINT_PHASE_UNSPECIFIED)
    return _commit(client, root, directory, clock, replies, parent, keep, coordinator)


def save_in_background(client: PSClient, root: str | Path, clock: int, *, keep: int | None = None,
                       parent: gc.Checkpoint | None = None) -> concurrent.futures.Future[gc.Checkpoint]:
    """`save`, returning as soon as every server captured its part in memory: training goes on while
    the servers write. The future holds the committed checkpoint, or the error that left it torn."""
    _job(client)
    directory = gc.new_directory(Path(root), clock)
    _parts(client, directory, clock, parent, pb.CHECKPOINT_PHASE_CAPTURE)
    done: concurrent.futures.Future[gc.Checkpoint] = concurrent.futures.Future()

    def finish() -> None:
        try:
            replies = _parts(client, directory, clock, parent, pb.CHECKPOINT_PHASE_DURABLE)
            done.set_result(_commit(client, root, directory, clock, replies, parent, keep))
        except BaseException as err:  # handed to whoever waits on the future
            done.set_exception(err)
    threading.Thread(target=finish, name=f"checkpoint-{clock}", daemon=True).start()
    return done


def _parts(client: PSClient, directory: Path, clock: int, parent: gc.Checkpoint | None,
           phase: pb.CheckpointPhase) -> list[pb.SaveCheckpointPartResponse]:
    layout = _layout(client)
    t = client.timeout_s
    try:
        return client.each_server(lambda i, stub: stub.SaveCheckpointPart(
            pb.SaveCheckpointPartRequest(directory=str(directory.resolve()), clock=clock,
                                         ranges=_ranges(layout, i), server=i, timeout_ms=int(t * 1000),
                                         parent=str(parent.path.resolve()) if parent is not None else "",
                                         phase=phase),
            timeout=t + DEADLINE_SLACK_S, wait_for_ready=True))
    except Exception:
        log.error("checkpoint at clock %d in %s NOT committed: a server's part failed (the directory is torn "
                  "and will be ignored)", clock, directory)
        raise


def _commit(client: PSClient, root: str | Path, directory: Path, clock: int,
            replies: list[pb.SaveCheckpointPartResponse], parent: gc.Checkpoint | None, keep: int | None,
            coordinator: Mapping[str, Any] | None = None) -> gc.Checkpoint:
    layout = _layout(client)
    parts = [[gc.FileEntry(f.name, f.sha256, f.size) for f in r.files] for r in replies]
    params = {p.key: (p.dtype, p.shape) for p in layout.params}
    gc.commit(directory, clock, _job(client), params, parts, coordinator, parent=parent)
    log.info("checkpoint at clock %d committed: %s (%d parts%s)", clock, directory, len(parts),
             f", incremental over {parent.path.name}" if parent is not None else "")
    if keep is not None:
        for gone in gc.retain(Path(root), keep):
            log.info("checkpoint retention (keep %d): removed %s", keep, gone)
    return gc.load_manifest(directory)


def restore(client: PSClient, root: str | Path, job: JobConfig, *, resume: bool = False) -> int | None:
    """Configure the servers from the newest committed checkpoint under `root` (torn ones are reported
    and skipped); the clock restored, or None when there is none. Servers that already hold a model
    keep it (a worker joining a running job restores nothing)."""
    checkpoint = restore_checkpoint_of(client, root, job, resume=resume)
    return checkpoint.clock if checkpoint is not None else None


def restore_checkpoint_of(client: PSClient, root: str | Path, job: JobConfig, *,
                          resume: bool = False) -> gc.Checkpoint | None:
    """`restore`, returning the checkpoint restored (its manifest: a coordinator reads its state there)."""
    layout = _layout(client)
    checkpoint = gc.latest(Path(root), report=report_torn)
    if checkpoint is None:
        return None
    gc.chain(checkpoint)  # a broken chain is refused here, naming its file, before any server reads it
    n = len(layout.servers)
    t = client.timeout_s
    replies = client.each_server(lambda i, stub: stub.RestoreCheckpoint(
        pb.RestoreCheckpointRequest(directory=str(checkpoint.path.resolve()), config=codec.job_to_proto(job),
                                    ranges=_ranges(layout, i), server=i, servers=n, resume=resume,
                                    row_owners=layout.row_owners),
        timeout=t + DEADLINE_SLACK_S, wait_for_ready=True))
    restored = sum(r.restored for r in replies)
    log.warning("checkpoint %s (clock %d, written by %d servers) restored onto %d of %d servers",
                checkpoint.path, checkpoint.clock, checkpoint.servers, restored, n)
    return checkpoint


# ---- in a training run (worker.train) ----

def restore_checkpoint(client: PSClient, root: str, job: JobConfig) -> int | None:
    """The clock of the newest committed checkpoint, after configuring the servers from it (None: there
    is none). At start, before the Declare: every trainer asks, so that whichever reaches a server first
    configures it from the checkpoint (a Declare first would start it fresh). With security on only
    the chief may restore; the servers then make the workers' Declares wait for the chief's."""
    try:
        return restore(client, root, job)
    except PermissionDeniedError:
        log.info("global checkpoint: restoring is the chief's (this worker's Declare waits for it)")
        newest = gc.latest(Path(root))
        return newest.clock if newest is not None else None


class Checkpointer:
    """The chief's global checkpoints in a training run. `background`: each returns once the servers
    captured their parts (at most one is being written: the next waits for it). `full_every` K > 1: a
    full checkpoint, then K - 1 incremental ones over the previous one, then a full one again (the
    first of a run is full: the servers' changes are tracked from their first part)."""

    def __init__(self, client: PSClient, root: str, keep: int | None, background: bool = False,
                 full_every: int = 1) -> None:
        self._client, self._root, self._keep = client, root, keep
        self._background, self._full_every = background, max(1, full_every)
        self._last: gc.Checkpoint | None = None
        self._pending: concurrent.futures.Future[gc.Checkpoint] | None = None

    def take(self, clock: int) -> None:
        """A checkpoint at `clock`; a failure is logged, not fatal (the previous one stays the latest)."""
        self.settle()
        last = self._last
        parent = last if last is not None and last.depth + 1 < self._full_every else None
        try:
            if self._background:
                self._pending = save_in_background(self._client, self._root, clock, keep=self._keep,
                                                   parent=parent)
            else:
                self._last = save(self._client, self._root, clock, keep=self._keep, parent=parent)
        except (PSError, OSError) as err:
            log.error("global checkpoint at clock %d failed: %s", clock, err)

    def settle(self) -> gc.Checkpoint | None:
        """Wait for the checkpoint being written, if any; the newest committed one of this run."""
        pending, self._pending = self._pending, None
        if pending is not None:
            try:
                self._last = pending.result()
            except (PSError, OSError) as err:
                log.error("global checkpoint written in the background failed: %s", err)
        return self._last
