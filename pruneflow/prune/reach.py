"""What channel pruning can reach on a model, known before any round: the MACs (or parameters) floor, and the
fixes a refusal suggests.

Channel pruning keeps modules whole (attention, embedding tables, a weight tied between an item table and the
output projection, the classifier, groups ``tp_adapter.whole_groups`` finds) and every pruned layer keeps
``1 - max_layer_ratio`` of its channels. When what stays is more than the target allows, the search of round k
found out only after k-1 rounds of pruning and fine-tuning (issue 37: a SASRec asked for ``macs: 0.5`` was
refused in round 2 of 3). One pruned copy at the top ratio, scored by magnitude (it prunes every group to its
floor, whatever the scores), tells it up front, with a target the next run accepts.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from ..errors import ConfigError
from ..evaluate import macs_by_module
from ..inputs import Inputs
from .engine import Metric, PruneOptions, measure, prune_step
from .importance import magnitude_saliency
from .mha import HeadAttention, convert_mha
from .transformer import UnitEvidence, attention_sites, ffn_sites, prune_heads, prune_neurons, select_lowest

#: The margin a suggested target keeps above the floor a magnitude-scored trial reached (rounding of the real
#: scores' selection can land a little higher).
MARGIN = 0.01


def tied_names(model: nn.Module) -> list[str]:
    """Modules that share a parameter with another module (``output.weight is items.weight``)."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    return list(dict.fromkeys(n for names in owners.values() if len(names) > 1 for n in names))


def lowest_reachable(model: nn.Module, example: Inputs, opts: PruneOptions) -> nn.Module:
    """A copy of ``model`` with every prunable group at its floor (``model`` is untouched)."""
    trial = copy.deepcopy(model)
    prune_step(trial, example, magnitude_saliency(trial), min(opts.max_layer_ratio, 0.99), opts)
    return trial


def check_floor(model: nn.Module, example: Inputs, opts: PruneOptions, metric: Metric, keep: float,
                before: dict[str, int], loc: tuple) -> None:
    """Raise a ConfigError at ``loc`` (the target) when keeping ``keep`` of ``before[metric]`` (macs, params) is below
    what channel pruning can reach. A `ratio` target is checked against max_layer_ratio when the recipe loads."""
    if metric == "channels":
        return
    trial = lowest_reachable(model, example, opts)
    lowest = measure(trial, example, opts.ignored)
    goal = before[metric] * keep
    if lowest[metric] <= goal:
        return
    floor = lowest[metric] / before[metric]
    suggested = math.ceil((floor + MARGIN) * 100) / 100
    kept = _unshrunk(model, trial, example, opts.ignored, tied_names(model)) if metric == "macs" else []
    whole = sum(s for _, s in kept)
    where = (f": {whole:.1%} of its MACs are in modules it cannot shrink ("
             + ", ".join(f"{n} {s:.1%}" for n, s in kept[:4]) + (", ..." if len(kept) > 4 else "")
             + f"), the other {1 - whole:.1%} in layers it prunes") if kept else ""
    message = (f"{metric} cannot go below {lowest[metric]:,} ({floor:.1%} of the model entering the stage) by channel "
               f"pruning{where}, and max_layer_ratio {opts.max_layer_ratio:g} keeps {1 - opts.max_layer_ratio:.0%} of "
               f"every pruned layer; the target ({metric}: {keep:g}) needs {goal:,.0f}")
    if suggested >= 1:
        hint = "channel pruning cannot shrink this model by much: drop this stage or ignore fewer layers"
    else:
        hint = f"ask for at least the floor: target: {{{metric}: {suggested:g}}}"
    units = _unit_suggestion(model, example, keep) if metric == "macs" else None
    if units:
        hint += f"; or {units}"
    raise ConfigError(loc, message, hint=hint)


def _unshrunk(model: nn.Module, trial: nn.Module, example: Inputs, ignored: tuple[str, ...],
              tied: list[str]) -> list[tuple[str, float]]:
    """The shares of the MACs of the kept-whole modules whose MACs the floor ``trial`` did not lower (a kept layer
    whose inputs were pruned does shrink), largest first; one name per module: an attention module rather than its
    projections, and a tied module says so."""
    per, after = macs_by_module(model, example), macs_by_module(trial, example)
    owners = []
    for name in ignored:
        parent = name.rpartition(".")[0]
        owner = parent if parent and isinstance(model.get_submodule(parent), HeadAttention) else name
        if owner not in owners:
            owners.append(owner)
    outermost = [n for n in owners if not any(n.startswith(o + ".") for o in owners if o != n)]
    total = max(per.get("", 0), 1)
    shares = [(f"{n} (tied)" if n in tied else n, per.get(n, 0) / total) for n in outermost if after.get(n) == per.get(n)]
    return sorted([s for s in shares if s[1] > 0], key=lambda s: -s[1])


