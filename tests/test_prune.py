"""Structured pruning: exact shortcut rewrite, Fisher vs brute force, coupling, targets, bad configs, reload."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
import torch_pruning as tp
from torch import nn

from pruneflow.runtime.host import cpu_channel_block
from pruneflow.errors import InputError, RecipeError
from pruneflow.export.onnx import export_onnx
from pruneflow.runtime import open_artifact
from pruneflow.prune.engine import (PruneOptions, layer_channels, layer_widths, measure, output_positions, plan_step,
                                    prune_step, resolve_ignored, search_ratio)
from pruneflow.prune.fisher import fisher_diagonal, mean_gradients
from pruneflow.prune.importance import SaliencyImportance, hessian_saliency, magnitude_saliency, taylor_saliency
from pruneflow.prune.surgery import ChannelEmbedConv, make_prunable
from pruneflow.recipe import load_recipe
from pruneflow.zoo import resnet20

from conftest import EvalOnly, run_recipe_dict, runs_a_recipe, tiny_recipe_dict


def _perturbed(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BatchNorm statistics, so eval-mode outputs depend on every layer."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_(0, 0.1, generator=g)
            m.running_var.uniform_(0.5, 1.5, generator=g)
            m.weight.data.uniform_(0.5, 1.5, generator=g)
    return model.eval()


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.conv2(x)) + x  # residual
        return self.fc(x.mean((2, 3)))


class ConcatNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, padding=1)
        self.b = nn.Conv2d(3, 16, 3, padding=1)
        self.merge = nn.Conv2d(32, 16, 1)
        self.fc = nn.Linear(16, 5)

    def forward(self, x):
        x = torch.cat([F.relu(self.a(x)), F.relu(self.b(x))], 1)
        return self.fc(F.relu(self.merge(x)).mean((2, 3)))


class DepthwiseNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 32, 3, padding=1)
        self.bn = nn.BatchNorm2d(32)
        self.dw = nn.Conv2d(32, 32, 3, padding=1, groups=32)
        self.pw = nn.Conv2d(32, 32, 1)
        self.fc = nn.Linear(32, 5)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = F.relu(self.pw(F.relu(self.dw(x))))
        return self.fc(x.mean((2, 3)))


def test_option_a_shortcuts_are_rewritten_without_changing_the_function():
    torch.manual_seed(0)
    model = _perturbed(resnet20())
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        before = model(x)
        assert make_prunable(model, x[:1]) == 2
        after = model(x)
    assert torch.equal(before, after)
    convs = [m for m in model.modules() if isinstance(m, ChannelEmbedConv)]
    assert len(convs) == 2 and not any(m.weight.requires_grad for m in convs)


def test_fisher_diagonal_matches_a_brute_force_per_sample_loop():
    torch.manual_seed(0)
    model = _perturbed(TinyNet())
    x, y = torch.randn(10, 3, 6, 6), torch.randint(0, 4, (10,))
    fisher, mean = fisher_diagonal(model, [(x[:6], y[:6]), (x[6:], y[6:])], F.cross_entropy, chunk=4)
    expected = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    expected_mean = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(len(y)):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for n, p in model.named_parameters():
            expected[n] += p.grad.pow(2) / len(y)
            expected_mean[n] += p.grad / len(y)
    for n in expected:
        torch.testing.assert_close(fisher[n], expected[n], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(mean[n], expected_mean[n], rtol=1e-4, atol=1e-7)
    # and the mean gradient of the batch route agrees (eval mode: samples are independent)
    grads = mean_gradients(model, [(x, y)], F.cross_entropy)
    for n in expected:
        torch.testing.assert_close(grads[n], expected_mean[n], rtol=1e-4, atol=1e-6)


def test_saliency_importance_equals_torch_pruning_for_magnitude_and_hessian():
    """Our group scores reproduce torch-pruning's formulas when fed the same per-parameter tensors."""
    torch.manual_seed(0)
    model = _perturbed(ConcatNet())
    x, y = torch.randn(8, 3, 8, 8), torch.randint(0, 5, (8,))
    fisher, _ = fisher_diagonal(model, [(x, y)], F.cross_entropy)
    graph = tp.DependencyGraph().build_dependency(model, example_inputs=x[:1])
    group = graph.get_pruning_group(model.a, tp.prune_conv_out_channels, idxs=list(range(16)))
    ours = SaliencyImportance(model, magnitude_saliency(model, 2))(group)
    theirs = tp.importance.GroupMagnitudeImportance(p=2)(group)
    torch.testing.assert_close(ours, theirs)
    for n, p in model.named_parameters():
        p.grad = fisher[n].clone()  # torch-pruning's Hessian score reads the Fisher diagonal from .grad
    theirs = tp.importance.GroupHessianImportance()(group)
    ours = SaliencyImportance(model, hessian_saliency(model, fisher))(group)
    torch.testing.assert_close(ours, theirs)


