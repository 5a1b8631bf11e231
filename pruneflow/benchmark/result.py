"""The outcome of one `pruneflow bench`: variants, rows of figures, the baseline, the host."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..formats import runtime_named
from ..units import dataframe, human_bytes, text_table
from .measure import MIN_P99_RUNS, BenchSettings, Row
from .variants import Variant, metric_key

FORMAT = "pruneflow-bench/1"


@dataclass(repr=False)
class BenchResult:
    """What `pruneflow bench` measured. ``print(result)`` shows one line a lane (artifact x runtime) with its p50 and
    speed-up at each batch size; ``to_records()`` every figure of every row, as the JSON's ``results``;
    ``to_pandas()`` the same as a DataFrame::

        result = pruneflow.bench(["runs/quickstart"], batches=[1, 32])
        print(result)                                   # a short table
        df = result.to_pandas()                         # p50_ms, p99_ms, throughput, speedup, size_bytes, ...
    """

    host: dict[str, Any]
    settings: BenchSettings
    variants: list[Variant]
    rows: list[Row]
    baseline: Variant
    #: Variant name → what it was timed on (the eval split, or random values of its input shape).
    inputs: dict[str, str]
    #: ``{"available": bool, "how": str}``: whether OpenVINO's benchmark_app was found (and asked for).
    benchmark_app: dict[str, Any]

    def to_records(self) -> list[dict[str, Any]]:
        """One dict per (artifact, runtime, batch): every figure, as ``pruneflow bench --json`` writes ``results``."""
        return [row_record(row, self) for row in self.rows]

    def to_pandas(self):
        """``to_records()`` as a pandas DataFrame (pandas is not a dependency of pruneflow)."""
        return dataframe(self.to_records())

    def lanes(self) -> list[dict[str, Any]]:
        """One dict per artifact x runtime: size, headline metric, and p50 (ms) and speed-up at each batch size."""
        several = len({v.model for v in self.variants}) > 1
        found: dict[tuple[str, str], dict[str, Any]] = {}
        notes: dict[tuple[str, str], list[str]] = {}
        for row in self.rows:
            name = row.lane.variant.name if several else row.lane.variant.label
            key = (name, row.lane.label)
            lane = found.setdefault(key, {"artifact": name, "runtime": row.lane.label,
                                          "size": human_bytes(row.lane.variant.size_bytes), self.metric_name(): self.row_metric(row)})
            lane[f"b{row.batch} p50 ms"] = f"{row.stats.p50_ms:.3g}" if row.stats else ""
            lane[f"b{row.batch} speed-up"] = f"{row.speedup:.2f}x" if row.speedup else ""
            notes.setdefault(key, []).extend(
                [f"b{row.batch} NOISY"] * bool(row.noisy and row.stats) + [f"b{row.batch}: {row.error}"] * bool(row.error))
        return [{**lane, "note": ", ".join(notes[key])} for key, lane in found.items()]

    def __str__(self) -> str:
        cpu = self.host.get("cpu") or {}
        runs = sorted({r.stats.runs for r in self.rows if r.stats is not None})
        lines = [f"BenchResult: {len(self.variants)} artifacts, batches {', '.join(map(str, self.settings.batches))}; "
                 f"speed-up against {self.baseline.name} in the same runtime",
                 text_table(self.lanes()),
                 f"host: {host_name(self.host)}, {cpu.get('usable_cpus')} CPUs; threads {self.settings.threads or 'runtime default'}"
                 + (f"; {'-'.join(map(str, sorted({runs[0], runs[-1]})))} timed runs per batch" if runs else ""),
                 f"every figure: .to_records() ({len(self.rows)} rows) or .to_pandas(); `pruneflow bench` prints the full tables"]
        return "\n".join(lines)

    __repr__ = __str__

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
        precision = row.lane.inference_precision if runtime_named(row.lane.runtime).takes_precision_hint else None
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
        """The cores one inference stream used: the runtime threads asked for (at most every usable CPU), else every
        usable CPU."""
        return lane_cores(self.settings.threads, self.host)

    def economics(self, row: Row) -> dict[str, float | None]:
        """``cores`` the stream used, ``throughput_per_core`` (samples/s per core) and, given ``--price-per-hour``,
        ``cost_per_million`` inferences at that throughput on those cores: the machine's price times the share of its
        usable CPUs the stream takes (the rest can serve other streams), not the whole machine billed to one stream."""
        if row.stats is None:
            return {"cores": None, "throughput_per_core": None, "cost_per_million": None}
        cores, throughput = self.cores(), row.stats.throughput
        return {"cores": cores, "throughput_per_core": throughput / cores,
                "cost_per_million": cost_per_million(self.settings.price_per_hour, throughput, cores, self.host)}

    def meets_budget(self) -> bool | None:
        """Whether some artifact x runtime has a batch whose p99 is within ``--p99-budget-ms`` (None: no budget).
        False is exit 1, so CI can gate on it."""
        return budget_met(self.under_budget()) if self.settings.p99_budget_ms is not None else None

    def exit_code(self) -> int:
        return 1 if self.meets_budget() is False else 0

    def under_budget(self) -> list[dict[str, Any]]:
        """Per artifact and runtime: the batch size of highest throughput whose p99 is within ``--p99-budget-ms``,
        with its figures; or why none is (``best_under_budget``)."""
        budget = self.settings.p99_budget_ms
        if budget is None:
            return []
        rows = [{"variant": r.lane.variant.name, "runtime_label": r.lane.label, "batch": r.batch,
                 "p99_ms": r.stats.p99_ms if r.stats else None, "throughput": r.stats.throughput if r.stats else None,
                 "runs": r.stats.runs if r.stats else None, "noisy": r.noisy, **self.economics(r)} for r in self.rows]
        return best_under_budget(rows, budget)


def lane_cores(threads: int | None, host: dict[str, Any]) -> int:
    """Cores a stream of ``threads`` runtime threads uses on ``host`` (0 or None: the runtime's own choice, every
    usable CPU); never more than the host has."""
    usable = max(1, int((host.get("cpu") or {}).get("usable_cpus") or 1))
    return min(int(threads), usable) if threads else usable


def cost_per_million(price: float | None, throughput: float | None, cores: int, host: dict[str, Any]) -> float | None:
    """What a million inferences cost at ``throughput`` samples/s on ``cores`` of ``host``, priced ``price`` an hour
    for the whole machine: the lane pays its share of the usable CPUs (``bench --load`` prices its lanes alike)."""
    if not price or not throughput:
        return None
    share = cores / max(1, int((host.get("cpu") or {}).get("usable_cpus") or 1))
    return price * share / (throughput * 3600) * 1e6


def budget_met(chosen: list[dict[str, Any]]) -> bool:
    """Some entry of ``best_under_budget`` has a batch within the budget."""
    return any(e.get("batch") is not None for e in chosen)


def host_name(host: dict[str, Any]) -> str:
    """``--host-label`` when one was given, else the CPU model."""
    return str(host.get("label") or (host.get("cpu") or {}).get("model") or "unknown host")


#: A p99 within this share of the budget (either side) is a close call: repeated runs of ~200 samples move a p99 a few
#: per cent, so which batch is the best one can flip (seen on ResNet-56: batch 8's p99 20.3 ms, then 19.3 ms).
CLOSE_TO_BUDGET = 0.10


def best_under_budget(rows: list[dict[str, Any]], budget: float) -> list[dict[str, Any]]:
    """Per ``(variant, runtime_label)`` of bench rows (dicts as in the JSON): the timed batch of highest throughput whose
    p99 is within ``budget`` ms, with its throughput per core and cost per million; or ``batch: None`` and why.

    The entry also says whether that batch is the largest one timed (``largest_timed``, with a ``warning``: a larger
    batch may do better still), and whether its figures are ``noisy`` or its p99 ``p99_low_confidence``."""
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
                                                     "cost_per_million", "runs")})
            entry.update(noisy=bool(best.get("noisy")), p99_low_confidence=bool(
                best.get("runs") is not None and best["runs"] < MIN_P99_RUNS))
            entry["largest_timed"] = best["batch"] == max(r["batch"] for r in timed)
            near = [r for r in timed if r["batch"] >= best["batch"] and abs(r["p99_ms"] / budget - 1) <= CLOSE_TO_BUDGET]
            if near:  # a p99 this close to the budget falls either side of it between runs: the choice is not stable
                entry.update(noisy=True, close_call=True, warning=(
                    "; ".join(f"batch {r['batch']}'s p99 {r['p99_ms']:.3g} ms" for r in near)
                    + f" within {CLOSE_TO_BUDGET:.0%} of the budget: the best batch may change between runs (NOISY)"))
            if entry["largest_timed"]:
                entry["warning"] = (entry["warning"] + "; " if entry.get("warning") else "") + (
                    f"batch {best['batch']} is the largest timed and within the budget: a larger batch may "
                    f"do better (time --batch ...,{best['batch']},{2 * best['batch']},{4 * best['batch']})")
        else:
            fastest = min(timed, key=lambda r: r["p99_ms"], default=None)
            entry.update(batch=None, why=f"no batch size timed has p99 within {budget:g} ms" + (
                f" (smallest: {fastest['p99_ms']:.3g} ms at batch {fastest['batch']})" if fastest else ""))
        chosen.append(entry)
    return chosen


def row_record(row: Row, result: BenchResult) -> dict[str, Any]:
    """One row of a bench as a flat dict (the JSON's ``results``, ``BenchResult.to_records``)."""
    lane, variant, stats = row.lane, row.lane.variant, row.stats
    hinted = runtime_named(lane.runtime).takes_precision_hint
    figures = stats.as_dict() if stats is not None else dict.fromkeys(("runs", "p50_ms", "p90_ms", "p99_ms", "mean_ms",
                                                                        "throughput"))
    figures.pop("batch", None)
    return {"variant": variant.name, "model": variant.model, "label": variant.label, "precision": variant.precision,
            "runtime": lane.runtime, "device": lane.executor.device if lane.executor else None,
            "runtime_label": lane.label, "precision_hint": lane.hint or ("default" if hinted else None),
            "inference_precision": lane.inference_precision if hinted else None,
            "batch": row.batch, "shape": row.shape, **figures, "size_bytes": variant.size_bytes,
            "metric": variant.metric, "metric_value": result.row_metric(row), "metric_direction": variant.metric_direction,
            "variant_metric_value": variant.metric_value, "speedup": row.speedup, "baseline_runtime": row.baseline_runtime,
            "size_reduction": result.size_reduction(variant), "metric_delta": result.row_metric_delta(row),
            "benchmark_app": row.benchmark_app, "error": row.error, "spread": row.spread,
            "noisy": row.noisy if stats is not None else None,
            "p99_low_confidence": row.p99_low_confidence if stats is not None else None, **result.economics(row)}
