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


class TinyUNet(nn.Module):
    """Two levels down (strided convs), two up by ``ConvTranspose2d`` with the skip connections concatenated."""

    def __init__(self, in_channels: int = 3, num_classes: int = 2, width: int = 16):
        super().__init__()
        self.enc1 = _block(in_channels, width, 1)
        self.enc2 = _block(width, 2 * width, 2)
        self.mid = _block(2 * width, 4 * width, 2)
        self.up2 = nn.ConvTranspose2d(4 * width, 2 * width, 2, stride=2)
        self.dec2 = _block(4 * width, 2 * width, 1)
        self.up1 = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec1 = _block(2 * width, width, 1)
        self.head = nn.Conv2d(width, num_classes, 1)

    def forward(self, x):
        import torch

        e1 = self.enc1(x)
        e2 = self.enc2(e1)
        d2 = self.dec2(torch.cat([self.up2(self.mid(e2)), e2], dim=1))
        return self.head(self.dec1(torch.cat([self.up1(d2), e1], dim=1)))


def tiny_unet(in_channels: int = 3, num_classes: int = 2, width: int = 16) -> nn.Module:
    """Class scores [B, num_classes, H, W] for images [B, in_channels, H, W] (H and W divisible by 4); upsampling
    by transposed convolutions, whose INT8 weights are per channel on axis 1 (their output channels)."""
    return TinyUNet(in_channels, num_classes, width)
