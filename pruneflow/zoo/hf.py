"""BERT-style sequence classifiers and sentence encoders from `transformers`: built from a config in code, or loaded
from a local folder (never from a hub). Wrapped so the model takes the tokenizer's int64 tensors by name
(``input_ids``, ``attention_mask``, ``token_type_ids``; what deployments feed) and returns logits (a classifier) or one
normalised vector a sentence (an embedder)."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Any

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


#: What model.kwargs.folder must hold (loaded with local_files_only: nothing is downloaded).
_FOLDER_HINT = ("point model.kwargs.folder at a folder a Hugging Face model was saved to (save_pretrained: config.json and "
                "model.safetensors or pytorch_model.bin); nothing is downloaded")

def _load_quietly(load: Any, folder: str, **kwargs: Any) -> tuple[Any, dict]:
    """``load(folder, ...)`` (a ``from_pretrained``) without transformers' own output: its per-weight progress bar and the
    LOAD REPORT table it prints on stderr for every key it skips (an embedder leaves the pooler out on purpose: its two
    "UNEXPECTED" keys opened every minilm-embed run). What was missing or skipped is logged instead; the model and
    ``info`` (``missing_keys``, ``unexpected_keys``) are returned."""
    import logging

    from transformers.utils import logging as hf_logging

    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model, info = load(folder, local_files_only=True, attn_implementation="eager", output_loading_info=True,
                           trust_remote_code=False, **kwargs)  # a folder's own modeling code never runs (no prompt either)
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    skipped = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys") and v}
    if skipped:
        logging.getLogger("pruneflow").info("loaded %s: %s", folder, "; ".join(f"{k}: {', '.join(v)}" for k, v in skipped.items()))
    return model, info


def token_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, token_type_ids: torch.Tensor | None,
                 pad_id: int) -> dict[str, torch.Tensor | None]:
    """A BERT's keyword inputs as int64; without a mask, padding (``pad_id``) is masked out."""
    input_ids = input_ids.long()
    mask = (input_ids != pad_id).long() if attention_mask is None else attention_mask.long()
    return {"input_ids": input_ids, "attention_mask": mask,
            "token_type_ids": None if token_type_ids is None else token_type_ids.long()}


class SequenceClassifier(nn.Module):
    """``forward(input_ids, attention_mask, token_type_ids=None) -> logits``. Without a mask, padding
    (``pad_id``) is masked out of attention (token ids alone, as older artifacts took them)."""

    def __init__(self, model: nn.Module, pad_id: int = 0):
        super().__init__()
        self.model = model
        self.pad_id = pad_id

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(**token_inputs(input_ids, attention_mask, token_type_ids, self.pad_id)).logits


def bert_classifier(folder: str | None = None, num_labels: int = 2, vocab_size: int = 30522, hidden_size: int = 128,
                    num_layers: int = 2, num_heads: int = 4, intermediate_size: int = 512, max_positions: int = 512,
                    pad_id: int = 0, seed: int | None = None) -> SequenceClassifier:
    """A BERT classifier: from ``folder`` (local files only) or a fresh config (random init)."""
    return bert_classifier_with_new_parameters(folder, num_labels, vocab_size, hidden_size, num_layers, num_heads,
                                               intermediate_size, max_positions, pad_id, seed)[0]


def bert_classifier_with_new_parameters(
        folder: str | None = None, num_labels: int = 2, vocab_size: int = 30522, hidden_size: int = 128, num_layers: int = 2,
        num_heads: int = 4, intermediate_size: int = 512, max_positions: int = 512, pad_id: int = 0,
        seed: int | None = None) -> tuple[SequenceClassifier, list[str]]:
    """``bert_classifier`` (the zoo's builder), and the names of the parameters the pretrained folder did not hold
    (the new classifier head, randomly initialised; none without a folder). Returned beside the model, never
    stored on it."""
    tf = _transformers()
    if seed is not None:
        torch.manual_seed(seed)
    # Eager attention: exportable to ONNX with the legacy exporter, and exact under head masks.
    if folder:
        try:
            model, info = _load_quietly(tf.AutoModelForSequenceClassification.from_pretrained, folder)
        except Exception as exc:  # noqa: BLE001
            raise InputError(f"model.kwargs.folder: could not load a model from {folder}: {type(exc).__name__}: {exc}",
                             hint=_FOLDER_HINT) from exc
        return SequenceClassifier(model, pad_id), sorted(f"model.{k}" for k in info.get("missing_keys", []))
    else:
        config = tf.BertConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                               num_attention_heads=num_heads, intermediate_size=intermediate_size,
                               max_position_embeddings=max_positions, num_labels=num_labels)
        config._attn_implementation = "eager"
        model = tf.BertForSequenceClassification(config)
    return SequenceClassifier(model, pad_id), []


