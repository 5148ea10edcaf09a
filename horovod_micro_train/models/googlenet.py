"""GoogLeNet (Szegedy et al., 2015) for 32x32 inputs, as in the MiCRO paper's CIFAR runs.

The nine Inception modules keep the paper's branch widths (3a ... 5b). For 32x32 images the
ImageNet stem (7x7 stride 2, pools, LRN) becomes one 3x3 convolution to 192 channels, and the
auxiliary classifiers are dropped: they only served the deep ImageNet optimisation.
"""

from __future__ import annotations

import torch
from torch import nn


def _conv_bn(in_ch: int, out_ch: int, kernel: int) -> list[nn.Module]:
    return [nn.Conv2d(in_ch, out_ch, kernel, padding=kernel // 2, bias=False),
            nn.BatchNorm2d(out_ch), nn.ReLU(inplace=True)]


class Inception(nn.Module):
    """Four parallel branches (1x1; 1x1->3x3; 1x1->two 3x3 for the "5x5"; pool->1x1),
    concatenated along channels."""

    def __init__(self, in_ch: int, c1: int, c3_reduce: int, c3: int, c5_reduce: int, c5: int,
                 pool_proj: int):
        super().__init__()
        self.branch1 = nn.Sequential(*_conv_bn(in_ch, c1, 1))
        self.branch3 = nn.Sequential(*_conv_bn(in_ch, c3_reduce, 1), *_conv_bn(c3_reduce, c3, 3))
        # Two stacked 3x3 convolutions cover a 5x5 field with fewer weights.
        self.branch5 = nn.Sequential(*_conv_bn(in_ch, c5_reduce, 1), *_conv_bn(c5_reduce, c5, 3),
                                     *_conv_bn(c5, c5, 3))
        self.branch_pool = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1),
                                         *_conv_bn(in_ch, pool_proj, 1))
        self.out_channels = c1 + c3 + c5 + pool_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch3(x), self.branch5(x),
                          self.branch_pool(x)], dim=1)


# (c1, c3_reduce, c3, c5_reduce, c5, pool_proj) of modules 3a..5b in the GoogLeNet paper.
_CONFIG = {
    "3a": (64, 96, 128, 16, 32, 32), "3b": (128, 128, 192, 32, 96, 64),
    "4a": (192, 96, 208, 16, 48, 64), "4b": (160, 112, 224, 24, 64, 64),
    "4c": (128, 128, 256, 24, 64, 64), "4d": (112, 144, 288, 32, 64, 64),
    "4e": (256, 160, 320, 32, 128, 128),
    "5a": (256, 160, 320, 32, 128, 128), "5b": (384, 192, 384, 48, 128, 128),
}


class GoogLeNet(nn.Module):
    """Stem, Inception 3a-3b, pool, 4a-4e, pool, 5a-5b, global average pool, linear."""

    def __init__(self, num_classes: int = 10, in_channels: int = 3):
        super().__init__()
        layers: list[nn.Module] = _conv_bn(in_channels, 192, 3)
        channels = 192
        for name, widths in _CONFIG.items():
            if name in ("4a", "5a"):
                layers.append(nn.MaxPool2d(3, stride=2, padding=1))
            module = Inception(channels, *widths)
            layers.append(module)
            channels = module.out_channels
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.features(x)), 1))


def googlenet(num_classes: int = 10) -> GoogLeNet:
    """GoogLeNet for 32x32 RGB images."""
    return GoogLeNet(num_classes=num_classes)
