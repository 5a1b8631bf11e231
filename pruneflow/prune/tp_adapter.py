"""Our one adapter over torch-pruning: every use of its internals lives in this module.

torch-pruning's public surface is a pruner and an importance callable; what we build on goes further
(a MetaPruner subclass that rounds differently, the widths its ratio cap compares against, interactive
groups read member by member, an importance's reduction and normalisation). Those parts change between
its releases, so pyproject.toml pins the tested range and an upgrade touches this file alone.

The rest of ``pruneflow.prune`` sees three small things: a :class:`Selection` (a group's root layer and
the channels chosen there), a :class:`Member` (one coupled layer of a group, with what pruning does to
it) and a :class:`GroupPruner` (one global or uniform step, yielded group by group)::

    pruner = GroupPruner(model, example, importance, rule, ratio=0.3, global_pruning=True, ignored=[model.fc])
    chosen = [s for s in pruner.selections()]     # nothing is pruned yet
    for s in chosen:
        prune(pruner.graph, s)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Literal, NamedTuple

import torch
import torch_pruning as tp
from torch import nn
from torch_pruning.pruner import function

if TYPE_CHECKING:
    from ..inputs import Inputs
    from .keep import KeepRule

_OUT = (function.prune_conv_out_channels, function.prune_linear_out_channels)
_IN = (function.prune_conv_in_channels, function.prune_linear_in_channels)
_NORM = (function.prune_batchnorm_out_channels, function.prune_layernorm_out_channels, function.prune_groupnorm_out_channels)

Role = Literal["out", "in", "norm", "other"]


class _BagPruner(function.EmbeddingPruner):
    """torch-pruning's pruner for ``nn.Embedding`` (columns), for ``nn.EmbeddingBag`` too.

    torch-pruning registers ``nn.Embedding`` only. A bag's weight was therefore an "unwrapped parameter" of no
    module, pruned on its last dimension (the columns) with whatever Linear its rows meet (a DLRM's bottom MLP):
    ignoring the bag module did not cover its weight, and ``embedding_coupled``'s reachability, which looks for
    modules, never reached it: channel pruning cut bag tables' columns (issue 37: three of them from 16 to 13),
    against "tables are kept whole". Registered for the class (``BAG_PRUNERS``, in every graph built here), a bag
    is a module node like a table: kept whole when ignored, and found from the layers tied to its columns."""

    TARGET_MODULES = nn.EmbeddingBag


#: torch-pruning's ``customized_pruners`` for every dependency graph and pruner built here.
BAG_PRUNERS: dict = {nn.EmbeddingBag: _BagPruner()}


class Selection(NamedTuple):
    """A group's root layer, torch-pruning's handler for it and the root's channel indices chosen."""

    module: nn.Module
    handler: object
    idxs: list[int]


@dataclass(frozen=True)
class Member:
    """One layer of a coupled group: ``role`` says which of its dimensions the group prunes.

    ``role`` is ``out`` for a conv/Linear's outputs, ``in`` for its inputs, ``norm`` for a
    normalisation layer's channels, ``other`` for anything else. ``out_channels`` is torch-pruning's
    own test (it also holds for layers our roles do not list). ``idxs`` number the member's own
    channels, ``root_idxs`` the same channels as the root layer numbers them.
    """

    module: nn.Module
    role: Role
    out_channels: bool
    idxs: list[int]
    root_idxs: list[int]


def _role(handler) -> Role:
    return "out" if handler in _OUT else "in" if handler in _IN else "norm" if handler in _NORM else "other"


def members(group, graph: tp.DependencyGraph | None = None) -> list[Member]:
    """The layers of a torch-pruning group as :class:`Member` records (``graph``: to test out-channel pruning)."""
    out = []
    for i, (dep, idxs) in enumerate(group):
        plain = [getattr(j, "idx", j) for j in idxs]
        root = getattr(group[i], "root_idxs", plain)
        is_out = graph.is_out_channel_pruning_fn(dep.handler) if graph is not None else dep.handler in _OUT
        out.append(Member(dep.target.module, _role(dep.handler), is_out, plain, list(root)))
    return out


def selection_members(graph: tp.DependencyGraph, selection: Selection) -> list[Member]:
    """Every layer that removing ``selection`` touches (the group torch-pruning derives from it)."""
    return members(graph.get_pruning_group(selection.module, selection.handler, selection.idxs), graph)


def prune(graph: tp.DependencyGraph, selection: Selection) -> None:
    """Remove ``selection``'s channels and every coupled one (indices derived now, as torch-pruning does)."""
    graph.get_pruning_group(selection.module, selection.handler, selection.idxs).prune()


class GroupImportance(tp.importance.GroupMagnitudeImportance):
    """Base for our group importances: subclasses score a list of :class:`Member` records.

    ``relative`` keeps torch-pruning's default (mean reduction, divided by the group's mean); otherwise the
    scores are summed and compared as they are. ``reduce`` and ``normalize`` are torch-pruning's own.
    """

    def __init__(self, relative: bool):
        if relative:
            super().__init__(p=1, group_reduction="mean", normalizer="mean")
        else:
            super().__init__(p=1, group_reduction="sum", normalizer=None)

    def reduce(self, scores: list[torch.Tensor], root_idxs: list[list[int]]) -> torch.Tensor:
        """One score per root channel from per-member scores (torch-pruning's group reduction)."""
        return self._reduce(scores, root_idxs)

    def normalize(self, scores: torch.Tensor) -> torch.Tensor:
        return self._normalize(scores, self.normalizer)

    def score(self, group: list[Member]) -> torch.Tensor | None:  # pragma: no cover - abstract
        raise NotImplementedError

    @torch.no_grad()
    def __call__(self, group):
        return self.score(members(group))


class _NearestRoundingPruner(tp.pruner.MetaPruner):
    """torch-pruning rounds the channels a layer keeps *down* to a multiple of round_to; ``rule`` decides
    instead (see ``KeepRule.pruned``)."""

    def __init__(self, *args, rule: "KeepRule", **kwargs):
        self.rule = rule
        super().__init__(*args, **kwargs)

    def _round_to(self, n_pruned: int, current_channels: int, round_to: int) -> int:
        return self.rule.pruned(n_pruned, current_channels)


class GroupPruner:
    """One pruning step of ``ratio`` on torch-pruning's dependency graph, yielded group by group.

    ``initial_widths`` maps layers to their (out, in) widths when the stage started: torch-pruning's
    ``max_pruning_ratio`` then holds against those over every round (a fresh pruner would measure it
    against the current widths).
    """

    def __init__(self, model: nn.Module, example: Inputs, importance: GroupImportance, rule: "KeepRule", *,
                 ratio: float, global_pruning: bool, ignored: list[nn.Module],
                 initial_widths: dict[nn.Module, tuple[int, int]] | None = None):
        with warnings.catch_warnings():
            # Bare parameters (a ViT's class token and position embedding, ConvNeXt's layer scale) are pruned on
            # their last non-singleton dimension, the channel one in each: right, and not worth a warning a run.
            warnings.filterwarnings("ignore", message="Unwrapped parameters detected")
            self._pruner = _NearestRoundingPruner(
                model, example, importance=importance, global_pruning=global_pruning, pruning_ratio=ratio,
                max_pruning_ratio=rule.max_layer_ratio, ignored_layers=ignored,
                # 1 when unset: the rule then keeps at least one channel of a group selected whole (once the global
                # threshold reaches the +inf floor scores), and the cap restores the floor; torch-pruning would
                # otherwise reject such a group and prune nothing there.
                round_to=rule.step, rule=rule, customized_pruners=BAG_PRUNERS,
            )
        for module, (out_ch, in_ch) in (initial_widths or {}).items():
            if module in self._pruner.layer_init_out_ch:
                self._pruner.layer_init_out_ch[module] = out_ch
                self._pruner.layer_init_in_ch[module] = in_ch

    @property
    def graph(self) -> tp.DependencyGraph:
        return self._pruner.DG

    def selections(self) -> Iterator[Selection]:
        """The step's choice, one group at a time (root layer first); nothing is pruned."""
        for group in self._pruner.step(interactive=True):
            dep, idxs = group[0]
            yield Selection(dep.target.module, dep.handler, list(idxs))

    def prunes_out_channels(self, selection: Selection) -> bool:
        return self.graph.is_out_channel_pruning_fn(selection.handler)

    def out_channels(self, module: nn.Module) -> int:
        return self.graph.get_out_channels(module)

    def scores(self, selection: Selection) -> torch.Tensor | None:
        """The importance of every channel of ``selection``'s root layer (None: torch-pruning could not score it)."""
        current = self.out_channels(selection.module)
        return self._pruner.estimate_importance(self.graph.get_pruning_group(selection.module, selection.handler,
                                                                             list(range(current))))


def count_ops_as(cls: type[nn.Module], hook) -> None:
    """Let torch-pruning's op counter (``count_ops_and_params``) count ``cls`` with ``hook(module, inputs, output)``
    (which adds to ``module.__flops__``) as one unit: its children are then not counted on their own."""
    from torch_pruning.utils import op_counter

    op_counter.MODULES_MAPPING[cls] = hook


def embedding_coupled(model: nn.Module, example: "Inputs") -> list[str]:
    """Names of the embedding tables and of the Conv/Linear layers whose output channels are tied to a table's
    columns (added to, multiplied with or concatenated beside its rows: a DeepFM's dense projection, a DLRM's
    bottom MLP output): channel pruning keeps them whole.

    Pruning a table's width is its own granularity (rows, per-field dimension), not an output channel of a
    layer. And torch-pruning's group search, which follows each channel index through every concat, slice and
    stack, did not finish in minutes on an 8-field DeepFM from such a root (``get_pruning_group`` on a table:
    index mappings through the stacked, sliced rows keep re-adding the same nodes). Plain reachability over the
    same dependency graph (each node and handler once) is linear, so it is what decides here.
    """
    from .. import inputs as model_inputs

    tables = [m for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    if not tables:
        return []
    graph = tp.DependencyGraph().build_dependency(model, example_inputs=model_inputs.bind(model, example),
                                                  customized_pruners=BAG_PRUNERS)
    names = {m: n for n, m in model.named_modules()}
    coupled = [names[t] for t in tables]
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d)) and module in graph.module2node:
            node = graph.module2node[module]
            if _reaches(graph, node, graph.get_pruner_of_module(module).prune_out_channels, set(tables)):
                coupled.append(name)
    return coupled


def _reaches(graph: tp.DependencyGraph, start, handler, targets: set[nn.Module]) -> bool:
    """Whether pruning ``start``'s output channels triggers a pruning of any module in ``targets``."""
    seen = {(start, handler)}
    stack = [(start, handler)]
    while stack:
        node, fn = stack.pop()
        for dep in node.dependencies:
            if not dep.is_triggered_by(fn):
                continue
            if dep.target.module in targets:
                return True
            key = (dep.target, dep.handler)
            if key not in seen:
                seen.add(key)
                stack.append(key)
    return False
