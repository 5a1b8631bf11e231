"""Issue 15, pruning half: attention heads of ``nn.MultiheadAttention`` removed whole (a ViT), pre-norm
residual blocks (ViT, ConvNeXt), ConvNeXt channels, squeeze-excite gates pruned with their channels."""

from __future__ import annotations

import copy
import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from families import convnext, se_net, vit
from torch import nn

from pruneflow.context import Reporter
from pruneflow.errors import ConfigError
from pruneflow.prune.blocks import find_blocks, is_residual, remove_blocks
from pruneflow.prune.config import ChannelPruneConfig, HeadPruneConfig
from pruneflow.prune.engine import PruneOptions, layer_channels, plan_step, prune_step, resolve_ignored
from pruneflow.prune.channels import ChannelStrategy
from pruneflow.prune.heads import HeadStrategy
from pruneflow.prune.importance import magnitude_saliency
from pruneflow.prune.mha import HeadAttention, convert_mha, from_mha
from pruneflow.prune.rounds import run_rounds

from conftest import REPO, EvalOnly, invoke, write

IMAGE = (1, 8, 8)


def _loc(*keys):
    return ("stages", 1, *keys)


def _perturbed_vit(seed: int = 0, **kwargs) -> nn.Module:
    """A ViT whose attention is far from uniform (random init attends almost evenly, hiding head mix-ups)."""
    torch.manual_seed(seed)
    model = vit.build(**kwargs)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.MultiheadAttention):
                m.in_proj_weight[: 2 * m.embed_dim].mul_(4.0)  # sharper scores
                m.in_proj_bias.normal_(0, 0.2)
            elif isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
        model.cls_token.normal_(0, 0.5)
        model.pos_embed.normal_(0, 0.5)
    return model.eval()


def _onnx_parity(model: nn.Module, x: torch.Tensor, path) -> float:
    """Max |torch - onnxruntime| of ``model`` exported (legacy exporter, dynamic batch) on ``x``."""
    model.eval()
    torch.onnx.export(model, (x,), str(path), input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {0: "b"}},
                      dynamo=False)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    with torch.no_grad():
        return float(np.abs(got - model(x).numpy()).max())


@pytest.mark.parametrize("kwargs", [dict(batch_first=True), dict(batch_first=False), dict(batch_first=True, kdim=12, vdim=20),
                                    dict(batch_first=True, bias=False), dict(batch_first=True, dropout=0.1)],
                         ids=["batch-first", "seq-first", "kdim-vdim", "no-bias", "dropout"])
def test_head_attention_computes_what_multihead_attention_computes(kwargs):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, **kwargs).eval()
    attn = from_mha("attn", mha).eval()
    n, length, source = 3, 7, 9
    q = torch.randn(n, length, 32)
    k, v = torch.randn(n, source, kwargs.get("kdim", 32)), torch.randn(n, source, kwargs.get("vdim", 32))
    if not kwargs["batch_first"]:
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    padding = torch.zeros(n, source, dtype=torch.bool)
    padding[0, -3:] = True
    for extra in ({}, {"key_padding_mask": padding}, {"attn_mask": torch.randn(length, source)},
                  {"attn_mask": torch.randn(n * 4, length, source), "average_attn_weights": False}, {"need_weights": False}):
        with torch.no_grad():
            want, want_w = mha(q, k, v, **extra)
            got, got_w = attn(q, k, v, **extra)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert (got_w is None) == (want_w is None)
        if want_w is not None:
            torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-5)


def test_multihead_attention_with_bias_kv_is_refused_naming_the_module():
    with pytest.raises(Exception) as err:
        from_mha("encoder.0.attn", nn.MultiheadAttention(16, 2, add_bias_kv=True))
    assert "encoder.0.attn" in str(err.value) and "ignore" in err.value.hint  # type: ignore[attr-defined]


def _prune_vit_heads(model: nn.Module, share: float = 0.5, importance: str = "taylor") -> HeadStrategy:
    x, y = torch.rand(16, *IMAGE), torch.randint(0, 10, (16,))
    cfg = HeadPruneConfig(target={"heads": share}, rounds=1, importance=importance, finetune=None, latency=None)
    strategy = HeadStrategy(cfg, model, x[:2], F.cross_entropy, _loc)
    strategy.entering()
    strategy.prepare()
    run_rounds(strategy, EvalOnly(x, y), lambda k: [(x, y)], Reporter(), "prune")
    return strategy


