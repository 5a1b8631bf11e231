"""``nn.EmbeddingBag`` in plain operators, for every ONNX export (``export_onnx``: float and INT8 alike).

Why by hand: torch's legacy ONNX exporter (the one ``export_onnx`` and the INT8 export use) refuses a bag with
``padding_idx`` ("embedding_bag with padding_idx"), and writes the others as a ``Loop`` over the bags; the dynamo
exporter writes a ``Loop`` of sequence ops too. OpenVINO cannot convert that ``Loop``, it is slow (9.5 ms at batch
32 for a 13k-MAC DLRM in onnxruntime) and it hides the table inside the loop's body, where
``export/embedding.py`` (the int8/int4 row-wise table storage) cannot find it (STACK-NOTES, measured 2026-12-05).

A fixed-length bag, ``ids [B, L]`` (torch's 2-D input form, the usual multi-hot field padded with
``padding_idx``), is instead::

    rows = weight[ids]                                   Gather: the table stays a top-level Gather initializer
    keep = ids != padding_idx                            (with padding_idx)
    rows = rows * per_sample_weights[..., None]          (mode sum, when given)
    sum:  (rows * keep).sum(1)
    mean: (rows * keep).sum(1) / max(keep.sum(1), 1)     the mean over the non-padding ids
    max:  max over the non-padding ids (-inf elsewhere)

and an all-padding bag gives zeros in every mode, as torch does. ``exportable_bags`` swaps every
``nn.EmbeddingBag`` of a copy of the model for :class:`FixedLengthBag`, which holds the very same ``weight``
Parameter (so a table that ``snap_embedding_tables`` put on the int8 row grid stays exactly on it).

torch's 1-D form (``input [N]`` + ``offsets [B]``, bags of varying length) has no static padded form: the padded
length is the longest bag of the batch, a property of the data. It is refused with an ExportError naming the
module (the fix: pass fixed-length 2-D bags); a static rewrite would need a ``[B, N]`` one-hot matrix, quadratic in
the batch size.

Quantized models: NNCF (``qat/``) names each op it hooks by the function called (``.../embedding_bag/0``) and may
hang an activation quantizer on a bag's output. ``embedding_bag`` below is dispatched through
``handle_torch_function`` under that same name, so NNCF's hooks still find the op and their quantizers still run
(and export as Q/DQ) on the rewritten bag, while the plain ops inside it are not renamed or counted by NNCF.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function

from ..errors import ExportError


class FixedLengthBag(nn.Module):
    """An ``nn.EmbeddingBag`` (sum, mean or max; ``padding_idx``; ``per_sample_weights``) for 2-D ``[B, L]`` bags,
    computed with a Gather, a mask and a reduction. ``weight`` is the bag's own Parameter, not a copy."""

    def __init__(self, bag: nn.EmbeddingBag, name: str):
        super().__init__()
        self.weight = bag.weight
        self.mode, self.padding_idx, self.name = bag.mode, bag.padding_idx, name
        self.num_embeddings, self.embedding_dim = bag.num_embeddings, bag.embedding_dim

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        if input.dim() != 2 or offsets is not None:
            raise ExportError(
                f"{self.name} (nn.EmbeddingBag) is called with {input.dim()}-D ids and offsets (bags of varying length): "
                "the padded form the export writes needs a fixed bag length, and that of a 1-D batch is its longest bag, "
                "known only from the data",
                hint=f"pass {self.name} fixed-length 2-D bags, ids [batch, length] padded with padding_idx "
                "(nn.EmbeddingBag(..., padding_idx=0)), instead of input + offsets")
        if per_sample_weights is not None and self.mode != "sum":
            raise ExportError(f"{self.name} (nn.EmbeddingBag, mode {self.mode}) is given per_sample_weights, "
                              "which torch takes in mode sum only", hint="use mode='sum' with per_sample_weights")
        return embedding_bag(input, self.weight, per_sample_weights, self.mode, self.padding_idx)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, mode={self.mode!r}, padding_idx={self.padding_idx}"


def embedding_bag(ids: torch.Tensor, weight: torch.Tensor, per_sample_weights: torch.Tensor | None, mode: str,
                  padding_idx: int | None) -> torch.Tensor:
    """``F.embedding_bag`` of 2-D ``ids`` in plain ops (see the module's doc). Named ``embedding_bag`` and dispatched
    through ``handle_torch_function`` so that a TorchFunctionMode (NNCF's hooks) sees one ``embedding_bag`` op."""
    tensors = (ids, weight) if per_sample_weights is None else (ids, weight, per_sample_weights)
    if has_torch_function(tensors):
        return handle_torch_function(embedding_bag, tensors, ids, weight, per_sample_weights, mode, padding_idx)
    rows = F.embedding(ids, weight)  # Gather(weight, ids), axis 0: what export/embedding.py stores row-wise
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(-1).to(rows.dtype)
    if padding_idx is None:
        return rows.sum(1) if mode == "sum" else rows.mean(1) if mode == "mean" else rows.amax(1)
    keep = (ids != padding_idx).unsqueeze(-1)  # [B, L, 1]
    count = keep.to(rows.dtype).sum(1)  # [B, 1]
    if mode == "max":
        top = rows.masked_fill(~keep, float("-inf")).amax(1)
        return torch.where(count > 0, top, 0.0)  # an all-padding bag: zeros, as torch gives
    total = (rows * keep.to(rows.dtype)).sum(1)
    return total if mode == "sum" else total / count.clamp(min=1.0)


def swap_bags(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """``model`` with every ``nn.EmbeddingBag`` replaced (in place) by a :class:`FixedLengthBag` on the same weight,
    and one note a bag (the model itself is replaced when it is a bag). A bag with ``max_norm`` (torch
    renormalises the rows it reads, in place, at every lookup) is refused with an ExportError."""
    notes = []
    for name, bag in [(n, m) for n, m in model.named_modules() if isinstance(m, nn.EmbeddingBag)]:
        if bag.max_norm is not None:
            raise ExportError(f"{name or 'the model'} (nn.EmbeddingBag) has max_norm={bag.max_norm}: torch renormalises "
                              "the rows it reads in place at each lookup, which an exported graph does not do",
                              hint="renormalise the table once and set max_norm=None before exporting")
        fixed = FixedLengthBag(bag, name or "the model")
        if not name:
            return fixed, [_note("the model", bag)]
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, fixed)
        notes.append(_note(name, bag))
    return model, notes


def _note(name: str, bag: nn.EmbeddingBag) -> str:
    return (f"{name} (nn.EmbeddingBag {bag.num_embeddings}x{bag.embedding_dim}, mode {bag.mode}, padding_idx "
            f"{bag.padding_idx}) exported as a Gather, a mask and a reduction over fixed-length 2-D bags")


def export_error_in(exc: BaseException) -> ExportError | None:
    """The ExportError a module of ours raised while an exporter traced it (``FixedLengthBag`` given offsets), found
    in ``exc``'s chain of causes: the dynamo exporter wraps what the traced code raises in its own errors."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ExportError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def exportable_bags(model: nn.Module) -> tuple[nn.Module, list[str]]:
    """A deep copy of ``model`` with its ``nn.EmbeddingBag`` modules swapped (``swap_bags``), and the notes; the
    model itself when it has none (nothing to copy)."""
    if not any(isinstance(m, nn.EmbeddingBag) for m in model.modules()):
        return model, []
    return swap_bags(copy.deepcopy(model))
