"""Acceptance benchmark for structured pruning: pretrained ResNet-56 on ../shared/data/cifar10.

Every variant gets the same fine-tuning budget, ``--epochs`` passes over the 10,000-image train subset:
- dense: the unpruned model fine-tuned for the whole budget (cosine LR): the honest reference;
- pruned: the shipped recipe (recipes/resnet56-cifar10-prune.yaml): its ``adapt`` train stage first
  (the pretrained weights meet this JPEG data; the adapted model is then the teacher and the source of
  the importance scores), then the prune stage: progressive rounds of one KD fine-tuning epoch each,
  then a final KD fine-tune for the rest of the budget.
  The adapt stage is the same for every pruned variant (same seed, data and settings), so it runs once
  and every pruned variant starts from its weights; its epochs still count in each variant's budget.
- 2x MACs: plain magnitude (uniform L2, no round_to: the torch-pruning default) and our magnitude
  (relative ranking) / taylor / hessian / hessian+taylor (the recipe's absolute ranking, global
  allocation, round_to 8), and hessian with round_to 16 (the channel block of onnxruntime's NCHWc
  kernels on AVX-512: the latency-first variant), and whole residual blocks removed instead of channels
  (`granularity: blocks`: depth pruning keeps every layer's width, so MACs saved are time saved);
  3x MACs: hessian.
Then every exported ONNX model is timed side by side in one interleaved loop (onnxruntime, 1 thread,
batch 1 and 32), and the Hessian vs Taylor importance cost on 64 samples. Prints a table; writes
results.json and results.md.

    python benchmarks/prune_resnet56.py --out runs/bench-prune            # ~90 min on 2 cores
    python benchmarks/prune_resnet56.py --out /tmp/smoke --quick          # a few minutes, tiny data

Each finished variant is saved as it completes; a rerun skips finished ones (--force to redo).
Run it alone: two torch processes on two cores slow each other down several-fold.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pruneflow.runtime import interleaved_times, open_artifact  # noqa: E402
from pruneflow.pipeline import run_recipe  # noqa: E402
from pruneflow.prune.config import BlockPruneConfig  # noqa: E402
from pruneflow.recipe import load_recipe  # noqa: E402
from pruneflow.recipe.loader import apply_overrides, deep_merge  # noqa: E402

RECIPE = REPO / "recipes" / "resnet56-cifar10-prune.yaml"
SCHEMA = 2  # results.json layout; a file with another (or other settings) is measured afresh


def base_recipe(quick: bool) -> dict:
    """The shipped recipe as a dict, with absolute paths (variant recipes are written under --out)."""
    raw = yaml.safe_load(RECIPE.read_text())
    raw["model"]["checkpoint"] = str((RECIPE.parent / raw["model"]["checkpoint"]).resolve())
    for key in ("train", "eval"):
        raw["data"][key] = str((RECIPE.parent / raw["data"][key]).resolve())
    if quick:
        raw["data"].update(max_train_samples=512, max_eval_samples=512)
    raw["gates"] = []
    return raw


def stage(raw: dict, type_: str) -> dict:
    return next(s for s in raw["stages"] if s["type"] == type_)


def plan(raw: dict, epochs: int) -> dict[str, dict]:
    """Variant name -> changes to the recipe's prune stage, with the epochs that fill the budget."""
    adapt = stage(raw, "train")["epochs"]

    def pruned(rounds: int, **changes) -> dict:
        final = epochs - adapt - rounds  # may be negative here: main() refuses it for the variants chosen
        # The final fine-tune is evaluated once, at its end (its epochs' evaluations change nothing but the time).
        return {"rounds": rounds, "finetune": {"epochs": 1},
                "final_finetune": {"epochs": final, "eval_every": 0} if final else None, **changes}

    return {
        "2x plain magnitude (uniform L2)": pruned(3, importance="magnitude", allocation="uniform", round_to=None),
        # Weight norms differ in scale from layer to layer: magnitude ranks within each group's mean.
        "2x magnitude": pruned(3, importance="magnitude", ranking="relative"),
        "2x taylor": pruned(3, importance="taylor"),
        "2x hessian": pruned(3, importance="hessian"),
        "2x hessian+taylor": pruned(3, importance="hessian+taylor"),
        "2x hessian round_to 16": pruned(3, importance="hessian", round_to=16),
        # Depth instead of width: whole residual blocks go, ranked by their measured loss (importance unused).
        # 32 batches: 1,024 samples rank blocks (the recipe's 4 batches are for channels; blocks cost one forward each).
        "2x blocks": pruned(3, granularity="blocks", importance_batches=32),
        "3x hessian": pruned(4, importance="hessian", target={"macs": round(1 / 3, 6)}),
    }


def prune_stage(raw: dict, changes: dict, sets: list[str]) -> dict:
    """The recipe's prune stage with a variant's ``changes`` and the ``--set`` items (paths inside the stage)."""
    data = {"prune": copy.deepcopy(deep_merge(stage(raw, "prune"), changes))}
    if data["prune"].get("granularity") == "blocks":  # the recipe's channel keys (round_to, ranking...) are not blocks keys
        data["prune"] = {k: v for k, v in data["prune"].items() if k in BlockPruneConfig.model_fields}
    apply_overrides(data, {}, [f"prune.{item}" for item in sets])
    return data["prune"]


