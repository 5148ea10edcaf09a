"""LeNet-5 for Fashion-MNIST: a small CNN for the in-process scaling benchmark.

conv 6@5x5 (padding 2) -> max-pool -> conv 16@5x5 -> max-pool -> 120 -> 84 -> classes, ReLU
activations: 61,706 parameters for 10 classes. Inputs are the 1x28x28 images of
``build_datasets('fashion-mnist')``. No BatchNorm and no in-place operations, so per-worker
gradients can be taken with ``torch.func.vmap(grad(...))`` over ``functional_call``.
"""

from __future__ import annotations

import torch
from torch import nn


class LeNet5(nn.Module):
    """LeNet-5 sized CNN for ``in_channels`` x 28 x 28 images."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),  # 6x14x14
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.MaxPool2d(2))                    # 16x5x5
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(),
            nn.Linear(84, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def fmnist_lenet(num_classes: int = 10) -> LeNet5:
    """Fashion-MNIST's CNN (input: 1x28x28 images; 61,706 parameters for 10 classes)."""
    return LeNet5(num_classes=num_classes)
