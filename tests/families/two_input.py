"""A model with two named inputs (issue 15): an image branch (a small CNN) and a vector branch (an MLP on
metadata, e.g. a sensor reading), concatenated before the classifier. ``forward(image, meta)``: recipes
feed it with ``data.input_column: {image: <column>, meta: <column>}`` and its artifacts take ``image``
and ``meta`` by name."""

from __future__ import annotations

import torch
from torch import nn


class TwoInput(nn.Module):
    def __init__(self, channels: int = 1, meta_features: int = 4, width: int = 8, num_classes: int = 10):
        super().__init__()
        self.image_branch = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1), nn.BatchNorm2d(2 * width), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        )
        self.meta_branch = nn.Sequential(nn.Linear(meta_features, 2 * width), nn.ReLU())
        self.fc = nn.Linear(4 * width, num_classes)

    def forward(self, image: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.image_branch(image), self.meta_branch(meta)], dim=1))


def build(**kwargs) -> nn.Module:
    return TwoInput(**kwargs)