@pytest.mark.parametrize("factory, shape, classes", [(resnet20, (3, 32, 32), 10), (ConcatNet, (3, 8, 8), 5),
                                                     (DepthwiseNet, (3, 8, 8), 5)], ids=["residual", "concat", "depthwise"])
def test_coupled_channels_are_pruned_together_and_the_model_stays_valid(factory, shape, classes, tmp_path):
    torch.manual_seed(0)
    model = _perturbed(factory())
    example = torch.zeros((1,) + shape)
    make_prunable(model, example)
    ignored = resolve_ignored(model, None)
    before = measure(model, example, ignored)
    prune_step(model, example, magnitude_saliency(model), 0.5, PruneOptions(allocation="uniform", ignored=ignored))
    after = measure(model, example, ignored)
    assert after["channels"] < before["channels"] and after["macs"] < before["macs"]
    assert not any(m.weight.requires_grad for m in model.modules() if isinstance(m, ChannelEmbedConv))
    x = torch.randn((3,) + shape)
    with torch.no_grad():
        out = model(x)
    assert out.shape == (3, classes)
    export_onnx(model, example, tmp_path / "m.onnx")  # the pruned graph is consistent enough to export
    got = open_artifact(tmp_path / "m.onnx")(x.numpy())
    assert abs(got - out.numpy()).max() < 1e-4
    if isinstance(model, DepthwiseNet):
        assert model.dw.groups == model.dw.in_channels == model.dw.out_channels == model.stem.out_channels


@pytest.mark.parametrize("metric, keep", [("macs", 0.5), ("params", 0.4), ("channels", 0.7)])
def test_search_meets_macs_params_and_channel_targets(metric, keep):
    torch.manual_seed(0)
    model = _perturbed(resnet20())
    example = torch.zeros(1, 3, 32, 32)
    make_prunable(model, example)
    opts = PruneOptions(ignored=resolve_ignored(model, None), round_to=4)
    base = measure(model, example, opts.ignored)
    ratio, predicted = search_ratio(model, example, magnitude_saliency(model), opts, metric, base[metric] * keep)
    prune_step(model, example, magnitude_saliency(model), ratio, opts)
    achieved = measure(model, example, opts.ignored)
    assert achieved == predicted
    assert keep - 0.08 <= achieved[metric] / base[metric] <= keep


def test_unreachable_target_and_everything_ignored_are_clear_errors():
    model = _perturbed(resnet20())
    example = torch.zeros(1, 3, 32, 32)
    make_prunable(model, example)
    opts = PruneOptions(ignored=resolve_ignored(model, None), max_layer_ratio=0.3)
    base = measure(model, example, opts.ignored)
    with pytest.raises(InputError, match="cannot go below"):
        search_ratio(model, example, magnitude_saliency(model), opts, "macs", base["macs"] * 0.05)
    everything = resolve_ignored(model, [r".*conv.*", "linear"])
    with pytest.raises(InputError, match="nothing is left to prune"):
        prune_step(model, example, magnitude_saliency(model), 0.3, PruneOptions(ignored=everything))
    with pytest.raises(InputError, match="matches no module"):
        resolve_ignored(model, ["classifier"])


