"""Timing: every artifact on every runtime asked for, all in one interleaved loop per batch size.

A *lane* is one variant loaded in one runtime configuration (onnxruntime; OpenVINO with its default
inference precision; OpenVINO forced to f32). Each batch size times every lane in turn within each
repetition (``pruneflow.runtime.time_interleaved``), so machine load hits all alike and ratios hold.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..context import Reporter
from ..errors import PruneflowError, UsageError
from ..runtime import Executor, LatencyStats, RuntimeUnavailable, open_artifact, runtimes_for, time_interleaved
from ..runtime.timing import DEFAULT_RUNS, DEFAULT_THREADS, DEFAULT_WARMUP
from .inputs import Feeds
from .variants import Variant

KNOWN_RUNTIMES = tuple(dict.fromkeys(r for suffix in (".onnx", ".xml", ".engine") for r in runtimes_for(f"x{suffix}")))
OPENVINO_HINTS = ("default", "f32", "bf16", "f16")
#: Cap on the runs a --duration may turn into (a sub-microsecond model would otherwise loop for ever).
MAX_RUNS = 100_000


@dataclass
class BenchSettings:
    """What `pruneflow bench` was asked; recorded in its JSON."""

    runtimes: list[str] | None = None
    batches: list[int] = field(default_factory=lambda: [1, 32])
    warmup: int = DEFAULT_WARMUP
    runs: int = DEFAULT_RUNS
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

    def check(self) -> None:
        """Bad values are usage errors (exit 2) naming the option."""
        unknown = [r for r in self.runtimes or [] if r not in KNOWN_RUNTIMES]
        if unknown:
            raise UsageError(f"--runtime {', '.join(unknown)}: unknown runtime", hint=f"use {', '.join(KNOWN_RUNTIMES)}")
        bad_hints = [h for h in self.openvino_precisions if h not in OPENVINO_HINTS]
        if bad_hints or not self.openvino_precisions:
            raise UsageError(f"--openvino-precision {','.join(bad_hints) or '(empty)'}: unknown precision hint",
                             hint=f"use a comma-separated list of {', '.join(OPENVINO_HINTS)}")
        if not self.batches or any(b < 1 for b in self.batches):
            raise UsageError(f"--batch {self.batches}: batch sizes must be positive integers", hint="e.g. --batch 1,32")
        if any(v is not None and not v > 0 for v in (self.p99_budget_ms, self.price_per_hour)):
            raise UsageError("--p99-budget-ms and --price-per-hour must be positive", hint="e.g. --p99-budget-ms 20 --price-per-hour 0.34")
        if self.runs < 1 or self.warmup < 0 or (self.duration is not None and self.duration <= 0):
            raise UsageError("--runs must be >= 1, --warmup >= 0 and --duration > 0", hint="e.g. --runs 50 --warmup 5")

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


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
        if self.runtime != "openvino":
            return f"{self.runtime}/{device}"
        used = self.inference_precision
        return f"openvino/{device} " + (self.hint or (f"default={used}" if used else "default"))

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
        if variant.onnxruntime_only and "openvino" in runtimes:
            runtimes.remove("openvino")
            variant.notes.append("onnxruntime's fused contrib ops (com.microsoft): OpenVINO does not read this file")
        if not runtimes:
            variant.notes.append(f"--runtime {','.join(settings.runtimes or [])} cannot load {variant.path.suffix} files")
        for runtime in runtimes:
            if variant.shortfall:  # timing it would time another model than the one it was built as
                lanes.append(Lane(variant, runtime, None, error=f"not timed: {variant.shortfall}"))
                continue
            hints = [None if h == "default" else h for h in settings.openvino_precisions] if runtime == "openvino" else [None]
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
    runs, warmup = settings.runs, settings.warmup
    if settings.duration is not None:
        probe = time_interleaved(ready, placeholder, warmup=warmup, runs=3)
        per_repetition_ms = sum(s.mean_ms for s in probe.values())
        runs = int(min(MAX_RUNS, max(3, math.ceil(settings.duration * 1000 / max(per_repetition_ms, 1e-6)))))
        warmup = 0
    with reporter.progress(f"batch {batch}: {len(ready)} artifact-runtime pairs, timed in turn", total=runs) as advance:
        timed = time_interleaved(ready, placeholder, warmup=warmup, runs=runs, on_step=advance)
    return dict(timed)


def add_ratios(rows: list[Row], baseline: Variant) -> None:
    """Speed-up = baseline p50 / variant p50, against the baseline on the same runtime configuration and batch
    (else on its first runtime at that batch)."""
    base = [r for r in rows if r.lane.variant is baseline and r.stats is not None]
    for row in rows:
        if row.stats is None:
            continue
        ref = next((b for b in base if b.batch == row.batch and b.lane.label == row.lane.label), None) or next(
            (b for b in base if b.batch == row.batch), None)
        if ref is not None and ref.stats is not None and row.stats.p50_ms > 0:
            row.speedup = ref.stats.p50_ms / row.stats.p50_ms
            row.baseline_runtime = ref.lane.label
