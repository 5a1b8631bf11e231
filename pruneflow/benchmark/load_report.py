"""`bench --load` results as HTML (p99 against offered QPS, the budget drawn, each lane's knee ringed) and as
Prometheus text (seconds, by convention). Both read the JSON document (``LoadResult.as_json``), so a file written on
another host renders the same."""

from __future__ import annotations

import math
from html import escape
from typing import Any

from .curves import DASHES, Axes, Series, line_chart
from .exposition import _sample
from .html import CSS, PALETTE

METRICS = {
    "pruneflow_load_latency_seconds": "End-to-end latency (queue + compute) of requests offered open-loop at offered_qps, "
                                      "by quantile (pruneflow bench --load).",
    "pruneflow_load_achieved_qps": "Requests answered per second at the offered rate (pruneflow bench --load).",
    "pruneflow_load_mean_batch": "Mean rows per batch the dynamic batcher ran at the offered rate.",
    "pruneflow_load_missed_ratio": "Share of requests over the p99 budget or never answered.",
    "pruneflow_load_best_qps": "Per artifact: the highest offered rate a lane held within the p99 budget (its knee).",
    "pruneflow_load_cost_per_million": "Cost of a million requests at the best rate, on the cores its lane uses.",
}


def load_prometheus(doc: dict[str, Any]) -> str:
    host = str(doc["host"].get("label") or doc["host"]["cpu"]["model"])
    samples: dict[str, list[str]] = {name: [] for name in METRICS}
    for lane in doc["lanes"]:
        labels = {"host": host, "model": lane["model"], "variant": lane["variant"], "precision": lane["precision"] or "",
                  "runtime": lane["runtime_label"] or lane["runtime"], "policy": lane["policy"], "threads": lane["threads"]}
        for p in lane["points"]:
            at = {**labels, "offered_qps": f"{p['offered_qps']:g}"}
            for q, key in (("0.5", "p50_ms"), ("0.95", "p95_ms"), ("0.99", "p99_ms")):
                if p[key] is not None:
                    samples["pruneflow_load_latency_seconds"].append(
                        _sample("pruneflow_load_latency_seconds", {**at, "quantile": q}, p[key] / 1000))
            samples["pruneflow_load_achieved_qps"].append(_sample("pruneflow_load_achieved_qps", at, float(p["achieved_qps"])))
            samples["pruneflow_load_mean_batch"].append(_sample("pruneflow_load_mean_batch", at, float(p["mean_batch"])))
            samples["pruneflow_load_missed_ratio"].append(
                _sample("pruneflow_load_missed_ratio", at, p["missed"] / max(1, p["requests"])))
    budget = doc["settings"].get("p99_budget_ms")
    for best in doc["best"]:
        if best.get("qps") is None:
            continue
        labels = {"host": host, "variant": best["variant"], "precision": best.get("precision") or "",
                  "runtime": best["runtime"], "policy": best["policy"], "threads": best["threads"],
                  "p99_budget_seconds": f"{budget / 1000:g}" if budget else ""}
        samples["pruneflow_load_best_qps"].append(_sample("pruneflow_load_best_qps", labels, float(best["qps"])))
        if best.get("cost_per_million") is not None:
            samples["pruneflow_load_cost_per_million"].append(
                _sample("pruneflow_load_cost_per_million", labels, float(best["cost_per_million"])))
    lines = []
    for name, text in METRICS.items():
        if samples[name]:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge", *samples[name]]
    return "\n".join(lines) + "\n"


def load_html(doc: dict[str, Any]) -> str:
    budget = doc["settings"].get("p99_budget_ms")
    cpu = doc["host"]["cpu"]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>pruneflow bench --load</title><style>{CSS}</style>",
             "</head><body><h1>pruneflow bench --load</h1>",
             f"<p>Open-loop Poisson arrivals, one request at a time, served through the dynamic batcher; latency from each "
             f"request's scheduled arrival to its answer (queue + compute). Host: {escape(str(cpu['model']))}, ISA "
             f"{escape(' '.join(cpu.get('isa', [])))}, {cpu.get('usable_cpus')} usable CPUs"
             + (f"; label {escape(str(doc['host']['label']))}" if doc["host"].get("label") else "") + ".</p>",
             "<h2>Best configuration per artifact</h2>", _best_table(doc)]
    variants = list(dict.fromkeys(lane["variant"] for lane in doc["lanes"]))
    for i, variant in enumerate(variants):
        lanes = [lane for lane in doc["lanes"] if lane["variant"] == variant and lane["points"]]
        if not lanes:
            continue
        parts += [f"<h2>{escape(variant)}: p99 latency against offered load</h2>", _chart(lanes, budget, PALETTE[i % len(PALETTE)])]
    parts += ["<h2>Every point</h2>", _points_table(doc), "</body></html>"]
    return "\n".join(parts)


