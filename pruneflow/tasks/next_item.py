"""`next_item`: a score for every item of a catalogue, judged by where the item that really came next ranks.

Sequential recommenders (SASRec, GRU4Rec) and retrieval models score the whole catalogue (``[B, items]``); the
label is the true next item's id. Metrics, over the whole catalogue (no sampled negatives, which overstate a
model's quality and reorder models, Krichene & Rendle 2020):

- ``hr`` (HR@k): the share of samples whose true item is among the k best scores;
- ``ndcg`` (NDCG@k): ``1 / log2(rank + 2)`` when the true item's 0-based rank is below k, else 0;
- ``mrr``: ``1 / (rank + 1)``, untruncated;
- ``loss``: the full-softmax cross-entropy the model trains with.

A rank counts the items scoring strictly above the true one, plus half of those tied with it (so a constant
model ranks every item in the middle, not first). Each batch's ranks are computed as it comes, so no
``[samples, items]`` matrix is ever held. The headline is the owner's choice (``headline: ndcg`` by default).

Parity between two executors is the share of the k best items they share (``topk_overlap``), per sample, averaged:
what a user would see change, where a cosine over 20,000 scores hides a reordered top. Distillation matches the
softened score distributions, as for classification.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from ..config import TaskConfig
from ..errors import InputError
from .base import Metric, Task, closeness, output_rows


class NextItemConfig(TaskConfig):
    type: Literal["next_item"] = Field(default="next_item", description="A score for every catalogue item (`[B, items]`), "
                                       "label = the true next item's id; judged by HR@k, NDCG@k and MRR over the whole catalogue.")
    k: int = Field(default=10, ge=1, le=1000, description="The cut-off of HR@k, NDCG@k and of the top-k agreement.")
    headline: Literal["hr", "ndcg", "mrr"] = Field(default="ndcg", description="The figure tables, logs and default gates show.")


def true_ranks(scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each sample's 0-based rank of its true item among all items (ties count half), float64."""
    true = scores.gather(1, target.view(-1, 1))
    above = (scores > true).sum(1).double()
    tied = (scores == true).sum(1).double() - 1
    return above + 0.5 * tied


def topk_overlap(ref: np.ndarray, got: np.ndarray, k: int) -> float:
    """The mean share of each sample's k best items that both score arrays put there."""
    k = min(k, ref.shape[1])
    a = np.argpartition(-ref, k - 1, axis=1)[:, :k]
    b = np.argpartition(-got, k - 1, axis=1)[:, :k]
    shared = [len(np.intersect1d(x, y, assume_unique=True)) for x, y in zip(a, b)]
    return float(np.mean(shared) / k) if shared else 1.0


class NextItem(Task):
    Config = NextItemConfig
    metrics = (Metric("hr", perfect=1.0, label="HR@k", description="share of samples whose true item is in the top k"),
               Metric("ndcg", perfect=1.0, label="NDCG@k", description="1/log2(rank+2) of the true item within the top k"),
               Metric("mrr", perfect=1.0, label="MRR", description="mean reciprocal rank of the true item"),
               Metric("loss", higher_is_better=False, description="mean full-softmax cross-entropy"))
    headline_name = "ndcg"
    agreement = Metric("topk_overlap", perfect=1.0, label="top-k overlap",
                       description="mean share of the k best items both executors agree on")
    agreement_limits = {"fp32": 0.99, "fp16": 0.95, "int8": 0.8, "bf16": 0.9}
    default_output_name = "scores"

    def __init__(self, config: TaskConfig | None = None):
        super().__init__(config)
        self.k = int(getattr(self.config, "k", 10))
        self.headline_name = str(getattr(self.config, "headline", "ndcg"))  # type: ignore[misc]  # the owner's choice

    def loss(self, out, target):
        return F.cross_entropy(self.output(out).float(), target)

    def distill_loss(self, student, teacher, temperature):
        t = temperature
        return F.kl_div(F.log_softmax(student.float() / t, -1), F.log_softmax(teacher.float() / t, -1),
                        reduction="batchmean", log_target=True) * (t * t)

    def update(self, state, output, target):
        scores = output.detach().float().cpu()
        y = target.detach().long().cpu()
        rank = true_ranks(scores, y)
        inside = rank < self.k
        state.add(hr=float(inside.sum()), ndcg=float((inside / torch.log2(rank + 2)).sum()),
                  mrr=float((1.0 / (rank + 1)).sum()), loss=float(F.cross_entropy(scores, y, reduction="sum")))
        state.count += int(y.numel())

    def compute(self, state):
        n = max(state.count, 1)
        return {name: state.sums.get(name, 0.0) / n for name in ("hr", "ndcg", "mrr", "loss")} | {"samples": state.count}

    def describe(self, figures):
        value = figures.get(self.headline_name)
        shown = self.headline.shown.replace("@k", f"@{self.k}")
        return f"{shown} {value:.4f}" if isinstance(value, (int, float)) else f"{shown} –"

    def data_summary(self, data):
        return f"labels are item ids (up to {data.num_classes - 1})"

    def read_targets(self, values, column):
        flat = np.asarray(values)
        if flat.ndim != 1 or not np.issubdtype(flat.dtype, np.integer) or (len(flat) and flat.min() < 0):
            raise InputError(f"data.label_column {column!r} must hold one integer item id a sample for the next_item task "
                             f"(found {flat.dtype}, shape {flat.shape[1:]})",
                             hint="map items to ids 1..N-1 (0 is the padding row of a sequence model's table)")
        return flat.astype(np.int64)

    def check_output(self, output, targets, data, factory):
        top = int(targets.max()) if len(targets) else 0
        if output.dim() != 2 or output.shape[1] <= top:
            raise InputError(
                f"the model from {factory!r} gives outputs of shape {tuple(output.shape)}, but the next_item task reads one "
                f"score per catalogue item ([B, items]) and the labels go up to item {top}",
                hint="build the model with num_items above the largest item id (model.kwargs), or name the part to read "
                "with task.output")

    def agree(self, ref, got):
        a, b = output_rows(ref, got)
        return {**closeness(a, b), "topk_overlap": topk_overlap(a, b, self.k), "parity_samples": int(len(a))}
