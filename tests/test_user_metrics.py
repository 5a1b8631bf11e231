"""Metrics of your own from the recipe (issue 42, item 4): `metrics: [my_metrics.py:f1_score]`, a function of the outputs
and labels with a declared direction, found and checked as a model factory is, judged wherever the task's own metrics
are: gates, sensitivity, report.md, --json and bench."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

import pruneflow
from conftest import invoke, tiny_recipe_dict, write
from pruneflow.errors import ConfigError, RecipeError, StageError
from pruneflow.recipe import load_recipe
from pruneflow.tasks import MetricState, make_task, with_user_metrics
from pruneflow.tasks.user import UserMetric

METRICS = '''
import numpy as np
import pruneflow


@pruneflow.metric(higher_is_better=True)
def f1_score(outputs, labels):
    """Macro F1 over the classes present."""
    pred = outputs.argmax(1)
    scores = []
    for c in np.unique(labels):
        tp = np.sum((pred == c) & (labels == c))
        scores.append(2 * tp / max(2 * tp + np.sum((pred == c) & (labels != c)) + np.sum((pred != c) & (labels == c)), 1))
    return float(np.mean(scores))


def errors(outputs, labels):
    return float(np.sum(outputs.argmax(1) != labels))


def broken(outputs, labels):
    raise ValueError("no labels like these")


def not_a_number(outputs, labels):
    return "high"
'''


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    write(tmp_path / "my_metrics.py", METRICS)
    return tmp_path


def recipe(folder: Path, metrics: list, **extra) -> Path:
    return write(folder / "r.yaml", tiny_recipe_dict(metrics=metrics, **extra))


# --------------------------------------------------------------------------- validate: found as a factory is


def test_a_declared_function_validates_without_running_any_of_its_code(folder):
    write(folder / "my_metrics.py", METRICS + "\nopen(__file__ + '.RAN', 'w').close()\n")
    result = invoke("validate", recipe(folder, ["my_metrics.py:f1_score", {"fn": "my_metrics.py:errors",
                                                                        "higher_is_better": False}]))
    assert result.exit_code == 0, result.output
    assert not (folder / "my_metrics.py.RAN").exists()
    loaded = load_recipe(folder / "r.yaml")
    assert [m.figure for m in loaded.recipe.metrics] == ["f1_score", "errors"]
    assert loaded.recipe.metrics[0].fn == f"{folder / 'my_metrics.py'}:f1_score"  # relative to the recipe, as a factory


@pytest.mark.parametrize("metrics, where, words", [
    (["my_metrics.py:errors"], "metrics.0.fn", "its direction is not declared"),
    (["my_metrics.py:f1_scor"], "metrics.0.fn", "did you mean 'f1_score'?"),
    (["missing.py:f1_score"], "metrics.0.fn", "file not found"),
    (["f1_score"], "metrics.0.fn", "is not `path/to/file.py:function`"),
    ([{"fn": "my_metrics.py:errors", "higher_is_better": False, "name": "accuracy"}], "metrics.0", "already records"),
    (["my_metrics.py:f1_score", {"fn": "my_metrics.py:errors", "higher_is_better": False, "name": "f1_score"}],
     "metrics.1", "is the name of metrics.0 too"),
    ([{"fn": "my_metrics.py:f1_score", "headline": True}, {"fn": "my_metrics.py:errors", "higher_is_better": False,
                                                           "headline": True}], "metrics.1.headline", "the headline already"),
    ([{"fn": "os:getcwd", "higher_is_better": True}], "metrics.0.fn", "standard library"),
])
def test_a_wrong_metric_is_exit_2_at_its_line(folder, metrics, where, words):
    result = invoke("validate", recipe(folder, metrics))
    assert result.exit_code == 2, result.output
    line = next(ln for ln in result.stderr.splitlines() if f"  {where}  " in ln)
    assert "r.yaml:" in line and words in result.stderr, result.stderr


# --------------------------------------------------------------------------- the task judges with them


def _task(folder: Path, metrics: list) -> pruneflow.tasks.Task:
    from pruneflow.user_metrics import recipe_task

    return recipe_task(load_recipe(recipe(folder, metrics)).recipe)


def test_the_task_computes_them_beside_its_own(folder):
    task = _task(folder, ["my_metrics.py:f1_score", {"fn": "my_metrics.py:errors", "higher_is_better": False}])
    state = MetricState()
    logits, labels = torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]]), torch.tensor([0, 1, 1])
    task.update(state, logits[:2], labels[:2])
    task.update(state, logits[2:], labels[2:])  # over the whole split, not per batch
    figures = task.compute(state)
    assert figures["accuracy"] == pytest.approx(2 / 3) and figures["errors"] == 1.0
    assert figures["f1_score"] == pytest.approx((2 / 3 + 2 / 3) / 2)
    assert not task.metric("onnx.int8.errors").higher_is_better and task.metric("qat.f1_score_fp32").higher_is_better
    assert task.summary()["metrics"]["f1_score"] == "higher" and "errors" in task.summary()["user_metrics"]
    assert task.headline_name == "accuracy"
    trained = task.for_training(label_smoothing=0.1)  # a new task for training: the metrics go with it
    assert trained is not task and "f1_score" in [m.name for m in trained.metrics]


def test_headline_true_makes_it_the_runs_headline(folder):
    task = _task(folder, [{"fn": "my_metrics.py:f1_score", "headline": True}])
    assert task.headline_name == "f1_score" and task.headline.higher_is_better
    assert task.summary()["headline"] == "f1_score"


def test_the_direction_in_the_recipe_and_the_function_must_agree(folder):
    with pytest.raises(ConfigError, match="declares higher_is_better=True"):
        _task(folder, [{"fn": "my_metrics.py:f1_score", "higher_is_better": False}])


def test_a_metric_that_raises_or_returns_no_number_says_which(folder):
    task = with_user_metrics(make_task("classification"), [
        UserMetric("broken", lambda o, y: 1 / 0, True, source="m.py:broken"),
    ])
    state = MetricState()
    task.update(state, torch.zeros(2, 3), torch.tensor([0, 1]))
    with pytest.raises(StageError, match="metric 'broken' \\(m.py:broken\\) raised ZeroDivisionError"):
        task.compute(state)
    nan = with_user_metrics(make_task("classification"), [UserMetric("nan", lambda o, y: "high", True, source="m.py:nan")])
    nan.update(state := MetricState(), torch.zeros(2, 3), torch.tensor([0, 1]))
    with pytest.raises(StageError, match="returned 'high', not a finite number"):
        nan.compute(state)


def test_a_metric_failing_on_the_first_batch_stops_the_run_before_any_stage(folder):
    """Checked when the data and model load (preflight), at the metric's line: not an hour into the run."""
    from pruneflow.pipeline import plan_stages
    from pruneflow.prepare import load_inputs
    from pruneflow.context import Reporter

    loaded = load_recipe(recipe(folder, [{"fn": "my_metrics.py:broken", "higher_is_better": True}]))
    with pytest.raises(RecipeError) as caught:
        with loaded.locating():
            load_inputs(loaded, plan_stages(loaded), Reporter())
    issue = caught.value.issues[0]
    assert issue.path == "metrics.0.fn" and issue.line is not None and "no labels like these" in issue.message


