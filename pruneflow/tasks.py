"""A task is a loss, a metric and how outputs are read. Classification first; others plug in here."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class MetricState:
    correct: int = 0
    count: int = 0
    loss_sum: float = 0.0


class Task:
    name = "task"
    #: The headline metric: used in tables and by default gates.
    primary_metric = "accuracy"

    def logits(self, output) -> torch.Tensor:
        """The tensor the loss reads. Handles models that return tuples or HF-style outputs."""
        if isinstance(output, torch.Tensor):
            return output
        if hasattr(output, "logits"):
            return output.logits
        if isinstance(output, (tuple, list)):
            return output[0]
        if isinstance(output, dict):
            return output["logits"]
        raise TypeError(f"cannot read logits from a model output of type {type(output).__name__}")

    def loss(self, output, target: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def update(self, state: MetricState, output, target: torch.Tensor) -> None:  # pragma: no cover
        raise NotImplementedError

    def compute(self, state: MetricState) -> dict[str, float]:  # pragma: no cover
        raise NotImplementedError


class Classification(Task):
    name = "classification"

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing

    def loss(self, output, target):
        return F.cross_entropy(self.logits(output), target, label_smoothing=self.label_smoothing)

    def update(self, state, output, target):
        logits = self.logits(output)
        state.correct += int((logits.argmax(-1) == target).sum())
        state.count += int(target.numel())
        state.loss_sum += float(F.cross_entropy(logits.float(), target, reduction="sum"))

    def compute(self, state):
        n = max(state.count, 1)
        return {"accuracy": state.correct / n, "loss": state.loss_sum / n, "samples": state.count}


TASKS: dict[str, type[Task]] = {"classification": Classification}


def make_task(name: str) -> Task:
    return TASKS[name]()
