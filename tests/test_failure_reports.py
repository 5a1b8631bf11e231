"""After a failure a user can tell what happened from the run folder alone (issue 15, Deliver 5).

The log holds the error, report.md the stages that finished and a Failed section, ``--json`` their metrics
with the error, and manifest.json lists exactly the files on disk, also after a failed ``--resume`` rerun.
The failing stage is a real stage registered for the test: it writes a file and then raises.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest
from pydantic import Field

from pruneflow import registry
from pruneflow.errors import InputError
from pruneflow.run_folder import RUN_FILES
from pruneflow.recipe.models import recipe_model, target_union
from pruneflow.stage import Stage, StageConfig, StageResult
from tests.conftest import invoke, tiny_recipe_dict, write


class BoomConfig(StageConfig):
    type: Literal["boom"] = Field("boom", description="Writes a partial file, then fails.")
    ours: bool = Field(False, description="Raise our own InputError (with a hint) instead of a RuntimeError.")


class BoomStage(Stage[BoomConfig]):
    Config = BoomConfig

    def run(self, state, ctx) -> StageResult:
        (ctx.stage_dir(self.index, self.id) / "partial.bin").write_bytes(b"half")
        if self.config.ours:
            raise InputError("the boom stage found no fuse", hint="give it a fuse")
        raise RuntimeError("boom: the stage blew up")


@pytest.fixture
def boom():
    recipe_model.cache_clear()
    target_union.cache_clear()
    with registry.stages.registered("boom", BoomStage):
        recipe_model.cache_clear()
        yield
    recipe_model.cache_clear()
    target_union.cache_clear()


def stages(targets: list[str], ours: bool = False) -> list[dict]:
    return [{"type": "train", "epochs": 1, "batch_size": 32, "lr": 0.05}, {"type": "evaluate"},
            {"type": "export", "targets": targets, "latency": None}, {"type": "boom", "ours": ours}]


def files_on_disk(run_dir: Path) -> set[str]:
    return {p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*")
            if p.is_file() and not p.relative_to(run_dir).as_posix().startswith("logs/")}


def assert_manifest_lists_exactly_the_files(run_dir: Path) -> dict:
    manifest = json.loads((run_dir / "manifest.json").read_text())
    failure = manifest.get("failure", {})
    listed = {f for s in manifest["stages"] for f in s["files"]} | set(failure.get("files", [])) | set(failure.get("earlier_run_files", []))
    records = {f"stages/{s['index'] + 1:02d}-{s['id']}/stage.json" for s in manifest["stages"]}
    assert files_on_disk(run_dir) == listed | records | (RUN_FILES & files_on_disk(run_dir))
    for artifact in manifest["artifacts"]:
        assert {artifact["path"], *artifact["files"]} <= listed
    return manifest


def one_json(stdout: str) -> dict:
    lines = stdout.strip().splitlines()
    assert len(lines) == 1, stdout
    return json.loads(lines[0])


@pytest.mark.slow
@pytest.mark.parametrize("ours", [False, True])
def test_a_failed_stage_leaves_log_report_json_and_a_manifest_of_what_is_on_disk(tmp_path, boom, ours):
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict(stages=stages(["onnx"], ours)))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--json")
    code = 2 if ours else 4
    assert result.exit_code == code, result.output
    payload = one_json(result.stdout)
    assert payload["exit_code"] == code and payload["error"]["type"] == ("InputError" if ours else "StageError")
    assert [s["name"] for s in payload["stages"]] == ["train", "evaluate", "export"]
    accuracy = payload["stages"][1]["metrics"]["accuracy"]
    assert 0 < accuracy <= 1 and payload["artifacts"][-1]["path"] == "export/onnx/model.fp32.onnx"

    run_dir = tmp_path / "runs" / "tiny"
    log = (run_dir / "logs" / "pruneflow.log").read_text()
    assert f"stage boom (boom) failed (exit {code})" in log
    assert ("the boom stage found no fuse" in log and "Fix: give it a fuse" in log) if ours else "boom: the stage blew up" in log

    report = (run_dir / "report.md").read_text()
    assert "**FAILED**" in report and "## Failed" in report and "## Stages that finished" in report
    assert "`stages/04-boom/partial.bin`" in report and f"exit {code}" in report
    assert ("**Fix:** give it a fuse" in report) if ours else "RuntimeError: boom" in report
    assert "| evaluate | evaluate |" in report and "onnx/model.fp32.onnx" in report

    manifest = assert_manifest_lists_exactly_the_files(run_dir)
    assert manifest["status"] == "failed" and [s["id"] for s in manifest["stages"]] == ["train", "evaluate", "export"]
    assert manifest["failure"]["stage"] == "boom" and manifest["failure"]["files"] == ["stages/04-boom/partial.bin"]
    assert manifest["failure"]["error"]["exit_code"] == code
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["stages"]["evaluate"]["accuracy"] == accuracy and metrics["failure"]["stage"] == "boom"


@pytest.mark.slow
def test_the_plain_console_names_the_report_after_a_failure(tmp_path, boom):
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict(stages=stages(["onnx"])))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "-q")
    assert result.exit_code == 4
    assert "report.md" in result.stderr and "pruneflow.log" in result.stderr


@pytest.mark.slow
def test_a_failed_resume_rerun_keeps_no_file_of_the_earlier_run(tmp_path, boom):
    """Run 1 exports ONNX and OpenVINO; run 2 (--resume) exports ONNX only and then fails: the OpenVINO
    files of run 1 are gone, the ONNX file is run 2's, and the manifest lists exactly what is on disk."""
    first = write(tmp_path / "r.yaml", tiny_recipe_dict(stages=stages(["onnx", "openvino"])[:3]))
    assert invoke("optimize", first, "--out", tmp_path / "runs", "-q").exit_code == 0
    run_dir = tmp_path / "runs" / "tiny"
    assert (run_dir / "export" / "openvino").is_dir()
    old_onnx = (run_dir / "export" / "onnx" / "model.fp32.onnx").stat().st_mtime_ns
    assert_manifest_lists_exactly_the_files(run_dir)

    second = write(tmp_path / "r.yaml", tiny_recipe_dict(stages=stages(["onnx"])))
    result = invoke("optimize", second, "--out", tmp_path / "runs", "--resume", "--json")
    assert result.exit_code == 4, result.output
    assert [(s["name"], s["resumed"]) for s in one_json(result.stdout)["stages"]] == [
        ("train", True), ("evaluate", True), ("export", False)]
    assert not (run_dir / "export" / "openvino").exists()
    assert (run_dir / "export" / "onnx" / "model.fp32.onnx").stat().st_mtime_ns > old_onnx  # written again
    manifest = assert_manifest_lists_exactly_the_files(run_dir)
    assert manifest["failure"]["files"] == ["stages/04-boom/partial.bin"] and manifest["failure"]["earlier_run_files"] == []

    third = write(tmp_path / "r.yaml", tiny_recipe_dict(stages=stages(["onnx"])[:3]))
    result = invoke("optimize", third, "--out", tmp_path / "runs", "--resume", "--json")
    assert result.exit_code == 0, result.output
    assert not (run_dir / "stages" / "04-boom").exists()  # what the failed stage left goes with it
    manifest = assert_manifest_lists_exactly_the_files(run_dir)
    assert manifest["status"] == "complete" and "failure" not in manifest


@pytest.mark.slow
def test_a_failed_resume_lists_the_earlier_runs_files_it_did_not_reach(tmp_path, boom):
    """Run 2 (--resume) fails before the export stage of run 1: that stage's files stay (a later --resume may
    reuse them) and the manifest lists them as the earlier run's, apart from this run's."""
    first = write(tmp_path / "r.yaml", tiny_recipe_dict(stages=stages(["onnx"])[:3]))
    assert invoke("optimize", first, "--out", tmp_path / "runs", "-q").exit_code == 0
    run_dir = tmp_path / "runs" / "tiny"
    s = stages(["onnx"])
    second = write(tmp_path / "r.yaml", tiny_recipe_dict(stages=[s[0], s[1], s[3], s[2]]))
    result = invoke("optimize", second, "--out", tmp_path / "runs", "--resume", "--json")
    assert result.exit_code == 4, result.output
    manifest = assert_manifest_lists_exactly_the_files(run_dir)
    assert manifest["failure"]["files"] == ["stages/03-boom/partial.bin"]
    assert manifest["failure"]["earlier_run_files"] == ["export/onnx/model.fp32.onnx", "stages/03-export/stage.json"]
    assert [a["path"] for a in manifest["artifacts"]] == ["stages/01-train/model.pt"]
