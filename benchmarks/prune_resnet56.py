"""Acceptance benchmark for structured pruning: pretrained ResNet-56 on ../shared/data/cifar10.

Runs, with the same fine-tuning budget in epochs over the 10,000-image train subset:
- dense: the unpruned model fine-tuned for the whole budget (the honest reference);
- 2x MACs: plain magnitude pruning (uniform L2, the torch-pruning default) and our
  magnitude / taylor / hessian / hessian+taylor (global allocation), each with KD fine-tuning;
- 3x MACs: hessian with KD.
Then times every exported ONNX model side by side in one loop (onnxruntime, 1 thread, batch 1 and 32)
and the Hessian vs Taylor importance cost on 64 samples. Prints a table; writes results.json/.md.

    python benchmarks/prune_resnet56.py --out runs/bench-prune            # ~1 h on 2 cores
    python benchmarks/prune_resnet56.py --out /tmp/smoke --quick          # a few minutes, tiny data

Each finished variant is saved as it completes; a rerun skips finished ones (--force to redo).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pruneflow.bench import interleaved_times  # noqa: E402
from pruneflow.pipeline import run_recipe  # noqa: E402
from pruneflow.recipe import load_recipe  # noqa: E402

RECIPE = REPO / "recipes" / "resnet56-cifar10-prune.yaml"


def variants(epochs: int) -> dict[str, list[str]]:
    """Overrides of the shipped recipe per variant. Budget: `epochs` fine-tuning epochs in all."""
    two_x = [f"stages.1.target.macs=0.5", "stages.1.rounds=3", "stages.1.finetune.epochs=1",
             f"stages.1.final_finetune.epochs={max(epochs - 3, 0)}"]
    three_x = [f"stages.1.target.macs={1 / 3:.6f}", "stages.1.rounds=5", "stages.1.finetune.epochs=1",
               f"stages.1.final_finetune.epochs={max(epochs - 5, 0)}"]
    common = ["stages.1.latency=null", "stages.3.latency=null", "gates=[]"]
    return {
        "dense": ["stages.1={type: train, epochs: %d, lr: 0.01, batch_size: 64, weight_decay: 0.0001, eval_every: 0}" % epochs,
                  "stages.3.latency=null", "gates=[]"],
        "2x plain magnitude (uniform L2)": two_x + common + ["stages.1.importance=magnitude", "stages.1.allocation=uniform",
                                                           "stages.1.round_to=null"],
        "2x magnitude": two_x + common + ["stages.1.importance=magnitude"],
        "2x taylor": two_x + common + ["stages.1.importance=taylor"],
        "2x hessian": two_x + common + ["stages.1.importance=hessian"],
        "2x hessian+taylor": two_x + common + ["stages.1.importance=hessian+taylor"],
        "3x hessian": three_x + common + ["stages.1.importance=hessian"],
    }


def run_variant(name: str, overrides: list[str], out: Path, quick: bool, sets: list[str] = ()) -> dict:
    extra = (["data.max_train_samples=512", "data.max_eval_samples=512"] if quick else []) + list(sets)
    slug = name.replace(" ", "_").replace("(", "").replace(")", "").replace("+", "-")
    loaded = load_recipe(RECIPE, overrides + extra + [f"name={slug}"])
    start = time.perf_counter()
    result = run_recipe(loaded, out=out)
    seconds = time.perf_counter() - start
    m = result.metrics
    stage = "prune" if "prune.macs" in m else "train"
    tables = next((s.tables for s in result.stages if s.type == "prune"), {})
    return {
        "variant": name,
        "run_dir": str(result.run_dir),
        "baseline_accuracy": m["baseline.accuracy"],
        "accuracy": m["evaluate.accuracy"],
        "onnx_accuracy": m["onnx.fp32.accuracy"],
        "macs": m["evaluate.macs"],
        "macs_reduction": m["baseline.macs"] / m["evaluate.macs"],
        "params": m["evaluate.params"],
        "stage_seconds": round(next(s.seconds for s in result.stages if s.type == stage), 1),
        "run_seconds": round(seconds, 1),
        "rounds": tables.get("rounds", []),
        "importance_seconds": m.get("prune.importance_seconds"),
    }


def side_by_side_latency(rows: list[dict], batch_sizes=(1, 32), runs: int = 30) -> None:
    """Time every variant's ONNX model in one interleaved loop, so machine load hits all alike."""
    from pruneflow.export.onnx import onnxruntime_runner

    runners = {r["variant"]: onnxruntime_runner(Path(r["run_dir"]) / "export/onnx/model.fp32.onnx", threads=1) for r in rows}
    rng = np.random.default_rng(0)
    for bs in batch_sizes:
        x = rng.standard_normal((bs, 3, 32, 32)).astype(np.float32)
        times = interleaved_times(runners, x, warmup=3, runs=runs)
        for r in rows:
            r[f"latency_b{bs}_ms"] = statistics.median(times[r["variant"]])


