"""MobileNetV2-style inverted residuals with squeeze-excite gating, for the 8x8 grayscale digits.

Depthwise 3x3 convs, 1x1 expand/project convs, a squeeze-excite block (global pool, two 1x1 convs, a
sigmoid gate multiplying the feature map) and residual Adds where shapes allow. The TOP module is an
``nn.Sequential``, as the user model of issue 15 was (NNCF's tracing failed on exactly that).
"""

from __future__ import annotations

from torch import nn


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, reduced: int):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce = nn.Conv2d(channels, reduced, 1)
        self.act = nn.ReLU()
        self.expand = nn.Conv2d(reduced, channels, 1)
        self.gate = nn.Sigmoid()

    def forward(self, x):
        return x * self.gate(self.expand(self.act(self.reduce(self.pool(x)))))


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int = 4, se: bool = True):
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = [
            nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, hidden, 3, stride, 1, groups=hidden, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
        ]
        if se:
            layers.append(SqueezeExcite(hidden, max(4, hidden // 4)))
        layers += [nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        out = self.block(x)
        return x + out if self.residual else out


def build(num_classes: int = 10, width: int = 8, in_channels: int = 1) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU6(),
        InvertedResidual(width, width, 1),
        InvertedResidual(width, 2 * width, 2),
        InvertedResidual(2 * width, 2 * width, 1),
        nn.Conv2d(2 * width, 4 * width, 1, bias=False), nn.BatchNorm2d(4 * width), nn.ReLU6(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, num_classes),
    )
