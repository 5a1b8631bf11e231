"""The README's commands run as written (issue 26): its example files are written from the README itself, then
every `pruneflow` command of its bash blocks that is cheap runs here, and the ones that train run in the slow lane."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from conftest import invoke

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SHARED = ROOT.parent / "shared" / "data"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def commands() -> list[list[str]]:
    """Every `pruneflow ...` line of the bash blocks, without its comment, split as a shell would."""
    found = []
    for block in blocks("bash"):
        for line in block.splitlines():
            if line.startswith("pruneflow "):
                found.append(shlex.split(line, comments=True)[1:])
    return found


def example_files(folder: Path) -> list[Path]:
    """The README's example files: python and yaml blocks whose first line is `# NAME.py` or `# NAME.yaml`."""
    written = []
    for block in blocks("python") + blocks("yaml"):
        first = block.splitlines()[0]
        if re.fullmatch(r"# [\w.-]+\.(py|yaml)", first):
            written.append(folder / first[2:])
            written[-1].write_text(block)
    return written


CHEAP = {"validate", "init", "inspect", "schema"}


def test_the_readme_is_short_and_has_a_support_matrix():
    assert len(README.splitlines()) < 300
    assert "## Support matrix" in README and "**Contents:**" in README


def test_the_cheap_commands_of_the_readme_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert {p.name for p in example_files(tmp_path)} == {"my_model.py", "my-recipe.yaml"}
    ran = 0
    for args in commands():
        if args[0] not in CHEAP or (args[0] == "init" and "--list" not in args and not SHARED.is_dir()):
            continue
        result = invoke(*args)
        assert result.exit_code == 0, (args, result.output)
        ran += 1
    assert ran >= 3  # init --list, init into a folder, validate the example recipe


@pytest.mark.slow  # trains the README's own model, and runs the zoo example (~1 minute)
def test_the_worked_examples_of_the_readme_run_as_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    example_files(tmp_path)
    for args in commands():
        needs_data = args[0] == "init" or any("new/" in a for a in args)
        if args[0] in ("optimize", "doctor", "init") and "recipes/quickstart.yaml" not in args and (SHARED.is_dir() or not needs_data):
            result = invoke(*args)
            assert result.exit_code == 0, (args, result.output)
    assert (tmp_path / "runs" / "my-model" / "export" / "openvino" / "model.int8.xml").is_file()
