"""A recipe names a model, not a program (issue 41, item 1).

`factory: torch.hub:load` ran the `hubconf.py` of any folder, `torch:load` / `numpy:load` / `pandas:read_pickle`
unpickled a payload, `sympy:sympify` evaluated text, pip's `call_subprocess` ran a command: `doctor` and `optimize`
called any installed package's function with the recipe's kwargs. Now a factory is the zoo's, a file in the recipe's
folder tree, or a callable its owner listed (`trust.code`, `--trust-code`); anything else is exit 2 at the
factory's line before anything is imported, and the payload's marker never appears. `validate` says what code a
recipe runs.
"""

from __future__ import annotations

import json
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import invoke, tiny_recipe_dict, write
from pruneflow.errors import InputError
from pruneflow.models import build_model, resolve_factory
from pruneflow.recipe import load_recipe
from pruneflow.recipe.code import CodeTrust

COMMANDS = (("validate",), ("doctor",), ("optimize", "--dry-run"), ("optimize",))


class Payload:
    """Unpickled, it creates the marker file (``open(marker, 'w')``): what a planted pickle would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _hub(tmp: Path, marker: Path) -> tuple[str, dict]:
    write(tmp / "hub" / "hubconf.py", f"open({str(marker)!r}, 'w')\ndef m():\n    import torch\n    return torch.nn.Linear(64, 10)\n")
    return "torch.hub:load", {"repo_or_dir": str(tmp / "hub"), "model": "m", "source": "local"}


def _torch_load(tmp: Path, marker: Path) -> tuple[str, dict]:
    torch.save(Payload(marker), tmp / "weights.pt")
    return "torch:load", {"f": str(tmp / "weights.pt"), "weights_only": False}


def _numpy_load(tmp: Path, marker: Path) -> tuple[str, dict]:
    np.save(tmp / "data.npy", np.array([Payload(marker)], dtype=object), allow_pickle=True)
    return "numpy:load", {"file": str(tmp / "data.npy"), "allow_pickle": True}


def _pandas_read_pickle(tmp: Path, marker: Path) -> tuple[str, dict]:
    (tmp / "frame.pkl").write_bytes(pickle.dumps(Payload(marker)))
    return "pandas:read_pickle", {"filepath_or_buffer": str(tmp / "frame.pkl")}


def _sympify(tmp: Path, marker: Path) -> tuple[str, dict]:
    return "sympy:sympify", {"a": f"__import__('pathlib').Path({str(marker)!r}).touch()"}


def _pip_subprocess(tmp: Path, marker: Path) -> tuple[str, dict]:
    return "pip._internal.utils.subprocess:call_subprocess", {"cmd": ["touch", str(marker)]}


def _pip_main(tmp: Path, marker: Path) -> tuple[str, dict]:
    return "pip._internal.cli.main:main", {"args": ["download", "--no-index", "-d", str(marker), "nothing"]}


def _load_inline(tmp: Path, marker: Path) -> tuple[str, dict]:
    return "torch.utils.cpp_extension:load_inline", {"name": "x", "cpp_sources": f"// {marker}"}


CASES = {"torch.hub:load": _hub, "torch:load": _torch_load, "numpy:load": _numpy_load, "pandas:read_pickle": _pandas_read_pickle,
         "sympy:sympify": _sympify, "pip call_subprocess": _pip_subprocess, "pip main": _pip_main,
         "cpp_extension:load_inline": _load_inline}


def _refused(result, recipe: Path, factory: str) -> None:
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert f"{recipe}:" in text and "model.factory" in text and "would run code that is not the recipe's" in text, text
    assert f'trust: {{code: ["{factory}"]}}' in text and f"--trust-code {factory}" in text, text


@pytest.mark.parametrize("case", list(CASES))
def test_a_factory_of_an_installed_package_runs_nothing_unless_trusted(tmp_path, case):
    marker = tmp_path / "pwned"
    factory, kwargs = CASES[case](tmp_path, marker)
    recipe = write(tmp_path / "proj" / "r.yaml", tiny_recipe_dict(model={"factory": factory, "kwargs": kwargs}))
    for command in COMMANDS:
        _refused(invoke(command[0], recipe, *command[1:], "--out", tmp_path / "runs")
                 if command[0] == "optimize" else invoke(*command, recipe), recipe, factory)
    assert not marker.exists() and not (tmp_path / "runs").exists()


def test_an_own_file_that_re_exports_an_installed_function_is_that_function(tmp_path):
    """`models.py` in the recipe's folder with `from torch.hub import load as build`: the callable is torch's."""
    marker = tmp_path / "pwned"
    _, kwargs = _hub(tmp_path, marker)
    write(tmp_path / "proj" / "models.py", "from torch.hub import load as build\n")
    recipe = write(tmp_path / "proj" / "r.yaml", tiny_recipe_dict(model={"factory": "models.py:build", "kwargs": kwargs}))
    for command in (("validate",), ("optimize", "--dry-run")):
        result = invoke(*command, recipe)
        assert result.exit_code == 2 and "it is torch.hub:load, imported from outside" in " ".join(result.output.split())
    assert not marker.exists()


def test_an_own_file_whose_star_import_gives_an_installed_function_is_refused_when_built(tmp_path):
    """A star import hides the binding from `validate` (which says so); building the model checks the callable
    itself, before calling it."""
    marker = tmp_path / "pwned"
    _, kwargs = _hub(tmp_path, marker)
    write(tmp_path / "proj" / "models.py", "from torch.hub import *\n")
    recipe = write(tmp_path / "proj" / "r.yaml", tiny_recipe_dict(model={"factory": "models.py:load", "kwargs": kwargs}))
    assert invoke("validate", recipe).exit_code == 0
    for command in (("doctor", recipe), ("optimize", recipe, "--out", tmp_path / "runs")):
        result = invoke(*command)
        text = " ".join(result.output.split())
        assert result.exit_code == 2 and "it is torch.hub:load, defined outside the recipe's folder" in text, text
    assert not marker.exists()


def test_a_factory_file_outside_the_recipe_folder_or_linked_out_of_it_is_refused(tmp_path):
    marker = tmp_path / "pwned"
    write(tmp_path / "elsewhere" / "m.py", f"open({str(marker)!r}, 'w')\ndef build():\n    pass\n")
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "linked.py").symlink_to(tmp_path / "elsewhere" / "m.py")
    for factory in ("../elsewhere/m.py:build", "linked.py:build", f"{tmp_path / 'elsewhere' / 'm.py'}:build"):
        recipe = write(tmp_path / "proj" / "r.yaml", tiny_recipe_dict(model={"factory": factory}))
        for command in (("validate", recipe), ("doctor", recipe)):
            result = invoke(*command)
            assert result.exit_code == 2 and "its code lies outside the recipe's folder" in " ".join(result.output.split())
    assert not marker.exists()


def test_a_package_installed_inside_the_recipe_folder_is_not_the_recipes_own(tmp_path, monkeypatch):
    """A virtual environment in the project folder does not make torch (or anything in it) the recipe's code."""
    site = tmp_path / "proj" / ".venv" / "lib" / "site-packages"
    write(site / "planted" / "__init__.py", f"open({str(tmp_path / 'pwned')!r}, 'w')\ndef build():\n    pass\n")
    monkeypatch.syspath_prepend(str(site))
    recipe = write(tmp_path / "proj" / "r.yaml", tiny_recipe_dict(model={"factory": "planted:build"}))
    result = invoke("validate", recipe)
    assert result.exit_code == 2 and "outside the recipe's folder" in " ".join(result.output.split()), result.output
    assert not (tmp_path / "pwned").exists()


def test_a_teacher_factory_is_held_to_the_same_rule(tmp_path):
    marker = tmp_path / "pwned"
    factory, kwargs = _hub(tmp_path, marker)
    stages = [{"type": "train", "epochs": 1}, {"type": "prune", "target": {"ratio": 0.5}, "rounds": 1, "latency": None,
                                               "teacher": {"factory": factory, "kwargs": kwargs}}]
    recipe = write(tmp_path / "proj" / "r.yaml", tiny_recipe_dict(stages=stages))
    result = invoke("validate", recipe)
    text = " ".join(result.output.split())
    assert result.exit_code == 2 and "stages.1.teacher.factory" in text and "would run code" in text, text
    assert not marker.exists()


def test_validate_says_what_code_a_recipe_runs_and_who_allowed_it(tmp_path):
    proj = tmp_path / "proj"
    write(proj / "models.py", "import torch\n\ndef build(num_classes=10):\n    return torch.nn.Sequential(torch.nn.Flatten(), "
          "torch.nn.Linear(64, num_classes))\n")
    own = write(proj / "own.yaml", tiny_recipe_dict(model={"factory": "models.py:build"}))
    result = invoke("validate", own)
    assert result.exit_code == 0
    assert f"this recipe runs code: {proj / 'models.py'}:build (model.factory; a file in the recipe's folder)" in result.stdout
    listed = write(proj / "listed.yaml", tiny_recipe_dict(model={"factory": "torch.nn:Linear", "kwargs": {"in_features": 64,
                   "out_features": 10}, "input_shape": [64]}, trust={"code": ["torch.nn:Linear"]}))
    result = invoke("validate", listed)
    assert result.exit_code == 0 and "this recipe runs code: torch.nn:Linear (model.factory; allowed by the recipe's trust.code)" in result.stdout
    zoo = invoke("validate", write(proj / "zoo.yaml", tiny_recipe_dict()))
    assert zoo.exit_code == 0 and "runs code" not in zoo.stdout
    dry = invoke("optimize", own, "--dry-run", "--json")
    assert json.loads(dry.stdout)["dry_run"]["code"] == [{"field": "model.factory", "callable": f"{proj / 'models.py'}:build",
                                                          "why": "a file in the recipe's folder"}]