@pytest.mark.parametrize(
    "target, message",
    [({"ratio": 1.5}, "less than 1"), ({"macs": 0.5, "params": 0.5}, "exactly one"), ({}, "exactly one")],
)
def test_bad_prune_targets_are_recipe_errors(write_recipe, target, message):
    recipe = tiny_recipe_dict()
    recipe["stages"].insert(1, {"type": "prune", "target": target})
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(recipe))
    assert any(message in i.message and i.path.startswith("stages.1.target") for i in err.value.issues), [i.format() for i in err.value.issues]


def test_taylor_and_hessian_saliency_are_finite_and_shaped_like_the_weights():
    torch.manual_seed(0)
    model = _perturbed(TinyNet())
    x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 4, (8,))
    fisher, grads = fisher_diagonal(model, [(x, y)], F.cross_entropy)
    for sal in (taylor_saliency(model, grads), hessian_saliency(model, fisher)):
        for n, p in model.named_parameters():
            assert sal[n].shape == p.shape and torch.isfinite(sal[n]).all() and (sal[n] >= 0).all()


@pytest.fixture(scope="module")
@runs_a_recipe
def pruned_run(tmp_path_factory):
    recipe = tiny_recipe_dict(name="pruned")
    recipe["stages"].insert(1, {"type": "prune", "importance": "taylor", "target": {"macs": 0.6}, "rounds": 2,
                                "finetune": {"epochs": 1}, "latency": {"batch_sizes": [1], "runs": 3}})
    return run_recipe_dict(recipe, tmp_path_factory.mktemp("prune"))


def test_prune_stage_reports_rounds_and_reaches_its_target(pruned_run):
    _, result = pruned_run
    assert result.exit_code == 0
    prune = next(s for s in result.stages if s.type == "prune")
    m = prune.metrics
    assert m["macs"] <= 0.6 * m["macs_before"] and m["macs_reduction"] >= 1 / 0.6
    assert [r["round"] for r in prune.tables["rounds"]] == [1, 2]
    assert prune.tables["rounds"][0]["macs"] > prune.tables["rounds"][1]["macs"]
    assert m["latency_b1_median_ms"] > 0 and m["latency_b1_median_ms_before"] > 0
    assert any(row["after"] < row["before"] for row in prune.tables["channels"])
    assert result.metrics["onnx.fp32.top1_agreement"] >= 0.99  # the pruned model exports faithfully
    report = (result.run_dir / "report.md").read_text()
    assert "## prune: rounds" in report and "## prune: channels" in report
    rounds = prune.tables["rounds"]
    assert rounds[0]["goal_kept"] > rounds[1]["goal_kept"] == pytest.approx(0.6)
    # Without round_to, pruned layers end off the CPU's channel block (where one is known): the report says so.
    off = [r for r in prune.tables["channels"] if r["after"] != r["before"] and cpu_channel_block() and r["after"] % cpu_channel_block()[0]]
    assert bool(off) == ("notes" in prune.tables)
    if off:
        assert "## prune: notes" in report and f"round_to: {cpu_channel_block()[0]}" in report


def test_cpu_channel_block_reads_the_instruction_set():
    assert cpu_channel_block("flags\t\t: fpu sse avx2 avx512f avx512bw\n") == (16, "AVX-512")
    assert cpu_channel_block("processor : 0\nflags : fpu sse avx avx2 fma\n") == (8, "AVX2")
    assert cpu_channel_block("Features : fp asimd\n") is None


def test_a_pruned_model_reloads_in_a_fresh_process(pruned_run):
    _, result = pruned_run
    checkpoint = result.run_dir / "stages" / "02-prune" / "model.pt"
    prune = next(s for s in result.stages if s.type == "prune")
    out = subprocess.run([sys.executable, "-m", "cli", "inspect", str(checkpoint), "--json"], capture_output=True,
                         text=True, cwd=str(result.run_dir), env=_env())
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["totals"]["params"] == prune.metrics["params"]


