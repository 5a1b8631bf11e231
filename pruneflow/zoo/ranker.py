"""Click-through-rate rankers: categorical ids through embedding tables, plus dense features, to one logit.

``forward(ids, dense)``: ``ids`` int64 ``[B, F]`` (one id per categorical field, each in ``0..cardinalities[f]-1``,
0 being the field's out-of-vocabulary row; ``pruneflow/tabular.py`` makes them), ``dense`` float32 ``[B, D]``.
Returns one click logit a sample, ``[B, 1]``.

- ``interaction="fm"`` (DeepFM, Guo et al. 2017): a first-order weight per id, the factorisation machine's
  pairwise term ``0.5 * ((Σ v)² - Σ v²)`` over the fields' vectors (dense features projected to one more
  vector), and an MLP over all vectors concatenated; the three are summed.
- ``interaction="dot"`` (DLRM, Naumov et al. 2019): a bottom MLP takes the dense features to one vector, the
  pairwise dot products of all vectors (upper triangle) and that vector feed the top MLP.

Tables: ``tables="per_field"`` gives each field its own ``nn.Embedding`` (named ``tables.<i>``);
``"shared"`` one table holding every field's rows (ids offset by the field's start), the layout of a hashed
id space. A DeepFM's first-order weight is column 0 of its field's table (width ``embedding_dim + 1``):
one lookup per field, and no width-1 table whose per-row scale would cost more than its value.
"""

from __future__ import annotations

import torch
from torch import nn


def _mlp(width: int, hidden: int, layers: int, out: int | None, dropout: float) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, hidden), nn.ReLU()] + ([nn.Dropout(dropout)] if dropout else [])
        width = hidden
    if out is not None:
        blocks.append(nn.Linear(width, out))
    return nn.Sequential(*blocks)


class Ranker(nn.Module):
    def __init__(self, cardinalities: list[int], num_dense: int = 0, embedding_dim: int = 16, hidden: int = 128,
                 layers: int = 2, interaction: str = "fm", tables: str = "per_field", dropout: float = 0.0):
        super().__init__()
        if not cardinalities:
            raise ValueError("a ranker needs at least one categorical field (cardinalities is empty)")
        if interaction not in ("fm", "dot") or tables not in ("per_field", "shared"):
            raise ValueError(f"interaction must be fm or dot (got {interaction!r}), tables per_field or shared (got {tables!r})")
        self.interaction, self.num_fields, self.num_dense, self.dim = interaction, len(cardinalities), num_dense, embedding_dim
        width = embedding_dim + (1 if interaction == "fm" else 0)  # fm: column 0 is the first-order weight
        if tables == "shared":
            made = [nn.Embedding(sum(cardinalities), width)]
            starts = torch.tensor([0] + list(cardinalities[:-1])).cumsum(0)
        else:
            made = [nn.Embedding(int(c), width) for c in cardinalities]
            starts = torch.zeros(len(cardinalities), dtype=torch.long)
        for table in made:
            nn.init.normal_(table.weight, std=0.01)
        self.tables = nn.ModuleList(made)
        self.offsets: torch.Tensor
        self.register_buffer("offsets", starts.long(), persistent=False)
        vectors = self.num_fields + (1 if num_dense else 0)
        if interaction == "fm":
            self.dense_vector = nn.Linear(num_dense, embedding_dim) if num_dense else None
            self.dense_linear = nn.Linear(num_dense, 1) if num_dense else None
            self.deep = _mlp(vectors * embedding_dim, hidden, layers, 1, dropout)
        else:
            self.bottom = _mlp(num_dense, hidden, 1, embedding_dim, dropout) if num_dense else None
            pairs = vectors * (vectors - 1) // 2
            self.top = _mlp(pairs + (embedding_dim if num_dense else 0), hidden, layers, 1, dropout)
            rows, cols = torch.triu_indices(vectors, vectors, offset=1)
            self.pair_rows: torch.Tensor
            self.pair_cols: torch.Tensor
            self.register_buffer("pair_rows", rows, persistent=False)
            self.register_buffer("pair_cols", cols, persistent=False)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The fields' rows, ``[B, F, width]``."""
        if len(self.tables) == 1 and self.num_fields > 1:
            return self.tables[0](ids + self.offsets)
        return torch.stack([table(ids[:, i]) for i, table in enumerate(self.tables)], dim=1)

    def forward(self, ids: torch.Tensor, dense: torch.Tensor | None = None) -> torch.Tensor:
        rows = self.lookup(ids)
        if self.interaction == "fm":
            return self._fm(rows, dense)
        return self._dot(rows, dense)

    def _fm(self, rows: torch.Tensor, dense: torch.Tensor | None) -> torch.Tensor:
        first = rows[:, :, 0].sum(dim=1, keepdim=True)
        vectors = rows[:, :, 1:]
        if dense is not None and self.dense_vector is not None and self.dense_linear is not None:
            first = first + self.dense_linear(dense)
            vectors = torch.cat([vectors, self.dense_vector(dense).unsqueeze(1)], dim=1)
        pairwise = 0.5 * (vectors.sum(dim=1).pow(2) - vectors.pow(2).sum(dim=1)).sum(dim=1, keepdim=True)
        return first + pairwise + self.deep(vectors.flatten(1))

    def _dot(self, rows: torch.Tensor, dense: torch.Tensor | None) -> torch.Tensor:
        vectors, extra = rows, []
        if dense is not None and self.bottom is not None:
            bottom = self.bottom(dense)
            vectors, extra = torch.cat([rows, bottom.unsqueeze(1)], dim=1), [bottom]
        products = torch.bmm(vectors, vectors.transpose(1, 2))[:, self.pair_rows, self.pair_cols]
        return self.top(torch.cat(extra + [products], dim=1))


def deepfm(cardinalities: list[int], num_dense: int = 0, embedding_dim: int = 16, hidden: int = 128, layers: int = 2,
           tables: str = "per_field", dropout: float = 0.0) -> nn.Module:
    """DeepFM: first-order weights + factorisation-machine pairs + an MLP over the fields' vectors, summed."""
    return Ranker(cardinalities, num_dense, embedding_dim, hidden, layers, "fm", tables, dropout)


def dlrm(cardinalities: list[int], num_dense: int = 0, embedding_dim: int = 16, hidden: int = 128, layers: int = 2,
         tables: str = "per_field", dropout: float = 0.0) -> nn.Module:
    """DLRM: a bottom MLP for the dense features, pairwise dot products of all vectors, a top MLP."""
    return Ranker(cardinalities, num_dense, embedding_dim, hidden, layers, "dot", tables, dropout)
