"""BERT-style sequence classifiers from `transformers`: built from a config in code, or loaded from
a local folder (never from a hub). Wrapped so the model takes the tokenizer's int64 tensors by name
(``input_ids``, ``attention_mask``, ``token_type_ids``; what deployments feed) and returns logits."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import InputError, MissingDependencyError


def _transformers():
    try:
        import transformers
    except ImportError as exc:
        raise MissingDependencyError("BERT-style models need the `transformers` package",
                                     hint="pip install 'pruneflow[transformers]'") from exc
    return transformers


class SequenceClassifier(nn.Module):
    """``forward(input_ids, attention_mask, token_type_ids=None) -> logits``. Without a mask, padding
    (``pad_id``) is masked out of attention (token ids alone, as older artifacts took them)."""

    def __init__(self, model: nn.Module, pad_id: int = 0):
        super().__init__()
        self.model = model
        self.pad_id = pad_id

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        input_ids = input_ids.long()
        mask = (input_ids != self.pad_id).long() if attention_mask is None else attention_mask.long()
        types = None if token_type_ids is None else token_type_ids.long()
        return self.model(input_ids=input_ids, attention_mask=mask, token_type_ids=types).logits


def bert_classifier(folder: str | None = None, num_labels: int = 2, vocab_size: int = 30522, hidden_size: int = 128,
                    num_layers: int = 2, num_heads: int = 4, intermediate_size: int = 512, max_positions: int = 512,
                    pad_id: int = 0, seed: int | None = None) -> SequenceClassifier:
    """A BERT classifier: from ``folder`` (local files only) or a fresh config (random init)."""
    tf = _transformers()
    if seed is not None:
        torch.manual_seed(seed)
    # Eager attention: exportable to ONNX with the legacy exporter, and exact under head masks.
    if folder:
        try:
            model = tf.AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True,
                                                                          attn_implementation="eager")
        except Exception as exc:  # noqa: BLE001
            raise InputError(f"model.kwargs.folder: could not load a model from {folder}: {type(exc).__name__}: {exc}") from exc
    else:
        config = tf.BertConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                               num_attention_heads=num_heads, intermediate_size=intermediate_size,
                               max_position_embeddings=max_positions, num_labels=num_labels)
        config._attn_implementation = "eager"
        model = tf.BertForSequenceClassification(config)
    return SequenceClassifier(model, pad_id)