class SentenceEmbedder(nn.Module):
    """``forward(input_ids, attention_mask, token_type_ids=None) -> [B, H]``: the encoder's last hidden states averaged
    over the tokens the attention mask keeps, L2-normalised: how sentence-transformers' all-MiniLM-L6-v2 (the
    shared MiniLM-L6 folder's upstream) makes a sentence vector, so cosine and dot product rank alike. Without a
    mask, padding (``pad_id``) is left out, as ``SequenceClassifier`` does."""

    def __init__(self, model: nn.Module, pad_id: int = 0, normalize: bool = True):
        super().__init__()
        self.model = model
        self.pad_id = pad_id
        self.normalize = normalize

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        inputs = token_inputs(input_ids, attention_mask, token_type_ids, self.pad_id)
        mask = inputs["attention_mask"]
        assert mask is not None  # token_inputs always makes one
        hidden = self.model(**inputs).last_hidden_state
        keep = mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * keep).sum(1) / keep.sum(1).clamp_min(1.0)
        return nn.functional.normalize(pooled, p=2.0, dim=-1) if self.normalize else pooled


def bert_embedder(folder: str | None = None, vocab_size: int = 30522, hidden_size: int = 128, num_layers: int = 2,
                  num_heads: int = 4, intermediate_size: int = 512, max_positions: int = 512, pad_id: int = 0,
                  normalize: bool = True, seed: int | None = None) -> SentenceEmbedder:
    """A BERT sentence encoder (mean-pooled, normalised; ``SentenceEmbedder``) from ``folder`` (a ``BertModel`` folder,
    local files only: the shared MiniLM-L6) or a fresh config (random init, for tests). The pooler layer is left out:
    a mean-pooled embedding never reads it, and unread parameters would still be pruned, quantized and exported."""
    tf = _transformers()
    if seed is not None:
        torch.manual_seed(seed)
    if folder:
        try:
            encoder, _ = _load_quietly(tf.AutoModel.from_pretrained, folder, add_pooling_layer=False)
        except Exception as exc:  # noqa: BLE001
            raise InputError(f"model.kwargs.folder: could not load a model from {folder}: {type(exc).__name__}: {exc}",
                             hint=_FOLDER_HINT) from exc
    else:
        config = tf.BertConfig(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                               num_attention_heads=num_heads, intermediate_size=intermediate_size,
                               max_position_embeddings=max_positions)
        config._attn_implementation = "eager"  # exportable with the legacy exporter, exact under head masks
        encoder = tf.BertModel(config, add_pooling_layer=False)
    return SentenceEmbedder(encoder, pad_id, normalize)


def save_pretrained_folder(module: nn.Module, folder: Path) -> str | None:
    """Write ``module`` (a ``SequenceClassifier``) as a folder that ``transformers``'
    ``AutoModelForSequenceClassification.from_pretrained`` loads, when its shapes still fit the class.
    Returns None when written, else why not (an empty string: not a `transformers` model at all).

    Fits: every parameter has the shape the class builds from the config, after setting the layer count
    and the FFN width to what the model has (depth pruning, or FFN neurons pruned alike in every layer).
    Head pruning never fits: `transformers` 5 has one head count and one head size (hidden / heads) for all
    layers and no longer re-prunes heads on load. Written to ``FOLDER.tmp`` and renamed when complete."""
    if not isinstance(module, SequenceClassifier) or not hasattr(module.model, "save_pretrained"):
        return ""
    hf: Any = module.model
    config = copy.deepcopy(hf.config)
    layers = getattr(getattr(getattr(hf, "base_model", None), "encoder", None), "layer", None)
    if layers is not None:
        config.num_hidden_layers = len(layers)
        widths = {layer.intermediate.dense.out_features for layer in layers if hasattr(layer, "intermediate")}
        if len(widths) == 1:
            config.intermediate_size = widths.pop()
    with torch.device("meta"):
        built = {k: tuple(v.shape) for k, v in type(hf)(config).state_dict().items()}
    have = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if built != have:
        key = next((k for k in have if built.get(k) != have[k]), next(iter(set(built) - set(have)), "?"))
        return (f"{key} is {list(have.get(key, ()))} where {type(hf).__name__} builds {list(built.get(key, ()))} "
                "(`transformers` has one head count, head size and FFN width for every layer)")
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    live, hf.config = hf.config, config
    try:
        hf.save_pretrained(tmp)
    finally:
        hf.config = live
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return None
