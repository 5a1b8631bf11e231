"""INT8 against FP32 ONNX of the same pruned ranker in onnxruntime, timed interleaved (issue 37's bar: INT8 not slower
than FP32 at batch 64).

    pruneflow optimize recipes/dlrm-bags.yaml --out runs/rec      # and recipes/mmoe-feed.yaml
    python benchmarks/ranker_int8_speed.py runs/rec/dlrm-bags runs/rec/mmoe-feed --out benchmarks/results/ranker_int8_speed

Each run folder's ``export/onnx/model.fp32.onnx`` and ``model.int8.onnx`` are opened with one thread
(``pruneflow.runtime.open_artifact``) and fed the run's own calibration samples (``calibration/``, real rows of the
recipe's data); every repeat times both files in one interleaved loop (``time_interleaved``) at each batch size, and the
ratio is FP32 p50 / INT8 p50 (above 1: INT8 faster). The figures move by several percent between repeats on a shared
host: each repeat is listed, with the host. Writes OUT.md and OUT.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def measure(run: Path, batches: list[int], runs: int, repeats: int) -> list[dict]:
    from pruneflow.calibrate.calibset import CalibrationSet
    from pruneflow.runtime import fresh_batch, open_artifact, time_interleaved

    samples = CalibrationSet.load(run / "calibration").x
    files = {p: open_artifact(run / "export" / "onnx" / f"model.{p}.onnx", runtime="onnxruntime", device="cpu", threads=1)
             for p in ("fp32", "int8")}
    rows = []
    for batch in batches:
        feed = fresh_batch(samples, batch)
        ratios, p50 = [], {}
        for _ in range(repeats):
            stats = time_interleaved(files, feed, warmup=20, runs=runs)
            ratios.append(stats["fp32"].p50_ms / stats["int8"].p50_ms)
            p50 = {p: s.p50_ms * 1000 for p, s in stats.items()}
        rows.append({"model": run.name, "batch": batch, "fp32 p50 us": p50["fp32"], "int8 p50 us": p50["int8"],
                     "int8 speed-up (each repeat)": ", ".join(f"{r:.3f}" for r in ratios),
                     "median speed-up": statistics.median(ratios)})
    return rows


def main(argv: list[str] | None = None) -> None:
    from pruneflow.runtime.host import host_info

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", type=Path, nargs="+", help="run folders (OUT/<recipe name>) of ranker recipes")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--runs-per-repeat", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    rows = [r for run in args.runs for r in measure(run, args.batch, args.runs_per_repeat, args.repeats)]
    cpu = host_info().get("cpu", {})
    host = f"{cpu.get('model', '?')} ({', '.join(cpu.get('isa') or [])}), onnxruntime, one thread"
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in columns) + " |" for r in rows]
    text = "\n\n".join(["# Ranker INT8 against FP32 ONNX, interleaved (onnxruntime)",
                        f"{args.repeats} repeats of {args.runs_per_repeat} interleaved runs a batch size; host: {host}.",
                        "\n".join(lines)])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(text + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"host": host, "rows": rows}, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
