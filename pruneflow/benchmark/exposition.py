"""The bench result as strict JSON and as Prometheus text (for node-exporter's textfile collector).

Prometheus text exposition format: ``# HELP`` and ``# TYPE`` before each metric family, one sample a line,
``name{label="value",...} number``, label values with ``\\``, ``"`` and newlines escaped, no timestamps
(the textfile collector refuses them). Written atomically, as the collector may read at any moment.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:
    from .result import BenchResult
    from .measure import Row

QUANTILES = (("0.5", "p50_ms"), ("0.9", "p90_ms"), ("0.99", "p99_ms"))

METRICS = {
    "pruneflow_latency_ms": "Latency of one call on one batch in milliseconds, by quantile (pruneflow bench, timed interleaved).",
    "pruneflow_throughput": "Samples per second at the median latency (pruneflow bench).",
    "pruneflow_speedup": "Baseline median latency / this variant's, same runtime and batch (pruneflow bench).",
    "pruneflow_benchmark_app_throughput": "Samples per second reported by OpenVINO's benchmark_app on the same IR.",
    "pruneflow_size_bytes": "Size on disk of the artifact with its companion files (pruneflow bench).",
    "pruneflow_metric": "The run's headline metric on the eval split (label `metric` names it, `direction` says whether "
                        "higher or lower is better), from the run's manifest (pruneflow bench).",
}


def strict(value: Any) -> Any:
    """JSON without NaN or Infinity (null instead), tuples as lists: what any JSON parser accepts."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def result_json(result: "BenchResult") -> dict[str, Any]:
    from .result import FORMAT

    variants = [{**v.as_dict(), "timed_on": result.inputs.get(v.name), "size_reduction": result.size_reduction(v),
                 "metric_delta": result.metric_delta(v)} for v in result.variants]
    return strict({"format": FORMAT, "exit_code": 0, "host": result.host, "settings": result.settings.as_dict(),
                   "baseline": result.baseline.name, "benchmark_app": result.benchmark_app, "variants": variants,
                   "results": [row_json(row, result) for row in result.rows], "under_budget": result.under_budget()})


def row_json(row: "Row", result: "BenchResult") -> dict[str, Any]:
    lane, variant, stats = row.lane, row.lane.variant, row.stats
    figures = stats.as_dict() if stats is not None else dict.fromkeys(("runs", "p50_ms", "p90_ms", "p99_ms", "mean_ms",
                                                                        "throughput"))
    figures.pop("batch", None)
    return {"variant": variant.name, "model": variant.model, "label": variant.label, "precision": variant.precision,
            "runtime": lane.runtime, "device": lane.executor.device if lane.executor else None,
            "runtime_label": lane.label, "precision_hint": lane.hint or ("default" if lane.runtime == "openvino" else None),
            "inference_precision": lane.inference_precision if lane.runtime == "openvino" else None,
            "batch": row.batch, "shape": row.shape, **figures, "size_bytes": variant.size_bytes,
            "metric": variant.metric, "metric_value": variant.metric_value, "metric_direction": variant.metric_direction,
            "speedup": row.speedup, "baseline_runtime": row.baseline_runtime,
            "size_reduction": result.size_reduction(variant), "metric_delta": result.metric_delta(variant),
            "benchmark_app": row.benchmark_app, "error": row.error, **result.economics(row)}


def escape_label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _sample(name: str, labels: dict[str, object], value: float) -> str:
    body = ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items())
    return f"{name}{{{body}}} {value!r}"


def prometheus_text(result: "BenchResult") -> str:
    """Every figure as gauges labelled model, variant, runtime, precision, batch (and quantile)."""
    samples: dict[str, list[str]] = {name: [] for name in METRICS}
    for name, labels, value in _samples(result):
        samples[name].append(_sample(name, labels, float(value)))
    lines = []
    for name, help_text in METRICS.items():
        if samples[name]:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", *samples[name]]
    return "\n".join(lines) + "\n"


def _samples(result: "BenchResult") -> Iterator[tuple[str, dict[str, object], float]]:
    for row in result.rows:
        if row.stats is None:
            continue
        v = row.lane.variant
        labels: dict[str, object] = {"model": v.model, "variant": v.label, "runtime": row.lane.label,
                                     "precision": v.precision or "", "batch": row.batch}
        for quantile, key in QUANTILES:
            yield "pruneflow_latency_ms", {**labels, "quantile": quantile}, getattr(row.stats, key)
        yield "pruneflow_throughput", labels, row.stats.throughput
        if row.speedup is not None:
            yield "pruneflow_speedup", labels, row.speedup
        if row.benchmark_app and row.benchmark_app.get("throughput") is not None:
            yield "pruneflow_benchmark_app_throughput", labels, row.benchmark_app["throughput"]
    for v in result.variants:
        labels = {"model": v.model, "variant": v.label, "precision": v.precision or ""}
        if v.size_bytes is not None and v.status == "built":
            yield "pruneflow_size_bytes", labels, v.size_bytes
        if v.metric_value is not None:
            yield "pruneflow_metric", {**labels, "metric": v.metric, "direction": v.metric_direction or ""}, v.metric_value