def test_resume_after_the_prune_stage_reuses_the_pruned_model(pruned_run):
    from pruneflow.pipeline import run_recipe

    path, first = pruned_run
    again = run_recipe(load_recipe(path), out=first.run_dir.parent, resume=True)
    assert all(s.resumed for s in again.stages)
    assert again.metrics["onnx.fp32.accuracy"] == first.metrics["onnx.fp32.accuracy"]


def test_a_pruned_checkpoint_holds_no_pickle_and_loads_outside_its_run_directory(pruned_run, tmp_path):
    import shutil

    from pruneflow.checkpoint import load_checkpoint
    from pruneflow.models import build_model

    path, result = pruned_run
    copy = tmp_path / "model.pt"
    shutil.copy(result.run_dir / "stages" / "02-prune" / "model.pt", copy)
    payload = torch.load(copy, map_location="cpu", weights_only=True)  # would raise on any pickled object
    assert "structure" in payload and "module" not in payload
    prune = next(s for s in result.stages if s.type == "prune")
    model = load_checkpoint(copy, into=build_model(load_recipe(path).recipe.model)).module
    assert sum(p.numel() for p in model.parameters()) == prune.metrics["params"]


def _env():
    import os

    from conftest import REPO

    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_max_layer_ratio_holds_over_several_rounds():
    from pruneflow.prune.engine import layer_widths

    torch.manual_seed(0)
    model = _perturbed(resnet20())
    example = torch.zeros(1, 3, 32, 32)
    make_prunable(model, example)
    widths = layer_widths(model)
    opts = PruneOptions(allocation="global", max_layer_ratio=0.5, ignored=resolve_ignored(model, None), initial_widths=widths)
    for _ in range(4):
        prune_step(model, example, magnitude_saliency(model), 0.3, opts)
    now = layer_widths(model)
    below = {n: (widths[n][0], now[n][0]) for n in now if n not in opts.ignored and now[n][0] < widths[n][0] * 0.5 - 1}
    assert not below, below


@pytest.mark.parametrize("ranking", ["relative", "absolute", "per_mac"])
def test_every_ranking_meets_a_macs_target_and_keeps_the_model_valid(ranking, tmp_path):
    torch.manual_seed(0)
    model = _perturbed(resnet20())
    example = torch.randn(2, 3, 32, 32)
    make_prunable(model, example)
    opts = PruneOptions(ignored=resolve_ignored(model, None), round_to=8, ranking=ranking)
    base = measure(model, example, opts.ignored)
    ratio, predicted = search_ratio(model, example, magnitude_saliency(model), opts, "macs", base["macs"] * 0.5)
    prune_step(model, example, magnitude_saliency(model), ratio, opts)
    assert measure(model, example, opts.ignored) == predicted
    assert 0.42 <= predicted["macs"] / base["macs"] <= 0.5
    assert all(c % 8 == 0 for n, c in layer_channels(model).items() if n != "linear")
    out = model.eval()(example).detach()
    export_onnx(model, example[:1], tmp_path / "m.onnx")
    assert abs(open_artifact(tmp_path / "m.onnx")(example.numpy()) - out.numpy()).max() < 1e-4


def test_per_mac_ranking_divides_by_what_a_channel_costs_in_every_coupled_layer():
    """A stem conv (3 -> 8, 3x3, 16x16 output) feeding a 1x1 conv (8 -> 4): one stem channel costs
    27 * 256 MACs as an output and 4 * 256 as an input of the next layer."""
    net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.ReLU(), nn.Conv2d(8, 4, 1, bias=False))
    example = torch.zeros(1, 3, 16, 16)
    saliency = {n: torch.ones_like(p) for n, p in net.named_parameters()}
    graph = tp.DependencyGraph().build_dependency(net, example)
    group = graph.get_pruning_group(net[0], tp.prune_conv_out_channels, list(range(8)))
    absolute = SaliencyImportance(net, saliency, "absolute")(group)
    assert torch.allclose(absolute, torch.full((8,), 27.0 + 4.0))  # summed saliency: 27 out-weights + 4 in-weights
    per_mac = SaliencyImportance(net, saliency, "per_mac", spatial=output_positions(net, example))(group)
    assert torch.allclose(per_mac, absolute / ((27 + 4) * 256))