def run(name: str, raw: dict, out: Path) -> tuple:
    slug = name.replace(" ", "_").replace(",", "").replace("(", "").replace(")", "").replace("+", "-")
    raw = dict(raw, name=slug)
    path = out / f"{slug}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    start = time.perf_counter()
    result = run_recipe(load_recipe(path), out=out)
    return result, time.perf_counter() - start


def run_adapt(raw: dict, out: Path) -> dict:
    """The shared first part of every pruned variant: the recipe's stages up to its prune stage."""
    cut = next(i for i, s in enumerate(raw["stages"]) if s["type"] == "prune")
    result, seconds = run("adapt", dict(raw, stages=raw["stages"][:cut]), out)
    train = next(s for s in result.stages if s.type == "train")
    checkpoint = (result.run_dir / "stages" / f"{train.index + 1:02d}-{train.id}" / "model.pt").resolve()
    return {"run_dir": str(result.run_dir), "checkpoint": str(checkpoint),
            "pretrained_accuracy": result.metrics["baseline.accuracy"], "accuracy": train.metrics["accuracy"],
            "epochs": train.metrics["epochs"], "stage_seconds": round(train.seconds, 1), "run_seconds": round(seconds, 1)}


def row(name: str, result, seconds: float, pretrained: float, extra_seconds: float = 0.0, epochs: int = 0) -> dict:
    m = result.metrics
    prune = next((s for s in result.stages if s.type == "prune"), None)
    tuned = prune or next(s for s in result.stages if s.type == "train")
    return {
        "variant": name, "run_dir": str(result.run_dir),
        "pretrained_accuracy": pretrained,
        "accuracy": m["evaluate.accuracy"], "onnx_accuracy": m["onnx.fp32.accuracy"],
        "macs": m["evaluate.macs"], "macs_reduction": m["baseline.macs"] / m["evaluate.macs"], "params": m["evaluate.params"],
        # Fine-tuning time of the budget: the (shared) adapt stage plus this variant's own stage.
        "finetune_seconds": round(tuned.seconds + extra_seconds, 1), "run_seconds": round(seconds, 1), "epochs": epochs,
        "rounds": prune.tables.get("rounds", []) if prune else [],
        "importance_seconds": prune.metrics.get("importance_seconds") if prune else None,
    }


def side_by_side_latency(rows: list[dict], batch_sizes=(1, 32), runs: int = 30) -> None:
    """Time every variant's ONNX model in one interleaved loop, so machine load hits all alike."""

    runners = {r["variant"]: open_artifact(Path(r["run_dir"]) / "export/onnx/model.fp32.onnx", threads=1) for r in rows}
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
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.out / "results.json"
    settings = {"schema": SCHEMA, "budget_epochs": args.epochs, "quick": args.quick, "overrides": args.sets}
    results = load_results(results_file, settings)
    results["torch_threads"] = torch.get_num_threads()
    save = lambda: results_file.write_text(json.dumps(results, indent=2))  # noqa: E731
    raw = base_recipe(args.quick)
    planned = plan(raw, args.epochs)
    chosen = ["dense", *planned]
    if args.only:
        chosen = [k for k in chosen if k in args.only.split(",")]
    short = [k for k in chosen if k != "dense" and (planned[k]["final_finetune"] or {}).get("epochs", 0) < 0]
    if short:
        raise SystemExit(f"--epochs {args.epochs} is less than the adapt stage plus the rounds of {', '.join(short)}")
    # The variants the bars are read from run first; the table keeps the plan's order.
    first = ["dense", "2x hessian", "3x hessian", "2x blocks", "2x hessian round_to 16", "2x plain magnitude (uniform L2)"]
    todo = sorted((k for k in chosen if args.force or k not in results["variants"]),
                  key=lambda k: first.index(k) if k in first else len(first))
    for name in sorted(set(chosen) - set(todo)):
        print(f"[skip] {name}: already measured", flush=True)
    if any(k != "dense" for k in todo) and (args.force or "adapt" not in results):
        print("[run ] adapt (shared by every pruned variant)", flush=True)
        results["adapt"] = run_adapt(raw, args.out)
        save()
    for name in todo:
        print(f"[run ] {name}", flush=True)
        results["variants"][name] = run_variant(name, raw, planned, results, args)
        save()
        r = results["variants"][name]
        print(f"[done] {name}: accuracy {r['accuracy']:.4f}, {r['macs_reduction']:.2f}x MACs", flush=True)
    rows = [results["variants"][k] for k in ["dense", *planned] if k in results["variants"]]
    side_by_side_latency(rows)
    results["importance_cost"] = importance_cost()
    save()
    report(results, args.out)
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-prune")
    parser.add_argument("--epochs", type=int, default=10, help="fine-tuning budget in epochs, the same for every variant")
    parser.add_argument("--only", default="", help="comma-separated variant names to run ('dense' included)")
    parser.add_argument("--quick", action="store_true", help="512 train / 512 eval samples: a smoke test")
    parser.add_argument("--force", action="store_true", help="rerun variants that already have results")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="PATH=VALUE",
                        help="change the prune stage of every pruned variant, e.g. 'distill.alpha=0.3' (repeatable)")
    return parser.parse_args()


