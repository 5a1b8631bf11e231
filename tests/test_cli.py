"""The command line end to end through Typer's CliRunner: exit codes, --json, --dry-run, --resume, init, schema, inspect.

Every run is a tiny recipe (digits_cnn, 300 training and 100 eval digits, one epoch, no latency timing) written
into tmp_path; the run that several tests read is made once per module.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import pytest
import yaml
from pydantic import Field
from typer.testing import CliRunner

from pruneflow.cli import app
from pruneflow import __version__, registry
from pruneflow.errors import MissingDependencyError
from pruneflow.recipe.models import recipe_model, target_union
from pruneflow.stage import Stage, StageConfig, StageResult, Target, TargetConfig
from conftest import invoke, runs_a_recipe, tiny_recipe_dict, write

# No forced colours (a CI variable could otherwise put ANSI codes between the words we look for).
runner = CliRunner(env={"FORCE_COLOR": None, "COLUMNS": "200"})

ROOT = Path(__file__).resolve().parents[1]


def tiny(**changes) -> dict:
    recipe = {
        "name": "tiny",
        "seed": 0,
        "device": "cpu",
        "model": {"factory": "digits_cnn"},
        "data": {"format": "digits", "max_train_samples": 300, "max_eval_samples": 100},
        "stages": [
            {"type": "train", "epochs": 1, "batch_size": 32},
            {"type": "evaluate"},
            {"type": "export", "targets": ["onnx"], "latency": None, "evaluate": True},
        ],
        "gates": [{"metric": "evaluate.accuracy", "min": 0.0}],
    }
    recipe.update(changes)
    return recipe


def no_train(**changes) -> dict:
    """The tiny recipe without training (evaluate and export the untrained model): about a second."""
    changes.setdefault("stages", [{"type": "evaluate"},
                                  {"type": "export", "targets": ["onnx"], "latency": None, "evaluate": True}])
    return tiny(**changes)


def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def one_json(result) -> dict:
    """stdout holds exactly one JSON object, on one line."""
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    payload = json.loads(lines[0])
    assert isinstance(payload, dict)
    return payload


# --------------------------------------------------------------------------- test-only plugins


class FakeTargetConfig(TargetConfig):
    type: Literal["fake"] = Field("fake", description="A target whose toolchain is never installed.")


class FakeTarget(Target):
    Config = FakeTargetConfig

    def preflight(self) -> list[str]:
        raise MissingDependencyError("the fake target needs fakelib, which is not installed", hint="pip install fakelib")


class FailConfig(StageConfig):
    type: Literal["fail_stage"] = Field("fail_stage", description="Raises RuntimeError.")


class FailStage(Stage):
    Config = FailConfig

    def run(self, state, ctx) -> StageResult:
        raise RuntimeError("the fail stage broke on purpose")


class InterruptConfig(StageConfig):
    type: Literal["interrupt_stage"] = Field("interrupt_stage", description="Raises KeyboardInterrupt (Ctrl-C).")


class InterruptStage(Stage):
    Config = InterruptConfig

    def run(self, state, ctx) -> StageResult:
        raise KeyboardInterrupt


def _clear_caches() -> None:
    recipe_model.cache_clear()
    target_union.cache_clear()


@pytest.fixture
def plugins():
    """Register the test-only target and stages; afterwards the registries and recipe models are as before."""
    _clear_caches()
    try:
        with (registry.targets.registered("fake", FakeTarget), registry.stages.registered("fail_stage", FailStage),
              registry.stages.registered("interrupt_stage", InterruptStage)):
            _clear_caches()
            yield
    finally:
        _clear_caches()  # the recipe models built while they were registered name them


# --------------------------------------------------------------------------- the shared run


@pytest.fixture(scope="module")
@runs_a_recipe
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    recipe = write(root / "tiny.yaml", tiny())
    result = invoke("optimize", recipe, "--out", root / "runs", "--json")
    assert result.exit_code == 0, result.output
    return SimpleNamespace(root=root, recipe=recipe, run_dir=root / "runs" / "tiny", result=result,
                           payload=one_json(result))


# --------------------------------------------------------------------------- exit 0


def test_validate_a_good_recipe_exits_0(tmp_path):
    recipe = write(tmp_path / "r.yaml", tiny())
    result = invoke("validate", recipe)
    assert result.exit_code == 0, result.output
    assert "valid" in result.stdout
    assert "3 stages: train (train), evaluate (evaluate), export (export)" in result.stdout


def test_validate_show_prints_the_resolved_recipe(tmp_path):
    recipe = write(tmp_path / "r.yaml", tiny())
    result = invoke("validate", recipe, "--show", "--set", "stages.0.epochs=2")
    assert result.exit_code == 0, result.output
    shown = yaml.safe_load(result.stdout.split("✓")[0])
    assert shown["stages"][0]["epochs"] == 2
    assert shown["stages"][0]["optimizer"] == "sgd"  # defaults are spelled out


def test_optimize_tiny_recipe_exits_0_and_writes_the_run(tiny_run):
    run_dir = tiny_run.run_dir
    assert tiny_run.payload["exit_code"] == 0
    assert Path(tiny_run.payload["run_dir"]) == run_dir
    for name in ("manifest.json", "metrics.json", "report.md", "recipe.resolved.yaml", "logs/pruneflow.log",
                 "stages/01-train/model.pt", "stages/01-train/stage.json", "export/onnx/model.fp32.onnx"):
        assert (run_dir / name).is_file(), name
    data = manifest(run_dir)
    assert data["status"] == "complete"
    assert [s["id"] for s in data["stages"]] == ["train", "evaluate", "export"]
    assert "PASSED" in (run_dir / "report.md").read_text()


@pytest.mark.slow
def test_optimize_prints_a_summary_without_json(tmp_path):
    recipe = write(tmp_path / "r.yaml", no_train())
    result = invoke("optimize", recipe, "--out", tmp_path / "runs")
    assert result.exit_code == 0, result.output
    assert "PASSED — run directory" in result.stdout  # report.md's verdict word (the last line said "done")
    assert "evaluate" in result.stdout and "onnx" in result.stdout
    assert "Traceback" not in result.output


# --------------------------------------------------------------------------- --json


def test_json_holds_stages_artifacts_and_gates(tiny_run):
    payload = tiny_run.payload
    assert {"run_dir", "exit_code", "stages", "artifacts", "gates"} <= set(payload)
    assert [s["name"] for s in payload["stages"]] == ["train", "evaluate", "export"]
    for stage in payload["stages"]:
        assert {"name", "type", "seconds", "metrics"} <= set(stage)
        assert stage["seconds"] >= 0 and stage["resumed"] is False
    assert payload["stages"][1]["metrics"]["samples"] == 100
    assert 0 <= payload["stages"][1]["metrics"]["accuracy"] <= 1

    artifacts = {a["path"]: a for a in payload["artifacts"]}
    assert set(artifacts) == {"stages/01-train/model.pt", "export/onnx/model.fp32.onnx"}
    for a in artifacts.values():
        assert {"path", "target", "precision", "status", "sha256", "size_bytes", "metrics"} <= set(a)
        assert a["status"] == "built"
        file = tiny_run.run_dir / a["path"]
        assert a["size_bytes"] == file.stat().st_size
        assert len(a["sha256"]) == 64
    onnx = artifacts["export/onnx/model.fp32.onnx"]
    assert (onnx["target"], onnx["precision"]) == ("onnx", "fp32")
    assert onnx["metrics"]["top1_agreement"] >= 0.99 and onnx["metrics"]["max_abs_diff"] < 1e-3
    assert onnx["metrics"]["accuracy"] == pytest.approx(payload["stages"][1]["metrics"]["accuracy"], abs=0.02)
    assert not any(k.startswith("latency") for k in onnx["metrics"])  # latency: null

    gates = {g["name"]: g for g in payload["gates"]}
    assert set(gates) == {"onnx.fp32.parity", "evaluate.accuracy"}
    assert all(g["passed"] for g in gates.values())
    assert tiny_run.result.stdout.count("\n") == 1  # one object, nothing else on stdout


def test_json_on_an_invalid_recipe(tmp_path):
    recipe = write(tmp_path / "r.yaml", tiny())
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--json", "--set", "stages.0.epochs=three")
    assert result.exit_code == 2
    payload = one_json(result)
    assert payload["exit_code"] == 2
    assert payload["error"]["type"] == "RecipeError"
    [issue] = payload["error"]["issues"]
    assert issue["path"] == "stages.0.epochs"
    assert issue["value"] == "three"
    assert issue["file"] == "--set stages.0.epochs=three"
    assert not (tmp_path / "runs").exists()


# --------------------------------------------------------------------------- exit 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "gates, args, failing",
    [
        ([{"metric": "evaluate.accuracy", "min": 0.0}], ["--set", "gates.0.min=1.01"], "< min 1.01"),
        ([{"metric": "onnx.fp32.no_such_metric", "min": 0.0}], [], "was not produced by this run"),
    ],
    ids=["min-above-1", "metric-never-produced"],
)
def test_a_failed_gate_exits_1_and_keeps_the_artifacts(tmp_path, gates, args, failing):
    recipe = write(tmp_path / "r.yaml", no_train(gates=gates))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--json", *args)
    assert result.exit_code == 1, result.output
    payload = one_json(result)
    assert payload["exit_code"] == 1
    [failed] = [g for g in payload["gates"] if not g["passed"]]
    assert failed["name"] == gates[0]["metric"]
    assert failing in failed["message"]

    run_dir = tmp_path / "runs" / "tiny"
    data = manifest(run_dir)
    assert data["status"] == "gate_failed"
    onnx = run_dir / "export" / "onnx" / "model.fp32.onnx"
    assert onnx.is_file()
    assert [a["sha256"] for a in data["artifacts"] if a["kind"] == "onnx"] == [
        a["sha256"] for a in payload["artifacts"] if a["kind"] == "onnx"
    ]
    assert "GATE FAILED" in (run_dir / "report.md").read_text()
    assert json.loads((run_dir / "metrics.json").read_text())["gates"] == payload["gates"]


@pytest.mark.slow
def test_a_failed_gate_is_reported_in_the_summary(tmp_path):
    recipe = write(tmp_path / "r.yaml", no_train())
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--set", "gates.0.min=1.01")
    assert result.exit_code == 1, result.output
    assert "FAIL" in result.stdout and "quality gate failed" in result.stdout


# --------------------------------------------------------------------------- exit 2

BAD_EPOCHS = """\
name: tiny
device: cpu
model:
  factory: digits_cnn