def test_a_group_wholly_below_the_global_threshold_is_pruned_to_its_floor_not_skipped():
    """torch-pruning skips a group when every channel falls under the global threshold; we prune it
    to what max_layer_ratio and round_to leave."""
    torch.manual_seed(0)
    model = _perturbed(resnet20())
    example = torch.zeros(1, 3, 32, 32)
    make_prunable(model, example)
    saliency = magnitude_saliency(model)
    for name in saliency:
        if name.startswith("layer1.") and "conv1" in name:  # the stage-1 inner channels matter least by far
            saliency[name] = saliency[name] * 1e-6
    opts = PruneOptions(ignored=resolve_ignored(model, None), round_to=8, ranking="absolute",
                        max_layer_ratio=0.5, initial_widths=layer_widths(model))
    prune_step(model, example, saliency, 0.1, opts)
    channels = layer_channels(model)
    assert [channels[f"layer1.{i}.conv1"] for i in range(3)] == [8, 8, 8]


@pytest.mark.parametrize("factory, shape", [(resnet20, (3, 32, 32)), (ConcatNet, (3, 8, 8)), (DepthwiseNet, (3, 8, 8))],
                         ids=["residual", "concat", "depthwise"])
def test_faded_channels_are_zero_and_their_removal_changes_no_output(factory, shape):
    torch.manual_seed(0)
    model = _perturbed(factory())
    example = torch.zeros((1,) + shape)
    make_prunable(model, example)
    opts = PruneOptions(ignored=resolve_ignored(model, None), round_to=2)
    reference = copy.deepcopy(model)
    prune_step(reference, example, magnitude_saliency(reference), 0.4, opts)
    plan = plan_step(model, example, magnitude_saliency(model), 0.4, opts)
    assert plan.channels > 0 and layer_channels(model) != layer_channels(reference)  # nothing removed yet
    x = torch.randn((4,) + shape)
    with torch.no_grad():
        dense = model(x)
    fade = plan.fader(0.5)
    total = 10
    fade(1, total)  # a tenth of the way: scaled by 0.8, not zero
    with torch.no_grad():
        assert not torch.allclose(model(x), dense)
    for step in range(2, total + 1):
        fade(step, total)
    with torch.no_grad():
        faded = model(x)
    plan.apply()
    assert layer_channels(model) == layer_channels(reference)  # the same channels as an immediate step
    with torch.no_grad():
        torch.testing.assert_close(model(x), faded, rtol=1e-5, atol=1e-5)
    assert not any(m.weight.requires_grad for m in model.modules() if isinstance(m, ChannelEmbedConv))


@pytest.mark.slow
def test_a_faded_prune_stage_meets_its_target_and_its_last_removal_changes_no_accuracy(tmp_path):
    """With fade, a round's accuracy is measured before its channels are removed: without a final
    fine-tune, the stage's accuracy must then equal the evaluate stage's after it."""
    recipe = tiny_recipe_dict(name="faded")
    recipe["stages"].insert(1, {"type": "prune", "importance": "taylor", "target": {"macs": 0.6}, "rounds": 2, "fade": 0.5,
                                "finetune": {"epochs": 1}, "latency": None})
    _, result = run_recipe_dict(recipe, tmp_path)
    assert result.exit_code == 0
    m = result.metrics
    assert m["prune.macs"] <= 0.6 * m["prune.macs_before"]
    rounds = next(s for s in result.stages if s.type == "prune").tables["rounds"]
    assert [r["round"] for r in rounds] == [1, 2] and rounds[0]["macs"] > rounds[1]["macs"]
    assert m["prune.accuracy"] == rounds[-1]["accuracy"] == m["evaluate.accuracy"]


