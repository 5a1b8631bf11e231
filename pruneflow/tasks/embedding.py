"""`embedding`: a vector per sample (a sentence encoder, a two-tower user tower), judged against the vectors the
model gave before any stage changed it.

What an embedding model's owner asks of a pruned or quantized copy is that it still puts every row where the
original put it, and that retrieval over those vectors still returns the same neighbours. There is no label to
hold that: the targets are the reference model's own outputs (``targets_from_model``), computed once over every
split by ``prepare.load_inputs`` from the model the recipe gives (its checkpoint or pretrained folder), before any
stage runs; the data needs no label column (one that is there is ignored).

Outputs ``[B, D]``. Metrics: ``ref_cosine`` (the headline: each row's cosine to its reference vector, averaged),
``recall@k`` (for every eval row, the share of its k nearest neighbours among the other eval rows, by cosine, that
are also its k nearest by the reference vectors, averaged; ``k`` in the task's config), ``mse`` (squared distance
to the reference vector per value: where the length of a vector carries meaning too). The headline is not called
``cosine``: every artifact already records a ``cosine``, its parity against the torch model it came from, and the
two would overwrite each other in ``onnx.int8.*``. Training and distillation pull the vectors to the reference's or
the teacher's (``loss: cosine``, 1 − cos, by default; ``mse``). Parity between executors is the worst row's cosine
(``worst_cosine``, beside the mean ``cosine`` every task records): one broken row (a long input overflowing
somewhere) hides in a mean over hundreds.

A reference that gives one vector for every row is refused before anything is written: any model that outputs it
would be perfect, and nearest neighbours would mean nothing. A model under evaluation that gives one vector for
every row retrieves nothing: its ``recall@k`` is 0.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from ..config import TaskConfig
from ..errors import InputError
from .base import Metric, Task, closeness, output_rows


class EmbeddingConfig(TaskConfig):
    type: Literal["embedding"] = Field(
        default="embedding", description="A vector per sample (a sentence or user embedding), judged against the vectors of "
        "the model the recipe gives, computed before any stage: mean cosine to them, and recall@k of each eval row's "
        "nearest neighbours. The data needs no label column (one that is there is ignored).")
    k: int = Field(default=10, ge=1, le=1000, description="Neighbours of `recall@k` (the metric is named after it: `recall@10`); "
                   "at most the eval rows less one are counted.")
    loss: Literal["cosine", "mse"] = Field(
        default="cosine", description="Training and distillation loss against the reference's (or the teacher's) vectors: "
        "`cosine` (1 − cos: direction only, what cosine retrieval reads) or `mse` (the vector itself, length included).")


#: recall@k compares every pair of eval rows: above this many rows it is measured on evenly spaced rows of the split
#: (10,000² similarities a side, about a second), so prune rounds and sensitivity scans stay fast on large eval sets.
RECALL_ROWS = 10_000
#: Rows of the similarity matrix computed at once (memory: this x rows floats a side).
CHUNK = 1024
#: The importance probe's noise, as a share of the reference vector's RMS value (``Embedding.importance_loss``).
PROBE_SCALE = 0.1


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Each row's cosine between ``a`` and ``b`` ([N, D]); 0 for a row of zeros."""
    return F.cosine_similarity(a.float(), b.float(), dim=-1, eps=1e-12)


def constant_rows(vectors: np.ndarray) -> bool:
    """True when every row is the same vector (up to float rounding relative to their size)."""
    scale = float(np.abs(vectors).max()) if vectors.size else 0.0
    return len(vectors) > 1 and float(np.ptp(vectors, axis=0).max()) <= 1e-6 * max(scale, 1e-30)


def _nearest(unit: np.ndarray, rows: slice, k: int) -> np.ndarray:
    """Indices of the k rows nearest by cosine to each of ``rows`` (``unit``: L2-normalised rows), itself excluded."""
    sims = unit[rows] @ unit.T
    sims[np.arange(sims.shape[0]), np.arange(rows.start, rows.start + sims.shape[0])] = -np.inf
    return np.argpartition(-sims, k - 1, axis=1)[:, :k]


