"""The Python API (`pruneflow.optimize`, `validate`, `bench`): what the CLI does, as results and exceptions."""

from __future__ import annotations

import json

import pytest

import pruneflow
from pruneflow.errors import RecipeError

from conftest import tiny_recipe_dict, write


def test_validate_returns_notes_and_raises_a_located_recipe_error(tmp_path):
    good = write(tmp_path / "good.yaml", tiny_recipe_dict())
    assert pruneflow.validate(good) == []
    bad = write(tmp_path / "bad.yaml", tiny_recipe_dict(model={"factory": "missing.py:build"}))
    with pytest.raises(RecipeError) as caught:
        pruneflow.validate(bad)
    assert caught.value.exit_code == 2 and caught.value.issues[0].path == "model.factory"
    with pytest.raises(RecipeError):
        pruneflow.validate(good, overrides=["stages.0.epochs=zero"])


def test_dir_lists_the_lazy_api_for_completion():
    names = dir(pruneflow)
    assert {"optimize", "validate", "bench", "RunResult", "BenchResult", "RecipeError", "__version__"} <= set(names)
    assert "os" not in names and "sys" not in names  # the package's own helpers are not its API
    assert pruneflow.RecipeError is RecipeError


def test_a_recipe_error_and_its_issues_print_as_lines_and_convert_to_records(tmp_path):
    bad = write(tmp_path / "bad.yaml", tiny_recipe_dict(stages=[{"type": "train", "epochs": "three", "lrr": 0.1}]))
    with pytest.raises(RecipeError) as caught:
        pruneflow.validate(bad)
    error = caught.value
    assert "object at 0x" not in repr(error.issues) and "object at 0x" not in repr(error)
    assert repr(error.issues[0]).startswith(f"RecipeIssue({bad}:") and "stages.0.epochs" in repr(error.issues[0])
    assert str(error.issues[1]).startswith(f"{bad}:") and "did you mean 'lr'" in str(error.issues[1])
    assert repr(error).startswith("RecipeError: ") and len(repr(error).splitlines()) == 4  # message, 2 issues, fix
    records = error.to_records()
    assert [r["path"] for r in records] == ["stages.0.epochs", "stages.0.lrr"] and records[0]["line"] == error.issues[0].line
    pd = pytest.importorskip("pandas")
    assert isinstance(error.to_pandas(), pd.DataFrame) and list(error.to_pandas()["path"]) == ["stages.0.epochs", "stages.0.lrr"]


def test_text_table_leaves_out_blank_columns_cuts_long_cells_and_counts_the_rest():
    from pruneflow.units import text_table

    rows = [{"a": i, "b": None, "c": "x" * 100} for i in range(40)]
    lines = text_table(rows, max_rows=5, max_width=20).splitlines()
    assert lines[0].split() == ["a", "c"] and len(lines) == 7 and lines[-1] == "… 35 more rows"
    assert lines[1].endswith("x…") and len(lines[1].split()[1]) == 20


def test_the_default_progress_is_a_line_a_stage_on_stderr(capsys):
    from pruneflow.api import TextReporter

    reporter = TextReporter()
    reporter.run_started("tiny", {"type": "classification", "headline": "accuracy"})
    reporter.stage_started("train", "train", 0, 3)
    with reporter.progress("train epoch 1/2", total=10) as advance:
        advance(5, loss=0.3)
    reporter.stage_finished("train", 4.2, {"accuracy": 0.91234, "loss": 0.3})
    err = capsys.readouterr().err.splitlines()
    assert err == ["pruneflow: run tiny (task classification, headline accuracy)", "pruneflow: 1/3 train (train) ...",
                   "pruneflow:   train done in 4.2 s, accuracy 0.9123"]  # a step under 5 s is not a line of its own


@pytest.mark.slow  # runs the tiny recipe, then times its artifact (~10 s)
def test_optimize_and_bench_return_what_the_cli_prints(tmp_path, capsys):
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict())
    result = pruneflow.optimize(recipe, out=tmp_path / "runs", overrides=["stages.0.epochs=2"])
    progress = capsys.readouterr().err
    assert "pruneflow: 1/3 train (train) ..." in progress and "report.md" in progress and "pruneflow.log" in progress
    assert result.exit_code == 0 and (result.run_dir / "report.md").is_file()
    assert json.loads((result.run_dir / "manifest.json").read_text())["status"] == "complete"
    assert "epochs: 2" in (result.run_dir / "recipe.resolved.yaml").read_text()  # the override was applied
    built = [a for a in result.artifacts if a.target == "onnx" and a.status == "built"]
    evaluated = next(s.metrics["accuracy"] for s in result.stages if s.type == "evaluate")
    assert built and abs(built[0].metrics["accuracy"] - evaluated) < 0.02
    table = pruneflow.bench([result.run_dir], batches=[1], runs=3, warmup=1)
    assert table.rows and all(r.stats is not None for r in table.rows if r.error is None)

    # readable from Python: print() shows short tables, to_records()/to_pandas() the figures (issue 42, item 5)
    shown = str(result)
    assert shown.startswith(f"RunResult: {result.run_dir} — PASSED") and "object at 0x" not in shown
    assert len(shown.splitlines()) < 40 and repr(result) == shown and "gates:" in shown
    assert {r["path"] for r in result.to_records()} == {a.path for a in result.artifacts}
    assert [r["stage"] for r in result.to_records("stages")] == ["train", "evaluate", "export"]
    with pytest.raises(ValueError, match="one of artifacts, stages, gates, headline"):
        result.to_records("nope")
    printed = str(table)
    assert printed.startswith("BenchResult: ") and len(printed.splitlines()) < 40 and len(repr(table)) < 4000
    assert "onnx.fp32" in printed and "b1 p50 ms" in printed and "host: " in printed
    records = table.to_records()
    assert len(records) == len(table.rows) and {"p50_ms", "p99_ms", "throughput", "runtime", "batch"} <= set(records[0])
    pd = pytest.importorskip("pandas")
    frame = table.to_pandas()
    assert isinstance(frame, pd.DataFrame) and len(frame) == len(table.rows) and "p50_ms" in frame.columns
    assert isinstance(result.to_pandas("stages"), pd.DataFrame)
