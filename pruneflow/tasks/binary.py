"""`binary`: a yes/no per sample (a click, a conversion, a fraud flag), judged as a ranker's owner judges it.

One logit a sample (shape ``[B]`` or ``[B, 1]``), or two class scores (``[B, 2]``: the logit is their
difference, what a softmax over them means). Labels are 0/1. Binary cross-entropy; metrics: ``auc`` (the
headline: how well clicks rank above non-clicks), ``log_loss``, ``calibration_error`` (expected calibration
error over equal-width probability bins), ``pctr_error`` (|mean predicted probability − observed positive
rate|: a model whose AUC holds while its predicted CTR drifts bids wrongly), ``accuracy`` (at probability 0.5);
``compute`` also reports ``mean_pctr`` and ``positive_rate``. Parity between torch and an artifact is the mean
absolute difference of their predicted probabilities. Distillation matches the teacher's probabilities (the
Bernoulli KL at temperature T).

AUC is computed here from ranks (ties share their mean rank, the Mann-Whitney U statistic), not taken from
scikit-learn: numpy alone, and the whole eval split at once.
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


class BinaryConfig(TaskConfig):
    type: Literal["binary"] = Field(default="binary", description="A yes/no per sample (a click): one logit, or two class "
                                    "scores; labels 0/1; judged by AUC, log loss, calibration and the mean predicted rate.")
    bins: int = Field(default=10, ge=2, le=1000, description="Equal-width probability bins of `calibration_error`.")
    positive: str | None = Field(
        default=None, min_length=1,
        description="The label value that counts as 1 when the label column holds text (e.g. `\">50K\"`, `click`); every "
        "other value counts as 0. Surrounding spaces are ignored. Not needed for 0/1 labels.")


def logit(output: torch.Tensor) -> torch.Tensor:
    """The log-odds a binary model's output stands for: its one logit, or class 1's score minus class 0's."""
    if output.dim() >= 2 and output.shape[-1] == 2:
        return output[..., 1] - output[..., 0]
    return output.reshape(len(output))


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """The probability that a random positive scores above a random negative (ties count half)."""
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    sorted_scores = scores[order]
    # average ranks over ties
    starts = np.r_[0, np.flatnonzero(np.diff(sorted_scores)) + 1]
    ends = np.r_[starts[1:], len(scores)]
    for s, e in zip(starts, ends):
        ranks[order[s:e]] = (s + e + 1) / 2.0
    positives = labels > 0.5
    n_pos, n_neg = int(positives.sum()), int((~positives).sum())
    if not n_pos or not n_neg:
        return float("nan")
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def calibration_error(probs: np.ndarray, labels: np.ndarray, bins: int) -> float:
    """Expected calibration error: the sample-weighted mean |mean prediction − positive rate| over equal-width bins."""
    which = np.minimum((probs * bins).astype(np.int64), bins - 1)
    total = 0.0
    for b in np.unique(which):
        inside = which == b
        total += inside.sum() * abs(float(probs[inside].mean()) - float(labels[inside].mean()))
    return total / max(len(probs), 1)


