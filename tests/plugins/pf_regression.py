"""A third-party task in one file: one value per sample, squared error; lower is better.

tests/test_task_plugin.py installs it the way a package would, through a ``pruneflow.tasks`` entry point::

    [project.entry-points."pruneflow.tasks"]
    regression = "pf_regression:Regression"
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch.nn.functional as F
from pydantic import Field

from pruneflow.config import TaskConfig
from pruneflow.errors import InputError
from pruneflow.tasks import Metric, Task


class RegressionConfig(TaskConfig):
    type: Literal["regression"] = Field(default="regression", description="One value per sample; judged by mean squared error.")


class Regression(Task):
    Config = RegressionConfig
    metrics = (Metric("mse", higher_is_better=False, perfect=0.0, description="mean squared error"),
               Metric("mae", higher_is_better=False, perfect=0.0, description="mean absolute error"))
    headline_name = "mse"
    #: Parity: mean absolute difference over the reference's mean magnitude.
    agreement = Metric("relative_error", higher_is_better=False, perfect=0.0)
    agreement_limits = {"fp32": 1e-4, "fp16": 1e-2, "int8": 0.1, "bf16": 1e-2}

    def loss(self, out, target):
        return F.mse_loss(self.output(out).reshape(target.shape), target)

    def update(self, state, output, target):
        err = output.detach().float().reshape(target.shape) - target
        state.add(se=float((err ** 2).sum()), ae=float(err.abs().sum()))
        state.count += int(target.numel())

    def compute(self, state):
        n = max(state.count, 1)
        return {"mse": state.sums.get("se", 0.0) / n, "mae": state.sums.get("ae", 0.0) / n, "samples": state.count}

    def read_targets(self, values, column):
        if not np.issubdtype(values.dtype, np.number):
            raise InputError(f"data.label_column {column!r} must hold numbers (found {values.dtype})")
        return values.astype(np.float32)

    def agree(self, ref, got):
        figures = super().agree(ref, got)
        figures["relative_error"] = float(np.abs(ref - got).mean() / max(float(np.abs(ref).mean()), 1e-12))
        return figures
