"""Scale-out on torchrun (issue 14, items 4-5): `optimize --nproc N`, `python -m pruneflow` under DDP, `--device cuda`.

The multi-process tests start real worker processes through torch's elastic launcher (gloo on CPU) and
check what they wrote: rank 0's run folder, and rank 1's scratch run kept through PRUNEFLOW_RANK_SCRATCH.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pruneflow import distributed
from conftest import invoke, tiny_recipe_dict, write

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
#: The files of a run folder besides the manifest's artifacts and the stages' records.
RUN_FILES = {"manifest.json", "metrics.json", "report.md", "recipe.resolved.yaml", "logs/pruneflow.log"}


def _prune_recipe(**overrides) -> dict:
    """Train, prune with KD (feature KD through a projection, the widths differ), export: on 300 digits."""
    stages = [
        {"type": "train", "epochs": 1, "batch_size": 32, "lr": 0.05},
        {"type": "prune", "target": {"macs": 0.6}, "allocation": "uniform", "rounds": 2, "latency": None,
         "finetune": {"epochs": 1, "batch_size": 32}, "distill": {"alpha": 0.5, "features": ["features.0"]}},
        {"type": "export", "targets": ["onnx"], "latency": None},
    ]
    return tiny_recipe_dict(**{"name": "ddp", "threads": 1, "stages": stages, **overrides})


def _optimize(recipe: Path, out: Path, *args: str, scratch: Path | None = None, timeout: int = 300):
    """`python -m pruneflow optimize RECIPE --out OUT --json ARGS` in a child process (as a user runs it)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop(distributed.SCRATCH_ENV, None)
    if scratch is not None:
        env[distributed.SCRATCH_ENV] = str(scratch)
    start = time.perf_counter()
    # Its own process group, so a timeout ends the workers the launcher started too.
    with subprocess.Popen([PY, "-m", "pruneflow", "optimize", str(recipe), "--out", str(out), "--json", *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                          start_new_session=True) as child:
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            raise
    proc = subprocess.CompletedProcess(child.args, child.returncode, stdout, stderr)
    return proc, time.perf_counter() - start


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _metrics(stdout: str, stage: str) -> dict:
    return next(s["metrics"] for s in json.loads(stdout)["stages"] if s["name"] == stage)


def _channels(run: Path) -> list[tuple[str, int]]:
    tables = json.loads((run / "metrics.json").read_text())["tables"]["prune"]
    return [(row["layer"], row["after"]) for row in tables["channels"]]


# --------------------------------------------------------------------------- pure helpers


def test_shards_are_disjoint_cover_the_split_and_are_reproducible():
    shards = [distributed.shard_indices(301, epoch=3, seed=7, rank=r, world=2) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == 151  # padded: both ranks take as many steps
    distinct = set(shards[0].tolist()) | set(shards[1].tolist())
    assert distinct == set(range(301))
    assert len(set(shards[0].tolist()) & set(shards[1].tolist())) == 1  # only the one padding index repeats
    again = distributed.shard_indices(301, epoch=3, seed=7, rank=1, world=2)
    assert torch.equal(again, shards[1])
    assert not torch.equal(distributed.shard_indices(301, epoch=4, seed=7, rank=1, world=2), shards[1])


def test_without_a_process_group_everything_is_one_process():
    from pruneflow.data import DataBundle, Split

    data = DataBundle(train=Split(torch.zeros(10, 2), torch.zeros(10)), eval=Split(torch.zeros(2, 2), torch.zeros(2)),
                      num_classes=2, input_shape=(2,))
    model = torch.nn.Linear(2, 2)
    assert not distributed.active() and distributed.rank() == 0 and distributed.world() == 1
    assert distributed.shard(data, 1, 0) is data
    assert distributed.wrap(model, "cpu") is model
    assert distributed.global_batch_share(64) == 64
    assert distributed.from_main(lambda: {"a": torch.ones(2)})["a"].tolist() == [1.0, 1.0]
    assert distributed.finish(3) == 3


def test_the_other_ranks_run_the_recipe_up_to_its_last_training_stage(tmp_path):
    from pruneflow.recipe import load_recipe

    loaded = load_recipe(write(tmp_path / "r.yaml", _prune_recipe(gates=[{"metric": "prune.accuracy", "min": 0.1}])))
    mine = distributed.worker_recipe(loaded)
    assert [s.type for s in mine.recipe.stages] == ["train", "prune"] and mine.recipe.gates == []
    assert distributed.last_training_stage_id(loaded) == "prune"
    export_only = load_recipe(write(tmp_path / "e.yaml", tiny_recipe_dict(stages=[{"type": "export", "targets": ["onnx"]}])))
    assert distributed.worker_recipe(export_only) is None


def test_job_exit_code_is_rank_0s_or_the_first_failed_rank():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def failure(rank: int, code: int) -> ProcessFailure:
        return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=code, error_file="")

    said: list[str] = []
    assert distributed._job_code({0: failure(0, 1)}, said.append) == 1 and said == []
    assert distributed._job_code({0: failure(0, 130), 1: failure(1, 4)}, said.append) == 130
    assert "worker rank 1 (exit code 4) failed" in said[0]
    assert distributed._job_code({1: failure(1, 4)}, said.append) == 4
    assert distributed._job_code({1: failure(1, -9)}, said.append) == 4 and "rank 1 (signal 9)" in said[2]


# --------------------------------------------------------------------------- the CLI


def test_device_cuda_without_cuda_is_exit_3_before_any_work(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for machines without it")
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict())
    out = tmp_path / "runs"
    result = invoke("optimize", recipe, "--out", out, "--device", "cuda")
    assert result.exit_code == 3
    assert "no CUDA device" in result.output and "--device cpu" in result.output
    assert not out.exists()  # nothing was written
    recipe_cuda = write(tmp_path / "c.yaml", tiny_recipe_dict(device="cuda"))  # the recipe's own field, too
    assert invoke("optimize", recipe_cuda, "--out", out).exit_code == 3 and not out.exists()


def test_resume_with_nproc_is_a_usage_error(tmp_path):
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict())
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--nproc", "2", "--resume")
    assert result.exit_code == 2 and "--resume is not supported with --nproc" in result.output
    assert not (tmp_path / "runs").exists()