def recall_at_k(got: np.ndarray, ref: np.ndarray, k: int) -> float:
    """Mean over rows of |k nearest by ``got`` ∩ k nearest by ``ref``| / k (cosine, a row never its own
    neighbour; ``k`` capped at rows − 1). NaN with fewer than 2 rows; 0 when ``got`` gives one vector for every row."""
    if len(got) > RECALL_ROWS:
        keep = np.linspace(0, len(got) - 1, RECALL_ROWS).round().astype(np.int64)
        got, ref = got[keep], ref[keep]
    n = len(got)
    if n < 2:
        return float("nan")
    if constant_rows(got):
        return 0.0
    k = min(k, n - 1)
    unit_got, unit_ref = (v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12) for v in (got, ref))
    hits = 0
    for start in range(0, n, CHUNK):
        rows = slice(start, min(start + CHUNK, n))
        mine, theirs = _nearest(unit_got, rows, k), _nearest(unit_ref, rows, k)
        member = np.zeros((len(mine), n), dtype=bool)
        member[np.arange(len(mine))[:, None], theirs] = True
        hits += int(member[np.arange(len(mine))[:, None], mine].sum())
    return hits / (n * k)


def _probe(target: torch.Tensor) -> torch.Tensor:
    """A ±1 vector per row, drawn by hashing the row's own values: deterministic, different for every row, and,
    unlike torch's generator, allowed inside ``torch.func.vmap`` (the channels' per-sample Fisher runs the loss
    there). The row's sum enters too, so zeros in a row still draw different signs in different rows."""
    position = torch.arange(target.shape[-1], device=target.device, dtype=torch.float32)
    salt = target.float().sum(-1, keepdim=True)
    return torch.sign(torch.sin(target.float() * 9973.0 + salt * 7919.0 + position * 1.6180339) + 1e-12)


