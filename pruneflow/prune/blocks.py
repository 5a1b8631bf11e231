"""Depth pruning: whole residual blocks removed (replaced by the identity), ranked by measured loss.

A residual block computes ``act(f(x) + x)``; without its branch ``f`` it passes ``x`` on (exactly, when
``act`` is a ReLU and ``x`` is a ReLU's output, as between ResNet blocks). Pre-norm blocks (ViT, ConvNeXt)
compute ``x + f(norm(x))``, or a chain of them (``y = x + attn(norm1(x)); y + mlp(norm2(y))``): the skip of
the last add reaches the input through earlier adds. Removing blocks keeps every
remaining layer's width, so on CPUs the MACs saved turn into time one for one, where channels pruned
below a kernel's SIMD channel block (8 or 16) save MACs but little time.

Written by hand: torch-pruning removes channels, not layers, and nncf has no depth pruning.
A block is a module (not the model itself) that keeps its input's shape and whose own forward, traced
by torch.fx with its submodules as calls, ends in an add of another branch and its input (through identity
modules, or through earlier such adds), optionally followed by an element-wise activation. Blocks are
ranked by the *measured* loss increase when each one alone is replaced by the identity, on the importance batches: exact where Taylor or Hessian scores
estimate, and cheap at the tens of blocks a network has (one forward pass per block and batch).
"""

from __future__ import annotations

import copy
import operator
from typing import Callable, Literal

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..inputs import Inputs, call
from .engine import auto_rounds, channel_table, layer_channels, measure, resolve_ignored
from .observe import observing
from .rounds import Batches, Plan, Round, Strategy, linear_goal

_ADDS = {operator.add, operator.iadd, torch.add}
_ACT_FUNCTIONS = {torch.relu, F.relu, F.relu6, F.gelu, F.silu, F.hardswish, F.leaky_relu}
_ACT_METHODS = {"relu", "relu_"}
_ACT_MODULES = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Hardswish, nn.LeakyReLU)


def _strip(gm: fx.GraphModule, node, activations: bool):
    """Follow ``node`` back through identity modules (and, with ``activations``, element-wise activations)."""
    while isinstance(node, fx.Node) and node.args:
        if node.op == "call_module":
            assert isinstance(node.target, str)  # a call_module node's target is the module's qualified name
            module = gm.get_submodule(node.target)
            if not (isinstance(module, nn.Identity) or (activations and isinstance(module, _ACT_MODULES))):
                break
        elif not (activations and ((node.op == "call_function" and node.target in _ACT_FUNCTIONS)
                                   or (node.op == "call_method" and node.target in _ACT_METHODS))):
            break
        node = node.args[0]
    return node


class _ShallowTracer(fx.Tracer):
    """Traces a module's own forward: its submodules are calls (their control flow does not matter), except
    ``nn.Sequential`` containers, traced through as torch.fx does (an empty one is a common identity shortcut)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return not isinstance(m, nn.Sequential)


def _is_add(node) -> bool:
    return isinstance(node, fx.Node) and ((node.op == "call_function" and node.target in _ADDS)
                                          or (node.op == "call_method" and node.target in ("add", "add_")))


def _skip_reaches(gm: fx.GraphModule, node, source) -> bool:
    """``node`` is ``source`` (through identity modules), or an add one of whose arguments is (pre-norm chains)."""
    node = _strip(gm, node, activations=False)
    if node is source:
        return True
    return _is_add(node) and any(_skip_reaches(gm, a, source) for a in node.args[:2] if isinstance(a, fx.Node))


def is_residual(module: nn.Module) -> bool:
    """``module``'s output is ``[act](x + branch)`` of its single input ``x``: an identity skip, or the skip
    of a chain of pre-norm adds (``y = x + f(norm(x)); y + g(norm(y))``)."""
    try:
        gm = fx.GraphModule(module, _ShallowTracer().trace(module))
    except Exception:  # noqa: BLE001 - data-dependent control flow etc.: not a block we can reason about
        return False
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    if len(inputs) != 1 or not isinstance(output, fx.Node):
        return False
    add = _strip(gm, output, activations=True)
    return _is_add(add) and any(_skip_reaches(gm, a, inputs[0]) for a in add.args[:2] if isinstance(a, fx.Node))


def find_blocks(model: nn.Module, example: "Inputs", ignored: tuple[str, ...] = ()) -> list[str]:
    """Names of the removable residual blocks of ``model``, in module order (``ignored`` names and their
    children excluded)."""
    shapes: dict[str, bool] = {}

    def hook(name):
        def record(module, inputs, output):
            shapes[name] = (len(inputs) == 1 and isinstance(inputs[0], torch.Tensor) and isinstance(output, torch.Tensor)
                            and inputs[0].shape == output.shape)
        return record

    named = [(n, m) for n, m in model.named_modules() if n and not any(n == i or n.startswith(i + ".") for i in ignored)]
    with observing(model, [m.register_forward_hook(hook(n)) for n, m in named if list(m.children())]), torch.no_grad():
        call(model, example)
    return [n for n, m in named if shapes.get(n) and is_residual(m)]


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def present(model: nn.Module, names: list[str]) -> list[str]:
    """The blocks of ``names`` still in ``model`` (not removed, nor inside a removed block)."""
    modules = dict(model.named_modules())
    return [n for n in names if n in modules and not isinstance(modules[n], nn.Identity)]


def removed_block() -> nn.Module:
    """What stands where a block was removed (registered under ``pruneflow.rebuildable_modules``, so a
    checkpoint of a model that lost blocks rebuilds it)."""
    return nn.Identity()


def remove_blocks(model: nn.Module, names: list[str]) -> None:
    for name in names:
        _set(model, name, removed_block())


@torch.no_grad()
def block_scores(model: nn.Module, names: list[str], batches: "list[tuple[Inputs, torch.Tensor]]", loss_fn) -> dict[str, float]:
    """Per block: the loss with it replaced by the identity minus the model's loss, on ``batches`` (eval mode)."""
    was = model.training
    model.eval()

    def loss() -> float:
        return sum(float(loss_fn(call(model, x), y)) * len(y) for x, y in batches) / sum(len(y) for _, y in batches)

    try:
        base = loss()
        scores = {}
        for name in names:
            block = model.get_submodule(name)
            _set(model, name, nn.Identity())
            try:
                scores[name] = loss() - base
            finally:
                _set(model, name, block)
        return scores
    finally:
        model.train(was)


