"""A tiny fully convolutional network for masks: two strided conv blocks down, bilinear upsampling back."""

from __future__ import annotations

from torch import nn


def _block(cin: int, cout: int, stride: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


def tiny_fcn(in_channels: int = 3, num_classes: int = 2, width: int = 16) -> nn.Module:
    """Class scores [B, num_classes, H, W] for images [B, in_channels, H, W] (H and W divisible by 4)."""
    return nn.Sequential(
        _block(in_channels, width, 1), _block(width, 2 * width, 2), _block(2 * width, 2 * width, 2),
        nn.Upsample(scale_factor=4, mode="bilinear", align_corners=False),
        _block(2 * width, width, 1), nn.Conv2d(width, num_classes, 1),
    )
