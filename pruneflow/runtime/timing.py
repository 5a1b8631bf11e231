"""Latency measured interleaved: every executor runs once per repetition, in turn, so load on a shared
machine hits all alike and the ratios between them hold (timed one after another they drift 2-3x)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from .base import Feed

if TYPE_CHECKING:
    from ..inputs import Inputs


#: One timing default for `pruneflow bench` and the export stage's `latency` (issue 26: they timed one file at 1
#: thread and 50 runs against the runtime's threads and 20 runs, and disagreed up to 50x at batch 1).
DEFAULT_RUNS = 50
DEFAULT_WARMUP = 3
DEFAULT_THREADS = 1


@dataclass
class LatencyStats:
    batch: int
    runs: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    #: Samples per second at the median latency.
    throughput: float

    @classmethod
    def of(cls, times_ms: list[float], batch: int) -> "LatencyStats":
        arr = np.asarray(times_ms, dtype=np.float64)
        p50, p90, p99 = (float(v) for v in np.percentile(arr, [50, 90, 99]))
        return cls(batch, len(arr), p50, p90, p99, float(arr.mean()), batch * 1000.0 / p50 if p50 > 0 else float("inf"))

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def time_interleaved(executors: Mapping[str, Callable[[Any], object]], batch: "Feed", *, warmup: int = 3,
                     runs: int = 20, on_step: Callable[[], None] | None = None) -> dict[str, LatencyStats]:
    """Warm every executor up, then time ``runs`` repetitions, each running every executor once on ``batch``.
    ``on_step`` is called after each repetition (progress bars).

        >>> stats = time_interleaved({"fp32": fp32, "int8": int8}, fresh_batch(x, 32), runs=50)  # doctest: +SKIP
        >>> stats["fp32"].p50_ms / stats["int8"].p50_ms                                          # doctest: +SKIP
    """
    times = interleaved_times(executors, batch, warmup=warmup, runs=runs, on_step=on_step)
    rows = len(batch) if isinstance(batch, np.ndarray) else len(next(iter(batch.values())))
    return {name: LatencyStats.of(t, rows) for name, t in times.items()}


def interleaved_times(executors: Mapping[str, Callable[[Any], object]], batch: "Feed", *, warmup: int = 3,
                      runs: int = 20, on_step: Callable[[], None] | None = None) -> dict[str, list[float]]:
    """The raw run times in ms behind ``time_interleaved``, per executor in the order of the repetitions."""
    for run in executors.values():
        for _ in range(warmup):
            run(batch)
    times: dict[str, list[float]] = {name: [] for name in executors}
    for _ in range(runs):
        for name, run in executors.items():
            start = time.perf_counter()
            run(batch)
            times[name].append((time.perf_counter() - start) * 1000)
        if on_step is not None:
            on_step()
    return times


def fresh_batch(x: "Inputs", batch: int) -> "Feed":
    """A new contiguous numpy batch of ``batch`` real samples of ``x`` (repeating them when there are fewer):
    timing a view of the split would measure its strides, not the model. For several inputs, a numpy
    feed of them (text cut to the batch's longest row: the sequence length real batches have)."""
    from ..inputs import as_numpy, repeat_to, trim

    if not isinstance(x, dict):
        reps = -(-batch // len(x))
        return np.ascontiguousarray(x.repeat((reps,) + (1,) * (x.dim() - 1))[:batch].cpu().numpy())
    return as_numpy(trim(repeat_to(x, batch)))