class Binary(Task):
    Config = BinaryConfig
    metrics = (
        Metric("auc", perfect=1.0, description="area under the ROC curve"),
        Metric("log_loss", higher_is_better=False, perfect=0.0, description="mean binary cross-entropy"),
        Metric("calibration_error", higher_is_better=False, perfect=0.0, description="expected calibration error"),
        Metric("pctr_error", higher_is_better=False, perfect=0.0,
               description="|mean predicted probability − observed positive rate|"),
        Metric("accuracy", perfect=1.0, description="share of samples on the right side of probability 0.5"),
    )
    headline_name = "auc"
    agreement = Metric("probability_diff", higher_is_better=False, perfect=0.0, label="mean |Δp|",
                       description="mean absolute difference of the predicted probabilities")
    agreement_limits = {"fp32": 1e-4, "fp16": 2e-3, "int8": 0.01, "bf16": 5e-3}
    stratify = True  # 0/1 labels split and subsample like two classes
    figures = ("mean_pctr", "positive_rate")
    default_output_name = "logit"

    def loss(self, out, target):
        return F.binary_cross_entropy_with_logits(logit(self.output(out)).float(), target.float())

    def distill_loss(self, student, teacher, temperature):
        """The Bernoulli KL(teacher_T || student_T) × T² between the softened click probabilities."""
        s, t = logit(student).float() / temperature, logit(teacher).float() / temperature
        p = torch.sigmoid(t)
        kl = p * (F.logsigmoid(t) - F.logsigmoid(s)) + (1 - p) * (F.logsigmoid(-t) - F.logsigmoid(-s))
        return kl.mean() * temperature * temperature

    def update(self, state, output, target):
        z = logit(output.detach().float()).cpu()
        y = target.detach().float().cpu()
        state.add(log_loss=float(F.binary_cross_entropy_with_logits(z, y, reduction="sum")),
                  correct=float(((z > 0).float() == y).sum()))
        state.count += int(y.numel())
        state.outputs.append(z)
        state.targets.append(y)

    def compute(self, state):
        n = max(state.count, 1)
        z = torch.cat(state.outputs).numpy().astype(np.float64) if state.outputs else np.zeros(0)
        y = torch.cat(state.targets).numpy().astype(np.float64) if state.targets else np.zeros(0)
        p = 1.0 / (1.0 + np.exp(-z))
        mean_pctr, rate = (float(p.mean()), float(y.mean())) if len(p) else (float("nan"), float("nan"))
        return {"auc": auc(z, y), "log_loss": state.sums.get("log_loss", 0.0) / n,
                "calibration_error": calibration_error(p, y, self.config.bins) if len(p) else float("nan"),
                "pctr_error": abs(mean_pctr - rate), "accuracy": state.sums.get("correct", 0.0) / n,
                "mean_pctr": mean_pctr, "positive_rate": rate, "samples": state.count}

    def read_targets(self, values, column):
        flat = np.asarray(values).reshape(len(values))
        if flat.dtype.kind in "OUS":
            return self._text_targets(flat, column)
        if flat.dtype.kind not in "biuf" or not np.isin(flat, (0, 1)).all():
            shown = ", ".join(map(str, np.unique(flat)[:5]))
            raise InputError(f"data.label_column {column!r} must hold 0/1 labels for the binary task (found {shown})",
                             hint="map the positive outcome (a click) to 1 and every other to 0")
        return flat.astype(np.float32)

    def _text_targets(self, flat: np.ndarray, column: str) -> np.ndarray:
        """Text labels (``<=50K``/``>50K``, ``click``/``no``): 1 where the value is ``positive``, else 0."""
        text = np.char.strip(flat.astype(str))
        found = ", ".join(repr(str(v)) for v in np.unique(text)[:5])
        positive = self.config.positive  # type: ignore[attr-defined]  # a BinaryConfig
        if positive is None:
            raise InputError(f"data.label_column {column!r} holds text ({found}): the binary task needs to know which "
                             "value is the positive outcome",
                             hint="set task: {type: binary, positive: VALUE}, VALUE being one of those")
        positive = positive.strip()
        if not (text == positive).any():
            raise InputError(f"task.positive {positive!r} never occurs in data.label_column {column!r} (values: {found})",
                             hint="set task.positive to the value that marks a positive (a click)")
        return (text == positive).astype(np.float32)

    def check_targets(self, targets, data, column):
        """0/1 labels with both outcomes in every split: AUC and log loss of a constant label mean nothing."""
        super().check_targets(targets, data, column)
        for role, y in targets.items():
            values = torch.unique(y)
            if len(values) < 2:
                raise InputError(
                    f"data.label_column {column!r}: every label of the {role} split is {float(values[0]):g}: AUC is "
                    "undefined and a model that always predicts it is perfect",
                    hint="check the label column and the split (a file sorted by label and cut by max_*_samples?)",
                )

    def check_output(self, output, targets, data, factory):
        if output.dim() > 2 or (output.dim() == 2 and output.shape[1] not in (1, 2)):
            raise InputError(
                f"the model from {factory!r} gives outputs of shape {tuple(output.shape)}: the binary task reads one logit "
                "a sample ([B] or [B, 1]) or two class scores ([B, 2])",
                hint="end the model in a Linear with one output (or two), or name the part to read with task.output",
            )

    def agree(self, ref, got):
        figures = super().agree(ref, got)
        p = 1.0 / (1.0 + np.exp(-logit(torch.from_numpy(np.asarray(ref, dtype=np.float64))).numpy()))
        q = 1.0 / (1.0 + np.exp(-logit(torch.from_numpy(np.asarray(got, dtype=np.float64))).numpy()))
        figures["probability_diff"] = float(np.abs(p - q).mean()) if len(p) else 0.0
        return figures