def test_more_processes_or_threads_than_cpus_are_refused_before_any_work(tmp_path):
    """`--nproc 64` on 2 cores had the launcher killed for memory and 35 orphaned workers holding 5.9 GB;
    `--set threads=100000` passed validate and then segfaulted torch (exit 139, no message). Both are exit 2 now,
    before a worker starts or a file is written."""
    from pruneflow.config import usable_cpus

    cpus = usable_cpus()
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict())
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--nproc", str(cpus + 1))
    assert result.exit_code == 2, result.output
    assert f"--nproc {cpus + 1}" in result.output and f"use --nproc {cpus} or fewer" in " ".join(result.output.split())
    for command in (("validate", recipe), ("optimize", recipe, "--out", tmp_path / "runs")):
        result = invoke(*command, "--set", "threads=100000")
        text = " ".join(result.output.split())
        assert result.exit_code == 2 and "threads" in text and f"{cpus} CPU(s)" in text, result.output
    assert not (tmp_path / "runs").exists()


def test_python_dash_m_pruneflow_is_the_cli():
    proc = subprocess.run([PY, "-m", "pruneflow", "--version"], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
    assert proc.returncode == 0 and proc.stdout.startswith("pruneflow ")


@pytest.mark.slow
def test_two_processes_train_and_prune_identically_and_rank_0_alone_writes(tmp_path):
    """`--nproc 2` (gloo): rank 1's checkpoints (train, prune with KD, NNCF QAT) equal rank 0's byte for byte (same
    structure, same weights, same quantizer ranges), the run folder holds each file once with an intact manifest,
    and rank 1 ran neither the export nor the report."""
    recipe_dict = _prune_recipe()
    recipe_dict["stages"].insert(2, {"type": "qat", "schedule": [{"precision": "int8", "epochs": 1}], "calibration_size": 64,
                                     "freeze_bn_after": 0})
    recipe = write(tmp_path / "r.yaml", recipe_dict)
    scratch = tmp_path / "scratch"
    proc, _ = _optimize(recipe, tmp_path / "runs", "--nproc", "2", scratch=scratch)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)  # rank 0 alone printed: one JSON object on stdout
    run = tmp_path / "runs" / "ddp"
    mine = scratch / "rank1" / "ddp"
    for stage in ("01-train", "02-prune", "03-qat"):
        assert _sha(run / "stages" / stage / "model.pt") == _sha(mine / "stages" / stage / "model.pt")
    assert not (mine / "export").exists() and not (mine / "stages" / "04-export").exists()
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "complete"
    assert [s["id"] for s in manifest["stages"]] == ["train", "prune", "qat", "export"]
    for artifact in manifest["artifacts"]:
        assert _sha(run / artifact["path"]) == artifact["sha256"]
    assert sorted(a["path"] for a in summary["artifacts"]) == sorted(a["path"] for a in manifest["artifacts"])
    files = set(_files(run))
    recorded = {a["path"] for a in manifest["artifacts"]} | {f"stages/{s}/stage.json" for s in ("01-train", "02-prune", "03-qat", "04-export")}
    assert files - recorded == RUN_FILES, files - recorded  # nothing unrecorded, nothing twice
    assert len([f for f in files if f.endswith("model.pt")]) == 3
    log = (run / "logs" / "pruneflow.log").read_text()
    assert log.count("stage prune (prune) started") == 1  # one writer of the run's log
    assert not list(tmp_path.glob("runs/*.tmp*")) and sorted(p.name for p in (tmp_path / "runs").iterdir()) == [".ddp.lock", "ddp"]


