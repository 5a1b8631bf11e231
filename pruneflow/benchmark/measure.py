"""Timing: every artifact on every runtime asked for, all in one interleaved loop per batch size.

A *lane* is one variant loaded in one runtime configuration (onnxruntime; OpenVINO with its default
inference precision; OpenVINO forced to f32). Each batch size times every lane in turn within each
repetition (``pruneflow.runtime.time_interleaved``), so machine load hits all alike and ratios hold.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..context import Reporter
from .. import registry
from ..errors import PruneflowError, UsageError
from ..formats import runtime_named
from ..headline import NOISY_SPREAD
from ..runtime import Executor, LatencyStats, RuntimeUnavailable, open_artifact, runtimes_for
from ..runtime.timing import DEFAULT_RUNS, DEFAULT_THREADS, DEFAULT_WARMUP, interleaved_times
from .inputs import Feeds
from .variants import Variant

OPENVINO_HINTS = ("default", "f32", "bf16", "f16")
#: Cap on the runs a --duration may turn into (a sub-microsecond model would otherwise loop for ever).
MAX_RUNS = 100_000
#: Timed runs a p99 needs before a service owner can trust it. Of n runs, the p99 sits at sorted index 0.99 (n - 1):
#: below 200 it is the second-worst run (or nearer the worst), so one stray run moves it; from 200 on at least two
#: runs are slower than it. A p99 from fewer runs is marked low-confidence (``p99_low_confidence``).
MIN_P99_RUNS = 200
#: Without --runs or --duration, each batch size is timed until MIN_P99_RUNS runs or for this many seconds (every lane
#: in turn), whichever comes first, and never for fewer than DEFAULT_RUNS runs.
AUTO_SECONDS = 20.0


@dataclass
class BenchSettings:
    """What `pruneflow bench` was asked; recorded in its JSON."""

    runtimes: list[str] | None = None
    batches: list[int] = field(default_factory=lambda: [1, 32])
    warmup: int = DEFAULT_WARMUP
    #: Timed runs per batch size; None: enough for the p99 (``MIN_P99_RUNS``) within ``AUTO_SECONDS`` (``window``).
    runs: int | None = None
    #: Seconds of timing per batch size (a window: every lane in turn until it has passed), instead of ``runs``.
    duration: float | None = None
    threads: int | None = DEFAULT_THREADS  # None: the runtime's own choice
    baseline: str | None = None
    openvino_precisions: list[str] = field(default_factory=lambda: ["default", "f32"])
    benchmark_app: bool = False
    seed: int = 0
    #: The latency budget the best batch is chosen under (``BenchResult.under_budget``), in milliseconds at p99.
    p99_budget_ms: float | None = None
    #: What the machine costs an hour (any currency): each row's cost per million inferences follows.
    price_per_hour: float | None = None
    #: Where the price came from (``--price-per-hour``, or the price table's file and entry), or why there is none.
    price_source: str | None = None
    #: A name for this machine (``--host-label``, e.g. an instance type): recorded as ``host.label``, matched by a
    #: price table and naming the host when several hosts' results are merged.
    host_label: str | None = None
    #: The figure each row shows (``--metric``: a multi-head run's other head, ``finish.auc``); None: the run's headline.
    metric: str | None = None

    def check(self) -> None:
        """Bad values are usage errors (exit 2) naming the option."""
        known = registry.runtimes.names()
        unknown = [r for r in self.runtimes or [] if r not in known]
        if unknown:
            raise UsageError(f"--runtime {', '.join(unknown)}: unknown runtime", hint=f"use {', '.join(known)}")
        bad_hints = [h for h in self.openvino_precisions if h not in OPENVINO_HINTS]
        if bad_hints or not self.openvino_precisions:
            raise UsageError(f"--openvino-precision {','.join(bad_hints) or '(empty)'}: unknown precision hint",
                             hint=f"use a comma-separated list of {', '.join(OPENVINO_HINTS)}")
        if not self.batches or any(b < 1 for b in self.batches):
            raise UsageError(f"--batch {self.batches}: batch sizes must be positive integers", hint="e.g. --batch 1,32")
        for option, value in (("--p99-budget-ms", self.p99_budget_ms), ("--price-per-hour", self.price_per_hour),
                              ("--duration", self.duration)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise UsageError(f"{option} {value:g}: must be a positive finite number",
                                 hint="e.g. --p99-budget-ms 20 --price-per-hour 0.34 --duration 10")
        if self.runs is not None and self.duration is not None:
            raise UsageError("--runs and --duration both given", hint="time a fixed number of runs or for a duration, not both")
        if (self.runs is not None and self.runs < 1) or self.warmup < 0:
            raise UsageError(f"--runs {self.runs}, --warmup {self.warmup}: --runs must be >= 1 and --warmup >= 0",
                             hint=f"e.g. --runs {MIN_P99_RUNS} --warmup 5, or leave --runs out: enough runs for the p99")

    def window(self) -> "Window":
        """How long each batch size is timed: ``--runs N`` exactly; ``--duration S`` for S seconds (at least 3 runs);
        neither: until ``MIN_P99_RUNS`` runs or ``AUTO_SECONDS``, whichever first, at least ``DEFAULT_RUNS``."""
        if self.runs is not None:
            return Window(self.runs, self.runs, None)
        if self.duration is not None:
            return Window(3, MAX_RUNS, self.duration)
        return Window(DEFAULT_RUNS, MIN_P99_RUNS, AUTO_SECONDS)

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Window:
    """Runs per batch size: at least ``least``, at most ``most``, and in between until ``seconds`` have passed."""

    least: int
    most: int
    seconds: float | None = None

    def describe(self) -> str:
        if self.seconds is None:
            return f"{self.most} runs"
        if self.most >= MAX_RUNS:
            return f"for {self.seconds:g} s"
        return f"{self.most} runs or {self.seconds:g} s, whichever first (at least {self.least})"


@dataclass(eq=False)
class Lane:
    """One variant on one runtime configuration; ``error`` when it could not be loaded or run."""

    variant: Variant
    runtime: str
    hint: str | None
    executor: Executor | None = None
    error: str | None = None

    @property
    def label(self) -> str:
        """``onnxruntime/CPU``, ``openvino/CPU default=bf16``, ``openvino/CPU f32``: the runtime column."""
        device = self.executor.device if self.executor is not None else "?"
        if not runtime_named(self.runtime).takes_precision_hint:
            return f"{self.runtime}/{device}"
        used = self.inference_precision
        return f"{self.runtime}/{device} " + (self.hint or (f"default={used}" if used else "default"))

    @property
    def inference_precision(self) -> str | None:
        """What OpenVINO actually computes in (``bf16``, ``f32``), read back from the compiled model."""
        raw = str((self.executor.info if self.executor else {}).get("inference_precision", ""))
        name = (re.findall(r"'([^']+)'", raw) or [raw])[0]
        return {"bfloat16": "bf16", "float32": "f32", "float16": "f16"}.get(name, name or None)


def open_lanes(variants: list[Variant], settings: BenchSettings) -> list[Lane]:
    """Load every timed variant in every runtime asked for that can load it; failures become lane errors."""
    lanes: list[Lane] = []
    for variant in (v for v in variants if v.timed):
        assert variant.path is not None
        runtimes = [r for r in runtimes_for(variant.path) if settings.runtimes is None or r in settings.runtimes]
        for refused, why in variant.refused.items():
            if refused in runtimes:
                runtimes.remove(refused)
                variant.notes.append(why)
        if not runtimes:
            variant.notes.append(f"--runtime {','.join(settings.runtimes or [])} cannot load {variant.path.suffix} files")
        for runtime in runtimes:
            if variant.shortfall:  # timing it would time another model than the one it was built as
                lanes.append(Lane(variant, runtime, None, error=f"not timed: {variant.shortfall}"))
                continue
            hints = ([None if h == "default" else h for h in settings.openvino_precisions]
                     if runtime_named(runtime).takes_precision_hint else [None])
            opened = [_open(variant, runtime, hint, settings.threads) for hint in hints]
            lanes += _without_duplicate_f32(opened)
    return lanes


def _open(variant: Variant, runtime: str, hint: str | None, threads: int | None) -> Lane:
    lane = Lane(variant, runtime, hint)
    try:
        lane.executor = open_artifact(variant.path, runtime=runtime, threads=threads, precision_hint=hint)  # type: ignore[arg-type]
    except RuntimeUnavailable as exc:
        lane.error = f"unavailable: {exc.message}"
    except Exception as exc:  # noqa: BLE001 - one artifact that will not load must not stop the others
        lane.error = f"failed to load: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return lane


def _without_duplicate_f32(lanes: list[Lane]) -> list[Lane]:
    """Where OpenVINO's default already computes in f32, a forced-f32 lane would time the same thing twice."""
    default = next((la for la in lanes if la.hint is None and la.executor is not None), None)
    if default is None or default.inference_precision != "f32":
        return lanes
    for lane in lanes:
        if lane.hint == "f32":
            default.variant.notes.append("OpenVINO's default precision is already f32 here: the forced-f32 run is skipped")
    return [la for la in lanes if la.hint != "f32"]


