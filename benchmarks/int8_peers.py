"""pruneflow's INT8 artifacts against what each runtime's own tools make of the same FP32 model (issue 25).

Takes a finished run with an FP32 export and an INT8 export (recipes/resnet56-cifar10-ptq.yaml; a MiniLM run) and
builds the peers from that run's FP32 files and its calibration set (the same samples pruneflow calibrated on):

- onnxruntime ``quantize_static``, QDQ, per-channel weights, after its ``quant_pre_process``: S8S8 (int8
  activations, onnxruntime's advice where the CPU has VNNI) and U8S8 (uint8 activations);
- for a transformer (token inputs), onnxruntime's BERT recipe: ``quantize_dynamic`` on the FP32 graph, and its
  transformer optimizer then ``quantize_dynamic`` (its default fusions; the head counts pinned first with
  ``pruneflow.export.fusion.pin_head_counts``, without which it fuses nothing in a pruned model);
- NNCF's ``nncf.quantize`` on the OpenVINO FP32 IR (default preset; ``ModelType.TRANSFORMER`` for a
  transformer), the path OpenVINO documents.

Every artifact's accuracy is measured on the run's eval split in its runtime, run as it would be deployed
(pruneflow's INT8 IR with the hint of its record, every other IR at OpenVINO's default), and all of them are timed
in ONE interleaved loop per batch size (1 thread; a fresh batch of real eval rows, text cut to its longest row),
with the FP32 files at each runtime's default (and OpenVINO's also with f32 forced), so machine load hits all
alike. Writes a markdown table and JSON.

    python benchmarks/int8_peers.py runs/ptq/resnet56-cifar10-ptq --out benchmarks/results/int8_peers_resnet56
    # a MiniLM run (its onnx FP32 fused for onnxruntime: the peers start from a standard export of its pruned
    # checkpoint); --also NAME=PATH adds a lane, e.g. the INT8 file an earlier export wrote
    python benchmarks/int8_peers.py runs/minilm/minilm-sst2 --out benchmarks/results/int8_peers_minilm
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pruneflow.calibrate.calibset import CalibrationSet  # noqa: E402
from pruneflow.calibrate.consumers import ort_reader  # noqa: E402
from pruneflow.data import load_data  # noqa: E402
from pruneflow.evaluate import evaluate_runtime  # noqa: E402
from pruneflow.export.fusion import is_portable  # noqa: E402
from pruneflow.recipe.models import DataSpec  # noqa: E402
from pruneflow.runtime import host_info, interleaved_times, open_artifact  # noqa: E402
from pruneflow.tasks import make_task  # noqa: E402


def find(run: Path, *patterns: str) -> Path:
    """The first of ``patterns`` (globs under the run) that exists."""
    for pattern in patterns:
        found = sorted(run.glob(pattern))
        if found:
            return found[0]
    raise SystemExit(f"{run}: none of {', '.join(patterns)} (run recipes/resnet56-cifar10-ptq.yaml first)")


def portable_fp32(run: Path, out: Path) -> Path:
    """A standard FP32 ONNX of the model that entered quantization (the float base of the run's last checkpoint, as
    the onnx target exports it), without `fuse`: what the peers start from when the run's FP32 ONNX is fused."""
    from pruneflow.checkpoint import load_checkpoint
    from pruneflow.export.onnx import export_onnx
    from pruneflow.inputs import fresh, take
    from pruneflow.models import build_model
    from pruneflow.recipe.models import ModelSpec

    recipe = yaml.safe_load((run / "recipe.resolved.yaml").read_text())
    checkpoint = sorted(run.glob("stages/*/model.pt"))[-1]
    module = load_checkpoint(checkpoint, into=build_model(ModelSpec.model_validate(recipe["model"]))).float_module().eval()
    calib = CalibrationSet.load(run / "calibration")
    export_onnx(module, fresh(take(calib.x, slice(0, 2)), 2), out / "fp32.portable.onnx")
    print(f"[fp32] {checkpoint} -> a standard FP32 ONNX", flush=True)
    return out / "fp32.portable.onnx"


