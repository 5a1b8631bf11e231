"""The fp16 phase of the precision schedule: weights and layer inputs rounded to half precision.

Rounding is a straight-through estimator: the forward pass sees ``x.half().float()``, the backward
pass treats the rounding as identity, so FP32 master weights keep learning what survives FP16.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

ROUNDED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


def round_half(x: torch.Tensor) -> torch.Tensor:
    """FP16 rounding with a straight-through gradient (values beyond ±65504 saturate to inf, as in FP16)."""
    return x + (x.half().to(x.dtype) - x).detach()


class _HalfWeight(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return round_half(w)


@contextlib.contextmanager
def fp16_rounding(model: nn.Module) -> Iterator[int]:
    """Round every conv/linear layer's weight and input to FP16 inside the block; yields the layer count."""
    layers = [m for m in model.modules() if isinstance(m, ROUNDED)]
    handles = []
    try:
        for m in layers:
            parametrize.register_parametrization(m, "weight", _HalfWeight())
            handles.append(m.register_forward_pre_hook(lambda mod, args: (round_half(args[0]), *args[1:])))
        yield len(layers)
    finally:
        for h in handles:
            h.remove()
        for m in layers:
            if parametrize.is_parametrized(m, "weight"):
                # keep the FP32 master weights that were trained, not their rounded view
                parametrize.remove_parametrizations(m, "weight", leave_parametrized=False)
