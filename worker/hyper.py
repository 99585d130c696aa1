"""PSTrainer's `param_groups`: the server-side optimizer's hyper-parameters as torch.optim shows them,
so that any `torch.optim.lr_scheduler` can drive the servers (docs/guide/pytorch-idioms.md).

Only the learning rate may change during a job: each push carries the lr of its clock in its stamp
(`Stamp.lr`), so in sync mode every worker's step c uses the same one. The other hyper-parameters
(momentum, betas, ...) are the job's, fixed on every server by the first Declare; a scheduler that
cycles them (OneCycleLR's cycle_momentum) is refused at the next step, naming the value.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pshard.common.errors import InvalidArgumentError
from pshard.common.job import OptimizerConfig, check_lr

# What each server-side optimizer shows in param_groups besides lr, with torch.optim's names.
_SHOWN = {
    "sgd": ("momentum", "dampening", "nesterov", "weight_decay"),
    "adam": ("betas", "eps", "weight_decay", "amsgrad"),
    "adamw": ("betas", "eps", "weight_decay", "amsgrad"),
    "adagrad": ("lr_decay", "eps", "weight_decay", "initial_accumulator_value"),
    "aggregate": (),
}


def defaults(config: OptimizerConfig) -> dict[str, Any]:
    """The param-group defaults of the job's optimizer: lr and what else applies to it."""
    return {"lr": config.lr, **{name: getattr(config, name) for name in _SHOWN[config.name]}}


def stamped_lr(groups: Sequence[Mapping[str, Any]], config: OptimizerConfig) -> float | None:
    """The lr to stamp on this step's pushes (None: the job's own), after checking that nothing else
    the servers cannot change was changed."""
    if len(groups) != 1:
        raise InvalidArgumentError(f"param_groups: got {len(groups)} groups, expected 1 (the servers run "
                                   "one optimizer over all of the model's parameters)")
    group = groups[0]
    for name in _SHOWN[config.name]:
        want, got = getattr(config, name), group.get(name)
        if (tuple(got) if isinstance(want, tuple) and got is not None else got) != want:
            raise InvalidArgumentError(
                f"param_groups[0][{name!r}]: got {got!r}, the servers' {config.name} runs {name}={want!r} "
                "for the whole job; only lr may follow a schedule")
    lr = float(group["lr"])
    if lr == config.lr:
        return None
    if config.name == "aggregate":
        raise InvalidArgumentError(
            f"param_groups[0]['lr']: got {lr!r}, but the servers only average gradients (optimizer "
            "'aggregate'); drive your local_optimizer's schedule instead")
    check_lr("param_groups[0]['lr']", lr)
    return lr