data:
  format: digits
  max_train_samples: 300
  max_eval_samples: 100
stages:
  - type: train
    batch_size: 32
    epochs: "three"
  - type: evaluate
"""


@pytest.mark.parametrize("command", ["validate", "optimize"])
def test_a_wrong_type_exits_2_naming_file_and_line(tmp_path, command):
    recipe = write(tmp_path / "bad.yaml", BAD_EPOCHS)
    line = BAD_EPOCHS.splitlines().index('    epochs: "three"') + 1
    args = ["--out", tmp_path / "runs"] if command == "optimize" else []
    result = invoke(command, recipe, *args)
    assert result.exit_code == 2, result.output
    assert f"{recipe}:{line}" in result.stderr
    assert "stages.0.epochs" in result.stderr and "'three'" in result.stderr
    assert "valid integer" in result.stderr
    assert not (tmp_path / "runs").exists()


def _unknown_key(tmp_path):
    r = tiny()
    r["stages"][0]["batchsize"] = r["stages"][0].pop("batch_size")
    return [write(tmp_path / "r.yaml", r)], ["stages.0.batchsize", "unknown key", "did you mean 'batch_size'"]


def _unknown_stage(tmp_path):
    r = tiny()
    r["stages"][1]["type"] = "evalute"
    return [write(tmp_path / "r.yaml", r)], ["stages.1.type", "unknown stage type", "did you mean 'evaluate'",
                                             "Known: calibrate, evaluate, export, prune, ptq, qat, train"]


def _extends_cycle(tmp_path):
    write(tmp_path / "b.yaml", "extends: a.yaml\nname: b\n")
    a = write(tmp_path / "a.yaml", "extends: b.yaml\nname: a\n")
    return [a], ["`extends` forms a cycle", "a.yaml -> ", "b.yaml -> "]


def _set_missing_index(tmp_path):
    return [write(tmp_path / "r.yaml", tiny()), "--set", "stages.9.epochs=3"], [
        "names a path that does not exist", "'stages' is a list of 3 entries"]


def _set_through_a_value(tmp_path):
    return [write(tmp_path / "r.yaml", tiny()), "--set", "data.format.kind=x"], [
        "names a path that does not exist", "'data.format' holds a value"]


def _set_unknown_key(tmp_path):
    return [write(tmp_path / "r.yaml", tiny()), "--set", "stages.0.epoch=3"], [
        "--set stages.0.epoch=3", "unknown key", "did you mean 'epochs'"]


def _set_new_mapping(tmp_path):
    return [write(tmp_path / "r.yaml", tiny()), "--set", "colour.hue=3"], ["--set colour.hue=3  colour", "unknown key"]


def _duplicate_stage_names(tmp_path):
    return [write(tmp_path / "r.yaml", tiny()), "--set", "stages.1.name=train"], [
        "--set stages.1.name=train  stages.1.name  'train' is used by two stages (stages.0 and this one)"]


def _missing_file(tmp_path):
    return [tmp_path / "nope.yaml"], ["recipe file not found", "nope.yaml"]


def _set_without_equals(tmp_path):
    return [write(tmp_path / "r.yaml", tiny()), "--set", "stages.0.epochs"], ["usage error", "has no '='"]


def _not_yaml(tmp_path):
    return [write(tmp_path / "r.yaml", "name: [unclosed\n")], ["is not valid YAML"]


@pytest.mark.parametrize(
    "case",
    [_unknown_key, _unknown_stage, _extends_cycle, _set_missing_index, _set_through_a_value, _set_unknown_key,
     _set_new_mapping, _duplicate_stage_names, _missing_file, _set_without_equals, _not_yaml],
    ids=lambda f: f.__name__.strip("_"),
)
@pytest.mark.parametrize("command", ["validate", "optimize"])
def test_invalid_recipe_or_usage_exits_2(tmp_path, case, command):
    args, expected = case(tmp_path)
    result = invoke(command, *args, *(["--out", tmp_path / "runs"] if command == "optimize" else []))
    assert result.exit_code == 2, result.output
    for text in expected:
        assert text in result.stderr, (text, result.stderr)
    assert "Traceback" not in result.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_optimize_refuses_a_foreign_run_directory(tmp_path):
    recipe = write(tmp_path / "r.yaml", tiny())
    write(tmp_path / "runs" / "tiny" / "keep.txt", "not ours")
    result = invoke("optimize", recipe, "--out", tmp_path / "runs")
    assert result.exit_code == 2, result.output
    assert "is not a pruneflow run directory" in result.stderr
    assert sorted(p.name for p in (tmp_path / "runs" / "tiny").iterdir()) == ["keep.txt"]


def test_unknown_option_is_a_usage_error(tmp_path):
    result = invoke("optimize", write(tmp_path / "r.yaml", tiny()), "--no-such-option")
    assert result.exit_code == 2


# --------------------------------------------------------------------------- exit 3


def test_missing_dependency_exits_3_before_writing_anything(tmp_path, plugins):
    recipe = write(tmp_path / "r.yaml", no_train(stages=[{"type": "evaluate"}, {"type": "export", "targets": ["fake"]}]))
    result = invoke("validate", recipe)  # the target is known; its toolchain is what is missing, and validate says so
    assert result.exit_code == 3 and "pip install fakelib" in result.stderr, result.output

    result = invoke("optimize", recipe, "--out", tmp_path / "runs")
    assert result.exit_code == 3, result.output
    assert "missing dependency" in result.stderr
    assert "fakelib" in result.stderr and "pip install fakelib" in result.stderr
    assert not (tmp_path / "runs").exists()

    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--json")
    assert result.exit_code == 3
    payload = one_json(result)
    assert payload["exit_code"] == 3
    assert payload["error"]["type"] == "MissingDependencyError"
    assert payload["error"]["hint"] == "pip install fakelib"

    assert invoke("optimize", recipe, "--out", tmp_path / "runs", "--dry-run").exit_code == 3


def test_the_plugins_fixture_registers_the_test_plugins(plugins):
    assert "fake" in registry.targets.names()
    assert "fail_stage" in json.dumps(recipe_model().model_json_schema())


def test_after_the_plugins_fixture_the_fake_target_is_unknown(tmp_path):
    assert "fake" not in registry.targets.names()
    assert "fail_stage" not in registry.stages.names()
    recipe = write(tmp_path / "r.yaml", no_train(stages=[{"type": "export", "targets": ["fake"]}]))
    result = invoke("validate", recipe)
    assert result.exit_code == 2
    assert "'fake'" in result.stderr


# --------------------------------------------------------------------------- exit 4

OPAQUE_MODEL = '''\
import torch
from torch import nn


class Opaque(torch.autograd.Function):
    """No `symbolic`, and a forward with an op ONNX cannot express, so the exporter cannot inline it either."""

    @staticmethod
    def forward(ctx, x):
        return torch.special.bessel_j0(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(64, 10)

    def forward(self, x):
        return self.fc(Opaque.apply(x.flatten(1)))


def make():
    return Net()
'''


@pytest.mark.slow
def test_an_onnx_export_failure_is_a_failed_artifact_and_build_gate_exit_1(tmp_path):
    """One artifact that cannot be built never aborts the export stage (issue 15): a `failed` artifact with
    the error, a failed `onnx.fp32.build` gate, exit 1."""
    write(tmp_path / "opaque.py", OPAQUE_MODEL)
    recipe = write(tmp_path / "r.yaml", tiny(
        model={"factory": "opaque.py:make"},
        stages=[{"type": "export", "targets": ["onnx"], "latency": None, "evaluate": True}],
        gates=[],
    ))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs")
    assert result.exit_code == 1, result.output
    assert "onnx.fp32.build" in result.output and "could not be exported to ONNX" in result.output
    assert "Traceback" not in result.output
    run_dir = tmp_path / "runs" / "tiny"
    data = manifest(run_dir)
    assert data["status"] == "gate_failed"
    failed = [a for a in data["artifacts"] if a["status"] == "failed"]
    assert len(failed) == 1 and "could not be exported to ONNX" in failed[0]["notes"][0]
    assert not (run_dir / "export" / "onnx" / "model.fp32.onnx").exists()
    assert not [p for p in (run_dir / "export" / "onnx").iterdir()]  # no half-written temporary left behind


@pytest.mark.slow
def test_a_failing_stage_exits_4_naming_it(tmp_path, plugins):
    recipe = write(tmp_path / "r.yaml", no_train(stages=[{"type": "evaluate"}, {"type": "fail_stage", "name": "breaker"}]))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--json")
    assert result.exit_code == 4, result.output
    assert "stage failed" in result.stderr
    assert "breaker (fail_stage)" in result.stderr and "the fail stage broke on purpose" in result.stderr
    payload = one_json(result)
    assert payload["exit_code"] == 4 and payload["error"]["type"] == "StageError"
    data = manifest(tmp_path / "runs" / "tiny")
    assert data["status"] == "failed"
    assert [s["id"] for s in data["stages"]] == ["evaluate"]


# --------------------------------------------------------------------------- exit 130


@pytest.mark.slow
def test_an_interrupted_run_exits_130_and_keeps_finished_stages(tmp_path, plugins):
    recipe = write(tmp_path / "r.yaml", no_train(stages=[{"type": "evaluate"}, {"type": "interrupt_stage"}]))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs")
    assert result.exit_code == 130, result.output
    assert "interrupted" in result.stderr and "--resume" in result.stderr
    run_dir = tmp_path / "runs" / "tiny"
    data = manifest(run_dir)
    assert data["status"] == "interrupted"
    assert [s["id"] for s in data["stages"]] == ["evaluate"]
    assert (run_dir / "stages" / "01-evaluate" / "stage.json").is_file()


@pytest.mark.slow
def test_an_interrupted_run_with_json_still_prints_one_object(tmp_path, plugins):
    recipe = write(tmp_path / "r.yaml", no_train(stages=[{"type": "interrupt_stage"}], gates=[]))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--json")
    assert result.exit_code == 130
    assert one_json(result)["exit_code"] == 130


# --------------------------------------------------------------------------- tracebacks only with -v


def test_traceback_only_with_verbose_for_an_invalid_recipe(tmp_path):
    recipe = write(tmp_path / "bad.yaml", BAD_EPOCHS)
    quiet = invoke("validate", recipe)
    loud = invoke("validate", recipe, "-v")
    assert quiet.exit_code == loud.exit_code == 2
    assert "Traceback" not in quiet.output
    assert "Traceback" in loud.stderr
    assert "stages.0.epochs" in loud.stderr  # the message still follows the traceback


@pytest.mark.slow
def test_traceback_only_with_verbose_for_a_failing_stage(tmp_path, plugins):
    recipe = write(tmp_path / "r.yaml", no_train(stages=[{"type": "fail_stage"}], gates=[]))
    quiet = invoke("optimize", recipe, "--out", tmp_path / "runs")
    loud = invoke("optimize", recipe, "--out", tmp_path / "runs", "--verbose")
    assert quiet.exit_code == loud.exit_code == 4
    assert "Traceback" not in quiet.output
    assert "Traceback" in loud.stderr
    assert "RuntimeError: the fail stage broke on purpose" in loud.stderr


# --------------------------------------------------------------------------- --dry-run


def test_dry_run_runs_nothing(tmp_path):
    recipe = write(tmp_path / "r.yaml", tiny())
    out = tmp_path / "runs"
    result = invoke("optimize", recipe, "--out", out, "--dry-run")
    assert result.exit_code == 0, result.output
    assert "Nothing was run" in result.stdout
    assert not out.exists()

    result = invoke("optimize", recipe, "--out", out, "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    plan = one_json(result)["dry_run"]
    assert [s["name"] for s in plan["stages"]] == ["train", "evaluate", "export"]
    assert Path(plan["run_dir"]) == out / "tiny"
    assert not out.exists()


def test_dry_run_names_each_target_by_type_with_its_own_settings(tmp_path):
    """The plan printed `targets=[{}, {}]` (each target dumped without its defaults, its type among them)."""
    stages = [{"type": "export", "targets": ["onnx", {"type": "openvino", "required": True}], "latency": None}]
    result = invoke("optimize", write(tmp_path / "r.yaml", tiny(stages=stages, gates=[])), "--out", tmp_path / "runs", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "targets=[onnx, openvino(required=True)]" in result.stdout and "{}" not in result.stdout


def test_dry_run_checks_files(tmp_path):
    recipe = write(tmp_path / "r.yaml", tiny(model={"factory": "digits_cnn", "checkpoint": "missing.pt"}))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--dry-run")
    assert result.exit_code == 2
    line = recipe.read_text().splitlines().index("  checkpoint: missing.pt") + 1
    assert f"{recipe}:{line}  model.checkpoint  file not found: {tmp_path / 'missing.pt'}" in result.stderr


# --------------------------------------------------------------------------- schema, init, --version


def _consts(node) -> set:
    found = set()
    if isinstance(node, dict):
        if isinstance(node.get("const"), str):
            found.add(node["const"])
        found.update(v for v in node.get("enum", []) if isinstance(v, str))
        for value in node.values():
            found |= _consts(value)
    elif isinstance(node, list):
        for value in node:
            found |= _consts(value)
    return found


def test_schema_is_json_with_every_stage_type(tmp_path):
    result = invoke("schema")
    assert result.exit_code == 0, result.output
    schema = json.loads(result.stdout)
    assert schema["title"] == "pruneflow recipe"
    assert {"train", "evaluate", "export", "onnx"} <= _consts(schema)
    assert "stages" in schema["properties"]

    out = tmp_path / "recipe.schema.json"
    assert invoke("schema", "--out", out).exit_code == 0
    assert json.loads(out.read_text()) == schema


@pytest.mark.parametrize("command, gate_line", [("optimize", "1 a quality gate failed"), ("schema", None), ("init", None),
                                                ("validate", None), ("doctor", "1 a check will fail"),
                                                ("bench", "1 nothing meets --p99-budget-ms")])
def test_each_commands_help_lists_the_exit_codes_it_can_return(command, gate_line):
    """`schema --help` listed "1 a quality gate failed" (issue 42, item 8): each command now lists its own."""
    text = " ".join(invoke(command, "--help").stdout.split())
    assert "Exit codes: 0 ok" in text and "2 invalid recipe or usage" in text
    if gate_line is None:
        assert "quality gate" not in text and " 1 " not in text.partition("Exit codes:")[2]
    else:
        assert gate_line in text


def test_init_list_names_the_templates():
    result = invoke("init", "--list")
    assert result.exit_code == 0, result.output
    names = [line.split()[0] for line in result.stdout.splitlines() if line.strip()]
    assert "quickstart" in names and "resnet20-cifar10" in names


def test_init_writes_a_recipe_that_validates_and_refuses_to_overwrite(tmp_path):
    target = tmp_path / "sub" / "mine.yaml"
    result = invoke("init", "quickstart", target)
    assert result.exit_code == 0, result.output
    assert target.is_file()
    assert invoke("validate", target).exit_code == 0

    target.write_text("# my edits\n")
    result = invoke("init", "quickstart", target)
    assert result.exit_code == 2
    assert "--force" in result.stderr
    assert target.read_text() == "# my edits\n"

    result = invoke("init", "quickstart", target, "--force")
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(target.read_text())["name"] == "quickstart"


def test_init_writes_the_recipe_a_template_extends_beside_it(tmp_path):
    """resnet56-cifar10-int8 extends resnet56-cifar10-prune: the copy validates where it lands, and a base
    file the user already has there is kept."""
    target = tmp_path / "mine.yaml"
    result = invoke("init", "resnet56-cifar10-int8", target)
    assert result.exit_code == 0, result.output
    base = tmp_path / "resnet56-cifar10-prune.yaml"
    assert "also wrote" in result.stdout and base.is_file()
    assert invoke("validate", target).exit_code == 0
    base.write_text(base.read_text().replace("name: resnet56-cifar10-prune", "name: my-base"))
    result = invoke("init", "resnet56-cifar10-int8", tmp_path / "again.yaml")
    assert result.exit_code == 0 and "kept the existing" in result.stdout
    assert "name: my-base" in base.read_text()


def test_init_keeps_data_reached_through_a_link_reached_through_it(tmp_path):
    """../shared a link to /elsewhere/shared: the copy's path went through the link's target
    (../../../elsewhere/shared/...; new-user trial), which breaks when the link is pointed elsewhere."""
    from pruneflow.recipe.templates import relocate_paths

    (tmp_path / "elsewhere" / "shared" / "data").mkdir(parents=True)
    write(tmp_path / "elsewhere" / "shared" / "data" / "x.npz", "")
    (tmp_path / "shared").symlink_to(tmp_path / "elsewhere" / "shared")
    (tmp_path / "checkout" / "recipes").mkdir(parents=True)
    text, notes = relocate_paths("data: {train: ../../shared/data/x.npz}\n", tmp_path / "checkout" / "recipes",
                                 tmp_path / "checkout" / "new")
    assert text == "data: {train: ../../shared/data/x.npz}\n" and not notes  # from checkout/new, ../../shared is the link
    text, _ = relocate_paths("data: {train: ../../shared/data/x.npz}\n", tmp_path / "checkout" / "recipes",
                             tmp_path / "checkout" / "new" / "deeper")
    assert text == "data: {train: ../../../shared/data/x.npz}\n"


def test_init_unknown_template_exits_2(tmp_path):
    result = invoke("init", "quickstrat", tmp_path / "x.yaml")
    assert result.exit_code == 2
    assert "quickstart" in result.stderr
    assert not (tmp_path / "x.yaml").exists()


def test_version():
    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"pruneflow {__version__}"


def test_no_arguments_shows_help():
    result = runner.invoke(app, [])
    assert "optimize" in result.output and "validate" in result.output


# --------------------------------------------------------------------------- inspect


def test_inspect_a_zoo_model():
    result = invoke("inspect", "resnet20", "--json")
    assert result.exit_code == 0, result.output
    info = one_json(result)
    assert info["kind"] == "zoo model"
    assert info["totals"]["params"] == 269722
    assert info["input_shape"] == [3, 32, 32]

    table = invoke("inspect", "resnet20")
    assert table.exit_code == 0
    assert "total: params 269.72 k" in table.stdout


def test_inspect_a_run_directory_and_its_checkpoint(tiny_run):
    params = tiny_run.payload["stages"][0]["metrics"]["params"]
    for source in (tiny_run.run_dir, tiny_run.run_dir / "stages" / "01-train" / "model.pt"):
        result = invoke("inspect", source, "--json")
        assert result.exit_code == 0, result.output
        info = one_json(result)
        assert info["kind"] == "checkpoint stages/01-train/model.pt"
        assert info["totals"]["params"] == params
        assert info["input_shape"] == [1, 8, 8]


def test_inspect_an_onnx_file(tiny_run):
    result = invoke("inspect", tiny_run.run_dir / "export" / "onnx" / "model.fp32.onnx", "--json")
    assert result.exit_code == 0, result.output
    info = one_json(result)
    assert info["kind"] == "onnx"
    assert info["totals"]["opset"] == 17
    assert info["totals"]["nodes"] == sum(r["count"] for r in info["layers"]) > 0
    assert "batch" in info["totals"]["inputs"]


def test_inspect_an_openvino_ir(tiny_run, tmp_path):
    """`inspect model.int8.xml` was refused ("not a run directory, checkpoint, recipe, .onnx file…"; new-user trial)."""
    import openvino as ov

    xml = tmp_path / "model.xml"
    ov.save_model(ov.convert_model(str(tiny_run.run_dir / "export" / "onnx" / "model.fp32.onnx")), str(xml))
    result = invoke("inspect", xml, "--json")
    assert result.exit_code == 0, result.output
    info = one_json(result)
    assert info["kind"] == "openvino" and info["totals"]["nodes"] == sum(r["count"] for r in info["layers"]) > 0
    assert {"Convolution", "Parameter", "Result"} <= {r["op"] for r in info["layers"]}
    params = tiny_run.payload["stages"][0]["metrics"]["params"]  # OpenVINO folds the batch norms into the convolutions
    assert abs(info["totals"]["params"] - params) <= 0.05 * params
    xml.with_suffix(".bin").unlink()
    missing = invoke("inspect", xml)
    assert missing.exit_code == 2 and "model.bin does not exist" in missing.stderr, missing.output


def test_inspect_a_recipe(tiny_run):
    result = invoke("inspect", tiny_run.recipe, "--json")
    assert result.exit_code == 0, result.output
    info = one_json(result)
    assert info["kind"] == "recipe model"
    assert info["totals"]["params"] == tiny_run.payload["stages"][0]["metrics"]["params"]


@pytest.mark.parametrize("kind", ["name", "onnx-garbage", "onnx-missing", "pt-outside-run", "bad-shape"])
def test_inspect_garbage_exits_2(tmp_path, kind):
    if kind == "name":
        args = ["no_such_model"]
    elif kind == "onnx-garbage":
        args = [write(tmp_path / "junk.onnx", "not a model")]
    elif kind == "onnx-missing":
        args = [tmp_path / "missing.onnx"]
    elif kind == "pt-outside-run":
        args = [write(tmp_path / "junk.pt", "not a model")]
    else:
        args = ["resnet20", "--input-shape", "3,x,32"]
    result = invoke("inspect", *args)
    assert result.exit_code == 2, result.output
    assert "internal error" not in result.stderr
    assert "Traceback" not in result.output
    payload = one_json(invoke("inspect", *args, "--json"))
    assert payload["exit_code"] == 2


# --------------------------------------------------------------------------- --resume


@pytest.fixture
def resumable(tiny_run, tmp_path):
    """A copy of the shared run, so resuming (and re-running stages) leaves the original alone."""
    out = tmp_path / "runs"
    shutil.copytree(tiny_run.run_dir, out / "tiny")
    return out


def test_resume_skips_every_finished_stage(tiny_run, resumable):
    result = invoke("optimize", tiny_run.recipe, "--out", resumable, "--resume", "--json")
    assert result.exit_code == 0, result.output
    payload = one_json(result)
    assert [s["resumed"] for s in payload["stages"]] == [True, True, True]
    before = {a["path"]: a["sha256"] for a in tiny_run.payload["artifacts"]}
    after = {a["path"]: a["sha256"] for a in payload["artifacts"]}
    assert after == before
    run_dir = resumable / "tiny"
    for path, digest in before.items():
        assert sha_of(run_dir / path) == digest
    assert [s["metrics"] for s in payload["stages"]] == [s["metrics"] for s in tiny_run.payload["stages"]]
    data = manifest(run_dir)
    assert data["status"] == "complete"
    assert {a["path"] for a in data["artifacts"]} == set(before)


def test_resume_reruns_a_changed_stage_and_the_ones_after_it(tiny_run, resumable):
    result = invoke("optimize", tiny_run.recipe, "--out", resumable, "--resume", "--json",
                    "--set", "stages.1.split=train")
    assert result.exit_code == 0, result.output
    payload = one_json(result)
    assert [(s["name"], s["resumed"]) for s in payload["stages"]] == [
        ("train", True), ("evaluate", False), ("export", False)]
    assert payload["stages"][1]["metrics"]["samples"] == 300  # measured on the training split now
    checkpoint = next(a for a in payload["artifacts"] if a["path"] == "stages/01-train/model.pt")
    original = next(a for a in tiny_run.payload["artifacts"] if a["path"] == "stages/01-train/model.pt")
    assert checkpoint["sha256"] == original["sha256"]


def test_resume_reruns_a_stage_whose_file_changed(tiny_run, resumable):
    (resumable / "tiny" / "export" / "onnx" / "model.fp32.onnx").write_bytes(b"tampered")
    result = invoke("optimize", tiny_run.recipe, "--out", resumable, "--resume", "--json")
    assert result.exit_code == 0, result.output
    payload = one_json(result)
    assert [s["resumed"] for s in payload["stages"]] == [True, True, False]
    onnx = next(a for a in payload["artifacts"] if a["kind"] == "onnx")
    assert sha_of(resumable / "tiny" / onnx["path"]) == onnx["sha256"]


def test_without_resume_the_run_directory_is_replaced(tiny_run, resumable):
    result = invoke("optimize", tiny_run.recipe, "--out", resumable, "--json")
    assert result.exit_code == 0, result.output
    assert [s["resumed"] for s in one_json(result)["stages"]] == [False, False, False]


def sha_of(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.skipif(not (ROOT.parent / "shared" / "data").is_dir(), reason="needs ../shared/data beside the checkout")
def test_every_template_validates_where_init_writes_it(tmp_path):
    """`init` copied templates whose `../../shared/data/...` paths resolve only from recipes/; validate said ✓
    because it checked no file, and three shipped recipes needed a file made by hand first. Now the paths are
    rewritten for where the copy lands, validate checks them, and every template validates (issue 26)."""
    from pruneflow.recipe.templates import templates

    for name in sorted(templates()):  # none needs a step first: the click log is generated by the run itself
        target = tmp_path / name / "deeper" / f"{name}.yaml"
        target.parent.mkdir(parents=True)
        assert invoke("init", name, target).exit_code == 0
        result = invoke("validate", target)
        assert result.exit_code == 0, (name, result.output)


@pytest.mark.skipif(not (ROOT.parent / "shared" / "data").is_dir(), reason="needs ../shared/data beside the checkout")
def test_init_writes_paths_relative_to_where_the_copy_lands_never_absolute(tmp_path):
    """A copy written outside the checkout's tree got absolute resolved paths (/work/shared/data/...), so it could not
    be committed and used elsewhere (issue 42, item 8): every path is now relative to the copy's folder."""
    import yaml

    target = tmp_path / "elsewhere" / "new" / "resnet20-cifar10.yaml"
    assert invoke("init", "resnet20-cifar10", target).exit_code == 0
    recipe = yaml.safe_load(target.read_text())
    paths = [recipe["model"]["checkpoint"], recipe["data"]["train"], recipe["data"]["eval"]]
    assert all(not Path(p).is_absolute() and p.startswith("../") for p in paths), paths
    assert all((target.parent / p).resolve().is_file() for p in paths)
    assert invoke("validate", target).exit_code == 0


