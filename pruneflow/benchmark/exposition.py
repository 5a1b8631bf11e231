"""The bench result as strict JSON and as Prometheus text (for node-exporter's textfile collector).

Prometheus text exposition format: ``# HELP`` and ``# TYPE`` before each metric family, one sample a line,
``name{label="value",...} number``, label values with ``\\``, ``"`` and newlines escaped, no timestamps
(the textfile collector refuses them). Written atomically, as the collector may read at any moment. Times are in
seconds, as Prometheus names them (``pruneflow_latency_seconds``; the JSON keeps milliseconds, ``p50_ms``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from .result import BenchResult
    from .measure import Row

QUANTILES = (("0.5", "p50_ms"), ("0.9", "p90_ms"), ("0.99", "p99_ms"))

METRICS = {
    "pruneflow_latency_seconds": "Latency of one call on one batch in seconds, by quantile (pruneflow bench, timed "
                                 "interleaved).",
    "pruneflow_throughput": "Samples per second at the median latency (pruneflow bench).",
    "pruneflow_throughput_per_core": "Samples per second per core the inference stream used (pruneflow bench).",
    "pruneflow_cost_per_million": "Cost of a million inferences at this throughput and the host's --price-per-hour.",
    "pruneflow_best_batch": "The batch size of highest throughput whose p99 is within the budget (label "
                            "p99_budget_seconds).",
    "pruneflow_speedup": "Baseline median latency / this variant's, same runtime and batch (pruneflow bench).",
    "pruneflow_benchmark_app_throughput": "Samples per second reported by OpenVINO's benchmark_app on the same IR.",
    "pruneflow_size_bytes": "Size on disk of the artifact with its companion files (pruneflow bench).",
    "pruneflow_metric": "The run's headline metric on the eval split (label `metric` names it, `direction` says whether "
                        "higher or lower is better), from the run's manifest (pruneflow bench).",
}


def write_files(paths: "tuple[Path | None, ...]", renders: "tuple[Callable[[], str], ...]") -> "list[Path]":
    """Each render into its path where one is given (``--json``, ``--html``, ``--prometheus``), atomically; the paths
    written, in that order. A render runs only for a path asked for."""
    from ..artifacts import write_text_atomic

    written = []
    for path, render in zip(paths, renders):
        if path is not None:
            write_text_atomic(path, render())
            written.append(path)
    return written


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
    from .result import FORMAT, row_record

    variants = [{**v.as_dict(), "timed_on": result.inputs.get(v.name), "size_reduction": result.size_reduction(v),
                 "metric_delta": result.metric_delta(v)} for v in result.variants]
    return strict({"format": FORMAT, "exit_code": result.exit_code(), "host": result.host, "settings": result.settings.as_dict(),
                   "baseline": result.baseline.name, "benchmark_app": result.benchmark_app, "variants": variants,
                   "results": [row_record(row, result) for row in result.rows], "under_budget": result.under_budget()})


def escape_label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _sample(name: str, labels: dict[str, object], value: float) -> str:
    body = ",".join(f'{k}="{escape_label(v)}"' for k, v in labels.items())
    return f"{name}{{{body}}} {value!r}"


def prometheus_text(result: "BenchResult") -> str:
    """Every figure as gauges labelled host, model, variant, runtime, precision, batch (and quantile)."""
    from .result import host_name

    doc = result_json(result)
    return exposition([(host_name(doc["host"]), doc["results"], doc["under_budget"])])


def exposition(hosts: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]]]]) -> str:
    """The text format for ``(host name, result rows, under_budget entries)`` per host (JSON dicts): one bench, or
    several hosts' merged (``bench --merge``)."""
    samples: dict[str, list[str]] = {name: [] for name in METRICS}
    for host, rows, chosen in hosts:
        for name, labels, value in _samples(host, rows, chosen):
            samples[name].append(_sample(name, labels, float(value)))
    lines = []
    for name, help_text in METRICS.items():
        if samples[name]:
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", *samples[name]]
    return "\n".join(lines) + "\n"


def _samples(host: str, rows: list[dict[str, Any]],
             chosen: list[dict[str, Any]]) -> Iterator[tuple[str, dict[str, object], float]]:
    variants: dict[str, dict[str, Any]] = {}
    for row in rows:
        labels: dict[str, object] = {"host": host, "model": row["model"], "variant": row["label"],
                                     "precision": row["precision"] or ""}
        variants.setdefault(row["variant"], {"labels": labels, "row": row})
        if row.get("p50_ms") is None:
            continue
        labels = {**labels, "runtime": row["runtime_label"], "batch": row["batch"]}
        for quantile, key in QUANTILES:
            yield "pruneflow_latency_seconds", {**labels, "quantile": quantile}, row[key] / 1000
        for name, key in (("pruneflow_throughput", "throughput"), ("pruneflow_throughput_per_core", "throughput_per_core"),
                          ("pruneflow_cost_per_million", "cost_per_million"), ("pruneflow_speedup", "speedup")):
            if row.get(key) is not None:
                yield name, labels, row[key]
        if (row.get("benchmark_app") or {}).get("throughput") is not None:
            yield "pruneflow_benchmark_app_throughput", labels, row["benchmark_app"]["throughput"]
    for entry in variants.values():
        labels, row = entry["labels"], entry["row"]
        if row.get("size_bytes") is not None:
            yield "pruneflow_size_bytes", labels, row["size_bytes"]
        value = row.get("variant_metric_value", row.get("metric_value"))  # the run's figure (older JSON: per row)
        if value is not None:
            yield "pruneflow_metric", {**labels, "metric": row["metric"], "direction": row["metric_direction"] or ""}, value
    for e in chosen:
        if e.get("batch") is not None and e["variant"] in variants:
            labels = {**variants[e["variant"]]["labels"], "runtime": e["runtime_label"],
                      "p99_budget_seconds": f"{e['p99_budget_ms'] / 1000:g}"}
            yield "pruneflow_best_batch", labels, e["batch"]
