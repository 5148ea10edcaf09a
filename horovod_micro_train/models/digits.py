"""A small CNN for scikit-learn's 8x8 digits, the embedded default run's model.

Small enough that two CPU ranks train it in seconds, large enough (about 40k weights) that a
density of a few percent still leaves hundreds of coordinates per exchange.
"""

from __future__ import annotations

import torch
from torch import nn


class DigitsCNN(nn.Module):
    """conv 1->16, conv 16->32, pool to 4x4, linear 512->64->classes."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64),
                                        nn.ReLU(inplace=True), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def digits_cnn(num_classes: int = 10) -> DigitsCNN:
    """The embedded default's model (input: 1x8x8 images)."""
    return DigitsCNN(num_classes=num_classes)
