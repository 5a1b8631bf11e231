"""Build a calibration set from a split: de-duplicate, choose, describe."""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn

from pruneflow.data import Split
from pruneflow.errors import ConfigError, InputError
from pruneflow.inputs import Inputs, as_mapping, call, size, take, to, trim

from .calibset import CalibrationSet
from .sampling import content_hashes, first_occurrences, select_diverse, select_random, select_stratified

STRATEGIES = ("random", "stratified", "diverse")


def feature_layer(model: nn.Module) -> tuple[nn.Module, str] | None:
    """The layer whose input is the model's features, and how to say so: the last Linear (a classifier's or a
    ranker's features, a sequence model's last state), else the last convolution (a mask model's decoder features,
    averaged over space); None for a model with neither."""
    names = {m: n for n, m in model.named_modules()}
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if linears:
        return linears[-1], f"model: the input of {names[linears[-1]]!r}, its last Linear"
    convs = [m for m in model.modules() if isinstance(m, nn.modules.conv._ConvNd)]
    if convs:
        return convs[-1], f"model: the input of {names[convs[-1]]!r}, its last convolution, averaged over space"
    return None


def penultimate_features(model: nn.Module, x: Inputs, batch_size: int = 256) -> np.ndarray:
    """The model's features (``feature_layer``'s input) for every sample: flattened for a Linear, one value a channel for
    a convolution."""
    found = feature_layer(model)
    if found is None:
        raise ConfigError(("features",), "model features need a model with a Linear or convolution layer", value="model",
                          hint="use features: inputs (or auto, which does so for such a model)")
    layer = found[0]
    conv = isinstance(layer, nn.modules.conv._ConvNd)

    def keep(m, inp, out) -> None:
        t = inp[0].detach()
        captured.append((t.float().mean(dim=tuple(range(2, t.dim()))) if conv and t.dim() > 2 else t.flatten(1)).cpu())

    captured: list[torch.Tensor] = []
    handle = layer.register_forward_hook(keep)
    was = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for start in range(0, size(x), batch_size):
                call(model, to(trim(take(x, slice(start, start + batch_size))), device))
    finally:
        handle.remove()
        model.train(was)
    return torch.cat(captured).numpy()


#: ``diverse`` picks its samples from at most this many (a seeded random pool of a larger source).
DIVERSE_POOL = 50_000


def build_calibration_set(split: Split, *, size: int, strategy: str, seed: int, groups: np.ndarray | None = None,
                          features: Callable[[Inputs], np.ndarray] | None = None, dedupe: bool = True,
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
        raise ConfigError(("size",), "must be at least 1", value=size, hint="e.g. size: 512, the samples to keep")
    if len(split) == 0:
        raise InputError("calibrate: the source holds no samples", hint="point at a source with data in it")
    keep = first_occurrences(content_hashes(split.x)) if dedupe else np.arange(len(split))
    duplicates = len(split) - len(keep)
    x = take(split.x, torch.as_tensor(keep))
    y = split.y[torch.as_tensor(keep)]
    n = len(y)
    if n < size:
        warn(f"calibrate: the source has only {n} unique samples, fewer than size {size}; using all of them")
    if strategy == "random" or n <= size:
        chosen = select_random(n, size, seed)
    elif strategy == "stratified":
        values = (y.numpy() if groups is None else np.asarray(groups)[keep])
        if groups is None and (values < 0).all():
            raise ConfigError(("by",), "the source has no labels to stratify by",
                              hint="name a column with `by`, or use strategy: random or diverse")
        chosen = select_stratified(values, size, seed)
    else:
        # k-center over at most DIVERSE_POOL samples (a seeded random pool): its cost is samples x size, and on a
        # 300,000-row click log with size 2048 it took 104 s of a 2-minute run (15.7 s over 50,000)
        pool = select_random(n, DIVERSE_POOL, seed) if n > DIVERSE_POOL else np.arange(n)
        px = take(x, torch.as_tensor(pool)) if len(pool) < n else x
        feats = features(px) if features else torch.cat([t.float().flatten(1) for t in as_mapping(px).values()], 1).numpy()
        chosen = pool[select_diverse(feats, size, seed)]
    idx = torch.as_tensor(chosen)
    # One label a sample is kept (its histogram, the set's `label` column); targets of another shape (an embedding
    # task's reference vectors, masks) are not: the set's consumers feed inputs alone.
    labels = y[idx] if y.dim() == 1 and (y >= 0).any() else None
    info = dict(meta or {})
    info.update(strategy=strategy, seed=seed, size=size, duplicates_removed=int(duplicates),
                indices=[int(i) for i in keep[chosen]])
    chosen_x = take(x, idx)
    chosen_x = chosen_x.contiguous() if isinstance(chosen_x, torch.Tensor) else {k: v.contiguous() for k, v in chosen_x.items()}
    return CalibrationSet(chosen_x, labels, info)
