"""Latency measured interleaved: every executor runs once per repetition, in turn, so load on a shared
machine hits all alike and the ratios between them hold (timed one after another they drift 2-3x)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Callable, Mapping

import numpy as np


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


def time_interleaved(executors: Mapping[str, Callable[[np.ndarray], object]], batch: np.ndarray, *, warmup: int = 3,
                     runs: int = 20, on_step: Callable[[], None] | None = None) -> dict[str, LatencyStats]:
    """Warm every executor up, then time ``runs`` repetitions, each running every executor once on ``batch``.
    ``on_step`` is called after each repetition (progress bars)."""
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
    return {name: LatencyStats.of(t, len(batch)) for name, t in times.items()}
