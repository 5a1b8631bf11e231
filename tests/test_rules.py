"""Recipe rules (pruneflow/recipe/rules.py and each stage's ``recipe_rules``): caught by `pruneflow validate`
with FILE:LINE before anything runs; rules that need the model or data raise ConfigError, which a run reports
at its FILE:LINE too; and one spelling of key paths in every message."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

import pytest
import yaml
from pydantic import Field
from typer.testing import CliRunner

from pruneflow.cli import app
from pruneflow import registry
from pruneflow.errors import ConfigError, RecipeError
from pruneflow.pipeline import plan_stages
from pruneflow.recipe import load_recipe
from pruneflow.recipe.models import recipe_model, target_union
from pruneflow.recipe.rules import stage_ids
from pruneflow.stage import Stage, StageConfig, StageResult, Target, TargetConfig

from conftest import REPO, tiny_recipe_dict

runner = CliRunner(env={"FORCE_COLOR": None, "COLUMNS": "250"})


def write(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def line_of(path: Path, text: str, after: str | None = None) -> int:
    """1-based number of the first line of ``path`` equal to ``text`` (after the line equal to ``after``)."""
    lines = path.read_text().splitlines()
    start = lines.index(after) + 1 if after else 0
    return lines.index(text, start) + 1


def validate(path: Path, *args: str):
    result = runner.invoke(app, ["validate", str(path), *args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def _clear_caches() -> None:
    recipe_model.cache_clear()
    target_union.cache_clear()


# --------------------------------------------------------------------------- test-only plugins


class FakeTargetConfig(TargetConfig):
    type: Literal["fake"] = Field("fake", description="A target that writes fp32 only.")


class FakeTarget(Target):
    Config = FakeTargetConfig
    precisions = ("fp32",)


class PickyConfig(StageConfig):
    type: Literal["picky"] = Field("picky", description="Refuses its `x` once the model is there.")
    x: int = Field(3, description="A setting the model does not accept.")


class PickyStage(Stage):
    """A rule that needs the model: raised at run time, at the stage's own key."""

    Config = PickyConfig

    def run(self, state, ctx) -> StageResult:
        raise ConfigError(self.loc("x"), f"the model has {sum(1 for _ in state.model.children())} children, fewer than x",
                          value=self.config.x, hint="lower x")


def _registered(reg, name: str, obj):
    """``obj`` registered for one test, the recipe model's caches cleared around it."""
    _clear_caches()
    with reg.registered(name, obj):
        _clear_caches()
        yield
    _clear_caches()


@pytest.fixture
def fake_target():
    yield from _registered(registry.targets, "fake", FakeTarget)


@pytest.fixture
def picky_stage():
    yield from _registered(registry.stages, "picky", PickyStage)


# --------------------------------------------------------------------------- rules that need only the recipe


def test_a_precision_the_target_cannot_write_is_refused_with_file_and_line(tmp_path, fake_target):
    recipe = tiny_recipe_dict()
    recipe["stages"][2] = {"type": "export", "targets": ["onnx", "fake"], "precisions": ["fp32", "fp16"]}
    path = write(tmp_path / "r.yaml", recipe)
    result = validate(path)
    assert result.exit_code == 2, result.output
    line = line_of(path, "  - fp16")
    assert f"{path}:{line}  stages.2.precisions.1  'fp16'  target 'fake' cannot write fp16" in result.stderr
    assert "fake writes fp32" in result.stderr
    assert "onnx" not in result.stderr.split("cannot write")[0].splitlines()[-1]  # onnx writes fp16: not flagged


def test_int8_without_a_quantizing_stage_is_refused_with_file_and_line(tmp_path):
    recipe = tiny_recipe_dict()
    recipe["stages"][2]["precisions"] = ["fp32", "int8"]
    path = write(tmp_path / "r.yaml", recipe)
    result = validate(path)
    assert result.exit_code == 2, result.output
    line = line_of(path, "  - int8")
    assert f"{path}:{line}  stages.2.precisions.1  'int8'  int8 needs a quantized model" in result.stderr
    assert "`ptq` stage" in result.stderr


