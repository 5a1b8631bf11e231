"""What a model input batch is: one tensor, or an ordered mapping of forward's parameter names to tensors.

Every place that feeds a model (training, evaluation, pruning, calibration, quantization, export, the
runtimes) goes through these helpers, so a model with one input (named ``input`` in its artifacts, as
always) and a model with several (``input_ids``/``attention_mask``, or an image and a metadata vector)
take the same path::

    call(model, {"input_ids": ids, "attention_mask": mask})   # model(input_ids=ids, attention_mask=mask)
    feed(take(batch, slice(0, 8)), ["input_ids", "attention_mask"])   # numpy feed for onnxruntime/OpenVINO

Text batches are padded dynamically: ``trim`` cuts every token tensor of a batch to its longest row
(by ``attention_mask``). Nothing here exists in torch, onnxruntime or OpenVINO as such: torch-pruning
and NNCF accept a dict of keyword inputs, which is the form kept here.
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Union

import numpy as np
import torch
from torch import nn

#: One batch of model inputs: a tensor, or forward's parameter names mapped to tensors (insertion order kept).
Inputs = Union[torch.Tensor, dict[str, torch.Tensor]]

#: The name a single-input model's input has in every artifact.
SINGLE_NAME = "input"
#: The mask that ``trim`` and ``lengths`` read.
MASK = "attention_mask"


def names(batch: Inputs) -> list[str]:
    """The input names an artifact of a model fed ``batch`` has: ``["input"]`` for one tensor."""
    return [SINGLE_NAME] if isinstance(batch, torch.Tensor) else list(batch)


def forward_names(model: nn.Module) -> list[str] | None:
    """The names of forward's parameters (None when it takes ``**kwargs`` or cannot be read); a wrapper that
    reads a part of a model's output (``tasks.ReadOutput``) takes what the model takes."""
    inner = getattr(model, "reads", None)
    while isinstance(inner, nn.Module):
        model, inner = inner, getattr(inner, "reads", None)
    try:
        params = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def bind(model: nn.Module, batch: Inputs) -> Inputs:
    """``batch`` restricted to what ``model.forward`` takes, in forward's order (a tensor stays as it is).

    A dict none of whose names forward takes (a one-argument model fed tokenized text) gives its first
    tensor (the token ids), so models written for one tensor keep working."""
    if isinstance(batch, torch.Tensor):
        return batch
    params = forward_names(model)
    if params is None:
        return dict(batch)
    kept = {k: batch[k] for k in params if k in batch}
    return kept if kept else next(iter(batch.values()))


def call(model: nn.Module, batch: Inputs, runner: nn.Module | None = None) -> Any:
    """Run ``model`` on ``batch``: ``model(x)`` for a tensor, ``model(**batch)`` (bound to forward) for a dict.

    ``runner`` runs it instead (the model wrapped in DistributedDataParallel, whose forward takes anything),
    with the batch bound to ``model``'s own forward."""
    bound = bind(model, batch)
    run = runner or model
    return run(bound) if isinstance(bound, torch.Tensor) else run(**bound)


def take(batch: Inputs, index: Any) -> Inputs:
    """Rows ``index`` (a slice, an index tensor or list) of every input."""
    if isinstance(batch, torch.Tensor):
        return batch[index]
    return {k: v[index] for k, v in batch.items()}


def to(batch: Inputs, device: str | torch.device) -> Inputs:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    return {k: v.to(device) for k, v in batch.items()}


def size(batch: Inputs) -> int:
    """The number of samples in ``batch``."""
    return len(batch) if isinstance(batch, torch.Tensor) else len(next(iter(batch.values())))


def first(batch: Inputs) -> torch.Tensor:
    """The one tensor, or the first input of a dict (the token ids of text)."""
    return batch if isinstance(batch, torch.Tensor) else next(iter(batch.values()))


def cat(batches: "list[Inputs]") -> Inputs:
    """Concatenate batches along the samples (token tensors padded to the longest with 0 first)."""
    if isinstance(batches[0], torch.Tensor):
        return torch.cat(batches)  # type: ignore[arg-type]
    keys = list(batches[0])
    return {k: _cat_padded([b[k] for b in batches]) for k in keys}  # type: ignore[index]


