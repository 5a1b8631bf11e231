"""``pruneflow bench``: artifacts timed side by side, under offered load (``--load``), or several hosts' results
merged (``--merge``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
import typer.core
from rich.console import Console
from rich.table import Table

from pruneflow.errors import UsageError

from .app import VerboseOpt, app, exits
from .app import RichReporter, err_console, handle_errors, out_console

def _print_budget(console: Console, result) -> None:
    """The best batch under --p99-budget-ms per artifact and runtime, with throughput per core and, given a price,
    the cost per million inferences (on the cores the lane used), and what to know about each (NOISY, a low-confidence
    p99, the largest batch timed); the line of exit 1 when nothing meets the budget."""
    from rich.markup import escape

    from pruneflow.benchmark.html import entry_note, nothing_meets

    chosen = result.under_budget()
    if not chosen:
        return
    table = Table(title=f"best batch with p99 within {result.settings.p99_budget_ms:g} ms", title_justify="left")
    priced = result.settings.price_per_hour is not None
    for c in ("artifact", "runtime", "batch", "p99 ms", "samples/s", "per core", *(["cost / 1M"] if priced else []), "note"):
        table.add_column(c, justify="left" if c in ("artifact", "runtime", "note") else "right")
    for e in (e for e in chosen if e["batch"] is not None):
        cost = [f"{e['cost_per_million']:.4g}"] if priced else []
        table.add_row(*(escape(c) for c in (e["variant"], e["runtime_label"], str(e["batch"]), f"{e['p99_ms']:.3g}",
                                            f"{e['throughput']:,.0f}", f"{e['throughput_per_core']:,.0f}", *cost,
                                            entry_note(e))))
    if table.row_count:
        console.print(table)
    for e in (e for e in chosen if e["batch"] is None):
        console.print(f"{e['variant']} on {e['runtime_label']}: {e['why']}", markup=False)
    if result.meets_budget() is False:
        console.print(nothing_meets(result.settings.p99_budget_ms), style="red", markup=False)


class _OptionalJsonValue(typer.core.TyperCommand):
    """``--json`` alone means stdout (``--json=-``); ``--json FILE.json`` and ``--json=FILE`` name a file.
    Typer has no option with an optional value, so a bare ``--json`` is rewritten before parsing."""

    def parse_args(self, ctx, args):
        out = []
        for i, arg in enumerate(args):
            following = args[i + 1] if i + 1 < len(args) else ""
            if arg == "--" or "--" in out:
                out.append(arg)
                continue
            out.append("--json=-" if arg == "--json" and not (following == "-" or following.endswith(".json")) else arg)
        return super().parse_args(ctx, out)


def _int_list(option: str, text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{option} {text!r} is not a comma-separated list of integers", hint=f"e.g. {option} 1,32") from None


def _names(text: str | None) -> list[str] | None:
    return [v.strip() for v in text.split(",") if v.strip()] if text else None


@app.command(cls=_OptionalJsonValue, epilog=exits(0, 1, 2, 3, 4, 130, _1="nothing meets --p99-budget-ms (--load: no lane holds it)"))
def bench(
    sources: Annotated[list[Path], typer.Argument(metavar="RUN_OR_ARTIFACT", help="Run folders (every exported artifact of the run) and/or .onnx/.xml files.", show_default=False)],
    runtime: Annotated[Optional[str], typer.Option("--runtime", help="Comma-separated: onnxruntime, openvino (default: every runtime that loads each file).", show_default=False)] = None,
    batch: Annotated[str, typer.Option("--batch", help="Comma-separated batch sizes.")] = "1,32",
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed runs of each artifact first (the export stage's default too).")] = 3,
    runs: Annotated[Optional[int], typer.Option("--runs", help="Timed repetitions per batch size [default: until 200 runs back each p99, or 20 s per batch size, at least 50]; a p99 from fewer than 200 runs is marked low-confidence (~).", show_default=False)] = None,
    duration: Annotated[Optional[float], typer.Option("--duration", help="Seconds of timing per batch size (a window: every artifact in turn until it has passed), instead of --runs.", show_default=False)] = None,
    threads: Annotated[str, typer.Option("--threads", help="Runtime threads, as the export stage times with; 0: the runtime's own choice. Under --load, a comma-separated list (each a lane).")] = "1",
    metric: Annotated[Optional[str], typer.Option("--metric", help="The figure each row shows, as its run measured it (default: the run's headline; e.g. finish.auc, a multi-head run's second head).", show_default=False)] = None,
    baseline: Annotated[Optional[str], typer.Option("--baseline", help="Variant the ratios are against: RUN/LABEL (e.g. quickstart/onnx.fp32), a label, or a file name [default: the first fp32 artifact].", show_default=False)] = None,
    openvino_precision: Annotated[Optional[str], typer.Option("--openvino-precision", help="OpenVINO inference precision hints to time, comma-separated: default (bf16 on AVX-512 BF16/AMX CPUs), f32, bf16, f16 [default: default,f32; under --load: as each IR's deployment record says].", show_default=False)] = None,
    json_out: Annotated[Optional[str], typer.Option("--json", metavar="[FILE]", help="Every figure as JSON: alone on stdout (instead of the table), or into FILE (--json out.json, --json=FILE).", show_default=False)] = None,
    html: Annotated[Optional[Path], typer.Option("--html", help="A self-contained HTML report with charts.", show_default=False)] = None,
    prometheus: Annotated[Optional[Path], typer.Option("--prometheus", help="Prometheus text format for node-exporter's textfile collector.", show_default=False)] = None,
    benchmark_app: Annotated[bool, typer.Option("--benchmark-app", help="Also run OpenVINO's benchmark_app on each IR and record its throughput.")] = False,
    p99_budget_ms: Annotated[Optional[float], typer.Option("--p99-budget-ms", help="Latency budget: per artifact and runtime, the batch size of highest throughput whose p99 stays within it (time several batch sizes: --batch 1,2,4,8,16,32); exit 1 when none does.", show_default=False)] = None,
    price_per_hour: Annotated[Optional[str], typer.Option("--price-per-hour", metavar="PRICE|FILE", help="What the machine costs an hour, or a YAML file of prices per host (host label or CPU model: price): adds the cost per million inferences to every row.", show_default=False)] = None,
    host_label: Annotated[Optional[str], typer.Option("--host-label", help="A name for this machine (e.g. its instance type), recorded in the JSON, matched in a price file and shown by --merge.", show_default=False)] = None,
    merge: Annotated[bool, typer.Option("--merge", help="Compare hosts: the arguments are bench --json files from several machines, merged into one table, HTML, JSON and Prometheus file (timing options do not apply).")] = False,
    load: Annotated[bool, typer.Option("--load", help="Serve each artifact under offered load instead: open-loop Poisson arrivals, one request at a time, through the dynamic batcher (pruneflow.runtime.Server); p50/p95/p99 end to end, achieved QPS, batch sizes. Needs --rate, or --p99-budget-ms to search the highest rate that holds it.", rich_help_panel="Under load")] = False,
    rate: Annotated[Optional[str], typer.Option("--rate", help="Offered rates in requests/s, comma-separated (a sweep; every lane at each rate in turn).", show_default=False, rich_help_panel="Under load")] = None,
    max_batch: Annotated[str, typer.Option("--max-batch", help="Batching policies: the most rows a batch takes (1: one request at a time).", rich_help_panel="Under load")] = "1,8,32",
    max_delay_ms: Annotated[str, typer.Option("--max-delay-ms", help="Batching policies: how long the oldest request may wait for a batch to fill.", rich_help_panel="Under load")] = "0,2,5",
    workers: Annotated[int, typer.Option("--workers", min=1, help="Executors (streams) per lane, each with --threads threads.", rich_help_panel="Under load")] = 1,
    requests: Annotated[int, typer.Option("--requests", min=10, help="At most this many requests per point (with --duration seconds of arrivals, default 3).", rich_help_panel="Under load")] = 6000,
    metrics_port: Annotated[Optional[int], typer.Option("--metrics-port", min=0, help="Serve live /metrics on 127.0.0.1:PORT while the load runs (0: any free port); each point is checked against a scrape.", show_default=False, rich_help_panel="Under load")] = None,
    verbose: VerboseOpt = False,
) -> None:
    """Time artifacts side by side (p50/p90/p99, throughput, size, headline metric, ratios), interleaved per batch size;
    with --load, one request at a time under offered load (docs/serving.md).

    The batch to serve at, its cost, two hosts:

        pruneflow bench runs/ptq --batch 1,2,4,8,16,32,64 --p99-budget-ms 20 --price-per-hour 0.36 --host-label c7i.large --json c7i.json
        pruneflow bench --merge c7i.json m7a.json --price-per-hour prices.yaml --p99-budget-ms 20 --html hosts.html
    """
    from pruneflow.benchmark import BenchSettings, price_for_this_host, result_json, run_bench, write_outputs

    to_stdout = json_out == "-"
    with handle_errors(verbose, to_stdout):
        if merge:
            return _bench_merge(sources, price_per_hour, p99_budget_ms, json_out, html, prometheus)
        if load:
            return _bench_load(sources, runtime, openvino_precision, threads, rate, max_batch, max_delay_ms, workers, duration,
                               requests, p99_budget_ms, price_per_hour, host_label, metrics_port, json_out, html, prometheus)
        json_file = _json_file(json_out)
        price, price_source = price_for_this_host(price_per_hour, host_label)
        settings = BenchSettings(runtimes=_names(runtime), batches=_int_list("--batch", batch), warmup=warmup,
                                 runs=runs, duration=duration, threads=_one_threads(threads), baseline=baseline,
                                 openvino_precisions=_names(openvino_precision or "default,f32") or [], benchmark_app=benchmark_app,
                                 p99_budget_ms=p99_budget_ms, price_per_hour=price, price_source=price_source,
                                 host_label=host_label, metric=metric)
        result = run_bench(list(sources), settings, RichReporter(err_console(), quiet=to_stdout))
        written = write_outputs(result, json_file=json_file, html=html, prometheus=prometheus)
        if to_stdout:
            print(json.dumps(result_json(result), allow_nan=False))
        else:
            _print_bench(result, written)
        if result.exit_code():  # nothing meets --p99-budget-ms: CI gates on it; every file is still written
            raise typer.Exit(result.exit_code())


def _one_threads(text: str) -> int | None:
    values = _int_list("--threads", text)
    if len(values) != 1 or values[0] < 0:
        raise UsageError(f"--threads {text!r}: one number >= 0 (0: the runtime's own choice)",
                         hint="several thread counts are lanes of --load only")
    return values[0] or None


def _bench_load(sources: list[Path], runtime: str | None, openvino_precision: str | None, threads: str, rate: str | None,
                max_batch: str, max_delay_ms: str, workers: int, duration: float | None, requests: int,
                p99_budget_ms: float | None, price_per_hour: str | None, host_label: str | None, metrics_port: int | None,
                json_out: str | None, html: Path | None, prometheus: Path | None) -> None:
    """``bench --load``: every lane under offered load (``pruneflow.benchmark.load``); exit 1 when none holds."""
    from pruneflow.benchmark import price_for_this_host
    from pruneflow.benchmark.load import LoadSettings, run_load, write_load_outputs

    to_stdout = json_out == "-"
    price, price_source = price_for_this_host(price_per_hour, host_label)
    settings = LoadSettings(
        rates=[float(v) for v in _float_list("--rate", rate)] if rate else None, max_batches=_int_list("--max-batch", max_batch),
        max_delays_ms=_float_list("--max-delay-ms", max_delay_ms), threads=_int_list("--threads", threads), workers=workers,
        duration=duration or 3.0, max_requests=requests, p99_budget_ms=p99_budget_ms, runtimes=_names(runtime),
        openvino_precisions=_names(openvino_precision), price_per_hour=price,
        price_source=price_source, host_label=host_label, metrics_port=metrics_port)
    result = run_load(list(sources), settings, RichReporter(err_console(), quiet=to_stdout))
    written = write_load_outputs(result, json_file=_json_file(json_out), html=html, prometheus=prometheus)
    if to_stdout:
        print(json.dumps(result.as_json(), allow_nan=False))
    else:
        _print_load(result, written)
    if not result.holds_any():
        raise typer.Exit(1)


def _float_list(option: str, text: str) -> list[float]:
    try:
        return [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{option} {text!r} is not a comma-separated list of numbers", hint=f"e.g. {option} 0,2,5") from None


def _print_load(result, written: list[Path]) -> None:
    """Per lane: each point's p99 (achieved QPS); then the best configuration per artifact, its cost and the ratio to
    FP32 served one request at a time."""
    console = out_console()
    if not console.is_terminal:
        console = Console(highlight=False, soft_wrap=True, width=240)
    doc = result.as_json()
    budget = result.settings.p99_budget_ms
    cpu = doc["host"]["cpu"]
    console.print(f"host: {cpu['model']} ({cpu['arch']}), ISA {' '.join(cpu['isa'])}, {cpu['usable_cpus']} usable CPUs"
                  + (f", label {doc['host']['label']}" if doc["host"].get("label") else ""), markup=False)
    table = Table(title="p99 ms (achieved QPS) at each offered rate; * over the budget or not keeping up", title_justify="left")
    for column in ("artifact", "runtime", "policy", "thr", "knee QPS", "points"):
        table.add_column(column)
    for lane in doc["lanes"]:
        cells = []
        for p in lane["points"]:
            held = p["keeps_up"] and (budget is None or (p["p99_ms"] is not None and p["p99_ms"] <= budget))
            p99 = "inf" if p["p99_ms"] is None else f"{p['p99_ms']:.3g}"
            cells.append(f"{p['offered_qps']:,.0f}: {p99}{'' if held else '*'} ({p['achieved_qps']:,.0f})")
        knee = f"{lane['knee_qps']:,.0f}" if lane["knee_qps"] else "–"
        table.add_row(lane["variant"], lane["runtime_label"] or lane["runtime"], lane["policy"], str(lane["threads"]), knee,
                      lane["error"] or "  ".join(cells))
    console.print(table)
    best = Table(title="best configuration per artifact" + (f", p99 within {budget:g} ms" if budget else ""), title_justify="left")
    for column in ("artifact", "runtime", "policy", "thr", "QPS held", "p99 ms", "mean batch", "vs FP32 one at a time", "cost / 1M"):
        best.add_column(column, justify="left" if column in ("artifact", "runtime", "policy") else "right")
    for b in doc["best"]:
        if b.get("qps") is None:
            best.add_row(b["variant"], b["why"], "", "", "", "", "", "", "")
            continue
        best.add_row(b["variant"], b["runtime"], b["policy"], str(b["threads"]), f"{b['qps']:,.0f}", f"{b['p99_ms']:.3g}",
                     f"{b['mean_batch']:.1f}", f"{b['vs_fp32_one_at_a_time']:.2f}x" if b.get("vs_fp32_one_at_a_time") else "–",
                     f"{b['cost_per_million']:.4g}" if b.get("cost_per_million") is not None else "–")
    console.print(best)
    if doc.get("reference"):
        console.print(f"FP32 one at a time: {doc['reference']}", markup=False)
    scraped = [(p["scraped"], p) for lane in doc["lanes"] for p in lane["points"] if p.get("scraped")]
    if scraped:
        worst = max(max(abs(s["qps"] / p["achieved_qps"] - 1) if p["achieved_qps"] else 0,
                        abs(s["p99_ms"] / p["p99_ms"] - 1) if p["p99_ms"] else 0) for s, p in scraped)
        console.print(f"/metrics scraped around each of {len(scraped)} points: QPS and p99 within {worst:.1%} of bench's own", markup=False)
    if not result.holds_any():
        console.print("[red]no lane held any rate" + (f" within p99 {budget:g} ms" if budget else "") + " (exit 1)[/red]")
    for path in written:
        console.print(f"wrote {path}", markup=False)


def _json_file(json_out: str | None) -> Path | None:
    from pruneflow.formats import format_of

    json_file = Path(json_out) if json_out and json_out != "-" else None
    if json_file is not None and (json_file.is_dir() or format_of(json_file) is not None):
        raise UsageError(f"--json took {json_out!r} as the file to write, and it is a model or a folder",
                         hint="put --json after the artifacts, or write --json=FILE")
    return json_file


def _bench_merge(sources: list[Path], price_per_hour: str | None, p99_budget_ms: float | None, json_out: str | None,
                 html: Path | None, prometheus: Path | None) -> None:
    """``bench --merge``: several hosts' bench JSON side by side (``pruneflow.benchmark.hosts``); exit 1 when no host
    has anything within the budget."""
    import math

    from pruneflow.benchmark import Prices, merge, write_outputs

    from pruneflow.benchmark.load_merge import is_load_file

    if p99_budget_ms is not None and not (math.isfinite(p99_budget_ms) and p99_budget_ms > 0):
        raise UsageError(f"--p99-budget-ms {p99_budget_ms:g}: must be a positive finite number", hint="e.g. --p99-budget-ms 20")
    kinds = {is_load_file(p) for p in sources}
    if kinds == {True}:
        if html is not None or prometheus is not None:
            raise UsageError("--merge of bench --load results writes --json and the table, not --html or --prometheus",
                             hint="drop --html/--prometheus (each host's own bench --load --html has its curves)")
        return _bench_merge_load(sources, Prices.parse(price_per_hour), p99_budget_ms, json_out)
    if len(kinds) > 1:
        raise UsageError("--merge: some files are bench --load results and some are not",
                         hint="merge load results with load results, and batch timings with batch timings")
    merged = merge(list(sources), Prices.parse(price_per_hour), p99_budget_ms)
    written = write_outputs(merged, json_file=_json_file(json_out), html=html, prometheus=prometheus)
    if json_out == "-":
        print(json.dumps(merged.as_json(), allow_nan=False))
    else:
        _print_merged(merged, written)
    if merged.exit_code():
        raise typer.Exit(merged.exit_code())


def _bench_merge_load(sources: list[Path], prices, p99_budget_ms: float | None, json_out: str | None) -> None:
    """``bench --merge`` of ``bench --load`` files: per artifact and host the best configuration, its cost, and the best
    artifact per host (``pruneflow.benchmark.load_merge``); exit 1 when no host held any rate."""
    from rich.markup import escape

    from pruneflow.artifacts import write_text_atomic
    from pruneflow.benchmark.load_merge import merge_load

    merged = merge_load(list(sources), prices, p99_budget_ms)
    failed = not any(h.get("artifact") for h in merged["best_per_host"])
    if json_out is not None:
        text = json.dumps(merged | {"exit_code": int(failed)}, indent=None if json_out == "-" else 2, allow_nan=False)
        if json_out == "-":
            print(text)
            raise typer.Exit(int(failed))
        write_text_atomic(Path(json_out), text + "\n")
    console = out_console()
    budget = merged["p99_budget_ms"]
    hosts = [h["name"] for h in merged["hosts"]]
    table = Table(title="highest rate held per artifact and host" + (f", p99 within {budget:g} ms" if budget else ""),
                  title_justify="left")
    table.add_column("artifact")
    for host in hosts:
        table.add_column(f"{escape(host)}\nQPS (p99 ms) policy thr, cost/1M", justify="right")
    for artifact in dict.fromkeys(r["artifact"] for r in merged["best"]):
        cells = []
        for host in hosts:
            r = next((r for r in merged["best"] if r["artifact"] == artifact and r["host"] == host), None)
            cost = f", {r['cost_per_million']:.4g}" if r and r["cost_per_million"] is not None else ""
            cells.append("–" if r is None else escape(f"{r['qps']:,.0f} ({r['p99_ms']:.3g}) {r['policy']} {r['threads']}t{cost}"))
        table.add_row(escape(artifact), *cells)
    console.print(table)
    for h in merged["best_per_host"]:
        line = (f"{h['host']}: best {h['artifact']} on {h['runtime']} {h['policy']} {h['threads']}t, {h['qps']:,.0f} "
                "requests/s" if h.get("artifact") else f"{h['host']}: {h['why']}")
        console.print(line, markup=False)
    if json_out not in (None, "-"):
        console.print(f"wrote {json_out}", markup=False)
    if failed:
        raise typer.Exit(1)


def _print_merged(merged, written: list[Path]) -> None:
    """The hosts, then per batch size one table with a column group per host, then the best batch under the budget.
    Names come from other hosts' files: table cells are escaped, never read as rich markup."""
    from rich.markup import escape

    from pruneflow.benchmark.hosts_html import host_cells
    from pruneflow.benchmark.html import marks_note

    console = out_console()
    if not console.is_terminal:
        console = Console(highlight=False, soft_wrap=True, width=240)
    priced = any(h["price_per_hour"] for h in merged.hosts)
    for h in merged.hosts:
        cpu = h["host"]["cpu"]
        price = f"{h['price_per_hour']:g}/h ({h['price_source']})" if h["price_per_hour"] else (h["price_source"] or "no price")
        console.print(f"host {h['name']}: {cpu['model']} ({cpu['arch']}), {cpu['usable_cpus']} CPUs, ISA "
                      f"{' '.join(cpu['isa'])}; threads {h['settings'].get('threads') or 'runtime default'}; {price}; "
                      f"{h['file']}", markup=False)
    figures = ("p50 ms", "p99 ms", "samples/s", *(("cost / 1M",) if priced else ()))
    for batch in merged.batches():
        table = Table(title=f"batch {batch}", title_justify="left")
        table.add_column("artifact")
        table.add_column("runtime")
        for h in merged.hosts:
            for i, f in enumerate(figures):
                table.add_column(f"{escape(h['name']) if i == 0 else ''}\n{f}", justify="right")
        for variant, lane in merged.lanes():
            table.add_row(*(escape(c) for c in (variant, lane, *(c for h in merged.hosts for c in host_cells(
                merged.row(h["name"], variant, lane, batch), priced)))))
        console.print(table)
    if (note := marks_note(merged.rows)) is not None:
        console.print(note, markup=False)
    _print_merged_budget(console, merged, priced)
    for path in written:
        console.print(f"wrote {path}", markup=False)


