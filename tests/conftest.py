"""Shared fixtures: the real data beside the checkout, and a small recipe writer; the `slow` marker applied by
what a test does (it runs a recipe end to end)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path
from typing import Callable, TypeVar

import pytest
import torch
import yaml

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


# --------------------------------------------------------------------------- the `slow` marker
# A test that runs a recipe end to end (run_recipe past its preflight, the CLI's `optimize` in-process or in a
# subprocess) is `slow`: `make test-fast` (pytest -m "not slow") skips it, `make test` (CI) runs everything.
# - A fixture that runs one says so with @runs_a_recipe (under @pytest.fixture): every test whose fixture
#   closure holds it is marked slow at collection.
# - A test that runs one itself carries @pytest.mark.slow.
# The guard below enforces both: in a test not marked slow, a recipe run (or a subprocess running `optimize`)
# fails the test, naming the mark it lacks, before any stage runs.

F = TypeVar("F", bound=Callable)


def runs_a_recipe(fixture: F) -> F:
    """Mark a fixture function (below ``@pytest.fixture``) as one that runs a recipe: its tests become slow."""
    fixture.runs_a_recipe = True  # type: ignore[attr-defined]
    return fixture


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = [d for ds in (info.name2fixturedefs.values() if info else ()) for d in ds]
        if any(getattr(d.func, "runs_a_recipe", False) for d in defs):
            item.add_marker(pytest.mark.slow)


_RUNNING: dict[str, pytest.Item | None] = {"item": None}
_UNMARKED: dict[str, str] = {}  # node id → the recipe run it made unmarked (failed even if the test caught it)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    _RUNNING["item"] = item  # setup (module fixtures included), call and teardown of this test
    try:
        return (yield)
    finally:
        _RUNNING["item"] = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if item.nodeid in _UNMARKED and call.when != "teardown" and not report.failed:
        report.outcome, report.longrepr = "failed", _UNMARKED[item.nodeid]
    return report


def refuse_unless_slow(what: str) -> None:
    """Fail the running test unless it is marked slow: it is about to run ``what`` (a recipe end to end)."""
    item = _RUNNING["item"]
    if item is None or item.get_closest_marker("slow") is not None:
        return
    _UNMARKED[item.nodeid] = (
        f"{item.nodeid} runs {what} but is not marked slow, so `make test-fast` would run it: add "
        "@pytest.mark.slow to the test, or @runs_a_recipe (tests/conftest.py) under the @pytest.fixture that runs it."
    )
    pytest.fail(_UNMARKED[item.nodeid], pytrace=False)


def _guard_recipe_runs() -> None:
    """Wrap the pipeline's run past preflight (lock, run folder, stages) and subprocesses running `optimize`."""
    import pruneflow.pipeline as pipeline

    run_locked = pipeline._run_locked

    def guarded_run_locked(loaded, *args, **kwargs):
        refuse_unless_slow(f"the recipe {loaded.recipe.name!r} end to end (pruneflow.pipeline.run_recipe)")
        return run_locked(loaded, *args, **kwargs)

    pipeline._run_locked = guarded_run_locked
    popen_init = subprocess.Popen.__init__

    def guarded_popen_init(self, args, *rest, **kwargs):
        argv = [str(a) for a in args] if isinstance(args, (list, tuple)) else str(args).split()
        if "optimize" in argv and any(a in ("cli", "pruneflow") or a.endswith("/pruneflow") for a in argv):
            shown = " ".join([Path(argv[0]).name, *argv[1:]])
            refuse_unless_slow(f"`{shown[:160]}` in a subprocess")
        popen_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = guarded_popen_init  # type: ignore[method-assign]


_guard_recipe_runs()


def optimize_json(recipe: dict, folder: Path) -> tuple[dict, dict[str, dict], dict[str, dict]]:
    """Run ``recipe`` with `pruneflow optimize --json` (written to FOLDER/recipe.yaml, run into FOLDER/runs); it
    must exit 0. Returns the --json object, each stage's metrics by stage name, each exported artifact's metrics
    by file name (``model.int8.onnx``)."""
    import json

    (folder / "recipe.yaml").write_text(json.dumps(recipe))
    result = invoke("optimize", folder / "recipe.yaml", "--out", folder / "runs", "--json")
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    stages = {s["name"]: s["metrics"] for s in out["stages"]}
    artifacts = {a["path"].rsplit("/", 1)[-1]: a["metrics"] for a in out["artifacts"] if a["target"]}
    return out, stages, artifacts


