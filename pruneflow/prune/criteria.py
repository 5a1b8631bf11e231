"""Pruning criteria: how important each channel, attention head or FFN neuron is. One small class a criterion,
with one scoring method, registered like a stage (entry point ``pruneflow.criteria``; a recipe's prune stage
names it in ``importance``), in the manner of Torch-Pruning's importance classes::

    [project.entry-points."pruneflow.criteria"]
    my_criterion = "my_pkg.criteria:MyCriterion"

    class MyCriterion(Criterion):
        def score(self, evidence: Evidence) -> Scores:
            grads = evidence.gradient()
            return {n: g.abs() for n, g in grads.items()}  # |g|, keyed like the evidence

A criterion reads an :class:`Evidence`, which the granularity gathers and which computes each term on first
use (a criterion that reads only ``magnitude`` never samples the importance batches):

- channels (``channels.py``): one tensor per parameter, shaped like it, keyed by parameter name; the
  strategy sums it over every coupled layer of a channel group (``importance.py``);
- heads and FFN neurons (``transformer.py``): one score per unit, keyed by site name. Each unit's output is
  multiplied by a mask of ones, so the mask is its "weight": ``weights()`` is ones and ``gradient()`` the
  mask's gradient, and ``|w·g|`` or ``w²·F`` mean the same for a unit as for a channel.

Higher scores are more important (the lowest go first).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from .. import registry

Scores = dict[str, torch.Tensor]


class Evidence(ABC):
    """What a criterion may read about the units being scored; each term computed once, on first use."""

    @abstractmethod
    def magnitude(self) -> Scores:
        """How large each unit's weights are: channels |w|^p per weight (``magnitude_p``); heads and FFN
        neurons the squared norm of the rows and columns that are the unit."""

    @abstractmethod
    def weights(self) -> Scores:
        """What the gradients are taken with respect to: channels the parameters, units their masks (ones)."""

    @abstractmethod
    def gradient(self) -> Scores:
        """The mean gradient of the loss over the importance batches."""

    @abstractmethod
    def fisher(self) -> Scores:
        """The mean per-sample squared gradient (the diagonal empirical Fisher, OBD's Hessian estimate)."""

    @abstractmethod
    def mixed(self, first: Scores, second: Scores, weight: float) -> Scores:
        """``weight`` of ``first`` plus ``1 - weight`` of ``second``, each divided by its mean over the whole model
        first, so two criteria's scores of different scales mix."""


class Criterion(ABC):
    """A pruning criterion: ``score(evidence)`` gives every unit's importance (higher: kept longer)."""

    #: True when scoring takes per-sample gradients (seconds to minutes on a large model): ``pruneflow doctor``
    #: then scores its trial round with ``taylor`` (which channels go does not change what traces).
    slow: ClassVar[bool] = False

    @classmethod
    def from_config(cls, config: Any) -> "Criterion":
        """The criterion a prune stage's config asks for (its options read from it). Default: no options."""
        return cls()

    @abstractmethod
    def score(self, evidence: Evidence) -> Scores:
        """Every unit's importance, keyed like ``evidence``'s terms."""


class Magnitude(Criterion):
    """Weight magnitude: |w|^p (channels), the squared norm of a unit's weights (heads, FFN neurons)."""

    def score(self, evidence: Evidence) -> Scores:
        return evidence.magnitude()


class Taylor(Criterion):
    """First-order Taylor: |w · g|, g the mean gradient over the importance batches (Molchanov et al. 2019)."""

    def score(self, evidence: Evidence) -> Scores:
        weights = evidence.weights()
        return {n: (weights[n] * g).abs() for n, g in evidence.gradient().items() if n in weights}


class Hessian(Criterion):
    """w² · F, F the diagonal empirical Fisher: Optimal Brain Damage's estimate of the loss increase (LeCun et al. 1989)."""

    slow = True

    def score(self, evidence: Evidence) -> Scores:
        weights = evidence.weights()
        return {n: weights[n].pow(2) * f for n, f in evidence.fisher().items() if n in weights}


class HessianTaylor(Criterion):
    """``hessian`` and ``taylor``, each normalised, mixed by ``hessian_weight``."""

    slow = True

    def __init__(self, hessian_weight: float = 0.5):
        self.hessian_weight = hessian_weight

    @classmethod
    def from_config(cls, config: Any) -> "Criterion":
        return cls(config.hessian_weight)

    def score(self, evidence: Evidence) -> Scores:
        # The Fisher first: its per-sample pass gives the mean gradient too, so taylor reuses it.
        hessian = Hessian().score(evidence)
        return evidence.mixed(hessian, Taylor().score(evidence), self.hessian_weight)


def criterion_for(config: Any) -> Criterion:
    """The registered criterion a prune stage's ``importance`` names, built from its config."""
    return registry.criteria.get(config.importance).from_config(config)
