"""CIFAR ResNet-20/32/44/56 (He et al. 2015, Sec. 4.2) with option-A shortcuts.

Written from the architecture description in ../shared/data/resnet_cifar10_akamaster/README.md so the
public pretrained weights there load with matching names (after the `module.` prefix is stripped).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class ChannelPadShortcut(nn.Module):
    """Option A: subsample spatially by ``stride`` and zero-pad ``pad`` channels on each side."""

    def __init__(self, stride: int, pad: int):
        super().__init__()
        self.stride = stride
        self.pad = pad

    def forward(self, x):
        return F.pad(x[:, :, :: self.stride, :: self.stride], (0, 0, 0, 0, self.pad, self.pad))


class BasicBlock(nn.Module):
    def __init__(self, in_planes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        if stride != 1 or in_planes != planes:
            self.shortcut: nn.Module = ChannelPadShortcut(stride, planes // 4)
        else:
            self.shortcut = nn.Identity()

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    def __init__(self, depth: int, num_classes: int = 10):
        super().__init__()
        if (depth - 2) % 6:
            raise ValueError(f"CIFAR ResNet depth must be 6n+2 (20, 32, 44, 56, 110), got {depth}")
        n = (depth - 2) // 6
        self.in_planes = 16
        self.conv1 = nn.Conv2d(3, 16, 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layer1 = self._layer(16, n, 1)
        self.layer2 = self._layer(32, n, 2)
        self.layer3 = self._layer(64, n, 2)
        self.linear = nn.Linear(64, num_classes)
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.kaiming_normal_(m.weight)

    def _layer(self, planes: int, blocks: int, stride: int) -> nn.Sequential:
        layers = []
        for s in [stride] + [1] * (blocks - 1):
            layers.append(BasicBlock(self.in_planes, planes, s))
            self.in_planes = planes
        return nn.Sequential(*layers)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer3(self.layer2(self.layer1(out)))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


def resnet20(num_classes: int = 10) -> CifarResNet:
    return CifarResNet(20, num_classes)


def resnet32(num_classes: int = 10) -> CifarResNet:
    return CifarResNet(32, num_classes)


def resnet44(num_classes: int = 10) -> CifarResNet:
    return CifarResNet(44, num_classes)


def resnet56(num_classes: int = 10) -> CifarResNet:
    return CifarResNet(56, num_classes)
