"""The bench result as ONE self-contained HTML file: inline CSS and SVG charts drawn here (no script,
no network), so it opens anywhere, from a CI artifact or an e-mail.

Charts: the headline metric against median latency, size per variant, p99 latency and throughput against batch size
(curves, ``curves.py``) with the best batch under the budget, latency per batch size (p50 bar, p99 tick); then the
table and the host. Each variant keeps one colour (``PALETTE``) in every chart.
"""

from __future__ import annotations

from html import escape
from typing import TYPE_CHECKING

from .curves import DASHES, Axes, Series, line_chart

if TYPE_CHECKING:
    from .result import BenchResult
    from .measure import Row

#: Twenty distinct colours (matplotlib's tab10, then its lighter tab20 partners): a comparison of two runs'
#: artifacts (a dozen variants) keeps one colour each; past twenty they repeat, in the same order.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
           "#7f7f7f", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94", "#f7b6d2", "#9edae5",
           "#dbdb8d", "#c7c7c7")
WIDTH = 1100
CSS = """body{font:14px system-ui,sans-serif;margin:24px;color:#222}h1{font-size:20px}h2{font-size:16px;margin-top:28px}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}
td:first-child,th:first-child,td.l{text-align:left}td:nth-child(-n+2),th:nth-child(-n+2){text-align:left;white-space:nowrap}.muted{color:#777}svg{display:block;margin:6px 0}
.key span{display:inline-block;margin-right:14px}.key i{display:inline-block;width:12px;height:12px;margin-right:4px}"""


def colours(result: "BenchResult") -> dict[str, str]:
    """Variant name → its colour (in command-line order, built variants only)."""
    built = [v for v in result.variants if v.timed]
    return {v.name: PALETTE[i % len(PALETTE)] for i, v in enumerate(built)}


def html_report(result: "BenchResult") -> str:
    colour = colours(result)
    key = "".join(f'<span><i style="background:{c}"></i>{escape(name)}</span>' for name, c in colour.items())
    baseline = escape(result.baseline.name)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>pruneflow bench</title><style>{CSS}</style>",
             "</head><body><h1>pruneflow bench</h1>",
             f"<p>Ratios against <b>{baseline}</b>; all timings interleaved in one loop per batch size.</p>",
             f'<p class="key">{key}</p>',
             f"<h2>{escape(result.metric_name())} vs median latency</h2>", scatter_svg(result, colour),
             "<h2>Size on disk per variant</h2>", size_svg(result, colour),
             "<h2>Latency and throughput against batch size</h2>", *curve_svgs(result, colour),
             *budget_html(result.under_budget(), result.settings.price_per_hour is not None),
             "<h2>Latency per batch size (bar: p50, tick: p99)</h2>", *latency_svgs(result, colour),
             "<h2>All figures</h2>", table_html(result),
             *([f'<p class="muted">{escape(note)}</p>'] if (note := result.metric_note()) else []),
             *([f'<p class="muted">{escape(marks)}</p>'] if (marks := low_confidence_note(result)) else []),
             "<h2>Host</h2>", host_html(result), "</body></html>"]
    return "\n".join(parts)


def curve_svgs(result: "BenchResult", colour: dict[str, str]) -> list[str]:
    """p99 latency (with the budget's rule) and throughput against batch size: a line per artifact x runtime, colour
    naming the artifact and dash the runtime, the best batch under the budget ringed."""
    if len(result.settings.batches) < 2:
        return ['<p class="muted">One batch size timed: the curves need several (e.g. --batch 1,2,4,8,16,32).</p>']
    best = {(e["variant"], e["runtime_label"]): e.get("batch") for e in result.under_budget()}
    dashes = {label: DASHES[i % len(DASHES)] for i, label in enumerate(dict.fromkeys(r.lane.label for r in result.rows))}
    lanes: dict[tuple[str, str], list["Row"]] = {}
    for row in sorted((r for r in result.rows if r.stats is not None), key=lambda r: r.batch):
        lanes.setdefault((row.lane.variant.name, row.lane.label), []).append(row)

    one_model = len({v.model for v in result.variants}) == 1
    short = {v.name: v.label if one_model else v.name for v in result.variants}

    def series(figure: str) -> list[Series]:
        return [Series(f"{short[name]} · {label}", colour[name], dashes[label],
                       [(r.batch, float(getattr(r.stats, figure))) for r in rows], best.get((name, label)))
                for (name, label), rows in lanes.items()]

    return latency_and_throughput(series("p99_ms"), series("throughput"), result.settings.p99_budget_ms)


