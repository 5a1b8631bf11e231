"""pruneflow from Python: what the CLI does, as functions that return results and raise errors.

    import pruneflow

    result = pruneflow.optimize("recipes/quickstart.yaml", out="runs", overrides=["stages.0.epochs=2"])
    result.exit_code                 # 0 passed, 1 a gate failed (the run folder is complete either way)
    result.headline_rows()           # start -> result against the model the run started from
    notes = pruneflow.validate("recipes/quickstart.yaml")           # raises RecipeError (exit_code 2) when wrong
    table = pruneflow.bench(["runs/quickstart"], batches=[1, 32])  # BenchResult: rows, ratios, host

Errors are ``pruneflow.errors.PruneflowError`` subclasses, each with the CLI's ``exit_code``, ``message`` and ``hint``:
``RecipeError`` (its ``issues`` give FILE:LINE and key of each problem), ``InputError``, ``MissingDependencyError``,
``StageError``. ``optimize`` shows its progress on stderr, a line a stage (``TextReporter``; under a notebook cell);
``progress=False`` is silent, and ``reporter`` takes any ``pruneflow.context.Reporter``. Every run also logs to
``OUT/NAME/logs/pruneflow.log``.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

from .context import Reporter

if TYPE_CHECKING:
    from .benchmark import BenchResult
    from .results import RunResult


class TextReporter(Reporter):
    """Progress as plain lines on ``stream`` (stderr): each stage as it starts and finishes (with the headline metric),
    any step that took 5 s or more (a training epoch), and warnings. What ``pruneflow.optimize`` shows by default."""

    SLOW_STEP_SECONDS = 5.0

    def __init__(self, stream: IO[str] | None = None):
        self.stream = stream
        self.headline = ""

    def say(self, text: str) -> None:
        print(f"pruneflow: {text}", file=self.stream or sys.stderr, flush=True)

    def run_started(self, name: str, task: dict) -> None:
        super().run_started(name, task)
        self.headline = str(task.get("headline", ""))
        self.say(f"run {name} (task {task.get('type')}, headline {self.headline})")

    def stage_started(self, stage_id: str, stage_type: str, index: int, total: int) -> None:
        super().stage_started(stage_id, stage_type, index, total)
        self.say(f"{index + 1}/{total} {stage_id} ({stage_type}) ...")

    def stage_finished(self, stage_id: str, seconds: float, metrics: dict, skipped: bool = False) -> None:
        super().stage_finished(stage_id, seconds, metrics, skipped)
        value = metrics.get(self.headline)
        shown = f", {self.headline} {value:.4g}" if isinstance(value, (int, float)) else ""
        self.say(f"  {stage_id} {'resumed from its checkpoint' if skipped else f'done in {seconds:.1f} s'}{shown}")

    @contextlib.contextmanager
    def progress(self, description: str, total: int | None) -> Iterator[Callable[..., None]]:
        started = time.perf_counter()
        yield lambda n=1, **fields: None
        if (took := time.perf_counter() - started) >= self.SLOW_STEP_SECONDS:
            self.say(f"  {description} ({took:.0f} s)")

    def warning(self, message: str) -> None:
        super().warning(message)
        self.say(f"warning: {message}")


def optimize(recipe: str | Path, out: str | Path = "runs", overrides: Iterable[str] = (), *, resume: bool = False,
             allow_paths: Iterable[str | Path] = (), trust_code: Iterable[str] = (), reporter: Reporter | None = None,
             progress: bool = True) -> "RunResult":
    """Run ``recipe`` into ``OUT/NAME`` (`pruneflow optimize`); ``overrides`` are ``--set`` items (``"seed=1"``),
    ``trust_code`` the ``--trust-code`` callables (code beyond the zoo and the recipe's folder it may run).

    Progress goes to ``reporter``; without one, a line a stage on stderr (``TextReporter``), or nothing with
    ``progress=False``. ``print(result)`` shows the verdict, the headline and the gates."""
    from .pipeline import run_recipe
    from .recipe import load_recipe

    shown = reporter or (TextReporter() if progress else Reporter())
    loaded = load_recipe(recipe, list(overrides), list(allow_paths), list(trust_code))
    result = run_recipe(loaded, out=out, reporter=shown, resume=resume)
    if isinstance(shown, TextReporter):
        shown.say(f"{'PASSED' if result.exit_code == 0 else f'exit {result.exit_code}'}: {result.run_dir / 'report.md'} "
                  f"(log: {result.run_dir / 'logs' / 'pruneflow.log'}); print(result) for the summary")
    return result


def validate(recipe: str | Path, overrides: Iterable[str] = (), *, allow_paths: Iterable[str | Path] = (),
             trust_code: Iterable[str] = ()) -> list[str]:
    """Check ``recipe`` as `pruneflow validate` does, running none of its code; returns the notes (a target that
    will be prepared, not built), raises what is wrong."""
    from .pipeline import plan_stages, preflight
    from .recipe import load_recipe

    loaded = load_recipe(recipe, list(overrides), list(allow_paths), list(trust_code))
    return preflight(loaded, plan_stages(loaded), None)


def bench(sources: Sequence[str | Path], *, batches: Sequence[int] = (1, 32), runs: int | None = None,
          warmup: int | None = None, threads: int | None = 1, runtimes: Sequence[str] | None = None,
          baseline: str | None = None, p99_budget_ms: float | None = None, price_per_hour: float | str | Path | None = None,
          host_label: str | None = None, metric: str | None = None, reporter: "Reporter | None" = None) -> "BenchResult":
    """Time run folders and artifact files side by side (`pruneflow bench`), with its defaults (``runs`` None: until 200
    runs back each p99, or 20 s a batch size, at least 50); ``price_per_hour`` is a
    price or a price table file, as ``--price-per-hour``; ``metric`` the figure shown, as ``--metric``."""
    from .benchmark import BenchSettings, price_for_this_host, run_bench
    from .runtime.timing import DEFAULT_WARMUP

    price, source = price_for_this_host(None if price_per_hour is None else str(price_per_hour), host_label)
    settings = BenchSettings(runtimes=list(runtimes) if runtimes else None, batches=list(batches),
                             runs=runs, warmup=DEFAULT_WARMUP if warmup is None else warmup,
                             threads=threads, baseline=baseline, p99_budget_ms=p99_budget_ms, price_per_hour=price,
                             price_source=source, host_label=host_label, metric=metric)
    return run_bench([Path(s) for s in sources], settings, reporter)
