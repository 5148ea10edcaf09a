"""A wide MLP with about ResNet-18's parameter count and a small fraction of its compute.

784 -> 4096 -> 2048 -> 512 -> classes: 12,660,234 parameters (ResNet-18 for CIFAR has
11,173,962), but forward+backward at batch 32 costs about 70 ms on one CPU thread, where
ResNet-18 costs about 1.6 s. The ratio of compute to parameters is then GPU-like, so behind
a rate-limited link dense training is communication-bound, as it is on a GPU cluster: the
model of the *communication-bound* regime (benchmarks) and of the Fashion-MNIST
time-to-accuracy runs (28x28 inputs, flattened).
"""

from __future__ import annotations

import torch
from torch import nn

WIDTHS = (4096, 2048, 512)


class WideMLP(nn.Module):
    """Flatten, then ``len(widths)`` ReLU layers and a linear classifier."""

    def __init__(self, num_classes: int = 10, in_features: int = 784,
                 widths: tuple[int, ...] = WIDTHS):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for w in widths:
            layers += [nn.Linear(width, w), nn.ReLU(inplace=True)]
            width = w
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def wide_mlp(num_classes: int = 10, in_features: int = 784) -> WideMLP:
    """The communication-bound regime's model (12,660,234 parameters for 10 classes)."""
    return WideMLP(num_classes=num_classes, in_features=in_features)


def fmnist_mlp(num_classes: int = 10, in_features: int = 784) -> WideMLP:
    """Fashion-MNIST's default model: 784-256-10 (203,530 parameters), a few ms per step."""
    return WideMLP(num_classes=num_classes, in_features=in_features, widths=(256,))
