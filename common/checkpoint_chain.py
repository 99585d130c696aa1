"""A table's rows in a chain of incremental global checkpoints, read back (issue 22).

A part's tables are written by ps_server.checkpoints.images: per table a folder with `ids.npy`, one
`.npy` per column, `table.json` (with `token`, `epoch` and `since`: the parent capture's epoch, null for
a full one) and, when incremental, `removed.npy`. A table's chain (`table_chain`) is its folders along
the checkpoints' chain, newest first, down to its full capture; each link must follow the next one's
capture of the same table object, or the chain is refused naming the file. `chain_rows` folds it
newest first: a row comes from the newest link that holds or removed it, so each id is read once, as
it was at the head's capture. Pure: numpy, json and files (the `pshard checkpoint` export reads it too).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pshard.common.errors import CheckpointError

CHUNK_ROWS = 1 << 16  # rows read at a time: bounds the temporary memory


def part_tables(folder: Path, part: str) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Part `part`'s tables in checkpoint `folder`: name -> (its directory, its table.json); {} if none."""
    pointer = folder / f"{part}.tables.json"
    if not pointer.exists():
        return {}
    index = json.loads(pointer.read_text())
    out = {}
    for entry in index["tables"]:
        sub = folder / index["directory"] / entry
        meta = json.loads((sub / "table.json").read_text())
        out[meta["config"]["name"]] = (sub, meta)
    return out


def table_chain(links: Sequence[Path], part: str, name: str) -> list[tuple[Path, dict[str, Any]]]:
    """Table `name`'s directories and table.json along part `part`'s chain (checkpoint folders newest
    first), down to its full capture; CheckpointError naming the missing or mismatched link."""
    out: list[tuple[Path, dict[str, Any]]] = []
    for i, folder in enumerate(links):
        held = part_tables(folder, part).get(name)
        if held is None:
            raise CheckpointError(f"checkpoint {folder}: table {name!r} of {part} is missing from "
                                  f"{folder / (part + '.tables.json')}, and {links[i - 1]} is incremental "
                                  "over it")
        sub, meta = held
        if out and (meta.get("token") != out[-1][1]["token"] or meta.get("epoch") != out[-1][1]["since"]):
            raise CheckpointError(f"checkpoint {folder}: {sub / 'table.json'} is capture {meta.get('epoch')} "
                                  f"of table {name!r}, but {out[-1][0] / 'table.json'} follows capture "
                                  f"{out[-1][1]['since']} of it")
        out.append((sub, meta))
        if meta.get("since") is None:
            return out
    raise CheckpointError(f"checkpoint {links[-1]}: table {name!r} of {part} is incremental, and the chain "
                          "ends there (its parent is missing)")


def chain_rows(chain: Sequence[tuple[Path, dict[str, Any]]], columns: Sequence[str]
               ) -> Iterator[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """The table's rows at its newest capture, a chunk at a time: each id from the newest link that
    holds it, none that a newer link removed."""
    decided = np.zeros(0, np.int64)  # sorted: ids a newer link held or removed
    for sub, meta in chain:
        ids = np.load(sub / "ids.npy", mmap_mode="r")
        arrays = {c: np.load(sub / f"{c}.npy", mmap_mode="r") for c in columns}
        for start in range(0, len(ids), CHUNK_ROWS):
            chunk = np.array(ids[start:start + CHUNK_ROWS])
            keep = ~_member(chunk, decided)
            if keep.any():
                yield chunk[keep], {c: np.array(a[start:start + CHUNK_ROWS])[keep] for c, a in arrays.items()}
        if meta.get("since") is not None:
            removed = np.load(sub / "removed.npy")
            decided = np.union1d(decided, np.union1d(np.asarray(ids), removed))



def _member(ids: np.ndarray, sorted_ids: np.ndarray) -> np.ndarray:
    if len(sorted_ids) == 0:
        return np.zeros(len(ids), bool)
    at = np.minimum(np.searchsorted(sorted_ids, ids), len(sorted_ids) - 1)
    return sorted_ids[at] == ids
