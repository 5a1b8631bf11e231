"""A third-party task in one file: quantile regression (the pinball loss), lower is better.

A forecaster that must say "90 % of deliveries arrive within X minutes" predicts a quantile, not a mean.
tests/test_task_plugin.py installs this the way a package would, through a ``pruneflow.tasks`` entry point::

    [project.entry-points."pruneflow.tasks"]
    quantile = "pf_quantile:Quantile"
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from pruneflow.config import TaskConfig
from pruneflow.errors import InputError
from pruneflow.tasks import Metric, Task


class QuantileConfig(TaskConfig):
    type: Literal["quantile"] = Field(default="quantile", description="One value per sample: the q-quantile of the target.")
    q: float = Field(default=0.9, gt=0, lt=1, description="The quantile the model predicts.")


class Quantile(Task):
    Config = QuantileConfig
    metrics = (Metric("pinball", higher_is_better=False, perfect=0.0, description="mean pinball loss at q"),
               Metric("coverage_error", higher_is_better=False, perfect=0.0,
                      description="|share of targets at or below the prediction − q|"))
    headline_name = "pinball"
    #: Parity: mean absolute difference over the reference's mean magnitude.
    agreement = Metric("relative_error", higher_is_better=False, perfect=0.0)
    agreement_limits = {"fp32": 1e-4, "fp16": 1e-2, "int8": 0.1, "bf16": 1e-2}

    def _pinball(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        error = target - prediction.reshape(target.shape)
        q = self.config.q  # type: ignore[attr-defined]
        return torch.maximum(q * error, (q - 1) * error)

    def loss(self, out, target):
        return self._pinball(self.output(out).float(), target).mean()

    def update(self, state, output, target):
        prediction = output.detach().float().reshape(target.shape)
        state.add(pinball=float(self._pinball(prediction, target).sum()), covered=float((target <= prediction).sum()))
        state.count += int(target.numel())

    def compute(self, state):
        n = max(state.count, 1)
        coverage = state.sums.get("covered", 0.0) / n
        return {"pinball": state.sums.get("pinball", 0.0) / n, "coverage_error": abs(coverage - self.config.q),  # type: ignore[attr-defined]
                "coverage": coverage, "samples": state.count}

    def read_targets(self, values, column):
        if not np.issubdtype(values.dtype, np.number):
            raise InputError(f"data.label_column {column!r} must hold numbers (found {values.dtype})")
        return values.astype(np.float32)

    def agree(self, ref, got):
        figures = super().agree(ref, got)
        figures["relative_error"] = float(np.abs(ref - got).mean() / max(float(np.abs(ref).mean()), 1e-12))
        return figures
