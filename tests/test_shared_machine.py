"""Safe on a shared machine (issue 27, item 1): every file pruneflow writes is created, never followed. A symlink,
FIFO, device or folder planted at an output path or at the run lock is refused with exit 2 and its path named,
and what it points to is left as it was (a link at the lock had emptied any file; `schema --out` and `bench
--json FILE` had replaced a link or a character device with a regular file)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import invoke, tiny_recipe_dict, write

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def victim(tmp_path):
    """A file outside the run folder that a planted link points at, and its content."""
    path = tmp_path / "elsewhere" / "precious.txt"
    path.parent.mkdir()
    path.write_text("keep me\n")
    return path


def test_a_link_planted_at_the_run_lock_is_refused_and_its_target_kept(tmp_path, victim):
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict())
    out = tmp_path / "runs"
    out.mkdir()
    (out / ".tiny.lock").symlink_to(victim)
    result = invoke("optimize", recipe, "--out", out)
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and ".tiny.lock is a symbolic link" in text, result.output
    assert victim.read_text() == "keep me\n" and not (out / "tiny").exists()


@pytest.mark.parametrize("plant", ["symlink", "fifo", "folder"])
def test_an_output_path_holding_something_else_than_a_regular_file_is_refused(tmp_path, victim, plant):
    target = tmp_path / "schema.json"
    if plant == "symlink":
        target.symlink_to(victim)
    elif plant == "fifo":
        os.mkfifo(target)
    else:
        target.mkdir()
    result = invoke("schema", "--out", target)
    kind = {"symlink": "a symbolic link", "fifo": "a FIFO", "folder": "a folder"}[plant]
    assert result.exit_code == 2 and f"is {kind}" in " ".join(result.output.split()), result.output
    assert victim.read_text() == "keep me\n"
    assert target.is_symlink() if plant == "symlink" else (target.is_fifo() if plant == "fifo" else target.is_dir())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".schema.json.")]  # no temporary file left


def test_a_regular_file_is_still_replaced_whole(tmp_path):
    target = tmp_path / "schema.json"
    target.write_text("old")
    assert invoke("schema", "--out", target).exit_code == 0
    assert target.read_text().startswith("{") and not target.is_symlink()


@pytest.mark.slow  # a subprocess, so that a regression blocks the child, not the test session (~5 s)
def test_a_data_path_that_is_a_fifo_is_refused_instead_of_blocking_forever(tmp_path):
    os.mkfifo(tmp_path / "rows.csv")
    recipe = tiny_recipe_dict(data={"format": "csv", "path": "rows.csv", "label_column": "y"})
    (tmp_path / "r.yaml").write_text(json.dumps(recipe))
    proc = subprocess.run([sys.executable, "-m", "pruneflow", "optimize", str(tmp_path / "r.yaml"), "--out", str(tmp_path / "runs")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    text = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "rows.csv is a FIFO, not a file" in text, proc.stderr[-2000:]


@pytest.mark.parametrize("factory", ["os:system", "subprocess:run", "builtins:eval", "helpers.py:system"])
def test_a_factory_from_the_standard_library_is_refused_before_anything_runs(tmp_path, factory):
    """`factory: os:system` with `kwargs: {command: ...}` was accepted: the recipe ran a shell command as its model.
    A user module re-exporting one (`from os import system`) is refused the same way."""
    (tmp_path / "helpers.py").write_text("from os import system\n")
    marker = tmp_path / "ran"
    recipe = tiny_recipe_dict(model={"factory": factory, "kwargs": {"command": f"touch {marker}"}})
    (tmp_path / "r.yaml").write_text(json.dumps(recipe))
    for command in (("validate", tmp_path / "r.yaml"), ("optimize", tmp_path / "r.yaml", "--out", tmp_path / "runs")):
        result = invoke(*command)
        text = " ".join(result.output.split())
        assert result.exit_code == 2 and "standard library" in text, result.output
    assert not marker.exists() and not (tmp_path / "runs").exists()


FACTORY_WITH_SIDE_EFFECT = """\
from pathlib import Path
Path({marker!r}).write_text("imported")
import torch

