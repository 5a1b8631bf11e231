"""`pruneflow doctor` for the prune stage (``PruneStage.doctor``): one real round of the stage's own strategy on a
copy of the model and one batch, and torch-pruning's view of the model.

The round scores importance on the batch (with ``taylor`` when the recipe's criterion is a slow one: which channels
go does not change what traces), aims at the whole target at once (the structure the run's last round reaches),
removes, and runs the pruned copy forward. Success leaves the pruned copy on the state, so the checks of the
stages after it (quantization, export) try the model the run will hand them.
"""

from __future__ import annotations

import copy

import torch

from .. import registry
from ..errors import PruneflowError
from ..handle import ModelHandle
from ..inputs import Inputs, call, to
from ..stage import Check
from .config import _ScoredPruneBase
from .mha import attention_modules
from .tp_adapter import ROOT_TYPES, build_graph, embedding_coupled

#: The criterion doctor's trial round scores with when the recipe's is slow (``Criterion.slow``).
STAND_IN = "taylor"


def prune_checks(stage, state, ctx) -> list[Check]:
    """One real round of the stage's strategy on a copy (importance from one batch, the round's goal, the
    removal), then a forward pass of the pruned copy; plus torch-pruning's coupling groups and the attention
    modules it will meet. The pruned copy goes on to the next stage's checks."""
    example = state.example_input
    assert example is not None and state.data is not None  # doctor's probe state holds both
    rows = coupling_rows(state.model, example)
    model = copy.deepcopy(state.model)
    cfg = stage.config
    # blocks are scored by their measured loss, without a criterion
    scored = cfg.importance if isinstance(cfg, _ScoredPruneBase) else None
    if scored is not None and registry.criteria.get(scored).slow:
        cfg = cfg.model_copy(update={"importance": STAND_IN})
    strategy = stage.strategy(model, example, state.task.importance_loss, cfg)
    before = strategy.entering()
    strategy.prepare()
    split = state.data.train if state.data.train is not None else state.data.eval
    batches = [(to(split.x, ctx.device), split.y.to(ctx.device))]
    try:
        rounds = strategy.rounds()  # the whole target in one round: the structure the run's last round reaches
        plan = strategy.plan(strategy.score(lambda: batches), strategy.goal(rounds, rounds))
        plan.apply()
        model.eval()
        with torch.no_grad():
            call(model, to(split.x, ctx.device))
    except PruneflowError:
        raise
    except Exception as exc:  # noqa: BLE001
        # (torch-pruning's own failures come as a ConfigError naming the layer and the `ignore` list: channels.py)
        heads = ", or prune attention by whole heads (granularity: heads)" if attention_modules(state.model) else ""
        return rows + [Check.failed("pruning to the target in one round", exc, "`ignore` the module named (its class is in "
                                    f"`pruneflow inspect`){heads}")]
    after = strategy.measure()
    state.handle = ModelHandle(model)
    return rows + [Check("pruning to the target in one round", "ok", f"MACs {before['macs']:,} -> {after['macs']:,}, "
                         f"parameters {before['params']:,} -> {after['params']:,} (the run takes {rounds} rounds"
                         f"{f'; channels scored by {STAND_IN} here, {scored} in the run' if isinstance(cfg, _ScoredPruneBase) and scored != cfg.importance else ''}); "
                         "the pruned model runs on one batch" + "".join(f"; {note}" for note in strategy.kept_notes),
                         figures={"macs_before": before["macs"], "macs_after": after["macs"], "params_before": before["params"],
                                  "params_after": after["params"], "rounds": rounds})]


def coupling_rows(model: torch.nn.Module, example: Inputs) -> list[Check]:
    """torch-pruning's dependency graph of the model: how many coupled groups, and the attention modules in it."""
    attention = [f"{n} ({type(m).__name__}, {getattr(m, 'num_heads', getattr(m, 'num_attention_heads', '?'))} heads)"
                 for n, m in model.named_modules()
                 if n and (isinstance(m, torch.nn.MultiheadAttention) or hasattr(m, "num_attention_heads"))]
    try:
        traced = copy.deepcopy(model).eval()
        graph = build_graph(traced, example)
        # tables and the layers tied to their columns are never channel roots (the stage keeps them whole, and
        # torch-pruning's group search from them does not finish on a DeepFM: tp_adapter.embedding_coupled)
        kept = [traced.get_submodule(n) for n in embedding_coupled(traced, example)]
        groups = list(graph.get_all_groups(ignored_layers=kept, root_module_types=list(ROOT_TYPES)))
    except Exception as exc:  # noqa: BLE001 - torch-pruning traces the forward pass
        return [Check.failed("torch-pruning dependency graph", exc, "a forward pass torch-pruning cannot trace cannot be pruned; "
                             "`ignore` the module that fails or drop the prune stage")]
    rows = [Check("torch-pruning dependency graph", "ok", f"{len(groups)} coupled channel groups")]
    if attention:
        rows.append(Check("attention modules", "ok", f"{len(attention)}: {', '.join(attention[:4])}"
                          f"{' ...' if len(attention) > 4 else ''}; their widths are coupled through the heads"))
    return rows
