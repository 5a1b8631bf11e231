"""The task seam: metrics with a direction, output reading, label checks, parity, gates, and the recipe's `task`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pruneflow.errors import ConfigError, InputError
from pruneflow.gates import check_gates
from pruneflow.recipe.models import GateSpec
from pruneflow.tasks import Classification, Metric, MetricState, make_task


def test_metric_direction_decides_what_worse_means():
    higher, lower = Metric("accuracy", perfect=1.0), Metric("mse", higher_is_better=False, perfect=0.0)
    assert higher.worsening(0.9, 0.85) == pytest.approx(0.05) and lower.worsening(0.10, 0.15) == pytest.approx(0.05)
    assert higher.worsening(0.9, 0.95) < 0 and lower.worsening(0.10, 0.05) < 0
    assert higher.at_least_as_good(0.96, 0.95) and not lower.at_least_as_good(0.2, 0.1)
    # two approximations' budgets add: shortfalls from perfect
    assert higher.compounded(0.99, 0.98) == pytest.approx(0.97) and lower.compounded(0.01, 0.02) == pytest.approx(0.03)
    assert higher.looser(0.99, 0.98) == 0.98 and lower.looser(0.01, 0.02) == 0.02


def test_a_figure_name_is_read_back_to_its_metric():
    task = Classification()
    assert task.metric("onnx.int8.accuracy_f32").name == "accuracy"
    assert task.metric("qat.accuracy_fp32").higher_is_better
    assert not task.metric("qat.accuracy_drop").higher_is_better  # a drop is a worsening
    assert not task.metric("evaluate.loss").higher_is_better
    assert task.metric("onnx.fp32.top1_agreement").name == "top1_agreement"
    assert task.metric("prune.macs_reduction").higher_is_better  # unknown figures: higher is better


def test_classification_computes_accuracy_and_loss_from_sums():
    task = Classification()
    state = MetricState()
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0]])
    task.update(state, logits, torch.tensor([0, 1, 1]))
    figures = task.compute(state)
    assert figures["accuracy"] == pytest.approx(2 / 3) and figures["samples"] == 3
    assert figures["loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 1]))))
    assert task.describe(figures) == "accuracy 0.6667"


@pytest.mark.parametrize("output", [
    torch.ones(2, 3),
    (torch.ones(2, 3), torch.zeros(2)),
    {"logits": torch.ones(2, 3), "hidden": torch.zeros(2, 8)},
    {"scores": torch.ones(2, 3)},
])
def test_the_default_output_reading_takes_the_tensor_its_logits_or_its_first_part(output):
    assert torch.equal(Classification().output(output), torch.ones(2, 3))


def test_task_output_names_the_part_to_read_and_a_wrong_name_is_an_error_naming_the_key():
    task = make_task({"type": "classification", "output": "scores"})
    out = {"logits": torch.zeros(2, 3), "scores": torch.ones(2, 3)}
    assert torch.equal(task.output(out), torch.ones(2, 3))
    assert torch.equal(make_task({"type": "classification", "output": 1}).output((torch.zeros(1), torch.ones(2, 3))),
                       torch.ones(2, 3))
    with pytest.raises(ConfigError) as info:
        task.output({"logits": torch.zeros(2, 3)})
    assert info.value.loc == ("task", "output") and "keys logits" in info.value.message


def test_classification_labels_must_be_class_ids():
    task = Classification()
    assert task.read_targets(np.array([0, 2, 1], dtype=np.int32), "label").dtype == np.int64
    with pytest.raises(InputError, match="integer class ids"):
        task.read_targets(np.array([0.5, 1.5]), "label")


def test_classification_parity_is_top1_agreement():
    ref = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 0.9]], dtype=np.float32)
    got = np.array([[1.0, 0.0], [0.0, 1.0], [0.9, 1.0]], dtype=np.float32)
    figures = Classification().agree(ref, got)
    assert figures["top1_agreement"] == pytest.approx(2 / 3) and figures["parity_samples"] == 3
    assert figures["max_abs_diff"] == pytest.approx(0.1, abs=1e-6)


def _lower_is_better_task():
    """Classification with its headline read as lower-is-better: a stand-in for a loss-judged task."""

    class Lossy(Classification):
        metrics = (Metric("loss", higher_is_better=False),)
        headline_name = "loss"

    return Lossy()


def test_max_drop_counts_worse_in_the_metrics_own_direction():
    spec = GateSpec(metric="onnx.int8.loss", baseline="evaluate.loss", max_drop=0.05)
    task = _lower_is_better_task()
    passed, failed = (check_gates([spec], {"onnx.int8.loss": v, "evaluate.loss": 0.30}, task)[0] for v in (0.34, 0.40))
    assert passed.passed and not failed.passed
    assert "worse by 0.1" in failed.message and "lower is better" in failed.message
    # a lower loss than the baseline is never a drop, however far
    assert check_gates([spec], {"onnx.int8.loss": 0.01, "evaluate.loss": 0.30}, task)[0].passed
    # and for accuracy (higher is better) the same gate counts the other way
    acc = GateSpec(metric="onnx.int8.accuracy", baseline="evaluate.accuracy", max_drop=0.01)
    assert not check_gates([acc], {"onnx.int8.accuracy": 0.90, "evaluate.accuracy": 0.92}, Classification())[0].passed
    assert check_gates([acc], {"onnx.int8.accuracy": 0.99, "evaluate.accuracy": 0.92}, Classification())[0].passed


def test_max_drop_relative_is_a_share_of_the_baselines_magnitude():
    spec = GateSpec(metric="onnx.int8.mse", baseline="onnx.fp32.mse", max_drop_relative=0.02)
    task = make_task("regression")
    within, beyond = (check_gates([spec], {"onnx.int8.mse": v, "onnx.fp32.mse": 100.0}, task)[0] for v in (101.9, 102.5))
    assert within.passed and "2.00%" in within.message
    assert not beyond.passed and "worse by 2.50%" in beyond.message and "max_drop_relative 2.00%" in beyond.message
    assert check_gates([spec], {"onnx.int8.mse": 50.0, "onnx.fp32.mse": 100.0}, task)[0].passed  # better is never a drop
    with pytest.raises(ValueError, match="baseline"):
        GateSpec(metric="onnx.int8.mse", max_drop_relative=0.02)


def test_recipe_task_takes_a_name_or_a_mapping_and_refuses_an_unknown_one_at_its_line(write_recipe):
    from pruneflow.errors import RecipeError
    from pruneflow.recipe import load_recipe

    from conftest import tiny_recipe_dict

    assert load_recipe(write_recipe(tiny_recipe_dict())).recipe.task.type == "classification"
    loaded = load_recipe(write_recipe(tiny_recipe_dict(task={"type": "classification", "output": "logits"})))
    assert loaded.recipe.task.output == "logits"
    with pytest.raises(RecipeError) as info:
        load_recipe(write_recipe(tiny_recipe_dict(task="clasification")))
    text = str(info.value)
    assert "unknown task 'clasification'" in text and "did you mean 'classification'" in text and "recipe.yaml:" in text
    with pytest.raises(RecipeError, match="task.outptu"):
        load_recipe(write_recipe(tiny_recipe_dict(task={"type": "classification", "outptu": "x"})))


def test_task_summary_is_what_runs_record():
    summary = Classification().summary()
    assert summary == {"type": "classification", "headline": "accuracy",
                       "metrics": {"accuracy": "higher", "loss": "lower"}, "agreement": "top1_agreement",
                       "agreement_label": "top-1 agreement"}


def _code_mentions(word: str) -> list[str]:
    """``file:line`` of each place outside docstrings, comments and field descriptions where ``word`` is part of
    the code: a name, an attribute, an argument, or a string the code uses (a dict key, a comparison)."""
    import ast

    from conftest import REPO

    files = [p for top in ("pruneflow", "qat", "calibrate") for p in sorted((REPO / top).rglob("*.py"))] + [REPO / "cli.py"]
    found = []
    for path in files:
        tree = ast.parse(path.read_text())
        prose: set[int] = set()  # ids of string constants that document: docstrings, descriptions, help texts
        for node in ast.walk(tree):
            body = getattr(node, "body", None)
            if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                prose.add(id(body[0].value))
            if isinstance(node, ast.keyword) and node.arg in ("description", "help", "hint"):
                prose |= {id(n) for n in ast.walk(node.value)}
        for node in ast.walk(tree):
            text = (node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose
                    else getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "arg", None)
                    or (node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else None))
            if isinstance(text, str) and word in text.lower():
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return sorted(set(found))


def test_accuracy_is_the_classification_tasks_word_alone():
    """Everything that judges a model reads the task's headline; only the classification task names accuracy."""
    # binary: accuracy at 0.5; segmentation: pixel accuracy
    allowed = ("pruneflow/tasks/classification.py", "pruneflow/tasks/binary.py", "pruneflow/tasks/segmentation.py")
    assert [f for f in _code_mentions("accuracy") if not f.startswith(allowed)] == []


