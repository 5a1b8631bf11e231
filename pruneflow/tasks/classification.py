"""`classification`: one class per sample, class ids 0..K-1, one logit per class; judged by accuracy."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from ..config import TaskConfig
from ..errors import InputError
from .base import Metric, Task, closeness, output_rows

class ClassificationConfig(TaskConfig):
    type: Literal["classification"] = Field(default="classification", description="One class per sample (class ids 0..K-1); "
                                            "judged by accuracy.")


class Classification(Task):
    """Class ids 0..K-1, one logit per class: cross-entropy; accuracy (top-1), the headline, and loss;
    parity is top-1 agreement; distillation matches the softened class distributions (Hinton et al. 2015)."""

    Config = ClassificationConfig
    metrics = (Metric("accuracy", perfect=1.0, description="share of samples whose top-1 class is the label"),
               Metric("loss", higher_is_better=False, description="mean cross-entropy"))
    headline_name = "accuracy"
    agreement = Metric("top1_agreement", perfect=1.0, description="share of samples with the same top-1 class",
                       label="top-1 agreement")
    agreement_limits = {"fp32": 0.99, "fp16": 0.98, "int8": 0.95, "bf16": 0.98}
    stratify = True

    def __init__(self, config: TaskConfig | None = None, label_smoothing: float = 0.0):
        super().__init__(config)
        self.label_smoothing = label_smoothing

    def loss(self, out, target):
        return F.cross_entropy(self.output(out), target, label_smoothing=self.label_smoothing)

    def for_training(self, label_smoothing: float) -> Task:
        if not label_smoothing:
            return self
        return Classification(self.config, label_smoothing)

    def distill_loss(self, student, teacher, temperature):
        """KL(teacher_T || student_T) × T², so gradients keep their scale across temperatures."""
        t = temperature
        return F.kl_div(F.log_softmax(student / t, -1), F.log_softmax(teacher / t, -1),
                        reduction="batchmean", log_target=True) * (t * t)

    def update(self, state, output, target):
        logits = output.detach().float()
        state.add(correct=int((logits.argmax(-1) == target).sum()),
                  loss=float(F.cross_entropy(logits, target, reduction="sum")))
        state.count += int(target.numel())

    def compute(self, state):
        n = max(state.count, 1)
        return {"accuracy": state.sums.get("correct", 0.0) / n, "loss": state.sums.get("loss", 0.0) / n, "samples": state.count}

    def data_summary(self, data):
        return f"{data.num_classes} classes"

    def read_targets(self, values, column):
        if not np.issubdtype(values.dtype, np.integer) or (len(values) and values.min() < 0):
            raise InputError(
                f"data.label_column {column!r} must hold integer class ids 0..K-1 (found {values.dtype})",
                hint="map class names to ids first, or use imagefolder, which does it; a continuous target "
                "needs another task (`task: {type: NAME}`)",
            )
        return values.astype(np.int64)

    def check_targets(self, targets, data, column):
        """Every label of every split must be a class id below the data's class count (the number of class
        names when given)."""
        super().check_targets(targets, data, column)
        train = targets.get("train")
        if train is not None and len(torch.unique(train)) < 2:
            raise InputError(
                f"data.label_column {column!r}: every label of the train split is {int(train[0])}: a classifier trained "
                "on one class learns nothing, and its accuracy would mean nothing",
                hint="check the label column and the split (a file sorted by label and cut by max_train_samples?)")
        num_classes, class_names = data.num_classes, data.class_names
        for role, y in targets.items():
            top = int(y.max())
            if top >= num_classes:
                named = f"{len(class_names)} class names" if class_names else f"{num_classes} classes"
                raise InputError(
                    f"data.label_column {column!r}: the {role} split has label {top} "
                    f"({int((y >= num_classes).sum())} samples at or above {num_classes}), but the data gives {named} "
                    f"(ids 0..{num_classes - 1})",
                    hint="list one class name per label id (class_names in the npz, or a ClassLabel feature), or fix the labels",
                )

    def check_output(self, output, targets, data, factory):
        if output.dim() == 2 and output.shape[1] < data.num_classes:
            raise InputError(
                f"the model from {factory!r} gives {output.shape[1]} outputs a sample but the data has {data.num_classes} classes",
                hint="build the model with one output per class (model.kwargs, e.g. num_classes), or fix the labels",
            )

    def agree(self, ref, got):
        a, b = output_rows(ref, got)
        return {**closeness(a, b), "top1_agreement": float((a.argmax(1) == b.argmax(1)).mean()), "parity_samples": int(len(a))}
