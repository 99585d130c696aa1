"""Coordinating global checkpoints from a worker (the chief): save at a clock boundary, restore.

Save (docs/architecture.md, 9 Failures): between two of its steps the chief asks every server of
the layout (the scheduler's) for its part at the clock it is at. In sync mode no slice can pass
that clock while the chief has not pushed it, so every part is the same clock boundary. Once
every part is on disk with its checksums, the chief writes the manifest: the commit point. A
save that fails half way leaves a directory without a manifest, which readers report and skip.
The checkpoint root must be a file system the servers and the chief share.

Restore: before the first Declare, each server of the current layout (any number of them) is
configured from the newest committed checkpoint, its slices re-cut by the current layout and its
table rows re-placed by row hash. The Declare that follows finds the slices and keeps them.
"""

from __future__ import annotations

import logging
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


def report_torn(torn: gc.Torn) -> None:
    log.warning("IGNORING TORN CHECKPOINT %s: %s", torn.path, torn.reason)


def save(client: PSClient, root: str | Path, clock: int, *, keep: int | None = None,
         coordinator: Mapping[str, Any] | None = None) -> gc.Checkpoint:
    """Write a global checkpoint at `clock` under `root`; returns it once committed.

    `keep`: afterwards delete all but the newest `keep` committed checkpoints (None: keep all).
    `coordinator`: a coordinator's own state, committed in the manifest with the weights.
    """
    layout = _layout(client)
    if client.job is None:
        raise InvalidArgumentError("global checkpoint: declare the parameters first (the job is not known)")
    job = client.job
    directory = gc.new_directory(Path(root), clock)
    t = client.timeout_s
    try:
        replies = client.each_server(lambda i, stub: stub.SaveCheckpointPart(
            pb.SaveCheckpointPartRequest(directory=str(directory.resolve()), clock=clock,
                                         ranges=_ranges(layout, i), server=i, timeout_ms=int(t * 1000)),
            timeout=t + DEADLINE_SLACK_S, wait_for_ready=True))
    except Exception:
        log.error("checkpoint at clock %d in %s NOT committed: a server's part failed (the directory is torn "
                  "and will be ignored)", clock, directory)
        raise
    parts = [[gc.FileEntry(f.name, f.sha256, f.size) for f in r.files] for r in replies]
    params = {p.key: (p.dtype, p.shape) for p in layout.params}
    gc.commit(directory, clock, job, params, parts, coordinator)
    log.info("checkpoint at clock %d committed: %s (%d parts)", clock, directory, len(parts))
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


def save_checkpoint(client: PSClient, root: str, clock: int, keep: int | None) -> gc.Checkpoint | None:
    """The chief between two steps. A failed checkpoint is logged, not fatal: training goes on, and
    the previous committed checkpoint stays the one a restart restores."""
    try:
        return save(client, root, clock, keep=keep)
    except (PSError, OSError) as err:
        log.error("global checkpoint at clock %d failed: %s", clock, err)
        return None
