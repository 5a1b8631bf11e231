"""Structured pruning on torch-pruning's dependency graph, with targets found by search.

torch-pruning prunes a *channel ratio*; users ask for a MACs or parameter budget. ``search_ratio``
finds the ratio that meets a budget by bisection on throw-away copies (a copy, a dependency graph
and a MACs count take ~0.3 s for ResNet-56), with the same importance scores as the real step.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import nn

from ..errors import ConfigError, InputError
from ..evaluate import count_macs_params
from ..inputs import Inputs, bind, call, take
from . import rnn as rnn_units
from .importance import SaliencyImportance
from .keep import KeepRule
from .observe import observing
from .surgery import ChannelEmbedConv
from .tp_adapter import GroupPruner, Selection, prune, selection_members

Metric = Literal["channels", "macs", "params"]
#: What channel pruning removes output channels of: a recurrent layer's are its hidden units (``rnn.py``).
PrunableLayer = nn.Conv2d | nn.Conv1d | nn.Linear | nn.RNNBase


@dataclass
class PruneOptions:
    allocation: Literal["global", "uniform"] = "global"
    max_layer_ratio: float = 0.9
    round_to: int | None = None
    ignored: tuple[str, ...] = ()  # module names kept intact
    ranking: Literal["relative", "absolute", "per_mac"] = "relative"  # how groups compare (importance.py)
    # Layer widths (out, in) when the stage started: max_layer_ratio holds against these over all
    # rounds (a fresh pruner each round would otherwise measure it against the current widths).
    initial_widths: dict[str, tuple[int, int]] | None = None

    @property
    def rule(self) -> "KeepRule":
        return KeepRule(self.round_to, self.max_layer_ratio)


def layer_widths(model: nn.Module) -> dict[str, tuple[int, int]]:
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
            out[name] = (m.out_channels, m.in_channels)
        elif isinstance(m, nn.Linear):
            out[name] = (m.out_features, m.in_features)
        elif isinstance(m, nn.RNNBase):
            out[name] = (m.hidden_size, m.input_size)
    return out


def resolve_ignored(model: nn.Module, patterns: list[str] | None, loc: tuple = ()) -> tuple[str, ...]:
    """Module names matching ``patterns`` (names or regexes); default: the classifier (last Linear).

    ``loc`` is the recipe key of the patterns (``Stage.loc("ignore")``): a pattern matching no module is
    reported there.
    """
    names = [n for n, m in model.named_modules() if n]
    if patterns is None:
        linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
        return tuple(linears[-1:])
    out = []
    for pattern in patterns:
        hits = [n for n in names if n == pattern or re.fullmatch(pattern, n)]
        if not hits:
            raise ConfigError(
                loc, f"{pattern!r} matches no module of the model", value=pattern,
                hint="use names from `pruneflow inspect` (first column) or a regex such as 'layer3\\..*'",
            )
        out += hits
    return tuple(dict.fromkeys(out))


def prunable_layers(model: nn.Module, ignored: tuple[str, ...]) -> list[tuple[str, PrunableLayer]]:
    out: list[tuple[str, PrunableLayer]] = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Conv1d, nn.Linear, nn.RNNBase)) and not isinstance(m, ChannelEmbedConv):
            if not any(name == i or name.startswith(i + ".") for i in ignored):
                out.append((name, m))
    return out


def _width(m: PrunableLayer) -> int:
    if isinstance(m, nn.Linear):
        return m.out_features
    return m.hidden_size if isinstance(m, nn.RNNBase) else m.out_channels


def channel_count(model: nn.Module, ignored: tuple[str, ...]) -> int:
    return sum(_width(m) for _, m in prunable_layers(model, ignored))


def measure(model: nn.Module, example: "Inputs", ignored: tuple[str, ...]) -> dict[str, int]:
    macs, params = count_macs_params(model, example)
    return {"macs": macs, "params": params, "channels": channel_count(model, ignored)}


def _pruner(model: nn.Module, example: Inputs, saliency: dict, ratio: float, opts: PruneOptions) -> GroupPruner:
    modules = dict(model.named_modules())
    if not prunable_layers(model, opts.ignored):
        raise InputError("every prunable layer is ignored; nothing is left to prune",
                         hint="shorten `ignore` (the classifier is ignored by default)")
    spatial = output_positions(model, example) if opts.ranking == "per_mac" else None
    widths = opts.initial_widths or {}
    return GroupPruner(
        model, bind(model, example), SaliencyImportance(model, saliency, opts.ranking, spatial, _floors(model, opts)), opts.rule,
        ratio=ratio, global_pruning=opts.allocation == "global", ignored=[modules[n] for n in opts.ignored],
        initial_widths={modules[n]: w for n, w in widths.items() if n in modules},
    )


def _floors(model: nn.Module, opts: PruneOptions) -> dict[nn.Module, int]:
    widths = opts.initial_widths or layer_widths(model)
    rule = opts.rule
    return {module: rule.floor(widths[name][0]) for name, module in model.named_modules() if name in widths}


@torch.no_grad()
def output_positions(model: nn.Module, example: Inputs) -> dict[nn.Module, int]:
    """Output positions per sample (H*W for a conv, tokens for a Linear, time steps for a recurrent layer) of every
    conv, Linear and recurrent layer."""
    out: dict[nn.Module, int] = {}

    def hook(module, inputs, output):
        output = output[0] if isinstance(output, tuple) else output  # a recurrent layer's (outputs, state)
        if isinstance(output, nn.utils.rnn.PackedSequence):
            output = output.data
        channels = output.shape[1] if isinstance(module, nn.modules.conv._ConvNd) else output.shape[-1]
        out[module] = int(output[0].numel() // channels)

    kinds = (nn.modules.conv._ConvNd, nn.Linear, nn.RNNBase)
    with observing(model, [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, kinds)]):
        call(model, take(example, slice(0, 1)))
    return out


def prune_step(model: nn.Module, example: Inputs, saliency: dict, ratio: float, opts: PruneOptions) -> None:
    """Prune ``model`` in place by ``ratio`` of its current channels."""
    plan_step(model, example, saliency, ratio, opts).apply()


@dataclass
class PrunePlan:
    """The channels one step removes, chosen but not yet removed: ``fader`` can fade them out first.

    Each entry is a :class:`Selection`: a group's root layer, its torch-pruning handler and the root
    indices to remove. The coupled layers' indices are derived when the step is applied, one group
    after another, as torch-pruning does itself (a concatenation's offsets change as its inputs are pruned).
    """

    model: nn.Module
    graph: object = None  # torch-pruning's dependency graph (tp_adapter)
    roots: list[Selection] = field(default_factory=list)

    @property
    def channels(self) -> int:
        return sum(len(s.idxs) for s in self.roots)

    def apply(self) -> None:
        for selection in self.roots:
            prune(self.graph, selection)
        self.roots = []
        for m in self.model.modules():
            if isinstance(m, ChannelEmbedConv):
                # torch-pruning replaces pruned weights with new (trainable) Parameters: keep the selection frozen.
                m.weight.requires_grad_(False)

    def fader(self, share: float):
        """A step callback for ``fit``: scale every parameter slice the plan removes (conv/Linear weights
        and biases of the removed outputs, BatchNorm affine terms, the consumers' input weights) down
        linearly to exactly zero over the first ``share`` of the fine-tune's steps, and hold it there.
        The removal that follows then changes no output. torch-pruning's GrowingRegPruner grows an L2
        penalty on all channels by their norm; it has no fade of a chosen set, so this is written here."""
        slices = self._slices()

        def on_step_end(step: int, total: int) -> None:
            end = max(1, round(share * total))
            before, now = max(0.0, 1 - (step - 1) / end), max(0.0, 1 - step / end)
            factor = now / before if before > 0 else 0.0
            with torch.no_grad():
                for param, dim, idx in slices:
                    param.index_copy_(dim, idx, param.index_select(dim, idx) * factor)

        return on_step_end

    def _slices(self) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        out = []
        for selection in self.roots:
            for member in selection_members(self.graph, selection):
                layer = member.module
                idx = torch.tensor(member.idxs, dtype=torch.long)
                params: list[tuple[torch.Tensor | None, int]] = []
                if isinstance(layer, nn.modules.batchnorm._BatchNorm) and layer.affine:
                    params = [(layer.weight, 0), (layer.bias, 0)]
                elif isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)):  # frozen selections too
                    if member.out_channels:
                        params = [(layer.weight, 0), (layer.bias, 0)]
                    elif isinstance(layer, nn.Linear) or layer.groups == 1:
                        params = [(layer.weight, 1)]
                elif isinstance(layer, nn.RNNBase):  # every gate's rows of the units and their columns (rnn.py)
                    found = (rnn_units.unit_slices if member.out_channels else rnn_units.input_slices)(layer, member.idxs)
                    out += [(getattr(layer, name).data, dim, i) for name, dim, i in found]
                    continue
                # Other layers (grouped convs' inputs, norms without affine terms) keep their values: the
                # faded producers already silence those channels.
                out += [(p.data, dim, idx.to(p.device)) for p, dim in params if p is not None]
        return out


def plan_step(model: nn.Module, example: Inputs, saliency: dict, ratio: float, opts: PruneOptions) -> PrunePlan:
    """The channels pruning ``model`` by ``ratio`` of its current channels would remove (nothing changes yet)."""
    if ratio <= 0:
        return PrunePlan(model)
    was = model.training
    model.eval()
    pruner = _pruner(model, example, saliency, ratio, opts)
    names = {m: n for n, m in model.named_modules()}
    widths = opts.initial_widths or layer_widths(model)  # the floors hold against these (as in _floors)
    plan = PrunePlan(model, pruner.graph)
    for selection in pruner.selections():
        idxs = _capped(selection, pruner, names, opts.rule, widths)
        if idxs:
            plan.roots.append(selection._replace(idxs=idxs))
    model.train(was)
    return plan


def _capped(selection: Selection, pruner: GroupPruner, names: dict, rule: KeepRule,
            widths: dict[str, tuple[int, int]]) -> list[int]:
    """The group's channels to prune, trimmed so its layer keeps (1 - max_layer_ratio) of its initial width.

    torch-pruning only skips a layer that is already below that floor; one global step can still
    take it far below. We keep the most important channels of the group (and round_to multiples).
    """
    idxs, module = selection.idxs, selection.module
    if names.get(module) not in widths or not pruner.prunes_out_channels(selection):
        return idxs
    current = pruner.out_channels(module)
    allowed = rule.capped(current, len(idxs), widths[names[module]][0])
    if allowed >= len(idxs):
        return idxs
    if allowed <= 0:
        return []
    scores = pruner.scores(selection)
    if scores is None:
        return sorted(idxs)[:allowed]
    return sorted(sorted(idxs, key=lambda i: float(scores[i]))[:allowed])


def search_ratio(model: nn.Module, example: Inputs, saliency: dict, opts: PruneOptions, metric: Metric,
                 goal: float, grid: int = 18, iterations: int = 8, loc: tuple = ()) -> tuple[float, dict[str, int]]:
    """Smallest ratio whose pruned copy has ``metric`` <= ``goal``. Raises ConfigError at ``loc`` (the recipe's
    ``target``) when unreachable.

    The result need not be monotone in the ratio: ``round_to`` rounds each layer's count to a multiple,
    and once the global threshold reaches the protected floor channels (+inf) every group is selected
    whole and skipped, so a higher ratio can prune less. A coarse grid finds the first feasible ratio;
    bisection then refines between it and the grid point before.
    """

    def trial(ratio: float) -> dict[str, int]:
        trial_model = copy.deepcopy(model)
        prune_step(trial_model, example, saliency, ratio, opts)
        return measure(trial_model, example, opts.ignored)

    current = measure(model, example, opts.ignored)
    if current[metric] <= goal:
        return 0.0, current
    top = min(opts.max_layer_ratio, 0.99)
    ratios = [top * (i + 1) / grid for i in range(grid)]
    lo, found, lowest = 0.0, None, current
    for ratio in ratios:
        result = trial(ratio)
        if result[metric] < lowest[metric]:
            lowest = result
        if result[metric] <= goal:
            found = (ratio, result)
            break
        lo = ratio
    if found is None:
        raise ConfigError(
            loc, f"{metric} cannot go below {lowest[metric]:,} ({lowest[metric] / current[metric]:.1%} of the "
            f"current model) with max_layer_ratio {opts.max_layer_ratio}, round_to {opts.round_to} and the ignored layers; "
            f"the target needs {goal:,.0f}",
            hint="raise max_layer_ratio, lower round_to, ignore fewer layers, or ask for less",
        )
    hi, best = found
    for _ in range(iterations):
        mid = (lo + hi) / 2
        result = trial(mid)
        if result[metric] <= goal:
            hi, best = mid, result
        else:
            lo = mid
    return hi, best


def auto_rounds(metric: Metric, keep: float, per_round: float = 0.1) -> int:
    """About ``per_round`` of the channels per round: MACs and params scale ~ with channels squared."""
    removed = 1 - keep if metric == "channels" else 1 - math.sqrt(keep)
    return max(1, math.ceil(removed / per_round - 1e-9))


def channel_table(model: nn.Module, before: dict[str, int]) -> list[dict]:
    """Per layer counted in ``before`` (``layer_channels`` of the entering model): its channels before and now."""
    now = layer_channels(model)
    return [{"layer": n, "before": c, "after": now.get(n, 0)} for n, c in before.items()]


def layer_channels(model: nn.Module) -> dict[str, int]:
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, (nn.Conv2d, nn.Conv1d)) and not isinstance(m, ChannelEmbedConv):
            out[name] = m.out_channels
        elif isinstance(m, (nn.Linear, nn.RNNBase)):
            out[name] = _width(m)
    return out
