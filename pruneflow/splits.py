"""The data a run holds in memory: a ``Split`` (inputs and targets) and the ``DataBundle`` of a recipe's splits.

Kernel records, like ``Artifact``: ``RunState`` carries a ``DataBundle`` and every stage reads it, while
loading one from a source (``load_data``) is a service in ``data.py``. Augmentation is written in torch on
whole batches: datasets' own transforms run per sample in Python and would dominate CPU time.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from .errors import InputError
from .inputs import Inputs, lengths, take, trim
from .recipe.models import AugmentSpec

if TYPE_CHECKING:
    from .tabular import TabularSchema


@dataclass
class Split:
    """Preprocessed inputs and integer labels of one split. ``x`` is one float32 tensor, or forward's
    parameter names mapped to tensors (text: ``input_ids``, ``attention_mask``[, ``token_type_ids``])."""

    x: Inputs
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)

    def batches(self, batch_size: int, by_length: bool = False) -> Iterator[tuple[Inputs, torch.Tensor]]:
        """Batches in order (``by_length``: text sorted by length first, which pads less; every sample
        still comes once). Text batches are cut to their longest row."""
        n = lengths(self.x) if by_length else None
        order = torch.argsort(n, stable=True) if n is not None else None
        for start in range(0, len(self), batch_size):
            idx = order[start : start + batch_size] if order is not None else slice(start, start + batch_size)
            yield trim(take(self.x, idx)), self.y[idx]


class TrainStream(ABC):
    """A training split too large to hold: read from its source once an epoch, in shuffled batches (a streamed click
    log: ``tabular_stream.StreamedTrain``). ``DataBundle.train`` then holds a uniform sample of it (what calibration,
    pruning importance and doctor read), and the epochs read this."""

    @abstractmethod
    def __len__(self) -> int:
        """Rows of the whole training split (every rank's together)."""

    @abstractmethod
    def epoch(self, batch_size: int, generator: torch.Generator) -> Iterator[tuple[Inputs, torch.Tensor]]:
        """One epoch of shuffled batches of this stream's rows (a rank's own rows once ``shard`` cut them)."""

    @abstractmethod
    def shard(self, rank: int, world: int) -> "TrainStream":
        """The part rank ``rank`` of ``world`` reads: disjoint, together the whole split, each as many batches."""


@dataclass
class DataBundle:
    train: Split | None
    eval: Split
    num_classes: int
    input_shape: tuple[int, ...]
    class_names: list[str] | None = None
    augment: AugmentSpec = field(default_factory=AugmentSpec)
    #: Per-channel value that raw zero pixels map to after normalisation (the crop padding fill).
    pad_value: torch.Tensor | None = None
    description: str = ""
    #: Tabular click data: the fitted vocabularies and statistics (``tabular.TabularSchema``), else None.
    tabular: "TabularSchema | None" = None
    #: A training split streamed from its source each epoch (``train`` is then a sample of it), else None.
    stream: TrainStream | None = None

    @property
    def train_rows(self) -> int:
        """Rows an epoch covers: the stream's, else the train split's (0 without one)."""
        return len(self.stream) if self.stream is not None else len(self.train) if self.train is not None else 0

    def train_batches(self, batch_size: int, generator: torch.Generator, augment: bool = True):
        """Shuffled, augmented training batches (one epoch): from the stream when there is one."""
        if self.stream is not None:
            yield from self.stream.epoch(batch_size, generator)
            return
        if self.train is None:
            raise InputError("this recipe's data has no training split", hint="set data.path or data.train")
        order = torch.randperm(len(self.train), generator=generator)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            x, y = trim(take(self.train.x, idx)), self.train.y[idx]
            if augment and isinstance(x, torch.Tensor):
                x = apply_augment(x, self.augment, generator, self.pad_value)
            yield x, y


def apply_augment(x: torch.Tensor, spec: AugmentSpec, gen: torch.Generator, pad_value: torch.Tensor | None) -> torch.Tensor:
    """Random crop after padding, and horizontal flip, on a whole NCHW batch at once."""
    if x.dim() != 4:
        return x
    b, c, h, w = x.shape
    if spec.crop_padding:
        p = spec.crop_padding
        padded = x.new_empty(b, c, h + 2 * p, w + 2 * p)
        padded[:] = (pad_value if pad_value is not None else torch.zeros(c)).view(1, c, 1, 1)
        padded[:, :, p : p + h, p : p + w] = x
        oy = torch.randint(0, 2 * p + 1, (b,), generator=gen)
        ox = torch.randint(0, 2 * p + 1, (b,), generator=gen)
        rows = (oy[:, None] + torch.arange(h))[:, :, None]  # B,H,1
        cols = (ox[:, None] + torch.arange(w))[:, None, :]  # B,1,W
        x = padded.permute(0, 2, 3, 1)[torch.arange(b)[:, None, None], rows, cols].permute(0, 3, 1, 2).contiguous()
    if spec.hflip:
        flip = torch.rand(b, generator=gen) < 0.5
        x = x.clone() if not spec.crop_padding else x
        x[flip] = x[flip].flip(-1)
    return x
