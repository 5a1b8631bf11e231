"""Acceptance benchmark for the transformer case (issue 13): pretrained MiniLM-L6-H384 on GLUE SST-2.

Runs, each a pruneflow run; all but the first two start from the same fine-tuned checkpoint:
- finetune: the pretrained encoder plus a new classifier, fine-tuned on a stratified subset of SST-2 train
  (--train-samples phrases, --epochs, AdamW, warm-up then linear decay): the FP32 baseline;
- probe: the pretrained encoder frozen, only the classifier trained on its pooled [CLS] (a pipeline run);
- probe (mean-pooled, logistic regression): the pretrained-but-not-fine-tuned reference as the data's README
  measures it (frozen encoder, mean-pooled hidden states, logistic regression);
- fp32 same budget: the fine-tuned model given the QAT variant's extra fine-tuning (same epochs, LR, KD) in FP32,
  the honest reference for what the extra training alone changes;
- ptq: NNCF post-training quantization (transformer model type) from a calibration set;
- qat: the int8 phase of the qat stage (KD from the fine-tuned model) for --qat-epochs;
- qat, smooth_quant off: the same without NNCF's SmoothQuant (what it changes, measured side by side);
- pruned (ffn F) + qat: 50 % of the heads and --ffn F of the FFN neurons pruned (KD), then calibrate and QAT INT8;
- recipe: pruned + qat (with --recipe-run): a finished run of recipes/minilm-sst2.yaml, read from its manifest.
Accuracy is on the whole dev split (872 sentences) in every runtime. Then FP32 / INT8 / pruned / pruned INT8
ONNX artifacts and the OpenVINO IRs are timed side by side in one interleaved loop (1 thread) at batch 1 and 32
on real dev rows (each batch padded to its longest row; the sequence lengths are printed), with the host's CPU
model and ISA flags beside the table. Prints a table; writes results.json and results.md.

    python benchmarks/bert_minilm.py --out runs/bench-bert                 # fine-tunes its own baseline
    # the figures in benchmarks/results/bert_minilm.md (R: a run of recipes/minilm-sst2.yaml), about 20 + 25 min:
    R=runs/minilm-sst2; B="--out runs/bench-bert --train-samples 16000 --finetuned $R/stages/01-finetune/model.pt"
    python benchmarks/bert_minilm.py $B --recipe-run $R
    python benchmarks/bert_minilm.py $B --recipe-run $R --only pruned --ffn 0.5
    python benchmarks/bert_minilm.py --out /tmp/bert-smoke --quick         # minutes: tiny data, not the figures
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pruneflow.artifacts import Artifact  # noqa: E402
from pruneflow.data import load_tokenizer  # noqa: E402
from pruneflow.pipeline import run_recipe  # noqa: E402
from pruneflow.recipe import load_recipe  # noqa: E402
from pruneflow.runtime import host_info, interleaved_times, open_artifact  # noqa: E402

DATA = REPO.parent / "shared" / "data"
MODEL = DATA / "minilm_l6_h384"
SST2 = DATA / "sst2"
EXPORT = {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32", "int8"], "latency": None}
KD = {"temperature": 2.0, "alpha": 0.5}


def recipe(name: str, stages: list[dict], args, checkpoint: str | None = None) -> dict:
    data = {"format": "parquet", "train": str(SST2 / "train.parquet"), "eval": str(SST2 / "dev.parquet"),
            "input_column": "sentence", "label_column": "label", "tokenizer": str(MODEL), "max_length": 64,
            "max_train_samples": args.train_samples}
    if args.quick:
        data["max_eval_samples"] = 128
    model: dict = {"factory": "bert_classifier", "kwargs": {"folder": str(MODEL), "num_labels": 2}}
    if checkpoint:
        model["checkpoint"] = checkpoint
    return {"name": name, "seed": 0, "threads": args.threads, "model": model, "data": data, "stages": stages}


def finetune(args, epochs: int, lr: float, freeze: list[str] | None = None) -> dict:
    train = {"type": "train", "epochs": epochs, "batch_size": 32, "optimizer": "adamw", "lr": lr, "weight_decay": 0.01,
             "schedule": "linear", "warmup_epochs": 0.1 * epochs, "augment": False, "eval_every": 0}
    if freeze:
        train["freeze"] = freeze
    return train


def variants(args) -> dict[str, tuple[list[dict], bool]]:
    """name -> (stages, starts from the fine-tuned checkpoint)."""
    tune = {"lr": args.qat_lr, "batch_size": 32, "optimizer": "adamw", "weight_decay": 0.0, "augment": False,
            "schedule": "linear"}
    calib = {"type": "calibrate", "size": args.calib, "strategy": "stratified", "by": "label"}
    qat = {"type": "qat", "schedule": [{"precision": "int8", "epochs": args.qat_epochs}], "finetune": tune, "distill": KD}
    prune = {"type": "prune", "target": {"heads": 0.5, "ffn": args.ffn}, "importance": "taylor", "rounds": 2,
             "finetune": dict(tune, epochs=1, lr=args.lr), "distill": KD}
    return {
        "finetune": ([finetune(args, args.epochs, args.lr), dict(EXPORT, precisions=["fp32"])], False),
        "probe": ([finetune(args, 1, 1e-3, freeze=[r"model\.bert\..*"]), {"type": "evaluate"}], False),
        "fp32 same budget": ([calib, {"type": "qat", "schedule": [{"precision": "fp32", "epochs": args.qat_epochs}],
                                      "finetune": tune, "distill": KD}, dict(EXPORT, precisions=["fp32"])], True),
        "ptq": ([calib, {"type": "ptq"}, EXPORT], True),
        "qat": ([calib, qat, EXPORT], True),
        "qat, smooth_quant off": ([calib, dict(qat, smooth_quant=None), EXPORT], True),
        f"pruned (ffn {args.ffn:g}) + qat": ([prune, calib, qat, EXPORT], True),
    }


def run_variant(name: str, stages: list[dict], args, checkpoint: str | None) -> dict:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", name.replace("+", "and")).strip("_")  # a valid recipe name
    path = args.out / f"{slug}.yaml"
    path.write_text(yaml.safe_dump(recipe(slug, stages, args, checkpoint), sort_keys=False))
    start = time.perf_counter()
    result = run_recipe(load_recipe(path), out=args.out)
    if result.exit_code != 0:
        raise SystemExit(f"{name}: run failed (exit {result.exit_code}): {[g for g in result.gates if not g.passed]}")
    settings = {k: getattr(args, k) for k in ("train_samples", "qat_epochs", "qat_lr", "ffn", "calib", "lr")}
    return dict(row_from_run(Path(result.run_dir), name), run_seconds=round(time.perf_counter() - start, 1), settings=settings)


def row_from_run(run_dir: Path, name: str) -> dict:
    """A results row read from a finished run folder's manifest.json (a benchmark variant or a recipe run)."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    if manifest.get("status") != "complete":
        raise SystemExit(f"{run_dir}: the run is {manifest.get('status')!r}, not complete")
    row: dict = {"variant": name, "run_dir": str(run_dir),
                 "run_seconds": round(sum(s["seconds"] for s in manifest["stages"]), 1)}
    for s in manifest["stages"]:
        row[f"{s['id']}.seconds"] = round(s["seconds"], 1)
        for key in ("accuracy", "macs", "params", "macs_reduction", "heads", "accuracy_fp32", "accuracy_fp16",
                    "accuracy_int8"):
            if key in s["metrics"]:
                row[f"{s['id']}.{key}"] = s["metrics"][key]
    for a in manifest["artifacts"]:
        if a["target"] and a["status"] == "built":
            label = Artifact.from_record(a).label  # onnx.int8, onnx.int8_tensorrt: the names metrics use
            row[f"{label}.bytes"] = a["size_bytes"]
            row[f"{label}.path"] = str(run_dir / a["path"])
            for key in ("accuracy", "accuracy_f32", "cosine", "top1_agreement"):
                if key in a["metrics"]:
                    row[f"{label}.{key}"] = a["metrics"][key]
        elif a["kind"] == "checkpoint":
            row["checkpoint"] = str(run_dir / a["path"])
    return row


