"""`train`: train from scratch or fine-tune the model on the recipe's training split."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..evaluate import count_macs_params
from ..stage import Stage, StageConfig, StageResult
from ..train import TrainSettings, fit


class TrainConfig(TrainSettings, StageConfig):
    type: Literal["train"] = Field(default="train", description="Train or fine-tune the model.")


class TrainStage(Stage[TrainConfig]):
    Config = TrainConfig
    modifies_model = True
    needs_train_split = True

    def run(self, state, ctx):
        cfg = self.config
        history = fit(state.model, state.data, state.task, cfg, ctx, description=self.id)
        last = history[-1]
        macs, params = count_macs_params(state.model, state.example_input)
        metrics = {
            "accuracy": last["eval_accuracy"],
            "train_loss": last["train_loss"],
            "train_accuracy": last["train_accuracy"],
            "epochs": cfg.epochs,
            "macs": macs,
            "params": params,
        }
        return StageResult(metrics=metrics, tables={"epochs": history})
