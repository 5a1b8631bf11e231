"""`pruneflow bench`: artifacts of one or several runs side by side, timed interleaved on every runtime.

    from pruneflow.benchmark import BenchSettings, run_bench

    result = run_bench([Path("runs/a"), Path("runs/b")], BenchSettings(batches=[1, 32]))
    result_json(result)["results"][0]["p50_ms"], result.baseline.name, result.exit_code()

Statistics a service owner can trust: each batch size is timed until enough runs back its p99 (``MIN_P99_RUNS``, within
``AUTO_SECONDS``), or exactly ``runs``, or over a window of ``duration`` seconds; a p99 from fewer runs is marked
low-confidence, a row whose p90/p50 passes report.md's ``NOISY_SPREAD`` is NOISY, cost per million is the machine's
price times the share of its CPUs the lane uses, and ``exit_code()`` is 1 when nothing meets ``p99_budget_ms``.

Everything runs through the runtime layer (``pruneflow.runtime``): ``open_artifact`` loads each file,
``time_interleaved`` times all of them in one loop per batch size, ``host_info`` describes the machine.
The library prints nothing; ``cli/bench.py`` renders the table and writes the files (``write_outputs``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import cgroup_memory_left as cgroup_memory_left, memory_left
from ..context import Reporter
from ..errors import PruneflowError, UsageError
from ..runtime import RuntimeUnavailable, host_info
from .appcheck import benchmark_app_command, run_benchmark_app
from .inputs import Feeds
from .exposition import result_json
from .hosts import MergedBench, Prices, merge
from .measure import BenchSettings, Lane, Row, add_ratios, open_lanes, time_all
from .result import BenchResult
from .variants import Variant, collect_variants, pick_baseline

__all__ = ["BenchResult", "BenchSettings", "Lane", "MergedBench", "Prices", "Row", "Variant", "merge", "price_for_this_host",
           "result_json", "run_bench", "write_outputs"]


def run_bench(sources: list[Path], settings: BenchSettings, reporter: Reporter | None = None) -> BenchResult:
    """Collect the variants, load each in every runtime asked for, time them all interleaved, add ratios.

    Raises UsageError/InputError (exit 2) for a wrong argument and RuntimeUnavailable (exit 3) when no
    runtime asked for could load any artifact."""
    reporter = reporter or Reporter()
    settings.check()
    variants = collect_variants(sources, settings.metric)
    baseline = pick_baseline(variants, settings.baseline)
    lanes = open_lanes(variants, settings)
    _check_something_loads(lanes, settings)
    feeds = Feeds(settings.seed)
    inputs = {v.name: feeds.source(v).what for v in variants if v.timed}
    _check_memory([v for v in variants if v.timed], feeds, settings)
    rows = time_all(lanes, feeds, settings, reporter)
    if not any(r.stats for r in rows):
        failures = "; ".join(sorted({f"{r.lane.variant.name}: {r.error}" for r in rows if r.error}))
        raise PruneflowError(f"no artifact could be timed: {failures}", hint="run again with -v, or bench one file at a time")
    add_ratios(rows, baseline)
    app = {"asked": settings.benchmark_app, "available": False, "how": "not asked (--benchmark-app)"}
    if settings.benchmark_app:
        app.update(_second_opinion(rows, settings, reporter))
    return BenchResult(this_host(settings.host_label), settings, variants, rows, baseline, inputs, app)


def price_for_this_host(text: str | None, host_label: str | None = None) -> tuple[float | None, str | None]:
    """``--price-per-hour`` (a number or a price table file) for the machine bench runs on: ``(price, source)``,
    or ``(None, why)`` when the table has no entry for it; ``(None, None)`` when no price was given."""
    prices = Prices.parse(text)
    if prices is None:
        return None, None
    return prices.for_host(this_host(host_label))


def this_host(label: str | None) -> dict[str, Any]:
    """``host_info()`` with the ``--host-label`` it was given (a copy: host_info is cached)."""
    return {**host_info(), "label": label} if label else host_info()


#: One batch's input may take at most this share of the memory available: the runtime's activations, its copy of the
#: input and the outputs need the rest.
BATCH_MEMORY_SHARE = 0.1
#: The batch bench suggests is this share of the largest that fits now, so that it still fits on the next run, when
#: the memory available has moved a little (another process, the page cache, the runtime's own arenas).
ADVICE_MARGIN = 0.8
def memory_available() -> tuple[int | None, str]:
    """``(bytes this process may still allocate, where the figure comes from)``: the machine's, lowered to what the
    process's own memory control group (v2 ``memory.max``, v1 ``memory.limit_in_bytes``, at every level up to the
    mount) leaves, as a container's limit is enforced (``config.memory_left``)."""
    return memory_left()


