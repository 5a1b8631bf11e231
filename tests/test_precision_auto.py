"""BF16 as a precision and `precision: auto` (issue 25, item 3): the openvino target writes a bf16 IR (fp16-stored
weights, its record pinning OpenVINO's bf16 inference precision), and a target with `precision: auto` delivers the
fastest of its artifacts that holds every gate, timed as deployed, with the table that decided it."""

from __future__ import annotations

import json

import pytest

from conftest import run_recipe_dict, tiny_recipe_dict
from pruneflow.artifacts import Artifact
from pruneflow.gates import GateResult
from pruneflow.stages.export_choice import choose_precisions


def _ir(precision: str, b1: float, b16: float, hint: str | None = None, f32: tuple[float, float] | None = None) -> Artifact:
    metrics = {"latency_b1_median_ms": b1, "latency_b16_median_ms": b16}
    if f32:
        metrics.update(latency_b1_median_ms_f32=f32[0], latency_b16_median_ms_f32=f32[1])
    record = {"runtime": {"openvino": {"INFERENCE_PRECISION_HINT": hint}}} if hint else {}
    return Artifact(path=f"export/openvino/model.{precision}.xml", kind="openvino", producer="export", target="openvino",
                    precision=precision, metrics=metrics, deployment=record)


def test_the_fastest_artifact_that_holds_every_gate_is_chosen_timed_as_deployed():
    fp32, bf16 = _ir("fp32", 2.0, 20.0), _ir("bf16", 1.0, 10.0)
    # the INT8 IR is deployed with the f32 hint: its f32 lane decides, not its (faster here) default one
    int8 = _ir("int8", 0.1, 1.0, hint="f32", f32=(0.9, 9.0))
    gates = [GateResult("openvino.fp32.parity", True, ""), GateResult("openvino.bf16.parity", True, ""),
             GateResult("openvino.int8.parity", True, "")]
    kept, rows = choose_precisions(["openvino"], [fp32, bf16, int8], gates, [1, 16])
    assert [a.metrics["precision_chosen"] for a in (fp32, bf16, int8)] == [0.0, 0.0, 1.0]
    assert kept[-1].name == "openvino.precision_auto" and kept[-1].passed
    assert [r["choice"] for r in rows] == ["", "", "chosen"] and rows[2]["timed as deployed"] == "f32 hint"
    assert rows[2]["b16 p50 ms"] == "9"  # the f32 lane's figure
    # INT8 fails its parity gate: bf16 wins, and INT8's failed gate leaves the stage's gates for its notes
    gates[2] = GateResult("openvino.int8.parity", False, "cosine 0.9 < 0.99")
    kept, rows = choose_precisions(["openvino"], [fp32, bf16, int8], list(gates), [1, 16])
    assert bf16.metrics["precision_chosen"] == 1.0 and int8.metrics["precision_chosen"] == 0.0
    assert all(g.passed for g in kept) and "openvino.int8.parity" not in {g.name for g in kept}
    assert any("not delivered (precision chosen per target); gate failed: openvino.int8.parity" in n for n in int8.notes)
    assert rows[2]["gates"] == "failed: parity"


def test_when_no_precision_holds_the_gates_nothing_is_chosen_and_the_run_fails():
    fp32, int8 = _ir("fp32", 2.0, 20.0), _ir("int8", 1.0, 10.0)
    gates = [GateResult("openvino.fp32.parity", False, "nan"), GateResult("openvino.int8.parity", False, "nan")]
    kept, _ = choose_precisions(["openvino"], [fp32, int8], list(gates), [1, 16])
    assert [g.name for g in kept if not g.passed] == ["openvino.fp32.parity", "openvino.int8.parity",
                                                       "openvino.precision_auto"]
    assert "openvino.fp32: parity" in kept[-1].message
    assert fp32.metrics["precision_chosen"] == 0.0 == int8.metrics["precision_chosen"]


def test_auto_needs_timing_and_onnxruntime_writes_no_bf16(write_recipe):
    from pruneflow.errors import RecipeError
    from pruneflow.recipe import load_recipe as load

    recipe = tiny_recipe_dict(name="rules")
    recipe["stages"] = [{"type": "export", "precisions": ["fp32", "bf16"], "latency": None,
                         "targets": [{"type": "onnx", "precisions": ["fp32"]}, {"type": "openvino", "precision": "auto"}]}]
    with pytest.raises(RecipeError) as err:
        load(write_recipe(recipe))
    (issue,) = err.value.issues
    assert issue.path == "stages.0.targets.1.precision" and "latency" in issue.message
    recipe["stages"][0]["targets"][0] = "onnx"
    recipe["stages"][0].pop("latency")
    with pytest.raises(RecipeError) as err:
        load(write_recipe(recipe))
    (issue,) = err.value.issues
    assert issue.path == "stages.0.precisions.1" and "'onnx' cannot write bf16" in issue.message


@pytest.mark.slow
def test_a_run_writes_a_bf16_ir_and_delivers_the_precision_auto_chose(tmp_path):
    recipe = tiny_recipe_dict(name="auto")
    recipe["stages"] = [{"type": "train", "epochs": 2, "batch_size": 32, "lr": 0.05},
                        {"type": "calibrate", "size": 64}, {"type": "ptq"},
                        {"type": "export", "precisions": ["fp32", "bf16", "int8"], "latency": {"batch_sizes": [1, 16], "runs": 10},
                         "targets": [{"type": "onnx", "precisions": ["fp32", "int8"]}, {"type": "openvino", "precision": "auto"}]}]
    _, result = run_recipe_dict(recipe, tmp_path)
    assert result.exit_code == 0
    manifest = json.loads((result.run_dir / "manifest.json").read_text())
    irs = {a["precision"]: a for a in manifest["artifacts"] if a.get("target") == "openvino"}
    assert set(irs) == {"fp32", "bf16", "int8"} and sum(a["metrics"]["precision_chosen"] for a in irs.values()) == 1
    bf16 = irs["bf16"]
    assert bf16["deployment"]["runtime"]["openvino"] == {"INFERENCE_PRECISION_HINT": "bf16"}
    assert bf16["size_bytes"] < 0.75 * irs["fp32"]["size_bytes"]  # weights stored in 16 bits
    host_bf16 = any(f in manifest["host"]["cpu"]["isa"] for f in ("avx512_bf16", "amx_bf16"))
    assert bf16["metrics"]["inference_precision"] == ("bf16" if host_bf16 else "f32") and bf16["metrics"]["cosine"] > 0.999
    report = (result.run_dir / "report.md").read_text()
    assert "## export: precision chosen" in report and report.count("| openvino | openvino.") == 3
    chosen = next(a for a in irs.values() if a["metrics"]["precision_chosen"] == 1)
    assert any(n.startswith("delivered for openvino: ") for n in chosen["notes"])
