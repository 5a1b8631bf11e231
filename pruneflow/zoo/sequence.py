"""Sequential recommenders: the last items a user touched in, a score for every item of the catalogue out.

``forward(seq)``: ``seq`` int64 ``[B, L]``, item ids ``1..num_items-1`` oldest first, left-padded with 0 (row 0 of
the item table is padding and stays zero). Returns ``[B, num_items]`` scores, one per catalogue item, for the
item that comes next (``task: next_item`` reads them: HR@k, NDCG@k, MRR against the true next item).

- ``sasrec`` (Kang & McAuley 2018): item + position embeddings, ``blocks`` causal self-attention blocks
  (``nn.MultiheadAttention`` with a causal mask, a pointwise FFN, pre-LayerNorm, residuals), the last
  position's state scored against the item table itself: the output projection is *tied* to the input table
  (``output.weight is items.weight``), as in the paper, so the catalogue is stored once.
- ``gru4rec`` (Hidasi et al. 2016): an item embedding, an ``nn.GRU``, the last hidden state through a Linear
  to the catalogue (untied).
"""

from __future__ import annotations

import math

import torch
from torch import nn


class CausalBlock(nn.Module):
    """Pre-LayerNorm self-attention under a causal mask, then a pointwise two-layer FFN; both residual."""

    def __init__(self, dim: int, heads: int, ffn: int, dropout: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attention = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn), nn.ReLU(), nn.Dropout(dropout), nn.Linear(ffn, dim))

    def forward(self, h: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
        x = self.norm1(h)
        h = h + self.attention(x, x, x, attn_mask=causal, need_weights=False)[0]
        return h + self.ffn(self.norm2(h))


class SASRec(nn.Module):
    def __init__(self, num_items: int, dim: int = 64, heads: int = 2, blocks: int = 2, max_len: int = 20,
                 ffn: int | None = None, dropout: float = 0.1):
        super().__init__()
        if num_items < 2:
            raise ValueError(f"num_items must count the padding row 0 and at least one item (got {num_items})")
        self.dim, self.max_len = dim, max_len
        self.items = nn.Embedding(num_items, dim, padding_idx=0)
        nn.init.normal_(self.items.weight, std=dim ** -0.5)
        with torch.no_grad():
            self.items.weight[0].zero_()
        self.positions = nn.Embedding(max_len, dim)
        self.dropout = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(CausalBlock(dim, heads, ffn or dim, dropout) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, num_items, bias=False)
        self.output.weight = self.items.weight  # tied: one table serves the lookup and the scores
        causal = torch.triu(torch.full((max_len, max_len), float("-inf")), diagonal=1)
        self.causal: torch.Tensor
        self.register_buffer("causal", causal, persistent=False)
        self.position_ids: torch.Tensor
        self.register_buffer("position_ids", torch.arange(max_len), persistent=False)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        length = seq.shape[1]
        keep = (seq != 0).unsqueeze(-1).to(self.items.weight.dtype)  # padding contributes nothing
        h = self.items(seq) * math.sqrt(self.dim) + self.positions(self.position_ids[-length:])
        h = self.dropout(h) * keep
        causal = self.causal[:length, :length]
        for block in self.blocks:
            h = block(h, causal) * keep
        return self.output(self.norm(h[:, -1]))


class GRU4Rec(nn.Module):
    def __init__(self, num_items: int, dim: int = 64, hidden: int = 100, layers: int = 1, dropout: float = 0.0):
        super().__init__()
        self.items = nn.Embedding(num_items, dim, padding_idx=0)
        self.gru = nn.GRU(dim, hidden, num_layers=layers, batch_first=True, dropout=dropout if layers > 1 else 0.0)
        self.output = nn.Linear(hidden, num_items)

    def forward(self, seq: torch.Tensor) -> torch.Tensor:
        states, _ = self.gru(self.items(seq))
        return self.output(states[:, -1])


def sasrec(num_items: int, dim: int = 64, heads: int = 2, blocks: int = 2, max_len: int = 20, ffn: int | None = None,
           dropout: float = 0.1) -> nn.Module:
    """SASRec: causal self-attention over the last ``max_len`` items, scored against the tied item table."""
    return SASRec(num_items, dim, heads, blocks, max_len, ffn, dropout)


def gru4rec(num_items: int, dim: int = 64, hidden: int = 100, layers: int = 1, dropout: float = 0.0) -> nn.Module:
    """GRU4Rec: a GRU over the session's items, its last state scored by a Linear over the catalogue."""
    return GRU4Rec(num_items, dim, hidden, layers, dropout)
