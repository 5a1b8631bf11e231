"""Channel importance from per-parameter saliency tensors.

torch-pruning scores a *group* of coupled channels (its DependencyGraph finds them); we keep its
group reduction and normalisation, but read a saliency tensor per parameter instead of weights and
``.grad`` directly:

- ``magnitude``: |w|^p
- ``taylor``:    |w · g|, g the mean gradient over the importance batches (Molchanov et al. 2019)
- ``hessian``:   w² · F, F the diagonal empirical Fisher, i.e. the mean of per-sample squared
                 gradients, as Optimal Brain Damage's Hessian estimate (LeCun et al. 1989)
- ``hessian+taylor``: both, each normalised, mixed by ``hessian_weight``

Why not tp.importance.GroupHessianImportance: in torch-pruning 1.6.1 its ``accumulate_grad``
tests membership by parameter name but stores by parameter object, so only the last sample counts,
and its per-sample backward loop is slow. We compute per-sample gradients with ``torch.func``
(vmap over grad, see ``fisher.py``). Saliency keyed by parameter *name* also survives
``copy.deepcopy``, which the target search needs.
"""

from __future__ import annotations

import torch
import torch_pruning as tp
from torch import nn
from torch_pruning.pruner import function

OUT_FNS = (function.prune_conv_out_channels, function.prune_linear_out_channels)
IN_FNS = (function.prune_conv_in_channels, function.prune_linear_in_channels)
NORM_FNS = (function.prune_batchnorm_out_channels, function.prune_layernorm_out_channels, function.prune_groupnorm_out_channels)


class SaliencyImportance(tp.importance.GroupMagnitudeImportance):
    """Group importance = reduce(per-channel sums of a saliency tensor over every coupled layer).

    ``saliency`` maps parameter names (``model.named_parameters()``) to tensors shaped like the
    parameters. Modules with ``_pruneflow_skip_importance = True`` (the frozen channel-embedding
    convolutions that replace option-A shortcuts) are coupled but not scored.
    """

    def __init__(self, model: nn.Module, saliency: dict[str, torch.Tensor], group_reduction: str = "mean",
                 normalizer: str | None = "mean"):
        super().__init__(p=1, group_reduction=group_reduction, normalizer=normalizer)
        self.saliency = saliency
        self.names = {id(p): n for n, p in model.named_parameters()}

    def _sal(self, param: torch.Tensor | None) -> torch.Tensor | None:
        if param is None:
            return None
        return self.saliency.get(self.names.get(id(param), ""))

    @torch.no_grad()
    def __call__(self, group):
        group_imp, group_idxs = [], []
        for i, (dep, idxs) in enumerate(group):
            layer, fn = dep.target.module, dep.handler
            root_idxs = group[i].root_idxs
            if getattr(layer, "_pruneflow_skip_importance", False):
                continue
            s = self._sal(getattr(layer, "weight", None))
            if s is None:
                continue
            idxs = sorted(idxs)
            transposed = getattr(layer, "transposed", False)
            if fn in OUT_FNS:
                w = s.transpose(0, 1) if transposed else s
                local = w[idxs].flatten(1).sum(1)
            elif fn in IN_FNS:
                w = s if transposed else s.transpose(0, 1)
                local = w.flatten(1).sum(1)
                if fn == function.prune_conv_in_channels and layer.groups not in (1, layer.in_channels):
                    local = local.repeat(layer.groups)
                local = local[idxs]
            elif fn in NORM_FNS:
                local = s[idxs]
            else:
                continue
            group_imp.append(local)
            group_idxs.append(root_idxs)
        if not group_imp:
            return None
        return self._normalize(self._reduce(group_imp, group_idxs), self.normalizer)


def magnitude_saliency(model: nn.Module, p: int = 2) -> dict[str, torch.Tensor]:
    return {n: w.detach().abs().pow(p) for n, w in model.named_parameters()}


def taylor_saliency(model: nn.Module, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    return {n: (params[n].detach() * g).abs() for n, g in grads.items() if n in params}


def hessian_saliency(model: nn.Module, fisher: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    params = dict(model.named_parameters())
    return {n: params[n].detach().pow(2) * f for n, f in fisher.items() if n in params}


def _normalised(sal: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # One scale for the whole model (mean saliency), so layers stay comparable within a criterion.
    total = sum(float(t.sum()) for t in sal.values())
    count = sum(t.numel() for t in sal.values())
    mean = total / max(count, 1) or 1.0
    return {n: t / mean for n, t in sal.items()}


def mixed_saliency(hessian: dict[str, torch.Tensor], taylor: dict[str, torch.Tensor], hessian_weight: float) -> dict[str, torch.Tensor]:
    h, t = _normalised(hessian), _normalised(taylor)
    return {n: hessian_weight * h[n] + (1 - hessian_weight) * t[n] for n in h if n in t}