@contextlib.contextmanager
def stages_registered(**stages):
    """Test stages registered through the public API for the ``with`` block; the recipe model is rebuilt around them."""
    from pruneflow import registry
    from pruneflow.recipe.models import recipe_model, target_union

    recipe_model.cache_clear()
    target_union.cache_clear()
    with contextlib.ExitStack() as stack:
        for name, stage in stages.items():
            stack.enter_context(registry.stages.registered(name, stage))
        recipe_model.cache_clear()
        try:
            yield
        finally:
            recipe_model.cache_clear()
    recipe_model.cache_clear()


@contextlib.contextmanager
def plugin_installed(site: Path, module: str, registry, entry: str, also: Callable[[], None] = lambda: None):
    """``tests/plugins/<module>.py`` installed into ``site`` as a distribution would be: the module on sys.path, its
    entry point (``entry``: ``name = module:Class``) under ``registry``'s group in a dist-info. The registry reads its
    entry points again before the block and after it (when the plugin is gone), and ``also`` runs with it (caches
    built from the registry)."""
    import shutil
    import sys

    name = entry.split("=")[0].strip()

    def reset() -> None:
        registry._entry_points = None
        registry.unregister(name)
        also()

    shutil.copy(Path(__file__).parent / "plugins" / f"{module}.py", site / f"{module}.py")
    info = site / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[{registry.group}]\n{entry}\n")
    sys.path.insert(0, str(site))
    reset()
    try:
        yield site
    finally:
        sys.path.remove(str(site))
        sys.modules.pop(module, None)
        reset()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """../shared/data beside the checkout (present locally and in CI); skip where it is absent."""
    if not (SHARED_DATA / "cifar10").is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


def wait_for(predicate, timeout: float, what: str) -> None:
    """Poll ``predicate`` every 0.1 s until it holds; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def write(path: Path, content: dict | str) -> Path:
    """Write a recipe (a dict, dumped as YAML) or any text to ``path``, making its folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False))
    return path


def invoke(*args: object):
    """Run the CLI in-process (plain output, 200 columns); an exception other than the exit itself fails
    the test with its traceback."""
    from typer.testing import CliRunner

    from pruneflow.cli import app

    result = CliRunner(env={"FORCE_COLOR": None, "COLUMNS": "200"}).invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def tiny_train_recipe(**overrides) -> dict:
    """``tiny_recipe_dict`` without its export: train 1 epoch, evaluate (the fault catalogues' run)."""
    stages = [{"type": "train", "epochs": 1, "batch_size": 32, "lr": 0.05}, {"type": "evaluate"}]
    return tiny_recipe_dict(**{"stages": stages, **overrides})


def tiny_recipe_dict(**overrides) -> dict:
    """A recipe that runs in a few seconds: digits_cnn, 1 epoch on 300 digits, no latency timing."""
    recipe = {
        "name": "tiny",
        "seed": 0,
        "device": "cpu",
        "model": {"factory": "digits_cnn", "kwargs": {"width": 8}},
        "data": {"format": "digits", "max_train_samples": 300, "max_eval_samples": 100},
        "stages": [
            {"type": "train", "epochs": 1, "batch_size": 32, "lr": 0.05},
            {"type": "evaluate"},
            {"type": "export", "targets": ["onnx"], "latency": None},
        ],
    }
    recipe.update(overrides)
    return recipe


def run_recipe_dict(recipe: dict, folder: Path):
    """Write ``recipe`` to FOLDER/recipe.yaml and run it into FOLDER/runs; returns (path, RunResult)."""
    import json

    from pruneflow.pipeline import run_recipe
    from pruneflow.recipe import load_recipe

    path = folder / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    return path, run_recipe(load_recipe(path), out=folder / "runs")


@pytest.fixture
def write_recipe(tmp_path):
    """write_recipe(data_or_text, name="recipe.yaml") -> Path in tmp_path."""

    def write(content, name: str = "recipe.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False))
        return path

    return write


class Quiet:
    """The round loop's reporter, saying nothing."""

    def info(self, message: str) -> None:
        pass


class Untuned:
    """The round loop's tuner with no fine-tune: a fixed figure (for tests asserting on structure and MACs)."""

    metric = "none"

    def after_round(self, model, index, rounds, on_step_end=None) -> float:
        return 0.0


class EvalOnly:
    """The loop's tuner when `finetune` is null: the accuracy on a fixed batch, no training."""

    metric = "accuracy"

    def __init__(self, x, y):
        self.x, self.y = x, y

    @torch.no_grad()
    def after_round(self, model, index, rounds, on_step_end=None) -> float:
        model.eval()
        return float((model(self.x).argmax(-1) == self.y).float().mean())


def forced_f32(metrics: dict, key: str):
    """An OpenVINO figure with f32 forced: ``key + "_f32"`` where the run measured that lane beside the default
    (a CPU whose default is bf16), else ``key`` (the default is f32 already: one lane)."""
    return metrics[key + "_f32"] if key + "_f32" in metrics else metrics[key]
