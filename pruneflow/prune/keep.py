"""The one rule of how many channels a pruned layer keeps (torch-pruning's rounding hook, the importance's
protected floor and the cap on one step all ask it); imports nothing else of the prune package."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class KeepRule:
    """How many output channels a layer keeps: a multiple of ``round_to``, at least its floor.

    The one place for the rule: torch-pruning's rounding hook (``pruned``), the importance's protected
    floor channels (``floor``) and the cap on one step (``capped``) all ask here.
    """

    round_to: int | None = None
    max_layer_ratio: float = 0.9

    @property
    def step(self) -> int:
        """The multiple kept (1 when unset)."""
        return self.round_to or 1

    def floor(self, width: int) -> int:
        """Output channels a layer of initial ``width`` keeps at least: (1 - max_layer_ratio) of it, in round_to steps."""
        floor = math.ceil(width * (1 - self.max_layer_ratio))
        return math.ceil(floor / self.round_to) * self.round_to if self.round_to else floor

    def pruned(self, n_pruned: int, current: int) -> int:
        """torch-pruning's rounding hook: the channels to prune when it asks for ``n_pruned`` of ``current``.

        torch-pruning rounds the count kept *down* to a multiple: one channel under the threshold in a
        64-channel layer removes 8, so the smallest step of a round is already large and the ranking decides
        little. We round the count kept to the *nearest* multiple (at least one multiple), so a layer loses
        round_to channels only when about half of them fall under it.
        """
        keep = current - n_pruned
        keep = max(self.step, math.floor(keep / self.step + 0.5) * self.step)
        return max(current - keep, 0)

    def capped(self, current: int, n_pruned: int, width: int) -> int:
        """At most how many of ``current`` channels one step may prune from a layer of initial ``width``."""
        keep = max(current - n_pruned, self.floor(width))
        if self.round_to:
            keep = min(current, math.ceil(keep / self.round_to) * self.round_to)
        return current - keep
