"""A parameter server's settings, parsed once (by __main__, or built by tests and embedders).

Every server default is defined here and only here; the command line reads its flag defaults
from `ServerSettings` rather than repeating them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pshard.common.job import JobConfig
from pshard.common.limits import DEFAULT_LIMITS, Limits
from pshard.common.rpc.options import CHUNK_BYTES

# Longest `pshard ps --drain-on-term` waits for the scheduler to hand its slices over (ps_server.drain).
DRAIN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ServerSettings:
    # Job used when the first Declare carries none; None = the first Declare's config decides.
    default_job: JobConfig | None = None
    # Workers expected before any scheduler view arrives: worker id -> generation.
    static_quorum: Mapping[str, int] | None = None
    # Longest a pull (or a checkpoint) waits when the request names no timeout. Generous: a sync pull
    # waits for the slowest worker's whole step, which can take minutes on a loaded machine.
    pull_timeout_s: float = 120.0
    # Exchange frames are at most this big (common.rpc.options).
    chunk_bytes: int = CHUNK_BYTES
    # In-flight request bytes past which new requests are refused (RESOURCE_EXHAUSTED,
    # ps_server.transport.budget).
    max_inflight_bytes: int = 512 * 2**20
    # A connection that sent this many request bytes in a row that were refused or changed nothing
    # (duplicates) has its next early requests held and refused unread
    # (ps_server.transport.budget.WasteTarpit);
    # 0 = off.
    waste_limit_bytes: int = 4 * 2**20  # budget.DEFAULT_WASTE_LIMIT_BYTES says why this much
    checkpoint_dir: str | None = None
    # The disk tiers of tables with memory_mb (ps_server/tables/disktier.py): a cache on local disk,
    # wiped at start; None: such tables are refused.
    table_dir: str | None = None
    shard_name: str = "shard"  # checkpoint file name
    # Global checkpoints (SaveCheckpointPart, RestoreCheckpoint) are written and read only inside this
    # directory, the chief's --global-checkpoint-dir on a shared file system; None: they are refused.
    global_checkpoint_dir: str | None = None
    # A global checkpoint written in the background writes its tables at most this fast (0: unpaced),
    # so that the training beside it keeps its share of the host (ps_server.checkpoints.images.Pace).
    checkpoint_write_mb_s: float = 0.0
    # Fast paths offered to workers besides gRPC: auto (shm and tcp), shm, tcp or grpc (none).
    transport: str = "auto"
    # The raw TCP fast path's port on the bind host; 0: any free one. Pinned where a firewall between
    # hosts must let it through (docs/operations/ports.md).
    fast_port: int = 0
    # Where workers' shared-memory segments live (a directory both sides can map).
    shm_dir: str = "/dev/shm"
    # What one request may ask for (common.limits, docs/operations/limits.md); tighter for tests and
    # embedders.
    limits: Limits = DEFAULT_LIMITS
    # A sync clock with some but not all of its gradients for this long is logged and shown in
    # GetStats (which slice, which clock, which workers), well before a pull's deadline fires; 0 = off.
    hang_report_s: float = 30.0
    # Continue a checkpoint of another job (another job_id) instead of starting fresh; logged loudly.
    resume: bool = False
    # Backups per slice, a job setting every server shares (docs/architecture.md, 9 Failures): this
    # server's slices are forwarded to the next `replicas` live servers in ring order before a push
    # is acknowledged. 0: no replication.
    replicas: int = 0
    # Threads one slice's optimizer update (and sync sum) is split over, the caller's included
    # (pshard.common.chunks: the same bits as one thread); 0 = half the available cores, 1 to 8. A process
    # setting: the entry point sizes the process's pool with it (configure_shared_pool) before any slice.
    update_threads: int = 1  # 0 = half the cores, 1 to 8; common/chunks.py says why 1 is the default
    # Test hook (PSHARD_TEST_CHECKPOINT_PAUSE_DIR, read by the entry point): a global checkpoint's part
    # writer, while `<dir>/armed` exists, touches `<dir>/part-<i>.<stage>.reached` between its files and
    # waits there, so a test can SIGKILL the server mid-checkpoint deterministically. None in production.
    checkpoint_pause_dir: str | None = None
