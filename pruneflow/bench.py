"""Latency helpers for stages: a model's onnxruntime latency (the prune stage's before/after), the CPU's
convolution channel block. Timing itself lives in the runtime layer (``pruneflow.runtime``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .runtime import fresh_batch, open_artifact, time_interleaved

if TYPE_CHECKING:
    import torch

    from .inputs import Inputs

__all__ = ["cpu_channel_block", "onnx_latency"]


def onnx_latency(model: "torch.nn.Module", example: "Inputs", samples: "Inputs", batch_sizes: list[int],
                 runs: int) -> dict[str, float]:
    """Median onnxruntime latency (CPU, one thread) of ``model`` exported to a throw-away ONNX file, per batch
    size, on fresh batches of ``samples``: ``{"latency_b32_median_ms": ...}``. What a stage reports for a
    model before and after it changes it (the prune stage does)."""
    import copy
    import tempfile
    from pathlib import Path

    from .export.onnx import export_onnx
    from .inputs import to

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.onnx"
        export_onnx(copy.deepcopy(model).cpu(), to(example, "cpu"), path)
        run = open_artifact(path, runtime="onnxruntime", device="cpu", threads=1)
        for bs in batch_sizes:
            stats = time_interleaved({"model": run}, fresh_batch(samples, bs), warmup=3, runs=runs)["model"]
            out[f"latency_b{bs}_median_ms"] = stats.p50_ms
    return out


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