def latency_and_throughput(latency: list[Series], throughput: list[Series], budget: float | None,
                           axes: tuple[Axes, Axes] | None = None) -> list[str]:
    """The two charts (``axes``: scales shared with other charts, else fitted to these)."""
    lat_axes, thr_axes = axes or (Axes.fit(latency, budget), Axes.fit(throughput))
    rule = f"p99 budget {budget:g} ms (ringed: the best batch within it)" if budget else ""
    return [line_chart(latency, lat_axes, "p99 latency (ms)", rule=budget, rule_label=rule),
            line_chart(throughput, thr_axes, "throughput (samples/s)")]


def budget_html(chosen: list[dict], priced: bool) -> list[str]:
    """The best batch under the budget per artifact x runtime (and host, when merged), as a table; a line in red when
    no batch of any artifact is within it (bench exits 1)."""
    if not chosen:
        return []
    hosts = any("host" in e for e in chosen)
    head = [*(["host"] if hosts else []), "artifact", "runtime", "batch", "p99 ms", "samples/s", "per core",
            *(["cost / 1M"] if priced else []), "note"]
    lines = [f"<h2>Best batch with p99 within {chosen[0]['p99_budget_ms']:g} ms</h2><table><tr>"
             + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for e in chosen:
        cells = [*([e["host"]] if hosts else []), e["variant"], e["runtime_label"]]
        if e.get("batch") is None:
            lines.append("<tr>" + "".join(f"<td class='l'>{escape(c)}</td>" for c in cells)
                         + f"<td class='l' colspan='{len(head) - len(cells)}'>{escape(e['why'])}</td></tr>")
            continue
        cost = e.get("cost_per_million")
        cells += [str(e["batch"]), f"{e['p99_ms']:.3g}", f"{e['throughput']:,.0f}", f"{e['throughput_per_core']:,.0f}",
                  *([f"{cost:.4g}" if cost is not None else "–"] if priced else []), entry_note(e)]
        lines.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in cells[:-1])
                     + f"<td class='l'>{escape(cells[-1])}</td></tr>")
    out = ["\n".join(lines) + "</table>"]
    if not any(e.get("batch") is not None for e in chosen):
        out.append(f"<p style='color:#b00'><b>{escape(nothing_meets(chosen[0]['p99_budget_ms']))}</b></p>")
    return out


def nothing_meets(budget: float) -> str:
    """The line bench prints (and exits 1 after) when no artifact x runtime has a batch within the budget."""
    return f"nothing meets --p99-budget-ms {budget:g}: no artifact x runtime has a batch timed with p99 within it (exit 1)"


def entry_note(entry: dict) -> str:
    """What to know about a best batch under the budget: NOISY figures, a low-confidence p99, the largest batch timed."""
    notes = []
    if entry.get("close_call"):
        notes.append("NOISY: a p99 close to the budget, the best batch may change between runs")
    elif entry.get("noisy"):
        notes.append("NOISY: time again")
    if entry.get("p99_low_confidence"):
        notes.append(f"p99 from {entry.get('runs')} runs: low confidence")
    if entry.get("largest_timed"):
        notes.append("the largest batch timed: a larger one may do better")
    return "; ".join(notes)


def scatter_svg(result: "BenchResult", colour: dict[str, str]) -> str:
    """One marker per variant x runtime at the largest batch: median latency (x) against the headline metric (y);
    colour names the variant, shape the runtime."""
    batch = max(result.settings.batches)
    points = [r for r in result.rows if r.stats is not None and r.batch == batch and result.row_metric(r) is not None]
    if not points:
        return '<p class="muted">No metric recorded (bare artifacts carry none): nothing to plot.</p>'
    height, left, bottom, top, right = 340, 70, 40, 20, 260
    xs = [r.stats.p50_ms for r in points if r.stats is not None]
    ys = [float(result.row_metric(r) or 0.0) for r in points]
    x_max = max(xs) * 1.1 or 1.0
    pad = max((max(ys) - min(ys)) * 0.15, 0.005)
    y_lo, y_hi = min(ys) - pad, max(ys) + pad
    shapes = {label: MARKERS[i % len(MARKERS)] for i, label in enumerate(dict.fromkeys(r.lane.label for r in points))}
    out = [_frame(height, left, bottom, top, right),
           _text(left, height - 22, "0"), _text(WIDTH - right - 40, height - 22, f"{x_max:.3g} ms"),
           _text(left + 4, height - 6, f"median latency at batch {batch} (ms)"),
           _text(4, top + 10, f"{y_hi:.3f}"), _text(4, height - bottom, f"{y_lo:.3f}"), _text(4, top + 26, escape(result.metric_name()))]
    for row, y in zip(points, ys):
        assert row.stats is not None
        cx = left + row.stats.p50_ms / x_max * (WIDTH - left - right)
        cy = top + (1 - (y - y_lo) / (y_hi - y_lo)) * (height - top - bottom)
        out.append(_marker(shapes[row.lane.label], cx, cy, colour[row.lane.variant.name]))
    for i, (label, shape) in enumerate(shapes.items()):
        out += [_marker(shape, WIDTH - right + 24, top + 14 + i * 24, "#555"), _text(WIDTH - right + 38, top + 18 + i * 24, label)]
    return _svg(height, out)


