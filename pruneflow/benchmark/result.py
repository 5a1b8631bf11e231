"""The outcome of one `pruneflow bench`: variants, rows of figures, the baseline, the host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .measure import BenchSettings, Row
from .variants import Variant, metric_key

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

    def row_metric(self, row: Row) -> float | None:
        """The headline as the run measured it in this row's runtime and precision (None where it did not: an
        ONNX timed in OpenVINO, an IR at a hint it was not evaluated at); the variant's one figure for a manifest
        that does not say where it measured."""
        v = row.lane.variant
        if not v.measured_in:
            return v.metric_value
        precision = row.lane.inference_precision if row.lane.runtime == "openvino" else None
        return v.measured_in.get(metric_key(row.lane.runtime, precision))

    def row_metric_delta(self, row: Row) -> float | None:
        """``row_metric`` − the baseline's headline (as its run measured it); None unless both have the same one."""
        value, base = self.row_metric(row), self.baseline
        if value is None or base.metric_value is None or row.lane.variant.metric != base.metric:
            return None
        return value - base.metric_value

    def metric_note(self) -> str | None:
        """What a blank headline cell means, when some row has one: the run measured that artifact, elsewhere."""
        blank = sorted({f"{r.lane.variant.name} in {r.lane.label}" for r in self.rows
                        if r.lane.variant.metric_value is not None and self.row_metric(r) is None})
        if not blank:
            return None
        return (f"{self.metric_name()}: as each run measured it in that runtime and precision; – where it did not "
                f"({', '.join(blank[:3])}{', ...' if len(blank) > 3 else ''}): a figure from another runtime or "
                "precision is not shown as this one's")

    def metric_name(self) -> str:
        """The headline metric the variants carry (``metric`` when they carry several, or none)."""
        names = {v.metric for v in self.variants if v.metric}
        return names.pop() if len(names) == 1 else "metric"

    def cores(self) -> int:
        """The cores one inference stream used: the runtime threads asked for, else every usable CPU."""
        return int(self.settings.threads or self.host["cpu"]["usable_cpus"] or 1)

    def economics(self, row: Row) -> dict[str, float | None]:
        """``throughput_per_core`` (samples/s per core used) and, given ``--price-per-hour``, ``cost_per_million``
        inferences at that throughput on a machine busy with this stream alone."""
        if row.stats is None:
            return {"throughput_per_core": None, "cost_per_million": None}
        price = self.settings.price_per_hour
        throughput = row.stats.throughput
        return {"throughput_per_core": throughput / self.cores(),
                "cost_per_million": price / (throughput * 3600) * 1e6 if price and throughput else None}

    def under_budget(self) -> list[dict[str, Any]]:
        """Per artifact and runtime: the batch size of highest throughput whose p99 is within ``--p99-budget-ms``,
        with its figures; or why none is (``best_under_budget``)."""
        budget = self.settings.p99_budget_ms
        if budget is None:
            return []
        rows = [{"variant": r.lane.variant.name, "runtime_label": r.lane.label, "batch": r.batch,
                 "p99_ms": r.stats.p99_ms if r.stats else None, "throughput": r.stats.throughput if r.stats else None,
                 **self.economics(r)} for r in self.rows]
        return best_under_budget(rows, budget)


def host_name(host: dict[str, Any]) -> str:
    """``--host-label`` when one was given, else the CPU model."""
    return str(host.get("label") or (host.get("cpu") or {}).get("model") or "unknown host")


def best_under_budget(rows: list[dict[str, Any]], budget: float) -> list[dict[str, Any]]:
    """Per ``(variant, runtime_label)`` of bench rows (dicts as in the JSON): the timed batch of highest throughput whose
    p99 is within ``budget`` ms, with its throughput per core and cost per million; or ``batch: None`` and why."""
    lanes: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        lanes.setdefault((row["variant"], row["runtime_label"]), []).append(row)
    chosen = []
    for (variant, label), lane in lanes.items():
        timed = [r for r in lane if r.get("p99_ms") is not None]
        fits = [r for r in timed if r["p99_ms"] <= budget]
        entry: dict[str, Any] = {"variant": variant, "runtime_label": label, "p99_budget_ms": budget}
        if fits:
            best = max(fits, key=lambda r: r["throughput"])
            entry.update({k: best.get(k) for k in ("batch", "p99_ms", "throughput", "throughput_per_core",
                                                     "cost_per_million")})
        else:
            fastest = min(timed, key=lambda r: r["p99_ms"], default=None)
            entry.update(batch=None, why=f"no batch size timed has p99 within {budget:g} ms" + (
                f" (smallest: {fastest['p99_ms']:.3g} ms at batch {fastest['batch']})" if fastest else ""))
        chosen.append(entry)
    return chosen