def ort_peers(fp32_onnx: Path, calib: CalibrationSet, out: Path, transformer: bool) -> dict[str, Path]:
    """onnxruntime's own quantization of the FP32 ONNX: static QDQ per-channel S8S8 and U8S8; for a transformer
    also dynamic, on the graph as it is and after onnxruntime's transformer optimizer."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_dynamic, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    fp32_onnx, out = fp32_onnx.resolve(), out.resolve()
    pre = out / "fp32.pre.onnx"
    with contextlib.chdir(out):  # it leaves temporary files in the working folder when it gives up
        try:
            quant_pre_process(str(fp32_onnx), str(pre))
        except Exception:  # noqa: BLE001 - its symbolic shape inference gives up on a BERT's mask arithmetic
            quant_pre_process(str(fp32_onnx), str(pre), skip_symbolic_shape=True)
    peers = {}
    for name, activations in (("ort quantize_static S8S8", QuantType.QInt8), ("ort quantize_static U8S8", QuantType.QUInt8)):
        path = out / f"{name.split()[-1].lower()}.onnx"
        quantize_static(str(pre), str(path), ort_reader(calib, batch_size=16), quant_format=QuantFormat.QDQ,
                        activation_type=activations, weight_type=QuantType.QInt8, per_channel=True,
                        calibrate_method=CalibrationMethod.MinMax)
        peers[name] = path
    if transformer:
        dynamic = {"weight_type": QuantType.QInt8, "extra_options": {"DefaultTensorType": 1}}  # 1: float (contrib ops)
        quantize_dynamic(str(fp32_onnx), str(out / "dynamic.onnx"), **dynamic)
        peers["ort quantize_dynamic"] = out / "dynamic.onnx"
        quantize_dynamic(str(ort_optimized(fp32_onnx, out)), str(out / "optimized_dynamic.onnx"), **dynamic)
        peers["ort optimizer + quantize_dynamic"] = out / "optimized_dynamic.onnx"
    return peers


def ort_optimized(fp32_onnx: Path, out: Path) -> Path:
    """onnxruntime's transformer optimizer with its BERT defaults, the head counts pinned first."""
    import onnx
    from onnxruntime.transformers.optimizer import optimize_model

    from pruneflow.export.fusion import pin_head_counts

    model = onnx.load(str(fp32_onnx))
    pin_head_counts(model)
    onnx.save(model, str(out / "pinned.onnx"))
    optimize_model(str(out / "pinned.onnx"), model_type="bert", num_heads=0, hidden_size=0).save_model_to_file(str(out / "optimized.onnx"))
    return out / "optimized.onnx"


def nncf_peer(fp32_xml: Path, calib: CalibrationSet, out: Path, transformer: bool) -> Path:
    """NNCF post-training quantization of the OpenVINO FP32 IR, with the same calibration samples."""
    import nncf
    import openvino as ov

    from pruneflow.inputs import as_numpy

    model = ov.Core().read_model(str(fp32_xml))
    names = {i.get_any_name() for i in model.inputs}
    batches = [as_numpy(b) for b in calib.batches(1)]
    batches = [{k: v for k, v in b.items() if k in names} if isinstance(b, dict) else b for b in batches]
    options = {"model_type": nncf.ModelType.TRANSFORMER} if transformer else {}
    quantized = nncf.quantize(model, nncf.Dataset(batches), subset_size=len(batches), **options)
    path = out / "nncf_ptq.xml"
    ov.save_model(quantized, str(path))
    return path


def lanes(run: Path, peers: dict[str, Path], fp32_onnx: Path, fp32_xml: Path, also: dict[str, Path]) -> dict[str, tuple[Path, dict]]:
    """name → (file, open_artifact options): each as deployed, the FP32 files also at OpenVINO's f32."""
    ours_ir = find(run, "export/openvino/model.int8.xml")
    pruneflow_fp32 = find(run, "export/onnx/model.fp32.onnx", "export/reference/onnx/model.fp32.onnx")
    return {
        "onnxruntime fp32": (fp32_onnx, {}),
        **({"onnxruntime pruneflow fp32 (fused)": (pruneflow_fp32, {})} if pruneflow_fp32 != fp32_onnx else {}),
        "onnxruntime pruneflow int8": (find(run, "export/onnx/model.int8.onnx"), {}),
        **{name: (path, {}) for name, path in also.items()},
        **{f"onnxruntime {k.removeprefix('ort ')}": (v, {}) for k, v in peers.items() if v.suffix == ".onnx"},
        "openvino fp32 (default)": (fp32_xml, {}),
        "openvino fp32 (f32)": (fp32_xml, {"precision_hint": "f32"}),
        "openvino pruneflow int8 (as deployed)": (ours_ir, {"precision_hint": _record_hint(ours_ir)}),
        "openvino pruneflow int8 (default)": (ours_ir, {}),
        "openvino nncf ptq (default)": (peers["nncf"], {}),
    }


