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

import contextlib
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Literal, NamedTuple

import torch
import torch_pruning as tp
from torch import nn
from torch_pruning.pruner import function

from . import rnn as rnn_units

if TYPE_CHECKING:
    from ..inputs import Inputs
    from .keep import KeepRule

Role = Literal["out", "in", "norm", "other"]

#: The layer types a group may start from: a layer whose output channels (hidden units) channel pruning removes.
ROOT_TYPES: tuple[type[nn.Module], ...] = (nn.Conv1d, nn.Conv2d, nn.Linear, nn.RNNBase)


class _BagPruner(function.EmbeddingPruner):
    """torch-pruning's pruner for ``nn.Embedding`` (columns), for ``nn.EmbeddingBag`` too.

    torch-pruning registers ``nn.Embedding`` only. A bag's weight was therefore an "unwrapped parameter" of no
    module, pruned on its last dimension (the columns) with whatever Linear its rows meet (a DLRM's bottom MLP):
    ignoring the bag module did not cover its weight, and ``embedding_coupled``'s reachability, which looks for
    modules, never reached it: channel pruning cut bag tables' columns (issue 37: three of them from 16 to 13),
    against "tables are kept whole". Registered for the class (``CUSTOM_PRUNERS``, in every graph built here), a bag
    is a module node like a table: kept whole when ignored, and found from the layers tied to its columns."""

    TARGET_MODULES = nn.EmbeddingBag


class _RnnPruner(function.BasePruningFunc):
    """Hidden units of ``nn.GRU``/``nn.LSTM``/``nn.RNN`` as output channels, input features as input channels
    (the surgery: ``rnn.py``). torch-pruning 1.6.1 has nothing for a GRU, and its ``LSTMPruner`` cuts an LSTM's
    gates inconsistently (``rnn.py`` says how)."""

    TARGET_MODULES = nn.RNNBase

    def prune_out_channels(self, layer: nn.Module, idxs: list) -> nn.Module:
        assert isinstance(layer, nn.RNNBase)
        return rnn_units.prune_hidden(layer, list(idxs))

    def prune_in_channels(self, layer: nn.Module, idxs: list) -> nn.Module:
        assert isinstance(layer, nn.RNNBase)
        return rnn_units.prune_input(layer, list(idxs))

    def get_out_channels(self, layer: nn.Module) -> int:
        return int(getattr(layer, "hidden_size"))

    def get_in_channels(self, layer: nn.Module) -> int:
        return int(getattr(layer, "input_size"))


_RNN = _RnnPruner()

#: torch-pruning's ``customized_pruners`` for every dependency graph and pruner built here (``build_graph``,
#: ``GroupPruner``): a customized pruner is registered for its class in all of them, nowhere else.
CUSTOM_PRUNERS: dict = {nn.EmbeddingBag: _BagPruner(), nn.GRU: _RNN, nn.LSTM: _RNN, nn.RNN: _RNN}

_OUT = (function.prune_conv_out_channels, function.prune_linear_out_channels, _RNN.prune_out_channels)
_IN = (function.prune_conv_in_channels, function.prune_linear_in_channels, _RNN.prune_in_channels)
_NORM = (function.prune_batchnorm_out_channels, function.prune_layernorm_out_channels, function.prune_groupnorm_out_channels)


def _traced_rnn(module: nn.RNNBase, input: Any, hx: Any = None) -> Any:
    """The module's outputs with one autograd path back to its input, for torch-pruning's tracer.

    On CPU a GRU runs as a loop of small ops (matmuls, a split into gates, a stack over time steps); torch-pruning
    follows channel indices through each of them, and the split into gates couples the units with the input's
    features. Traced opaque (the real outputs, computed without autograd, plus ``0 * sum`` of the input), the
    module is one node between its input's producer and its outputs' consumers, as a Linear is."""
    real = type(module).forward
    if isinstance(input, nn.utils.rnn.PackedSequence):
        return real(module, input, hx)
    with torch.no_grad():
        out, state = real(module, input, hx)
    out = out + input.sum(-1, keepdim=True) * 0
    link = out.sum() * 0  # the final state (h_n; c_n) is the units' too: coupled with the output
    state = tuple(s + link for s in state) if isinstance(state, tuple) else state + link
    return out, state


@contextlib.contextmanager
def _opaque_rnns(model: nn.Module) -> Iterator[None]:
    """While torch-pruning traces ``model``, its recurrent layers run :func:`_traced_rnn`."""
    patched = [m for m in model.modules() if isinstance(m, nn.RNNBase) and "forward" not in vars(m)]
    for m in patched:
        setattr(m, "forward", lambda *args, _m=m, **kwargs: _traced_rnn(_m, *args, **kwargs))
    try:
        yield
    finally:
        for m in patched:
            delattr(m, "forward")


def build_graph(model: nn.Module, example: Any) -> tp.DependencyGraph:
    """torch-pruning's dependency graph of ``model`` on ``example`` (bound inputs), with our customized pruners
    and recurrent layers traced as one node each."""
    with _opaque_rnns(model):
        return tp.DependencyGraph().build_dependency(model, example_inputs=example, customized_pruners=CUSTOM_PRUNERS)