def mean_pool_probe(args) -> dict:
    """The pretrained-but-not-fine-tuned reference as the data's README measures it: the frozen encoder's
    mean-pooled last hidden states of the same stratified train subset, a logistic regression on them
    (torch L-BFGS, L2 1e-4), accuracy on the dev split. (The pipeline's own probe, a frozen encoder under a
    trained classifier on BERT's pooled [CLS], is the `probe` row: this sentence-embedding model never
    trained its [CLS] for that.)"""
    import torch
    import transformers

    start = time.perf_counter()
    path = args.out / "mean_pool_probe.yaml"
    path.write_text(yaml.safe_dump(recipe("mean_pool_probe", [{"type": "evaluate"}], args), sort_keys=False))
    from pruneflow.data import load_data

    data = load_data(load_recipe(path).recipe.data, seed=0, with_train=True)
    encoder = transformers.AutoModel.from_pretrained(str(MODEL), local_files_only=True).eval()

    def features(split) -> torch.Tensor:
        out = []
        with torch.no_grad():
            for i in range(0, len(split.y), 128):
                batch = {k: v[i:i + 128] for k, v in split.x.items()}
                hidden = encoder(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).float()
                out.append((hidden * mask).sum(1) / mask.sum(1))
        return torch.cat(out)

    xtr, xdev = features(data.train), features(data.eval)
    mean, std = xtr.mean(0), xtr.std(0) + 1e-6
    xtr, xdev = (xtr - mean) / std, (xdev - mean) / std
    head = torch.nn.Linear(xtr.shape[1], data.num_classes)
    opt = torch.optim.LBFGS(head.parameters(), max_iter=500, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(xtr), data.train.y) + 1e-4 * head.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        accuracy = float((head(xdev).argmax(1) == data.eval.y).float().mean())
    return {"variant": "probe (mean-pooled, logistic regression)", "evaluate.accuracy": accuracy,
            "run_seconds": round(time.perf_counter() - start, 1), "settings": {"train_samples": args.train_samples}}