def test_a_trusted_callable_runs_through_doctor(tmp_path):
    """`--trust-code` (or `trust.code`) lets an installed package's class build the model; doctor runs it as the run would."""
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict(model={"factory": "torch.nn:Linear", "kwargs": {"in_features": 64,
                   "out_features": 10}, "input_shape": [1, 8, 8]}))
    assert invoke("doctor", recipe).exit_code == 2
    result = invoke("doctor", recipe, "--trust-code", "torch.nn:Linear")
    # the factory ran (the model then fails on the data's shape: Linear(64) on [1, 8, 8] images)
    assert "would run code" not in result.output and "fails on a batch of the data" in " ".join(result.output.split())


def test_the_trust_travels_with_the_model_spec_to_the_build(tmp_path):
    """The check is not only at load time: a recipe's spec refuses an untrusted callable when it is built, and the
    resolver others call (``resolve_factory``) does the same for any field."""
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict(model={"factory": "torch.nn:Linear", "kwargs": {"in_features": 4,
                   "out_features": 2}}, trust={"code": ["torch.nn:Linear"]}))
    spec = load_recipe(recipe).recipe.model
    assert isinstance(build_model(spec), torch.nn.Linear)
    spec.trusting(CodeTrust(tmp_path))  # the same spec, with nothing listed
    with pytest.raises(InputError, match="would run code that is not the recipe's"):
        build_model(spec)
    with pytest.raises(InputError, match=r"^metrics\.0 'numpy:load' would run code"):
        resolve_factory("numpy:load", CodeTrust(tmp_path), field="metrics.0")
    assert resolve_factory("numpy:load", CodeTrust(tmp_path, command_line=("numpy:load",)), field="metrics.0") is np.load


def test_the_standard_library_stays_refused_even_when_listed(tmp_path):
    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict(model={"factory": "os:system", "kwargs": {"command": "true"}},
                                                         trust={"code": ["os:system"]}))
    result = invoke("validate", recipe)
    assert result.exit_code == 2 and "standard library" in " ".join(result.output.split())
    assert sys.modules.get("os") is not None


HF_CUSTOM_CODE = """\
open({marker!r}, "w")
from transformers import PretrainedConfig, PreTrainedModel
class EvilConfig(PretrainedConfig):
    model_type = "evilbert"
class EvilModel(PreTrainedModel):
    config_class = EvilConfig
"""


def test_a_hugging_face_folder_with_its_own_modeling_code_is_refused_without_a_prompt(tmp_path, monkeypatch):
    """A zoo transformer's `folder` whose config.json maps to the folder's own .py: transformers asked "Do you wish
    to run the custom code? [y/N]" on the terminal mid-run; now it is refused outright and the code never runs."""
    pytest.importorskip("transformers")
    from pruneflow.zoo.hf import bert_classifier, bert_embedder

    marker = tmp_path / "pwned"
    folder = tmp_path / "model"
    write(folder / "modeling_evil.py", HF_CUSTOM_CODE.format(marker=str(marker)))
    auto = {k: "modeling_evil.EvilModel" for k in ("AutoModel", "AutoModelForSequenceClassification")}
    write(folder / "config.json", json.dumps({"model_type": "evilbert", "auto_map": {"AutoConfig": "modeling_evil.EvilConfig", **auto}}))
    monkeypatch.setattr("builtins.input", lambda *a: pytest.fail("transformers prompted for custom code"))
    for build in (bert_classifier, bert_embedder):
        with pytest.raises(InputError, match="custom code"):
            build(folder=str(folder))
    assert not marker.exists()


def test_checking_a_recipe_that_names_pip_leaves_setuptools_working(tmp_path):
    """Looking up `pip` with importlib.util.find_spec made setuptools' distutils hook take pip for running and switch
    itself off: every later NNCF build in the process failed (`AssertionError: .../distutils/core.py`)."""
    import subprocess

    recipe = write(tmp_path / "r.yaml", tiny_recipe_dict(model={"factory": "pip._internal.cli.main:main"}))
    code = ("from pruneflow.recipe import load_recipe\nfrom pruneflow.errors import RecipeError\n"
            f"try:\n    load_recipe({str(recipe)!r})\nexcept RecipeError:\n    pass\n"
            "import setuptools, distutils.core\nprint(distutils.core.__file__)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert done.returncode == 0 and "setuptools" in done.stdout, done.stderr[-2000:]
