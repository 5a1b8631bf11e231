"""A resumed run on a changed host says so and measures again what depends on the host (issue 41).

`--resume` in a folder a run left on another machine reused every stage, the export's timed choices with them, and
rewrote the manifest's `host` with this machine's, so its latency figures and choices read as measured here. Now the
stages that time or choose by timing (export; a stage with `latency`) carry the host in their resume key and run again,
the others are reused, a warning names what changed, and manifest.json keeps the earlier host under `earlier_hosts`.
"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import invoke, runs_a_recipe, tiny_recipe_dict, write
from pruneflow.runtime import host_info, timing_host

OTHER = {"cpu": {"model": "Some Other CPU @ 2.0GHz", "arch": "x86_64", "isa": ["avx2", "fma"], "logical_cpus": 64,
                 "usable_cpus": 64}, "os": "Linux", "python": "3.11", "gpus": [], "versions": {}}


@pytest.fixture(scope="module")
@runs_a_recipe
def finished(tmp_path_factory):
    root = tmp_path_factory.mktemp("host")
    recipe = write(root / "tiny.yaml", tiny_recipe_dict())
    result = invoke("optimize", recipe, "--out", root / "runs", "--quiet")
    assert result.exit_code == 0, result.output
    return recipe, root / "runs" / "tiny"


def _stages(result) -> dict[str, bool]:
    return {s["name"]: s["resumed"] for s in json.loads(result.stdout)["stages"]}


def _resumed(run) -> dict[str, bool]:
    """Each stage of the last run in ``run``: reused (True) or run again (False), as its log says."""
    log = (run / "logs" / "pruneflow.log").read_text().split("run tiny: task")[-1]
    return {name: f"stage {name} finished in 0.0s (resumed)" in log for name in ("train", "evaluate", "export")}


def test_a_resume_on_another_host_says_so_measures_again_and_keeps_the_earlier_host(finished, tmp_path):
    recipe, run = finished
    copy = tmp_path / "runs" / "tiny"
    shutil.copytree(run, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["host"] = OTHER
    (copy / "manifest.json").write_text(json.dumps(manifest))
    result = invoke("optimize", recipe, "--out", copy.parent, "--resume")
    assert result.exit_code == 0, result.output
    text = " ".join(result.stderr.split())
    assert "--resume on another host" in text and "'Some Other CPU @ 2.0GHz' ->" in text and "earlier_hosts" in text
    assert "--resume on another host" in (copy / "logs" / "pruneflow.log").read_text()
    assert _resumed(copy) == {"train": True, "evaluate": True, "export": False}  # export times and chooses: again
    after = json.loads((copy / "manifest.json").read_text())
    assert after["earlier_hosts"] == [OTHER] and timing_host(after["host"]) == timing_host(host_info())


def test_a_resume_on_the_same_host_reuses_every_stage_and_records_no_earlier_host(finished, tmp_path):
    recipe, run = finished
    copy = tmp_path / "runs" / "tiny"
    shutil.copytree(run, copy)
    result = invoke("optimize", recipe, "--out", copy.parent, "--resume", "--json")
    assert result.exit_code == 0, result.output
    assert "another host" not in result.stderr
    assert _stages(result) == {"train": True, "evaluate": True, "export": True}
    assert "earlier_hosts" not in json.loads((copy / "manifest.json").read_text())
