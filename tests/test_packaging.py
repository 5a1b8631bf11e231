"""pyproject lists packages by hand (recipes/ ships as pruneflow.templates): keep the list complete."""

from __future__ import annotations

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

from conftest import REPO


def test_every_package_folder_is_listed_in_pyproject():
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    found = set()
    for init in REPO.glob("**/__init__.py"):
        rel = init.parent.relative_to(REPO)
        if rel.parts[0] in ("tests", ".venv", "build", "benchmarks") or rel.parts[0].startswith("."):
            continue
        found.add(".".join(rel.parts))
    found.discard("recipes")
    # qat/ and calibrate/ install inside pruneflow (never as top-level names that could collide)
    moved = {name: f"pruneflow.{name}" for name in ("qat", "calibrate")}
    assert {moved.get(name, name) for name in found} | {"pruneflow.templates"} == listed
    assert config["package-dir"] == {"pruneflow.templates": "recipes", "pruneflow.qat": "qat", "pruneflow.calibrate": "calibrate"}
    assert "py-modules" not in config  # cli.py goes in as pruneflow/cli.py (setup.py), not as a top-level `cli`
