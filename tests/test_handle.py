"""The model handle: a third-party stage that reshapes the model needs no flag for its checkpoint to reload
(in a fresh process), and no stage leaves hidden ``_pruneflow_*`` state on a module."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import ClassVar, Literal

import pytest
import torch
from pydantic import Field
from torch import nn

from pruneflow import registry
from pruneflow.errors import ExportError
from pruneflow.handle import ModelHandle
from pruneflow.stage import Stage, StageConfig, StageResult

from conftest import REPO, run_recipe_dict, stages_registered, tiny_recipe_dict


class NarrowConfig(StageConfig):
    type: Literal["narrow"] = Field("narrow", description="Keep the first `keep` channels of the digits CNN's last block.")
    keep: int = Field(5, ge=1, description="Channels kept.")


class NarrowStage(Stage):
    """A plugin that knows nothing about checkpoints: it swaps in narrower Conv/BatchNorm/Linear modules."""

    Config = NarrowConfig
    modifies_model = True
    #: The models it made, so the test can compare them with what a fresh process loads.
    made: ClassVar[list[nn.Module]] = []

    def run(self, state, ctx):
        keep, model = self.config.keep, state.model
        block, head = model.features[4], model.classifier
        conv = nn.Conv2d(block[0].in_channels, keep, 3, padding=1, bias=False)
        bn, linear = nn.BatchNorm2d(keep), nn.Linear(keep, head.out_features)
        with torch.no_grad():
            conv.weight.copy_(block[0].weight[:keep])
            for name in ("weight", "bias", "running_mean", "running_var"):
                getattr(bn, name).copy_(getattr(block[1], name)[:keep])
            linear.weight.copy_(head.weight[:, :keep])
            linear.bias.copy_(head.bias)
        block[0], block[1], model.classifier = conv, bn, linear
        NarrowStage.made.append(model)
        return StageResult(metrics={"channels": keep})


class ProbeConfig(StageConfig):
    type: Literal["probe"] = Field("probe", description="Report every `_pruneflow_*` attribute on the run's modules.")


class ProbeStage(Stage):
    """Looks at every module the state holds (the model, its float base and view, the teacher)."""

    Config = ProbeConfig

    def run(self, state, ctx):
        roots = {"module": state.handle.module, "float_base": state.handle.float_base,
                 "float_module": state.handle.float_module(), "teacher": state.teacher}
        hidden = sorted(f"{root}:{name}.{key}" for root, model in roots.items() if model is not None
                        for name, m in model.named_modules() for key in vars(m) if key.startswith("_pruneflow_"))
        return StageResult(metrics={"kind": state.handle.kind, "hidden": json.dumps(hidden)})


@pytest.fixture
def plugins():
    """The test stages registered through the public API; the recipe model is rebuilt around them."""
    with stages_registered(narrow=NarrowStage, probe=ProbeStage):
        yield


LOAD_IN_A_FRESH_PROCESS = """
import sys, torch, yaml
from pruneflow.checkpoint import load_checkpoint
from pruneflow.models import build_model
from pruneflow.recipe.models import ModelSpec

run_dir, out = sys.argv[1], sys.argv[2]
# The recipe's model section only: this process has never heard of the `narrow` stage.
spec = ModelSpec(**yaml.safe_load(open(f"{run_dir}/recipe.resolved.yaml"))["model"])
handle = load_checkpoint(f"{run_dir}/stages/02-narrow/model.pt", into=build_model(spec))
x = torch.load(f"{out}/x.pt", weights_only=True)
with torch.no_grad():
    y = handle.module.eval()(x)
shapes = {k: list(v.shape) for k, v in handle.module.state_dict().items()}
torch.save({"y": y, "kind": handle.kind, "shapes": shapes}, f"{out}/y.pt")
"""


@pytest.mark.slow
def test_a_third_party_stage_that_reshapes_the_model_writes_a_checkpoint_that_reloads_elsewhere(plugins, tmp_path):
    NarrowStage.made.clear()
    recipe = tiny_recipe_dict(name="narrowed")
    recipe["stages"] = [recipe["stages"][0], {"type": "narrow", "keep": 5}, {"type": "evaluate"}]
    _, result = run_recipe_dict(recipe, tmp_path)
    assert result.exit_code == 0 and result.metrics["narrow.channels"] == 5
    (model,) = NarrowStage.made
    model.eval()
    x = torch.randn(7, 1, 8, 8)
    torch.save(x, tmp_path / "x.pt")
    done = subprocess.run([sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, str(result.run_dir), str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = torch.load(tmp_path / "y.pt", weights_only=True)
    assert loaded["kind"] == "float"
    assert loaded["shapes"] == {k: list(v.shape) for k, v in model.state_dict().items()}
    assert loaded["shapes"]["features.4.0.weight"] == [5, 32, 3, 3] and loaded["shapes"]["classifier.weight"] == [10, 5]
    with torch.no_grad():
        torch.testing.assert_close(loaded["y"], model(x), rtol=0, atol=1e-6)
    assert result.metrics["evaluate.params"] == sum(p.numel() for p in model.parameters())


@pytest.mark.slow
def test_no_module_carries_hidden_pruneflow_state_after_prune_and_qat(plugins, tmp_path):
    recipe = tiny_recipe_dict(name="hidden")
    recipe["stages"] = [
        recipe["stages"][0],
        {"type": "prune", "target": {"macs": 0.7}, "rounds": 1, "finetune": {"epochs": 1}, "latency": None},
        {"type": "probe", "name": "after-prune"},
        {"type": "qat", "schedule": [{"precision": "int8", "epochs": 1}], "calibration_size": 32},
        {"type": "probe", "name": "after-qat"},
    ]
    _, result = run_recipe_dict(recipe, tmp_path)
    assert result.exit_code == 0
    assert result.metrics["after-qat.kind"] == "nncf"
    assert json.loads(result.metrics["after-prune.hidden"]) == []
    assert json.loads(result.metrics["after-qat.hidden"]) == []


def test_a_float_model_has_no_int8_form():
    with pytest.raises(ExportError, match="int8 export needs a quantized model, and the model reaching the export "
                                          "stage is floating point") as info:
        ModelHandle(nn.Linear(2, 2)).int8_module(torch.zeros(1, 2))
    assert "ptq" in info.value.hint


def test_model_kinds_are_registered_by_entry_point_and_the_core_imports_no_backend():
    """The nncf kind arrives like any plugin; nothing under pruneflow/ imports qat, calibrate or nncf."""
    import re

    assert {"float", "nncf"} <= set(registry.model_kinds.names())
    assert registry.model_kinds.get("nncf").quantized and not registry.model_kinds.get("float").quantized
    pattern = re.compile(r"^\s*(import|from)\s+(qat|calibrate|nncf)\b", re.MULTILINE)
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "pruneflow").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []
