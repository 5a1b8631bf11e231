"""`multi`: a model that serves several named heads (a multi-task ranker's ``click`` and ``finish`` logits), each a
registered task of its own, judged on its own metric, in one recipe and one artifact.

    task:
      type: multi
      heads: {click: binary, finish: binary}          # head name -> a task type, or {type: binary, positive: ...}
      weights: {click: 1.0, finish: 0.5}              # loss weights in training, pruning importance and KD (default 1)
      headline: finish.auc                            # default: the first head's headline
    data:
      label_column: {click: clicked, finish: finished}   # one label column a head

Each head reads the model's output by its name (a dict key, an attribute; ``output:`` in a head's mapping overrides
it) and its own label column. Every figure is named ``HEAD.METRIC`` (``click.auc``, ``finish.pctr_error``), so a gate
addresses a head (``onnx.int8.finish.auc``); report, ``--json`` and ``bench`` show them as any other figure.

Inside a run the heads travel as one tensor: ``output`` concatenates each head's output (flattened per sample) in
the order the recipe lists them, and targets are one column a head. Every exported artifact keeps every head as its
own named output (``export_output``: a tuple, one tensor a head); the runtime layer concatenates an artifact's
outputs back in that order, so evaluation, parity and ``bench`` read artifacts and the torch model alike.

Parity between executors: each head's own agreement figure (``click.probability_diff``...); the task's figure is the
worst head's when the heads share one agreement metric (all binary: the largest mean |Δp|), else the worst head's
cosine. Nothing here exists in torch, NNCF or the runtimes, which know outputs but not what they mean.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping

import numpy as np
import torch
from pydantic import Field, model_validator

from .. import registry
from ..config import TaskConfig
from ..errors import InputError
from .base import Metric, MetricState, Task, closeness, output_rows


class MultiConfig(TaskConfig):
    type: Literal["multi"] = Field(default="multi", description="Several named heads (a multi-task ranker), each a task of its "
                                   "own with its own label column (`data.label_column: {head: column}`) and metrics (`HEAD.METRIC`).")
    heads: dict[str, str | dict[str, Any]] = Field(
        min_length=1, description="Head name (the key of the model's output dict) -> its task: a type (`binary`) or a "
        "mapping with the task's options (`{type: binary, positive: yes}`).")
    weights: dict[str, float] = Field(default_factory=dict, description="Loss weight of each head in training, pruning "
                                      "importance and distillation (default 1 each).")
    headline: str | None = Field(default=None, description="The figure tables, logs and default gates show, `HEAD.METRIC` "
                                 "(default: the first head's headline).")

    @model_validator(mode="after")
    def _heads(self) -> "MultiConfig":
        bad = [h for h in self.heads if not h.isidentifier()]
        if bad:
            raise ValueError(f"head names must be identifiers (they name ONNX outputs and figures): {bad}")
        stray = [h for h in self.weights if h not in self.heads]
        if stray or any(w <= 0 for w in self.weights.values()):
            raise ValueError(f"weights name heads of `heads` ({', '.join(self.heads)}) with positive values (got {self.weights})")
        made = {h: head_task(h, spec) for h, spec in self.heads.items()}  # unknown types and options fail here, at their line
        if self.headline is not None:
            head, _, metric = self.headline.partition(".")
            if head not in made or metric not in {m.name for m in made[head].metrics}:
                known = [f"{h}.{m.name}" for h, t in made.items() for m in t.metrics]
                raise ValueError(f"headline {self.headline!r} is not a figure of the heads; one of {', '.join(known)}")
        return self


def head_task(name: str, spec: "str | Mapping[str, Any]") -> Task:
    """The task one head is: its type's class with its options, reading the output part named like the head."""
    mapping = {"type": spec} if isinstance(spec, str) else dict(spec)
    cls = registry.tasks.get(str(mapping.get("type")))
    if issubclass(cls, MultiTask):
        raise ValueError(f"head {name!r}: a head is one task, not a set of heads")
    if cls.targets_from_model:
        raise ValueError(f"head {name!r}: a {mapping['type']} head judges the model against its own outputs, which a "
                         "multi-task recipe does not compute; use it as the recipe's only task")
    mapping.setdefault("output", name)
    return cls(cls.Config.model_validate(mapping))


