"""The host a latency figure was measured on: CPU model, ISA flags that change kernels, threads, GPUs,
runtime versions. Recorded beside every latency figure (manifest, bench JSON)."""

from __future__ import annotations

import os
import platform
from functools import cache
from typing import Any

from ..config import usable_cpus

#: CPU flags that decide which kernels onnxruntime and OpenVINO pick (int8 dot products, bf16, AMX).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "amx_tile",
             "asimd", "sve")


@cache
def host_info() -> dict[str, Any]:
    """``{"cpu": {"model", "arch", "isa", "logical_cpus", "usable_cpus"}, "os", "python", "gpus", "versions"}``:
    cached, since it is read beside every latency figure of a run."""
    from ..artifacts import tool_versions

    model, flags = _cpuinfo()
    return {
        "cpu": {"model": model or platform.processor() or platform.machine(), "arch": platform.machine(),
                "isa": [f for f in ISA_FLAGS if f in flags], "logical_cpus": os.cpu_count(),
                "usable_cpus": usable_cpus()},
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "gpus": _gpus(),
        "versions": {**tool_versions(), **_optional_versions()},
    }


def timing_host(info: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a timed figure or choice depends on, of ``info`` (a ``host_info()``, this machine's by default): the CPU
    model, architecture, ISA flags, usable CPUs and GPUs. Two runs with equal ones time alike; a ``--resume`` that finds
    another measures again (``pipeline``)."""
    info = info if info is not None else host_info()
    cpu: dict[str, Any] = info["cpu"] if isinstance(info.get("cpu"), dict) else {}
    return {"cpu": cpu.get("model"), "arch": cpu.get("arch"), "isa": sorted(cpu.get("isa") or []),
            "usable_cpus": cpu.get("usable_cpus"), "gpus": list(info.get("gpus") or [])}


def _gpus() -> list[str]:
    """CUDA devices torch sees (names), [] on a machine without one."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def _optional_versions() -> dict[str, str]:
    """Runtimes outside the tracked packages that a latency figure may come from (TensorRT, onnxruntime-gpu)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("tensorrt", "onnxruntime-gpu"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            continue
    return out


def _cpuinfo() -> tuple[str | None, set[str]]:
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return None, set()
    model = next((line.partition(":")[2].strip() for line in text.splitlines() if line.startswith("model name")), None)
    line = next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")
    return model, set(line.partition(":")[2].split())


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