def test_int8_after_a_qat_stage_ending_in_fp16_is_refused_and_after_int8_accepted(tmp_path):
    recipe = tiny_recipe_dict()
    recipe["stages"][1:1] = [{"type": "qat", "schedule": [{"precision": "fp32"}, {"precision": "fp16"}]}]
    recipe["stages"][3]["precisions"] = ["int8"]
    path = write(tmp_path / "r.yaml", recipe)
    result = validate(path)
    assert result.exit_code == 2, result.output
    assert f"{path}:{line_of(path, '  - int8')}  stages.3.precisions.0  'int8'  int8 needs a quantized model" in result.stderr

    ok = validate(path, "--set", "stages.1.schedule=[{precision: fp16}, {precision: int8}]")
    assert ok.exit_code == 0, ok.output
    ptq = validate(path, "--set", "stages.1={type: ptq}")
    assert ptq.exit_code == 0, ptq.output


def test_two_stages_with_one_name_are_refused_at_the_second(tmp_path):
    recipe = tiny_recipe_dict()
    recipe["stages"][1]["name"] = "train"
    path = write(tmp_path / "r.yaml", recipe)
    result = validate(path)
    assert result.exit_code == 2, result.output
    line = line_of(path, "  name: train")
    assert f"{path}:{line}  stages.1.name  'train' is used by two stages (stages.0 and this one)" in result.stderr


def test_a_default_name_colliding_with_a_given_one_points_at_the_unnamed_stage(tmp_path):
    recipe = tiny_recipe_dict()
    recipe["stages"][0]["name"] = "evaluate"  # the train stage takes the name the evaluate stage would get
    path = write(tmp_path / "r.yaml", recipe)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    [issue] = err.value.issues
    assert issue.path == "stages.1.name" and issue.line == line_of(path, "- type: evaluate")  # no name key: the stage


def test_split_train_without_training_data_is_refused_for_evaluate_and_calibrate(tmp_path):
    recipe = tiny_recipe_dict(data={"format": "npz", "eval": "eval.npz"})
    recipe["stages"] = [{"type": "calibrate", "size": 8}, {"type": "evaluate", "split": "train"}]
    path = write(tmp_path / "r.yaml", recipe)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    found = {i.path: i for i in err.value.issues}
    assert set(found) == {"stages.0.split", "stages.1.split"}
    assert found["stages.0.split"].line == line_of(path, "- type: calibrate")  # the default split: the stage's line
    assert found["stages.1.split"].line == line_of(path, "  split: train")
    assert all("no train split" in i.message for i in found.values())


def test_stratifying_the_recipe_data_by_another_column_is_refused(tmp_path):
    recipe = tiny_recipe_dict()
    recipe["stages"] = [{"type": "calibrate", "strategy": "stratified", "by": "region"}]
    path = write(tmp_path / "r.yaml", recipe)
    result = validate(path)
    assert result.exit_code == 2, result.output
    assert f"{path}:{line_of(path, '  by: region')}  stages.0.by  'region'  only the label can stratify" in result.stderr


def test_a_gate_naming_no_stage_or_target_is_refused_with_did_you_mean(tmp_path):
    recipe = tiny_recipe_dict(gates=[{"metric": "evalute.accuracy", "min": 0.5},
                                     {"metric": "onnx.fp32.accuracy", "baseline": "evaluate.accuracy", "max_drop": 0.01},
                                     {"metric": "evaluate.no_such_metric", "min": 0.0}])
    path = write(tmp_path / "r.yaml", recipe)
    result = validate(path)
    assert result.exit_code == 2, result.output
    line = line_of(path, "- metric: evalute.accuracy")
    assert f"{path}:{line}  gates.0.metric  'evalute.accuracy'  names no stage or export target" in result.stderr
    assert "did you mean 'evaluate'?" in result.stderr
    # A target of the `export` stage is a valid start; the evaluate stage lists what it records (issue 41).
    line = line_of(path, "- metric: evaluate.no_such_metric")
    assert f"{path}:{line}  gates.2.metric  'evaluate.no_such_metric'  stage 'evaluate' records no metric" in result.stderr
    assert "the evaluate stage records: accuracy, loss, samples, macs, params" in result.stderr
    assert "2 problems in the recipe" in result.stderr