def build(num_classes=10):
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, num_classes))
"""


def test_validate_and_dry_run_read_a_factory_file_without_running_it(tmp_path):
    """`validate` and `--dry-run` imported a factory file that lives outside the recipe's folder, running its
    top-level code (issue 27, item 2). Now the file is parsed, never imported: the name is checked, nothing runs."""
    outside, recipes = tmp_path / "elsewhere", tmp_path / "recipes"
    outside.mkdir(), recipes.mkdir()
    marker = tmp_path / "ran"
    (outside / "evil.py").write_text(FACTORY_WITH_SIDE_EFFECT.format(marker=str(marker)))
    recipe = tiny_recipe_dict(model={"factory": "../elsewhere/evil.py:build", "kwargs": {"num_classes": 10}})
    (recipes / "r.yaml").write_text(json.dumps(recipe))
    trusted = ("--trust-code", outside / "evil.py:build")  # outside the recipe's folder: runs only when trusted (issue 41)
    for command in (("validate", recipes / "r.yaml", *trusted), ("optimize", recipes / "r.yaml", "--dry-run", *trusted)):
        result = invoke(*command)
        assert result.exit_code == 0, result.output
        assert f"this recipe runs code: {outside / 'evil.py'}:build" in " ".join(result.output.split())
    assert not marker.exists()


@pytest.mark.parametrize("source, expected", [
    ("def other():\n    pass\n", "defines no 'build' at top level"),
    ("def build(:\n", "does not parse as Python"),
    ("from os import system as build\n", "standard library"),
])
def test_a_factory_file_that_cannot_give_the_factory_is_refused_without_running_it(tmp_path, source, expected):
    (tmp_path / "m.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n" + source)
    (tmp_path / "r.yaml").write_text(json.dumps(tiny_recipe_dict(model={"factory": "m.py:build"})))
    result = invoke("validate", tmp_path / "r.yaml")
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and expected in text and "model.factory" in text, result.output
    assert not (tmp_path / "ran").exists()


def test_a_factory_bound_by_a_star_import_is_left_to_the_run_and_said_so(tmp_path):
    (tmp_path / "m.py").write_text("from torch.nn import *\n")
    (tmp_path / "r.yaml").write_text(json.dumps(tiny_recipe_dict(model={"factory": "m.py:build"})))
    result = invoke("validate", tmp_path / "r.yaml")
    assert result.exit_code == 0 and "checked when the model is built" in " ".join(result.output.split()), result.output


def _tiny_onnx(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def _run_folder(root: Path, rel: str, size: int | None = None) -> Path:
    """A run folder whose manifest lists one built ONNX artifact at ``rel`` (what `bench` and `inspect` read)."""
    run = root / "run"
    (run / "export" / "onnx").mkdir(parents=True)
    real = _tiny_onnx(run / "export" / "onnx" / "model.fp32.onnx")
    entry = {"path": rel, "kind": "model", "target": "onnx", "precision": "fp32", "status": "built",
             "size_bytes": real.stat().st_size if size is None else size}
    (run / "manifest.json").write_text(json.dumps({"format": "pruneflow-manifest/1", "recipe": "r", "artifacts": [entry]}))
    return run


@pytest.mark.parametrize("case", ["outside", "link_out", "absolute", "replaced", "fifo"])
def test_bench_reads_a_run_folder_only_inside_itself(tmp_path, victim, case):
    """`bench` followed an artifact link to a 6 GiB file elsewhere, and with the manifest's path edited timed
    another run's model under this run's name (issue 27, item 3). A path leading out of the run folder (directly,
    through a link, absolute), to a FIFO, or a file whose bytes differ from the manifest's is refused, named."""
    other = _tiny_onnx(tmp_path / "elsewhere" / "other.onnx")
    rel = {"outside": "../elsewhere/other.onnx", "link_out": "export/onnx/link.onnx", "absolute": str(other),
           "replaced": "export/onnx/model.fp32.onnx", "fifo": "export/onnx/pipe.onnx"}[case]
    run = _run_folder(tmp_path, rel, size=7 if case == "replaced" else None)
    if case == "link_out":
        (run / rel).symlink_to(other)
    if case == "fifo":
        os.mkfifo(run / rel)
    result = invoke("bench", run, "--runs", "1", "--warmup", "0")
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "manifest.json" in text, result.output
    assert ("replaced after the run" if case == "replaced" else "not a regular file" if case == "fifo"
            else "outside the run folder" if case != "absolute" else "not a path inside the run folder") in text, result.output
    assert "Traceback" not in result.output


