"""`train`: train from scratch or fine-tune the model on the recipe's training split."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from ..evaluate import count_macs_params
from ..stage import Check, Stage, StageConfig, StageResult
from ..train import TrainSettings, fit


class TrainConfig(TrainSettings, StageConfig):
    type: Literal["train"] = Field(default="train", description="Train or fine-tune the model.")


class TrainStage(Stage[TrainConfig]):
    Config = TrainConfig
    modifies_model = True
    needs_train_split = True
    runs_under_ddp = True

    def doctor(self, state, ctx) -> list[Check]:
        """`pruneflow doctor`: one optimizer step on a copy: forward, the task's loss, backward, finite gradients."""
        import copy

        import torch

        from ..inputs import call, to

        data = state.data
        split = data.train if data is not None and data.train is not None else None
        if split is None:
            return [Check("training split", "will fail", "the recipe's data has no training split",
                          "set data.path or data.train")]
        model = copy.deepcopy(state.model).train()
        loss = state.task.loss(call(model, to(split.x, ctx.device)), split.y.to(ctx.device))
        loss.backward()
        bad = [n for n, p in model.named_parameters() if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        if bad:
            return [Check("one training step", "will fail", f"non-finite gradients in {', '.join(bad[:3])}",
                          "check the data's scale and the model's initialisation")]
        return [Check("one training step", "ok", f"loss {float(loss.detach()):.4f} on {len(split)} samples, finite gradients")]

    @classmethod
    def gate_metrics(cls, config, task):
        """What ``run`` records: each recorded figure on the eval split (``Task.recorded_names``: the headline, every
        head's, the recipe's own metrics), the training loss and headline, epochs, MACs and parameters."""
        return [*task.recorded_names, "train_loss", f"train_{task.headline_name}", "epochs", "macs", "params"]

    def run(self, state, ctx):
        cfg = self.config
        history = fit(state.model, state.data, state.task, cfg, ctx, description=self.id)
        last = history[-1]
        macs, params = count_macs_params(state.model, state.example_input)
        headline = state.task.headline_name
        metrics = {
            **{name: last[f"eval_{name}"] for name in state.task.recorded_names},
            "train_loss": last["train_loss"],
            f"train_{headline}": last[f"train_{headline}"],
            "epochs": cfg.epochs,
            "macs": macs,
            "params": params,
        }
        return StageResult(metrics=metrics, tables={"epochs": history})
