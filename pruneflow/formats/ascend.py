"""Ascend OM (``.om``): ATC's offline model for one Ascend SoC. No runtime here loads it (CANN's ACL runs it on the
NPU), so ``bench`` lists it without timing it."""

from __future__ import annotations

from .base import Format


class OmFormat(Format):
    name = "ascend"
    title = "Ascend OM"
    suffixes = (".om",)
