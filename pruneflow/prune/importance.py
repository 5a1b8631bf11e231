"""Channel importance from per-parameter saliency tensors.

The saliency comes from the stage's criterion (``criteria.py``, named by ``importance``), reading a
:class:`ChannelEvidence`. The built-in criteria:

- ``magnitude``: |w|^p
- ``taylor``:    |w · g|, g the mean gradient over the importance batches (Molchanov et al. 2019)
- ``hessian``:   w² · F, F the diagonal empirical Fisher, i.e. the mean of per-sample squared
                 gradients, as Optimal Brain Damage's Hessian estimate (LeCun et al. 1989)
- ``hessian+taylor``: both, each normalised, mixed by ``hessian_weight``

torch-pruning scores a *group* of coupled channels (its DependencyGraph finds them); we keep its
group reduction and normalisation, but read a saliency tensor per parameter instead of weights and
``.grad`` directly.

How groups compare in a global ranking (``ranking``):
- ``relative`` (torch-pruning's default): a group's summed scores are divided by their mean, so a
  channel competes against its own group's average and absolute scales do not cross layers;
- ``absolute``: the scores summed over every coupled layer, compared as they are. For ``hessian``
  that sum is OBD's estimate of the loss increase when the channel goes, which is comparable across
  layers;
- ``per_mac``: ``absolute`` divided by the multiply-accumulates the channel costs in every coupled
  layer, so the channels that give the most MACs for the least loss go first (ours: torch-pruning has
  no cost-aware importance).

Why not tp.importance.GroupHessianImportance: in torch-pruning 1.6.1 its ``accumulate_grad``
tests membership by parameter name but stores by parameter object, so only the last sample counts,
and its per-sample backward loop is slow. We compute per-sample gradients with ``torch.func``
(vmap over grad, see ``fisher.py``). Saliency keyed by parameter *name* also survives
``copy.deepcopy``, which the target search needs.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from . import rnn as rnn_units
from .criteria import Evidence, Scores
from .fisher import fisher_diagonal, mean_gradients
from .surgery import ChannelEmbedConv
from .tp_adapter import GroupImportance, Member


class SaliencyImportance(GroupImportance):
    """Group importance = reduce(per-channel sums of a saliency tensor over every coupled layer).

    ``saliency`` maps parameter names (``model.named_parameters()``) to tensors shaped like the
    parameters. The frozen channel-embedding convolutions that replace option-A shortcuts
    (:class:`ChannelEmbedConv`) are coupled but not scored: they are selections, not learned layers.
    """

    def __init__(self, model: nn.Module, saliency: dict[str, torch.Tensor], ranking: str = "relative",
                 spatial: dict[nn.Module, int] | None = None, floors: dict[nn.Module, int] | None = None):
        super().__init__(relative=ranking == "relative")
        if ranking == "per_mac" and spatial is None:
            raise ValueError("ranking 'per_mac' needs the output positions of every layer (spatial)")
        self.ranking = ranking
        self.spatial = spatial or {}
        # Channels each layer keeps (max_layer_ratio, round_to). torch-pruning skips a group whose every
        # channel falls below the global threshold instead of pruning it to its floor, which makes the
        # result non-monotone in the ratio and, with `per_mac`, leaves the cheapest layers untouched.
        # The floor's best channels score +inf, so a group is pruned to its floor at most.
        self.floors = floors or {}
        self.saliency = saliency
        self.names = {id(p): n for n, p in model.named_parameters()}

    def _cost(self, layer: nn.Module, role: str) -> float:
        """MACs one channel costs in ``layer`` when the group prunes its ``role`` side (0 for normalisation layers)."""
        positions = self.spatial.get(layer, 1)
        if isinstance(layer, nn.Linear):
            return float(layer.in_features if role == "out" else layer.out_features) * positions
        if isinstance(layer, nn.modules.conv._ConvNd):
            k = float(torch.tensor(layer.kernel_size).prod())
            other = layer.in_channels // layer.groups if role == "out" else layer.out_channels // layer.groups
            return k * other * positions
        if isinstance(layer, nn.RNNBase):
            return rnn_units.unit_cost(layer, role, positions)
        return 0.0

    def _sal(self, param: torch.Tensor | None) -> torch.Tensor | None:
        if param is None:
            return None
        return self.saliency.get(self.names.get(id(param), ""))

    def _local(self, member: Member) -> torch.Tensor | None:
        """Per-channel saliency sums of one member, in its own channel numbering (None: not scored)."""
        layer = member.module
        if isinstance(layer, nn.RNNBase):  # a hidden unit: its rows in every gate and its columns (rnn.py)
            own = {n: sal for n, p in layer.named_parameters() if (sal := self._sal(p)) is not None}
            return rnn_units.unit_saliency(layer, own, member.role, member.idxs) if member.role in ("out", "in") else None
        s = None if isinstance(layer, ChannelEmbedConv) else self._sal(getattr(layer, "weight", None))
        if s is None:
            return None
        idxs = sorted(member.idxs)
        transposed = getattr(layer, "transposed", False)
        if member.role == "out":
            w = s.transpose(0, 1) if transposed else s
            return w[idxs].flatten(1).sum(1)
        if member.role == "in":
            w = s if transposed else s.transpose(0, 1)
            local = w.flatten(1).sum(1)
            if isinstance(layer, nn.modules.conv._ConvNd) and layer.groups not in (1, layer.in_channels):
                local = local.repeat(layer.groups)
            return local[idxs]
        if member.role == "norm":
            return s[idxs]
        return None

    def score(self, group: list[Member]) -> torch.Tensor | None:
        group_imp, group_idxs, group_cost = [], [], []
        for member in group:
            local = self._local(member)
            if local is None:
                continue
            group_imp.append(local)
            group_idxs.append(member.root_idxs)
            if self.ranking == "per_mac":
                group_cost.append(torch.full_like(local, self._cost(member.module, member.role)))
        if not group_imp:
            return None
        imp = self.normalize(self.reduce(group_imp, group_idxs))
        if self.ranking == "per_mac":
            # Costs of skipped (frozen embedding) layers are left out too: they are cheap 1x1 selections.
            imp = imp / self.reduce(group_cost, group_idxs).clamp_min(1.0)
        floor = max((self.floors.get(m.module, 0) for m in group if m.role == "out"), default=0)
        if floor > 0:
            imp = imp.clone()
            imp[imp.topk(min(floor, len(imp))).indices] = float("inf")
        return imp


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


class ChannelEvidence(Evidence):
    """What a criterion reads for channel pruning: per-parameter tensors keyed by parameter name.

    ``batches()`` samples the round's importance batches (once, when a term first needs them). The mean
    gradient comes from the Fisher's per-sample pass when that ran first (it computes both), else from one
    backward pass a batch."""

    def __init__(self, model: nn.Module, batches: Callable[[], list], loss: Callable, magnitude_p: int = 2):
        self.model, self._batches, self.loss, self.p = model, batches, loss, magnitude_p
        self._sample: list | None = None
        self._gradient: Scores | None = None
        self._fisher: Scores | None = None

    def _sampled(self) -> list:
        if self._sample is None:
            self._sample = self._batches()
        return self._sample

    def magnitude(self) -> Scores:
        return magnitude_saliency(self.model, self.p)

    def weights(self) -> Scores:
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def gradient(self) -> Scores:
        if self._gradient is None:
            self._gradient = mean_gradients(self.model, self._sampled(), self.loss)
        return self._gradient

    def fisher(self) -> Scores:
        if self._fisher is None:
            self._fisher, grads = fisher_diagonal(self.model, self._sampled(), self.loss)
            if self._gradient is None:
                self._gradient = grads
        return self._fisher

    def mixed(self, first: Scores, second: Scores, weight: float) -> Scores:
        a, b = _normalised(first), _normalised(second)
        return {n: weight * a[n] + (1 - weight) * b[n] for n in a if n in b}
