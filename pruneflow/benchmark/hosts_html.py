"""Several hosts' bench results (``bench --merge``) as one self-contained HTML page: the hosts and their prices, p99
latency and throughput against batch size per host on shared axes, the best batch under the budget per host, and one
side-by-side table per batch size. Inline CSS and SVG, no script, like the single-bench report (``html.py``)."""

from __future__ import annotations

from html import escape
from typing import Any

from .curves import DASHES, Axes, Series
from .hosts import MergedBench
from .html import CSS, LOW_CONFIDENCE, PALETTE, budget_html, latency_and_throughput, marks_note


def merged_html(merged: MergedBench) -> str:
    names = [h["name"] for h in merged.hosts]
    budget = merged.p99_budget_ms
    chosen = merged.under_budget()
    latency = {h: _series(merged, h, "p99_ms", chosen) for h in names}
    throughput = {h: _series(merged, h, "throughput", chosen) for h in names}
    axes = (Axes.shared(list(latency.values()), budget), Axes.shared(list(throughput.values())))
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>pruneflow bench: hosts compared</title>"
             f"<style>{CSS}</style></head><body><h1>pruneflow bench: {len(names)} hosts compared</h1>",
             "<p>Each host timed its artifacts interleaved in one loop per batch size; the charts of all hosts share "
             "their axes.</p>", "<h2>Hosts</h2>", hosts_table(merged)]
    for name in names:
        parts += [f"<h2>{escape(name)}: latency and throughput against batch size</h2>",
                  *latency_and_throughput(latency[name], throughput[name], budget, axes)]
    parts += budget_html(chosen, any(h["price_per_hour"] for h in merged.hosts))
    for batch in merged.batches():
        parts += [f"<h2>Batch {batch}, side by side</h2>", side_by_side(merged, batch)]
    if (note := marks_note(merged.rows)) is not None:
        parts.append(f'<p class="muted">{escape(note)}</p>')
    return "\n".join(parts + ["</body></html>"])


def _colours(merged: MergedBench) -> dict[str, str]:
    variants = dict.fromkeys(v for v, _ in merged.lanes())
    return {v: PALETTE[i % len(PALETTE)] for i, v in enumerate(variants)}


def _series(merged: MergedBench, host: str, figure: str, chosen: list[dict]) -> list[Series]:
    """One line per artifact x runtime lane of ``host``; colour by artifact and dash by lane, alike on every host;
    ``chosen``: the best batches under the budget (``MergedBench.under_budget``), ringed."""
    colour = _colours(merged)
    dashes = {lane: DASHES[i % len(DASHES)] for i, lane in enumerate(dict.fromkeys(lane for _, lane in merged.lanes()))}
    best = {(e["variant"], e["runtime_label"]): e.get("batch") for e in chosen if e["host"] == host}
    one_model = len({r["model"] for r in merged.rows}) == 1
    short = {r["variant"]: r["label"] if one_model else r["variant"] for r in merged.rows}
    out = []
    for variant, lane in merged.lanes():
        rows = [merged.row(host, variant, lane, b) for b in merged.batches()]
        points = [(int(r["batch"]), float(r[figure])) for r in rows if r is not None and r.get(figure) is not None]
        if points:
            out.append(Series(f"{short[variant]} · {lane}", colour[variant], dashes[lane], points, best.get((variant, lane))))
    return out


def hosts_table(merged: MergedBench) -> str:
    head = ("host", "CPU", "ISA", "usable CPUs", "threads", "OpenVINO default computes", "price / hour", "onnxruntime",
            "openvino", "file")
    lines = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for h in merged.hosts:
        cpu, versions = h["host"].get("cpu") or {}, h["host"].get("versions") or {}
        defaults = {str(r["inference_precision"]) for r in merged.rows
                    if r["host"] == h["name"] and r.get("precision_hint") == "default" and r.get("inference_precision")}
        price = h["price_per_hour"]
        cells = [h["name"], f"{cpu.get('model')} ({cpu.get('arch')})", " ".join(cpu.get("isa") or []),
                 str(cpu.get("usable_cpus")), str(h["settings"].get("threads") or "runtime default"),
                 ", ".join(sorted(defaults)) or "–",
                 f"{price:g} ({h['price_source']})" if price else (h["price_source"] or "–"),
                 str(versions.get("onnxruntime", "–")), str(versions.get("openvino", "–")), h["file"]]
        lines.append("<tr>" + "".join(f"<td class='l'>{escape(c)}</td>" for c in cells) + "</tr>")
    return "\n".join(lines) + "</table>"


def side_by_side(merged: MergedBench, batch: int) -> str:
    """Rows: artifact x runtime lane; per host: p50, p99, samples/s and (priced) cost per million."""
    priced = any(h["price_per_hour"] for h in merged.hosts)
    figures = ("p50 ms", "p99 ms", "samples/s", *(("cost / 1M",) if priced else ()))
    top = "<tr><th></th><th></th>" + "".join(f"<th colspan='{len(figures)}'>{escape(h['name'])}</th>"
                                             for h in merged.hosts) + "</tr>"
    head = "<tr><th>artifact</th><th>runtime</th>" + "".join(f"<th>{f}</th>" for _ in merged.hosts for f in figures)
    lines = ["<table>", top, head + "</tr>"]
    for variant, lane in merged.lanes():
        cells = [variant, lane]
        for h in merged.hosts:
            cells += host_cells(merged.row(h["name"], variant, lane, batch), priced)
        lines.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells) + "</tr>")
    return "\n".join(lines) + "</table>"


def host_cells(row: dict[str, Any] | None, priced: bool) -> list[str]:
    if row is None or row.get("p50_ms") is None:
        why = "not benched" if row is None else (row.get("error") or "not timed")
        return [why[:60], *["–"] * (3 if priced else 2)]
    cost = row.get("cost_per_million")
    p99 = f"{row['p99_ms']:.3f}" + (LOW_CONFIDENCE if row.get("p99_low_confidence") else "") + (" NOISY" if row.get("noisy") else "")
    return [f"{row['p50_ms']:.3f}", p99, f"{row['throughput']:,.0f}",
            *([f"{cost:.4g}" if cost is not None else "–"] if priced else [])]
