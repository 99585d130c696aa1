"""Checkpoint files that cannot be written or read are PSErrors naming the file and why: the errno of a
write (RESOURCE_EXHAUSTED for a full disk, else FAILED_PRECONDITION), the damage of a read."""

from __future__ import annotations

import asyncio
import errno
from pathlib import Path

import numpy as np
import pytest
from pshard.common.errors import CheckpointError, CheckpointSpaceError, checkpoint_write_error
from pshard.common.sparse import TableConfig
from pshard.ps_server.handlers.tables import TableHandlers
from pshard.ps_server.settings import ServerSettings
from pshard.ps_server.tables.files import load_tables, save_tables
from pshard.ps_server.tables.table import SparseTable

from tests.service.mounts import tmpfs


def test_a_write_error_names_the_file_and_the_errno_and_picks_the_status() -> None:
    full = checkpoint_write_error(OSError(errno.ENOSPC, "No space left on device", "/d/shard.npz"), "/d")
    assert isinstance(full, CheckpointSpaceError) and full.status == "RESOURCE_EXHAUSTED"
    assert str(full) == "checkpoint: cannot write '/d/shard.npz': ENOSPC (No space left on device)"
    read_only = checkpoint_write_error(OSError(errno.EROFS, "Read-only file system"), "/d")
    assert type(read_only) is CheckpointError and read_only.status == "FAILED_PRECONDITION"
    assert str(read_only) == "checkpoint: cannot write '/d': EROFS (Read-only file system)"
    quota = checkpoint_write_error(OSError(errno.EDQUOT, "Disk quota exceeded", "/d/x"), "/d")
    assert isinstance(quota, CheckpointSpaceError)


def _table(rows: int) -> SparseTable:
    table = SparseTable(TableConfig("emb", 8))
    table.push(np.arange(rows, dtype=np.int64), np.ones((rows, 8), np.float32))
    return table


@pytest.mark.parametrize("damage", ["truncate", "remove"])
def test_a_damaged_table_checkpoint_is_a_checkpoint_error_naming_the_pointer(tmp_path: Path,
                                                                             damage: str) -> None:
    pointer = save_tables(tmp_path, "shard", [_table(100)])
    (ids,) = tmp_path.rglob("ids.npy")
    if damage == "truncate":
        ids.write_bytes(ids.read_bytes()[:100])
    else:
        ids.unlink()
    with pytest.raises(CheckpointError, match=rf"table checkpoint {pointer}: cannot read it \("):
        load_tables(tmp_path, "shard", lambda config: SparseTable(config))


def test_a_table_checkpoint_on_a_full_disk_is_refused_naming_file_and_errno(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "disk", size="64k") as disk:
        async def main() -> None:
            handlers = TableHandlers(ServerSettings(checkpoint_dir=str(disk)))
            await handlers.declare(TableConfig("emb", 8))
            await handlers.push("emb", np.arange(10_000, dtype=np.int64).tobytes(),
                                np.ones((10_000, 8), np.float32).tobytes())
            with pytest.raises(CheckpointSpaceError, match=rf"cannot write '{disk}/[^']+': ENOSPC"):
                await handlers.checkpoint()
            assert handlers.stats("emb").rows == 10_000  # the table is as it was

        asyncio.run(main())
