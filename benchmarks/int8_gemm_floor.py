"""How much of a transformer's onnxruntime INT8 time is its integer GEMMs alone (issue 25, item 2).

Takes a finished MiniLM-style run whose onnx INT8 file is the ``fused`` form (QAttention + MatMulIntegerToFloat)
and times, in ONE interleaved loop (1 thread, a batch of real eval rows as ``benchmarks/int8_peers.py`` draws it):

- a graph of nothing but the model's own integer GEMMs (every MatMulIntegerToFloat and QAttention weight, each as
  one MatMulIntegerToFloat over batch x sequence rows): the floor onnxruntime's MLAS kernels set;
- the whole INT8 file and the FP32 file in onnxruntime;
- the INT8 IR as deployed (the hint its record names) and the FP32 IR at OpenVINO's default.

It prints the GEMMs' share of the whole model and their rate in GMAC/s, so a target such as "1.4x faster" can be
checked against what the kernels allow before anyone tunes the rest of the graph. Writes a markdown table and JSON.

    python benchmarks/int8_gemm_floor.py runs/minilm/minilm-sst2 --out benchmarks/results/int8_gemm_floor_minilm
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pruneflow.data import load_data  # noqa: E402
from pruneflow.inputs import take  # noqa: E402
from pruneflow.recipe.models import DataSpec  # noqa: E402
from pruneflow.runtime import fresh_batch, host_info, interleaved_times, open_artifact  # noqa: E402
from pruneflow.tasks import make_task  # noqa: E402

INTEGER_GEMMS = ("MatMulIntegerToFloat", "QAttention")


def gemm_shapes(int8_onnx: Path) -> list[tuple[int, int]]:
    """(K, N) of every integer GEMM weight in the fused INT8 file (input 1 of both ops)."""
    import onnx

    model = onnx.load(str(int8_onnx))
    weights = {i.name: tuple(i.dims) for i in model.graph.initializer}
    shapes = [weights[n.input[1]] for n in model.graph.node if n.op_type in INTEGER_GEMMS]
    if not shapes:
        raise SystemExit(f"{int8_onnx} has no {' or '.join(INTEGER_GEMMS)}: export it with `form: fused` (or auto)")
    return [(int(k), int(n)) for k, n in shapes]


def gemms_only(shapes: list[tuple[int, int]], rows: int):
    """An onnxruntime session running one MatMulIntegerToFloat per shape over ``rows`` uint8 rows, and its feed."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, inputs, inits, feed = [], [], [], {}
    for i, (k, n) in enumerate(shapes):
        inits += [numpy_helper.from_array(rng.integers(-127, 128, (k, n)).astype(np.int8), f"w{i}"),
                  numpy_helper.from_array(np.full(n, 0.01, np.float32), f"ws{i}")]
        inputs.append(helper.make_tensor_value_info(f"a{i}", TensorProto.UINT8, [rows, k]))
        nodes.append(helper.make_node("MatMulIntegerToFloat", [f"a{i}", f"w{i}", "as", f"ws{i}", "az"], [f"y{i}"],
                                      domain="com.microsoft"))
        feed[f"a{i}"] = rng.integers(0, 256, (rows, k)).astype(np.uint8)
    inits += [numpy_helper.from_array(np.array(0.01, np.float32), "as"), numpy_helper.from_array(np.array(128, np.uint8), "az")]
    outputs = [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, None) for i in range(len(shapes))]
    model = helper.make_model(helper.make_graph(nodes, "gemms", inputs, outputs, inits),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session, feed


def eval_batch(run: Path, batch: int):
    """The batch ``int8_peers.py`` times at ``--batch 1,BATCH``: eval rows drawn with seed 0 after its batch-1 row,
    text cut to the batch's longest row."""
    recipe = yaml.safe_load((run / "recipe.resolved.yaml").read_text())
    data = load_data(DataSpec.model_validate(recipe["data"]), seed=int(recipe.get("seed", 0)), with_train=False,
                     task=make_task(recipe.get("task")))
    rng = np.random.default_rng(0)
    for size in dict.fromkeys((1, batch)):
        rows = rng.choice(len(data.eval), size=size, replace=False).tolist()
    return fresh_batch(take(data.eval.x, rows), batch)


def _record_hint(xml: Path) -> str | None:
    from pruneflow.deployment import openvino_hint
    from pruneflow.formats.openvino import read_ir

    return openvino_hint(read_ir(xml))


def measure(run: Path, batch: int, runs: int) -> dict:
    export = run / "export"
    shapes = gemm_shapes(export / "onnx" / "model.int8.onnx")
    sample = eval_batch(run, batch)
    rows = int(np.prod(next(iter(sample.values())).shape))
    session, feed = gemms_only(shapes, rows)
    ir = export / "openvino" / "model.int8.xml"
    lanes = {"onnxruntime integer GEMMs only": lambda _: session.run(None, feed),
             "onnxruntime int8 (whole model)": open_artifact(export / "onnx" / "model.int8.onnx", threads=1),
             "onnxruntime fp32": open_artifact(export / "onnx" / "model.fp32.onnx", threads=1),
             "openvino int8 (as deployed)": open_artifact(ir, threads=1, precision_hint=_record_hint(ir)),
             "openvino fp32 (default)": open_artifact(export / "openvino" / "model.fp32.xml", threads=1)}
    times = interleaved_times(lanes, sample, warmup=5, runs=runs)
    p50 = {name: statistics.median(values) for name, values in times.items()}
    macs = sum(k * n for k, n in shapes) * rows
    return {"shape": [batch, rows // batch], "gemms": len(shapes), "gmac": macs / 1e9, "p50_ms": p50,
            "gemm_gmac_per_s": macs / p50["onnxruntime integer GEMMs only"] / 1e6,
            "gemm_share": p50["onnxruntime integer GEMMs only"] / p50["onnxruntime int8 (whole model)"]}


def markdown(results: dict) -> str:
    m, host = results["measured"], results["host"]
    cpu = host.get("cpu", {})
    lines = [f"# onnxruntime INT8: the integer GEMMs' floor ({results['run']})", "",
             f"Host: {cpu.get('model', '?')}, ISA {' '.join(cpu.get('isa') or [])}; 1 thread; {results['date']}. "
             f"Batch {m['shape'][0]} x {m['shape'][1]} tokens of real eval rows; one interleaved loop, {results['runs']} runs.", "",
             "| lane | p50 ms | vs onnxruntime int8 |", "|---|---|---|"]
    whole = m["p50_ms"]["onnxruntime int8 (whole model)"]
    lines += [f"| {name} | {ms:.2f} | {whole / ms:.2f}x |" for name, ms in m["p50_ms"].items()]
    lines += ["", f"{m['gemms']} integer GEMMs, {m['gmac']:.2f} GMAC at {m['gemm_gmac_per_s']:.0f} GMAC/s: "
              f"{m['gemm_share']:.0%} of the whole INT8 model's time in onnxruntime: with every other op taking no time "
              f"the model would be {1 / m['gemm_share']:.2f}x faster there, and no faster than "
              f"{m['p50_ms']['onnxruntime integer GEMMs only']:.1f} ms without faster GEMM kernels.", "",
              f"Run: `python benchmarks/int8_gemm_floor.py {results['run']} --out OUT --batch {m['shape'][0]} "
              f"--runs {results['runs']}`", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path, help="a finished MiniLM run with onnx (form fused) and openvino exports")
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.md and OUT.json")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    results = {"run": str(args.run), "date": time.strftime("%Y-%m-%d"), "runs": args.runs, "host": host_info(),
               "measured": measure(args.run, args.batch, args.runs)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
