"""Which of a model's buffers follow the job, and how (docs/architecture.md, 14 PyTorch idioms).

Floating-point buffers (BatchNorm's running_mean and running_var, ...) are not gradients, yet a
model evaluated or saved by one worker should hold what the whole job saw. PSTrainer's `buffers=`:

- "average": every step, each worker pushes its buffers beside its gradients and pulls back their
  mean (sync: the mean of the clock's pushes, so every worker starts step c+1 with the same buffers;
  async/SSP: the newest push). The servers hold them as slices of their own that the job declares
  `averaged` (JobConfig.averaged), whatever its optimizer. The default in sync mode.
- "local": each worker keeps its own, as before. The default in async and SSP modes, which have no
  common step to average at.

Integer buffers (num_batches_tracked) stay local: every worker counts the same steps in sync mode.
"""

from __future__ import annotations

from pshard.common.errors import InvalidArgumentError
from torch import Tensor, nn

POLICIES = ("average", "local")


def resolve(policy: str | None, mode: str) -> str:
    """The policy asked for, or the mode's default."""
    if policy is None:
        return "average" if mode == "sync" else "local"
    if policy not in POLICIES:
        raise InvalidArgumentError(f"buffers: got {policy!r}, expected one of {POLICIES}")
    return policy


def synced(model: nn.Module, policy: str) -> dict[str, Tensor]:
    """The buffers that travel under `policy`, by their state_dict names."""
    if policy == "local":
        return {}
    return {name: b for name, b in model.named_buffers() if b.is_floating_point()}
