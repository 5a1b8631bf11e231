"""A small conv net with squeeze-excite gating (MobileNetV3 / EfficientNet style; issue 15's SE family).

Each block: 3x3 conv + BatchNorm + ReLU, then a squeeze-excite gate (global average pool, 1x1 reduce,
ReLU, 1x1 expand, sigmoid) multiplying the feature map channel by channel, and a residual add when the
shape is kept. Defaults fit the built-in ``digits`` data (8x8 grayscale, 10 classes).
"""

from __future__ import annotations

import torch
from torch import nn


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, reduction: int = 4):
        super().__init__()
        self.reduce = nn.Conv2d(channels, max(1, channels // reduction), 1)
        self.expand = nn.Conv2d(max(1, channels // reduction), channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.sigmoid(self.expand(torch.relu(self.reduce(x.mean((2, 3), keepdim=True)))))
        return x * gate


class SEBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(cout)
        self.se = SqueezeExcite(cout)
        self.residual = cin == cout and stride == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.se(torch.relu(self.bn(self.conv(x))))
        return x + y if self.residual else y


class SENet(nn.Module):
    def __init__(self, in_channels: int = 1, width: int = 16, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(SEBlock(in_channels, width), SEBlock(width, width), SEBlock(width, 2 * width, 2),
                                      SEBlock(2 * width, 2 * width))
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x).mean((2, 3)))


def build(**kwargs) -> SENet:
    return SENet(**kwargs)