MARKERS = ("circle", "square", "diamond", "triangle")


def _marker(shape: str, x: float, y: float, fill: str, r: float = 8) -> str:
    if shape == "circle":
        return f'<circle cx="{x:.1f}" cy="{y:.1f}" r="{r}" fill="{fill}" fill-opacity="0.85"/>'
    if shape == "square":
        return f'<rect x="{x - r:.1f}" y="{y - r:.1f}" width="{2 * r}" height="{2 * r}" fill="{fill}" fill-opacity="0.85"/>'
    corners = ((x, y - r * 1.3), (x + r * 1.3, y), (x, y + r * 1.3), (x - r * 1.3, y)) if shape == "diamond" else (
        (x, y - r * 1.2), (x + r * 1.2, y + r), (x - r * 1.2, y + r))
    points = " ".join(f"{px:.1f},{py:.1f}" for px, py in corners)
    return f'<polygon points="{points}" fill="{fill}" fill-opacity="0.85"/>'


def size_svg(result: "BenchResult", colour: dict[str, str]) -> str:
    built = [v for v in result.variants if v.timed and v.size_bytes]
    if not built:
        return '<p class="muted">No sizes.</p>'
    biggest = max(float(v.size_bytes or 0) for v in built)
    bar, left = 26, 330
    out = []
    for i, v in enumerate(built):
        width = (WIDTH - left - 120) * float(v.size_bytes or 0) / biggest
        y = 8 + i * (bar + 8)
        out += [_text(4, y + bar * 0.65, v.name),
                f'<rect x="{left}" y="{y}" width="{max(width, 2):.1f}" height="{bar}" fill="{colour[v.name]}"/>',
                _text(left + width + 6, y + bar * 0.65, human_bytes(v.size_bytes))]
    return _svg(16 + len(built) * (bar + 8), out)


def latency_svgs(result: "BenchResult", colour: dict[str, str]) -> list[str]:
    charts = []
    for batch in result.settings.batches:
        rows = [r for r in result.rows if r.batch == batch and r.stats is not None]
        if rows:
            charts += [f"<p><b>batch {batch}</b></p>", _latency_bars(rows, colour)]
    return charts


def _latency_bars(rows: list["Row"], colour: dict[str, str]) -> str:
    slowest = max(r.stats.p99_ms for r in rows if r.stats is not None) or 1.0
    bar, left = 18, 430
    scale = (WIDTH - left - 230) / slowest
    out = []
    for i, row in enumerate(rows):
        assert row.stats is not None
        y = 6 + i * (bar + 6)
        p50, p99 = row.stats.p50_ms * scale, row.stats.p99_ms * scale
        out += [_text(4, y + bar * 0.7, f"{row.lane.variant.name} · {row.lane.label}"),
                f'<rect x="{left}" y="{y}" width="{max(p50, 2):.1f}" height="{bar}" fill="{colour[row.lane.variant.name]}"/>',
                f'<line x1="{left + p99:.1f}" x2="{left + p99:.1f}" y1="{y}" y2="{y + bar}" stroke="#222" stroke-width="2"/>',
                _text(left + p99 + 6, y + bar * 0.7, f"p50 {row.stats.p50_ms:.3g} ms · p99 {row.stats.p99_ms:.3g} ms")]
    return _svg(12 + len(rows) * (bar + 6), out)


#: Columns of the side-by-side table (terminal and HTML); cells from ``table_cells``; ``{metric}``: the headline's name.
TABLE_HEAD = ("variant", "runtime", "batch", "p50 ms", "p90 ms", "p99 ms", "samples/s", "speed-up", "size", "size ÷",
              "{metric}", "Δ {metric}", "benchmark_app /s", "note")


def table_head(result: "BenchResult") -> tuple[str, ...]:
    """``TABLE_HEAD`` with the variants' headline metric named."""
    return tuple(h.replace("{metric}", result.metric_name()) for h in TABLE_HEAD)


