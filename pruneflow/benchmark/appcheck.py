"""A second opinion on OpenVINO IR: OpenVINO's own ``benchmark_app``, run on the same file, batch and
precision hint, its throughput recorded beside ours.

The openvino wheel ships it as the ``benchmark_app`` console script (module
``openvino.tools.benchmark.main``, which has no ``__main__``, so ``python -m`` does not run it); where
neither is present the bench says "absent" and records no figure.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

#: benchmark_app's figures from a handful of sub-millisecond iterations are noise: it runs at least this many.
MIN_ITERATIONS = 100
#: Runs main() when only the module is there (the console script is missing, e.g. a copied venv).
MODULE_RUNNER = "import sys; from openvino.tools.benchmark.main import main; sys.argv[0] = 'benchmark_app'; sys.exit(main())"


def benchmark_app_command() -> tuple[list[str] | None, str]:
    """(the command prefix, how it was found) or (None, why it is absent)."""
    script = Path(sys.executable).parent / "benchmark_app"
    if script.is_file():
        return [str(script)], f"console script {script}"
    found = shutil.which("benchmark_app")
    if found:
        return [found], f"console script {found}"
    try:
        spec = importlib.util.find_spec("openvino.tools.benchmark.main")
    except ImportError:
        spec = None
    if spec is not None:
        return [sys.executable, "-c", MODULE_RUNNER], "module openvino.tools.benchmark.main"
    return None, "absent: no benchmark_app console script and no openvino.tools.benchmark module in this environment"


def benchmark_app_args(xml: Path, shape: tuple[int, ...], hint: str | None, threads: int | None, runs: int,
                       duration: float | None, report_dir: Path) -> list[str]:
    """One stream and one request, like our loop; ``-infer_precision`` only when a hint was forced; ``--runs``
    iterations (at least ``MIN_ITERATIONS``) or ``--duration`` seconds (whole seconds: its ``-t`` takes integers)."""
    args = ["-m", str(xml), "-d", "CPU", "-shape", "[" + ",".join(str(d) for d in shape) + "]",
            "-json_stats", "-report_type", "no_counters", "-report_folder", str(report_dir)]
    args += ["-t", str(max(1, math.ceil(duration)))] if duration else ["-niter", str(max(runs, MIN_ITERATIONS))]
    args += ["-hint", "none", "-nstreams", "1", "-nireq", "1"] + (["-nthreads", str(threads)] if threads else [])
    if hint:
        args += ["-infer_precision", hint]
    return args


def run_benchmark_app(prefix: list[str], xml: Path, shape: tuple[int, ...], hint: str | None, threads: int | None,
                      runs: int, duration: float | None, timeout: float = 300) -> dict[str, Any]:
    """``{"throughput", "median_ms", "command"}`` from benchmark_app's JSON report and log, or ``{"error", ...}``."""
    with tempfile.TemporaryDirectory(prefix="pruneflow-benchmark-app-") as tmp:
        args = benchmark_app_args(xml, shape, hint, threads, runs, duration, Path(tmp))
        command = [*prefix, *args]
        shown = "benchmark_app " + " ".join("<tmp>" if a == tmp else a for a in args)
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"command": shown, "error": f"{type(exc).__name__}: {exc}"}
        report = Path(tmp) / "benchmark_report.json"
        if done.returncode != 0 or not report.is_file():
            tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
            return {"command": shown, "error": f"exit {done.returncode}: " + " | ".join(tail)}
        results = json.loads(report.read_text()).get("execution_results", {})
    return {"command": shown, "throughput": _number(results.get("throughput")),
            "median_ms": _median_ms(done.stdout + done.stderr),
            "iterations": _number(results.get("total number of iterations"))}


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _median_ms(log: str) -> float | None:
    """``Median:  16.92 us`` (the JSON report rounds latency to 0.01 ms, too coarse for small models)."""
    match = re.search(r"Median:\s+([\d.]+)\s*(us|ms|s)\b", log)
    if match is None:
        return None
    return float(match.group(1)) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[match.group(2)]
