"""A DLRM whose features include multi-hot bags: ``nn.EmbeddingBag`` tables beside ``nn.Embedding`` ones.

``forward(ids, bags, dense)``: ``ids`` int64 ``[B, F]`` (one id per one-hot field, ``0..cardinalities[f]-1``),
``bags`` int64 ``[B, N, L]`` (``N`` multi-hot fields, each a fixed-length bag of ``L`` ids in
``0..bag_cardinalities[n]-1``, padded with 0: row 0 of a bag table is its padding row, never read),
``dense`` float32 ``[B, D]``. Returns one click logit a sample, ``[B, 1]``.

A bag field (a user's last clicked categories, a document's tags) reduces its ids' rows to one vector
(``mode``: ``sum``, ``mean`` over the non-padding ids, or ``max``); that vector then plays the part of a one-hot
field's row: a bottom MLP takes the dense features to one more vector, the pairwise dot products of all
vectors (upper triangle) and the bottom vector feed the top MLP (DLRM, Naumov et al. 2019; ``zoo/ranker.py``).

Fixed-length 2-D bags, not torch's 1-D ``input`` + ``offsets`` form: a batch of them is one tensor, which the
data loaders, the calibration sets and every exported graph take as they take ids; and the export rewrites a
2-D bag in plain operators (``export/bags.py``), which it cannot do for bags of varying length.
"""

from __future__ import annotations

import torch
from torch import nn

from .ranker import _mlp


class BagDLRM(nn.Module):
    def __init__(self, cardinalities: list[int], bag_cardinalities: list[int], bag_length: int, num_dense: int,
                 embedding_dim: int = 16, hidden: int = 64, layers: int = 2, mode: str = "sum"):
        super().__init__()
        if not bag_cardinalities:
            raise ValueError("dlrm_bags needs at least one bag field (bag_cardinalities is empty); use dlrm without bags")
        if mode not in ("sum", "mean", "max") or bag_length < 1:
            raise ValueError(f"mode must be sum, mean or max (got {mode!r}) and bag_length at least 1 (got {bag_length})")
        self.num_fields, self.num_bags, self.bag_length = len(cardinalities), len(bag_cardinalities), bag_length
        self.num_dense = num_dense
        tables = [nn.Embedding(int(c), embedding_dim) for c in cardinalities]
        bags = [nn.EmbeddingBag(int(c), embedding_dim, mode=mode, padding_idx=0) for c in bag_cardinalities]
        for weight in [t.weight for t in tables] + [b.weight for b in bags]:
            nn.init.normal_(weight, std=0.01)
        with torch.no_grad():
            for bag in bags:
                bag.weight[0].zero_()  # the padding row, as nn.EmbeddingBag(padding_idx=0) makes it
        self.tables, self.bags = nn.ModuleList(tables), nn.ModuleList(bags)
        self.bottom = _mlp(num_dense, hidden, 1, embedding_dim, 0.0) if num_dense else None
        vectors = self.num_fields + self.num_bags + (1 if num_dense else 0)
        self.top = _mlp(vectors * (vectors - 1) // 2 + (embedding_dim if num_dense else 0), hidden, layers, 1, 0.0)
        rows, cols = torch.triu_indices(vectors, vectors, offset=1)
        self.pair_rows: torch.Tensor
        self.pair_cols: torch.Tensor
        self.register_buffer("pair_rows", rows, persistent=False)
        self.register_buffer("pair_cols", cols, persistent=False)

    def forward(self, ids: torch.Tensor, bags: torch.Tensor, dense: torch.Tensor | None = None) -> torch.Tensor:
        if bags.dim() != 3 or bags.shape[1] != self.num_bags or bags.shape[2] != self.bag_length:
            raise ValueError(f"bags must be [batch, {self.num_bags}, {self.bag_length}] (bag fields, bag length; "
                             f"0 pads a short bag), got {list(bags.shape)}")
        rows = [table(ids[:, i]) for i, table in enumerate(self.tables)]
        rows += [bag(bags[:, j]) for j, bag in enumerate(self.bags)]
        vectors, extra = torch.stack(rows, dim=1), []
        if dense is not None and self.bottom is not None:
            bottom = self.bottom(dense)
            vectors, extra = torch.cat([vectors, bottom.unsqueeze(1)], dim=1), [bottom]
        products = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pair_rows, self.pair_cols]
        return self.top(torch.cat(extra + [products], dim=1))


def dlrm_bags(cardinalities: list[int], bag_cardinalities: list[int], bag_length: int, num_dense: int,
              embedding_dim: int = 16, hidden: int = 64, layers: int = 2, mode: str = "sum") -> nn.Module:
    """DLRM over one-hot ids (``nn.Embedding``), fixed-length multi-hot bags (``nn.EmbeddingBag``, 0 = padding)
    and dense features: a bottom MLP, pairwise dot products of all vectors, a top MLP, one logit."""
    return BagDLRM(cardinalities, bag_cardinalities, bag_length, num_dense, embedding_dim, hidden, layers, mode)
