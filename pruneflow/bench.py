"""Latency measurement: the median over repeated runs after warm-up, and the tail (p99 from 100 runs
on; below that the slowest run, named ``max``, since a p99 of 20 samples is just the maximum)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import numpy as np

if TYPE_CHECKING:
    import torch


def fresh_batch(x: "torch.Tensor", batch: int) -> "torch.Tensor":
    """A new contiguous batch of ``batch`` samples (repeating the split when it is smaller): timing a view
    of the split would measure its strides, not the model."""
    reps = -(-batch // len(x))
    return x.repeat((reps,) + (1,) * (x.dim() - 1))[:batch].clone().contiguous()


def onnx_latency(model: "torch.nn.Module", example: "torch.Tensor", samples: "torch.Tensor", batch_sizes: list[int],
                 runs: int) -> dict[str, float]:
    """Median onnxruntime latency (one thread) of ``model`` exported to a throw-away ONNX file, per batch
    size, on fresh batches of ``samples``: ``{"latency_b32_median_ms": ...}``. What a stage reports for a
    model before and after it changes it (the prune stage does)."""
    import copy
    import tempfile
    from pathlib import Path

    from .export.onnx import export_onnx, onnxruntime_runner

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        export_onnx(copy.deepcopy(model).cpu(), example.cpu(), path)
        run = onnxruntime_runner(path, threads=1)
        for bs in batch_sizes:
            lat = measure_latency(run, fresh_batch(samples, bs).numpy(), warmup=3, runs=runs)
            out[f"latency_b{bs}_median_ms"] = lat["median_ms"]
    return out


def measure_latency(run: Callable[[np.ndarray], object], example: np.ndarray, warmup: int = 3, runs: int = 20) -> dict[str, float]:
    arr = np.asarray(interleaved_times({"run": run}, example, warmup, runs)["run"])
    tail = {"p99_ms": float(np.percentile(arr, 99))} if runs >= 100 else {"max_ms": float(arr.max())}
    return {"median_ms": float(np.median(arr)), **tail, "runs": runs}


def interleaved_times(runners: dict[str, Callable[[np.ndarray], object]], example: np.ndarray, warmup: int = 3,
                      runs: int = 20) -> dict[str, list[float]]:
    """Run times in ms of several models, timed in turn within each repetition so machine load hits all alike."""
    for run in runners.values():
        for _ in range(warmup):
            run(example)
    times: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(runs):
        for name, run in runners.items():
            start = time.perf_counter()
            run(example)
            times[name].append((time.perf_counter() - start) * 1000)
    return times


def cpu_channel_block(cpuinfo: str | None = None) -> tuple[int, str] | None:
    """(channels per SIMD block, instruction set) of the blocked (NCHWc) CPU convolution kernels that
    onnxruntime and OpenVINO pick on this x86 CPU: 16 with AVX-512, 8 with AVX2; None when unknown.
    A layer whose channel count is not a multiple of it is padded up to one, so pruning below it saves
    MACs but little time."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return None
    line = next((line for line in cpuinfo.splitlines() if line.startswith("flags")), "")
    flags = set(line.partition(":")[2].split())
    if "avx512f" in flags:
        return 16, "AVX-512"
    if "avx2" in flags:
        return 8, "AVX2"
    return None