def test_fade_reaches_zero_at_its_share_of_the_steps_and_holds_it():
    torch.manual_seed(0)
    model = TinyNet()
    example = torch.zeros(1, 3, 8, 8)
    plan = plan_step(model, example, magnitude_saliency(model), 0.5, PruneOptions(ignored=resolve_ignored(model, None)))
    (module, _, idxs), = plan.roots
    weight = module.weight
    start = weight.detach()[idxs].clone()
    fade = plan.fader(0.5)
    for step, remaining in [(1, 0.75), (2, 0.5), (3, 0.25), (4, 0.0)]:
        fade(step, 8)
        torch.testing.assert_close(weight.detach()[idxs], start * remaining)
    with torch.no_grad():
        weight[idxs] += 1.0  # an optimizer step moves them; the fade holds them at zero
    fade(5, 8)
    assert weight.detach()[idxs].abs().max() == 0
    kept = [i for i in range(weight.shape[0]) if i not in idxs]
    assert weight.detach()[kept].abs().min() > 0


# --------------------------------------------------------------------------- the config union and the round loop


def _line(path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.mark.parametrize("stage, key", [
    ({"granularity": "blocks", "target": {"macs": 0.6}, "fade": 0.5}, "fade"),
    ({"granularity": "blocks", "target": {"macs": 0.6}, "round_to": 8}, "round_to"),
    ({"target": {"heads": 0.5}, "round_to": 8}, "round_to"),  # a heads/ffn target selects the transformer variant
    ({"granularity": "heads", "target": {"ffn": 0.5}, "magnitude_p": 1}, "magnitude_p"),
    ({"target": {"heads": 0.5}, "allocation": "uniform"}, "allocation"),
])
def test_a_key_of_another_granularity_is_an_unknown_key_with_its_file_and_line(write_recipe, stage, key):
    from typer.testing import CliRunner

    from pruneflow.cli import app

    recipe = tiny_recipe_dict()
    recipe["stages"].insert(1, {"type": "prune", **stage})
    path = write_recipe(recipe)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    (issue,) = err.value.issues
    assert (issue.path, issue.location()) == (f"stages.1.{key}", f"{path}:{_line(path, key + ':')}")
    assert issue.message.startswith("unknown key") and "Known keys:" in issue.message
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["validate", str(path)])
    assert result.exit_code == 2 and f"{path}:{_line(path, key + ':')}  stages.1.{key}" in result.output


def test_the_prune_variants_suggest_their_own_keys_and_name_a_bad_granularity(write_recipe):
    recipe = tiny_recipe_dict()
    recipe["stages"][1:1] = [
        {"type": "prune", "granularity": "blocks", "target": {"macs": 0.6}, "round": 2},
        {"type": "prune", "granularity": "layers", "target": {"macs": 0.6}},
        {"type": "prune", "granularity": "channels", "target": {"heads": 0.5}},
        {"type": "prune", "target": {"ratio": 0.95}},
    ]
    path = write_recipe(recipe)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    issues = {i.path: i for i in err.value.issues}
    assert set(issues) == {"stages.1.round", "stages.2.granularity", "stages.3.target", "stages.4.max_layer_ratio"}
    assert "did you mean 'rounds'?" in issues["stages.1.round"].message
    assert "fade" not in issues["stages.1.round"].message  # the blocks variant's keys, not the channel variant's
    bad = issues["stages.2.granularity"]
    assert (bad.value, bad.line) == ("layers", _line(path, "granularity: layers"))
    assert bad.message == "unknown granularity. Known: channels, blocks, heads, tables"
    assert "need `granularity: heads`" in issues["stages.3.target"].message
    assert "target ratio 0.95 cannot be reached" in issues["stages.4.max_layer_ratio"].message