def test_no_code_compares_a_task_name():
    """A task is chosen through the registry: no code outside it asks which task it is by name."""
    import re

    from conftest import REPO

    files = [p for top in ("pruneflow", "qat", "calibrate") for p in sorted((REPO / top).rglob("*.py"))] + [REPO / "cli.py"]
    pattern = re.compile(r"""(==|!=|\bin)\s*\(?\s*["'](classification|regression|binary|embedding|segmentation)["']"""
                         r"""|["'](classification|regression|binary|embedding|segmentation)["']\s*(==|!=|\bin\b)""")
    hits = [f"{p.relative_to(REPO)}:{i}" for p in files for i, line in enumerate(p.read_text().splitlines(), 1)
            if pattern.search(line)]
    assert hits == []


def test_a_constant_class_label_is_refused_before_training():
    task = Classification()
    with pytest.raises(InputError, match="every label of the train split is 3"):
        task.check_targets({"train": torch.full((20,), 3), "eval": torch.tensor([3, 1])}, None, "label")


def test_a_training_loss_of_exactly_zero_stops_the_run_with_its_cause(tmp_path):
    """A model whose output the loss cannot move (here: a constant the labels already match) trains without a word
    otherwise: exit 0 with every figure that of an untrained model."""
    from pruneflow.context import RunContext
    from pruneflow.splits import DataBundle, Split
    from pruneflow.train import TrainSettings, fit

    class Certain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Linear(2, 2)

        def forward(self, x):
            return torch.tensor([[0.0, 1e4]]).expand(len(x), 2) + 0 * self.unused(x)

    x, y = torch.randn(16, 2), torch.ones(16, dtype=torch.int64)
    data = DataBundle(train=Split(x, y), eval=Split(x, y), num_classes=2, input_shape=(2,))
    ctx = RunContext(run_dir=tmp_path, recipe=None, recipe_file=None)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="training loss is exactly 0"):
        fit(Certain(), data, Classification(), TrainSettings(epochs=2, batch_size=8), ctx)
