"""Latency measurement: median and p99 over repeated runs, after warm-up."""

from __future__ import annotations

import time
from typing import Callable

import numpy as np


def measure_latency(run: Callable[[np.ndarray], object], example: np.ndarray, warmup: int = 3, runs: int = 20) -> dict[str, float]:
    for _ in range(warmup):
        run(example)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        run(example)
        times.append((time.perf_counter() - start) * 1000)
    arr = np.asarray(times)
    return {"median_ms": float(np.median(arr)), "p99_ms": float(np.percentile(arr, 99)), "runs": runs}
