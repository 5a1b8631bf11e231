"""Faults a run must survive (issue 14): hostile run folders and checkpoints, reproducible checkpoint bytes,
SIGTERM, two runs into one folder, NNCF's log after a resume, and the --json contract (a stale NNCF build lock:
tests/test_nncf_build_lock.py).

Each case asserts the exit code, a message that says what, where and the fix, and that nothing was run,
written or lost. Runs are tiny (digits_cnn, 300 training digits, one epoch); subprocesses run the real CLI.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import numpy as np
import pytest
import torch
import yaml
from pydantic import Field

from pruneflow.commands.app import json_line
from pruneflow import registry
from pruneflow.artifacts import run_dir_lock
from pruneflow.checkpoint import FORMAT
from pruneflow.recipe.models import recipe_model, target_union
from pruneflow.stage import Stage, StageConfig, StageResult
from conftest import invoke, runs_a_recipe, tiny_train_recipe as tiny, wait_for, write

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


class Trap:
    """Unpickling this creates ``marker`` (builtins.open in write mode): proof that code ran while loading."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def one_json(stdout: str) -> dict:
    """stdout holds exactly one JSON object on one line, and it is strict JSON (no NaN/Infinity)."""
    lines = stdout.strip().splitlines()
    assert len(lines) == 1, stdout

    def refuse(name):
        raise AssertionError(f"non-standard JSON constant {name} on stdout")

    payload = json.loads(lines[0], parse_constant=refuse)
    assert isinstance(payload, dict)
    return payload


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): sha(p) for p in sorted(folder.rglob("*")) if p.is_file()}


