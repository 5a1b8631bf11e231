"""Depth pruning (`granularity: blocks`): finding residual blocks, their measured ranking, the stage end to end."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from pruneflow.errors import InputError
from pruneflow.prune.blocks import block_scores, find_blocks, is_residual, present, remove_blocks
from pruneflow.recipe import load_recipe
from pruneflow.zoo import resnet20

from conftest import run_recipe_dict, runs_a_recipe, tiny_recipe_dict
from test_prune import _env, _perturbed

# A user's own residual network, in torchvision's style (in-place add, ReLU module), for 1x8x8 digits.
TINY_RESNET = '''
from torch import nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.relu = nn.ReLU()

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


def build(num_classes=10, width=8, blocks=4):
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
        *[Block(width) for _ in range(blocks)],
        nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU()),  # keeps the shape, but no skip
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))
'''


@pytest.fixture
def tiny_resnet_file(tmp_path):
    path = tmp_path / "tiny_resnet.py"
    path.write_text(TINY_RESNET)
    return path


def _load(path):
    spec = importlib.util.spec_from_file_location("tiny_resnet", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_identity_skip_blocks_are_found_and_downsampling_blocks_are_not():
    model = resnet20().eval()
    # The first block of stages 2 and 3 changes the shape (stride 2, option-A shortcut): not removable.
    assert find_blocks(model, torch.zeros(1, 3, 32, 32)) == [
        "layer1.0", "layer1.1", "layer1.2", "layer2.1", "layer2.2", "layer3.1", "layer3.2"]
    assert find_blocks(model, torch.zeros(1, 3, 32, 32), ignored=("layer1", "layer3.2")) == ["layer2.1", "layer2.2", "layer3.1"]


def test_a_torchvision_style_block_is_found_and_a_plain_shape_keeping_module_is_not(tiny_resnet_file):
    model = _load(tiny_resnet_file).build()
    assert find_blocks(model, torch.zeros(1, 1, 8, 8)) == ["3", "4", "5", "6"]
    assert not is_residual(model[7])  # conv + relu, same shape, no skip


def test_scores_are_the_measured_loss_increase_and_a_dead_branch_is_removed_for_free():
    torch.manual_seed(0)
    model = _perturbed(resnet20()).eval()
    with torch.no_grad():  # layer2.1's branch now outputs zero: the block passes its (non-negative) input on
        model.layer2[1].bn2.weight.zero_()
        model.layer2[1].bn2.bias.zero_()
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    blocks = find_blocks(model, x[:1])
    scores = block_scores(model, blocks, [(x[:8], y[:8]), (x[8:], y[8:])], F.cross_entropy)
    assert set(scores) == set(blocks)
    assert abs(scores["layer2.1"]) < 1e-6 and min(scores, key=lambda k: abs(scores[k])) == "layer2.1"
    with torch.no_grad():
        base = F.cross_entropy(model(x), y)
        reference = model(x)
        without = _perturbed(resnet20()).eval()
        without.load_state_dict(model.state_dict())
        remove_blocks(without, ["layer3.1"])
        assert scores["layer3.1"] == pytest.approx(float(F.cross_entropy(without(x), y) - base), abs=1e-5)
        remove_blocks(model, ["layer2.1"])
        assert torch.allclose(model(x), reference, atol=1e-5)
    assert present(model, blocks) == [b for b in blocks if b != "layer2.1"]


@pytest.fixture(scope="module")
@runs_a_recipe
def depth_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("depth")
    (tmp / "tiny_resnet.py").write_text(TINY_RESNET)
    recipe = tiny_recipe_dict(name="depth", model={"factory": "tiny_resnet.py:build", "input_shape": [1, 8, 8]})
    recipe["stages"][0]["epochs"] = 3
    recipe["stages"].insert(1, {"type": "prune", "granularity": "blocks", "target": {"macs": 0.6}, "rounds": 2,
                                "finetune": {"epochs": 1}, "latency": {"batch_sizes": [1], "runs": 3}})
    return run_recipe_dict(recipe, tmp)


def test_the_blocks_stage_removes_whole_blocks_round_by_round_to_its_target(depth_run):
    _, result = depth_run
    assert result.exit_code == 0
    prune = next(s for s in result.stages if s.type == "prune")
    m = prune.metrics
    assert m["macs"] <= 0.6 * m["macs_before"] and m["blocks_before"] == 4 and m["blocks_removed"] == 2
    rounds = prune.tables["rounds"]
    assert [r["round"] for r in rounds] == [1, 2] and [r["blocks"] for r in rounds] == [3, 2]
    assert rounds[0]["macs"] > rounds[1]["macs"] and rounds[1]["goal_kept"] == pytest.approx(0.6)
    removed = [r["block"] for r in prune.tables["blocks"]]
    assert len(removed) == 2 and set(removed) <= {"3", "4", "5", "6"}
    # The removed blocks' convolutions are gone from the per-layer table; the others kept their widths.
    after = {r["layer"]: r["after"] for r in prune.tables["channels"]}
    assert all(after[f"{b}.conv1"] == 0 for b in removed)
    assert all(after[f"{b}.conv1"] == after[f"{b}.conv2"] == 8 for b in "3456" if b not in removed)
    assert m["latency_b1_median_ms"] > 0 and m["latency_b1_median_ms_before"] > 0
    assert result.metrics["onnx.fp32.top1_agreement"] >= 0.99
    assert m["accuracy_before"] > 0.2 and m["accuracy"] > 0.2  # above chance (0.1) before and after losing half its blocks
    assert "## prune: blocks" in (result.run_dir / "report.md").read_text()


def test_a_depth_pruned_model_reloads_in_a_fresh_process_and_resumes(depth_run):
    from pruneflow.pipeline import run_recipe

    path, result = depth_run
    prune = next(s for s in result.stages if s.type == "prune")
    checkpoint = result.run_dir / "stages" / "02-prune" / "model.pt"
    assert "structure" in torch.load(checkpoint, map_location="cpu", weights_only=True)
    out = subprocess.run([sys.executable, "-m", "cli", "inspect", str(checkpoint), "--recipe", str(path), "--json"], capture_output=True,
                         text=True, cwd=str(result.run_dir), env=_env())
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["totals"]["params"] == prune.metrics["params"]
    again = run_recipe(load_recipe(path), out=result.run_dir.parent, resume=True)
    assert all(s.resumed for s in again.stages)
    assert again.metrics["onnx.fp32.accuracy"] == result.metrics["onnx.fp32.accuracy"]


@pytest.mark.slow
@pytest.mark.parametrize("model, stage, message", [
    ({"factory": "digits_cnn", "kwargs": {"width": 8}}, {"target": {"macs": 0.6}},
     r"stages\.0\.granularity  'blocks'  the model has no removable residual block"),
    (None, {"target": {"macs": 0.1}}, r"stages\.0\.target  .*macs 0\.1 cannot be reached by removing blocks: without all 4"),
])
def test_bad_depth_pruning_configs_are_clear_errors(tmp_path, tiny_resnet_file, model, stage, message):
    recipe = tiny_recipe_dict(name="bad", model=model or {"factory": "tiny_resnet.py:build"})
    recipe["stages"] = [{"type": "prune", "granularity": "blocks", "finetune": {"epochs": 1}, "latency": None, **stage}]
    with pytest.raises(InputError, match=message):
        run_recipe_dict(recipe, tmp_path)