@pytest.mark.slow
def test_a_failing_rank_ends_the_job_with_a_clear_error_not_a_hang(tmp_path):
    """Rank 1's model raises in its first training step: the launcher stops rank 0 too, exit non-zero (a hang
    would run into the child's timeout: a guard against hanging forever, not a speed bound)."""
    factory = write(tmp_path / "flaky.py", (
        "import os\nfrom pruneflow.zoo import digits_cnn\nfrom torch import nn\n\n\n"
        "class Flaky(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.net = digits_cnn(width=8)\n\n"
        "    def forward(self, x):\n        if self.training and os.environ.get('RANK') == '1':\n"
        "            raise RuntimeError('rank 1 lost its data')\n        return self.net(x)\n\n\n"
        "def build():\n    return Flaky()\n"))
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict(name="flaky", model={"factory": f"{factory}:build"}, threads=1))
    proc, _ = _optimize(recipe, tmp_path / "runs", "--nproc", "2", timeout=180)
    assert proc.returncode == 4, proc.stderr[-3000:]
    assert "rank 1 lost its data" in proc.stderr
    assert "worker rank 1 (exit code 4) failed" in proc.stderr
    assert "lost contact with the other ranks" in proc.stderr  # rank 0, when its collective failed first
    manifest = json.loads((tmp_path / "runs" / "flaky" / "manifest.json").read_text())
    assert manifest["status"] in ("failed", "interrupted")


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
    """The acceptance check: all 1,437 training digits, 6 epochs, then prune to 60 % of the MACs; `--nproc 2`
    gives the same pruned structure and accuracy within 0.5 pt of one process."""
    recipe_dict = _prune_recipe(data={"format": "digits"})
    recipe_dict["stages"][0].update(epochs=6, eval_every=0)
    recipe_dict["stages"][1].update(rounds=1)
    recipe = write(tmp_path / "r.yaml", recipe_dict)
    one, one_s = _optimize(recipe, tmp_path / "one")
    two, two_s = _optimize(recipe, tmp_path / "two", "--nproc", "2")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr[-2000:], two.stderr[-2000:])
    a, b = _metrics(one.stdout, "prune"), _metrics(two.stdout, "prune")
    assert _channels(tmp_path / "one" / "ddp") == _channels(tmp_path / "two" / "ddp")
    assert a["macs"] == b["macs"] and a["params"] == b["params"]
    assert abs(a["accuracy"] - b["accuracy"]) <= 0.005, (a["accuracy"], b["accuracy"])
    print(f"1 process: {one_s:.1f} s, accuracy {a['accuracy']:.4f}; 2 processes: {two_s:.1f} s, accuracy {b['accuracy']:.4f}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False on this "
                    "machine (see DEVELOPERS.md, 'GPU tests')")
def test_device_cuda_trains_prunes_and_quantizes_on_the_gpu(tmp_path):
    """`--device cuda`: the run's stages train on the GPU (the checkpoints' accuracy is measured there) and the
    run folder is complete; with two GPUs, `--nproc 2` runs the same recipe under nccl."""
    recipe_dict = _prune_recipe()
    recipe_dict["stages"].insert(2, {"type": "qat", "schedule": [{"precision": "int8", "epochs": 1}], "calibration_size": 64})
    recipe = write(tmp_path / "r.yaml", recipe_dict)
    proc, _ = _optimize(recipe, tmp_path / "runs", "--device", "cuda")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resolved = (tmp_path / "runs" / "ddp" / "recipe.resolved.yaml").read_text()
    assert "device: cuda" in resolved
    assert _metrics(proc.stdout, "qat")["accuracy"] > 0
    if torch.cuda.device_count() >= 2:
        proc, _ = _optimize(recipe, tmp_path / "nccl", "--device", "cuda", "--nproc", "2")
        assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("value", ["abc", "0", "-5", "1.5"])
def test_a_bad_timeout_in_the_environment_is_one_error_from_the_launcher(tmp_path, monkeypatch, value):
    """`--nproc 2 --json` with PRUNEFLOW_DIST_TIMEOUT=abc printed two JSON objects (one a rank) and exited 4 (issue 41):
    the launcher reads it before any worker starts."""
    monkeypatch.setenv("PRUNEFLOW_DIST_TIMEOUT", value)
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict())
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--nproc", "2", "--json")
    assert result.exit_code == 2, result.output
    [line] = result.stdout.strip().splitlines()
    error = json.loads(line)["error"]
    assert error["type"] == "UsageError" and f"PRUNEFLOW_DIST_TIMEOUT={value!r}" in error["message"]
    assert not (tmp_path / "runs").exists()