@pytest.mark.parametrize("metric, says", [
    ("evaluate.acuracy", "stage 'evaluate' records no metric 'acuracy'; did you mean 'accuracy'?"),
    ("train.train_los", "stage 'train' records no metric 'train_los'; did you mean 'train_loss'?"),
    ("onnx.fp32.acuracy", "'acuracy' looks like a misspelt metric"),
    ("onnx.int8.lateny_b1_median_ms", "did you mean 'latency'?"),
])
def test_a_typod_gate_metric_is_exit_2_at_validate_not_a_failed_gate_after_the_run(tmp_path, metric, says):
    """`evaluate.acuracy` failed only after the whole run, as a gate the run never produced (exit 1; issue 41)."""
    path = write(tmp_path / "r.yaml", _writing_int8(tiny_recipe_dict(gates=[{"metric": metric, "min": 0.5}])))
    result = validate(path)
    assert result.exit_code == 2 and f"gates.0.metric  {metric!r}" in result.stderr and says in result.stderr, result.output


@pytest.mark.parametrize("metric", ["evaluate.accuracy", "train.train_accuracy", "evaluate.macs", "onnx.fp32.accuracy",
                                    "onnx.int8.latency_b32_median_ms", "onnx.int8.speedup_b32", "onnx.fp32.size_mb",
                                    "onnx.int8.agreement_fp32", "onnx.int8.top1_agreement"])
def test_a_gate_metric_a_stage_records_is_accepted(tmp_path, metric):
    recipe = _writing_int8(tiny_recipe_dict(gates=[{"metric": metric, "min": 0.0}]))
    assert validate(write(tmp_path / "r.yaml", recipe)).exit_code == 0


def _writing_int8(recipe: dict) -> dict:
    """``recipe`` (the tiny one) quantized by PTQ and exporting fp32 and int8."""
    *before, export = recipe["stages"]
    recipe["stages"] = [*before, {"type": "ptq"}, {**export, "precisions": ["fp32", "int8"]}]
    return recipe


@pytest.mark.parametrize("metric, quantized, says", [
    ("onnx.int9.accuracy", True, "target 'onnx' writes no int9 artifact in this recipe; did you mean 'int8'?"),
    ("onnx.int8.accuracy", False, "target 'onnx' writes no int8 artifact in this recipe"),  # nothing quantizes it
    ("onnx.fp16.accuracy", True, "target 'onnx' writes no fp16 artifact in this recipe"),  # the stage names fp32, int8
])
def test_a_gate_on_a_precision_the_export_does_not_write_is_exit_2_at_validate(tmp_path, metric, quantized, says):
    """`onnx.int9.accuracy` passed validate, then the whole run, then failed as a gate never produced (exit 1): in CI
    that reads as a quality regression (found by a new-user trial)."""
    recipe = tiny_recipe_dict(gates=[{"metric": metric, "min": 0.5}])
    result = validate(write(tmp_path / "r.yaml", _writing_int8(recipe) if quantized else recipe))
    assert result.exit_code == 2 and f"gates.0.metric  {metric!r}" in result.stderr and says in result.stderr, result.output
    assert "with a precision it writes here: fp32" in result.stderr


def test_every_problem_is_reported_at_once_in_line_order(tmp_path):
    recipe = tiny_recipe_dict(gates=[{"metric": "nope.accuracy", "min": 0.5}])
    recipe["stages"][1]["name"] = "train"
    recipe["stages"][2]["precisions"] = ["int8"]
    path = write(tmp_path / "r.yaml", recipe)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert [i.path for i in err.value.issues] == ["stages.1.name", "stages.2.precisions.0", "gates.0.metric"]
    assert [i.line for i in err.value.issues] == sorted(i.line for i in err.value.issues)
    assert err.value.message.endswith("3 problems in the recipe")
    assert all(f"{i.path}: " in err.value.hint for i in err.value.issues)  # each fix named by its key


