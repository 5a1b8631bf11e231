"""An LSTM or GRU text classifier (issue 15): embedding → recurrent layer → classifier on the state at each
row's last real token (``attention_mask`` gives the lengths). ``forward(input_ids, attention_mask)``, the
names the tokenizer step gives, so its artifacts take both, with dynamic batch and sequence axes.

The recurrent layer runs over the padded batch (``pack_padded_sequence`` does not export to ONNX): a
unidirectional layer's output at a position never depends on later ones, so reading it at the last real
token is exact whatever the padding."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn


class RecurrentText(nn.Module):
    def __init__(self, vocab_size: int = 30522, embed_dim: int = 32, hidden: int = 32, num_classes: int = 2,
                 cell: Literal["lstm", "gru"] = "lstm", pad_id: int = 0):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim, padding_idx=pad_id)
        self.rnn = (nn.LSTM if cell == "lstm" else nn.GRU)(embed_dim, hidden, batch_first=True)
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(input_ids))  # (B, L, H)
        last = (attention_mask.sum(1) - 1).clamp(min=0)  # index of each row's last real token
        state = out.gather(1, last[:, None, None].expand(-1, 1, out.shape[2])).squeeze(1)
        return self.fc(state)


def build(**kwargs) -> nn.Module:
    return RecurrentText(**kwargs)