def _record_hint(xml: Path) -> str | None:
    from pruneflow.deployment import openvino_hint
    from pruneflow.formats.openvino import read_ir

    return openvino_hint(read_ir(xml))


def measure(run: Path, chosen: dict[str, tuple[Path, dict]], batches: list[int], runs: int) -> dict[str, dict]:
    from pruneflow.inputs import take
    from pruneflow.runtime import fresh_batch

    recipe = yaml.safe_load((run / "recipe.resolved.yaml").read_text())
    task = make_task(recipe.get("task"))
    data = load_data(DataSpec.model_validate(recipe["data"]), seed=int(recipe.get("seed", 0)), with_train=False, task=task)
    runners = {name: open_artifact(path, threads=1, **{k: v for k, v in options.items() if v}) for name, (path, options) in chosen.items()}
    out: dict[str, dict] = {}
    for name, runner in runners.items():
        metrics = evaluate_runtime(runner, data.eval, task, 256)
        out[name] = {"file": str(chosen[name][0]), "accuracy": metrics["accuracy"],
                     "computed_in": runner.info.get("inference_precision")}
        print(f"[acc ] {name}: {metrics['accuracy']:.4f}", flush=True)
    for name, (path, options) in chosen.items():
        if path.suffix == ".xml":
            out[name]["runtime_graph"] = openvino_runtime_ops(path, options.get("precision_hint"))
    rng = np.random.default_rng(0)
    for batch in batches:
        sample = fresh_batch(take(data.eval.x, rng.choice(len(data.eval), size=batch, replace=False).tolist()), batch)
        times = interleaved_times(runners, sample, warmup=5, runs=runs)
        for name, values in times.items():
            out[name][f"b{batch}"] = {"p50_ms": statistics.median(values), "p99_ms": float(np.percentile(values, 99))}
        shape = {k: list(v.shape) for k, v in sample.items()} if isinstance(sample, dict) else list(sample.shape)
        print(f"[time] batch {batch} {shape}: " + ", ".join(f"{n} {statistics.median(v):.2f}" for n, v in times.items()), flush=True)
    return out


def openvino_runtime_ops(xml: Path, hint: str | None) -> dict[str, int]:
    """What OpenVINO's CPU plugin runs for an IR (its compiled runtime graph): FakeQuantize left standalone,
    Reorder (layout or precision conversions), and FullyConnected/MatMul/Convolution run in int8."""
    import openvino as ov

    config = {"INFERENCE_NUM_THREADS": 1, **({"INFERENCE_PRECISION_HINT": hint} if hint else {})}
    ops = ov.Core().compile_model(str(xml), "CPU", config).get_runtime_model().get_ops()
    kinds = [(op.get_rt_info()["layerType"].astype(str), op.get_rt_info()["runtimePrecision"].astype(str)) for op in ops]
    weighted = ("FullyConnected", "MatMul", "Convolution")
    return {"FakeQuantize": sum(k == "FakeQuantize" for k, _ in kinds), "Reorder": sum(k == "Reorder" for k, _ in kinds),
            "weighted": sum(k in weighted for k, _ in kinds), "weighted_int8": sum(k in weighted and p in ("i8", "u8") for k, p in kinds)}


