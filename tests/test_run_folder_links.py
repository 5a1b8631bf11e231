"""A run folder reused by `--resume` cannot steer a write out of it (issue 41, item 2).

`logs/pruneflow.log` linked to a victim file had the run's log appended to it; a linked `stages/01-train` or
`export/onnx` folder received `model.pt` / the ONNX outside the run folder before the run failed with exit 4. Now
every object under the folder is checked before anything is written (a link, FIFO, another user's object or a hard
link is exit 2, named, and nothing is written), and each folder a run makes or reuses, and its log, are checked
again when it writes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from conftest import invoke, runs_a_recipe, tiny_recipe_dict, write
from pruneflow.artifacts import check_run_tree, open_run_log, run_subdir
from pruneflow.errors import InputError


@pytest.fixture(scope="module")
@runs_a_recipe
def finished(tmp_path_factory) -> tuple[Path, Path]:
    """One finished run (train, evaluate, export onnx); tests copy it."""
    root = tmp_path_factory.mktemp("finished")
    recipe = write(root / "tiny.yaml", tiny_recipe_dict())
    result = invoke("optimize", recipe, "--out", root / "runs", "--quiet")
    assert result.exit_code == 0, result.output
    return recipe, root / "runs" / "tiny"


@pytest.fixture
def copy(finished, tmp_path) -> Path:
    shutil.copytree(finished[1], tmp_path / "runs" / "tiny")
    return tmp_path / "runs" / "tiny"


def _link_folder(path: Path, target: Path) -> None:
    shutil.rmtree(path)
    target.mkdir()
    path.symlink_to(target, target_is_directory=True)


def _plant_log_link(run: Path, victim: Path) -> str:
    (run / "logs" / "pruneflow.log").unlink()
    (run / "logs" / "pruneflow.log").symlink_to(victim)
    return "logs/pruneflow.log is a symbolic link"


def _plant_stage_link(run: Path, victim: Path) -> str:
    _link_folder(run / "stages" / "01-train", victim.parent / "outside")
    return "stages/01-train is a symbolic link"


def _plant_export_link(run: Path, victim: Path) -> str:
    _link_folder(run / "export" / "onnx", victim.parent / "outside")
    return "export/onnx is a symbolic link"


def _plant_fifo(run: Path, victim: Path) -> str:
    os.mkfifo(run / "stages" / "02-evaluate" / "metrics.json.fifo")
    return "metrics.json.fifo is a FIFO"


def _plant_hard_link(run: Path, victim: Path) -> str:
    (run / "logs" / "pruneflow.log").unlink()
    os.link(victim, run / "logs" / "pruneflow.log")
    return "logs/pruneflow.log is a hard link"


PLANTS = {"log link": _plant_log_link, "stage folder link": _plant_stage_link, "export folder link": _plant_export_link,
          "fifo": _plant_fifo, "hard-linked log": _plant_hard_link}


def _outside(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_resume_refuses_a_planted_object_and_writes_nothing_anywhere(finished, copy, tmp_path, plant):
    victim_dir = tmp_path / "victims"
    victim_dir.mkdir()
    victim = victim_dir / "victim.txt"
    victim.write_text("the victim's own text\n")
    says = PLANTS[plant](copy, victim)
    before_outside, manifest = _outside(victim_dir), (copy / "manifest.json").read_bytes()
    result = invoke("optimize", finished[0], "--out", copy.parent, "--resume")
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert says in text and "--resume" in text and "run without --resume" in text, text
    assert "Traceback" not in result.output
    assert _outside(victim_dir) == before_outside  # the victim unchanged, nothing written outside the run folder
    assert (copy / "manifest.json").read_bytes() == manifest  # nor in it


def test_a_resume_of_a_clean_folder_still_reuses_its_stages(finished, copy):
    result = invoke("optimize", finished[0], "--out", copy.parent, "--resume", "--json")
    assert result.exit_code == 0, result.output
    assert all(s.get("resumed") for s in json.loads(result.stdout)["stages"][:2])


def test_a_folder_planted_while_the_run_goes_on_is_refused_where_it_writes(tmp_path):
    """The scan runs once, before the run; a link planted later is caught where the run makes or opens the folder."""
    run = tmp_path / "run"
    (run / "stages").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (run / "stages" / "01-train").symlink_to(tmp_path / "outside", target_is_directory=True)
    with pytest.raises(InputError, match="01-train is a symbolic link .*, inside the run folder"):
        run_subdir(run, "stages", "01-train")
    with pytest.raises(InputError, match="is a symbolic link"):
        check_run_tree(run)
    assert run_subdir(run, "export", "onnx") == run / "export" / "onnx" and (run / "export" / "onnx").is_dir()


@pytest.mark.parametrize("kind", ["link", "hard link", "fifo"])
def test_the_run_log_is_never_opened_through_a_planted_object(tmp_path, kind):
    victim = tmp_path / "victim"
    victim.write_text("mine\n")
    log = tmp_path / "pruneflow.log"
    if kind == "link":
        log.symlink_to(victim)
    elif kind == "hard link":
        os.link(victim, log)
    else:
        os.mkfifo(log)
    with pytest.raises(InputError, match="writing the run's log"):
        open_run_log(log)
    assert victim.read_text() == "mine\n"
    fresh = tmp_path / "fresh.log"
    os.close(open_run_log(fresh))
    assert fresh.is_file()


def test_a_finished_run_about_to_be_replaced_is_named(tmp_path):
    """Re-running into a finished run's folder replaced it with no word (new-user trial): the run now says what it
    replaces (pipeline._run_locked warns with this) and how to keep it."""
    import json

    from pruneflow.run_folder import earlier_run

    assert earlier_run(tmp_path / "none") is None
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "manifest.json").write_text(json.dumps({"status": "complete", "created": "2026-12-05T19:34:48+00:00"}))
    assert earlier_run(tmp_path / "run") == "complete, from 2026-12-05T19:34:48+00:00"
    (tmp_path / "run" / "manifest.json").write_text("[1, 2")  # a torn file: no claim made about it
    assert earlier_run(tmp_path / "run") is None
