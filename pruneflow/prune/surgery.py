"""Rewrites that make a model prunable by torch-pruning without changing what it computes.

torch-pruning does not trace channel zero-padding (``F.pad`` on the channel dimension), which the
option-A shortcuts of the CIFAR ResNets use: pruning through it yields a broken model. A 1x1
convolution with stride s whose weight embeds input channel i at output channel pad + i computes
exactly the same function, and torch-pruning couples its channels correctly. The weight stays
frozen (it is a selection, not a learned layer) and is left out of importance scores.
"""

from __future__ import annotations

import torch
from torch import nn

from ..inputs import Inputs, call, first
from ..zoo.resnet_cifar import ChannelPadShortcut


class ChannelEmbedConv(nn.Conv2d):
    """Frozen 1x1 strided conv equal to ``F.pad(x[:, :, ::s, ::s], channels (pad, pad))``. Importance
    scores leave it out (``isinstance``): it is a selection, not a learned layer."""

    def __init__(self, in_channels: int, pad: int, stride: int):
        super().__init__(in_channels, in_channels + 2 * pad, 1, stride=stride, bias=False)
        with torch.no_grad():
            self.weight.zero_()
            for i in range(in_channels):
                self.weight[pad + i, i, 0, 0] = 1.0
        self.weight.requires_grad_(False)

    @classmethod
    def blank(cls) -> "ChannelEmbedConv":
        """One whose sizes and stride a checkpoint sets (registered under ``pruneflow.rebuildable_modules``)."""
        return cls(1, 0, 1)


def make_prunable(model: nn.Module, example: Inputs) -> int:
    """Replace every ChannelPadShortcut in place; returns how many were replaced."""
    shapes: dict[str, int] = {}
    hooks = [m.register_forward_hook(lambda mod, inp, out, n=n: shapes.__setitem__(n, inp[0].shape[1]))
             for n, m in model.named_modules() if isinstance(m, ChannelPadShortcut)]
    was = model.training
    model.eval()
    with torch.no_grad():
        call(model, example)
    model.train(was)
    for h in hooks:
        h.remove()
    replaced = 0
    for name, module in list(model.named_modules()):
        if isinstance(module, ChannelPadShortcut):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            conv = ChannelEmbedConv(shapes[name], module.pad, module.stride).to(first(example).device)
            setattr(parent, child, conv)
            replaced += 1
    return replaced