@pytest.mark.parametrize("command", ["validate", "doctor"])
def test_validate_and_doctor_list_every_missing_file_each_at_its_line(tmp_path, command):
    """`doctor` reported only the first of three missing files; `validate` checked none (issue 26)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: m\nmodel: {factory: nope.py:build, checkpoint: missing.pt}\ndata: {format: npz, path: gone.npz}\n"
                      "stages:\n  - {type: train, epochs: 1}\n"
                      "  - {type: calibrate, size: 8, source: {path: requests.jsonl, format: jsonl}}\n")
    result = invoke(command, recipe)
    assert result.exit_code == 2, result.output
    for line, key in ((2, "model.checkpoint"), (2, "model.factory"), (3, "data.path"), (6, "stages.1.source.path")):
        assert f"{recipe}:{line}  {key}" in result.stderr, result.stderr
    assert "4 problems" in result.stderr


@pytest.mark.slow  # a subprocess whose stdout a reader closes early (~3 s)
def test_a_reader_closing_the_pipe_early_is_not_an_error():
    """`pruneflow validate R | head -1` exited 4, "code run by pruneflow called sys.exit(1)": rich's broken-pipe
    handling raised SystemExit, which the CLI took for user code exiting."""
    import subprocess
    import sys

    done = subprocess.run(f"'{sys.executable}' -m pruneflow init --list | head -1", shell=True, cwd=ROOT, text=True,
                          capture_output=True, executable="/bin/bash")
    assert done.stdout.count("\n") == 1 and "error" not in done.stderr and "sys.exit" not in done.stderr, done.stderr
    status = subprocess.run(f"'{sys.executable}' -m pruneflow init --list | head -1 >/dev/null; echo ${{PIPESTATUS[0]}}",
                            shell=True, cwd=ROOT, text=True, capture_output=True, executable="/bin/bash")
    assert status.stdout.strip() == "0", status.stderr
    # a plain print (schema's JSON) met the closed pipe as BrokenPipeError: "internal error", exit 4 (new-user trial)
    schema = subprocess.run(f"'{sys.executable}' -m pruneflow schema | head -c 10 >/dev/null; echo ${{PIPESTATUS[0]}}",
                            shell=True, cwd=ROOT, text=True, capture_output=True, executable="/bin/bash")
    assert schema.stdout.strip() == "0" and "internal error" not in schema.stderr, schema.stderr


@pytest.mark.parametrize("command", ["optimize", "validate", "doctor", "schema", "init", "calibrate", "inspect", "bench"])
def test_help_shows_placeholders_not_python_types(command):
    """`--help` printed typer's annotations as placeholders: `--resume <bool>`, `--set <list[str]>` (issue 26)."""
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, [command, "--help"])
    assert result.exit_code == 0
    assert not [w for w in result.output.split() if w.startswith("<") and w.endswith(">")], result.output