class MultiTask(Task):
    Config = MultiConfig
    default_output_name = "heads"

    def __init__(self, config: TaskConfig | None = None):
        super().__init__(config)
        cfg = self.config
        assert isinstance(cfg, MultiConfig)
        self.heads = {h: head_task(h, spec) for h, spec in cfg.heads.items()}
        self.weights = {h: float(cfg.weights.get(h, 1.0)) for h in self.heads}
        #: Values a sample each head outputs (a logit: 1), learnt from the first output read; unknown: an equal split.
        self.widths: dict[str, int] = {}
        self.target_dtypes: dict[str, np.dtype] = {}
        self.metrics = tuple(_named(h, m) for h, t in self.heads.items() for m in t.metrics)  # type: ignore[misc]
        self.figures = tuple(f"{h}.{f}" for h, t in self.heads.items() for f in t.figures)  # type: ignore[misc]
        first = next(iter(self.heads))
        self.headline_name = cfg.headline or f"{first}.{self.heads[first].headline_name}"  # type: ignore[misc]
        kinds = {t.agreement for t in self.heads.values()}
        if len(kinds) == 1:
            only = next(iter(self.heads.values()))
            self.agreement, self.agreement_limits = only.agreement, only.agreement_limits  # type: ignore[misc]

    def ranges(self) -> str:
        """``minmax`` when any head's task asks for it (one head that is a value: its tails count), else NNCF's."""
        return "minmax" if any(t.ranges() == "minmax" for t in self.heads.values()) else "mean_minmax"

    # ---------------------------------------------------------------- the heads as one tensor

    @property
    def output_names(self) -> list[str]:
        return list(self.heads)

    @property
    def headline_names(self) -> list[str]:
        return list(dict.fromkeys([self.headline_name, *(f"{h}.{t.headline_name}" for h, t in self.heads.items())]))

    def output(self, out: Any) -> torch.Tensor:
        """Every head's output, flattened per sample and concatenated in the heads' order (an artifact's output,
        already so, as it is)."""
        if isinstance(out, torch.Tensor):
            return out
        flat = [_rows(p) for p in self._parts(out)]
        self.widths = {h: int(p.shape[1]) for h, p in zip(self.heads, flat)}
        return torch.cat(flat, dim=1)

    def _parts(self, out: Any) -> list[torch.Tensor]:
        parts = list(out) if isinstance(out, (tuple, list)) else [t.output(out) for t in self.heads.values()]
        if len(parts) != len(self.heads):
            raise InputError(f"task: the model gives {len(parts)} outputs where the multi task has {len(self.heads)} heads "
                             f"({', '.join(self.heads)})", hint="name each head as a key of the model's output dict")
        return parts

    def export_output(self, out: Any) -> Any:
        """What an artifact outputs: each head's tensor as the model gives it, in the heads' order (named so by the
        export). Shapes come from the traced tensors, never from a Python length, so the batch axis stays dynamic."""
        if isinstance(out, torch.Tensor):
            return tuple(self.split(out).values())
        parts = self._parts(out)
        self.widths = {h: int(_rows(p).shape[1]) for h, p in zip(self.heads, parts)}
        return tuple(parts)

    def split(self, whole: torch.Tensor) -> dict[str, torch.Tensor]:
        """The concatenated heads back apart, each ``[B, width]``."""
        widths = self.widths or dict.fromkeys(self.heads, whole.shape[1] // len(self.heads))
        parts, start = {}, 0
        for head, width in widths.items():
            parts[head] = whole[:, start:start + width]
            start += width
        return parts

    def _target(self, head: str, y: torch.Tensor, index: int) -> torch.Tensor:
        column = y[:, index]
        dtype = self.target_dtypes.get(head)
        return column.long() if dtype is not None and np.issubdtype(dtype, np.integer) else column.float()

    def _each(self, out: Any, target: torch.Tensor):
        parts = self.split(self.output(out))
        return [(h, t, parts[h], self._target(h, target, i)) for i, (h, t) in enumerate(self.heads.items())]

    # ---------------------------------------------------------------- training

    def loss(self, out, target):
        return sum(self.weights[h] * t.loss(o, y) for h, t, o, y in self._each(out, target))

    def importance_loss(self, out, target):
        return sum(self.weights[h] * t.importance_loss(o, y) for h, t, o, y in self._each(out, target))

    def distill_loss(self, student, teacher, temperature):
        s, t = self.split(self.output(student)), self.split(self.output(teacher))
        return sum(self.weights[h] * task.distill_loss(s[h], t[h], temperature) for h, task in self.heads.items())

    def for_training(self, label_smoothing: float) -> Task:
        if not label_smoothing:
            return self
        trained = MultiTask(self.config)
        trained.heads = {h: t.for_training(label_smoothing) for h, t in self.heads.items()}
        trained.widths, trained.target_dtypes = self.widths, self.target_dtypes
        return trained

    # ---------------------------------------------------------------- metrics

    def update(self, state, output, target):
        for h, task, o, y in self._each(output, target):
            task.update(state.parts.setdefault(h, MetricState()), o, y)
        state.count += int(len(target))

    def compute(self, state):
        figures: dict[str, float] = {}
        for h, task in self.heads.items():
            computed = task.compute(state.parts.get(h, MetricState()))
            figures.update({f"{h}.{k}": v for k, v in computed.items() if k != "samples"})
        return figures | {"samples": state.count}

    def metric(self, name: str) -> Metric:
        """A head's figure by its ``HEAD.`` prefix anywhere in ``name`` (``onnx.int8.finish.auc``, ``click.auc_drop``)."""
        parts = name.split(".")
        for i in range(len(parts) - 2, -1, -1):
            if parts[i] in self.heads:
                found = self.heads[parts[i]].metric(".".join(parts[i + 1:]))
                return found if found.name == "drop" else _named(parts[i], found)
        return super().metric(name)

    def summary(self) -> dict[str, Any]:
        return super().summary() | {"heads": {h: t.summary() for h, t in self.heads.items()}, "weights": self.weights}

    def data_summary(self, data) -> str:
        return "; ".join(f"{h}: {t.data_summary(data) or t.name}" for h, t in self.heads.items())

    # ---------------------------------------------------------------- labels

    def read_targets(self, values, column):
        """``values``: each head's label column (``data.label_column: {head: column}``), read by the head's task;
        one float32 column a head."""
        if not isinstance(values, Mapping) or set(values) != set(self.heads):
            raise InputError("data.label_column must name one column a head for the multi task "
                             f"(heads: {', '.join(self.heads)}; got {column!r})",
                             hint="set data.label_column: {" + ", ".join(f"{h}: COLUMN" for h in self.heads) + "}")
        read = {h: t.read_targets(np.asarray(values[h]), f"{column[h]}") for h, t in self.heads.items()}
        self.target_dtypes = {h: v.dtype for h, v in read.items()}
        return np.stack([read[h].astype(np.float32) for h in self.heads], axis=1)

    def check_targets(self, targets, data, column):
        super().check_targets(targets, data, column)
        for i, (h, task) in enumerate(self.heads.items()):
            task.check_targets({r: self._target(h, y, i) for r, y in targets.items()}, data, _column(column, h))

    def check_output(self, output, targets, data, factory):
        parts = self.split(output)
        for i, (h, task) in enumerate(self.heads.items()):
            task.check_output(parts[h], self._target(h, targets, i), data, f"{factory} (head {h!r})")

    # ---------------------------------------------------------------- agreement between executors

    def agree(self, ref, got):
        a, b = output_rows(ref, got)
        ra, rb = self.split(torch.from_numpy(a)), self.split(torch.from_numpy(b))
        figures: dict[str, float] = {**closeness(a, b), "parity_samples": int(len(a))}
        heads = {h: task.agree(ra[h].numpy(), rb[h].numpy()) for h, task in self.heads.items()}
        for h, own in heads.items():
            figures.update({f"{h}.{k}": v for k, v in own.items() if k != "parity_samples"})
        figures["cosine"] = min(own["cosine"] for own in heads.values())
        name, worst = self.agreement.name, (min if self.agreement.higher_is_better else max)
        if name != "cosine" and all(name in own for own in heads.values()):  # the heads share one agreement figure
            figures[name] = worst(own[name] for own in heads.values())
        return figures


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[B, values]`` of a head's output (``[B]`` -> ``[B, 1]``), without reading the batch size as a number."""
    return t.unsqueeze(1) if t.dim() == 1 else t.flatten(1)


def _named(head: str, metric: Metric) -> Metric:
    return dataclasses.replace(metric, name=f"{head}.{metric.name}", label=f"{head} {metric.shown}")


def _column(column: Any, head: str) -> str:
    return str(column[head]) if isinstance(column, Mapping) and head in column else str(column)