def test_bench_of_a_well_formed_run_folder_still_times_it(tmp_path):
    run = _run_folder(tmp_path, "export/onnx/model.fp32.onnx")
    result = invoke("bench", run, "--runs", "2", "--warmup", "1", "--json")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("content", [b'{"artifacts": [', b"[1, 2]", b"\xff\xfe"])
def test_a_truncated_or_foreign_manifest_is_a_one_paragraph_error(tmp_path, content):
    """`inspect` and `bench` printed a traceback on a truncated manifest (issue 27, item 6)."""
    run = _run_folder(tmp_path, "export/onnx/model.fp32.onnx")
    (run / "manifest.json").write_bytes(content)
    (run / "recipe.resolved.yaml").write_text(json.dumps(tiny_recipe_dict(model={"factory": "digits_cnn"})))
    for command in (("bench", run), ("inspect", run)):
        result = invoke(*command)
        assert result.exit_code == 2 and "manifest.json" in result.output and "Traceback" not in result.output, result.output


def test_a_manifest_past_32_mb_is_refused_before_it_is_read(tmp_path):
    """docs/security.md: a record larger than 32 MB is refused (a run's is kilobytes), sized before it is parsed."""
    from pruneflow.artifacts import MAX_RECORD_BYTES

    run = _run_folder(tmp_path, "export/onnx/model.fp32.onnx")
    with open(run / "manifest.json", "wb") as fh:  # sparse: 33 MB of nothing on disk
        fh.truncate(MAX_RECORD_BYTES + 1)
    result = invoke("bench", run)
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and f"more than a run's record ever does ({MAX_RECORD_BYTES:,})" in text, result.output


def test_a_run_folder_that_is_a_link_is_refused_before_anything_runs(tmp_path, victim):
    """OUT/NAME a symlink to a folder holding a manifest: the whole run went by, then `rmtree` refused the link and
    the run ended in an internal error (issue 27, item 6). It is refused up front; the folder it points to is kept."""
    (victim.parent / "manifest.json").write_text("{}")
    (victim.parent / "recipe.resolved.yaml").write_text("")
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict())
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "tiny").symlink_to(victim.parent)
    result = invoke("optimize", recipe, "--out", tmp_path / "runs")
    assert result.exit_code == 2 and "symbolic link" in " ".join(result.output.split()), result.output
    assert sorted(p.name for p in victim.parent.iterdir()) == ["manifest.json", "precious.txt", "recipe.resolved.yaml"]
    assert victim.read_text() == "keep me\n"


def test_an_immutable_run_folder_is_refused_before_anything_runs(tmp_path):
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict())
    run = tmp_path / "runs" / "tiny"
    run.mkdir(parents=True)
    (run / "manifest.json").write_text("{}")
    (run / "recipe.resolved.yaml").write_text("")
    import shutil

    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(run)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not allowed here")
    try:
        result = invoke("optimize", recipe, "--out", tmp_path / "runs")
    finally:
        subprocess.run(["chattr", "-i", str(run)], capture_output=True)
    assert result.exit_code == 2 and "immutable" in " ".join(result.output.split()), result.output


def test_nproc_with_json_on_a_recipe_that_cannot_start_prints_one_json_object_and_starts_no_worker(tmp_path):
    """Each rank checked the recipe itself: an early error was printed by every worker (issue 27, item 6). The
    launcher now runs the checks first, so the error comes once, as one JSON object, and no worker is started."""
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict(model={"factory": "digits_cnn", "checkpoint": "missing.pt"}))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--nproc", "2", "--json")
    lines = [ln for ln in result.stdout.splitlines() if ln.strip()]
    assert result.exit_code == 2 and len(lines) == 1, result.output
    payload = json.loads(lines[0])
    assert payload["exit_code"] == 2 and payload["error"]["issues"][0]["path"] == "model.checkpoint"
    assert "worker" not in result.stderr and not (tmp_path / "runs").exists()


