"""The output side of a catalogue: rows of the output projection that no training label reaches, merged into one.

A session recommender scores every item of its catalogue with a Linear whose row ``j`` is item ``j`` (GRU4Rec's
``output``: 20,000 x hidden, most of its MACs); a classifier over a large label space is the same. A row whose item
is never the label of a training sample is only ever pushed down by the full-softmax loss: it never reaches the
top of a ranking, and its score carries nothing a model learned about that item. Such rows are merged into one
row, their mean, so every one of those items gets the same score, the mean of the scores they had; the projection
computes the kept rows and the merged one, and an ``index`` (int32, one entry per catalogue item) spreads them back
to the catalogue's order: the output keeps its shape (``[B, items]``), ids and the deployment record their meaning.
On the zoo's GRU4Rec (the generated log: 3,713 of 20,000 items are never a training label) the unpruned model's
HR@10 stays 0.3330 to the fourth decimal, and its output projection loses 18.6 % of its MACs.

Rows are ranked by how often the training split labels them (never first, then the least labelled; ties: the
smaller row). Beyond the never-labelled rows a merge costs quality: the zoo GRU4Rec's once-labelled items hold 1.4 %
of its top-10 places. It is the output-side counterpart of the `tables` granularity's rows never read (``tables.py``),
and the same stage runs it (``target: {outputs: share}``). A projection tied to an input table (SASRec's
``output.weight is items.weight``) is left whole: its rows are the items' input rows too.
"""

from __future__ import annotations

import torch
from torch import nn

from ..inputs import Inputs, call
from .observe import observing


class CompactLinear(nn.Module):
    """An output projection whose merged rows share one: ``linear`` computes the kept rows (row 0: the merged row),
    ``index`` (int32, ``out_features`` entries) maps each original output to its row. Same inputs and output shape
    as the ``nn.Linear`` it replaces; MACs count the rows it computes."""

    index: torch.Tensor

    def __init__(self, linear: nn.Linear, index: torch.Tensor):
        super().__init__()
        self.linear = linear
        self.in_features, self.out_features = linear.in_features, int(index.numel())
        self.register_buffer("index", index.to(torch.int32).clone())

    @classmethod
    def blank(cls) -> "CompactLinear":
        """One whose sizes a checkpoint sets (registered under ``pruneflow.rebuildable_modules``)."""
        return cls(nn.Linear(1, 1), torch.zeros(1, dtype=torch.int32))

    @property
    def rows(self) -> int:
        return self.linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.index_select(self.linear(x), -1, self.index)

    def extra_repr(self) -> str:
        return f"{self.out_features} outputs -> {self.rows} rows computed"


def output_rows(module: nn.Module) -> int:
    """Rows the projection computes."""
    return module.rows if isinstance(module, CompactLinear) else int(getattr(module, "out_features"))


@torch.no_grad()
def output_projection(model: nn.Module, example: Inputs, min_rows: int) -> str | None:
    """The name of the Linear (or compacted one) whose output is the model's output, when it has at least
    ``min_rows`` outputs and its weight is its own (not tied to a table); else None."""
    found: dict[str, torch.Tensor] = {}
    kinds = (nn.Linear, CompactLinear)
    names = {m: n for n, m in model.named_modules() if isinstance(m, kinds)}
    with observing(model, [m.register_forward_hook(lambda mod, args, out: found.__setitem__(names[mod], out)) for m in names]):
        out = call(model, example)
    name = next((n for n, t in found.items() if t is out), None)
    if name is None:
        return None
    module = model.get_submodule(name)
    weight = (module.linear if isinstance(module, CompactLinear) else module).weight
    shared = sum(1 for m in model.modules() for p in m.parameters(recurse=False) if p is weight) > 1
    return name if output_count(module) >= min_rows and not shared else None


def label_counts(labels: torch.Tensor, outputs: int) -> torch.Tensor:
    """How often the training labels name each output (float64, ``outputs`` entries)."""
    flat = labels.reshape(-1).long().cpu()
    return torch.bincount(flat[(flat >= 0) & (flat < outputs)], minlength=outputs).double()


def rows_to_merge(module: nn.Module, counts: torch.Tensor, merge: int) -> torch.Tensor:
    """A mask over the original outputs: every never-labelled one and every one already merged, then the least
    labelled (ties: the smaller row first) until ``merge`` are."""
    mask = _merged(module) | (counts.cpu() == 0)
    missing = merge - int(mask.sum())
    if missing > 0:
        norms = _dense_rows(module).detach().double().norm(dim=1).cpu()
        order = sorted((j for j in range(len(mask)) if not mask[j]), key=lambda j: (float(counts[j]), float(norms[j])))
        mask[torch.tensor(order[:missing], dtype=torch.long)] = True
    return mask


def _merged(module: nn.Module) -> torch.Tensor:
    if isinstance(module, CompactLinear):
        return (module.index == 0).cpu()
    return torch.zeros(int(getattr(module, "out_features")), dtype=torch.bool)


def _dense_rows(module: nn.Module) -> torch.Tensor:
    """One weight row per original output."""
    if isinstance(module, CompactLinear):
        return module.linear.weight[module.index.long()]
    assert isinstance(module, nn.Linear)
    return module.weight


def output_count(module: nn.Module) -> int:
    """Outputs the projection gives (the catalogue's size, whatever it computes)."""
    return int(getattr(module, "out_features"))


@torch.no_grad()
def merge_output_rows(module: nn.Module, mask: torch.Tensor) -> CompactLinear:
    """``module`` (an ``nn.Linear`` or a :class:`CompactLinear`) with the outputs in ``mask`` sharing one row, their
    mean (weights and bias): each of them then scores the mean of what they scored."""
    linear = module.linear if isinstance(module, CompactLinear) else module
    assert isinstance(linear, nn.Linear)
    source = module.index.long() if isinstance(module, CompactLinear) else torch.arange(linear.out_features)
    weight, bias = linear.weight[source], (linear.bias[source] if linear.bias is not None else None)
    gone = mask.to(weight.device)
    if not bool(gone.any()) or bool(gone.all()):
        raise ValueError(f"merge at least one output and keep at least one (asked: {int(gone.sum())} of {len(gone)})")
    keep = (~gone).nonzero().flatten()
    rows = torch.cat([weight[gone].mean(0, keepdim=True), weight[keep]])
    new = nn.Linear(linear.in_features, len(rows), bias=bias is not None).to(weight.device, weight.dtype)
    new.weight.copy_(rows)
    if bias is not None:
        new.bias.copy_(torch.cat([bias[gone].mean(0, keepdim=True), bias[keep]]))
    index = torch.zeros(len(source), dtype=torch.long, device=weight.device)
    index[keep] = torch.arange(1, len(keep) + 1, device=weight.device)
    new.train(linear.training)
    return CompactLinear(new, index)