def _chart(lanes: list[dict[str, Any]], budget: float | None, colour: str) -> str:
    """p99 against offered QPS, a line per runtime x policy x threads (colour by runtime, dash by policy)."""
    runtimes = list(dict.fromkeys(lane["runtime_label"] for lane in lanes))
    policies = list(dict.fromkeys(lane["policy"] for lane in lanes))
    series = []
    for lane in lanes:
        points = [(max(1, int(round(p["offered_qps"]))), p["p99_ms"]) for p in lane["points"] if p["p99_ms"] is not None]
        if not points:
            continue
        knee = int(round(lane["knee_qps"])) if lane.get("knee_qps") else None
        shade = PALETTE[(PALETTE.index(colour) + runtimes.index(lane["runtime_label"])) % len(PALETTE)]
        series.append(Series(f"{lane['runtime_label']} {lane['policy']} {lane['threads']}t", shade,
                             DASHES[policies.index(lane["policy"]) % len(DASHES)], points, knee))
    xs = sorted({x for s in series for x, _ in s.points})
    axes = Axes.fit(series, budget)
    axes.batches = _ticks(xs[0], xs[-1]) if xs else [1]
    return line_chart(series, axes, "p99 latency, ms", "offered load, requests/s (log scale); ring: the knee, the "
                      "highest rate held within the budget", rule=budget, rule_label=f"budget {budget:g} ms" if budget else "")


def _ticks(lo: int, hi: int) -> list[int]:
    """1-2-5 ticks from at most ``lo`` to at least ``hi`` (the axis's ends are its first and last tick)."""
    ticks = []
    for power in range(int(math.floor(math.log10(max(lo, 1)))), int(math.ceil(math.log10(max(hi, 1)))) + 1):
        ticks += [m * 10 ** power for m in (1, 2, 5)]
    below = [t for t in ticks if t <= lo] or [ticks[0]]
    above = [t for t in ticks if t >= hi] or [ticks[-1]]
    return [t for t in ticks if below[-1] <= t <= above[0]]


def _best_table(doc: dict[str, Any]) -> str:
    head = ("artifact", "runtime", "policy", "threads", "QPS held", "p99 ms", "mean batch", "vs FP32 one at a time",
            "cost / 1M")
    rows = []
    for b in doc["best"]:
        if b.get("qps") is None:
            rows.append(f"<tr><td>{escape(b['variant'])}</td><td colspan='{len(head) - 1}' class='l'>{escape(b['why'])}</td></tr>")
            continue
        cells = [b["variant"], b["runtime"], b["policy"], str(b["threads"]), f"{b['qps']:,.0f}", f"{b['p99_ms']:.3g}",
                 f"{b['mean_batch']:.1f}", f"{b['vs_fp32_one_at_a_time']:.2f}x" if b.get("vs_fp32_one_at_a_time") else "–",
                 f"{b['cost_per_million']:.4g}" if b.get("cost_per_million") is not None else "–"]
        rows.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    reference = doc.get("reference")
    note = f"<p class='muted'>FP32 one at a time: {escape(reference)}.</p>" if reference else ""
    return ("<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>" + note)


def _points_table(doc: dict[str, Any]) -> str:
    head = ("artifact", "runtime", "policy", "threads", "offered QPS", "achieved", "p50 ms", "p95 ms", "p99 ms", "mean batch",
            "missed", "held")
    budget = doc["settings"].get("p99_budget_ms")
    rows = []
    for lane in doc["lanes"]:
        for p in lane["points"]:
            held = p["keeps_up"] and (budget is None or (p["p99_ms"] is not None and p["p99_ms"] <= budget))
            cells = [lane["variant"], lane["runtime_label"], lane["policy"], str(lane["threads"]), f"{p['offered_qps']:,.0f}",
                     f"{p['achieved_qps']:,.0f}", _ms(p["p50_ms"]), _ms(p["p95_ms"]), _ms(p["p99_ms"]),
                     f"{p['mean_batch']:.1f}", f"{p['missed']}/{p['requests']}", "yes" if held else "no"]
            rows.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
        if lane.get("error"):
            rows.append(f"<tr><td>{escape(lane['variant'])}</td><td colspan='{len(head) - 1}' class='l'>"
                        f"{escape(lane['error'])}</td></tr>")
    return "<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>" + "".join(rows) + "</table>"


def _ms(value: float | None) -> str:
    return "∞" if value is None else f"{value:.3g}"