def test_each_granularity_validates_as_its_own_variant_and_round_trips(write_recipe):
    from pruneflow.prune.config import BlockPruneConfig, ChannelPruneConfig, HeadPruneConfig
    from pruneflow.recipe.loader import dump_recipe

    recipe = tiny_recipe_dict()
    recipe["stages"][1:1] = [{"type": "prune", "target": {"macs": 0.6}, "fade": 0.5},
                             {"type": "prune", "granularity": "blocks", "target": {"ratio": 0.5}},
                             {"type": "prune", "target": {"heads": 0.5, "ffn": 0.3}}]
    loaded = load_recipe(write_recipe(recipe)).recipe
    kinds = [type(s) for s in loaded.stages[1:4]]
    assert kinds == [ChannelPruneConfig, BlockPruneConfig, HeadPruneConfig]
    assert [s.granularity for s in loaded.stages[1:4]] == ["channels", "blocks", "heads"]
    again = load_recipe(write_recipe(dump_recipe(loaded), "again.yaml")).recipe
    assert again.stages == loaded.stages


def _loc(*keys):
    return ("stages", 1, *keys)


def test_the_round_loop_records_one_round_per_round_for_channels():
    from pruneflow.context import Reporter
    from pruneflow.prune.channels import ChannelStrategy
    from pruneflow.prune.config import ChannelPruneConfig
    from pruneflow.prune.rounds import run_rounds

    torch.manual_seed(0)
    model = _perturbed(resnet20())
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    cfg = ChannelPruneConfig(target={"macs": 0.6}, rounds=3, importance="taylor", round_to=4, finetune=None, latency=None)
    strategy = ChannelStrategy(cfg, model, x[:1], F.cross_entropy, _loc)
    entering = strategy.entering()
    strategy.prepare()
    records, seconds = run_rounds(strategy, EvalOnly(x, y), lambda k: [(x, y)], Reporter(), "prune")
    assert [r.index for r in records] == [1, 2, 3] and seconds > 0
    macs = [r.figures["macs"] for r in records]
    assert macs[0] > macs[1] > macs[2] and macs[2] <= 0.6 * strategy.before["macs"] < entering["macs"]
    for r in records:  # each round meets its own goal, removes channels and measures what it left
        assert r.figures["macs"] <= r.goal["macs"] and r.removed["channels"] > 0 and 0 < r.plan["ratio"] < 1
    assert [r.figures for r in records][-1] == strategy.measure()
    rows = [strategy.row(r) for r in records]
    assert [row["goal_kept"] for row in rows] == [round(1 - 0.4 * k / 3, 4) for k in (1, 2, 3)]
    assert [row["channels"] for row in rows] == [r.figures["channels"] for r in records]


def test_the_round_loop_records_one_round_per_round_for_blocks():
    from pruneflow.context import Reporter
    from pruneflow.prune.blocks import BlockStrategy
    from pruneflow.prune.config import BlockPruneConfig
    from pruneflow.prune.rounds import run_rounds

    torch.manual_seed(0)
    model = _perturbed(resnet20())
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    cfg = BlockPruneConfig(granularity="blocks", target={"ratio": 0.5}, rounds=2, finetune=None, latency=None)
    strategy = BlockStrategy(cfg, model, x[:1], F.cross_entropy, _loc)
    entering = strategy.entering()
    strategy.prepare()
    records, _ = run_rounds(strategy, EvalOnly(x, y), lambda k: [(x, y)], Reporter(), "prune")
    assert entering["blocks"] == 7  # resnet20's 9 blocks but the 2 that downsample
    # Goals 7 * (1 - 0.5 * k / 2) = 5.25 and 3.5 blocks: each round removes blocks until it is under its goal.
    assert [r.index for r in records] == [1, 2] and [r.figures["blocks"] for r in records] == [5, 3]
    for r in records:  # ascending measured loss increase, until the goal
        assert list(r.removed.values()) == sorted(r.removed.values())
    assert [len(r.removed) for r in records] == [2, 2]
    table = strategy.tables(records)["blocks"]
    assert [(row["block"], row["round"]) for row in table] == [(n, r.index) for r in records for n in r.removed]
