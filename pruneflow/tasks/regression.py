"""`regression`: one value per sample (or several targets), judged by squared error; lower is better.

Outputs ``[B]``, ``[B, 1]`` or ``[B, T]`` for T targets; labels a number per sample (or T of them). MSE loss;
metrics ``mse`` (the headline), ``mae``, and ``r2`` (the share of the targets' variance explained, higher is
better); parity is the mean absolute difference over the reference's mean magnitude (``relative_error``).
Distillation matches the teacher's outputs (MSE). A constant target is refused: its variance is 0, so any
model that outputs the constant is perfect and R² is undefined.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from ..config import TaskConfig
from ..errors import InputError
from .base import Metric, Task


class RegressionConfig(TaskConfig):
    type: Literal["regression"] = Field(default="regression", description="A number per sample (or several); judged by "
                                        "mean squared error.")


def _aligned(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The output shaped like the target (``[B, 1]`` for ``[B]`` labels)."""
    return output.reshape(target.shape)


class Regression(Task):
    default_output_name = "prediction"
    Config = RegressionConfig
    metrics = (Metric("mse", higher_is_better=False, perfect=0.0, description="mean squared error"),
               Metric("mae", higher_is_better=False, perfect=0.0, description="mean absolute error"),
               Metric("r2", perfect=1.0, description="coefficient of determination"))
    headline_name = "mse"
    agreement = Metric("relative_error", higher_is_better=False, perfect=0.0,
                       description="mean |reference − artifact| over the reference's mean magnitude")
    agreement_limits = {"fp32": 1e-4, "fp16": 5e-3, "int8": 0.05, "bf16": 1e-2}

    def ranges(self) -> str:
        """The extremes seen (``minmax``). Measured on a pruned 6-64-64-1 MLP (FP32 MSE 0.0067, 2,000 eval rows): INT8
        MSE +28 % with NNCF's mean of each batch's extremes (+18.6 % from 256 samples), +0.8 % with the extremes seen."""
        return "minmax"

    def loss(self, out, target):
        return F.mse_loss(_aligned(self.output(out).float(), target), target)

    def update(self, state, output, target):
        y = target.detach().float().cpu()
        err = _aligned(output.detach().float().cpu(), y) - y
        state.add(se=float((err ** 2).sum()), ae=float(err.abs().sum()), y=float(y.sum()), yy=float((y ** 2).sum()))
        state.count += int(y.numel())

    def compute(self, state):
        n = max(state.count, 1)
        sums = state.sums
        variance = sums.get("yy", 0.0) / n - (sums.get("y", 0.0) / n) ** 2
        mse = sums.get("se", 0.0) / n
        return {"mse": mse, "mae": sums.get("ae", 0.0) / n, "r2": 1.0 - mse / variance if variance > 0 else float("nan"),
                "samples": state.count}

    def read_targets(self, values, column):
        values = np.asarray(values)
        if values.dtype.kind not in "biuf":
            raise InputError(f"data.label_column {column!r} must hold numbers for the regression task (found {values.dtype})",
                             hint="convert the target to a number per sample")
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            raise InputError(f"data.label_column {column!r}: {int((~np.isfinite(values)).sum())} targets are NaN or infinite",
                             hint="drop or impute those rows")
        return values.astype(np.float32)

    def check_targets(self, targets, data, column):
        super().check_targets(targets, data, column)
        train = targets.get("train")
        if train is not None and float(train.float().std()) == 0.0:
            raise InputError(f"data.label_column {column!r}: every target of the train split is {float(train.flatten()[0]):g}: "
                             "a model that outputs it is perfect and nothing is learnt",
                             hint="check the label column")

    def check_output(self, output, targets, data, factory):
        if output.numel() != targets.numel():
            raise InputError(
                f"the model from {factory!r} gives outputs of shape {tuple(output.shape)} for targets of shape "
                f"{tuple(targets.shape)}: the regression task reads one output per target",
                hint="end the model in a Linear with one output per target, or name the part to read with task.output")

    def agree(self, ref, got):
        figures = super().agree(ref, got)
        figures["relative_error"] = float(np.abs(ref - got).mean() / max(float(np.abs(ref).mean()), 1e-12))
        return figures