@pytest.mark.slow  # runs a tiny recipe twice (~10 s)
@pytest.mark.parametrize("writer", ["onnx", "openvino"])
def test_a_disk_that_fills_during_export_is_exit_4_with_the_free_space(tmp_path, monkeypatch, writer):
    """A disk that filled during export was exit 1 ("gate failed", hint "try exporter: dynamo"): the exporter's
    error was kept on a failed artifact (issue 27, item 6). OpenVINO's writer says only "iostream error". Both are
    now exit 4, "disk full at ...", with the free space, no file half-written, and --resume finishes the run."""
    import errno
    import shutil

    import openvino
    import torch

    if writer == "onnx":
        def full(model, args, f, *a, **k):
            Path(f).write_bytes(b"half an onnx")
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(torch.onnx, "export", full)
    else:
        usage = shutil.disk_usage

        def iostream(*a, **k):
            raise RuntimeError("basic_ios::clear: iostream error")

        monkeypatch.setattr(openvino, "save_model", iostream)
        monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(p)._replace(free=4096))
    recipe = tiny_recipe_dict()
    recipe["stages"][-1]["targets"] = ["onnx", "openvino"]
    path = write(tmp_path / "r.yaml", recipe)
    result = invoke("optimize", path, "--out", tmp_path / "runs", "--json")
    text = " ".join(result.stderr.split())
    assert result.exit_code == 4 and "disk full at" in text and "MB free" in text, result.output
    assert "dynamo" not in text and json.loads(result.stdout)["error"]["type"] == "StageError"
    run = tmp_path / "runs" / "tiny"
    assert not [p for p in run.rglob("*") if p.is_file() and ".tmp" in p.name]
    monkeypatch.undo()
    again = invoke("optimize", path, "--out", tmp_path / "runs", "--resume")
    assert again.exit_code == 0, again.output
    assert (run / "export" / "onnx" / "model.fp32.onnx").is_file() and (run / "export" / "openvino" / "model.fp32.xml").is_file()


