"""The training job's settings that every server must share: consistency mode and optimizer.

Workers send a JobConfig with their first Declare; the first one a server sees wins
and later ones must agree (the same rule as initial values). Frozen dataclasses,
validated on construction so a bad value fails where it is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pshard.common.dtypes import WIRE_DTYPES
from pshard.common.errors import InvalidArgumentError

# The wire's enums (ConsistencyMode, Optimizer) carry these as CONSISTENCY_MODE_SYNC, OPTIMIZER_SGD,
# ...; pshard.common.codec converts.
MODES = ("sync", "async", "ssp")
OPTIMIZERS = ("sgd", "adam", "adamw", "adagrad", "aggregate")
__all__ = ["MODES", "OPTIMIZERS", "WIRE_DTYPES", "JobConfig", "OptimizerConfig"]


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
        if not self.lr >= 0.0:
            raise InvalidArgumentError(f"optimizer.lr: got {self.lr}, expected >= 0")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise InvalidArgumentError(
                f"optimizer.nesterov: needs momentum > 0 and dampening = 0, "
                f"got momentum={self.momentum}, dampening={self.dampening}"
            )
        for name, value in (("momentum", self.momentum), ("weight_decay", self.weight_decay),
                            ("eps", self.eps), ("lr_decay", self.lr_decay)):
            if value < 0:
                raise InvalidArgumentError(f"optimizer.{name}: got {value}, expected >= 0")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise InvalidArgumentError(f"optimizer.betas: got {self.betas}, expected each in [0, 1)")


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

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InvalidArgumentError(f"mode: got {self.mode!r}, expected one of {MODES}")
        if self.staleness < 0:
            raise InvalidArgumentError(f"staleness: got {self.staleness}, expected >= 0")
        if self.backup_workers < 0:
            raise InvalidArgumentError(f"backup_workers: got {self.backup_workers}, expected >= 0")
        if self.wire_dtype not in WIRE_DTYPES:
            raise InvalidArgumentError(f"wire_dtype: got {self.wire_dtype!r}, expected one of {WIRE_DTYPES}")
