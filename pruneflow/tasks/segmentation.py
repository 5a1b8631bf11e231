"""`segmentation`: a class per pixel (a review model's masks), judged by mean IoU.

Outputs ``[B, C, H, W]`` class scores; labels ``[B, H, W]`` class ids 0..C-1, and ``ignore_index`` (default 255)
for pixels no class is claimed for. Pixel-wise cross-entropy; metrics ``miou`` (the headline: the intersection
over union of each class present, averaged), ``pixel_accuracy``; parity is the share of pixels whose class
agrees (``pixel_agreement``). Distillation matches the softened per-pixel class distributions.
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


class SegmentationConfig(TaskConfig):
    type: Literal["segmentation"] = Field(default="segmentation", description="A class per pixel (masks); judged by mean IoU.")
    ignore_index: int = Field(default=255, ge=0, description="Label of pixels that count for nothing (borders, unlabelled).")


class Segmentation(Task):
    Config = SegmentationConfig
    metrics = (Metric("miou", perfect=1.0, description="mean over classes of intersection over union"),
               Metric("pixel_accuracy", perfect=1.0, description="share of labelled pixels given their class"))
    headline_name = "miou"
    agreement = Metric("pixel_agreement", perfect=1.0, description="share of pixels with the same class", label="pixel agreement")
    agreement_limits = {"fp32": 0.999, "fp16": 0.99, "int8": 0.95, "bf16": 0.99}

    @property
    def _ignore(self) -> int:
        return self.config.ignore_index  # type: ignore[attr-defined]

    def loss(self, out, target):
        return F.cross_entropy(self.output(out), target, ignore_index=self._ignore)

    def distill_loss(self, student, teacher, temperature):
        t = temperature
        return F.kl_div(F.log_softmax(student / t, 1), F.log_softmax(teacher / t, 1), reduction="batchmean",
                        log_target=True) * (t * t) / (student[0, 0].numel() or 1)

    def update(self, state, output, target):
        classes = output.shape[1]
        predicted = output.detach().argmax(1).cpu()
        target = target.cpu()
        kept = target != self._ignore
        p, y = predicted[kept], target[kept]
        state.add(correct=int((p == y).sum()), pixels=int(kept.sum()))
        for c in range(classes):
            state.add(**{f"inter_{c}": int(((p == c) & (y == c)).sum()), f"union_{c}": int(((p == c) | (y == c)).sum())})
        state.count += int(target.shape[0])

    def compute(self, state):
        sums = state.sums
        unions = {k[len("union_"):]: v for k, v in sums.items() if k.startswith("union_") and v > 0}
        ious = [sums.get(f"inter_{c}", 0.0) / u for c, u in unions.items()]
        return {"miou": float(np.mean(ious)) if ious else float("nan"),
                "pixel_accuracy": sums.get("correct", 0.0) / max(sums.get("pixels", 0.0), 1.0), "samples": state.count}

    def read_targets(self, values, column):
        values = np.asarray(values)
        if values.ndim < 3 or values.dtype.kind not in "biu":
            raise InputError(f"data.label_column {column!r} must hold a mask of integer class ids per sample "
                             f"([N, H, W]; found {values.dtype} of shape {values.shape})",
                             hint="store masks as integer arrays, one class id per pixel")
        return values.astype(np.int64)

    def check_targets(self, targets, data, column):
        super().check_targets(targets, data, column)
        train = targets.get("train")
        if train is not None and len(torch.unique(train[train != self._ignore])) < 2:
            raise InputError(f"data.label_column {column!r}: every labelled pixel of the train split is one class: "
                             "a model that outputs it everywhere is perfect", hint="check the masks")

    def check_output(self, output, targets, data, factory):
        if output.dim() != 4 or tuple(output.shape[2:]) != tuple(targets.shape[1:]):
            raise InputError(
                f"the model from {factory!r} gives outputs of shape {tuple(output.shape)} for masks of shape "
                f"{tuple(targets.shape)}: the segmentation task reads class scores [B, C, H, W] at the mask's size",
                hint="upsample the output to the mask's size, or name the part to read with task.output")
        labelled = targets[targets != self._ignore]
        if len(labelled) and int(labelled.max()) >= output.shape[1]:
            raise InputError(f"the model from {factory!r} scores {output.shape[1]} classes but the masks hold class "
                             f"{int(labelled.max())}", hint="build the model with one output channel per class")

    def agree(self, ref, got):
        figures = super().agree(ref, got)
        figures["pixel_agreement"] = float((np.asarray(ref).argmax(1) == np.asarray(got).argmax(1)).mean())
        return figures
