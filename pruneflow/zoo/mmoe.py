"""A multi-task ranker: Multi-gate Mixture-of-Experts (Ma et al., KDD 2018), the production form of a feed's ranker.

``forward(ids, dense)``: ``ids`` int64 ``[B, F]`` (one id per categorical field, as ``pruneflow/tabular.py`` makes
them), ``dense`` float32 ``[B, D]``. Shared id tables feed ``experts`` expert MLPs; each task has its own softmax
gate over the experts and its own tower. Returns a dict of one logit a sample per task, ``{"click": [B, 1],
"finish": [B, 1]}`` (``tasks`` names them): a recipe's multi-task ``task`` reads each head by that name, and every
artifact keeps every head as a named output.
"""

from __future__ import annotations

import torch
from torch import nn

from .ranker import _mlp


class MMoE(nn.Module):
    def __init__(self, cardinalities: list[int], num_dense: int = 0, embedding_dim: int = 16, experts: int = 4,
                 expert_hidden: int = 64, tower_hidden: int = 32, tasks: tuple[str, ...] | list[str] = ("click", "finish"),
                 dropout: float = 0.0):
        super().__init__()
        if not cardinalities or not tasks:
            raise ValueError("an MMoE needs at least one categorical field and one task")
        self.task_names = list(tasks)
        tables = [nn.Embedding(int(c), embedding_dim) for c in cardinalities]
        for table in tables:
            nn.init.normal_(table.weight, std=0.01)
        self.tables = nn.ModuleList(tables)
        width = len(cardinalities) * embedding_dim + num_dense
        self.experts = nn.ModuleList(_mlp(width, expert_hidden, 1, expert_hidden, dropout) for _ in range(experts))
        self.gates = nn.ModuleList(nn.Linear(width, experts) for _ in self.task_names)
        self.towers = nn.ModuleList(_mlp(expert_hidden, tower_hidden, 1, 1, dropout) for _ in self.task_names)

    def forward(self, ids: torch.Tensor, dense: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        rows = [table(ids[:, i]) for i, table in enumerate(self.tables)]
        x = torch.cat(rows + ([dense] if dense is not None else []), dim=1)
        expert_out = torch.stack([expert(x) for expert in self.experts], dim=1)  # [B, E, H]
        heads = {}
        for name, gate, tower in zip(self.task_names, self.gates, self.towers):
            weights = torch.softmax(gate(x), dim=1).unsqueeze(-1)  # [B, E, 1]
            heads[name] = tower((weights * expert_out).sum(dim=1))
        return heads


def mmoe(cardinalities: list[int], num_dense: int = 0, embedding_dim: int = 16, experts: int = 4, expert_hidden: int = 64,
         tower_hidden: int = 32, tasks: list[str] | None = None, dropout: float = 0.0) -> nn.Module:
    """MMoE: shared id tables, ``experts`` expert MLPs, a softmax gate and a tower per task -> ``{task: logit}``."""
    return MMoE(cardinalities, num_dense, embedding_dim, experts, expert_hidden, tower_hidden,
                tuple(tasks or ("click", "finish")), dropout)
