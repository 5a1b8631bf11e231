"""Model width: the channels an embedding table writes, removed with every layer that reads or writes them, and a
table tied to an output projection pruned on both sides at once.

In a transformer the residual stream has the width of its embedding tables: the item (or word) table and the
position table are added into it, every block's LayerNorms normalise it, the q/k/v projections and the FFN's first
Linear read it, the attention's output projection and the FFN's last Linear write back into it, and a final
LayerNorm feeds the output projection, which a sequential recommender or a language model *ties* to the input
table (``output.weight is items.weight``): in SASRec over 20,000 items that projection is 38 % of the MACs, and
heads and FFN neurons cannot shrink it. Removing channel ``c`` of the width removes column ``c`` of every table,
entry ``c`` of every LayerNorm, input column ``c`` of every reader, output row ``c`` of every writer, and column
``c`` of the tied output projection, which is the table's own column: the one parameter loses it once and stays
shared. This is the embedding-channel pruning of Minitron (Muralidharan et al. 2024, "Compact Language Models via
Pruning and Knowledge Distillation"), which prunes heads, MLP neurons and embedding channels and recovers with
distillation.

The group is torch-pruning's dependency graph from the table's columns (``tp_adapter.build_graph``): it follows
the channels through the adds, the norms and the reshapes. torch-pruning rebuilds every pruned weight as a new
Parameter, which would untie the pair (the table and the projection each pruned on their own copy), so the tie is
restored after the removal, after checking both sides hold the same values. A group the width cannot go through
is not a width site (:func:`width_sites` says why in ``skipped``): channels that meet a concatenation, a split or
a slice (a ranker's tables concatenated into its MLP input: tables keep their width there, the `tables`
granularity stores them narrower), a member whose channels run past its width, an ``nn.MultiheadAttention`` not
converted to :class:`~pruneflow.prune.mha.HeadAttention`, or a parameter tied to a module outside the group.

Removing a channel changes what the LayerNorms average over, so unlike a head or an FFN neuron no mask
reproduces it exactly; fine-tuning with distillation after each round recovers it (``rounds.py``). Importance
(``transformer.py``) multiplies the channel by one per-sample mask at the output of every norm of the group
(``masked``): in a pre-norm transformer every read of the stream goes through one (each block's, and the final
norm before the tied projection), so the mask's gradient sums the channel's every use. A width without norms
(an embedding read by a GRU) is masked where it is written: each table's lookup and each writer's output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..inputs import Inputs, bind
from .mha import HeadAttention
from .tp_adapter import Member, build_graph, members

#: torch-pruning's stand-ins for ops through which a width channel is not the same channel on both sides.
_REINDEXING_OPS = ("_ConcatOp", "_SplitOp", "_SliceOp", "_UnbindOp", "_ExpandOp")


@dataclass
class WidthSite:
    """One width: its ``name`` (the first table's), the ``tables`` that write it, ``members`` (every layer of the
    group, torch-pruning's records), the modules whose outputs an importance mask multiplies (``masked``: the
    norms, else the tables and writers) and the current ``width``."""

    name: str
    tables: list[str]
    members: list[Member]
    masked: list[nn.Module] = field(default_factory=list)
    width: int = 0

    @property
    def units(self) -> int:
        return self.width


def tied_groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Every parameter held by more than one module, as its (module, attribute) owners, first owner first."""
    owners: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((module, name))
    return [found for found in owners.values() if len(found) > 1]


def width_sites(model: nn.Module, example: Inputs, skipped: dict[str, str] | None = None) -> list[WidthSite]:
    """The widths of ``model`` that can be pruned: one site per group of embedding tables that write the same
    channels (an item and a position table added together are one). ``skipped`` (given) receives the tables whose
    width cannot go, with why."""
    tables = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Embedding) and m.embedding_dim > 1]
    if not tables:
        return []
    with torch.enable_grad():  # torch-pruning traces through autograd
        graph = build_graph(model, bind(model, example))
    names = {m: n for n, m in model.named_modules()}
    ties = tied_groups(model)
    sites: list[WidthSite] = []
    for name, table in tables:
        if any(name in s.tables for s in sites) or table not in graph.module2node:
            continue
        pruner = graph.get_pruner_of_module(table)
        group = members(graph.get_pruning_group(table, pruner.prune_out_channels, list(range(table.embedding_dim))), graph)
        why = _not_a_width(group, graph, names, ties)
        if why:
            if skipped is not None:
                skipped[name] = why
            continue
        norms = [m.module for m in group if m.module in names and m.role == "norm"]
        writers = norms or [m.module for m in group if m.module in names and (m.role == "out" or isinstance(m.module, nn.Embedding))]
        group_tables = [names[m.module] for m in group if isinstance(m.module, nn.Embedding)]
        sites.append(WidthSite(name, list(dict.fromkeys(group_tables)), group, list(dict.fromkeys(writers)), table.embedding_dim))
    return sites


