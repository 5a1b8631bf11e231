"""The outcome of one `pruneflow bench`: variants, rows of figures, the baseline, the host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .measure import BenchSettings, Row
from .variants import Variant

FORMAT = "pruneflow-bench/1"


@dataclass
class BenchResult:
    host: dict[str, Any]
    settings: BenchSettings
    variants: list[Variant]
    rows: list[Row]
    baseline: Variant
    #: Variant name → what it was timed on (the eval split, or random values of its input shape).
    inputs: dict[str, str]
    #: ``{"available": bool, "how": str}``: whether OpenVINO's benchmark_app was found (and asked for).
    benchmark_app: dict[str, Any]

    def size_reduction(self, variant: Variant) -> float | None:
        """Baseline size / variant size (4.0 = a quarter of the bytes)."""
        base, own = self.baseline.size_bytes, variant.size_bytes
        return base / own if base and own else None

    def metric_delta(self, variant: Variant) -> float | None:
        """Variant's headline metric − the baseline's (from the runs' manifests); None unless both have the same one."""
        base = self.baseline
        if variant.metric_value is None or base.metric_value is None or variant.metric != base.metric:
            return None
        return variant.metric_value - base.metric_value

    def metric_name(self) -> str:
        """The headline metric the variants carry (``metric`` when they carry several, or none)."""
        names = {v.metric for v in self.variants if v.metric}
        return names.pop() if len(names) == 1 else "metric"
