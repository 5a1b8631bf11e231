"""A small ConvNeXt-style network (issue 15's ConvNeXt family).

Each block: depthwise 7x7 conv, LayerNorm on channels-last, Linear expand (4x), GELU, Linear back,
layer scale (a learned per-channel ``gamma``), residual ``x + branch(x)``. A stem conv, one downsampling
step (LayerNorm over channels + 2x2 stride-2 conv) between two stages, global average pooling, LayerNorm
and a linear head. Defaults fit the built-in ``digits`` data (8x8 grayscale, 10 classes).
"""

from __future__ import annotations

import torch
from torch import nn


class ChannelsFirstNorm(nn.Module):
    """LayerNorm over the channels of an NCHW tensor (permute to channels-last and back)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = nn.LayerNorm(channels, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class Block(nn.Module):
    def __init__(self, dim: int, expand: int = 4, layer_scale: float = 1e-1):
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, expand * dim)
        self.act = nn.GELU()
        self.pwconv2 = nn.Linear(expand * dim, dim)
        self.gamma = nn.Parameter(torch.full((dim,), layer_scale))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(self.dwconv(x).permute(0, 2, 3, 1))
        y = self.gamma * self.pwconv2(self.act(self.pwconv1(y)))
        return x + y.permute(0, 3, 1, 2)


class ConvNeXt(nn.Module):
    def __init__(self, in_channels: int = 1, dims: tuple[int, int] = (16, 32), depths: tuple[int, int] = (2, 2),
                 num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, dims[0], 3, padding=1), ChannelsFirstNorm(dims[0]))
        self.stage1 = nn.Sequential(*[Block(dims[0]) for _ in range(depths[0])])
        self.down = nn.Sequential(ChannelsFirstNorm(dims[0]), nn.Conv2d(dims[0], dims[1], 2, stride=2))
        self.stage2 = nn.Sequential(*[Block(dims[1]) for _ in range(depths[1])])
        self.norm = nn.LayerNorm(dims[1], eps=1e-6)
        self.head = nn.Linear(dims[1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.down(self.stage1(self.stem(x))))
        return self.head(self.norm(x.mean((2, 3))))


def build(**kwargs) -> ConvNeXt:
    if "dims" in kwargs:
        kwargs["dims"] = tuple(kwargs["dims"])
    if "depths" in kwargs:
        kwargs["depths"] = tuple(kwargs["depths"])
    return ConvNeXt(**kwargs)