def _unit_suggestion(model: nn.Module, example: Inputs, keep: float) -> str | None:
    """A `granularity: heads` stage that removes attention heads and FFN neurons, with the share of MACs a trial of
    it leaves: the one that reaches ``keep`` if any (None: the model has no attention heads to remove)."""
    trial = copy.deepcopy(model)
    convert_mha(trial)
    sites = attention_sites(trial)
    if not sites:
        return None
    heads = sum(s.heads for s in sites)
    head_share = math.floor((heads - len(sites)) / heads * 100) / 100  # every layer keeps one head
    has_ffn = bool(ffn_sites(trial))
    before = macs_by_module(trial, example)[""]
    tried: tuple[dict[str, float], float] | None = None
    for ffn in (0.5, 0.75, 0.9) if has_ffn else (None,):
        target = {k: v for k, v in (("heads", head_share), ("ffn", ffn)) if v}
        if not target:
            return None
        tried = (target, _units_trial(trial, example, target) / before)
        if tried[1] <= keep:
            break
    assert tried is not None
    target, share = tried
    spelled = ", ".join(f"{k}: {v:g}" for k, v in target.items())
    budget = _budget_trial(trial, example, keep) if share > keep else None
    if budget is not None and budget < share:  # heads and FFN shares fall short: a budget that takes the width too
        return (f"`granularity: channels` keeps attention whole, so prune its heads, FFN neurons and width instead, with "
                f"a MACs budget: {{type: prune, granularity: heads, target: {{macs: {keep:g}}}}} (a trial of it leaves "
                f"{budget:.1%} of the MACs; heads and FFN alone, {{{spelled}}}, leave {share:.1%})")
    return (f"`granularity: channels` keeps attention whole, so prune its heads{' and FFN neurons' if has_ffn else ''} "
            f"instead, with a `granularity: heads` stage: {{type: prune, target: {{{spelled}}}}} (a trial of it leaves "
            f"{share:.1%} of the MACs)")


def _budget_trial(model: nn.Module, example: Inputs, keep: float) -> float:
    """The share of MACs a `{macs: keep}` budget leaves on a copy of ``model`` (attention converted), units ranked by
    their weight norms per MAC (``budget.py``; the stage ranks them by its criterion)."""
    from .budget import budget_plan, ranked_units, remove_units, unit_costs, unit_counts
    from .width import width_sites

    trial = copy.deepcopy(model)
    widths = width_sites(trial, example)
    scores = UnitEvidence(trial, lambda: [], lambda out, y: y, widths).magnitude()
    before = macs_by_module(trial, example)[""]
    order = ranked_units(scores, unit_costs(trial, example, widths))
    remove_units(trial, example, budget_plan(trial, example, order, unit_counts(trial, widths), keep * before))
    return macs_by_module(trial, example)[""] / before


@torch.no_grad()
def _units_trial(model: nn.Module, example: Inputs, target: dict[str, float]) -> int:
    """MACs of a copy of ``model`` (its attention already converted) with ``target``'s shares of heads and FFN
    neurons removed, the lowest magnitudes first (as ``HeadStrategy`` removes them)."""
    trial = copy.deepcopy(model)
    scores = UnitEvidence(trial, lambda: [], lambda out, y: y).magnitude()  # weight norms: no batch, no loss
    sites, ffns = {s.name: s for s in attention_sites(trial)}, {s.name: s for s in ffn_sites(trial)}
    if target.get("heads"):
        for name, remove in select_lowest({n: scores[n] for n in sites}, target["heads"]).items():
            if remove:
                prune_heads(sites[name], remove)
    if target.get("ffn"):
        for name, remove in select_lowest({n: scores[n] for n in ffns}, target["ffn"]).items():
            if remove:
                prune_neurons(ffns[name], remove)
    return macs_by_module(trial, example)[""]