class GroupFailure(RuntimeError):
    """torch-pruning's group of ``root`` (``name`` in its model: the stage's, or a trial copy's) could not be scored
    or removed (``cause`` says why): the stage names the layer and the `ignore` entry that keeps its group whole."""

    def __init__(self, root: nn.Module, cause: BaseException, name: str | None = None):
        super().__init__(f"{name or type(root).__name__}: {type(cause).__name__}: {cause}")
        self.root, self.cause, self.name = root, cause, name


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
    try:
        graph.get_pruning_group(selection.module, selection.handler, selection.idxs).prune()
    except Exception as exc:  # noqa: BLE001 - torch-pruning's own failures (an index past a layer's width)
        raise GroupFailure(selection.module, exc, graph._module2name.get(selection.module)) from exc


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
        try:
            return self.score(members(group))
        except Exception as exc:  # noqa: BLE001 - e.g. an index past a coupled layer's width (issue 37: MMoE's gates)
            raise GroupFailure(group[0][0].target.module, exc) from exc


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
        with warnings.catch_warnings(), _opaque_rnns(model):
            # Bare parameters (a ViT's class token and position embedding, ConvNeXt's layer scale) are pruned on
            # their last non-singleton dimension, the channel one in each: right, and not worth a warning a run.
            warnings.filterwarnings("ignore", message="Unwrapped parameters detected")
            self._pruner = _NearestRoundingPruner(
                model, example, importance=importance, global_pruning=global_pruning, pruning_ratio=ratio,
                max_pruning_ratio=rule.max_layer_ratio, ignored_layers=ignored,
                # 1 when unset: the rule then keeps at least one channel of a group selected whole (once the global
                # threshold reaches the +inf floor scores), and the cap restores the floor; torch-pruning would
                # otherwise reject such a group and prune nothing there.
                round_to=rule.step, rule=rule, customized_pruners=CUSTOM_PRUNERS, root_module_types=list(ROOT_TYPES),
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
        try:
            for group in self._pruner.step(interactive=True):
                dep, idxs = group[0]
                yield Selection(dep.target.module, dep.handler, list(idxs))
        except GroupFailure as exc:  # raised while scoring: name the root as the model names it
            raise GroupFailure(exc.root, exc.cause, self.graph._module2name.get(exc.root)) from exc.cause

    def prunes_out_channels(self, selection: Selection) -> bool:
        return self.graph.is_out_channel_pruning_fn(selection.handler)

    def out_channels(self, module: nn.Module) -> int:
        return self.graph.get_out_channels(module)

    def scores(self, selection: Selection) -> torch.Tensor | None:
        """The importance of every channel of ``selection``'s root layer (None: torch-pruning could not score it)."""
        current = self.out_channels(selection.module)
        try:
            return self._pruner.estimate_importance(self.graph.get_pruning_group(selection.module, selection.handler,
                                                                                 list(range(current))))
        except GroupFailure as exc:
            raise GroupFailure(exc.root, exc.cause, self.graph._module2name.get(exc.root)) from exc.cause


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
    graph = build_graph(model, model_inputs.bind(model, example))
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


@dataclass(frozen=True)
class WholeGroup:
    """A coupled group channel pruning must leave whole: its ``root`` layer's name, ``why``, and the names of
    every layer whose output channels are in it (ignored, they keep torch-pruning from selecting the group)."""

    root: str
    why: str
    layers: tuple[str, ...]


def whole_groups(model: nn.Module, example: "Inputs", ignored: tuple[str, ...], tied: set[str]) -> list[WholeGroup]:
    """The groups, rooted at layers outside ``ignored``, that no channel of can go:

    - **mis-coupled**: a member's channel indices run past its own width. torch-pruning takes every op it does
      not know (``torch.stack``, a broadcast multiply) as element-wise on dimension 1, so an MMoE's softmax gate
      (one output per expert) lands in one group with the experts' 64 output channels it weighs, and scoring
      index 4 of the gate's 4 rows crashed (issue 37); pruning such a group would cut the expert count;
    - **tied**: a member shares its weight with another module (``tied``: a SASRec's item table that is also its
      output projection): torch-pruning rebuilds a member's weight as a new Parameter, which unties the pair and
      prunes one side only.
    """
    from .. import inputs as model_inputs

    graph = build_graph(model, model_inputs.bind(model, example))
    names = {m: n for n, m in model.named_modules()}
    out: list[WholeGroup] = []
    for name, module in model.named_modules():
        if not isinstance(module, ROOT_TYPES) or module not in graph.module2node or _covered(name, ignored):
            continue
        if any(name in g.layers for g in out):
            continue
        pruner = graph.get_pruner_of_module(module)
        group = members(graph.get_pruning_group(module, pruner.prune_out_channels,
                                                list(range(pruner.get_out_channels(module)))), graph)
        why = _whole_because(graph, group, names, tied)
        if why:
            layers = tuple(dict.fromkeys(names[m.module] for m in group if m.out_channels and m.module in names))
            out.append(WholeGroup(name, why, layers))
    return out


def _covered(name: str, ignored: tuple[str, ...]) -> bool:
    return any(name == i or name.startswith(i + ".") for i in ignored)


def _whole_because(graph: tp.DependencyGraph, group: list[Member], names: dict, tied: set[str]) -> str | None:
    """Why no channel of ``group`` may go (None: it is a plain group)."""
    root = names.get(group[0].module, "?")
    for member in group:
        module = member.module
        if module not in names or type(module).__module__.startswith("torch_pruning"):
            continue  # torch-pruning's stand-ins for ops and bare parameters
        if names[module] in tied:
            return f"{names[module]} shares its weight with another module (tied)"
        width = graph.get_out_channels(module) if member.out_channels else graph.get_in_channels(module)
        if width is not None and member.idxs and max(member.idxs) >= width:
            return (f"{names[module]} ({type(module).__name__}, {width} {'output' if member.out_channels else 'input'} "
                    f"channels) is coupled with the {len(member.root_idxs)} output channels of {root} through an op "
                    "torch-pruning follows on another dimension (a stack or a broadcast: an MMoE gate's one weight per "
                    "expert)")
    return None