# --------------------------------------------------------------------------- a whole run


@pytest.mark.slow  # the tiny recipe through PTQ with sensitivity and an export, then bench (~30 s)
def test_a_metric_from_the_recipe_gates_a_run_and_shows_in_the_report_json_and_bench(folder):
    stages = [{"type": "train", "epochs": 2, "batch_size": 32, "lr": 0.05},
              {"type": "calibrate", "size": 64},
              {"type": "ptq", "sensitivity": {"metric": "f1_score", "max_drop": 1.0, "samples": 64}},
              {"type": "export", "targets": ["onnx"], "precisions": ["fp32", "int8"], "latency": None}]
    gates = [{"metric": "onnx.int8.f1_score", "baseline": "train.f1_score", "max_drop": 0.05},
             {"metric": "onnx.int8.f1_score", "min": 1.01}]  # the second cannot hold: the run says so, exit 1
    path = recipe(folder, [{"fn": "my_metrics.py:f1_score", "headline": True}], stages=stages, gates=gates)
    result = invoke("optimize", path, "--out", folder / "runs", "--json")
    assert result.exit_code == 1, result.output
    out = json.loads(result.stdout)
    assert out["task"]["headline"] == "f1_score" and "f1_score" in out["task"]["user_metrics"]
    by_name = {g["name"]: g for g in out["gates"]}
    failed = [g for g in out["gates"] if not g["passed"]]
    assert [g["name"] for g in failed] == ["onnx.int8.f1_score"] and "< min 1.01" in failed[0]["message"]
    assert by_name["ptq.sensitivity"]["passed"]  # sensitivity measured the drop in f1_score
    ptq = next(s for s in out["stages"] if s["name"] == "ptq")["metrics"]
    assert "f1_score_drop" in ptq and 0 <= ptq["f1_score"] <= 1
    int8 = next(a for a in out["artifacts"] if a["path"] == "export/onnx/model.int8.onnx")
    assert 0 <= int8["metrics"]["f1_score"] <= 1 and out["headline_gate"]["gated"] is True
    assert any(r["what"] == "f1_score (onnx.int8 against train.f1_score)" for r in out["headline"])

    report = (folder / "runs" / "tiny" / "report.md").read_text()
    assert "headline metric `f1_score` (higher is better)" in report and "| onnx.int8.f1_score | FAIL |" in report
    header = next(ln for ln in report.splitlines() if ln.startswith("| artifact |"))
    assert "f1_score" in header

    bench = pruneflow.bench([folder / "runs" / "tiny"], batches=[1], runs=3, warmup=1)
    rows = [r for r in bench.to_records() if r["label"] == "onnx.int8" and r["runtime"] == "onnxruntime"]
    assert rows[0]["metric"] == "f1_score" and rows[0]["metric_value"] == pytest.approx(int8["metrics"]["f1_score"])
    assert "f1_score" in str(bench).splitlines()[1]