def test_shell_completion_is_offered():
    """`pruneflow --install-completion` was "No such option" (issue 26)."""
    assert "--install-completion" in CliRunner(env={"COLUMNS": "200"}).invoke(app, ["--help"]).output


@pytest.mark.slow  # a subprocess, as a shell runs it (typer's completion reads the process's own environment)
def test_the_completion_script_is_printed_for_bash():
    import subprocess
    import sys

    entry = Path(sys.executable).with_name("pruneflow")  # the console script, as a user types it
    # typer finds the shell from the parent processes (shellingham), which under nohup or a CI runner is none:
    # its own test switch makes --show-completion take the shell's name instead, as a user's bash would be found
    env = {**os.environ, "_TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION": "1"}
    done = subprocess.run([str(entry), "--show-completion", "bash"], cwd=ROOT, text=True, capture_output=True, timeout=120,
                          env=env)
    assert done.returncode == 0 and "complete -o default -F _pruneflow_completion pruneflow" in done.stdout, done.stderr


def test_inspect_prints_every_share_of_macs_with_one_decimal():
    """`inspect`'s `macs %` column read `1.1000`, `0.0000`, `97.3` (issue 26)."""
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["inspect", "digits_cnn"])
    assert result.exit_code == 0, result.output
    shares = [ln.split("│")[-2].strip() for ln in result.output.splitlines() if ln.startswith("│")]
    assert shares and all(s.count(".") == 1 and len(s.split(".")[1]) == 1 for s in shares), shares