def cli_process(*args: object, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([PYTHON, "-m", "cli", *map(str, args)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


@pytest.fixture(scope="module")
@runs_a_recipe
def trained(tmp_path_factory):
    """One finished run with a checkpoint (train, evaluate); tests copy it."""
    root = tmp_path_factory.mktemp("trained")
    recipe = write(root / "tiny.yaml", tiny())
    result = invoke("optimize", recipe, "--out", root / "runs", "--json")
    assert result.exit_code == 0, result.output
    return SimpleNamespace(root=root, recipe=recipe, run_dir=root / "runs" / "tiny", payload=one_json(result.stdout))


@pytest.fixture
def run_copy(trained, tmp_path):
    out = tmp_path / "runs"
    shutil.copytree(trained.run_dir, out / "tiny")
    return out / "tiny"


# --------------------------------------------------------------------------- 1. no code from a run folder or checkpoint


def plant(run_dir: Path, payload: object) -> Path:
    """Replace the train stage's checkpoint by ``payload`` and edit stage.json and manifest.json to vouch for it."""
    path = run_dir / "stages" / "01-train" / "model.pt"
    torch.save(payload, path)
    digest, size = sha(path), path.stat().st_size
    stage_file = path.parent / "stage.json"
    stage = json.loads(stage_file.read_text())
    for record in stage["artifact_records"]:
        if record["kind"] == "checkpoint":
            record.update(sha256=digest, size_bytes=size)
    stage_file.write_text(json.dumps(stage))
    manifest = json.loads((run_dir / "manifest.json").read_text())
    for record in manifest["artifacts"]:
        if record["path"] == "stages/01-train/model.pt":
            record.update(sha256=digest, size_bytes=size)
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    return path


def payloads(marker: Path) -> dict[str, object]:
    """A __reduce__ payload in every part of a checkpoint that is read, in both formats."""
    state = {k: v for k, v in __import__("pruneflow.zoo", fromlist=["ZOO"]).ZOO["digits_cnn"].factory(width=8).state_dict().items()}
    trap = Trap(marker)
    return {
        "v2-state_dict": {"format": FORMAT, "kind": "float", "structure": {}, "state_dict": {**state, "x": trap},
                          "meta": {}, "kind_payload": {}},
        "v2-kind_payload": {"format": FORMAT, "kind": "nncf", "structure": {}, "state_dict": state, "meta": {},
                            "kind_payload": {"nncf_config": trap, "state_dict": state}},
        "v2-meta": {"format": FORMAT, "kind": "float", "structure": {}, "state_dict": state, "meta": {"m": trap},
                    "kind_payload": {}},
        "v1-module": {"format": "pruneflow-checkpoint/1", "state_dict": state, "module": trap},
        "bare": trap,
    }


PAYLOADS = ["v2-state_dict", "v2-kind_payload", "v2-meta", "v1-module", "bare"]


def assert_refused(result, marker: Path, where: str) -> None:
    assert result.exit_code == 2, result.output
    assert not marker.exists(), "code in a planted file ran"
    assert "pickled Python objects" in result.stderr and "never unpickles" in result.stderr, result.stderr
    assert where in result.stderr and "Fix:" in result.stderr
    assert "Traceback" not in result.output and "internal error" not in result.stderr


@pytest.mark.parametrize("which", PAYLOADS)
def test_inspect_of_a_run_folder_with_a_planted_payload_runs_no_code(run_copy, tmp_path, which):
    marker = tmp_path / "pwned"
    plant(run_copy, payloads(marker)[which])
    for target in (run_copy, run_copy / "stages" / "01-train" / "model.pt"):
        assert_refused(invoke("inspect", target), marker, "model.pt")
        payload = one_json(invoke("inspect", target, "--json").stdout)
        assert payload["exit_code"] == 2 and "never unpickles" in payload["error"]["message"]
        assert not marker.exists()


def test_an_nncf_checkpoint_naming_a_module_outside_nncf_is_refused(run_copy, tmp_path):
    """The nncf kind's config names the classes to rebuild: NNCF imports only from nncf.*, and the refusal is exit 2."""
    from pruneflow.checkpoint import describe_structure
    from pruneflow.zoo import ZOO

    model = ZOO["digits_cnn"].factory(width=8)
    command = {"module_path": "os", "module_cls_name": "system", "module_config": {}, "hook_names_in_model": []}
    plant(run_copy, {"format": FORMAT, "kind": "nncf", "structure": describe_structure(model),
                     "state_dict": model.state_dict(), "meta": {},
                     "kind_payload": {"nncf_config": {"compression_state": [command]}, "state_dict": {}}})
    result = invoke("inspect", run_copy)
    assert result.exit_code == 2, result.output
    assert "model.pt: its 'nncf' model could not be restored" in result.stderr and "untrusted path 'os'" in result.stderr
    assert "internal error" not in result.stderr and "Fix:" in result.stderr


@pytest.mark.parametrize("factory", ["os:system", "evil.py:make"])
def test_inspect_never_runs_a_factory_that_a_run_folder_names(trained, run_copy, tmp_path, factory):
    """recipe.resolved.yaml is part of the run folder: edited to name code, inspecting the run must not run it."""
    marker = tmp_path / "pwned"
    (run_copy / "evil.py").write_text(f"open({str(marker)!r}, 'w')\ndef make():\n    open({str(marker)!r}, 'w')\n")
    resolved = yaml.safe_load((run_copy / "recipe.resolved.yaml").read_text())
    resolved["model"].update(factory=factory if factory.startswith("os") else str(run_copy / factory),
                             kwargs={"command": f"touch {marker}"} if factory.startswith("os") else {})
    (run_copy / "recipe.resolved.yaml").write_text(yaml.safe_dump(resolved))
    result = invoke("inspect", run_copy)
    assert result.exit_code == 2, result.output
    assert not marker.exists()
    assert "recipe.resolved.yaml names model.factory" in result.stderr and "does not run code" in result.stderr
    assert "--recipe" in result.stderr
    # With the user's own recipe the run's model is shown (its checkpoint, weights only).
    ok = invoke("inspect", run_copy, "--recipe", trained.recipe, "--json")
    assert ok.exit_code == 0, ok.output
    assert one_json(ok.stdout)["kind"] == "checkpoint stages/01-train/model.pt" and not marker.exists()


@pytest.mark.parametrize("which", PAYLOADS)
def test_resume_of_a_run_folder_with_a_planted_payload_runs_no_code_and_stops(trained, run_copy, tmp_path, which):
    """stage.json and manifest.json both record the planted file's sha256: resume must not trust them."""
    marker = tmp_path / "pwned"
    planted = plant(run_copy, payloads(marker)[which])
    digest = sha(planted)
    result = invoke("optimize", trained.recipe, "--out", run_copy.parent, "--resume")
    assert_refused(result, marker, "stages/01-train/model.pt")
    assert "--resume" in result.stderr and "altered" in result.stderr
    assert sha(planted) == digest  # the evidence is kept, not overwritten
    assert json.loads((run_copy / "manifest.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("which", PAYLOADS)
def test_a_recipe_checkpoint_holding_a_payload_runs_no_code(tmp_path, which):
    marker = tmp_path / "pwned"
    torch.save(payloads(marker)[which], tmp_path / "weights.pt")
    recipe = write(tmp_path / "r.yaml", tiny(model={"factory": "digits_cnn", "kwargs": {"width": 8},
                                                    "checkpoint": "weights.pt"}))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--json")
    assert result.exit_code == 2 and not marker.exists()
    error = one_json(result.stdout)["error"]
    assert "weights.pt" in error["message"] and "weights-only" in error["message"] and "torch.save" in error["hint"]
    result = invoke("inspect", recipe)
    assert result.exit_code == 2 and not marker.exists() and "weights.pt" in result.stderr


@pytest.mark.parametrize("content", [b"hello\n", b"", b"PK\x03\x04garbage", bytes(range(256))])
def test_a_recipe_checkpoint_that_is_not_a_torch_file_exits_2(tmp_path, content):
    (tmp_path / "weights.pt").write_bytes(content)
    recipe = write(tmp_path / "r.yaml", tiny(model={"factory": "digits_cnn", "kwargs": {"width": 8},
                                                    "checkpoint": "weights.pt"}))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs")
    assert result.exit_code == 2, result.output
    assert "weights.pt could not be read as a weights-only state_dict" in result.stderr and "Fix:" in result.stderr
    assert "internal error" not in result.stderr


def test_npz_data_holding_pickled_objects_is_not_unpickled(tmp_path):
    marker = tmp_path / "pwned"
    np.savez(tmp_path / "data.npz", x=np.zeros((4, 64), dtype=np.float32), y=np.array([Trap(marker)] * 4, dtype=object))
    recipe = write(tmp_path / "r.yaml", tiny(data={"format": "npz", "path": "data.npz"}, model={"factory": "digits_cnn"}))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs")
    assert not marker.exists()
    assert result.exit_code == 2, result.output
    assert "data.npz" in result.stderr and "internal error" not in result.stderr


# --------------------------------------------------------------------------- 2. reproducible checkpoint bytes


def test_the_same_seed_gives_byte_identical_checkpoints(trained, tmp_path):
    result = invoke("optimize", trained.recipe, "--out", tmp_path / "again", "--json")
    assert result.exit_code == 0, result.output
    again = tmp_path / "again" / "tiny" / "stages" / "01-train" / "model.pt"
    first = trained.run_dir / "stages" / "01-train" / "model.pt"
    assert sha(again) == sha(first)
    recorded = {a["path"]: a["sha256"] for a in one_json(result.stdout)["artifacts"]}
    assert recorded["stages/01-train/model.pt"] == sha(first)


# --------------------------------------------------------------------------- 3. SIGTERM


SLOW = {"type": "train", "name": "long", "epochs": 400, "batch_size": 32, "lr": 0.05}


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_sigterm_stops_like_ctrl_c_and_resume_picks_up(tmp_path, sig):
    """SIGHUP (the terminal or ssh session closed) ended a run with no message, its manifest left `running` (issue 41):
    it is handled as SIGTERM is."""
    recipe = write(tmp_path / "r.yaml", tiny(stages=[{"type": "evaluate"}, SLOW]))
    run_dir = tmp_path / "runs" / "tiny"
    proc = cli_process("optimize", recipe, "--out", tmp_path / "runs", "--json")
    try:
        wait_for(lambda: (run_dir / "stages" / "01-evaluate" / "stage.json").is_file(), 120, "the first stage")
        time.sleep(0.5)
        proc.send_signal(getattr(signal, sig))
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert f"terminated ({sig})" in stderr and "--resume" in stderr
    payload = one_json(stdout)
    assert payload["exit_code"] == 130
    assert payload["error"] == {"type": "Terminated", "message": f"terminated ({sig})", "hint": None}
    assert [s["name"] for s in payload["stages"]] == ["evaluate"]  # the finished stage, with its metrics
    assert "accuracy" in payload["stages"][0]["metrics"] and payload["run_dir"] == str(run_dir)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and [s["id"] for s in manifest["stages"]] == ["evaluate"]
    assert not list(run_dir.rglob(".*.tmp"))  # no half-written file left
    resumed = invoke("optimize", write(tmp_path / "r.yaml", tiny(stages=[{"type": "evaluate"}, {**SLOW, "epochs": 1}])),
                     "--out", tmp_path / "runs", "--resume", "--json")
    assert resumed.exit_code == 0, resumed.output
    assert [s["resumed"] for s in one_json(resumed.stdout)["stages"]] == [True, False]


# --------------------------------------------------------------------------- 4. two runs into one folder


def test_a_second_run_into_a_folder_in_use_exits_2_and_touches_nothing(run_copy, trained):
    """The test process holds the folder (as a running `optimize` does); a second process is refused."""
    before = snapshot(run_copy)
    with run_dir_lock(run_copy):
        proc = cli_process("optimize", trained.recipe, "--out", run_copy.parent, "--json")
        stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, stderr
    error = one_json(stdout)["error"]
    assert f"run folder {run_copy} is in use by pid {os.getpid()} since " in error["message"]
    assert "another --out" in error["hint"] and "in use by pid" in stderr
    assert snapshot(run_copy) == before


@pytest.mark.slow
def test_a_lock_left_by_a_killed_run_is_taken_over_with_a_message(tmp_path):
    gone = subprocess.Popen([PYTHON, "-c", "pass"])
    gone.wait()
    lock = tmp_path / "runs" / ".tiny.lock"
    write(lock, json.dumps({"pid": gone.pid, "since": "2026-12-01T10:00:00+00:00"}))
    recipe = write(tmp_path / "r.yaml", tiny(stages=[{"type": "evaluate"}]))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs")
    assert result.exit_code == 0, result.output
    assert f"taking over the lock of pid {gone.pid}" in result.stderr
    assert lock.read_text() == ""  # released cleanly: no owner recorded
    assert json.loads((tmp_path / "runs" / "tiny" / "manifest.json").read_text())["status"] == "complete"


@pytest.mark.slow
def test_two_concurrent_runs_one_completes_intact_the_other_is_refused(tmp_path):
    # long enough to outlast the second run's start (15 epochs took 0.5 s on an idle host: the run ended first)
    recipe = write(tmp_path / "r.yaml", tiny(stages=[{"type": "evaluate"}, {**SLOW, "epochs": 300}, {"type": "evaluate", "name": "after"}]))
    out = tmp_path / "runs"
    first = cli_process("optimize", recipe, "--out", out, "--json")
    try:
        wait_for(lambda: (out / "tiny" / "stages" / "01-evaluate" / "stage.json").is_file(), 120, "the first run")
        second = invoke("optimize", recipe, "--out", out, "--json")
        running = first.poll() is None
        stdout, stderr = first.communicate(timeout=300)
    finally:
        first.kill()
    assert running, "the first run ended before the second started; make its slow stage longer"
    assert second.exit_code == 2 and f"in use by pid {first.pid}" in one_json(second.stdout)["error"]["message"]
    assert first.returncode == 0, stderr
    payload = one_json(stdout)
    assert payload["artifacts"] and all(sha(out / "tiny" / a["path"]) == a["sha256"] for a in payload["artifacts"])
    assert json.loads((out / "tiny" / "manifest.json").read_text())["status"] == "complete"


def test_an_out_folder_that_is_a_file_is_a_clear_error(tmp_path):
    write(tmp_path / "file", "not a folder")
    recipe = write(tmp_path / "r.yaml", tiny(stages=[{"type": "evaluate"}]))
    result = invoke("optimize", recipe, "--out", tmp_path / "file")
    assert result.exit_code == 2, result.output
    assert "lock" in result.stderr and "--out" in result.stderr and "internal error" not in result.stderr


# --------------------------------------------------------------------------- 5. NNCF's log after a resume (its build lock: test_nncf_build_lock.py)


@pytest.mark.slow
def test_nncf_log_lines_after_resuming_a_quantized_model_go_to_stderr(tmp_path):
    """Reproduced on main: resuming past a ptq stage and running a stage on the restored model printed NNCF's
    `INFO:nncf:Compiling and loading torch extension` lines on stdout before the JSON."""
    stages = [{"type": "train", "epochs": 1, "batch_size": 32, "lr": 0.05}, {"type": "ptq", "calibration_size": 32},
              {"type": "evaluate", "name": "first"}]
    recipe = write(tmp_path / "r.yaml", tiny(stages=stages))
    done = subprocess.run([PYTHON, "-m", "cli", "optimize", recipe, "--out", tmp_path / "runs", "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    write(recipe, tiny(stages=stages[:2] + [{"type": "evaluate", "name": "second"}]))
    again = subprocess.run([PYTHON, "-m", "cli", "optimize", recipe, "--out", tmp_path / "runs", "--json", "--resume"],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    payload = one_json(again.stdout)
    assert [s["resumed"] for s in payload["stages"]] == [True, True, False]
    # stdout is the JSON alone (one_json above). Since the qat/ptq preflight quantizes a copy at load time, inside
    # quiet_nncf, NNCF loads its extension there and says nothing on the restore at all: on neither stream.
    assert "INFO:nncf" not in again.stdout and "INFO:nncf" not in again.stderr


# --------------------------------------------------------------------------- 6. the --json contract


class NanConfig(StageConfig):
    type: Literal["nan_stage"] = Field("nan_stage", description="Reports NaN and infinite metrics.")


class NanStage(Stage):
    Config = NanConfig

    def run(self, state, ctx) -> StageResult:
        return StageResult(metrics={"loss": float("nan"), "ratio": float("inf"), "np": np.float32("nan"), "ok": 1.5})


class ExitConfig(StageConfig):
    type: Literal["exit_stage"] = Field("exit_stage", description="Calls sys.exit(0).")


class ExitStage(Stage):
    Config = ExitConfig

    def run(self, state, ctx) -> StageResult:
        sys.exit(0)


@pytest.fixture
def plugins():
    def clear():
        recipe_model.cache_clear()
        target_union.cache_clear()

    clear()
    try:
        with registry.stages.registered("nan_stage", NanStage), registry.stages.registered("exit_stage", ExitStage):
            clear()
            yield
    finally:
        clear()


FACTORY = '''
import sys
from pruneflow.zoo import ZOO
print("hello from import")

def make(mode="print"):
    print("hello from the factory")
    if mode == "exit":
        sys.exit(0)
    model = ZOO["digits_cnn"].factory(width=8)
    if mode == "forward_exit":
        model.forward = lambda x: sys.exit(0)
    return model
'''


@pytest.mark.slow
def test_user_code_printing_to_stdout_does_not_break_json(tmp_path):
    write(tmp_path / "factory.py", FACTORY)
    recipe = write(tmp_path / "r.yaml", tiny(model={"factory": "factory.py:make"}, stages=[{"type": "evaluate"}]))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--json")
    assert result.exit_code == 0, result.output
    assert one_json(result.stdout)["exit_code"] == 0
    assert "hello from the factory" in result.stderr
    dry = invoke("optimize", recipe, "--out", tmp_path / "runs", "--json", "--dry-run")
    assert one_json(dry.stdout)["exit_code"] == 0


@pytest.mark.parametrize("mode, code, where", [("exit", 2, "factory.py:make' called sys.exit(0)"),
                                                ("forward_exit", 2, "fails on a batch of the data, shape (8, 1, 8, 8) "
                                                                    "(the data's samples are (1, 8, 8)): called sys.exit(0)")])
def test_user_code_calling_sys_exit_is_an_error_with_json_never_a_silent_exit_0(tmp_path, mode, code, where):
    write(tmp_path / "factory.py", FACTORY)
    recipe = write(tmp_path / "r.yaml", tiny(model={"factory": "factory.py:make", "kwargs": {"mode": mode}},
                                             stages=[{"type": "evaluate"}]))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--json")
    assert result.exit_code == code, result.output
    payload = one_json(result.stdout)
    # at the recipe's line: the message is in the error's issue (FILE:LINE, model.factory), as every recipe error's is
    said = " ".join([payload["error"]["message"], *(i["message"] for i in payload["error"].get("issues") or [])])
    assert payload["exit_code"] == code and where in said and payload["error"]["hint"]
    assert not (tmp_path / "runs").exists()  # refused while loading the model: before any run folder


@pytest.mark.slow
def test_a_stage_calling_sys_exit_fails_with_exit_4_and_json(tmp_path, plugins):
    recipe = write(tmp_path / "r.yaml", tiny(stages=[{"type": "evaluate"}, {"type": "exit_stage"}]))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--json")
    assert result.exit_code == 4, result.output
    error = one_json(result.stdout)["error"]
    assert error["type"] == "StageError" and "stage exit_stage (exit_stage) called sys.exit(0)" in error["message"]
    manifest = json.loads((tmp_path / "runs" / "tiny" / "manifest.json").read_text())
    assert manifest["status"] == "failed" and [s["id"] for s in manifest["stages"]] == ["evaluate"]


@pytest.mark.slow
def test_nan_and_infinite_metrics_are_null_in_strict_json(tmp_path, plugins):
    recipe = write(tmp_path / "r.yaml", tiny(stages=[{"type": "nan_stage"}]))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--json")
    assert result.exit_code == 0, result.output
    stage = one_json(result.stdout)["stages"][0]
    assert stage["metrics"] == {"loss": None, "ratio": None, "np": None, "ok": 1.5}


def test_json_line_maps_every_non_finite_number():
    text = json_line({"a": [float("nan"), -float("inf")], "b": np.float64("inf"), "c": torch.tensor(float("nan")), "d": 2})
    assert json.loads(text) == {"a": [None, None], "b": None, "c": None, "d": 2}


def test_run_files_are_strict_json_with_null_for_nan(tmp_path):
    """manifest.json and metrics.json go through the same writer: a NaN or infinite metric is null there too."""
    import numpy as np

    from pruneflow.artifacts import write_json_atomic

    path = tmp_path / "metrics.json"
    write_json_atomic(path, {"a": float("nan"), "b": [float("inf"), 1.5], "c": np.float32("nan"), "d": torch.tensor(2.0)})

    def refuse(name: str):
        raise AssertionError(f"{name} in {path.name}")

    assert json.loads(path.read_text(), parse_constant=refuse) == {"a": None, "b": [None, 1.5], "c": None, "d": 2.0}
