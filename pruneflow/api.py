"""pruneflow from Python: what the CLI does, as functions that return results and raise errors.

    import pruneflow

    result = pruneflow.optimize("recipes/quickstart.yaml", out="runs", overrides=["stages.0.epochs=2"])
    result.exit_code                 # 0 passed, 1 a gate failed (the run folder is complete either way)
    result.headline_rows()           # start -> result against the model the run started from
    notes = pruneflow.validate("recipes/quickstart.yaml")           # raises RecipeError (exit_code 2) when wrong
    table = pruneflow.bench(["runs/quickstart"], batches=[1, 32])  # BenchResult: rows, ratios, host

Errors are ``pruneflow.errors.PruneflowError`` subclasses, each with the CLI's ``exit_code``, ``message`` and ``hint``:
``RecipeError`` (its ``issues`` give FILE:LINE and key of each problem), ``InputError``, ``MissingDependencyError``,
``StageError``. Progress goes to ``reporter`` (a ``pruneflow.context.Reporter``; the default is silent).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Sequence

if TYPE_CHECKING:
    from .benchmark import BenchResult
    from .context import Reporter
    from .results import RunResult


def optimize(recipe: str | Path, out: str | Path = "runs", overrides: Iterable[str] = (), *, resume: bool = False,
             allow_paths: Iterable[str | Path] = (), trust_code: Iterable[str] = (),
             reporter: "Reporter | None" = None) -> "RunResult":
    """Run ``recipe`` into ``OUT/NAME`` (`pruneflow optimize`); ``overrides`` are ``--set`` items (``"seed=1"``),
    ``trust_code`` the ``--trust-code`` callables (code beyond the zoo and the recipe's folder it may run)."""
    from .pipeline import run_recipe
    from .recipe import load_recipe

    loaded = load_recipe(recipe, list(overrides), list(allow_paths), list(trust_code))
    return run_recipe(loaded, out=out, reporter=reporter, resume=resume)


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
    """Time run folders and artifact files side by side (`pruneflow bench`), with its defaults; ``price_per_hour`` is a
    price or a price table file, as ``--price-per-hour``; ``metric`` the figure shown, as ``--metric``."""
    from .benchmark import BenchSettings, price_for_this_host, run_bench
    from .runtime.timing import DEFAULT_RUNS, DEFAULT_WARMUP

    price, source = price_for_this_host(None if price_per_hour is None else str(price_per_hour), host_label)
    settings = BenchSettings(runtimes=list(runtimes) if runtimes else None, batches=list(batches),
                             runs=DEFAULT_RUNS if runs is None else runs, warmup=DEFAULT_WARMUP if warmup is None else warmup,
                             threads=threads, baseline=baseline, p99_budget_ms=p99_budget_ms, price_per_hour=price,
                             price_source=source, host_label=host_label, metric=metric)
    return run_bench([Path(s) for s in sources], settings, reporter)
