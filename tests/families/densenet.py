"""DenseNet-style dense concatenation for the 8x8 grayscale digits: each layer of a dense block reads the
concatenation of every earlier feature map (BN-ReLU-Conv), transitions halve the channels and the size."""

from __future__ import annotations

import torch
from torch import nn


class DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int):
        super().__init__()
        self.norm = nn.BatchNorm2d(cin)
        self.act = nn.ReLU()
        self.conv = nn.Conv2d(cin, growth, 3, 1, 1, bias=False)

    def forward(self, x):
        return torch.cat([x, self.conv(self.act(self.norm(x)))], dim=1)


class Transition(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm = nn.BatchNorm2d(cin)
        self.act = nn.ReLU()
        self.conv = nn.Conv2d(cin, cout, 1, bias=False)
        self.pool = nn.AvgPool2d(2)

    def forward(self, x):
        return self.pool(self.conv(self.act(self.norm(x))))


class DenseNet(nn.Module):
    def __init__(self, num_classes: int = 10, growth: int = 8, layers: int = 3, in_channels: int = 1):
        super().__init__()
        width = 2 * growth
        self.stem = nn.Conv2d(in_channels, width, 3, 1, 1, bias=False)
        blocks: list[nn.Module] = []
        for stage in range(2):
            for _ in range(layers):
                blocks.append(DenseLayer(width, growth))
                width += growth
            if stage == 0:
                blocks.append(Transition(width, width // 2))
                width //= 2
        self.features = nn.Sequential(*blocks)
        self.norm = nn.BatchNorm2d(width)
        self.act = nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x):
        x = self.act(self.norm(self.features(self.stem(x))))
        return self.fc(torch.flatten(self.pool(x), 1))


def build(num_classes: int = 10, growth: int = 8, layers: int = 3, in_channels: int = 1) -> DenseNet:
    return DenseNet(num_classes=num_classes, growth=growth, layers=layers, in_channels=in_channels)
