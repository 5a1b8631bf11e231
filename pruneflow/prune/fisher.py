"""Gradients for importance: the mean gradient (Taylor) and per-sample squared gradients (Fisher).

Per-sample gradients are computed with ``torch.func.vmap(torch.func.grad(...))`` over chunks of
samples: one vectorised pass instead of one backward per sample.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from ..inputs import Inputs, bind, call, take


def mean_gradients(model: nn.Module, batches: "Iterable[tuple[Inputs, torch.Tensor]]",
                   loss_fn: Callable) -> dict[str, torch.Tensor]:
    """Mean gradient of the loss over the batches (model in eval mode: BatchNorm uses running stats)."""
    was = model.training
    model.eval()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    count = 0
    for x, y in batches:
        model.zero_grad(set_to_none=True)
        loss = loss_fn(call(model, x), y)
        loss.backward()
        for n, p in params.items():
            if p.grad is not None:
                total[n] += p.grad.detach() * len(y)
        count += len(y)
    model.zero_grad(set_to_none=True)
    model.train(was)
    return {n: t / max(count, 1) for n, t in total.items()}


def fisher_diagonal(model: nn.Module, batches: "Iterable[tuple[Inputs, torch.Tensor]]", loss_fn: Callable,
                    chunk: int = 32) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Mean per-sample squared gradient (diagonal empirical Fisher) and mean gradient, per parameter.

    Runs the model in eval mode so a sample's loss does not depend on the others in its batch.
    """
    was = model.training
    model.eval()
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def sample_loss(p, x, y):
        one = bind(model, {k: v.unsqueeze(0) for k, v in x.items()} if isinstance(x, dict) else x.unsqueeze(0))
        out = functional_call(model, (p, buffers), (one,)) if isinstance(one, torch.Tensor) else functional_call(model, (p, buffers), (), one)
        return loss_fn(out, y.unsqueeze(0))

    vectorised = vmap(grad(sample_loss), in_dims=(None, 0, 0))
    one_by_one = _looped(grad(sample_loss))
    per_sample_grad = vectorised
    fisher = {n: torch.zeros_like(p) for n, p in params.items()}
    mean = {n: torch.zeros_like(p) for n, p in params.items()}
    count = 0
    with torch.no_grad():
        for x, y in batches:
            for start in range(0, len(y), chunk):
                xs, ys = take(x, slice(start, start + chunk)), y[start : start + chunk]
                with torch.enable_grad():
                    try:
                        g = per_sample_grad(params, xs, ys)
                    except RuntimeError:
                        if per_sample_grad is one_by_one:
                            raise
                        # vmap has no batching rule for some ops: an nn.GRU's CPU kernel writes its
                        # state in place ("output with shape [1, 64] doesn't match the broadcast shape
                        # [32, 1, 64]", issue 37). The same gradients, one sample at a time.
                        per_sample_grad = one_by_one
                        g = per_sample_grad(params, xs, ys)
                for n in params:
                    fisher[n] += g[n].pow(2).sum(0)
                    mean[n] += g[n].sum(0)
                count += len(ys)
    model.train(was)
    samples = max(count, 1)
    return {k: v / samples for k, v in fisher.items()}, {k: v / samples for k, v in mean.items()}


def _looped(per_sample: Callable) -> Callable:
    """``vmap(per_sample, in_dims=(None, 0, 0))`` as a loop over the samples (for models vmap cannot batch)."""

    def run(params: dict[str, torch.Tensor], xs: Inputs, ys: torch.Tensor) -> dict[str, torch.Tensor]:
        grads = [per_sample(params, take(xs, i), ys[i]) for i in range(len(ys))]
        return {n: torch.stack([g[n] for g in grads]) for n in params}

    return run
