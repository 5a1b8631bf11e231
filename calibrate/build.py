"""Build a calibration set from a split: de-duplicate, choose, describe."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn

from pruneflow.data import Split
from pruneflow.errors import ConfigError, InputError

from .calibset import CalibrationSet
from .sampling import content_hashes, first_occurrences, select_diverse, select_random, select_stratified

STRATEGIES = ("random", "stratified", "diverse")


def penultimate_features(model: nn.Module, x: torch.Tensor, batch_size: int = 256) -> np.ndarray:
    """The input of the model's last Linear layer (the classifier's features), for every sample."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ConfigError(("features",), "model features need a model ending in a Linear layer", value="model",
                          hint="use features: inputs")
    captured: list[torch.Tensor] = []
    handle = linears[-1].register_forward_hook(lambda m, inp, out: captured.append(inp[0].detach().flatten(1).cpu()))
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for start in range(0, len(x), batch_size):
                model(x[start : start + batch_size].to(device))
    finally:
        handle.remove()
        model.train(was)
    return torch.cat(captured).numpy()


def build_calibration_set(split: Split, *, size: int, strategy: str, seed: int, groups: np.ndarray | None = None,
                          features: Callable[[torch.Tensor], np.ndarray] | None = None, dedupe: bool = True,
                          meta: dict | None = None, warn: Callable[[str], None] = lambda m: None) -> CalibrationSet:
    """Choose ``size`` samples of ``split`` by ``strategy``.

    ``groups``: one value a sample for ``stratified`` (labels, or any column). ``features``: maps
    inputs to feature vectors for ``diverse`` (default: the inputs themselves). A wrong setting raises
    ConfigError at the setting's own key (``("by",)``): the caller knows where that sits (the stage:
    ``exc.under(*self.loc())``).
    """
    if strategy not in STRATEGIES:
        raise ConfigError(("strategy",), f"unknown strategy; known: {', '.join(STRATEGIES)}", value=strategy)
    if size < 1:
        raise ConfigError(("size",), "must be at least 1", value=size)
    if len(split) == 0:
        raise InputError("calibrate: the source holds no samples", hint="point at a source with data in it")
    keep = first_occurrences(content_hashes(split.x)) if dedupe else np.arange(len(split))
    duplicates = len(split) - len(keep)
    x = split.x[torch.as_tensor(keep)]
    y = split.y[torch.as_tensor(keep)]
    if len(x) < size:
        warn(f"calibrate: the source has only {len(x)} unique samples, fewer than size {size}; using all of them")
    if strategy == "random" or len(x) <= size:
        chosen = select_random(len(x), size, seed)
    elif strategy == "stratified":
        values = (y.numpy() if groups is None else np.asarray(groups)[keep])
        if groups is None and (values < 0).all():
            raise ConfigError(("by",), "the source has no labels to stratify by",
                              hint="name a column with `by`, or use strategy: random or diverse")
        chosen = select_stratified(values, size, seed)
    else:
        feats = features(x) if features else x.float().flatten(1).numpy()
        chosen = select_diverse(feats, size, seed)
    idx = torch.as_tensor(chosen)
    labels = y[idx] if (y >= 0).any() else None
    info = dict(meta or {})
    info.update(strategy=strategy, seed=seed, size=size, duplicates_removed=int(duplicates),
                indices=[int(i) for i in keep[chosen]])
    return CalibrationSet(x[idx].contiguous(), labels, info)
