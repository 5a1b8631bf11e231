"""`prune`: progressive structured pruning with distillation fine-tuning between rounds.

The stage picks the strategy for the config's granularity (channels, blocks, or transformer heads and
FFN neurons), runs the one round loop (``rounds.py``) and reports what is common to all three: the task's
headline metric and MACs/params before and after, onnxruntime latency before and after, the rounds table.
"""

from __future__ import annotations

from .. import distributed
from ..export.onnx import onnx_latency
from ..evaluate import evaluate_model
from ..errors import ConfigError
from ..stage import Stage, StageResult
from .blocks import BlockStrategy
from .channels import ChannelStrategy, check_prunable
from .engine import resolve_ignored
from .config import AnyPruneConfig, BlockPruneConfig, ChannelPruneConfig, HeadPruneConfig, PruneConfig, TablePruneConfig
from .heads import HeadStrategy
from .tables import TableStrategy
from .rounds import Strategy, Tuner, importance_batches, run_rounds

# Re-exported: the variants are the stage's config (a recipe's `granularity` picks one).
__all__ = ["PruneStage", "PruneConfig", "ChannelPruneConfig", "BlockPruneConfig", "HeadPruneConfig", "TablePruneConfig"]

_STRATEGIES: dict[type, type[Strategy]] = {
    ChannelPruneConfig: ChannelStrategy,
    BlockPruneConfig: BlockStrategy,
    HeadPruneConfig: HeadStrategy,
    TablePruneConfig: TableStrategy,
}


class PruneStage(Stage[AnyPruneConfig]):
    Config = ChannelPruneConfig  # the default variant; the recipe validates against config_model()
    modifies_model = True
    compresses = True
    needs_train_split = True
    runs_under_ddp = True

    @property
    def times_on_host(self) -> bool:
        """Timing the model before and after (``latency``) makes the stage's figures the host's."""
        return self.config.latency is not None

    @classmethod
    def config_model(cls):
        """The union of the granularity variants, told apart by `granularity` (see ``config.py``)."""
        return PruneConfig

    def strategy(self, model, example, loss, config: AnyPruneConfig | None = None, data=None) -> Strategy:
        """The round-loop strategy of the config's granularity on ``model`` (``config``: another variant of this
        stage's settings, e.g. doctor's with a quick criterion; ``data``: the run's splits, for a strategy that
        reads the whole training split)."""
        cfg = config or self.config
        return _STRATEGIES[type(cfg)](cfg, model, example, loss, self.loc, data)

    def doctor(self, state, ctx):
        """`pruneflow doctor`: one real round on a copy and one batch (``prune/doctor.py``)."""
        from .doctor import prune_checks

        return prune_checks(self, state, ctx)

    def check_model(self, model, batch) -> list[str]:
        """Before any stage of the run trains: channel pruning has a layer to prune (else exit 2 here, not
        after training)."""
        if isinstance(self.config, ChannelPruneConfig):
            try:
                resolve_ignored(model, self.config.ignore, self.loc("ignore"))
            except ConfigError:
                return []  # an `ignore` entry matching nothing is reported where it was (the stage, doctor's table)
            check_prunable(model, self.config.ignore, self.loc, batch)
        return []

    def run(self, state, ctx) -> StageResult:
        cfg = self.config
        model, example, data = state.model, state.example_input, state.data
        latency = cfg.latency if distributed.is_main() else None  # other ranks would disturb rank 0's timing
        strategy = self.strategy(model, example, state.task.importance_loss, data=data)
        entering = strategy.entering()
        headline = state.task.headline_name
        baseline = evaluate_model(model, data.eval, state.task, ctx.recipe.data.eval_batch_size, ctx.device,
                                  ctx.reporter, f"{self.id} baseline")
        before = baseline[headline]
        latency_before = onnx_latency(model, example, data.eval.x, latency.batch_sizes, latency.runs) if latency else {}
        strategy.prepare()
        tuner = Tuner(cfg, state, ctx, self.id, self.loc("distill"))
        batches = cfg.importance_batches or strategy.default_importance_batches

        def sample(index: int):
            return importance_batches(data, batches, cfg.importance_batch_size, ctx.seed * 1000 + index, ctx.device)

        records, importance_seconds = run_rounds(strategy, tuner, sample, ctx.reporter, self.id)
        final = tuner.final(model, records[-1].value if records else before)
        after = strategy.measure()
        metrics: dict[str, float | int | str] = {
            headline: final, f"{headline}_before": before,
            "macs": after["macs"], "params": after["params"],
            "macs_before": entering["macs"], "params_before": entering["params"],
            "macs_reduction": entering["macs"] / after["macs"], "params_reduction": entering["params"] / after["params"],
            **strategy.summary(after),
            "rounds": len(records), "importance_seconds": round(importance_seconds, 3),
        }
        others = [n for n in state.task.recorded_names if n != headline]
        if others:  # every head's figure (and the recipe's own metrics) before and after, not the headline's alone
            final_all = evaluate_model(model, data.eval, state.task, ctx.recipe.data.eval_batch_size, ctx.device,
                                       ctx.reporter, f"{self.id} heads")
            metrics.update({k: v for n in others for k, v in ((n, final_all[n]), (f"{n}_before", baseline[n]))})
        if latency:
            _add_latency(metrics, latency_before, onnx_latency(model, example, data.eval.x, latency.batch_sizes, latency.runs))
        tables = {"rounds": [strategy.row(r) for r in records], **strategy.tables(records)}
        for row in tables.get("notes", []):
            ctx.reporter.info(f"{self.id}: {row['note']}")
        return StageResult(metrics=metrics, tables=tables)


def _add_latency(metrics: dict, before: dict, after: dict) -> None:
    """`latency_bN_median_ms` after, `..._before` and the speed-up, per batch size."""
    for key, value in before.items():
        metrics[f"{key}_before"] = value
        metrics[key] = after[key]
        bs = key[len("latency_b"): -len("_median_ms")]
        metrics[f"latency_b{bs}_speedup"] = value / after[key]
