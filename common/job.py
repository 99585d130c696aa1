"""The training job's settings that every server must share: consistency mode and optimizer.

Workers send a JobConfig with their first Declare; the first one a server sees wins
and later ones must agree (the same rule as initial values). Frozen dataclasses,
validated on construction so a bad value fails where it is written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pshard.common.compression import Compression, Compressor
from pshard.common.errors import InvalidArgumentError
from pshard.common.wire.dtypes import WIRE_DTYPES

# The wire's enums (ConsistencyMode, Optimizer) carry these as CONSISTENCY_MODE_SYNC, OPTIMIZER_SGD,
# ...; pshard.common.wire.codec converts.
MODES = ("sync", "async", "ssp")
OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad", "aggregate")
# What a server does with a pushed gradient holding NaN or Inf (docs/architecture.md, 6 Server updates):
# reject refuses the whole request (INVALID_ARGUMENT naming the key and the first bad index), skip drops
# the poisoned gradients and counts them, allow applies them as they are.
NONFINITE = ("reject", "skip", "allow")
__all__ = ["MODES", "NONFINITE", "OPTIMIZERS", "WIRE_DTYPES", "JobConfig", "OptimizerConfig", "check_lr"]

# The accepted ranges (docs/operations/limits.md). The bounds are far beyond any setting that trains: they are
# there so that a typo or a hostile Declare (lr = 1e30, momentum = NaN) cannot configure every server
# of the job, since the first Declare's settings win for the whole run.
# (field, lowest, highest), both ends included; non-finite values are always refused.
_OPTIMIZER_RANGES = (
    ("lr", 0.0, 1e3),
    ("momentum", 0.0, 1.0),  # torch allows more, but momentum past 1 makes every step grow
    ("dampening", 0.0, 1.0),
    ("weight_decay", 0.0, 1.0),
    ("eps", 0.0, 1.0),
    ("lr_decay", 0.0, 1e3),
    ("initial_accumulator_value", 0.0, 1e6),
)
# SSP past a million clocks of staleness is async; sync backups cannot outnumber a job's members.
MAX_STALENESS = 2**20
# Their steps divide by sqrt(state) + eps (an unset eps of a protobuf JobConfig is 0: fine for sgd).
_DIVIDES_BY_EPS = ("adam", "adamw", "adagrad")
MAX_BACKUP_WORKERS = 4096
MAX_JOB_ID_CHARS = 128


def _check_range(field: str, value: float, low: float, high: float) -> None:
    if not (math.isfinite(value) and low <= value <= high):
        raise InvalidArgumentError(f"{field}: got {value}, expected a finite value in [{low:g}, {high:g}]")


def check_lr(field: str, lr: float) -> None:
    """A learning rate from anywhere (the job's, a push's stamp) within the accepted range."""
    _check_range(field, lr, *_LR_RANGE)


_LR_RANGE = next((low, high) for name, low, high in _OPTIMIZER_RANGES if name == "lr")


@dataclass(frozen=True)
class OptimizerConfig:
    """Hyper-parameters with torch.optim's names and defaults.

    `aggregate` is the aggregate-only mode: the server stores the mean gradient
    of each step as the slice value and the worker applies its own optimizer.
    """

    name: str = "sgd"
    lr: float = 0.01
    momentum: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    amsgrad: bool = False
    lr_decay: float = 0.0
    initial_accumulator_value: float = 0.0

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise InvalidArgumentError(f"optimizer.name: got {self.name!r}, expected one of {OPTIMIZERS}")
        for name, low, high in _OPTIMIZER_RANGES:
            _check_range(f"optimizer.{name}", getattr(self, name), low, high)
        if self.name in _DIVIDES_BY_EPS and not self.eps > 0:
            raise InvalidArgumentError(f"optimizer.eps: got {self.eps}, expected > 0 for {self.name}")
        if len(self.betas) != 2:
            raise InvalidArgumentError(f"optimizer.betas: got {self.betas}, expected two values")
        for i, beta in enumerate(self.betas):
            if not (math.isfinite(beta) and 0.0 <= beta < 1.0):
                raise InvalidArgumentError(f"optimizer.betas[{i}]: got {beta} (betas {self.betas}), "
                                           "expected each in [0, 1)")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise InvalidArgumentError(
                f"optimizer.nesterov: needs momentum > 0 and dampening = 0, "
                f"got momentum={self.momentum}, dampening={self.dampening}"
            )


@dataclass(frozen=True)
class JobConfig:
    mode: str = "sync"
    # SSP only: the fastest worker is never more than `staleness` clocks ahead of the slowest.
    staleness: int = 0
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    # Sync only: with b backup workers, the first (quorum - b) gradients of a clock are used.
    backup_workers: int = 0
    # Gradients and pulled weights may travel cast to this dtype ("" = as stored).
    wire_dtype: str = ""
    # A NaN or Inf that lands once poisons the weights of every worker for good, hence reject by default.
    nonfinite: str = "reject"
    # The run's identity (docs/architecture.md, 9 Failures): checkpoints carry it, and a server restores
    # only a checkpoint of the same job, so re-running with the same --checkpoint-dir never mixes two.
    job_id: str = ""
    # Keys whose slices hold the mean of what the workers push rather than an optimizer's update: the
    # model's floating-point buffers (BatchNorm running statistics), PSTrainer(buffers="average").
    averaged: tuple[str, ...] = ()
    # The workers' gradient compression (pshard.common.compression, docs/guide/compression.md): theirs
    # alone, as a server unpacks whatever each slice says it is, so it never travels in a Declare. A
    # cast (bf16, fp16) is the wire dtype: the default sets it, and a rule's cast must be it.
    compression: Compression = field(default_factory=Compression)

    def __post_init__(self) -> None:
        if isinstance(self.compression, dict):  # JSON
            object.__setattr__(self, "compression", Compression(**self.compression))
        self._fold_casts()
        if self.mode not in MODES:
            raise InvalidArgumentError(f"mode: got {self.mode!r}, expected one of {MODES}")
        _check_range("staleness", self.staleness, 0, MAX_STALENESS)
        _check_range("backup_workers", self.backup_workers, 0, MAX_BACKUP_WORKERS)
        if self.wire_dtype not in WIRE_DTYPES:
            raise InvalidArgumentError(f"wire_dtype: got {self.wire_dtype!r}, expected one of {WIRE_DTYPES}")
        if self.nonfinite not in NONFINITE:
            raise InvalidArgumentError(f"nonfinite: got {self.nonfinite!r}, expected one of {NONFINITE}")
        if len(self.job_id) > MAX_JOB_ID_CHARS or not all(c.isalnum() or c in "-_.:" for c in self.job_id):
            shown = self.job_id[:MAX_JOB_ID_CHARS + 1]
            raise InvalidArgumentError(f"job_id: got {shown!r}, expected at most {MAX_JOB_ID_CHARS} letters, "
                                       "digits or '-_.:'")
        object.__setattr__(self, "averaged", tuple(self.averaged))  # JSON and protobuf give lists
        if len(set(self.averaged)) != len(self.averaged) or not all(self.averaged):
            raise InvalidArgumentError(f"averaged: got {list(self.averaged)[:8]}, expected distinct, "
                                       "non-empty keys")

    def _fold_casts(self) -> None:
        """--compression bf16 is today's wire_dtype=bfloat16, pushes and pulls alike; a cast in a rule must
        be that same dtype, since pulls travel in one."""
        cast = self.compression.compressor.wire_dtype
        if cast:
            if self.wire_dtype not in ("", cast):
                raise InvalidArgumentError(f"compression: got {self.compression.default!r}, but wire_dtype "
                                           f"is {self.wire_dtype!r}; expected one of them, or both the same")
            object.__setattr__(self, "wire_dtype", cast)
        for i, (pattern, name) in enumerate(self.compression.rules):
            rule_cast = Compressor.parse(name).wire_dtype
            if rule_cast and rule_cast != self.wire_dtype:
                raise InvalidArgumentError(
                    f"compression.rules[{i}] ({pattern!r}): got {name!r}, which sends {rule_cast}, but the "
                    f"job's wire_dtype is {self.wire_dtype!r}; a cast rule must be the job's wire dtype (set "
                    f"wire_dtype={rule_cast!r})")