@dataclass
class Row:
    """One lane at one batch size: the figures, or the reason there are none."""

    lane: Lane
    batch: int
    stats: LatencyStats | None = None
    error: str | None = None
    speedup: float | None = None
    baseline_runtime: str | None = None
    #: The input's shape as fed (batch first).
    shape: tuple[int, ...] | None = None
    benchmark_app: dict[str, Any] | None = None
    #: p90/p50 of this row, or of its ratio's baseline row when that is larger (``add_ratios``): the spread the
    #: headline of report.md flags NOISY above ``NOISY_SPREAD``.
    spread: float | None = None

    @property
    def noisy(self) -> bool:
        """The same rule as report.md's headline (``headline.NOISY_SPREAD``): p90/p50 above 1.5 on either side."""
        return self.spread is not None and self.spread > NOISY_SPREAD

    @property
    def p99_low_confidence(self) -> bool:
        """Fewer than ``MIN_P99_RUNS`` timed runs behind the p99: it is the second-worst run, or nearer the worst."""
        return self.stats is not None and self.stats.runs < MIN_P99_RUNS


def spread(stats: LatencyStats | None) -> float | None:
    """p90/p50 of one lane's timings (None without figures)."""
    return stats.p90_ms / stats.p50_ms if stats is not None and stats.p50_ms > 0 else None