class Embedding(Task):
    Config = EmbeddingConfig
    metrics = (
        Metric("ref_cosine", perfect=1.0, description="mean cosine of each row's vector to the reference model's"),
        Metric("recall@10", perfect=1.0, description="share of each eval row's 10 nearest neighbours (cosine) that are "
               "also its 10 nearest by the reference vectors"),
        Metric("mse", higher_is_better=False, perfect=0.0, description="mean squared difference to the reference vectors"),
    )
    headline_name = "ref_cosine"
    default_output_name = "embedding"
    agreement = Metric("worst_cosine", perfect=1.0, label="worst-row cosine",
                       description="the lowest cosine between two executors' vectors of one row")
    # Worst rows, not means: fp32 runtimes round differently by ~1e-7; fp16 and bf16 keep 3 digits; an INT8 artifact
    # against the quantized torch model it came from differs where a runtime rounds a level differently.
    agreement_limits = {"fp32": 0.9999, "fp16": 0.999, "int8": 0.98, "bf16": 0.998}
    targets_from_model = True

    def __init__(self, config: TaskConfig | None = None):
        super().__init__(config)
        k = self._k
        recall = Metric(f"recall@{k}", perfect=1.0, description=f"share of each eval row's {k} nearest neighbours "
                        f"(cosine) that are also its {k} nearest by the reference vectors")
        # The recall figure is named after this instance's k; the class keeps recall@10 for the reference docs.
        self.metrics = (Embedding.metrics[0], recall, Embedding.metrics[2])  # type: ignore[misc]

    @property
    def _k(self) -> int:
        return self.config.k  # type: ignore[attr-defined]

    def _distance(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.config.loss == "mse":  # type: ignore[attr-defined]
            return F.mse_loss(a.float(), b.float())
        return (1.0 - cosines(a, b)).mean()

    def loss(self, out, target):
        return self._distance(self.output(out), target)

    def distill_loss(self, student, teacher, temperature):
        """The same distance between the student's vectors and the teacher's (no temperature: nothing to soften)."""
        return self._distance(student, teacher)

    def importance_loss(self, out, target):
        """The Fisher of a Gaussian around the reference vectors, with targets drawn from it (the "true" Fisher).

        At the unpruned model every vector equals its target, so the training loss and every gradient are zero and
        Taylor or Hessian scores would rank nothing. With the target moved by ``σ·u`` (``u`` a ±1 probe per row,
        ``σ`` a tenth of the row's RMS value), a row's gradient is ``Jᵀ(f − y)/σ² − Jᵀu/σ``: its square, averaged
        over rows, is ``diag(JᵀJ)/σ²`` at the reference (Hutchinson's estimate of the Gauss-Newton diagonal, which is
        OBD's Hessian of the squared error there), plus the empirical Fisher of whatever error pruning has left. A
        removed block's measured increase is ``‖Δ‖²/2σ²`` less a zero-mean term of order ``‖Δ‖/σ``."""
        f = self.output(out).float()
        y = target.float()
        sigma = PROBE_SCALE * y.pow(2).mean(-1, keepdim=True).sqrt().clamp_min(1e-12)
        return 0.5 * ((f - y - sigma * _probe(y)) / sigma).pow(2).sum(-1).mean()

    def update(self, state, output, target):
        got, ref = output.detach().float().cpu(), target.detach().float().cpu()
        state.add(cosine=float(cosines(got, ref).sum()), squared=float((got - ref).pow(2).sum()), values=float(got.numel()))
        state.count += len(got)
        state.outputs.append(got)
        state.targets.append(ref)

    def compute(self, state):
        sums, n = state.sums, max(state.count, 1)
        if state.outputs:
            got, ref = torch.cat(state.outputs).numpy(), torch.cat(state.targets).numpy()
            recall = recall_at_k(got, ref, self._k)
        else:
            recall = float("nan")
        return {"ref_cosine": sums.get("cosine", 0.0) / n, f"recall@{self._k}": recall,
                "mse": sums.get("squared", 0.0) / max(sums.get("values", 0.0), 1.0), "samples": state.count}

    def data_summary(self, data):
        width = data.eval.y.shape[1] if data.eval.y.dim() == 2 else 0
        return f"{width}-dim reference vectors" if width else ""

    def read_targets(self, values, column):
        """Placeholders: the label column means nothing to this task, its targets come from the reference model."""
        return np.zeros(len(values), dtype=np.float32)

    def check_output(self, output, targets, data, factory):
        problem = None
        if output.dim() != 2:
            problem = "the embedding task reads one vector a sample ([B, D])"
        elif not output.is_floating_point():
            problem = f"the embedding task reads float vectors, not {output.dtype}"
        elif output.shape[1] <= 2:
            problem = "one or two values a sample is a logit or class scores, not an embedding"
        if problem:
            raise InputError(f"the model from {factory!r} gives outputs of shape {tuple(output.shape)}: {problem}",
                             hint="pool the token or feature vectors into one vector a sample (the zoo's bert_embedder "
                             "mean-pools over the attention mask), or name the part to read with task.output")

    def reference_targets(self, outputs, role, factory):
        """The reference vectors, refused where they hold NaN, a row of zeros, or one vector for every row."""
        values = outputs.detach().float().cpu()
        rows = values.numpy()
        bad = int((~np.isfinite(rows)).any(1).sum())
        zero = int((np.abs(rows).max(1) == 0).sum()) if rows.size else 0
        why = (f"{bad} of its {len(rows)} vectors hold NaN or infinities" if bad
               else f"{zero} of its {len(rows)} vectors are all zeros (their cosine to anything is undefined)" if zero
               else f"it gives the same vector for all {len(rows)} rows: any model giving that vector would match it "
               "perfectly and nearest neighbours would mean nothing" if constant_rows(rows) else None)
        if why:
            raise InputError(f"the reference model from {factory!r} on the {role} split: {why}",
                             hint="load its trained weights (model.checkpoint, or kwargs.folder), and check that its "
                             "pooling reads the attention mask")
        return values.contiguous()

    def agree(self, ref, got):
        a, b = output_rows(ref, got)
        rows = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)
        return {**closeness(a, b), "worst_cosine": float(rows.min()) if len(rows) else 1.0, "parity_samples": int(len(a))}

    def describe(self, figures):
        recall = figures.get(f"recall@{self._k}")
        shown = f", recall@{self._k} {recall:.4f}" if isinstance(recall, float) and not math.isnan(recall) else ""
        return super().describe(figures) + shown
