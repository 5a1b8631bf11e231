"""End to end on real data: the quickstart (digits) and the pretrained ResNet-20 on CIFAR-10."""

from __future__ import annotations

import json

import pytest

from pruneflow.artifacts import Artifact, Manifest, atomic_path, sha256_file
from pruneflow.pipeline import run_recipe
from pruneflow.recipe import load_recipe

from conftest import REPO, forced_f32, invoke, runs_a_recipe, tiny_recipe_dict, write


@pytest.fixture(scope="module")
@runs_a_recipe
def quickstart(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    return run_recipe(load_recipe(REPO / "recipes" / "quickstart.yaml"), out=out)


def test_quickstart_meets_its_acceptance_figures(quickstart):
    r = quickstart
    assert r.exit_code == 0, [g for g in r.gates if not g.passed]
    assert r.metrics["evaluate.accuracy"] >= 0.95
    assert abs(r.metrics["onnx.fp32.accuracy"] - r.metrics["evaluate.accuracy"]) <= 0.005
    assert r.metrics["onnx.fp32.top1_agreement"] >= 0.99
    assert r.metrics["evaluate.samples"] == 360  # 20 % of 1,797 digits, stratified
    assert [s.id for s in r.stages] == ["train", "prune", "calibrate", "qat", "evaluate", "export"]
    assert r.metrics["prune.macs_reduction"] >= 2.0  # target: keep half the MACs
    for runtime in ("onnx", "openvino"):  # INT8 within a point of the FP32 model entering QAT, in each runtime
        assert r.metrics[f"{runtime}.int8.accuracy"] >= r.metrics["qat.accuracy_fp32"] - 0.01
    assert r.metrics["onnx.int8_tensorrt.top1_agreement"] >= 0.95
    # every artifact timed in one interleaved loop: speed-ups against the fp32 artifact of the same target
    for label in ("onnx.int8", "onnx.int8_tensorrt", "openvino.int8"):
        ratio = r.metrics[f"{label.split('.')[0]}.fp32.latency_b32_median_ms"] / r.metrics[f"{label}.latency_b32_median_ms"]
        assert r.metrics[f"{label}.speedup_b32"] == pytest.approx(ratio)
    assert r.metrics["openvino.int8.inference_precision"] and forced_f32(r.metrics, "openvino.int8.accuracy") >= 0.9


def test_quickstart_manifest_records_true_hashes_and_lineage(quickstart):
    run_dir = quickstart.run_dir
    manifest = Manifest.read(run_dir)
    assert manifest["status"] == "complete"
    assert manifest["host"]["cpu"]["model"] and manifest["host"]["versions"]["openvino"]
    by_path = {a["path"]: a for a in manifest["artifacts"]}
    assert set(by_path) == {
        "stages/01-train/model.pt", "stages/02-prune/model.pt", "calibration/calibration.json", "stages/04-qat/model.pt",
        "export/onnx/model.fp32.onnx", "export/onnx/model.int8.onnx", "export/onnx/model.int8.tensorrt.onnx",
        "export/openvino/model.fp32.xml", "export/openvino/model.int8.xml",
    }
    for path, artifact in by_path.items():
        # One file: its own sha256; several (OpenVINO's .xml and .bin, the calibration dataset): each file's in
        # `files` and their combined digest in `sha256`.
        assert Artifact.from_record(artifact).verify(run_dir)
        if not artifact["files"]:
            assert artifact["sha256"] == sha256_file(run_dir / path)
        files = {path, *artifact["files"]}
        assert artifact["size_bytes"] == sum((run_dir / f).stat().st_size for f in files)
        assert all(sha == sha256_file(run_dir / f) for f, sha in artifact["files"].items())
        assert artifact["tool_versions"]["torch"]
    assert by_path["export/onnx/model.int8.onnx"]["parent"] == "stages/04-qat/model.pt"
    assert by_path["stages/04-qat/model.pt"]["parent"] == "stages/02-prune/model.pt"
    assert by_path["stages/02-prune/model.pt"]["parent"] == "stages/01-train/model.pt"
    assert by_path["stages/01-train/model.pt"]["parent"].startswith("source:")


def test_quickstart_writes_the_run_directory(quickstart):
    run_dir = quickstart.run_dir
    for name in ("recipe.resolved.yaml", "manifest.json", "metrics.json", "report.md", "logs/pruneflow.log"):
        assert (run_dir / name).is_file(), name
    assert not list(run_dir.rglob("*.tmp")), "a temporary file was left behind"
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["flat"]["evaluate.accuracy"] == quickstart.metrics["evaluate.accuracy"]
    assert len(metrics["tables"]["train"]["epochs"]) == 12
    report = (run_dir / "report.md").read_text()
    assert "## Stages" in report and "onnx/model.fp32.onnx" in report and "PASSED" in report
    assert load_recipe(run_dir / "recipe.resolved.yaml").recipe.name == "quickstart"


@pytest.mark.slow
@pytest.mark.shared_data
def test_pretrained_resnet20_on_cifar10_matches_the_published_figure(shared_data, tmp_path):
    r = run_recipe(load_recipe(REPO / "recipes" / "resnet20-cifar10.yaml", ["stages.1.latency=null"]), out=tmp_path)
    assert r.exit_code == 0
    # ../shared/data/cifar10/README.md: ResNet-20 scores 81.03 % on cifar10_test.npz.
    assert abs(r.metrics["evaluate.accuracy"] - 0.8103) <= 0.001
    assert abs(r.metrics["onnx.fp32.accuracy"] - r.metrics["evaluate.accuracy"]) <= 0.001
    assert r.metrics["evaluate.params"] == 269_722


def test_atomic_path_leaves_nothing_when_the_writer_fails(tmp_path):
    final = tmp_path / "model.onnx"
    with pytest.raises(RuntimeError):
        with atomic_path(final) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("crash mid-write")
    assert list(tmp_path.iterdir()) == []
    with atomic_path(final) as tmp:
        tmp.write_bytes(b"whole")
    assert final.read_bytes() == b"whole" and list(tmp_path.iterdir()) == [final]


def test_a_failure_before_the_first_stage_writes_nothing(tmp_path, write_recipe):
    """Data and model are loaded and checked before the run folder exists (tests/test_garbage_in.py)."""
    from pruneflow.errors import InputError

    from conftest import tiny_recipe_dict

    (tmp_path / "empty.csv").write_text("x,label\n")
    recipe = tiny_recipe_dict(data={"format": "csv", "path": "empty.csv"})
    with pytest.raises(InputError, match="no rows"):
        run_recipe(load_recipe(write_recipe(recipe)), out=tmp_path / "runs")
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow  # a tiny recipe through pruning and PTQ with latency timed (~20 s)
def test_the_report_opens_with_what_changed_against_the_model_the_run_started_from(tmp_path):
    """report.md never said what changed against the model you started from: every ratio was against the pruned
    FP32 (issue 26). It now opens with start -> result and a ratio for MACs, parameters, bytes, the headline metric
    and the latency of the starting model timed in each runtime interleaved with the artifacts."""

    stages = [{"type": "train", "epochs": 1, "batch_size": 32, "lr": 0.05},
              {"type": "prune", "importance": "magnitude", "target": {"macs": 0.5}, "rounds": 1,
               "finetune": {"epochs": 1, "batch_size": 32}},
              {"type": "calibrate", "size": 64},
              {"type": "ptq"},
              {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32", "int8"],
               "latency": {"batch_sizes": [1], "runs": 5, "warmup": 1}}]
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict(stages=stages))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--json")
    assert result.exit_code == 0, result.output
    rows = {r["what"].split(" (")[0].split(",")[0]: r for r in json.loads(result.stdout)["headline"]}
    assert rows["MACs"]["ratio"] > 1.3 and rows["parameters"]["ratio"] > 1.3
    assert rows["bytes on disk"]["ratio"] > 3  # int8 of a pruned model against the trained fp32 checkpoint
    assert "delta" in rows["accuracy"]
    assert rows["latency onnxruntime/CPU"]["ratio"] > 0 and "spread" in rows["latency onnxruntime/CPU"]
    assert any(k.startswith("latency openvino/CPU") for k in rows)
    # where OpenVINO defaults to bf16, the INT8 IR is compared as its deployment record says to run it (f32 hint),
    # unless the export measured it faster, and as close, at the default (int8_hint: auto)
    ir = next(a for a in json.loads(result.stdout)["artifacts"] if a["path"].endswith("openvino/model.int8.xml"))
    pinned = ir["metrics"]["int8_hint"] == "f32"
    for row in json.loads(result.stdout)["headline"]:
        if row["what"].startswith("latency openvino/CPU (default: bf16)"):
            assert row["what"].endswith("(openvino.int8 as deployed, f32 hint)" if pinned else "(openvino.int8)"), row
    head = (tmp_path / "runs" / "tiny" / "report.md").read_text().splitlines()[:15]
    assert "## Against the model you started from" in head and any(ln.startswith("| MACs |") and "x fewer" in ln for ln in head)


def test_the_artifact_table_sets_no_checkpoint_latency_beside_the_runtimes():
    """02-prune/model.pt showed 0.026 ms beside onnx.int8's 0.040 ms: the prune stage's own timing of its ONNX export,
    in other settings, read as a faster artifact (new-user trial). The stage's table keeps it."""
    from types import SimpleNamespace

    from pruneflow.report import artifact_rows

    def artifact(path, kind, ms):
        return SimpleNamespace(path=path, kind=kind, status="built", notes=[], size_bytes=1000,
                               metrics={"accuracy": 0.9, "latency_b1_median_ms": ms})

    result = SimpleNamespace(task={"agreement": "top1_agreement"}, headline="accuracy",
                             artifacts=[artifact("stages/02-prune/model.pt", "checkpoint", 0.026),
                                        artifact("export/onnx/model.int8.onnx", "onnx", 0.040)])
    rows = {r["artifact"]: r for r in artifact_rows(result)}
    assert rows["02-prune/model.pt"]["lat b1 ms"] is None and rows["onnx/model.int8.onnx"]["lat b1 ms"] == 0.040