def _print_merged_budget(console: Console, merged, priced: bool) -> None:
    """Per artifact x runtime, per host: the best batch within --p99-budget-ms, its samples/s and cost per million
    (``+``: the largest batch timed, a larger one may do better); then the line of exit 1 when nothing fits anywhere."""
    from rich.markup import escape

    from pruneflow.benchmark.html import entry_note, nothing_meets

    listed = merged.under_budget()
    chosen = {(e["host"], e["variant"], e["runtime_label"]): e for e in listed}
    if not chosen:
        return
    table = Table(title=f"best batch with p99 within {merged.p99_budget_ms:g} ms", title_justify="left")
    table.add_column("artifact")
    table.add_column("runtime")
    figures = ("batch", "samples/s", "per core", *(("cost / 1M",) if priced else ()))
    for h in merged.hosts:
        for i, f in enumerate(figures):
            table.add_column(f"{escape(h['name']) if i == 0 else ''}\n{f}", justify="right")
    for variant, lane in merged.lanes():
        cells = [variant, lane]
        for h in merged.hosts:
            e = chosen.get((h["name"], variant, lane))
            if e is None or e.get("batch") is None:
                cells += ["none fits" if e else "–", *["–"] * (len(figures) - 1)]
                continue
            cost = e.get("cost_per_million")
            cells += [f"{e['batch']}{'+' if e.get('largest_timed') else ''}", f"{e['throughput']:,.0f}",
                      f"{e['throughput_per_core']:,.0f}", *([f"{cost:.4g}" if cost is not None else "–"] if priced else [])]
        table.add_row(*(escape(c) for c in cells))
    console.print(table)
    for e in listed:
        if e.get("batch") is not None and entry_note(e):
            console.print(f"{e['host']}, {e['variant']} on {e['runtime_label']}, batch {e['batch']}: {entry_note(e)}",
                          markup=False)
    if merged.meets_budget() is False:
        console.print(nothing_meets(merged.p99_budget_ms), style="red", markup=False)