def test_a_batch_that_cannot_fit_in_memory_is_refused_before_it_is_made(tmp_path):
    """`bench --batch 1000000000` grew until the kernel killed it (issue 27, item 4): the batch is sized first."""
    from pruneflow.config import available_memory

    model = _tiny_onnx(tmp_path / "m.onnx")
    huge = max(10**9, (available_memory() or 0) // 16 + 1)  # 16 bytes a sample: more than all the memory there is
    result = invoke("bench", model, "--batch", f"1,{huge}", "--runs", "1")
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and f"--batch {huge}" in text and "GB available" in text and "use --batch" in text, result.output


def _workers_of(launcher: int) -> list[int]:
    """Pids of the processes whose environment names ``launcher`` as their --nproc launcher."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and f"PRUNEFLOW_LAUNCHER_PID={launcher}".encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


@pytest.mark.slow  # starts 2 workers (~20 s)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_killing_the_nproc_launcher_leaves_no_worker_behind(tmp_path):
    """`--nproc 64` on 2 cores: the launcher was killed for memory and 35 orphaned workers kept 5.9 GB for more
    than 11 minutes (issue 27, item 4). Each worker now dies with its launcher, whatever killed it."""
    import signal
    import time

    recipe = tiny_recipe_dict(stages=[{"type": "train", "epochs": 500, "batch_size": 32, "lr": 0.05}])
    path = write(tmp_path / "r.yaml", recipe)
    launcher = subprocess.Popen([sys.executable, "-m", "pruneflow", "optimize", str(path), "--out", str(tmp_path / "runs"),
                                 "--nproc", "2", "--quiet"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while len(_workers_of(launcher.pid)) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.5)
        workers = _workers_of(launcher.pid)
        assert len(workers) == 2, "the workers never started"
        time.sleep(3)  # past their start-up, into training
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 30
        while _workers_of(launcher.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not _workers_of(launcher.pid), "workers outlived their launcher"
    finally:
        for pid in _workers_of(launcher.pid):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.slow  # a tiny recipe through QAT, then its export again (~30 s)
def test_a_resumed_export_writes_the_same_bytes_as_an_uninterrupted_run(tmp_path):
    """A resumed export wrote the fp32 ONNX with its initializers in another order (the model rebuilt from its
    checkpoint registers a pruned layer's weight and bias the other way round), so its bytes differed from an
    uninterrupted run's (issue 27, item 7). Every artifact of the resumed run now has the same sha256."""
    import hashlib
    import shutil

    stages = [{"type": "train", "epochs": 1, "batch_size": 32, "lr": 0.05},
              {"type": "prune", "importance": "magnitude", "target": {"macs": 0.7}, "rounds": 1,
               "finetune": {"epochs": 1, "batch_size": 32}},
              {"type": "calibrate", "size": 64},
              {"type": "qat", "schedule": [{"precision": "int8", "epochs": 1}]},
              # `form: auto` and `int8_hint: auto` time candidates and may choose differently in two runs (the IR's
              # deployment record names the hint chosen); this is about the bytes of one form at one hint
              {"type": "export", "targets": [{"type": "onnx", "form": "u8s8"},
                                             {"type": "openvino", "form": "u8s8", "int8_hint": "f32"}],
               "precisions": ["fp32", "int8"], "latency": None}]
    path = write(tmp_path / "r.yaml", tiny_recipe_dict(stages=stages))
    assert invoke("optimize", path, "--out", tmp_path / "a").exit_code == 0
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    resumed = tmp_path / "b" / "tiny"
    shutil.rmtree(resumed / "export")
    shutil.rmtree(resumed / "stages" / "05-export")
    result = invoke("optimize", path, "--out", tmp_path / "b", "--resume")
    assert result.exit_code == 0, result.output

    def digests(run: Path) -> dict[str, str]:
        return {p.relative_to(run).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(run.rglob("*"))
                if p.suffix in (".onnx", ".xml", ".bin", ".pt")}

    first = digests(tmp_path / "a" / "tiny")
    assert "export/onnx/model.fp32.onnx" in first and digests(resumed) == first


def fake_cgroup(monkeypatch, tmp_path: Path, self_cgroup: str, group: str, limit: int, used: int) -> None:
    """This process's /proc/self/cgroup reads ``self_cgroup``; ``group`` (under a fake /sys/fs/cgroup) holds a memory
    limit of ``limit`` bytes with ``used`` in use (v1 file names under ``memory/``, else v2's)."""
    from pruneflow import config

    proc, root = tmp_path / "proc-self-cgroup", tmp_path / "sys-fs-cgroup"
    proc.write_text(self_cgroup)
    folder = root / group
    folder.mkdir(parents=True)
    v1 = group.startswith("memory/")
    (folder / ("memory.limit_in_bytes" if v1 else "memory.max")).write_text(f"{limit}\n")
    (folder / ("memory.usage_in_bytes" if v1 else "memory.current")).write_text(f"{used}\n")
    monkeypatch.setattr(config, "SELF_CGROUP", proc)
    monkeypatch.setattr(config, "CGROUP_ROOT", root)


@pytest.mark.parametrize("self_cgroup, group", [("0::/user.slice/job7\n", "user.slice/job7"),
                                                ("12:pids:/job7\n4:cpu,memory:/job7\n0::/\n", "memory/job7")])
def test_available_memory_is_the_limit_of_this_processs_own_cgroup_v1_and_v2(tmp_path, monkeypatch, self_cgroup, group):
    """config.available_memory read only the root cgroup v2's memory.max: a job's own group (a nested v2 group, or
    v1's memory controller) was not seen, so the npz check and every other bound used the machine's memory."""
    from pruneflow import config

    fake_cgroup(monkeypatch, tmp_path, self_cgroup, group, limit=64 * 2**20, used=16 * 2**20)
    assert config.available_memory() == 48 * 2**20
    assert config.memory_left() == (48 * 2**20, "under this container's memory limit (cgroup)")
    (tmp_path / "proc-self-cgroup").write_text("0::/\n")  # the root group: no limit there, the machine's figure
    assert config.available_memory() == config.machine_memory()


def test_an_npz_that_inflates_beyond_memory_is_refused_before_it_is_read(tmp_path, monkeypatch):
    """An .npz is read whole: a small file of zeros that inflates to more than the machine has grew until the
    process was killed; its zip directory now tells the size first (issue 27, item 4). The process here is put in a
    (fake) 4 MiB cgroup v1, so that the file need not be gigabytes: the limit of the process's own group counts, not
    the root's (issue 41, item 3)."""
    fake_cgroup(monkeypatch, tmp_path, "4:memory:/ci/job7\n", "memory/ci/job7", limit=4 * 2**20, used=0)
    bomb = tmp_path / "bomb.npz"
    np.savez_compressed(bomb, image=np.zeros((16384, 1, 8, 8), np.float32), label=np.zeros(16384, np.int64))
    assert bomb.stat().st_size < 100_000
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict(data={"format": "npz", "path": str(bomb)}))
    result = invoke("optimize", recipe, "--out", tmp_path / "runs")
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "under this container's memory limit (cgroup)" in text and "bomb.npz" in text, result.output
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("command", ["init --force", "bench --json", "bench --html", "bench --prometheus"])
def test_every_command_that_writes_a_named_file_refuses_a_planted_link(tmp_path, victim, command):
    """`init --force`, `bench --json/--html/--prometheus FILE` replaced a link (or a device) with a regular file."""
    link = tmp_path / "out.file"
    link.symlink_to(victim)
    if command == "init --force":
        args = ("init", "quickstart", link, "--force")
    else:
        args = ("bench", _tiny_onnx(tmp_path / "m.onnx"), "--runs", "1", "--warmup", "0", f"{command.split()[1]}={link}")
    result = invoke(*args)
    assert result.exit_code == 2 and "is a symbolic link" in " ".join(result.output.split()), result.output
    assert link.is_symlink() and victim.read_text() == "keep me\n"


def test_inspect_reads_no_checkpoint_outside_the_run_folder(tmp_path, victim):
    """`inspect RUN` followed an edited manifest's checkpoint path out of the run folder (issue 27, item 3)."""
    run = _run_folder(tmp_path, "export/onnx/model.fp32.onnx")
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["artifacts"].append({"path": "../elsewhere/precious.txt", "kind": "checkpoint", "size_bytes": 8})
    (run / "manifest.json").write_text(json.dumps(manifest))
    (run / "recipe.resolved.yaml").write_text(json.dumps(tiny_recipe_dict(model={"factory": "digits_cnn"})))
    result = invoke("inspect", run)
    assert result.exit_code == 2 and "outside the run folder" in " ".join(result.output.split()), result.output


def test_an_out_folder_name_too_long_for_the_file_system_is_one_paragraph(tmp_path):
    """A 256-byte --out component ended in a traceback (issue 27, item 6)."""
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict())
    result = invoke("optimize", recipe, "--out", tmp_path / ("a" * 256))
    assert result.exit_code == 2 and "File name too long" in result.output and "Traceback" not in result.output, result.output


