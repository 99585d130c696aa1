"""The models the training CLI offers, sized for small grey-scale images on a couple of CPU cores.

Neither model has BatchNorm or other buffers: the parameter servers hold parameters and
their gradients, and running statistics (which are not gradients) would drift apart on
every worker. Initialisation is torch's default, so `torch.manual_seed(s)` before
`build_model` gives every worker the same initial weights.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pshard.common.errors import InvalidArgumentError
from pshard.worker.config import MODELS
from pshard.worker.data import Dataset
from torch import nn
from torch.nn import functional as F


def build_model(name: str, image_shape: Sequence[int], num_classes: int) -> nn.Module:
    """A fresh model for (C, H, W) inputs that returns (N, num_classes) logits."""
    if len(image_shape) != 3 or min(image_shape) < 1:
        raise InvalidArgumentError(
            f"image_shape: got {tuple(image_shape)}, expected (C, H, W) with each >= 1"
        )
    if num_classes < 2:
        raise InvalidArgumentError(f"num_classes: got {num_classes}, expected >= 2")
    channels, height, width = (int(d) for d in image_shape)
    if name == "mlp":
        return _mlp(channels * height * width, num_classes)
    if name == "cnn":
        return _cnn(channels, height, width, num_classes)
    raise InvalidArgumentError(f"model: got {name!r}, expected one of {MODELS}")


def _mlp(in_features: int, num_classes: int) -> nn.Module:
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_features, 256),
        nn.ReLU(),
        nn.Linear(256, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


def _cnn(channels: int, height: int, width: int, num_classes: int) -> nn.Module:
    # Two conv/pool stages then a small classifier: about 0.2 M parameters on 28x28, ~90% on
    # Fashion-MNIST after 2 epochs, and a step of batch 64 takes milliseconds on one CPU core.
    # Padding keeps each conv size-preserving, so only the two 2x2 pools shrink the image and
    # 8x8 digits still leave a 2x2 map.
    if height < 4 or width < 4:
        raise InvalidArgumentError(f"image_shape: cnn needs H, W >= 4 (two 2x2 pools), got {height}x{width}")
    flat = 32 * (height // 4) * (width // 4)
    return nn.Sequential(
        nn.Conv2d(channels, 16, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(flat, 128),
        nn.ReLU(),
        nn.Linear(128, num_classes),
    )


_EVAL_BATCH = 1000


def evaluate(model: nn.Module, data: Dataset, device: torch.device) -> tuple[float, float]:
    """(accuracy, mean loss) on the test split; shared by the chief and the evaluator task."""
    model.eval()
    correct, total_loss = 0, 0.0
    with torch.no_grad():
        for start in range(0, len(data.test_y), _EVAL_BATCH):
            x = torch.from_numpy(data.test_x[start:start + _EVAL_BATCH]).to(device)
            y = torch.from_numpy(data.test_y[start:start + _EVAL_BATCH]).to(device)
            logits = model(x)
            total_loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(dim=1) == y).sum())
    model.train()
    n = max(len(data.test_y), 1)
    return correct / n, total_loss / n