def test_a_model_that_does_not_fit_its_checkpoint_or_the_data_is_reported_at_its_recipe_line(tmp_path):
    """A wrong checkpoint ("22 missing ...; 97 unexpected") and a class count other than the data's came without the
    FILE:LINE the README promises (issue 26)."""
    import torch

    from pruneflow.zoo import ZOO

    torch.save(ZOO["digits_cnn"].factory(width=4).state_dict(), tmp_path / "other.pt")
    cases = {"model.checkpoint": {"factory": "digits_cnn", "kwargs": {"width": 8}, "checkpoint": "other.pt"},
             "model.kwargs": {"factory": "digits_cnn", "kwargs": {"width": 8, "num_classes": 5}}}
    for key, model in cases.items():
        recipe = write(tmp_path / f"{key}.yaml", tiny_recipe_dict(model=model))
        result = invoke("optimize", recipe, "--out", tmp_path / "runs")
        line = next(i for i, text in enumerate(recipe.read_text().splitlines(), 1) if key.split(".")[1] in text)
        assert result.exit_code == 2 and f"{recipe}:{line}  {key}" in result.stderr, result.stderr
        assert not (tmp_path / "runs").exists()


def test_the_fix_for_a_missing_file_says_where_a_relative_path_was_resolved(tmp_path, monkeypatch):
    """A path given with --set is resolved against the working directory, yet the fix said "relative to the recipe
    file" (issue 26)."""
    recipe = write(tmp_path / "sub" / "r.yaml", tiny_recipe_dict(model={"factory": "digits_cnn", "checkpoint": "w.pt"}))
    monkeypatch.chdir(tmp_path)
    written = invoke("validate", recipe)
    assert written.exit_code == 2 and f"relative to the recipe file that sets it ({recipe})" in written.stderr
    given = invoke("validate", recipe, "--set", "model.checkpoint=w2.pt")
    assert given.exit_code == 2 and f"given with --set is relative to the working directory ({tmp_path})" in given.stderr


def test_a_required_toolchain_that_is_absent_is_exit_3_at_the_stage_that_asks_for_it(tmp_path, plugins):
    """`validate` exits 3 for a `required: true` target without its toolchain, naming the recipe line (issue 26)."""
    recipe = write(tmp_path / "r.yaml", no_train(stages=[{"type": "evaluate"}, {"type": "export", "targets": ["fake"]}]))
    result = invoke("validate", recipe)
    line = next(i for i, text in enumerate(recipe.read_text().splitlines(), 1) if "type: export" in text)
    assert result.exit_code == 3 and f"{recipe}:{line}  stages.1 (export)" in result.stderr, result.stderr