class BlockStrategy(Strategy):
    """`granularity: blocks`: each round removes the blocks of lowest measured loss increase, in ascending
    order, until the round's goal is met. ``ratio`` counts blocks."""

    #: A block's score is one forward pass a batch, and fewer samples rank blocks by noise.
    default_importance_batches = 32

    def entering(self) -> dict[str, int]:
        cfg = self.config
        self.check_kind()
        self.ignored = resolve_ignored(self.model, cfg.ignore, self.loc("ignore"))
        self.candidates = find_blocks(self.model, self.example, self.ignored)
        if not self.candidates:
            raise ConfigError(
                self.loc("granularity"), "the model has no removable residual block (a module that keeps "
                "its input's shape and adds its input, through an identity skip, to another branch)"
                + (" outside `ignore`" if cfg.ignore else ""), value="blocks",
                hint="use granularity: channels for models without residual blocks",
            )
        metric, self.keep = cfg.target.metric_and_keep()
        # ratio: the share of blocks removed
        self.metric: Literal["blocks", "macs", "params"] = "blocks" if metric == "channels" else metric
        self.before = self.measure()
        self._check_reachable()
        return self.before

    def _check_reachable(self) -> None:
        """Refuse an unreachable target before any training (a copy without every candidate block)."""
        if self.metric == "blocks":
            return
        bare = copy.deepcopy(self.model)
        remove_blocks(bare, self.candidates)
        floor = measure(bare, self.example, self.ignored)[self.metric]
        if floor > self.before[self.metric] * self.keep:
            share = floor / self.before[self.metric]
            raise ConfigError(
                self.loc("target"), f"{self.metric} {self.keep:g} cannot be reached by removing blocks: without all "
                f"{len(self.candidates)} removable blocks the model keeps {share:.1%} of its {self.metric}",
                hint=f"ask for {self.metric}: {share + 0.05:.2f} or more, or use granularity: channels",
            )

    def prepare(self) -> None:
        self.channels_before = layer_channels(self.model)

    def rounds(self) -> int:
        if self.config.rounds != "auto":
            return self.config.rounds
        return auto_rounds("macs" if self.metric == "blocks" else self.metric, self.keep)

    def goal(self, index: int, rounds: int) -> dict[str, float]:
        return linear_goal(self.metric, self.before, self.keep, index, rounds)

    def score(self, batches: Callable[[], Batches]) -> dict[str, float]:
        return block_scores(self.model, present(self.model, self.candidates), batches(), self.loss)

    def plan(self, scores: dict[str, float], goal: dict[str, float]) -> Plan:
        def apply() -> dict[str, float]:
            removed = {}
            for name in sorted(scores, key=scores.__getitem__):
                if self.measure()[self.metric] <= goal[self.metric] + 1e-9:
                    break
                remove_blocks(self.model, [name])
                removed[name] = scores[name]
            return removed

        return Plan(apply)

    def measure(self) -> dict[str, int]:
        return dict(measure(self.model, self.example, self.ignored), blocks=len(present(self.model, self.candidates)))

    def row(self, record: Round) -> dict:
        after, before = record.figures, self.before
        return {"round": record.index, "goal_kept": round(record.goal[self.metric] / before[self.metric], 4),
                "blocks": after["blocks"], "removed": ", ".join(record.removed), "macs": after["macs"],
                "params": after["params"], "macs_kept": after["macs"] / before["macs"], record.metric: record.value,
                "seconds": record.seconds}

    def describe(self, record: Round) -> str:
        return (f"removed {len(record.removed)} block(s), {record.figures['macs'] / self.before['macs']:.1%} of MACs, "
                f"{record.metric} {record.value:.4f}")

    def summary(self, after: dict[str, int]) -> dict[str, float | int]:
        return {"blocks_before": self.before["blocks"], "blocks_removed": self.before["blocks"] - after["blocks"]}

    def tables(self, records: list[Round]) -> dict[str, list[dict]]:
        removed = [{"block": name, "round": r.index, "loss_increase": round(score, 5)}
                   for r in records for name, score in r.removed.items()]
        layers = channel_table(self.model, self.channels_before)
        return {"blocks": removed, "channels": layers}
