"""Head pruning for ``torch.nn.MultiheadAttention``: the module it becomes and the conversion.

``nn.MultiheadAttention`` ties its inner width (heads x head size) to ``embed_dim``, the width of its
query input and of its output: ``F.multi_head_attention_forward`` splits the query's own width into
``num_heads``. Removing heads while the model's embedding width stays is therefore something the class
cannot hold. torch-pruning's ``MultiheadAttentionPruner`` prunes the inner width and the embedding width
with the *same* indices and recomputes ``head_dim = embed_dim // num_heads``: with ``prune_num_heads`` it
removes whole heads but also as many channels of the residual stream (every LayerNorm, the class token,
the position embedding, every block), the same number in every layer; without it the heads are re-split
(head size 32 -> 25 in issue 15). So per-layer head pruning with the width kept is written here: each
``nn.MultiheadAttention`` becomes a :class:`HeadAttention` that computes the same function (separate
q/k/v projections of width ``num_heads * head_dim``, the output projection back to ``embed_dim``), whose
heads are then removed whole: rows of q/k/v and columns of the output projection, never re-split.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from .tp_adapter import count_ops_as


class HeadAttention(nn.Module):
    """``nn.MultiheadAttention``'s forward (same arguments and outputs) with an inner width of
    ``num_heads * head_dim`` that need not equal ``embed_dim``.

    ``head_index`` numbers the heads kept in the original module's numbering (a 3-D ``attn_mask`` given
    per original head is sliced with it). ``context`` is an identity on the merged head outputs,
    shaped (batch, target length, heads x head size): importance hooks read and mask the heads there.
    """

    head_index: torch.Tensor
    #: What ``nn.TransformerEncoderLayer`` reads before its fused eval path (``self_attn.in_proj_bias is None``: "bias
    #: False"), which it then skips and calls this module: its q/k/v are separate Linears, no fused projection.
    in_proj_bias: None = None

    def __init__(self, embed_dim: int, num_heads: int, head_dim: int, kdim: int | None = None, vdim: int | None = None,
                 bias: bool = True, dropout: float = 0.0, batch_first: bool = False):
        super().__init__()
        inner = num_heads * head_dim
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.dropout, self.batch_first = dropout, batch_first
        self.q_proj = nn.Linear(embed_dim, inner, bias=bias)
        self.k_proj = nn.Linear(self.kdim, inner, bias=bias)
        self.v_proj = nn.Linear(self.vdim, inner, bias=bias)
        self.context = nn.Identity()
        self.out_proj = nn.Linear(inner, embed_dim, bias=bias)
        self.register_buffer("head_index", torch.arange(num_heads), persistent=True)

    @classmethod
    def blank(cls) -> "HeadAttention":
        """One whose sizes a checkpoint sets (registered under ``pruneflow.rebuildable_modules``): an
        ``nn.MultiheadAttention`` that lost heads."""
        return cls(1, 1, 1)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_padding_mask: torch.Tensor | None = None,
                need_weights: bool = True, attn_mask: torch.Tensor | None = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        batched = query.dim() == 3
        if not batched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            key_padding_mask = key_padding_mask.unsqueeze(0) if key_padding_mask is not None else None
        if not self.batch_first or not batched:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        n, length, source = query.shape[0], query.shape[1], key.shape[1]
        q = self.q_proj(query).view(n, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(key).view(n, source, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(value).view(n, source, self.num_heads, self.head_dim).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = scores + self._bias(n, length, source, key_padding_mask, attn_mask, is_causal, scores)
        weights = torch.softmax(scores, dim=-1)
        dropped = F.dropout(weights, self.dropout, self.training) if self.dropout > 0 else weights
        context = self.context(torch.matmul(dropped, v).transpose(1, 2).reshape(n, length, self.num_heads * self.head_dim))
        out = self.out_proj(context)
        if not self.batch_first or not batched:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(1)
        if not need_weights:
            return out, None
        returned = weights.mean(1) if average_attn_weights else weights
        return out, returned if batched else returned.squeeze(0)

    def _bias(self, n: int, length: int, source: int, key_padding_mask: torch.Tensor | None, attn_mask: torch.Tensor | None,
              is_causal: bool, like: torch.Tensor) -> torch.Tensor:
        """The additive mask (0 where attention is allowed, -inf where a boolean mask says True)."""
        bias = torch.zeros((), dtype=like.dtype, device=like.device)
        if attn_mask is None and is_causal:
            attn_mask = torch.ones(length, source, dtype=torch.bool, device=like.device).triu(1)
        if attn_mask is not None:
            mask = _additive(attn_mask, like)
            if mask.dim() == 3:  # (batch * original heads, L, S): keep the rows of the heads still here
                mask = mask.view(n, -1, length, source)[:, self.head_index]
            bias = bias + mask
        if key_padding_mask is not None:
            bias = bias + _additive(key_padding_mask, like).view(n, 1, 1, source)
        return bias

    def extra_repr(self) -> str:
        return (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, head_dim={self.head_dim}, "
                f"batch_first={self.batch_first}")


def _additive(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=like.dtype, device=like.device).masked_fill(mask, float("-inf"))
    return mask.to(like.dtype)


def from_mha(name: str, mha: nn.MultiheadAttention) -> HeadAttention:
    """A :class:`HeadAttention` computing what ``mha`` computes (its weights copied)."""
    if mha.bias_k is not None or mha.add_zero_attn:
        raise InputError(
            f"attention module {name!r} ({type(mha).__name__}) uses add_bias_kv or add_zero_attn, which head pruning "
            "does not support", hint=f"add {name!r} to the prune stage's `ignore` list, or prune by channels",
        )
    e, h = mha.embed_dim, mha.num_heads
    bias = mha.in_proj_bias is not None
    out = HeadAttention(e, h, mha.head_dim, mha.kdim, mha.vdim, bias=bias, dropout=mha.dropout, batch_first=mha.batch_first)
    out = out.to(device=mha.out_proj.weight.device, dtype=mha.out_proj.weight.dtype)
    if mha.in_proj_weight is not None:
        weights = tuple(mha.in_proj_weight.detach().chunk(3))
    else:
        weights = (mha.q_proj_weight.detach(), mha.k_proj_weight.detach(), mha.v_proj_weight.detach())
    biases = tuple(mha.in_proj_bias.detach().chunk(3)) if bias else (None, None, None)
    with torch.no_grad():
        for linear, w, b in zip((out.q_proj, out.k_proj, out.v_proj), weights, biases):
            linear.weight.copy_(w)
            if b is not None:
                linear.bias.copy_(b)
        out.out_proj.weight.copy_(mha.out_proj.weight)
        if mha.out_proj.bias is not None:
            out.out_proj.bias.copy_(mha.out_proj.bias)
    out.train(mha.training)
    return out


def convert_mha(model: nn.Module, ignored: tuple[str, ...] = ()) -> list[str]:
    """Replace every ``nn.MultiheadAttention`` of ``model`` (outside ``ignored``) by its :class:`HeadAttention`,
    in place; returns the names replaced."""
    names = [n for n, m in model.named_modules() if n and isinstance(m, nn.MultiheadAttention)
             and not any(n == i or n.startswith(i + ".") for i in ignored)]
    for name in names:
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, from_mha(name, getattr(owner, child)))
    return names


def attention_modules(model: nn.Module) -> list[str]:
    """Names of the attention modules of ``model`` whose heads channel pruning must leave whole: every
    ``nn.MultiheadAttention`` and every projection of a :class:`HeadAttention`."""
    names = []
    for name, m in model.named_modules():
        if isinstance(m, nn.MultiheadAttention):
            names.append(name)
        elif isinstance(m, HeadAttention):
            names += [f"{name}.{p}" for p in ("q_proj", "k_proj", "v_proj", "out_proj")]
    return names


def prune_attention_heads(attn: HeadAttention, remove: list[int]) -> None:
    """Remove heads ``remove`` (current numbering) whole: their rows of q/k/v, their columns of out_proj."""
    kept = [h for h in range(attn.num_heads) if h not in set(remove)]
    if not kept:
        raise ValueError(f"cannot remove all {attn.num_heads} heads")
    d = attn.head_dim
    rows = torch.cat([torch.arange(h * d, (h + 1) * d) for h in kept]).to(attn.q_proj.weight.device)
    with torch.no_grad():
        for linear in (attn.q_proj, attn.k_proj, attn.v_proj):
            linear.weight = nn.Parameter(linear.weight[rows].clone())
            if linear.bias is not None:
                linear.bias = nn.Parameter(linear.bias[rows].clone())
            linear.out_features = len(rows)
        attn.out_proj.weight = nn.Parameter(attn.out_proj.weight[:, rows].clone())
        attn.out_proj.in_features = len(rows)
    attn.num_heads = len(kept)
    attn.head_index = attn.head_index[torch.tensor(kept, device=attn.head_index.device)]


def _count_ops(module: HeadAttention, inputs: tuple, output) -> None:
    """torch-pruning's count for ``nn.MultiheadAttention`` (projections, biases, q scaling, per-head scores,
    softmax and context, output projection) with the inner width ``num_heads * head_dim``: equal to it
    for an unpruned module, so MACs before and after the conversion agree."""
    query, key = inputs[0], inputs[1]
    batch_first = module.batch_first and query.dim() == 3
    batch = query.shape[0] if batch_first else (query.shape[1] if query.dim() == 3 else 1)
    qlen, klen = query.shape[1 if batch_first else 0], key.shape[1 if batch_first else 0]
    inner, e = module.num_heads * module.head_dim, module.embed_dim
    flops = qlen * inner + qlen * e * inner + klen * (module.kdim + module.vdim) * inner
    if module.q_proj.bias is not None:
        flops += (qlen + 2 * klen) * inner
    flops += module.num_heads * (2 * qlen * klen * module.head_dim + qlen * klen)
    flops += qlen * e * (inner + 1)
    setattr(module, "__flops__", getattr(module, "__flops__", 0) + int(flops * batch))


count_ops_as(HeadAttention, _count_ops)