def dev_batches(sizes=(1, 32)) -> dict[int, dict]:
    """Real dev rows, tokenized as the recipe does, each batch padded to its longest row."""
    import pandas as pd

    sentences = list(pd.read_parquet(SST2 / "dev.parquet")["sentence"])
    tok = load_tokenizer(str(MODEL))
    out = {}
    for bs in sizes:
        enc = tok(sentences[:bs], padding=True, truncation=True, max_length=64, return_tensors="np")
        out[bs] = {k: v.astype(np.int64) for k, v in enc.items()}
    return out


def pruned_variants(rows: dict) -> list[str]:
    """The rows with a pruning stage: the benchmark's own and a recipe run's."""
    return [name for name, row in rows.items() if "prune.macs_reduction" in row]


def runtime_agreement(rows: dict) -> dict:
    """How far the same INT8 model's dev predictions move between runtimes: the share of dev sentences each
    executor predicts differently from onnxruntime's, for the QAT INT8 (with SmoothQuant and without) and (as the
    yardstick) the FP32 model; for INT8, also the share predicted differently from the FP32 model.
    An INT8 transformer's coarse activation grids turn tiny float differences into whole-step ones, so this
    is the noise floor under every INT8 accuracy figure: one sentence of 872 is 0.11 pt."""
    import pandas as pd

    df = pd.read_parquet(SST2 / "dev.parquet")
    tok, sentences = load_tokenizer(str(MODEL)), list(df["sentence"])
    feeds = [{k: v.astype(np.int64) for k, v in tok(sentences[i : i + 32], padding=True, truncation=True, max_length=64,
                                                     return_tensors="np").items()} for i in range(0, len(sentences), 32)]
    picks = {"fp32": ("fp32 same budget", "fp32"), "int8": ("qat", "int8"),
             "int8, smooth_quant off": ("qat, smooth_quant off", "int8")}
    out: dict = {"sentences": len(sentences)}
    labels, correct, predicted = df["label"].to_numpy(), {}, {}
    for what, (variant, precision) in picks.items():
        onnx_path, ir_path = (rows.get(variant, {}).get(f"{t}.{precision}.path") for t in ("onnx", "openvino"))
        if not (onnx_path and ir_path):
            continue
        runners = {"onnxruntime": open_artifact(Path(onnx_path)), "openvino (default)": open_artifact(Path(ir_path)),
                   "openvino (f32)": open_artifact(Path(ir_path), precision_hint="f32")}
        preds = {n: np.concatenate([np.asarray(r(f)).argmax(1) for f in feeds]) for n, r in runners.items()}
        out[what] = {n: {"accuracy": float((p == labels).mean()), "differs_from_onnxruntime": float((p != preds["onnxruntime"]).mean())}
                     for n, p in preds.items()}
        correct[what] = {n: (p == labels).astype(float) for n, p in preds.items()}
        predicted[what] = preds
    for what in [w for w in correct if w != "fp32" and "fp32" in correct]:  # the drop sentence by sentence, its paired s.e.
        for name, right in correct[what].items():
            diff = 100 * (correct["fp32"]["onnxruntime"] - right)
            out[what][name].update(drop_vs_fp32_pt=float(diff.mean()), paired_se_pt=float(diff.std(ddof=1) / np.sqrt(len(diff))),
                                   differs_from_fp32=float((predicted[what][name] != predicted["fp32"]["onnxruntime"]).mean()))
    return out