def _print_bench(result, written: list[Path]) -> None:
    """One table per batch size (columns with nothing in them left out; one run: labels without its name),
    then what was not timed, the host, the inputs and the files written. Cells are escaped: a file's name is never
    read as rich markup."""
    from rich.markup import escape

    from pruneflow.benchmark.html import low_confidence_note, table_cells, table_head

    console = out_console()
    if not console.is_terminal:  # logs and pipes: every figure whole, however wide
        console = Console(highlight=False, soft_wrap=True, width=240)
    models = {v.model for v in result.variants}
    head = table_head(result)
    for batch in result.settings.batches:
        rows = [r for r in result.rows if r.batch == batch]
        cells = [table_cells(result, r) for r in rows]
        if len(models) == 1:
            cells = [[row.lane.variant.label, *c[1:]] for row, c in zip(rows, cells)]
        keep = [i for i, h in enumerate(head) if h != "batch" and any(c[i] not in ("", "–") for c in cells)]
        where = f" of {next(iter(models))}" if len(models) == 1 else ""
        table = Table(title=escape(f"batch {batch}{where}: ratios against {result.baseline.name}"), title_justify="left")
        for i in keep:
            table.add_column(escape(head[i]), justify="left" if i in (0, 1, len(head) - 1) else "right",
                             no_wrap=0 < i < len(head) - 1)
        for row, c in zip(rows, cells):
            table.add_row(*(escape(c[i]) for i in keep), style="bold" if row.lane.variant is result.baseline else None)
        console.print(table)
    if (note := result.metric_note()) is not None:
        console.print(note, markup=False)
    if (marks := low_confidence_note(result)) is not None:
        console.print(marks, markup=False)
    for v in result.variants:
        if not v.timed:
            console.print(f"{v.name}: {v.untimed_detail()}", markup=False)
    cpu = result.host["cpu"]
    label = f"{result.host['label']}, " if result.host.get("label") else ""
    console.print(f"host: {label}{cpu['model']} ({cpu['arch']}), {cpu['usable_cpus']} CPUs, ISA {' '.join(cpu['isa'])}; "
                  f"threads {result.settings.threads or 'runtime default'}", markup=False)
    if result.settings.price_source and result.settings.price_per_hour is None:
        console.print(f"cost per million: none, {result.settings.price_source}", markup=False)
    _print_budget(console, result)
    settings = result.settings
    runs = sorted({r.stats.runs for r in result.rows if r.stats is not None})
    timed = f" ({runs[0]} timed)" if len(runs) == 1 else f" ({runs[0]} to {runs[-1]} timed)" if runs else ""
    console.print(f"timing: interleaved, {settings.window().describe()}{timed} per batch size after {settings.warmup} "
                  f"warm-up, threads {settings.threads or 'runtime default'} (the export stage's defaults: 50 runs, "
                  "3 warm-up, 1 thread)", markup=False)
    for what in sorted(set(result.inputs.values())):
        console.print(f"input: {what}", markup=False)
    if result.benchmark_app["asked"]:
        console.print(f"benchmark_app: {result.benchmark_app['how']}", markup=False)
    for path in written:
        console.print(f"wrote {path}", markup=False)