def test_a_rule_problem_set_by_set_points_at_the_option(tmp_path):
    path = write(tmp_path / "r.yaml", tiny_recipe_dict())
    result = validate(path, "--set", "stages.2.precisions=[int8]")
    assert result.exit_code == 2
    assert "--set stages.2.precisions=[int8]  stages.2.precisions.0  'int8'  int8 needs" in result.stderr


def test_dry_run_catches_a_rule_before_touching_the_output(tmp_path):
    recipe = tiny_recipe_dict()
    recipe["stages"][2]["precisions"] = ["int8"]
    path = write(tmp_path / "r.yaml", recipe)
    result = runner.invoke(app, ["optimize", str(path), "--out", str(tmp_path / "runs"), "--dry-run", "--json"])
    assert result.exit_code == 2
    [issue] = json.loads(result.stdout)["error"]["issues"]
    assert (issue["file"], issue["line"], issue["path"]) == (str(path), line_of(path, "  - int8"), "stages.2.precisions.0")
    assert "ptq" in issue["hint"]
    assert not (tmp_path / "runs").exists()


def test_plan_stages_uses_the_ids_the_rules_checked():
    loaded = load_recipe(REPO / "recipes" / "quickstart.yaml")
    assert [s.id for s in plan_stages(loaded)] == stage_ids(loaded.recipe.stages)
    configs = [StageConfig(type="evaluate"), StageConfig(type="train"), StageConfig(type="evaluate"),
               StageConfig(type="evaluate", name="last")]
    assert stage_ids(configs) == ["evaluate", "train", "evaluate-2", "last"]


def test_quantizes_is_decided_by_the_config():
    ptq, qat = registry.stages.get("ptq"), registry.stages.get("qat")
    assert ptq.quantizes(ptq.Config())
    assert qat.quantizes(qat.Config(schedule=[{"precision": "fp32"}, {"precision": "int8"}]))
    assert not qat.quantizes(qat.Config(schedule=[{"precision": "fp32"}, {"precision": "fp16"}]))
    assert not registry.stages.get("train").quantizes(registry.stages.get("train").Config())


# --------------------------------------------------------------------------- rules that need the model or data


@pytest.mark.slow
def test_a_stage_config_error_at_run_time_names_file_and_line(tmp_path, picky_stage):
    recipe = tiny_recipe_dict(stages=[{"type": "evaluate"}, {"type": "picky", "x": 99}])
    path = write(tmp_path / "r.yaml", recipe)
    out = tmp_path / "runs"
    result = runner.invoke(app, ["optimize", str(path), "--out", str(out)])
    assert result.exit_code == 2, result.output
    line = line_of(path, "  x: 99")
    assert f"{path}:{line}  stages.1.x  99  the model has" in result.stderr
    assert "Fix: lower x" in result.stderr
    assert json.loads((out / "tiny" / "manifest.json").read_text())["status"] == "failed"

    as_json = runner.invoke(app, ["optimize", str(path), "--out", str(out), "--json"])
    assert as_json.exit_code == 2
    error = json.loads(as_json.stdout)["error"]
    assert error["type"] == "RecipeError"
    [issue] = error["issues"]
    assert (issue["file"], issue["line"], issue["path"], issue["value"]) == (str(path), line, "stages.1.x", 99)


@pytest.mark.slow
def test_a_run_time_config_error_on_a_default_points_at_the_stage(tmp_path, picky_stage):
    path = write(tmp_path / "r.yaml", tiny_recipe_dict(stages=[{"type": "picky"}]))
    with pytest.raises(RecipeError) as err:
        from pruneflow.pipeline import run_recipe

        run_recipe(load_recipe(path), out=tmp_path / "runs")
    [issue] = err.value.issues
    assert (issue.path, issue.line, issue.value) == ("stages.0.x", line_of(path, "- type: picky"), 3)
    assert isinstance(err.value.__cause__, ConfigError)  # -v shows where the stage raised it