def table_html(result: "BenchResult") -> str:
    head = table_head(result)
    lines = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for row in result.rows:
        lines.append("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in table_cells(result, row)) + "</tr>")
    for v in result.variants:
        if not v.timed:
            lines.append(f"<tr><td>{escape(v.name)}</td><td class='l' colspan='{len(head) - 1}'>"
                         f"{escape(v.untimed_detail())}</td></tr>")
    return "\n".join(lines) + "</table>"


#: Appended to a p99 cell from fewer than ``MIN_P99_RUNS`` timed runs (``low_confidence_note`` says what it means).
LOW_CONFIDENCE = "~"


def table_cells(result: "BenchResult", row: "Row") -> list[str]:
    """One row of the side-by-side table, formatted (shared by the terminal table and the HTML one): a low-confidence
    p99 carries ``LOW_CONFIDENCE``, an unstable row NOISY in its note, as report.md's headline does."""
    v, s = row.lane.variant, row.stats
    value, delta = result.row_metric(row), result.row_metric_delta(row)
    app = (row.benchmark_app or {}).get("throughput")
    p99 = f"{s.p99_ms:.3f}{LOW_CONFIDENCE if row.p99_low_confidence else ''}" if s else "–"
    timing = [f"{s.p50_ms:.3f}", f"{s.p90_ms:.3f}", p99, f"{s.throughput:,.0f}"] if s else ["–"] * 4
    noisy = f"NOISY (p90/p50 {row.spread:.2f}): time again" if row.noisy and row.spread is not None else ""
    note = "; ".join(n for n in (row.error or (row.benchmark_app or {}).get("error") or "", noisy) if n)
    return [v.name, row.lane.label, str(row.batch), *timing, _ratio(row.speedup), human_bytes(v.size_bytes),
            _ratio(result.size_reduction(v)), "–" if value is None else f"{value:.4f}",
            "–" if delta is None else f"{delta:+.4f}", "–" if app is None else f"{app:,.0f}", note]


def low_confidence_note(result: "BenchResult") -> str | None:
    """What ``LOW_CONFIDENCE`` and NOISY mean, when some row carries them."""
    timed = [r for r in result.rows if r.stats is not None]
    return marks_note([{"runs": r.stats.runs, "p99_low_confidence": r.p99_low_confidence, "noisy": r.noisy}
                       for r in timed if r.stats is not None])


def marks_note(rows: list[dict]) -> str | None:
    """What ``LOW_CONFIDENCE`` and NOISY mean, when some row (as in the JSON) carries them."""
    from ..headline import NOISY_SPREAD
    from .measure import MIN_P99_RUNS

    few = sorted({int(r["runs"]) for r in rows if r.get("p99_low_confidence") and r.get("runs") is not None})
    notes = []
    if few:
        counts = f"{few[0]}" if len(few) == 1 else f"{few[0]} to {few[-1]}"
        notes.append(f"p99 {LOW_CONFIDENCE}: from {counts} timed runs, fewer than {MIN_P99_RUNS}, so it is "
                     "the second-worst run or nearer the worst: low confidence (leave --runs out, or --runs "
                     f"{MIN_P99_RUNS}, or a longer --duration)")
    if any(r.get("noisy") for r in rows):
        notes.append(f"NOISY: p90/p50 above {NOISY_SPREAD:g} on the row or its baseline (report.md's rule): the machine "
                     "was busy or the figure unstable; time it again")
    return "; ".join(notes) or None


def host_html(result: "BenchResult") -> str:
    cpu = result.host.get("cpu", {})
    versions = ", ".join(f"{k} {v}" for k, v in result.host.get("versions", {}).items())
    inputs = "".join(f"<li>{escape(name)}: {escape(what)}</li>" for name, what in result.inputs.items())
    return (f"<p>{escape(str(cpu.get('model')))} ({escape(str(cpu.get('arch')))}), ISA {escape(' '.join(cpu.get('isa', [])))}, "
            f"{cpu.get('usable_cpus')} usable CPUs; threads {result.settings.threads or 'runtime default'}; "
            f"{escape(str(result.host.get('os')))}, Python {escape(str(result.host.get('python')))}</p>"
            f"<p class='muted'>{escape(versions)}</p><p>Timed on:</p><ul>{inputs}</ul>")


def human_bytes(size: int | None) -> str:
    if size is None:
        return "–"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{size} B"


def _ratio(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}x"


def _frame(height: int, left: int, bottom: int, top: int, right: int) -> str:
    return (f'<rect x="{left}" y="{top}" width="{WIDTH - left - right}" height="{height - top - bottom}" '
            'fill="none" stroke="#999"/>')


def _text(x: float, y: float, text: str) -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" font-size="12">{escape(text)}</text>'


def _svg(height: int, body: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'viewBox="0 0 {WIDTH} {height}">' + "".join(body) + "</svg>")

