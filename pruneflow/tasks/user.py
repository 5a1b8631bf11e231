"""Metrics of your own, from the recipe: a function of the outputs and the labels, with its direction.

    # my_metrics.py
    import pruneflow
    from sklearn.metrics import f1_score as sk_f1

    @pruneflow.metric(higher_is_better=True)
    def f1_score(outputs, labels):          # numpy: outputs as the task reads them (logits), labels as the data gives them
        return sk_f1(labels, outputs.argmax(1), average="macro")

    # recipe.yaml
    metrics: [my_metrics.py:f1_score]       # or {fn: my_metrics.py:f1_score, higher_is_better: true, headline: true}

The task (``Task``) the run judges with gains the metric (``with_user_metrics``): it is computed wherever the task's own
metrics are (training's figures, ``evaluate``, prune rounds, QAT phases, sensitivity, every artifact in its runtime), so
gates read ``onnx.int8.f1_score``, report.md and ``--json`` list it, and with ``headline: true`` it is the run's headline
(the headline table, bench, the default of ``sensitivity.metric``). The function is resolved as a model factory is
(``pruneflow.models.resolve_factory``, and checked without running it at validate); it is called once per evaluation on
every output and label of the split, as numpy arrays, and must return a finite number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import numpy as np
import torch

from ..errors import StageError
from .base import Metric, MetricState, Task

F = TypeVar("F", bound=Callable[..., Any])


def metric(*, higher_is_better: bool) -> Callable[[F], F]:
    """Declare a function of ``(outputs, labels)`` a metric, with its direction: what lets a recipe name it bare
    (``metrics: [my_metrics.py:f1_score]``); ``validate`` reads the decorator from the source without running it."""

    def mark(fn: F) -> F:
        fn.higher_is_better = bool(higher_is_better)  # type: ignore[attr-defined]
        return fn

    return mark


@dataclass(frozen=True)
class UserMetric:
    """A recipe's metric, resolved: its name in metrics and gates, the function, its direction, whether it is the
    run's headline, and where it came from (``my_metrics.py:f1_score``, for messages)."""

    name: str
    fn: Callable[[np.ndarray, np.ndarray], Any]
    higher_is_better: bool
    headline: bool = False
    source: str = ""

    def compute(self, outputs: np.ndarray, labels: np.ndarray) -> float:
        try:
            value = self.fn(outputs, labels)
        except Exception as exc:  # noqa: BLE001 - the user's code: name it, keep the cause
            raise StageError(f"metric {self.name!r} ({self.source}) raised {type(exc).__name__}: {exc}",
                             hint=f"it is called with numpy outputs {outputs.shape} and labels {labels.shape}; fix "
                                  f"{self.source.rpartition(':')[0] or self.source}") from exc
        try:
            number = float(value)
        except (TypeError, ValueError):
            number = math.nan
        if not math.isfinite(number):
            raise StageError(f"metric {self.name!r} ({self.source}) returned {value!r}, not a finite number",
                             hint="return one float for the whole split")
        return number


class _UserMetrics:
    """Mixed into a task's class by ``with_user_metrics``: keeps every output and label it is shown, and adds each
    user metric to what ``compute`` returns."""

    user_metrics: tuple[UserMetric, ...]
    #: The task's own headline, before a metric of the recipe's took its place (``with_user_metrics``).
    own_headline: str

    @property
    def recorded_names(self) -> list[str]:
        return list(dict.fromkeys([*self.headline_names, self.own_headline, *(m.name for m in self.user_metrics)]))  # type: ignore[attr-defined]

    def update(self, state: MetricState, output: torch.Tensor, target: torch.Tensor) -> None:
        super().update(state, output, target)  # type: ignore[misc]
        state.kept_outputs.append(output.detach().float().cpu())
        state.kept_targets.append(target.detach().cpu())

    def compute(self, state: MetricState) -> dict[str, float]:
        figures = super().compute(state)  # type: ignore[misc]
        if state.kept_outputs:
            outputs, labels = torch.cat(state.kept_outputs).numpy(), torch.cat(state.kept_targets).numpy()
            figures.update({m.name: m.compute(outputs, labels) for m in self.user_metrics})
        return figures

    def for_training(self, label_smoothing: float) -> Task:
        trained: Task = super().for_training(label_smoothing)  # type: ignore[misc]
        return trained if trained is self else with_user_metrics(trained, self.user_metrics)

    def summary(self) -> dict[str, Any]:
        return super().summary() | {"user_metrics": {m.name: m.source for m in self.user_metrics}}  # type: ignore[misc]


_CLASSES: dict[type, type] = {}


def with_user_metrics(task: Task, metrics: Sequence[UserMetric]) -> Task:
    """``task`` judging with ``metrics`` too (in place; the same task when there are none). A metric marked
    ``headline`` becomes the task's headline."""
    if not metrics:
        return task
    earlier = {m.name for m in getattr(task, "user_metrics", ())}
    own = tuple(m for m in task.metrics if m.name not in earlier | {u.name for u in metrics})
    base = type(task)
    if issubclass(base, _UserMetrics):
        base = base.__mro__[2]  # already mixed: the task's own class (mixin, base, ...)
    if base not in _CLASSES:
        _CLASSES[base] = type(base.__name__, (_UserMetrics, base), {"__module__": base.__module__,
                                                                    "__qualname__": base.__qualname__})
    if not isinstance(task, _UserMetrics):
        task.own_headline = task.headline_name  # type: ignore[attr-defined]
    task.__class__ = _CLASSES[base]
    task.user_metrics = tuple(metrics)  # type: ignore[attr-defined]
    task.metrics = (*own, *(Metric(m.name, m.higher_is_better, description=f"{m.source} (the recipe's metrics)")  # type: ignore[misc]
                            for m in metrics))
    headline = next((m.name for m in metrics if m.headline), None)
    if headline:
        task.headline_name = headline  # type: ignore[misc]
    return task