def _not_a_width(group: list[Member], graph, names: dict[nn.Module, str], ties: list[list[tuple[nn.Module, str]]]) -> str | None:
    """Why ``group`` (from a table's columns) is not a width this module prunes (None: it is)."""
    inside = {m.module for m in group}
    for member in group:
        module = member.module
        kind = type(module).__name__
        if kind in _REINDEXING_OPS:
            return "its columns meet a concatenation, split or slice (they are not one channel on both sides)"
        if isinstance(module, nn.MultiheadAttention):
            return f"{names.get(module, kind)} is an nn.MultiheadAttention (converted to HeadAttention, it can lose width)"
        if isinstance(module, (nn.modules.conv._ConvNd, nn.EmbeddingBag)) or (isinstance(module, nn.RNNBase) and member.role != "in"):
            return f"{names.get(module, kind)} ({kind}) carries the channels on in a way width pruning does not follow"
        width = graph.get_out_channels(module) if member.out_channels else graph.get_in_channels(module)
        if module in names and width is not None and member.idxs and max(member.idxs) >= width:
            return f"{names[module]} ({kind}) is coupled with the columns through an op that reads another dimension"
    for owners in ties:
        held = [m in inside for m, _ in owners]
        if any(held) and not all(held):
            outside = next(names.get(m, type(m).__name__) for m, _ in owners if m not in inside)
            return f"it shares a weight with {outside}, outside the width (pruning one side would untie them)"
    return None


def prune_width(model: nn.Module, example: Inputs, site: str, remove: list[int]) -> int:
    """Remove channels ``remove`` (current numbering) of the width named ``site`` from every table and layer of its
    group, keep every tied parameter shared, and update the attention modules' widths; returns the width left."""
    found = {s.name: s for s in width_sites(model, example)}
    if site not in found:
        raise ValueError(f"{site!r} is not a width of this model (widths: {', '.join(found) or 'none'})")
    width = found[site].width
    remove = sorted(set(int(i) for i in remove))
    if not remove:
        return width
    if len(remove) >= width:
        raise ValueError(f"cannot remove all {width} channels of the width of {site!r}")
    ties = tied_groups(model)
    with torch.enable_grad():
        graph = build_graph(model, bind(model, example))
    table = model.get_submodule(site)
    with torch.no_grad():
        graph.get_pruning_group(table, graph.get_pruner_of_module(table).prune_out_channels, remove).prune()
    _retie(ties)
    for module in model.modules():
        if isinstance(module, HeadAttention):  # its q/k/v read the width, its out_proj writes it
            module.embed_dim, module.kdim, module.vdim = (module.q_proj.in_features, module.k_proj.in_features,
                                                          module.v_proj.in_features)
    return width - len(remove)


@torch.no_grad()
def _retie(ties: list[list[tuple[nn.Module, str]]]) -> None:
    """Make each tied group's owners hold one Parameter again: torch-pruning gave each its own pruned copy."""
    for owners in ties:
        (first, attr), *others = owners
        param = getattr(first, attr)
        for module, name in others:
            other = getattr(module, name)
            if other is param:
                continue
            if other.shape != param.shape or not torch.equal(other, param):
                raise RuntimeError(f"tied {name} of {type(module).__name__} was pruned differently from its "
                                   f"{type(first).__name__}.{attr}: {tuple(other.shape)} against {tuple(param.shape)}")
            setattr(module, name, param)


def width_norms(site: WidthSite) -> torch.Tensor:
    """Each channel's squared weights in every member (each parameter once: a tied table's column counts once)."""
    total = torch.zeros(site.width, dtype=torch.float64)
    seen: set[int] = set()
    for member in site.members:
        module = member.module
        weight = module.weight_ih_l0 if isinstance(module, nn.RNNBase) else getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or id(weight) in seen:
            continue
        seen.add(id(weight))
        w = weight.detach().double().pow(2).cpu()
        if isinstance(module, nn.Embedding) or member.role == "in":
            per = w.sum(0)  # columns: a table's, a reader's inputs
        elif member.role == "out":
            per = w.sum(1)
        elif member.role == "norm":
            bias = getattr(module, "bias", None)
            per = w + (bias.detach().double().pow(2).cpu() if isinstance(bias, torch.Tensor) else 0)
        else:
            continue
        total[torch.as_tensor(member.root_idxs)] += per[torch.as_tensor(member.idxs)]
    return total
