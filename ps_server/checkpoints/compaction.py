"""Folding a chain of incremental global checkpoints into a new full one (`pshard checkpoint compact`).

The new checkpoint sits beside the chain under the same root, at the head's clock and created after it,
so it is the newest; it holds, part by part, what a restore of the chain reads, and no parent. Each
part keeps its writer and its tables' tokens and epochs: the servers that wrote the head, still
running, take their next incremental part over the compacted one as over the head. The chain's
links are left for retention (`pshard checkpoint prune`) to delete. Offline and pure: numpy, json and
files; it reads and writes one part at a time.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
from pshard.common import checkpoint_store as ckpt
from pshard.common.checkpoint_chain import chain_rows, part_tables, table_chain
from pshard.ps_server.checkpoints.global_part import PartImage, write_image
from pshard.ps_server.checkpoints.images import TableImage

_NOT_COLUMNS = {"ids", "removed", "admission"}


def compact(checkpoint: ckpt.Checkpoint) -> ckpt.Checkpoint:
    """A full checkpoint equal to `checkpoint` read through its chain (every link verified first)."""
    links = ckpt.chain(checkpoint)
    directory = ckpt.new_directory(checkpoint.path.parent, checkpoint.clock)
    folders = [c.path for c in links]
    parts = []
    with ckpt.DenseReader(checkpoint, links) as reader:
        for part in sorted((f.name for f in checkpoint.files if re.fullmatch(r"part-\d+\.json", f.name)),
                           key=lambda n: int(n[5:-5])):
            name = part.removesuffix(".json")
            meta: dict[str, Any] = json.loads((checkpoint.path / part).read_bytes())
            arrays: dict[str, np.ndarray] = {}
            entries = []
            for i, e in enumerate(meta["slices"]):
                key, offset, numel = e["key"], int(e["offset"]), int(e["numel"])
                arrays[f"s{i}.value"] = reader.read(key, offset, numel)
                for j, state in enumerate(e["state_arrays"]):
                    arrays[f"s{i}.opt{j}"] = reader.read(key, offset, numel, state)
                entries.append({k: v for k, v in e.items() if k != "npz"} | {"index": i})
            tables = tuple(_folded(folders, name, t) for t in part_tables(checkpoint.path, name))
            image = PartImage(name=name, meta={**meta, "parent": None, "slices": entries}, arrays=arrays,
                              tables=tables)
            parts.append(write_image(directory, image))
    ckpt.commit(directory, checkpoint.clock, checkpoint.job, checkpoint.params, parts, checkpoint.coordinator)
    return ckpt.load_manifest(directory, verify=True)


def _folded(folders: list[Path], part: str, name: str) -> TableImage:
    links = table_chain(folders, part, name)
    head, meta = links[0]
    columns = sorted(p.stem for p in head.glob("*.npy") if p.stem not in _NOT_COLUMNS)
    chunks = list(chain_rows(links, columns))
    ids = np.concatenate([c[0] for c in chunks]) if chunks else np.zeros(0, np.int64)
    rows = {c: (np.concatenate([k[1][c] for k in chunks]) if chunks else np.load(head / f"{c}.npy")[:0])
            for c in columns}
    admission = np.load(head / "admission.npy") if (head / "admission.npy").exists() else None
    return TableImage(meta={**meta, "since": None}, ids=ids, columns=rows, removed=np.zeros(0, np.int64),
                      admission=admission)