def markdown(results: dict, batches: list[int]) -> str:
    cpu = results["host"]["cpu"]
    lines = [f"# INT8 against the runtimes' own tools: {results['run']}", "",
             f"Host: {cpu['model']} ({cpu['arch']}), {cpu['usable_cpus']} CPUs, ISA {' '.join(cpu['isa'])}; 1 thread; "
             f"{results['date']}. One interleaved loop per batch size, {results['runs']} runs, a fresh eval batch. "
             "Ratios are against the FP32 file in the same runtime at its default.", "",
             "| artifact | computed in | accuracy | " + " | ".join(f"b{b} p50 ms | b{b} vs FP32" for b in batches) + " |",
             "|---|---|---|" + "---|---|" * len(batches)]
    figures = results["artifacts"]
    for name, row in figures.items():
        base = figures["onnxruntime fp32" if name.startswith("onnxruntime") else "openvino fp32 (default)"]
        cells = [f"{row[f'b{b}']['p50_ms']:.2f} | {base[f'b{b}']['p50_ms'] / row[f'b{b}']['p50_ms']:.2f}x" for b in batches]
        lines.append(f"| {name} | {row['computed_in'] or '-'} | {row['accuracy']:.4f} | " + " | ".join(cells) + " |")
    graphs = {name: row["runtime_graph"] for name, row in figures.items() if "runtime_graph" in row}
    if graphs:
        lines += ["", "What OpenVINO's CPU plugin runs for each IR (its compiled runtime graph, as timed above):", "",
                  "| IR | standalone FakeQuantize | Reorder | FullyConnected/MatMul/Conv | of them in int8 |", "|---|---|---|---|---|"]
        lines += [f"| {n} | {g['FakeQuantize']} | {g['Reorder']} | {g['weighted']} | {g['weighted_int8']} |" for n, g in graphs.items()]
    return "\n".join(lines + forms_tables(Path(results["run"]))) + "\n"


def forms_tables(run: Path) -> list[str]:
    """The run's own "int8 forms" tables (each target's candidates as its export timed them), when it has them."""
    metrics = run / "metrics.json"
    rows = [r for t in json.loads(metrics.read_text()).get("tables", {}).values() for r in t.get("int8 forms", [])] if metrics.is_file() else []
    if not rows:
        return []
    times = sorted({k for r in rows for k in r if k.startswith("p50_ms_")})
    out = ["", "The forms the run's export timed (its own loop, earlier; `relative`: geometric mean over batch sizes of "
           "the time over the best):", "", "| artifact | form | cosine | " + " | ".join(times) + " | relative | chosen |",
           "|---|---|---|" + "---|" * len(times) + "---|---|"]
    for r in rows:
        cells = " | ".join(f"{r[k]:.2f}" if k in r else "-" for k in times)
        rel = f"{r['relative']:.3f}" if r.get("relative") is not None else "not kept (parity or agreement)" if not r["passed"] else "-"
        out.append(f"| {r['artifact']} | {r['form']} | {r['cosine']:.6f} | {cells} | {rel} | {'yes' if r['chosen'] else ''} |")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a finished run of recipes/resnet56-cifar10-ptq.yaml")
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.md and OUT.json")
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--fp32-onnx", type=Path, help="the standard FP32 ONNX the onnxruntime peers start from "
                        "(default: the run's reference or onnx export; exported from its checkpoint when that is fused)")
    parser.add_argument("--also", action="append", default=[], metavar="NAME=PATH", help="one more onnxruntime lane")
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    calib = CalibrationSet.load(args.run / "calibration")
    transformer = isinstance(calib.x, dict)
    fp32_onnx = args.fp32_onnx or find(args.run, "export/reference/onnx/model.fp32.onnx", "export/onnx/model.fp32.onnx")
    fp32_xml = find(args.run, "export/reference/openvino/model.fp32.xml", "export/openvino/model.fp32.xml")
    also = {name: Path(path) for name, path in (item.split("=", 1) for item in args.also)}
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        if not is_portable(fp32_onnx):  # fused for onnxruntime: the peers start from a standard export of the same model
            fp32_onnx = portable_fp32(args.run, Path(tmp))
        peers = ort_peers(fp32_onnx, calib, Path(tmp), transformer)
        peers["nncf"] = nncf_peer(fp32_xml, calib, Path(tmp), transformer)
        figures = measure(args.run, lanes(args.run, peers, fp32_onnx, fp32_xml, also), batches, args.runs)
    results = {"run": str(args.run), "date": time.strftime("%Y-%m-%d"), "runs": args.runs, "host": host_info(),
               "seconds": round(time.perf_counter() - start, 1), "artifacts": figures}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results, batches))
    print(markdown(results, batches))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
