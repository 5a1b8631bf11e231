"""`evaluate`: the task's metrics (classification: accuracy and loss), MACs and parameters of the current torch model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..errors import ConfigError
from ..evaluate import count_macs_params, evaluate_model
from ..recipe.rules import has_train_split
from ..stage import Check, Stage, StageConfig, StageResult


class EvaluateConfig(StageConfig):
    type: Literal["evaluate"] = Field(default="evaluate", description="Measure the current model on the eval split.")
    split: Literal["eval", "train"] = Field(default="eval", description="Which split to measure.")


class EvaluateStage(Stage[EvaluateConfig]):
    Config = EvaluateConfig

    @property
    def needs_train_split(self) -> bool:
        return self.config.split == "train"

    @classmethod
    def recipe_rules(cls, config, index, recipe):
        """`split: train` on data without a training source fails at load time, not after the earlier stages ran."""
        if config.split == "train" and not has_train_split(recipe.data):
            yield ConfigError(("stages", index, "split"), "the recipe's data has no train split", value="train",
                              hint="measure `split: eval`, or give the data a `path` (split by eval_fraction) or a `train` source")

    @classmethod
    def gate_metrics(cls, config, task):
        """The task's metrics and figures (``Task.compute``), the samples counted, MACs and parameters (``run``)."""
        return [m.name for m in task.metrics] + list(task.figures) + ["samples", "macs", "params"]

    def doctor(self, state, ctx) -> list[Check]:
        """`pruneflow doctor`: the model evaluated on the one eval batch doctor holds."""
        assert state.data is not None
        result = evaluate_model(state.model, state.data.eval, state.task, device=ctx.device)
        return [Check("evaluate one batch", "ok", f"{state.task.describe(result)} on {len(state.data.eval)} eval samples "
                      "(doctor trains nothing: the figure is not the run's)")]

    def run(self, state, ctx):
        split = state.data.eval if self.config.split == "eval" else state.data.train
        if split is None:
            raise ConfigError(self.loc("split"), f"the data has no {self.config.split} split", value=self.config.split,
                              hint="set this stage's split: eval, or give the recipe that split (data.path, or data.train "
                              "and data.eval)")
        metrics = evaluate_model(state.model, split, state.task, ctx.recipe.data.eval_batch_size, ctx.device,
                                 ctx.reporter, description=self.id)
        # A quantized model is counted through its float twin (quantizer ranges are not model parameters).
        macs, params = count_macs_params(state.handle.float_module(), state.example_input)
        metrics.update(macs=macs, params=params)
        return StageResult(metrics=metrics)