def _check_memory(variants: list, feeds: Feeds, settings: BenchSettings) -> None:
    """``--batch 1000000000`` grew until the kernel killed bench: each batch's input is sized before it is made,
    and one that would not leave room is a usage error (exit 2) naming the variant and the largest batch to use
    (with a margin, so that the batch suggested is not refused by the next run)."""
    free, where = memory_available()
    if free is None:
        return
    for variant in variants:
        per_sample = feeds.sample_bytes(variant)
        for batch in settings.batches:
            if per_sample and batch * per_sample > BATCH_MEMORY_SHARE * free:
                fits = max(1, int(ADVICE_MARGIN * BATCH_MEMORY_SHARE * free // per_sample))
                raise UsageError(f"--batch {batch}: one batch of {variant.name}'s input would take "
                                 f"{batch * per_sample / 1e9:,.2f} GB ({per_sample:,} bytes a sample), and there are "
                                 f"{free / 1e9:,.2f} GB available {where.removeprefix('available ')}; bench allows a batch "
                                 f"{BATCH_MEMORY_SHARE:.0%} of that",
                                 hint=f"use --batch {fits} or less")


def _check_something_loads(lanes: list[Lane], settings: BenchSettings) -> None:
    if any(lane.executor is not None for lane in lanes):
        return
    if not lanes:
        raise UsageError(f"--runtime {','.join(settings.runtimes or [])} loads none of the artifacts given",
                         hint="leave --runtime out to use every runtime that loads each file")
    reasons = "; ".join(sorted({f"{lane.variant.name} on {lane.runtime}: {lane.error}" for lane in lanes}))
    if all((lane.error or "").startswith("unavailable") for lane in lanes):
        raise RuntimeUnavailable(f"no runtime asked for is available for any artifact ({reasons})",
                                 hint="install the runtime (pip install onnxruntime / openvino), or bench on the machine it needs")
    raise PruneflowError(f"no artifact could be loaded ({reasons})", hint="check the files with `pruneflow inspect`")


def _app_times(runtime: str, path: Path) -> bool:
    """Whether the runtime's vendor tool (OpenVINO's benchmark_app) times this lane: a file of its native format (an IR)."""
    from ..formats import format_of, runtime_named

    fmt = format_of(path)
    return fmt is not None and fmt.native_runtime == runtime and runtime_named(runtime).vendor_benchmark


def _second_opinion(rows: list[Row], settings: BenchSettings, reporter: Reporter) -> dict[str, Any]:
    """benchmark_app on every timed IR row (same file, batch, precision hint and threads)."""
    prefix, how = benchmark_app_command()
    if prefix is None:
        return {"available": False, "how": how}
    chosen = [r for r in rows if r.stats is not None and r.lane.variant.path is not None
              and _app_times(r.lane.runtime, r.lane.variant.path)]
    with reporter.progress("benchmark_app on each IR", total=len(chosen)) as advance:
        for row in chosen:
            assert row.lane.variant.path is not None and row.shape is not None and row.stats is not None
            row.benchmark_app = run_benchmark_app(prefix, row.lane.variant.path, row.shape, row.lane.hint,
                                                  settings.threads, row.stats.runs, settings.duration)
            advance()
    return {"available": True, "how": how}



def write_outputs(result: BenchResult | MergedBench, *, json_file: Path | None = None, html: Path | None = None,
                  prometheus: Path | None = None) -> list[Path]:
    """Write the files asked for (of one bench, or of several hosts merged), each atomically; returns them in that
    order."""
    import json

    from .exposition import exposition, prometheus_text, write_files
    from .hosts_html import merged_html
    from .html import html_report

    if isinstance(result, MergedBench):
        merged = result
        chosen = merged.under_budget()
        renders = (lambda: json.dumps(merged.as_json(), indent=2, allow_nan=False) + "\n", lambda: merged_html(merged),
                   lambda: exposition([(h["name"], [r for r in merged.rows if r["host"] == h["name"]],
                                        [e for e in chosen if e["host"] == h["name"]]) for h in merged.hosts]))
    else:
        single = result
        renders = (lambda: json.dumps(result_json(single), indent=2, allow_nan=False) + "\n",
                   lambda: html_report(single), lambda: prometheus_text(single))
    return write_files((json_file, html, prometheus), renders)
