"""`PSEmbedding` and `PSEmbeddingBag`: torch modules whose rows live in a sparse table on the servers.

The forward pass pulls the distinct ids of its input once and builds the output from them with
torch ops, so autograd gives the gradient of each distinct row (torch sums repeats). The rows'
gradients are kept until the trainer's step, which pushes them, coalesced, with the table's
optimizer running on the servers:

    model = nn.Sequential(...)  # holding PSEmbedding(16, table="user") among dense layers
    trainer = PSTrainer(model, PSClient(servers, "worker-0"), job)  # attaches the tables
    loss_fn(model(x), y).backward()
    trainer.step()  # pushes the rows' gradients, then the dense exchange

The table's settings (optimizer, admission, eviction...) are TableConfig's, given as keywords.
Without a PSTrainer, call `attach(client)` and then `push_grads(clock)` after each backward pass.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from pshard.client.ps_client import PSClient
from pshard.common.errors import InvalidArgumentError
from pshard.common.sparse import TableConfig
from torch import nn

BAG_MODES = ("sum", "mean")


class PSEmbedding(nn.Module):
    def __init__(self, dim: int, table: str, client: PSClient | None = None, **config: Any) -> None:
        super().__init__()
        self.config = TableConfig(table, dim, **config)
        self._client: PSClient | None = None
        self._clock = 0  # the clock pulls read at (sync tables wait for it): the trainer's next step
        # (distinct ids, their pulled rows) of each forward pass since the last push.
        self._pending: list[tuple[np.ndarray, torch.Tensor]] = []
        if client is not None:
            self.attach(client)

    @property
    def dim(self) -> int:
        return self.config.dim

    def attach(self, client: PSClient) -> None:
        """Declare the table on `client`'s servers and use them from now on."""
        client.declare_table(self.config)
        self._client = client

    def _rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The distinct ids' rows (a leaf that records its gradient when training) and the inverse index."""
        if self._client is None:
            raise InvalidArgumentError(f"table {self.config.name!r}: the module has no client; wrap the "
                                       "model in a PSTrainer or call attach(client)")
        if ids.dtype not in (torch.int64, torch.int32):
            raise InvalidArgumentError(f"table {self.config.name!r}: ids of dtype {ids.dtype}, "
                                       "expected int64")
        flat = ids.detach().cpu().numpy().reshape(-1).astype(np.int64, copy=False)
        unique, inverse = np.unique(flat, return_inverse=True)
        pulled = self._client.pull_rows(self.config.name, unique, self._clock)
        rows = torch.from_numpy(np.ascontiguousarray(pulled))
        if self.training and torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._pending.append((unique, rows))
        return rows, torch.from_numpy(inverse.reshape(-1)).to(ids.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows, inverse = self._rows(ids)
        return rows.to(ids.device)[inverse].reshape(*ids.shape, self.dim)

    def push_grads(self, clock: int = 0) -> int:
        """Push the rows' gradients of every forward pass since the last push (repeats summed) for
        `clock`, after which pulls read at clock + 1; returns the rows stored (admission may only count
        some). A sync table gets a push even with no rows: its clock waits for every worker."""
        done = [(u, r.grad) for u, r in self._pending if r.grad is not None]
        self._pending.clear()
        self._clock = clock + 1
        if self._client is None or (not done and self.config.mode != "sync"):
            return 0
        ids = np.concatenate([u for u, _ in done]) if done else np.zeros(0, np.int64)
        grads = (np.concatenate([g.detach().cpu().numpy() for _, g in done]) if done
                 else np.zeros((0, self.dim), self.config.np_dtype))
        return self._client.push_rows(self.config.name, ids, grads, clock)


class PSEmbeddingBag(PSEmbedding):
    """Sums or means of rows per bag, as nn.EmbeddingBag: input (bags, ids per bag), or a 1-D input
    with `offsets` where each bag starts."""

    def __init__(self, dim: int, table: str, mode: str = "sum", client: PSClient | None = None,
                 **config: Any) -> None:
        if mode not in BAG_MODES:
            raise InvalidArgumentError(f"table {table!r}: mode {mode!r}, expected one of {BAG_MODES}")
        self.mode = mode
        super().__init__(dim, table, client, **config)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        rows, inverse = self._rows(ids)
        return F.embedding_bag(inverse.reshape(ids.shape), rows.to(ids.device), offsets, mode=self.mode)


def table_modules(model: nn.Module) -> list[PSEmbedding]:
    return [m for m in model.modules() if isinstance(m, PSEmbedding)]


def attach_tables(model: nn.Module, client: PSClient) -> list[PSEmbedding]:
    """Declare every table module of `model` on `client`; the modules, for `push_table_grads`."""
    modules = table_modules(model)
    for m in modules:
        m.attach(client)
    return modules


def push_table_grads(modules: list[PSEmbedding], clock: int) -> None:
    for m in modules:
        m.push_grads(clock)
