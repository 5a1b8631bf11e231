"""PASSED means what it says (issue 42, item 3): README example 2 trained to 70.8 %, pruned to 62.8 %, went INT8 at
64.2 % and report.md opened with **PASSED**, since its recipe had no gate on the task's headline metric and nothing
said so. A run without one now says so in report.md, the terminal and --json, with a gate line to add; every shipped
recipe and the README's own example gate on it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from conftest import REPO, invoke, tiny_recipe_dict, write
from pruneflow.gates import headline_gate, reads_headline
from pruneflow.recipe import load_recipe
from pruneflow.recipe.models import GateSpec
from pruneflow.tasks import make_task


def gate(metric: str, **bounds) -> GateSpec:
    return GateSpec(metric=metric, **(bounds or {"min": 0.5}))


def test_a_gate_reads_the_headline_by_its_value_or_its_drop_anywhere_in_the_run():
    task = make_task("classification")
    assert reads_headline(gate("onnx.int8.accuracy"), task) and reads_headline(gate("evaluate.accuracy"), task)
    assert reads_headline(gate("qat.accuracy_drop", max=0.01), task)
    assert reads_headline(gate("ptq.accuracy", baseline="qat.accuracy_fp32", max_drop=0.01), task)
    assert not reads_headline(gate("prune.macs_reduction", min=2.0), task)
    assert not reads_headline(gate("onnx.int8.top1_agreement"), task) and not reads_headline(gate("onnx.int8.loss", max=1), task)
    multi = make_task({"type": "multi", "heads": {"click": "binary", "finish": "binary"}})
    assert reads_headline(gate("onnx.int8.click.auc"), multi) and not reads_headline(gate("onnx.int8.finish.auc"), multi)


def test_without_a_headline_gate_the_verdict_says_so_and_suggests_one():
    task = make_task("classification")
    assert headline_gate([gate("onnx.int8.accuracy")], task) == {"gated": True}
    found = headline_gate([gate("prune.macs_reduction", min=2.0)], task, "onnx.int8.accuracy", "train.accuracy")
    assert found["gated"] is False
    assert found["suggestion"] == "- {metric: onnx.int8.accuracy, baseline: train.accuracy, max_drop: 0.01}"
    assert "no gate reads accuracy" in found["message"] and found["suggestion"] in found["message"]
    # the suggestion is a gate the recipe loader takes as written
    assert GateSpec(**yaml.safe_load(found["suggestion"])[0]).max_drop == 0.01
    # an error (lower is better, no upper bound): relative; no start point: a bound to fill in
    regression = headline_gate([], make_task("regression"), "onnx.int8.mse", "train.mse")
    assert regression["suggestion"] == "- {metric: onnx.int8.mse, baseline: train.mse, max_drop_relative: 0.05}"
    assert headline_gate([], task, "evaluate.accuracy", None)["suggestion"] == "- {metric: evaluate.accuracy, min: VALUE}"


@pytest.mark.parametrize("path", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_gates_its_headline_metric(path):
    recipe = load_recipe(path).recipe
    task = make_task(recipe.task)
    assert any(reads_headline(spec, task) for spec in recipe.gates), f"{path.name}: no gate on {task.headline.name}"


def test_the_readme_example_recipe_gates_accuracy():
    readme = (REPO / "README.md").read_text()
    block = next(b for b in re.findall(r"```yaml\n(.*?)```", readme, flags=re.S) if b.startswith("# my-recipe.yaml"))
    gates = [GateSpec(**g) for g in yaml.safe_load(block)["gates"]]
    assert any(reads_headline(g, make_task("classification")) for g in gates)
    assert gates[-1].metric == "onnx.int8.accuracy" and gates[-1].baseline == "train.accuracy"


@pytest.mark.slow  # a tiny recipe: train, prune, ptq, export (about 15 s)
def test_a_run_without_a_headline_gate_says_so_in_the_report_the_terminal_and_json(tmp_path):
    stages = [{"type": "train", "epochs": 1, "batch_size": 32, "lr": 0.05},
              {"type": "prune", "importance": "magnitude", "target": {"macs": 0.6}, "rounds": 1, "finetune": None},
              {"type": "calibrate", "size": 64}, {"type": "ptq"},
              {"type": "export", "targets": ["onnx"], "precisions": ["fp32", "int8"], "latency": None}]
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict(stages=stages, gates=[{"metric": "prune.macs_reduction", "min": 1.1}]))
    out = tmp_path / "runs"
    shown = invoke("optimize", recipe, "--out", out)
    assert shown.exit_code == 0, shown.output
    line = "- {metric: onnx.int8.accuracy, baseline: train.accuracy, max_drop: 0.01}"
    assert "no gate reads accuracy" in shown.stdout and line in shown.stdout
    report = (out / "tiny" / "report.md").read_text().splitlines()
    assert report[2].startswith("**PASSED**") and report[4].startswith("> **Not gated on accuracy**") and line in report[4]
    as_json = json.loads(invoke("optimize", recipe, "--out", tmp_path / "again", "--json").stdout)
    assert as_json["headline_gate"]["gated"] is False and as_json["headline_gate"]["suggestion"] == line
    assert json.loads((out / "tiny" / "metrics.json").read_text())["headline_gate"]["suggestion"] == line

    gated = write(tmp_path / "g.yaml", {**yaml.safe_load(recipe.read_text()), "name": "gated",
                                        "gates": [yaml.safe_load(line)[0]]})
    result = invoke("optimize", gated, "--out", out, "--json")
    assert json.loads(result.stdout)["headline_gate"] == {"gated": True}
    assert "Not gated" not in (out / "gated" / "report.md").read_text()


def test_a_gate_counting_from_another_baseline_than_the_headline_says_so(tmp_path, capsys):
    """The headline's accuracy change counts from the model entering the first compressing stage (train.accuracy); a
    max_drop gate from its own baseline (qat.accuracy_fp32): the two disagreed without saying so (issue 42, item 8)."""
    from pruneflow.headline import baseline_notes
    from pruneflow.results import RunResult

    result = RunResult(tmp_path, 0, [], [], [], {"qat.accuracy_fp32": 0.9722, "train.accuracy": 0.9889},
                       {"headline": "accuracy"}, start={"stage": "prune", "metric": 0.9889, "metric_from": "train.accuracy"})
    task = make_task("classification")
    other = GateSpec(metric="onnx.int8.accuracy", baseline="qat.accuracy_fp32", max_drop=0.01)
    same = GateSpec(metric="openvino.int8.accuracy", baseline="train.accuracy", max_drop=0.01)
    notes = baseline_notes(result, [other, same, gate("prune.macs_reduction", min=2.0)], task)
    assert notes == ["gate `onnx.int8.accuracy` counts its change from `qat.accuracy_fp32` (0.9722); the headline counts "
                     "from `train.accuracy` (0.9889), the model entering `prune`"]
    result.baseline_notes = notes
    assert result.as_json()["baseline_notes"] == notes
    from pruneflow.commands.optimize import _print_summary

    _print_summary(result)
    assert "note: gate `onnx.int8.accuracy` counts its change from `qat.accuracy_fp32`" in capsys.readouterr().out