# --------------------------------------------------------------------------- docs/plugins.md as written


def _docs_block(language: str, first_line: str) -> str:
    import re

    from conftest import REPO

    blocks = re.findall(rf"```{language}\n(.*?)```", (REPO / "docs" / "plugins.md").read_text(), flags=re.S)
    return next(b for b in blocks if b.startswith(first_line))


def test_the_metric_in_docs_plugins_validates_and_computes(tmp_path):
    write(tmp_path / "my_metrics.py", _docs_block("python", "# my_metrics.py"))
    snippet = yaml.safe_load(_docs_block("yaml", "metrics:"))
    assert invoke("validate", recipe(tmp_path, snippet["metrics"])).exit_code == 0
    task = _task(tmp_path, snippet["metrics"])
    state = MetricState()
    task.update(state, torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 0.0]]), torch.tensor([0, 1, 1]))
    assert task.compute(state)["f1_score"] == pytest.approx(2 / 3)


def test_the_task_plugin_in_docs_plugins_is_a_working_task(tmp_path):
    import importlib.util

    write(tmp_path / "docs_quantile.py", _docs_block("python", "# my_pkg/tasks.py"))
    spec = importlib.util.spec_from_file_location("docs_quantile", tmp_path / "docs_quantile.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    task = module.Quantile(module.QuantileConfig(q=0.5))
    state = MetricState()
    task.update(state, torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))
    assert task.compute(state) == {"pinball": pytest.approx(0.5), "samples": 2}
    assert float(task.loss(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 4.0]))) == pytest.approx(0.5)
    assert task.headline.name == "pinball" and not task.headline.higher_is_better


def test_a_metric_from_an_installed_package_needs_the_recipes_trust_as_a_factory_does(folder):
    """A metric function is code the recipe runs (issue 41): one outside the recipe's folder tree and the zoo is refused
    at validate unless `trust.code` lists it, and validate names each one that will run."""
    metric = {"fn": "numpy:load", "higher_is_better": True}
    refused = invoke("validate", recipe(folder, [metric]))
    assert refused.exit_code == 2 and "metrics.0.fn" in refused.stderr and "trust: {code:" in refused.stderr, refused.output
    trusted = invoke("validate", recipe(folder, [metric], trust={"code": ["numpy:load"]}))
    assert trusted.exit_code == 0, trusted.output
    assert "this recipe runs code: numpy:load" in trusted.output


def test_a_gate_on_a_metric_of_the_recipes_own_validates_and_a_misspelt_one_does_not(folder):
    gate = {"metric": "onnx.fp32.f1_score", "baseline": "train.f1_score", "max_drop": 0.02}
    good = invoke("validate", recipe(folder, [{"fn": "my_metrics.py:f1_score", "headline": True}], gates=[gate]))
    assert good.exit_code == 0, good.output
    bad = invoke("validate", recipe(folder, [{"fn": "my_metrics.py:f1_score", "headline": True}],
                                    gates=[{**gate, "baseline": "train.f1_scor"}]))
    assert bad.exit_code == 2 and "f1_score" in bad.stderr, bad.output


def test_train_records_the_recipes_metrics_and_the_tasks_own_headline_so_gates_can_count_from_either(folder):
    """docs/plugins.md's gate counts from `train.f1_score` without `headline: true`, and README example 2's gate from
    `train.accuracy` still validates once f1_score is the headline (each was refused: train recorded the headline only)."""
    f1 = {"metric": "onnx.fp32.f1_score", "baseline": "train.f1_score", "max_drop": 0.02}
    accuracy = {"metric": "onnx.fp32.accuracy", "baseline": "train.accuracy", "max_drop": 0.01}
    for headline in (False, True):
        done = invoke("validate", recipe(folder, [{"fn": "my_metrics.py:f1_score", "headline": headline}], gates=[f1, accuracy]))
        assert done.exit_code == 0, (headline, done.output)
    from pruneflow.tasks import make_task
    from pruneflow.tasks.base import TaskConfig
    from pruneflow.tasks.user import UserMetric, with_user_metrics

    task = with_user_metrics(make_task(TaskConfig(type="classification")), [UserMetric("f1_score", lambda o, l: 0.0, True, True)])
    assert task.headline_name == "f1_score" and task.recorded_names == ["f1_score", "accuracy"]
    assert task.headline_names == ["f1_score"]  # sensitivity's default bound stays the headline alone
