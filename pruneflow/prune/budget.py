"""A MACs budget for `granularity: heads` (``target: {macs: 0.5}``): attention heads, FFN neurons and channels of the
model width, ranked together by importance per MAC, the cheapest loss per MAC saved going first.

A transformer's MACs sit in three kinds of unit whose removal costs the model differently: a SASRec over 20,000
items keeps 38 % of its MACs in the output projection tied to its item table, which only the width shrinks, 39 % in
its FFNs and 23 % in attention. Shares per kind (``{heads: 0.5, ffn: 0.5, width: 0.3}``) leave the split to the
recipe; a budget lets the scores decide it. Every unit is scored through a mask of ones on its output
(``transformer.py``: a head's, a neuron's, a width channel's at every norm of the stream), so under ``hessian`` a
unit's score is the Fisher of its mask, Optimal Brain Damage's estimate of the loss increase when the unit goes,
the same quantity for the three kinds. Divided by the MACs the unit costs (:func:`unit_costs`, per sample: its
rows and columns in every projection, times the positions each runs over; a width channel's column of the tied
output projection counts once per catalogue item), the units are removed lowest first, as channel pruning's
``ranking: per_mac`` does for channels.

Measured on the zoo's SASRec after `{heads: 0.5, ffn: 0.5}` (3,000 held-out rows, no fine-tuning, taken to 55 % of
the MACs): per MAC across kinds HR@10 0.2843 (it chose 144 FFN neurons and 3 width channels), FFN neurons alone
0.2777, width alone 0.2803, from 0.2980.

How many units go is found by bisection on pruned copies, measured by the MACs counter (``evaluate.py``), so the
round lands on its goal although removing a width channel also shrinks the heads and neurons that read it.
"""

from __future__ import annotations

import copy
from typing import Sequence

import torch
from torch import nn

from ..evaluate import count_macs_params
from ..inputs import Inputs
from .engine import output_positions
from . import rnn as rnn_units
from .transformer import AttentionSite, attention_sites, ffn_sites, prune_heads, prune_neurons
from .width import WidthSite, prune_width

#: A unit: its site's name and its index there (heads, FFN neurons, width channels, as the model numbers them now).
Unit = tuple[str, int]


def unit_costs(model: nn.Module, example: Inputs, widths: Sequence[WidthSite]) -> dict[str, torch.Tensor]:
    """MACs a sample that each unit costs, keyed like the scores (site name): a head's q/k/v rows, its out_proj
    columns, its scores and context; an FFN neuron's row and column; a width channel's column or row in every
    Linear (or recurrent layer) that reads or writes it."""
    positions = output_positions(model, example)
    out: dict[str, torch.Tensor] = {}
    for site in attention_sites(model):
        out[site.name] = torch.full((site.heads,), float(_head_cost(site, positions)))
    for ffn in ffn_sites(model):
        out[ffn.name] = torch.full((ffn.neurons,), float((ffn.up.in_features + ffn.down.out_features) * positions.get(ffn.up, 1)))
    for width in widths:
        out[width.name] = torch.full((width.width,), float(_channel_cost(width, positions)))
    return out


def _head_cost(site: AttentionSite, positions: dict[nn.Module, int]) -> int:
    queries, keys = positions.get(site.query, 1), positions.get(site.key, 1)
    size = site.head_size
    projections = (site.query.in_features * queries + (site.key.in_features + site.value.in_features) * keys) * size
    return projections + site.out.out_features * queries * size + 2 * queries * keys * size


def _channel_cost(site: WidthSite, positions: dict[nn.Module, int]) -> int:
    cost, seen = 0, set()
    for member in site.members:
        module = member.module
        if module in seen:
            continue
        seen.add(module)
        if isinstance(module, nn.Linear) and member.role in ("in", "out"):
            other = module.out_features if member.role == "in" else module.in_features
            cost += other * positions.get(module, 1)
        elif isinstance(module, nn.RNNBase) and member.role == "in":
            cost += int(rnn_units.unit_cost(module, "in", positions.get(module, 1)))
    return cost


def ranked_units(scores: dict[str, torch.Tensor], costs: dict[str, torch.Tensor]) -> list[Unit]:
    """Every unit, the lowest score per MAC first (ties: the site and index order)."""
    flat = [(float(scores[name][i]) / max(float(costs[name][i]), 1.0), name, i)
            for name in scores if name in costs for i in range(len(scores[name]))]
    return [(name, i) for _, name, i in sorted(flat)]


def removable(order: list[Unit], counts: dict[str, int], take: int, keep_min: int = 1) -> dict[str, list[int]]:
    """The first ``take`` units of ``order`` that leave every site ``keep_min`` units, per site."""
    left = dict(counts)
    chosen: dict[str, list[int]] = {name: [] for name in counts}
    for name, index in order:
        if take <= 0:
            break
        if left.get(name, 0) > keep_min:
            chosen[name].append(index)
            left[name] -= 1
            take -= 1
    return chosen


def remove_units(model: nn.Module, example: Inputs, chosen: dict[str, list[int]]) -> None:
    """Remove the chosen heads, FFN neurons and width channels (numbered as the model numbers them now)."""
    heads = {s.name: s for s in attention_sites(model)}
    ffns = {s.name: s for s in ffn_sites(model)}
    widths = []
    for name, idxs in chosen.items():
        if not idxs:
            continue
        if name in heads:
            prune_heads(heads[name], idxs)
        elif name in ffns:
            prune_neurons(ffns[name], idxs)
        else:
            widths.append(name)
    for name in widths:  # last: traced again on the model the removals above left
        prune_width(model, example, name, chosen[name])


def budget_plan(model: nn.Module, example: Inputs, order: list[Unit], counts: dict[str, int], goal: float) -> dict[str, list[int]]:
    """The fewest units of ``order`` whose removal brings ``model``'s MACs to ``goal`` or below (bisection on copies;
    all that may go when even that is not enough)."""
    def macs(take: int) -> int:
        trial = copy.deepcopy(model)
        remove_units(trial, example, removable(order, counts, take))
        return count_macs_params(trial, example)[0]

    lo, hi = 0, sum(max(0, c - 1) for c in counts.values())
    if count_macs_params(model, example)[0] <= goal:
        return {}
    if macs(hi) > goal:
        return removable(order, counts, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if macs(mid) <= goal:
            hi = mid
        else:
            lo = mid
    return removable(order, counts, hi)


def unit_counts(model: nn.Module, widths: Sequence[WidthSite]) -> dict[str, int]:
    """Units per site now: heads, FFN neurons, width channels."""
    return {**{s.name: s.heads for s in attention_sites(model)}, **{s.name: s.neurons for s in ffn_sites(model)},
            **{w.name: w.width for w in widths}}
