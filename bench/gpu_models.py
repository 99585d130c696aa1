"""The models of the GPU check: the demo CNN and a ResNet-18 (11.7 M parameters with 1000 classes).

ResNet-18 is torchvision's architecture (basic blocks, [2, 2, 2, 2], BatchNorm), written out here
because the GPU machine has no torchvision. BatchNorm's running statistics are buffers, so they stay on
each worker (PSTrainer sends parameters only); for a throughput figure that is what matters.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

MODELS = ("cnn", "resnet18")


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.down(x))


def resnet18(channels: int, num_classes: int) -> nn.Module:
    layers: list[nn.Module] = [nn.Conv2d(channels, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                               nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, num_classes)]
    return nn.Sequential(*layers)


def build(name: str, image: Sequence[int], num_classes: int, seed: int = 0) -> nn.Module:
    """A fresh model, the same weights for the same seed (every worker and the local loop alike)."""
    from pshard.worker.model import build_model

    torch.manual_seed(seed)
    if name == "cnn":
        return build_model("cnn", image, num_classes)
    if name == "resnet18":
        return resnet18(int(image[0]), num_classes)
    raise ValueError(f"model: got {name!r}, expected one of {MODELS}")


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
