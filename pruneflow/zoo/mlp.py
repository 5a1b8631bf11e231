"""A multilayer perceptron for feature vectors: tabular regressors and classifiers, a ranker's dense tower."""

from __future__ import annotations

from torch import nn


def mlp(in_features: int, hidden: int = 64, layers: int = 2, out_features: int = 1, dropout: float = 0.0) -> nn.Module:
    """``layers`` hidden Linear + ReLU blocks of width ``hidden``, then a Linear to ``out_features`` (1: one value or
    one click logit; K: K classes)."""
    blocks: list[nn.Module] = []
    width = in_features
    for _ in range(layers):
        blocks += [nn.Linear(width, hidden), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else [])
        width = hidden
    return nn.Sequential(*blocks, nn.Linear(width, out_features))
