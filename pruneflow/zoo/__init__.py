"""Architectures shipped in code. A recipe names one as ``model.factory: resnet20``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from torch import nn

from .bags import dlrm_bags
from .digits import digits_cnn
from .hf import bert_classifier, bert_classifier_with_new_parameters, bert_embedder
from .fcn import tiny_fcn, tiny_unet
from .mlp import mlp
from .mmoe import mmoe
from .ranker import deepfm, dlrm
from .resnet_cifar import resnet20, resnet32, resnet44, resnet56
from .sequence import gru4rec, sasrec


@dataclass(frozen=True)
class ZooEntry:
    factory: Callable[..., nn.Module]
    input_shape: tuple[int, ...] | None  # None: taken from the data
    description: str
    #: What the run builds with, when the model may come with newly initialised parameters: the factory's
    #: arguments in, ``(model, names of the parameters no pretrained weights set)`` out (``models.build_model_with_new_parameters``).
    build: Callable[..., tuple[nn.Module, list[str]]] | None = None


ZOO: dict[str, ZooEntry] = {
    "digits_cnn": ZooEntry(digits_cnn, (1, 8, 8), "4-conv CNN for scikit-learn's 8x8 digits"),
    "resnet20": ZooEntry(resnet20, (3, 32, 32), "CIFAR ResNet-20, option-A shortcuts (0.27 M params)"),
    "resnet32": ZooEntry(resnet32, (3, 32, 32), "CIFAR ResNet-32, option-A shortcuts (0.46 M params)"),
    "resnet44": ZooEntry(resnet44, (3, 32, 32), "CIFAR ResNet-44, option-A shortcuts (0.66 M params)"),
    "resnet56": ZooEntry(resnet56, (3, 32, 32), "CIFAR ResNet-56, option-A shortcuts (0.85 M params)"),
    "mlp": ZooEntry(mlp, None, "Multilayer perceptron for feature vectors (in_features, hidden, layers, out_features)"),
    "deepfm": ZooEntry(deepfm, None, "DeepFM click ranker: ids [B, F] through embedding tables + dense [B, D] -> one logit "
                       "(cardinalities and num_dense come from data.features)"),
    "dlrm": ZooEntry(dlrm, None, "DLRM click ranker: bottom MLP, pairwise dot products, top MLP (cardinalities and "
                     "num_dense come from data.features)"),
    "mmoe": ZooEntry(mmoe, None, "Multi-task ranker (MMoE): shared id tables, expert MLPs, a softmax gate and a tower per task "
                     "-> {task: logit} (tasks: [click, finish] by default; cardinalities and num_dense come from data.features)"),
    "sasrec": ZooEntry(sasrec, None, "SASRec sequential recommender: the last items (int64 [B, L], 0 = padding) through causal "
                       "self-attention blocks, scored against the tied item table -> [B, num_items] (for task: next_item)"),
    "gru4rec": ZooEntry(gru4rec, None, "GRU4Rec session recommender: item embedding, nn.GRU, a Linear over the catalogue -> "
                        "[B, num_items] (for task: next_item)"),
    "dlrm_bags": ZooEntry(dlrm_bags, None, "DLRM click ranker with multi-hot bags: ids [B, F] through nn.Embedding tables, "
                          "bags [B, N, L] (0 = padding) through nn.EmbeddingBag tables, dense [B, D] through a bottom MLP; "
                          "pairwise dot products, top MLP -> one logit (cardinalities, bag_cardinalities, bag_length, num_dense)"),
    "tiny_unet": ZooEntry(tiny_unet, None, "Tiny U-Net for masks: ConvTranspose upsampling, skip connections (in_channels, "
                          "num_classes, width)"),
    "tiny_fcn": ZooEntry(tiny_fcn, None, "Tiny fully convolutional net for masks (in_channels, num_classes, width)"),
    "bert_classifier": ZooEntry(bert_classifier, None, "BERT-style classifier from a local folder or a config (needs transformers)",
                                bert_classifier_with_new_parameters),
    "bert_embedder": ZooEntry(bert_embedder, None, "BERT sentence encoder, mean-pooled and L2-normalised (a local folder such as "
                              "MiniLM-L6, or a config; needs transformers): for task: embedding"),
}

__all__ = ["ZOO", "ZooEntry", "bert_classifier", "bert_embedder", "deepfm", "digits_cnn", "dlrm", "dlrm_bags", "gru4rec", "mlp", "mmoe", "sasrec", "tiny_fcn", "tiny_unet", "resnet20", "resnet32", "resnet44", "resnet56"]