def test_a_missing_calibration_source_is_located_by_the_dry_run(tmp_path):
    recipe = tiny_recipe_dict(stages=[{"type": "calibrate", "source": {"format": "jsonl", "path": "logs.jsonl"}}])
    path = write(tmp_path / "r.yaml", recipe)
    result = runner.invoke(app, ["optimize", str(path), "--out", str(tmp_path / "runs"), "--dry-run"])
    assert result.exit_code == 2, result.output
    line = line_of(path, "    path: logs.jsonl")
    assert f"{path}:{line}  stages.0.source.path  file not found: {tmp_path / 'logs.jsonl'}" in result.stderr


@pytest.mark.slow
def test_a_calibration_helper_error_is_located_under_the_stage(tmp_path):
    from pruneflow.pipeline import run_recipe

    (tmp_path / "logs.jsonl").write_text("".join(json.dumps({"input": [i, i + 1.0]}) + "\n" for i in range(20)))
    recipe = tiny_recipe_dict(stages=[{"type": "calibrate", "size": 4, "strategy": "stratified",
                                       "source": {"format": "jsonl", "path": "logs.jsonl"}}])
    path = write(tmp_path / "r.yaml", recipe)
    with pytest.raises(RecipeError) as err:
        run_recipe(load_recipe(path), out=tmp_path / "runs")
    [issue] = err.value.issues
    assert issue.path == "stages.0.by" and "no labels to stratify by" in issue.message
    assert issue.line == line_of(path, "- type: calibrate")  # `by` is a default: the stage's line


def test_the_calibrate_command_names_its_own_option_not_a_recipe_key(tmp_path):
    (tmp_path / "logs.jsonl").write_text("".join(json.dumps({"input": [i, i + 1.0]}) + "\n" for i in range(20)))
    args = ["calibrate", str(tmp_path / "logs.jsonl"), "--out", str(tmp_path / "c"), "--size", "4"]
    unlabelled = runner.invoke(app, [*args, "--strategy", "stratified"])
    assert unlabelled.exit_code == 2
    assert "usage error: --by: the source has no labels to stratify by" in unlabelled.stderr
    unknown = runner.invoke(app, [*args, "--strategy", "best"])
    assert unknown.exit_code == 2 and "usage error: --strategy: unknown strategy 'best'" in unknown.stderr


def test_config_error_under_prefixes_the_key_path():
    inner = ConfigError(("by",), "no labels", value="label", hint="name a column")
    outer = inner.under("stages", 2)
    assert (outer.loc, outer.detail, outer.value, outer.hint) == (("stages", 2, "by"), "no labels", "label", "name a column")
    assert str(outer).startswith("stages.2.by: no labels")


def test_locate_falls_back_to_the_nearest_written_parent(tmp_path):
    loaded = load_recipe(write(tmp_path / "r.yaml", tiny_recipe_dict()), ["stages.1.split=eval"])
    assert loaded.locate(("stages", 2, "targets", 0)) == (str(tmp_path / "r.yaml"), line_of(tmp_path / "r.yaml", "  - onnx"))
    assert loaded.locate(("stages", 2, "parity", "samples")) == loaded.locate(("stages", 2))
    assert loaded.locate(("stages", 1, "split")) == ("--set stages.1.split=eval", None)
    assert loaded.locate(("nowhere",)) == (str(tmp_path / "r.yaml"), 1)


# --------------------------------------------------------------------------- one spelling of key paths

# A message that starts with a hand-typed key path (`f"stages.{self.index}.fade: ..."`, `"qat.ignore: ..."`)
# cannot be located and drifts from the real path; raise ConfigError(self.loc("fade"), ...) instead.
HAND_TYPED = re.compile(r"""(?<!\w)f?["'](stages\.\{|prune\.|qat\.|calibrate\.)""")


def test_no_message_hand_types_a_recipe_key_path():
    offenders = []
    for folder in ("pruneflow", "qat", "calibrate"):
        for file in sorted((REPO / folder).rglob("*.py")):
            rel = file.relative_to(REPO).as_posix()
            for number, text in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
                if HAND_TYPED.search(text):
                    offenders.append(f"{rel}:{number}: {text.strip()}")
    assert not offenders, "\n".join(offenders)
    assert HAND_TYPED.search('raise InputError(f"stages.{self.index}.fade: no")')  # the pattern itself works
    assert HAND_TYPED.search('raise InputError("qat.ignore: bad")')