@pytest.mark.parametrize("importance", ["taylor", "hessian", "magnitude"])
def test_vit_loses_half_its_heads_whole_and_never_resplit(importance):
    model = _perturbed_vit(layers=3)
    original = copy.deepcopy(model)
    strategy = _prune_vit_heads(model, 0.5, importance)
    assert strategy.converted == ["encoder.0.self_attn", "encoder.1.self_attn", "encoder.2.self_attn"]
    kept = 0
    for i, layer in enumerate(model.encoder):
        attn, before = layer.self_attn, original.encoder[i].self_attn
        assert isinstance(attn, HeadAttention) and attn.embed_dim == 64 and attn.head_dim == 16
        inner = attn.num_heads * attn.head_dim
        assert attn.q_proj.weight.shape == attn.k_proj.weight.shape == attn.v_proj.weight.shape == (inner, 64)
        assert attn.out_proj.weight.shape == (64, inner) and layer.norm1.weight.shape == (64,)
        q0, k0, v0 = before.in_proj_weight.detach().chunk(3)
        for j, head in enumerate(attn.head_index.tolist()):  # each kept head is one original head, rows unchanged
            rows, old = slice(j * 16, (j + 1) * 16), slice(head * 16, (head + 1) * 16)
            for now, then in ((attn.q_proj, q0), (attn.k_proj, k0), (attn.v_proj, v0)):
                assert torch.equal(now.weight[rows], then[old])
            assert torch.equal(attn.out_proj.weight[:, rows], before.out_proj.weight[:, old])
        assert attn.head_index.tolist() == sorted(set(attn.head_index.tolist()))
        kept += attn.num_heads
    assert kept == 6 and strategy.summary(strategy.measure())["heads_before"] == 12
    assert "3 nn.MultiheadAttention module(s) became HeadAttention" in strategy.tables([])["notes"][0]["note"]
    assert model(torch.rand(3, *IMAGE)).shape == (3, 10)