def test_a_teachers_factory_is_checked_the_same_way_and_located(tmp_path):
    (tmp_path / "t.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w')\n")
    stages = [{"type": "prune", "target": {"macs": 0.8}, "teacher": {"factory": "t.py:teacher"}}]
    (tmp_path / "r.yaml").write_text(json.dumps(tiny_recipe_dict(stages=stages)))
    result = invoke("validate", tmp_path / "r.yaml")
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "stages.0.teacher.factory" in text and "defines no 'teacher'" in text, result.output
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("setting", [None, "on"])
def test_openvino_and_nncf_telemetry_stay_off_unless_asked_for(tmp_path, setting):
    """OpenVINO's converter and NNCF phone google-analytics from a thread; offline, that thread held glibc's resolver
    lock and a forked child deadlocked. Importing pruneflow leaves both on their no-op stubs."""
    probe = ("import pruneflow, openvino.tools.ovc.convert_impl as ovc, nncf.telemetry.wrapper as w; "
             "print(ovc.tm.__name__, type(w.telemetry).__name__)")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "NNCF_CI", "PRUNEFLOW_OPENVINO_TELEMETRY")}
    if setting:
        env["PRUNEFLOW_OPENVINO_TELEMETRY"] = setting
    # the user's own answer, declined: with telemetry left on, the real senders load but this test sends nothing
    (tmp_path / "intel").mkdir()
    (tmp_path / "intel" / "openvino_telemetry").write_text("0\n")
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "HOME": str(tmp_path)}, cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout.split()
    if setting:
        assert out == ["openvino_telemetry", "NNCFTelemetry"]  # what the user configured: the real senders
    else:
        assert out[0] == "openvino.tools.ovc.telemetry_stub" and out[1] != "NNCFTelemetry"