def side_by_side_latency(rows: dict, runs: int) -> dict:
    """Every artifact in one interleaved loop per batch size, so machine load hits all alike."""
    picks = {"onnxruntime fp32": ("finetune", "onnx.fp32", {}), "onnxruntime int8 (qat)": ("qat", "onnx.int8", {}),
             "onnxruntime int8 (ptq)": ("ptq", "onnx.int8", {}),
             "openvino fp32 (default)": ("finetune", "openvino.fp32", {}),
             "openvino fp32 (f32)": ("finetune", "openvino.fp32", {"precision_hint": "f32"}),
             "openvino int8 (default)": ("qat", "openvino.int8", {}),
             "openvino int8 (f32)": ("qat", "openvino.int8", {"precision_hint": "f32"})}
    for name in pruned_variants(rows):
        picks.update({f"onnxruntime fp32, {name}": (name, "onnx.fp32", {}), f"onnxruntime int8, {name}": (name, "onnx.int8", {}),
                      f"openvino int8 (default), {name}": (name, "openvino.int8", {}),
                      f"openvino int8 (f32), {name}": (name, "openvino.int8", {"precision_hint": "f32"})})
    runners = {}
    for name, (variant, label, kw) in picks.items():
        path = rows.get(variant, {}).get(f"{label}.path")
        if path:
            runners[name] = open_artifact(Path(path), threads=1, **kw)
    out: dict = {"host": host_info(), "runs": runs, "executors": {n: r.info for n, r in runners.items()}}
    for bs, feed in dev_batches().items():
        times = interleaved_times(runners, feed, warmup=5, runs=runs)
        out[f"b{bs}"] = {"sequence_length": int(feed["input_ids"].shape[1]),
                         **{n: {"median_ms": statistics.median(v), "p99_ms": float(np.percentile(v, 99))} for n, v in times.items()}}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench-bert")
    parser.add_argument("--train-samples", type=int, default=4000, help="stratified subset of SST-2 train for every run")
    parser.add_argument("--epochs", type=int, default=2, help="fine-tuning epochs")
    parser.add_argument("--lr", type=float, default=5e-5, help="fine-tuning peak LR (AdamW, warm-up, linear decay)")
    parser.add_argument("--qat-epochs", type=int, default=1, help="QAT epochs (and the FP32 reference's)")
    parser.add_argument("--qat-lr", type=float, default=1e-5)
    parser.add_argument("--ffn", type=float, default=0.3, help="share of FFN neurons pruned beside 50 %% of the heads")
    parser.add_argument("--calib", type=int, default=256, help="calibration set size")
    parser.add_argument("--threads", type=int, default=2, help="torch threads while training")
    parser.add_argument("--runs", type=int, default=50, help="timed repetitions per artifact and batch size")
    parser.add_argument("--only", default="", help="comma-separated variant names (or their beginnings) to run")
    parser.add_argument("--quick", action="store_true", help="256 train / 128 dev rows, 1 epoch: a smoke test")
    parser.add_argument("--force", action="store_true", help="rerun variants that already have results")
    parser.add_argument("--finetuned", type=Path, default=None,
                        help="a fine-tuned checkpoint (e.g. RUN/stages/01-finetune/model.pt of recipes/minilm-sst2.yaml) "
                        "used as the baseline instead of fine-tuning here")
    parser.add_argument("--recipe-run", type=Path, default=None,
                        help="a finished run folder of recipes/minilm-sst2.yaml: one more pruned + INT8 row, read from its "
                        "manifest (use --only to skip the benchmark's own)")
    args = parser.parse_args()
    if args.quick:
        args.train_samples, args.epochs, args.calib, args.runs = 256, 1, 64, 5
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {"variants": {}}
    results["settings"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    for name, row in results["variants"].items():  # rows re-read from their run folders (fields added since)
        if (Path(row.get("run_dir", "")) / "manifest.json").is_file():
            row.update({k: v for k, v in row_from_run(Path(row["run_dir"]), name).items() if k != "run_seconds"})
    chosen = variants(args)
    if args.only:
        wanted = args.only.split(",")
        chosen = {k: v for k, v in chosen.items() if any(k.startswith(w) for w in wanted) or k == "finetune"}
    if args.finetuned:  # a recipe run's fine-tuned checkpoint is the baseline: evaluate and export it, train nothing
        chosen["finetune"] = ([{"type": "evaluate"}, dict(EXPORT, precisions=["fp32"])], True)
    if args.recipe_run:  # a finished `pruneflow optimize` run is one more row, read from its manifest
        results["variants"]["recipe: pruned + qat"] = dict(row_from_run(args.recipe_run.resolve(), "recipe: pruned + qat"),
                                                            budget=f"the recipe {args.recipe_run}")
    if "probe (mean-pooled, logistic regression)" not in results["variants"] or args.force:
        print("[run ] probe (mean-pooled, logistic regression)", flush=True)
        results["variants"]["probe (mean-pooled, logistic regression)"] = mean_pool_probe(args)
        results_file.write_text(json.dumps(results, indent=2))
    for name, (stages, from_finetuned) in chosen.items():
        if name in results["variants"] and not args.force:
            print(f"[skip] {name}: already measured", flush=True)
            continue
        print(f"[run ] {name}", flush=True)
        checkpoint = None
        if from_finetuned:
            checkpoint = str(args.finetuned.resolve()) if args.finetuned else results["variants"]["finetune"]["checkpoint"]
        results["variants"][name] = run_variant(name, stages, args, checkpoint)
        results_file.write_text(json.dumps(results, indent=2))
    results["agreement"] = runtime_agreement(results["variants"])
    results["latency"] = side_by_side_latency(results["variants"], args.runs)
    results_file.write_text(json.dumps(results, indent=2))
    report(results, args.out)
    return 0


def _pct(x) -> str:
    return f"{100 * x:.2f} %" if isinstance(x, (int, float)) else ""


def torch_accuracy(row: dict) -> float | None:
    """The accuracy of the last stage that measured one in torch (``STAGE.accuracy``; runtimes' keys have two dots)."""
    found = [v for k, v in row.items() if k.endswith(".accuracy") and k.count(".") == 1]
    return found[-1] if found else None


def acceptance(results: dict) -> list[tuple[str, str, bool]]:
    """Issue 13's acceptance lines, each (what, measured, held), computed from the rows and the latency loop."""
    v, b32 = results["variants"], results.get("latency", {}).get("b32", {})
    base = v["finetune"]
    ref, qat = v.get("fp32 same budget", base), v.get("qat", {})
    ms = {k: b32[k]["median_ms"] for k in b32 if isinstance(b32[k], dict)}
    out: list[tuple[str, str, bool]] = []
    for rt, key, how in (("onnx", "accuracy", "onnxruntime"), ("openvino", "accuracy", "OpenVINO (its default: bf16 here)"),
                         ("openvino", "accuracy_f32", "OpenVINO (f32, as the IR's deployment record says)")):
        a, r = qat.get(f"{rt}.int8.{key}"), ref.get(f"{rt}.fp32.{key}")
        if a is not None and r is not None:
            out.append((f"QAT INT8 top-1 drop vs same-budget FP32 in {how} <= 0.3 pt", f"{100 * (r - a):.2f} pt", 100 * (r - a) <= 0.3))
    if qat.get("onnx.int8.bytes") and base.get("onnx.fp32.bytes"):
        ratio = base["onnx.fp32.bytes"] / qat["onnx.int8.bytes"]
        out.append(("INT8 ONNX >= 3.5x smaller than FP32 ONNX", f"{ratio:.2f}x", ratio >= 3.5))
    fp32, int8 = ms.get("onnxruntime fp32"), ms.get("onnxruntime int8 (qat)")
    if fp32 and int8:
        out.append(("ORT INT8 >= 2x faster than ORT FP32 at batch 32", f"{fp32 / int8:.2f}x", fp32 / int8 >= 2))
    for q in ("onnxruntime int8 (qat)", "openvino int8 (default)", "openvino int8 (f32)"):
        for ov in ("openvino fp32 (default)", "openvino fp32 (f32)"):
            if q in ms and ov in ms:
                out.append((f"{q} faster than {ov} at batch 32", f"{ms[q]:.1f} vs {ms[ov]:.1f} ms", ms[q] < ms[ov]))
    for name in pruned_variants(v):
        out += pruned_acceptance(name, v[name], base, ref, ms)
    return out


def pruned_acceptance(name: str, pruned: dict, base: dict, ref: dict, ms: dict) -> list[tuple[str, str, bool]]:
    out: list[tuple[str, str, bool]] = []
    red, r, fp32 = pruned["prune.macs_reduction"], ref.get("onnx.fp32.accuracy"), ms.get("onnxruntime fp32")
    out.append((f"{name}: pruning >= 1.5x fewer MACs", f"{red:.2f}x", red >= 1.5))
    if pruned.get("prune.accuracy") is not None and r is not None:
        drop = 100 * (r - pruned["prune.accuracy"])
        out.append((f"{name}: pruned FP32 (torch) drop vs same-budget FP32 <= 1.0 pt", f"{drop:.2f} pt", drop <= 1.0))
    if fp32 and ms.get(f"onnxruntime fp32, {name}"):
        gain = fp32 / ms[f"onnxruntime fp32, {name}"]
        out.append((f"{name}: ORT b32 latency gain / MACs reduction (printed, no bar)", f"{gain:.2f}x / {red:.2f}x", True))
    if pruned.get("onnx.int8.bytes") and base.get("onnx.fp32.bytes"):
        ratio = base["onnx.fp32.bytes"] / pruned["onnx.int8.bytes"]
        out.append((f"{name}: pruned + INT8 >= 5x smaller than FP32 ONNX", f"{ratio:.2f}x", ratio >= 5))
    if fp32 and ms.get(f"onnxruntime int8, {name}"):
        speed = fp32 / ms[f"onnxruntime int8, {name}"]
        out.append((f"{name}: pruned + INT8 >= 3x faster than FP32 in ORT at batch 32", f"{speed:.2f}x", speed >= 3))
    a = pruned.get("onnx.int8.accuracy")
    if a is not None and r is not None:
        out.append((f"{name}: pruned + INT8 (ORT) drop vs same-budget FP32 <= 1.0 pt", f"{100 * (r - a):.2f} pt", 100 * (r - a) <= 1.0))
    return out


def report(results: dict, out: Path) -> None:
    v, s = results["variants"], results["settings"]
    base = v["finetune"]
    budget = (f"the fine-tuned checkpoint {s['finetuned']}" if s.get("finetuned") else
              f"{s['train_samples']} stratified SST-2 train phrases, {s['epochs']} epoch(s) at lr {s['lr']:g}")
    lines = ["# MiniLM-L6 on SST-2: fine-tune, prune, INT8" + (" (QUICK smoke run, not the acceptance figures)" if s["quick"] else ""),
             "", f"Baseline: {budget}. Later variants: {s['train_samples']} stratified train phrases, QAT (and its FP32 "
             f"reference) {s['qat_epochs']} epoch(s) at lr {s['qat_lr']:g} with KD from the baseline, calibration "
             f"{s['calib']} rows. Accuracy on the whole dev split in each runtime (OpenVINO: its default precision).", "",
             "| variant | torch | ORT fp32 | ORT int8 | OV fp32 | OV int8 | OV int8 (f32) | ORT int8 vs same-budget FP32 | run s |",
             "|---|---|---|---|---|---|---|---|---|"]
    ref = v.get("fp32 same budget", {}).get("onnx.fp32.accuracy", base.get("onnx.fp32.accuracy"))
    for r in v.values():
        drop = r.get("onnx.int8.accuracy")
        drop_txt = f"{100 * (drop - ref):+.2f} pt" if isinstance(drop, float) and isinstance(ref, float) else ""
        lines.append(f"| {r['variant']} | {_pct(torch_accuracy(r))} | {_pct(r.get('onnx.fp32.accuracy'))} | "
                     f"{_pct(r.get('onnx.int8.accuracy'))} | {_pct(r.get('openvino.fp32.accuracy'))} | "
                     f"{_pct(r.get('openvino.int8.accuracy'))} | {_pct(r.get('openvino.int8.accuracy_f32'))} | {drop_txt} | "
                     f"{r['run_seconds']} |")
    fp32_bytes = base.get("onnx.fp32.bytes")
    lines += ["", "| artifact | bytes | FP32 ONNX / this |", "|---|---|---|"]
    for name in ["finetune", "qat", "ptq", *pruned_variants(v)]:
        for label in ("onnx.fp32", "onnx.int8", "openvino.fp32", "openvino.int8"):
            b = v.get(name, {}).get(f"{label}.bytes")
            if b and fp32_bytes:
                lines.append(f"| {name}: {label} | {b:,} | {fp32_bytes / b:.2f}x |")
    for name in pruned_variants(v):
        pruned = v[name]
        phases = ", ".join(f"{p} {_pct(pruned[f'qat.accuracy_{p}'])}" for p in ("fp32", "fp16", "int8")
                           if f"qat.accuracy_{p}" in pruned)
        lines += ["", f"Pruning ({name}): {pruned['prune.macs_reduction']:.2f}x fewer MACs, heads {pruned.get('prune.heads')}, "
                  f"accuracy after pruning {_pct(pruned.get('prune.accuracy'))}" + (f"; QAT phases (torch): {phases}" if phases else "") + "."]
    agreement = results.get("agreement", {})
    if agreement.get("int8"):
        lines += ["", f"The same model in three runtimes ({agreement['sentences']} dev sentences): the share each predicts "
                  "differently from onnxruntime, the noise floor under every INT8 accuracy figure above.", "",
                  "| model | executor | accuracy | differs from onnxruntime | differs from FP32 (ORT) | drop vs FP32 (ORT) ± paired s.e. |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {what} | {name} | {_pct(a['accuracy'])} | {_pct(a['differs_from_onnxruntime'])} | "
                  + (f"{_pct(a['differs_from_fp32'])} | {a['drop_vs_fp32_pt']:+.2f} ± {a['paired_se_pt']:.2f} pt |" if "paired_se_pt" in a else "| |")
                  for what in agreement if what != "sentences" for name, a in agreement[what].items()]
    lat = results.get("latency", {})
    cpu = lat.get("host", {}).get("cpu", {})
    lines += ["", f"Latency, 1 thread, interleaved, {lat.get('runs')} runs each (ms). Host: {cpu.get('model')}, "
              f"{cpu.get('usable_cpus')} usable CPUs, ISA {' '.join(cpu.get('isa', []))}.", "",
              "| executor | b1 median | b32 median | b32 p99 | b32 speed-up vs ORT fp32 |", "|---|---|---|---|---|"]
    b1, b32 = lat.get("b1", {}), lat.get("b32", {})
    for name in [k for k in b32 if isinstance(b32[k], dict)]:
        speed = b32["onnxruntime fp32"]["median_ms"] / b32[name]["median_ms"] if "onnxruntime fp32" in b32 else float("nan")
        lines.append(f"| {name} | {b1.get(name, {}).get('median_ms', float('nan')):.2f} | {b32[name]['median_ms']:.2f} | "
                     f"{b32[name]['p99_ms']:.2f} | {speed:.2f}x |")
    lines += ["", f"Sequence lengths: batch 1 = {b1.get('sequence_length')}, batch 32 = {b32.get('sequence_length')} "
              "(the first dev rows, padded to the longest).", "", "| acceptance (issue 13) | measured | held |", "|---|---|---|"]
    lines += [f"| {what} | {value} | {'yes' if held else 'NO'} |" for what, value, held in acceptance(results)]
    text = "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    print(text)


if __name__ == "__main__":
    raise SystemExit(main())