def test_removing_heads_equals_zeroing_them_first_and_exports_to_onnx(tmp_path):
    model = _perturbed_vit()
    reference = copy.deepcopy(model)
    convert_mha(reference)
    _prune_vit_heads(model, 0.5)
    x = torch.rand(8, *IMAGE)
    with torch.no_grad():
        dense = reference(x)
        for i, layer in enumerate(model.encoder):  # silence the removed heads' outputs in the unpruned copy
            attn = reference.encoder[i].self_attn
            for head in set(range(4)) - set(layer.self_attn.head_index.tolist()):
                attn.out_proj.weight[:, head * 16: (head + 1) * 16] = 0
        zeroed = reference(x)
        pruned = model(x)
    assert (zeroed - dense).abs().max() > 1e-2  # the removed heads mattered
    assert (pruned - zeroed).abs().max() < 1e-5
    assert _onnx_parity(model, x, tmp_path / "vit.onnx") < 1e-4
    import openvino as ov

    compiled = ov.Core().compile_model(str(tmp_path / "vit.onnx"), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    assert np.abs(compiled(x.numpy())[0] - pruned.numpy()).max() < 1e-4


def test_torch_pruning_cannot_remove_whole_heads_of_multihead_attention():
    """Why mha.py exists (torch-pruning 1.6.1, checked on its result): asked for half the heads it removes none,
    and channel pruning through nn.MultiheadAttention shrinks every layer's width alike and re-splits the heads."""
    import warnings

    import torch_pruning as tp

    def pruned(heads: bool, **kwargs) -> list[tuple[int, int, int]]:
        model = vit.build().eval()
        mhas = [m for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
        if heads:
            kwargs.update(num_heads={m: m.num_heads for m in mhas}, prune_num_heads=True, head_pruning_ratio=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tp.pruner.MetaPruner(model, torch.zeros(1, *IMAGE), importance=tp.importance.GroupMagnitudeImportance(),
                                 ignored_layers=[model.head], **kwargs).step()
        assert model(torch.rand(2, *IMAGE)).shape == (2, 10)
        return [(m.embed_dim, m.num_heads, m.head_dim) for m in mhas]

    assert pruned(True, pruning_ratio=0.0) == [(64, 4, 16)] * 2
    assert pruned(False, pruning_ratio=0.25, round_to=4) == [(48, 4, 12)] * 2  # heads of 16 re-split into heads of 12


def test_heads_need_attention_and_ffn_finds_a_pointwise_ffn_beside_it():
    """A ViT's `mlp` (Linear, GELU, Linear beside nn.MultiheadAttention) is an FFN: issue 37's SASRec, whose FFN is
    such a Sequential, was refused `ffn` and told to use channels, which the next run refused too."""
    x = torch.rand(2, *IMAGE)
    with pytest.raises(ConfigError, match="attention heads"):
        HeadStrategy(HeadPruneConfig(target={"heads": 0.5}, latency=None), se_net.build(), x, F.cross_entropy, _loc).entering()
    strategy = HeadStrategy(HeadPruneConfig(target={"heads": 0.5, "ffn": 0.3}, latency=None), vit.build(), x,
                            F.cross_entropy, _loc)
    strategy.entering()
    assert strategy.total_heads > 0 and strategy.total_ffn > 0


def _channel_prune(model: nn.Module, ratio: float = 0.3, **extra) -> tuple[ChannelStrategy, list]:
    x, y = torch.rand(16, *IMAGE), torch.randint(0, 10, (16,))
    cfg = ChannelPruneConfig(target={"ratio": ratio}, rounds=1, importance="magnitude", finetune=None, latency=None, **extra)
    strategy = ChannelStrategy(cfg, model, x[:1], F.cross_entropy, _loc)
    strategy.entering()
    strategy.prepare()
    records = run_rounds(strategy, EvalOnly(x, y), lambda k: [(x, y)], Reporter(), "prune")[0]
    return strategy, records


@pytest.mark.parametrize("heads_first", [False, True], ids=["mha", "after-head-pruning"])
def test_channels_on_a_vit_keep_attention_whole_and_say_so(heads_first, tmp_path):
    model = _perturbed_vit()
    if heads_first:
        _prune_vit_heads(model, 0.25)
    attn_before = {n: (type(m), getattr(m, "num_heads", 0), getattr(m, "embed_dim", 0)) for n, m in model.named_modules()
                   if isinstance(m, (nn.MultiheadAttention, HeadAttention))}
    before = layer_channels(model)
    strategy, records = _channel_prune(model, 0.3, round_to=4)  # round_to 4 re-split heads of 16 in issue 15
    after = layer_channels(model)
    assert {n: (type(m), getattr(m, "num_heads", 0), getattr(m, "embed_dim", 0)) for n, m in model.named_modules()
            if isinstance(m, (nn.MultiheadAttention, HeadAttention))} == attn_before
    assert all(after[n] == before[n] for n in after if "attn" in n or n == "patch_embed")  # width and heads kept
    assert any(after[n] < before[n] for n in after if ".mlp." in n)  # the MLPs lost neurons
    assert all(after[n] % 4 == 0 for n in after if ".mlp.0" in n)
    notes = strategy.tables(records)["notes"]
    assert any("attention module(s) kept whole" in row["note"] and "granularity: heads" in row["note"] for row in notes)
    assert _onnx_parity(model, torch.rand(4, *IMAGE), tmp_path / "vit.onnx") < 1e-4


def test_pre_norm_blocks_are_found_in_vits_and_convnexts():
    example = torch.zeros(1, *IMAGE)
    assert find_blocks(vit.build(layers=3), example) == ["encoder.0", "encoder.1", "encoder.2"]
    converted = vit.build()
    convert_mha(converted)  # HeadAttention's own control flow does not hide the block
    assert find_blocks(converted, example) == ["encoder.0", "encoder.1"]
    assert find_blocks(convnext.build(), example) == ["stage1.0", "stage1.1", "stage2.0", "stage2.1"]

    class TwoBranches(nn.Module):  # f(x) + g(x): no identity skip, not a block
        def __init__(self):
            super().__init__()
            self.f, self.g = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.f(x) + self.g(x)

    class Chained(nn.Module):  # y = x + f(x); y + g(y): a pre-norm chain
        def __init__(self):
            super().__init__()
            self.f, self.g = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            y = x + self.f(x)
            return y + self.g(y)

    class EmptyShortcut(nn.Module):  # relu(f(x) + shortcut(x)), the shortcut an empty nn.Sequential
        def __init__(self):
            super().__init__()
            self.f, self.shortcut = nn.Linear(4, 4), nn.Sequential()

        def forward(self, x):
            return torch.relu(self.f(x) + self.shortcut(x))

    assert not is_residual(TwoBranches()) and is_residual(Chained()) and is_residual(EmptyShortcut())


def test_a_vit_loses_whole_encoder_layers_under_granularity_blocks():
    from pruneflow.prune.blocks import BlockStrategy
    from pruneflow.prune.config import BlockPruneConfig

    model = _perturbed_vit(layers=4)
    x, y = torch.rand(16, *IMAGE), torch.randint(0, 10, (16,))
    cfg = BlockPruneConfig(granularity="blocks", target={"ratio": 0.5}, rounds=1, finetune=None, latency=None)
    strategy = BlockStrategy(cfg, model, x[:1], F.cross_entropy, _loc)
    assert strategy.entering()["blocks"] == 4  # "has no removable residual block" in issue 15
    strategy.prepare()
    records, _ = run_rounds(strategy, EvalOnly(x, y), lambda k: [(x, y)], Reporter(), "prune")
    assert records[0].figures["blocks"] == 2 and len(records[0].removed) == 2
    assert sum(isinstance(layer, nn.Identity) for layer in model.encoder) == 2 and model(x).shape == (16, 10)


def test_convnext_channels_prune_through_layer_norm_and_layer_scale_and_blocks_go_whole(tmp_path):
    torch.manual_seed(0)
    model = convnext.build().eval()
    before = layer_channels(model)
    _channel_prune(model, 0.3)
    after = layer_channels(model)
    for stage in ("stage1", "stage2"):
        for i in range(2):
            block = model.get_submodule(f"{stage}.{i}")
            width = block.dwconv.out_channels
            assert block.gamma.shape == block.norm.weight.shape == (width,) == (block.pwconv2.out_features,)
            assert block.pwconv1.in_features == width and block.dwconv.groups == width
    assert sum(after.values()) < sum(before.values())
    x = torch.rand(4, *IMAGE)
    assert _onnx_parity(model, x, tmp_path / "convnext.onnx") < 1e-4
    remove_blocks(model, find_blocks(model, x[:1])[:2])
    assert isinstance(model.stage1[0], nn.Identity) and model(x).shape == (4, 10)


def _perturbed_se(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = se_net.build()
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_(0, 0.1, generator=g)
            m.running_var.uniform_(0.5, 1.5, generator=g)
            m.weight.data.uniform_(0.5, 1.5, generator=g)
            m.bias.data.normal_(0, 0.2, generator=g)
    return model.eval()


def test_squeeze_excite_gates_are_pruned_with_the_channels_they_scale():
    model = _perturbed_se()
    example = torch.zeros(1, *IMAGE)
    opts = PruneOptions(ignored=resolve_ignored(model, None))
    plan = plan_step(model, example, magnitude_saliency(model), 0.4, opts)
    x = torch.rand(8, *IMAGE)
    with torch.no_grad():
        dense = model(x)
    fade = plan.fader(1.0)
    fade(1, 1)  # the chosen channels (conv, BN, the gate's expand rows, the reduce's inputs) at zero
    with torch.no_grad():
        zeroed = model(x)
    plan.apply()
    with torch.no_grad():
        pruned = model(x)
    assert (zeroed - dense).abs().max() > 1e-3
    assert (pruned - zeroed).abs().max() < 1e-5
    for block in model.features:
        assert block.se.expand.out_channels == block.conv.out_channels == block.bn.num_features == block.se.reduce.in_channels
    assert model.features[0].conv.out_channels < 16
    reference = _perturbed_se()
    prune_step(reference, example, magnitude_saliency(reference), 0.4, opts)
    assert layer_channels(reference) == layer_channels(model)


@pytest.mark.slow  # ~30 s on a shared 2-core machine
def test_a_vit_recipe_trains_prunes_heads_and_exports_onnx_through_the_cli(tmp_path):
    from pruneflow.checkpoint import load_checkpoint

    recipe = write(tmp_path / "vit.yaml", {
        "name": "vit", "seed": 0, "device": "cpu",
        "model": {"factory": f"{REPO / 'tests/families/vit.py'}:build", "kwargs": {"dim": 32, "heads": 4}},
        "trust": {"code": [f"{REPO / 'tests/families/vit.py'}:build"]},  # a factory outside the recipe's folder
        "data": {"format": "digits", "max_train_samples": 128, "max_eval_samples": 64},
        "stages": [
            {"type": "train", "epochs": 1, "batch_size": 32, "lr": 0.002, "optimizer": "adamw"},
            {"type": "prune", "target": {"heads": 0.5}, "rounds": 1, "importance": "taylor", "latency": None,
             "finetune": {"epochs": 1}},
            {"type": "export", "targets": ["onnx"], "latency": None},
        ],
    })
    result = invoke("optimize", recipe, "--out", tmp_path / "runs", "--json", "--quiet")
    assert result.exit_code == 0, result.output
    run = tmp_path / "runs" / "vit"
    metrics = json.loads((run / "metrics.json").read_text())
    prune = metrics["stages"]["prune"]
    assert (prune["heads_before"], prune["heads"]) == (8, 4) and prune["macs"] < prune["macs_before"]
    assert prune["macs_before"] == metrics["stages"]["train"]["macs"]  # counted alike before and after conversion
    onnx = metrics["artifacts"]["export/onnx/model.fp32.onnx"]
    assert onnx["max_abs_diff"] < 1e-4 and onnx["top1_agreement"] == 1.0
    handle = load_checkpoint(run / "stages" / "02-prune" / "model.pt", vit.build(dim=32, heads=4))
    heads = [layer.self_attn.num_heads for layer in handle.module.encoder]
    assert sum(heads) == 4 and all(isinstance(layer.self_attn, HeadAttention) for layer in handle.module.encoder)
    session = ort.InferenceSession(str(run / "export" / "onnx" / "model.fp32.onnx"), providers=["CPUExecutionProvider"])
    x = torch.rand(4, *IMAGE)
    with torch.no_grad():  # the reloaded checkpoint is the model that was exported
        want = handle.module.eval()(x).numpy()
    assert np.abs(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0] - want).max() < 1e-4