def importance_cost(samples: int = 64, repeats: int = 3) -> dict:
    from pruneflow.data import load_data
    from pruneflow.models import build_model
    from pruneflow.prune.fisher import fisher_diagonal, mean_gradients
    from pruneflow.prune.surgery import make_prunable

    loaded = load_recipe(RECIPE)
    model = build_model(loaded.recipe.model)
    make_prunable(model, torch.zeros(1, 3, 32, 32))
    data = load_data(loaded.recipe.data, 0)
    x, y = data.train.x[:samples], data.train.y[:samples]
    batches = [(x[i : i + 32], y[i : i + 32]) for i in range(0, samples, 32)]
    taylor, hessian = [], []
    for _ in range(repeats):
        t = time.perf_counter()
        mean_gradients(model, batches, F.cross_entropy)
        taylor.append(time.perf_counter() - t)
        t = time.perf_counter()
        fisher_diagonal(model, batches, F.cross_entropy)
        hessian.append(time.perf_counter() - t)
    t, h = statistics.median(taylor), statistics.median(hessian)
    return {"samples": samples, "taylor_seconds": t, "hessian_seconds": h, "ratio": h / t}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-prune")
    parser.add_argument("--epochs", type=int, default=5, help="fine-tuning budget in epochs, the same for every variant")
    parser.add_argument("--only", default="", help="comma-separated variant names to run")
    parser.add_argument("--quick", action="store_true", help="512 train / 512 eval samples: a smoke test")
    parser.add_argument("--force", action="store_true", help="rerun variants that already have results")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="PATH=VALUE",
                        help="extra recipe override for every variant, e.g. 'stages.1.distill.alpha=0.3' (repeatable)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {"variants": {}}
    results["budget_epochs"] = args.epochs
    results["quick"] = args.quick
    results["overrides"] = args.sets
    chosen = variants(args.epochs)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    for name, overrides in chosen.items():
        if name in results["variants"] and not args.force:
            print(f"[skip] {name}: already measured", flush=True)
            continue
        print(f"[run ] {name}", flush=True)
        results["variants"][name] = run_variant(name, overrides, args.out, args.quick, args.sets)
        results_file.write_text(json.dumps(results, indent=2))
        print(f"[done] {name}: accuracy {results['variants'][name]['accuracy']:.4f}, "
              f"{results['variants'][name]['macs_reduction']:.2f}x MACs", flush=True)
    rows = list(results["variants"].values())
    side_by_side_latency(rows)
    results["importance_cost"] = importance_cost()
    results_file.write_text(json.dumps(results, indent=2))
    report(results, args.out)
    return 0


def report(results: dict, out: Path) -> None:
    rows = list(results["variants"].values())
    dense = results["variants"].get("dense")
    lines = [f"# Pruning benchmark: ResNet-56, CIFAR-10 (JPEG copy), {results['budget_epochs']}-epoch fine-tuning budget"
             + (" (QUICK smoke run, not the acceptance figures)" if results.get("quick") else ""), "",
             *([f"Overrides for every variant: {', '.join(f'`{o}`' for o in results['overrides'])}", ""] if results.get("overrides") else []),
             "| variant | MACs reduction | top-1 | ONNX top-1 | Δ vs pretrained | Δ vs dense same budget | "
             "b1 ms | b32 ms | b32 speed-up / MACs reduction | stage s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        speed = dense and r is not dense and dense["latency_b32_ms"] / r["latency_b32_ms"]
        eff = f"{speed / r['macs_reduction']:.2f} ({speed:.2f}x)" if speed else ""
        vs_dense = f"{100 * (r['accuracy'] - dense['accuracy']):+.2f} pt" if dense else ""
        lines.append(f"| {r['variant']} | {r['macs_reduction']:.2f}x | {100 * r['accuracy']:.2f} % | "
                     f"{100 * r['onnx_accuracy']:.2f} % | {100 * (r['accuracy'] - r['baseline_accuracy']):+.2f} pt | {vs_dense} | "
                     f"{r['latency_b1_ms']:.2f} | {r['latency_b32_ms']:.2f} | {eff} | {r['stage_seconds']} |")
    cost = results["importance_cost"]
    lines += ["", f"Importance cost on {cost['samples']} samples: Taylor {cost['taylor_seconds']:.2f} s, "
              f"Hessian {cost['hessian_seconds']:.2f} s, ratio {cost['ratio']:.2f} (bar: <= 3)"]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(main())
