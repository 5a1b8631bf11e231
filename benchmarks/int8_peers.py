"""pruneflow's INT8 artifacts against what each runtime's own tools make of the same FP32 model (issue 25).

Takes a finished run with an FP32 reference export and an INT8 export (recipes/resnet56-cifar10-ptq.yaml) and
builds the peers from that run's FP32 files and its calibration set (the same 512 samples pruneflow calibrated on):

- onnxruntime ``quantize_static``, QDQ, per-channel weights, after its ``quant_pre_process``: S8S8 (int8
  activations, onnxruntime's advice where the CPU has VNNI) and U8S8 (uint8 activations);
- NNCF's ``nncf.quantize`` on the OpenVINO FP32 IR (default preset), the path OpenVINO documents.

Every artifact's accuracy is measured on the run's eval split in its runtime, run as it would be deployed
(pruneflow's INT8 IR with the f32 hint of its record, every other IR at OpenVINO's default), and all of them are
timed in ONE interleaved loop per batch size (1 thread; a fresh eval batch), with the FP32 files at each runtime's
default (and OpenVINO's also with f32 forced), so machine load hits all alike. Writes a markdown table and JSON.

    python benchmarks/int8_peers.py runs/ptq/resnet56-cifar10-ptq --out benchmarks/results/int8_peers_resnet56
"""

from __future__ import annotations

import argparse
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

from calibrate.calibset import CalibrationSet  # noqa: E402
from calibrate.consumers import ort_reader  # noqa: E402
from pruneflow.data import load_data  # noqa: E402
from pruneflow.evaluate import evaluate_runtime  # noqa: E402
from pruneflow.recipe.models import DataSpec  # noqa: E402
from pruneflow.runtime import host_info, interleaved_times, open_artifact  # noqa: E402
from pruneflow.tasks import make_task  # noqa: E402


def find(run: Path, pattern: str) -> Path:
    found = sorted(run.glob(pattern))
    if not found:
        raise SystemExit(f"{run}: no {pattern} (run recipes/resnet56-cifar10-ptq.yaml first)")
    return found[0]


def ort_peers(fp32_onnx: Path, calib: CalibrationSet, out: Path) -> dict[str, Path]:
    """onnxruntime's own static quantization of the FP32 ONNX: QDQ, per-channel, S8S8 and U8S8."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = out / "fp32.pre.onnx"
    quant_pre_process(str(fp32_onnx), str(pre))
    peers = {}
    for name, activations in (("ort quantize_static S8S8", QuantType.QInt8), ("ort quantize_static U8S8", QuantType.QUInt8)):
        path = out / f"{name.split()[-1].lower()}.onnx"
        quantize_static(str(pre), str(path), ort_reader(calib, batch_size=16), quant_format=QuantFormat.QDQ,
                        activation_type=activations, weight_type=QuantType.QInt8, per_channel=True,
                        calibrate_method=CalibrationMethod.MinMax)
        peers[name] = path
    return peers


def nncf_peer(fp32_xml: Path, calib: CalibrationSet, out: Path) -> Path:
    """NNCF post-training quantization of the OpenVINO FP32 IR, with the same calibration samples."""
    import nncf
    import openvino as ov

    from pruneflow.inputs import as_numpy

    batches = [as_numpy(b) for b in calib.batches(1)]
    quantized = nncf.quantize(ov.Core().read_model(str(fp32_xml)), nncf.Dataset(batches), subset_size=len(batches))
    path = out / "nncf_ptq.xml"
    ov.save_model(quantized, str(path))
    return path


def lanes(run: Path, peers: dict[str, Path]) -> dict[str, tuple[Path, dict]]:
    """name → (file, open_artifact options): each as deployed, the FP32 files also at OpenVINO's f32."""
    fp32_onnx, fp32_xml = find(run, "export/reference/onnx/model.fp32.onnx"), find(run, "export/reference/openvino/model.fp32.xml")
    return {
        "onnxruntime fp32": (fp32_onnx, {}),
        "onnxruntime pruneflow int8": (find(run, "export/onnx/model.int8.onnx"), {}),
        **{f"onnxruntime {k.removeprefix('ort ')}": (v, {}) for k, v in peers.items() if v.suffix == ".onnx"},
        "openvino fp32 (default)": (fp32_xml, {}),
        "openvino fp32 (f32)": (fp32_xml, {"precision_hint": "f32"}),
        "openvino pruneflow int8 (f32 hint, as deployed)": (find(run, "export/openvino/model.int8.xml"), {"precision_hint": "f32"}),
        "openvino nncf ptq (default)": (peers["nncf"], {}),
    }


def measure(run: Path, chosen: dict[str, tuple[Path, dict]], batches: list[int], runs: int) -> dict[str, dict]:
    recipe = yaml.safe_load((run / "recipe.resolved.yaml").read_text())
    task = make_task(recipe.get("task"))
    data = load_data(DataSpec.model_validate(recipe["data"]), seed=int(recipe.get("seed", 0)), with_train=False, task=task)
    runners = {name: open_artifact(path, threads=1, **options) for name, (path, options) in chosen.items()}
    out: dict[str, dict] = {}
    for name, runner in runners.items():
        metrics = evaluate_runtime(runner, data.eval, task, 256)
        out[name] = {"file": str(chosen[name][0]), "accuracy": metrics["accuracy"],
                     "computed_in": runner.info.get("inference_precision")}
        print(f"[acc ] {name}: {metrics['accuracy']:.4f}", flush=True)
    rng = np.random.default_rng(0)
    x = np.asarray(data.eval.x)
    for batch in batches:
        sample = np.ascontiguousarray(x[rng.choice(len(x), size=batch, replace=False)])
        times = interleaved_times(runners, sample, warmup=5, runs=runs)
        for name, values in times.items():
            out[name][f"b{batch}"] = {"p50_ms": statistics.median(values), "p99_ms": float(np.percentile(values, 99))}
        print(f"[time] batch {batch}: " + ", ".join(f"{n} {statistics.median(v):.2f}" for n, v in times.items()), flush=True)
    return out


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
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a finished run of recipes/resnet56-cifar10-ptq.yaml")
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.md and OUT.json")
    parser.add_argument("--batch", default="1,32")
    parser.add_argument("--runs", type=int, default=100)
    args = parser.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    calib = CalibrationSet.load(args.run / "calibration")
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        peers = ort_peers(find(args.run, "export/reference/onnx/model.fp32.onnx"), calib, Path(tmp))
        peers["nncf"] = nncf_peer(find(args.run, "export/reference/openvino/model.fp32.xml"), calib, Path(tmp))
        figures = measure(args.run, lanes(args.run, peers), batches, args.runs)
    results = {"run": str(args.run), "date": time.strftime("%Y-%m-%d"), "runs": args.runs, "host": host_info(),
               "seconds": round(time.perf_counter() - start, 1), "artifacts": figures}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results, batches))
    print(markdown(results, batches))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
