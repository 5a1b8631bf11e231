"""Acceptance benchmark for INT8: pretrained ResNet-56 on ../shared/data/cifar10, FP32 vs PTQ vs QAT.

Variants, each a pruneflow run from the same pretrained weights and the same stratified calibration set:
- ptq: NNCF post-training quantization (no training);
- qat: the int8 phase of the qat stage (FakeQuantize, KD from the FP32 model) for --epochs epochs;
- fp32 same budget: the same qat stage with an fp32 phase only (same epochs, LR, KD, data), the honest
  reference for what QAT's fine-tuning alone changes on this data.
Every run exports ONNX and OpenVINO at fp32 and int8; accuracy is measured on the 10,000 test images in
each runtime. Then the FP32 and INT8 artifacts of the QAT run are timed side by side in one interleaved
loop (1 thread, batch 1 and 32, median and p99 of 100 runs). Prints a table; writes results.json/.md.

    python benchmarks/qat_resnet56.py --out runs/bench-qat            # ~20 min on 2 cores
    python benchmarks/qat_resnet56.py --out /tmp/smoke --quick        # a couple of minutes, tiny data
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
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pruneflow.runtime import interleaved_times, open_artifact  # noqa: E402
from pruneflow.pipeline import run_recipe  # noqa: E402
from pruneflow.recipe import load_recipe  # noqa: E402

DATA = REPO.parent / "shared" / "data"
EXPORT = {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32", "int8"], "latency": None}


def recipe(name: str, stages: list[dict], quick: bool) -> dict:
    data = {
        "format": "npz",
        "train": str(DATA / "cifar10" / "cifar10_train_subset.npz"),
        "eval": str(DATA / "cifar10" / "cifar10_test.npz"),
        "input_column": "images", "label_column": "labels",
        "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
        "augment": {"crop_padding": 4, "hflip": True},
    }
    if quick:
        data.update(max_train_samples=512, max_eval_samples=512)
    return {
        "name": name, "seed": 0,
        "model": {"factory": "resnet56", "checkpoint": str(DATA / "resnet_cifar10_akamaster" / "resnet56-4bfd9763.th")},
        "data": data,
        "stages": [{"type": "evaluate", "name": "baseline"},
                   {"type": "calibrate", "size": 512, "strategy": "stratified", "by": "label"}] + stages,
    }


def variants(epochs: int, lr: float) -> dict[str, list[dict]]:
    train = {"finetune": {"lr": lr, "batch_size": 64, "weight_decay": 0.0}, "distill": {"temperature": 4.0, "alpha": 0.5}}
    return {
        "ptq": [{"type": "ptq"}, EXPORT],
        "qat": [{"type": "qat", "schedule": [{"precision": "int8", "epochs": epochs}], "freeze_bn_after": max(epochs - 1, 0),
                 **train}, EXPORT],
        "fp32 same budget": [{"type": "qat", "schedule": [{"precision": "fp32", "epochs": epochs}], **train},
                             dict(EXPORT, precisions=["fp32"])],
    }


def run_variant(name: str, stages: list[dict], out: Path, quick: bool) -> dict:
    slug = name.replace(" ", "_")
    path = out / f"{slug}.yaml"
    path.write_text(yaml.safe_dump(recipe(slug, stages, quick), sort_keys=False))
    start = time.perf_counter()
    result = run_recipe(load_recipe(path), out=out)
    if result.exit_code != 0:
        raise SystemExit(f"{name}: run failed its gates: {[g for g in result.gates if not g.passed]}")
    m = result.metrics
    row = {"variant": name, "run_dir": str(result.run_dir), "run_seconds": round(time.perf_counter() - start, 1),
           "pretrained_accuracy": m["baseline.accuracy"]}
    for target in ("onnx", "openvino"):
        for precision in ("fp32", "int8", "int8_tensorrt"):
            if f"{target}.{precision}.accuracy" in m:
                row[f"{target}_{precision}_accuracy"] = m[f"{target}.{precision}.accuracy"]
                row[f"{target}_{precision}_cosine"] = m[f"{target}.{precision}.cosine"]
    stage = next(s for s in result.stages if s.type in ("ptq", "qat"))
    row["torch_accuracy"] = stage.metrics["accuracy"]
    row["stage_seconds"] = round(stage.seconds, 1)
    for a in result.artifacts:
        if a.target:
            row[f"{a.label.replace('.', '_')}_bytes"] = a.size_bytes
            row[f"{a.label.replace('.', '_')}_path"] = a.path
    return row


def side_by_side_latency(row: dict, batch_sizes=(1, 32), runs: int = 100) -> dict:
    """Time the FP32 and INT8 artifacts of one run in one interleaved loop, so machine load hits all alike."""

    run_dir = Path(row["run_dir"])
    runners = {
        "onnxruntime fp32": open_artifact(run_dir / row["onnx_fp32_path"], threads=1),
        "onnxruntime int8": open_artifact(run_dir / row["onnx_int8_path"], threads=1),
        "openvino fp32": open_artifact(run_dir / row["openvino_fp32_path"], threads=1, precision_hint="f32"),
        "openvino int8": open_artifact(run_dir / row["openvino_int8_path"], threads=1, precision_hint="f32"),
    }
    rng = np.random.default_rng(0)
    out: dict[str, dict] = {k: {} for k in runners}
    for bs in batch_sizes:
        x = rng.standard_normal((bs, 3, 32, 32)).astype(np.float32)
        times = interleaved_times(runners, x, warmup=5, runs=runs)
        for name, values in times.items():
            out[name][f"b{bs}"] = {"median_ms": statistics.median(values), "p99_ms": float(np.percentile(values, 99))}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-qat")
    parser.add_argument("--epochs", type=int, default=2, help="QAT epochs (and the FP32 reference's)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (cosine) of QAT and the reference")
    parser.add_argument("--only", default="", help="comma-separated variant names to run")
    parser.add_argument("--quick", action="store_true", help="512 train / 512 eval samples: a smoke test")
    parser.add_argument("--force", action="store_true", help="rerun variants that already have results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {"variants": {}}
    results.update(epochs=args.epochs, lr=args.lr, quick=args.quick, torch_threads=torch.get_num_threads())
    chosen = variants(args.epochs, args.lr)
    if args.only:
        chosen = {k: v for k, v in chosen.items() if k in args.only.split(",")}
    for name, stages in chosen.items():
        if name in results["variants"] and not args.force:
            print(f"[skip] {name}: already measured", flush=True)
            continue
        print(f"[run ] {name}", flush=True)
        results["variants"][name] = run_variant(name, stages, args.out, args.quick)
        results_file.write_text(json.dumps(results, indent=2))
        print(f"[done] {name}: onnxruntime {results['variants'][name]['onnx_fp32_accuracy']:.4f} fp32", flush=True)
    if "qat" in results["variants"]:
        results["latency"] = side_by_side_latency(results["variants"]["qat"])
        results_file.write_text(json.dumps(results, indent=2))
    report(results, args.out)
    return 0


def report(results: dict, out: Path) -> None:
    v = results["variants"]
    pct = lambda x: f"{100 * x:.2f} %" if x is not None else ""  # noqa: E731
    lines = [f"# INT8 benchmark: pretrained ResNet-56, CIFAR-10 (JPEG copy), QAT {results['epochs']} epoch(s) at lr "
             f"{results['lr']:g}" + (" (QUICK smoke run, not the acceptance figures)" if results.get("quick") else ""), "",
             "Accuracy on the 10,000 test images, measured in each runtime. Drop = FP32 artifact minus INT8 artifact, "
             "same runtime.", "",
             "| variant | torch | ORT fp32 | ORT int8 | ORT drop | OV fp32 | OV int8 | OV drop | ORT int8 (TensorRT form) | stage s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in v.values():
        ort_drop = r.get("onnx_int8_accuracy") is not None and r["onnx_fp32_accuracy"] - r["onnx_int8_accuracy"]
        ov_drop = r.get("openvino_int8_accuracy") is not None and r["openvino_fp32_accuracy"] - r["openvino_int8_accuracy"]
        lines.append(f"| {r['variant']} | {pct(r['torch_accuracy'])} | {pct(r['onnx_fp32_accuracy'])} | "
                     f"{pct(r.get('onnx_int8_accuracy'))} | {'' if ort_drop is False else f'{100 * ort_drop:+.2f} pt'} | "
                     f"{pct(r['openvino_fp32_accuracy'])} | {pct(r.get('openvino_int8_accuracy'))} | "
                     f"{'' if ov_drop is False else f'{100 * ov_drop:+.2f} pt'} | {pct(r.get('onnx_int8_tensorrt_accuracy'))} | "
                     f"{r['stage_seconds']} |")
    pre = next(iter(v.values()))["pretrained_accuracy"]
    lines += ["", f"Pretrained FP32 (torch): {pct(pre)}."]
    if "qat" in v:
        q = v["qat"]
        ref = v.get("fp32 same budget")
        lines += [f"QAT INT8 vs pretrained FP32: onnxruntime {100 * (q['onnx_int8_accuracy'] - pre):+.2f} pt, "
                  f"OpenVINO {100 * (q['openvino_int8_accuracy'] - pre):+.2f} pt."]
        if ref:
            lines += [f"QAT INT8 vs FP32 fine-tuned with the same budget: onnxruntime "
                      f"{100 * (q['onnx_int8_accuracy'] - ref['onnx_fp32_accuracy']):+.2f} pt, OpenVINO "
                      f"{100 * (q['openvino_int8_accuracy'] - ref['openvino_fp32_accuracy']):+.2f} pt."]
        lines += ["", "| file | bytes | FP32 ONNX bytes / these bytes |", "|---|---|---|"]
        base = q["onnx_fp32_bytes"]
        for key, label in (("onnx_fp32_bytes", "model.fp32.onnx"), ("onnx_int8_bytes", "model.int8.onnx (CPU form)"),
                           ("onnx_int8_tensorrt_bytes", "model.int8.tensorrt.onnx"), ("openvino_fp32_bytes", "OpenVINO fp32 (xml+bin)"),
                           ("openvino_int8_bytes", "OpenVINO int8 (xml+bin)")):
            if key in q:
                lines.append(f"| {label} | {q[key]:,} | {base / q[key]:.2f}x |")
    lat = results.get("latency")
    if lat:
        lines += ["", "Latency of the QAT run's artifacts, 1 thread, interleaved, 100 runs each (ms):", "",
                  "| runtime | precision | b1 median | b1 p99 | b32 median | b32 p99 | b32 speed-up vs FP32 |", "|---|---|---|---|---|---|---|"]
        for name, by in lat.items():
            runtime, precision = name.split()
            fp32 = lat[f"{runtime} fp32"]["b32"]["median_ms"]
            speed = f"{fp32 / by['b32']['median_ms']:.2f}x" if precision == "int8" else ""
            lines.append(f"| {runtime} | {precision} | {by['b1']['median_ms']:.2f} | {by['b1']['p99_ms']:.2f} | "
                         f"{by['b32']['median_ms']:.2f} | {by['b32']['p99_ms']:.2f} | {speed} |")
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(main())
