"""ResNet-18 for 32x32 inputs (He et al., 2016), as used in the MiCRO paper's CIFAR runs.

The CIFAR variant replaces ImageNet's 7x7 stride-2 stem and max-pool by one 3x3 stride-1
convolution, so the four stages see 32, 16, 8 and 4 pixel maps. With 10 classes it has
11,173,962 parameters (a test pins this: benchmarks compare against the paper's model).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a (projected when the shape changes) identity shortcut."""

    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """CIFAR ResNet built from :class:`BasicBlock` stages of widths 64, 128, 256, 512."""

    def __init__(self, blocks_per_stage: tuple[int, ...], num_classes: int = 10,
                 in_channels: int = 3):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False),
            nn.BatchNorm2d(64), nn.ReLU(inplace=True))
        stages, in_planes = [], 64
        for index, (planes, count) in enumerate(zip((64, 128, 256, 512), blocks_per_stage)):
            stride = 1 if index == 0 else 2
            layers = []
            for block in range(count):
                layers.append(BasicBlock(in_planes, planes, stride if block == 0 else 1))
                in_planes = planes
            stages.append(nn.Sequential(*layers))
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.pool(self.stages(self.stem(x)))
        return self.fc(torch.flatten(out, 1))


def resnet18(num_classes: int = 10) -> ResNet:
    """ResNet-18 for 32x32 RGB images (11,173,962 parameters for 10 classes)."""
    return ResNet((2, 2, 2, 2), num_classes=num_classes)
