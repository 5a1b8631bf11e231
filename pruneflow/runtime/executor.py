"""Executors: one loaded artifact on one runtime and device, called like a function on a numpy batch.

The file's format (``pruneflow.formats``) says which runtimes load it; the runtime (a registered kind too) opens it.
"""

from __future__ import annotations

from pathlib import Path

from .base import Executor, RuntimeUnavailable


def runtimes_for(path: str | Path) -> tuple[str, ...]:
    """The runtimes that can load ``path`` (by its format), the default first; () when none can."""
    from ..formats import runtimes_for as of_format

    return of_format(path)


def open_artifact(path: str | Path, *, runtime: str | None = None, device: str | None = None,
                  threads: int | None = None, precision_hint: str | None = None, exact_int8: bool = False) -> Executor:
    """Load ``path`` in ``runtime`` (default: the first of ``runtimes_for``) on ``device`` (default: the
    best the runtime has here: CUDA for onnxruntime when its CUDA provider is present, else the CPU).
    ``precision_hint`` is OpenVINO's INFERENCE_PRECISION_HINT: None leaves the plugin's default (bf16 on
    CPUs with AVX-512 BF16 or AMX), ``"f32"`` forces fp32. An absent runtime or device raises
    RuntimeUnavailable; nothing falls back to another one. ``exact_int8`` keeps onnxruntime from fusing
    Q/DQ into its integer kernels (basic graph optimizations only: each DequantizeLinear, then float
    kernels): for an artifact built for another runtime (TensorRT's form, whose int8 activations onnxruntime
    adds in saturating int16 pairs on x86 CPUs without VNNI), checked here for its arithmetic and not timed
    as onnxruntime would serve it.

        >>> ex = open_artifact("model.fp32.xml", precision_hint="f32")   # doctest: +SKIP
        >>> ex.label, ex.info["inference_precision"]                       # doctest: +SKIP
        ('openvino/CPU (f32)', 'f32')
    """
    from ..formats import runtime_named

    path = Path(path)
    choices = runtimes_for(path)
    runtime = runtime or (choices[0] if choices else None)
    if runtime not in choices:
        raise RuntimeUnavailable(f"{path.name}: no runtime {runtime!r} loads {path.suffix or 'this'} files",
                                 hint=f"use one of: {', '.join(choices) or '(none)'}")
    if not path.is_file():
        raise RuntimeUnavailable(f"{path}: no such file", hint="pass the path of a built artifact")
    assert runtime is not None
    return runtime_named(runtime).open(path, device, threads, precision_hint, exact_int8)