def _cat_padded(parts: list[torch.Tensor]) -> torch.Tensor:
    if parts[0].dim() == 2 and not parts[0].is_floating_point():
        width = max(p.shape[1] for p in parts)
        parts = [torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts]
    return torch.cat(parts)


def is_token(t: torch.Tensor) -> bool:
    """An integer (batch, sequence) tensor: token ids, masks, type ids. Its axis 1 is dynamic in artifacts."""
    return t.dim() == 2 and t.dtype in (torch.int64, torch.int32)


def lengths(batch: Inputs) -> torch.Tensor | None:
    """Tokens a row (the attention mask's sums), or None for inputs without a mask."""
    if isinstance(batch, torch.Tensor) or MASK not in batch:
        return None
    return batch[MASK].sum(1)


def trim(batch: Inputs) -> Inputs:
    """Cut every token tensor to the batch's longest row (dynamic padding); other inputs stay as they are."""
    n = lengths(batch)
    if n is None or not len(n):
        return batch
    width = max(int(n.max()), 1)
    return {k: v[:, :width].contiguous() if is_token(v) else v for k, v in batch.items()}  # type: ignore[union-attr]


def feed(batch: Inputs, wanted: "list[str] | None" = None) -> dict[str, np.ndarray]:
    """A numpy feed for onnxruntime or OpenVINO, keyed by the artifact's input names (``wanted``)."""
    if isinstance(batch, torch.Tensor):
        arrays = {SINGLE_NAME: batch}
    else:
        arrays = dict(batch)
    if wanted is not None:
        if len(wanted) == 1 and wanted[0] not in arrays:
            arrays = {wanted[0]: next(iter(arrays.values()))}
        arrays = {k: arrays[k] for k in wanted if k in arrays}
    return {k: np.ascontiguousarray(v.detach().cpu().numpy()) for k, v in arrays.items()}


def as_numpy(batch: Inputs) -> "np.ndarray | dict[str, np.ndarray]":
    """What an executor takes: a numpy array for one tensor, a numpy feed for several."""
    if isinstance(batch, torch.Tensor):
        return np.ascontiguousarray(batch.detach().cpu().numpy())
    return feed(batch)


def padded_text(batch: Inputs) -> bool:
    """Whether ``batch`` is tokenized text padded per batch (it holds an ``attention_mask``): then its token tensors'
    axis 1 varies from batch to batch, and artifacts take it dynamic. Other integer inputs (a ranker's ``ids`` of one
    id a field, a sequence model's fixed window of item ids) keep their width."""
    return isinstance(batch, Mapping) and MASK in batch


def describe(batch: Inputs, text: bool | None = None) -> dict[str, dict[str, Any]]:
    """Per input: its per-sample shape (``"sequence"`` for a token axis of padded text, ``padded_text``; ``text``
    says so for a batch already bound to a forward that does not take the mask) and dtype."""
    items = {SINGLE_NAME: batch} if isinstance(batch, torch.Tensor) else batch
    text = padded_text(batch) if text is None else text
    out = {}
    for k, v in items.items():
        shape: list[Any] = list(map(int, v.shape[1:]))
        if text and is_token(v):
            shape[0] = "sequence"
        out[k] = {"shape": shape, "dtype": str(v.dtype).removeprefix("torch.")}
    return out


def fresh(batch: Inputs, rows: int) -> Inputs:
    """New tensors of ``rows`` samples shaped like ``batch`` (for tracing: a slice or batch 1 can fix the batch
    dimension in a graph). Floats are random, integers ones (valid token ids and a full mask)."""
    def one(t: torch.Tensor) -> torch.Tensor:
        shape = (rows,) + tuple(t.shape[1:])
        return torch.randn(shape) if t.dtype.is_floating_point else torch.ones(shape, dtype=t.dtype)

    if isinstance(batch, torch.Tensor):
        return one(batch)
    return {k: one(v) for k, v in batch.items()}


def repeat_to(batch: Inputs, rows: int) -> Inputs:
    """``rows`` real samples of ``batch`` (repeated when there are fewer), as new contiguous tensors."""
    n = size(batch)
    index = torch.arange(rows) % n
    out = take(batch, index)
    return out.contiguous() if isinstance(out, torch.Tensor) else {k: v.contiguous() for k, v in out.items()}


def as_mapping(batch: Inputs) -> Mapping[str, torch.Tensor]:
    return {SINGLE_NAME: batch} if isinstance(batch, torch.Tensor) else batch