def load_results(results_file: Path, settings: dict) -> dict:
    """The saved results when they were measured with these settings (so a rerun skips finished variants),
    else a fresh start; either way stamped with the settings."""
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    if {k: results.get(k) for k in settings} != settings:
        if results:
            print(f"[note] {results_file} was measured with other settings; starting afresh", flush=True)
        results = {"variants": {}}
    results.update(settings)
    return results


def run_variant(name: str, raw: dict, planned: dict[str, dict], results: dict, args: argparse.Namespace) -> dict:
    """Run one variant and return its row. Dense fine-tunes for the whole budget in the prune stage's place;
    a pruned variant starts from the shared adapt checkpoint, whose stage time counts in its budget."""
    if name == "dense":
        train = dict(stage(raw, "train"), name="finetune", epochs=args.epochs)  # in the prune stage's place
        stages = [train if s["type"] == "prune" else s for s in raw["stages"] if s["type"] != "train"]
        result, seconds = run(name, dict(raw, stages=_no_latency(stages)), args.out)
        return row(name, result, seconds, result.metrics["baseline.accuracy"], epochs=args.epochs)
    adapt = results["adapt"]
    prune = prune_stage(raw, planned[name], args.sets)
    stages = [s for s in raw["stages"] if s["type"] != "train"]
    stages = [prune if s["type"] == "prune" else s for s in stages]
    variant = dict(raw, model=dict(raw["model"], checkpoint=adapt["checkpoint"]), stages=_no_latency(stages))
    result, seconds = run(name, variant, args.out)
    return row(name, result, seconds, adapt["pretrained_accuracy"], extra_seconds=adapt["stage_seconds"], epochs=args.epochs)


def _no_latency(stages: list[dict]) -> list[dict]:
    """Latency is timed side by side at the end, not inside each run (load differs between runs)."""
    return [dict(s, latency=None) if s["type"] in ("prune", "export") else s for s in stages]


def report(results: dict, out: Path) -> None:
    variants = {k: v for k, v in results["variants"].items() if "latency_b32_ms" in v}  # the ones timed in this run
    dense = variants.get("dense")
    adapt = results.get("adapt")
    lines = [f"# Pruning benchmark: ResNet-56, CIFAR-10 (JPEG copy), {results['budget_epochs']}-epoch fine-tuning budget"
             + (" (QUICK smoke run, not the acceptance figures)" if results.get("quick") else ""), ""]
    if results.get("overrides"):
        lines += [f"Changes to every prune stage: {', '.join(f'`{o}`' for o in results['overrides'])}", ""]
    if adapt:
        lines += [f"Pretrained: {100 * adapt['pretrained_accuracy']:.2f} %. Shared adapt stage ({adapt['epochs']} epochs, "
                  f"{adapt['stage_seconds']} s): {100 * adapt['accuracy']:.2f} %, the teacher of every pruned variant.", ""]
    lines += ["| variant | MACs reduction | top-1 | ONNX top-1 | Δ vs pretrained | Δ vs dense same budget | "
              "b1 ms | b32 ms | b32 speed-up / MACs reduction | fine-tune s |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in variants.values():
        speed = dense and r is not dense and dense["latency_b32_ms"] / r["latency_b32_ms"]
        eff = f"{speed / r['macs_reduction']:.2f} ({speed:.2f}x)" if speed else ""
        vs_dense = f"{100 * (r['accuracy'] - dense['accuracy']):+.2f} pt" if dense else ""
        lines.append(f"| {r['variant']} | {r['macs_reduction']:.2f}x | {100 * r['accuracy']:.2f} % | "
                     f"{100 * r['onnx_accuracy']:.2f} % | {100 * (r['accuracy'] - r['pretrained_accuracy']):+.2f} pt | {vs_dense} | "
                     f"{r['latency_b1_ms']:.2f} | {r['latency_b32_ms']:.2f} | {eff} | {r['finetune_seconds']} |")
    lines += ["", "Rounds (MACs kept -> accuracy after the round's fine-tune):", ""]
    for r in variants.values():
        if r["rounds"]:
            steps = ", ".join(f"{x['macs_kept']:.1%} -> {100 * x['accuracy']:.2f}" for x in r["rounds"])
            lines.append(f"- {r['variant']}: {steps}; final {100 * r['accuracy']:.2f} %")
    cost = results["importance_cost"]
    lines += ["", f"Importance cost on {cost['samples']} samples: Taylor {cost['taylor_seconds']:.2f} s, "
              f"Hessian {cost['hessian_seconds']:.2f} s, ratio {cost['ratio']:.2f} (bar: <= 3)"]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(main())
