"""`evaluate`: accuracy, MACs and parameters of the current torch model."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..evaluate import count_macs_params, evaluate_model
from ..stage import Stage, StageConfig, StageResult


class EvaluateConfig(StageConfig):
    type: Literal["evaluate"] = Field("evaluate", description="Measure the current model on the eval split.")
    split: Literal["eval", "train"] = Field("eval", description="Which split to measure.")


class EvaluateStage(Stage):
    Config = EvaluateConfig

    @property
    def needs_train_split(self) -> bool:  # type: ignore[override]
        return self.config.split == "train"

    def run(self, state, ctx):
        split = state.data.eval if self.config.split == "eval" else state.data.train
        if split is None:
            from ..errors import InputError

            raise InputError(f"stages.{self.index}.split: the data has no {self.config.split} split")
        metrics = evaluate_model(state.model, split, state.task, ctx.recipe.data.eval_batch_size, ctx.device,
                                 ctx.reporter, description=self.id)
        # A quantized model is counted through its float twin (quantizer ranges are not model parameters).
        macs, params = count_macs_params(state.handle.float_module(), state.example_input)
        metrics.update(macs=macs, params=params)
        return StageResult(metrics=metrics)
