"""A small torchvision-style vision transformer on ``torch.nn.MultiheadAttention`` (issue 15's ViT family).

Conv patch embedding, a class token, a learned position embedding, pre-norm encoder layers
(``x + attn(norm(x))``, ``x + mlp(norm(x))``), a final LayerNorm and a linear head on the class token.
Defaults fit the built-in ``digits`` data (8x8 grayscale, 10 classes): 2x2 patches give 16 tokens + 1.
"""

from __future__ import annotations

import torch
from torch import nn


class EncoderLayer(nn.Module):
    """Pre-norm transformer layer, as torchvision's ``EncoderBlock``."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int = 2, dropout: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.self_attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, dim * mlp_ratio), nn.GELU(), nn.Linear(dim * mlp_ratio, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        x = x + self.self_attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, image_size: int = 8, patch: int = 2, in_channels: int = 1, dim: int = 64, heads: int = 4,
                 layers: int = 2, mlp_ratio: int = 2, num_classes: int = 10):
        super().__init__()
        tokens = (image_size // patch) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, tokens + 1, dim) * 0.02)
        self.encoder = nn.Sequential(*[EncoderLayer(dim, heads, mlp_ratio) for _ in range(layers)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        x = self.norm(self.encoder(x))
        return self.head(x[:, 0])


def build(**kwargs) -> ViT:
    return ViT(**kwargs)