def time_all(lanes: list[Lane], feeds: Feeds, settings: BenchSettings, reporter: Reporter) -> list[Row]:
    """Per batch size: one input per lane, a trial call, then every working lane timed in one interleaved loop."""
    rows: list[Row] = []
    for batch in settings.batches:
        batch_rows = [Row(lane, batch, error=lane.error) for lane in lanes]
        ready: dict[str, Callable[[np.ndarray], object]] = {}
        for i, row in enumerate(batch_rows):
            runner = _trial(row, feeds) if row.lane.executor is not None and row.error is None else None
            if runner is not None:
                ready[str(i)] = runner
        if ready:
            stats = _interleaved(ready, batch, settings, reporter)
            for i, row in enumerate(batch_rows):
                row.stats = stats.get(str(i))
        rows += batch_rows
    return rows


def _trial(row: Row, feeds: Feeds) -> Callable[[np.ndarray], object] | None:
    """The lane's runner on its own input (ignoring the placeholder the loop passes), after one trial call."""
    variant, executor = row.lane.variant, row.lane.executor
    assert executor is not None
    if variant.input is not None and not variant.input.batch_fits(row.batch):
        row.error = f"static batch {variant.input.shape[0]}: cannot run batch {row.batch}"
        return None
    try:
        x = feeds.batch(variant, row.batch)
        row.shape = tuple(int(d) for d in (x.shape if isinstance(x, np.ndarray) else next(iter(x.values())).shape))
        executor(x)
    except PruneflowError as exc:
        row.error = exc.message
        return None
    except Exception as exc:  # noqa: BLE001 - a runtime error on one artifact: reported on its row
        row.error = f"failed to run: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return None
    return lambda _placeholder: executor(x)


def _interleaved(ready: dict[str, Callable[[np.ndarray], object]], batch: int, settings: BenchSettings,
                 reporter: Reporter) -> dict[str, LatencyStats]:
    placeholder = np.zeros((batch,), dtype=np.float32)  # only its length is read (the samples per call)
    window = settings.window()
    interleaved_times(ready, placeholder, warmup=settings.warmup, runs=0)
    total = window.most if window.most < MAX_RUNS else None
    with reporter.progress(f"batch {batch}: {len(ready)} artifact-runtime pairs, timed in turn", total=total) as advance:
        times = timed_window(ready, placeholder, window, advance)
    return {name: LatencyStats.of(t, batch) for name, t in times.items()}


def timed_window(ready: dict[str, Callable[[Any], object]], feed: Any, window: Window,
                 on_step: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """Raw times (ms) of repetitions that each run every lane once, in turn, until ``window`` is over: a duration is a
    real window of time (the repetitions stop when it has passed), not a count guessed from a probe."""
    times: dict[str, list[float]] = {name: [] for name in ready}
    start, done = time.perf_counter(), 0
    while done < window.most and (done < window.least or window.seconds is None
                                  or time.perf_counter() - start < window.seconds):
        for name, taken in interleaved_times(ready, feed, warmup=0, runs=1).items():
            times[name] += taken
        done += 1
        if on_step is not None:
            on_step()
    return times


def add_ratios(rows: list[Row], baseline: Variant) -> None:
    """Speed-up = baseline p50 / variant p50, against the baseline on the same runtime configuration and batch
    (else on its first runtime at that batch); each row's spread, the larger p90/p50 of the two (as the headline's)."""
    base = [r for r in rows if r.lane.variant is baseline and r.stats is not None]
    for row in rows:
        if row.stats is None:
            continue
        row.spread = spread(row.stats)
        ref = next((b for b in base if b.batch == row.batch and b.lane.label == row.lane.label), None) or next(
            (b for b in base if b.batch == row.batch), None)
        if ref is not None and ref.stats is not None and row.stats.p50_ms > 0:
            row.speedup = ref.stats.p50_ms / row.stats.p50_ms
            row.baseline_runtime = ref.lane.label
            row.spread = max(row.spread or 0.0, spread(ref.stats) or 0.0)
