"""Head and FFN pruning for BERT-style models: surgery equals masking, per-sample mask gradients."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from pruneflow.prune.transformer import (  # noqa: E402
    attention_sites,
    ffn_sites,
    prune_heads,
    prune_neurons,
    select_lowest,
    unit_importance,
    unit_masks,
)
from pruneflow import registry  # noqa: E402
from pruneflow.zoo.hf import bert_classifier  # noqa: E402

from conftest import SHARED_DATA, EvalOnly  # noqa: E402


def perturbed_bert(seed: int = 0):
    """Random init gives near-uniform attention, which hides wrong head bookkeeping: scale weights up."""
    model = bert_classifier(vocab_size=120, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                            max_positions=32, num_labels=3, seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def test_pruned_heads_and_neurons_equal_the_masked_reference():
    model = perturbed_bert()
    x = torch.randint(1, 120, (6, 14))
    x[:, 10:] = 0  # padding, masked out of attention
    sites, ffns = attention_sites(model), ffn_sites(model)
    head_mask = {sites[0].name: torch.tensor([1.0, 0, 1, 0]), sites[1].name: torch.tensor([0.0, 1, 1, 1])}
    ffn_mask = {ffns[1].name: (torch.arange(64) % 4 != 0).float()}
    with torch.no_grad():
        reference = model(x)
        with unit_masks(model, head_mask=head_mask, ffn_mask=ffn_mask):
            masked = model(x)
        assert (masked - reference).abs().max() > 1e-3  # the masked heads matter in this model
        prune_heads(sites[0], [1, 3])
        prune_heads(sites[1], [0])
        prune_neurons(ffns[1], [i for i in range(64) if i % 4 == 0])
        pruned = model(x)
    torch.testing.assert_close(pruned, masked, rtol=1e-5, atol=1e-6)
    assert (sites[0].attn.num_attention_heads, sites[0].attn.all_head_size) == (2, 16)
    assert sites[1].heads == 3 and sites[1].out.in_features == 24 and ffns[1].neurons == 48


def test_per_sample_mask_gradients_match_a_brute_force_loop():
    model = perturbed_bert(1)
    x, y = torch.randint(1, 120, (5, 10)), torch.randint(0, 3, (5,))
    heads, ffn = unit_importance(model, [(x, y)], F.cross_entropy, registry.criteria.get("hessian")())
    expected_heads = {n: torch.zeros_like(v) for n, v in heads.items()}
    for i in range(len(y)):
        ones = {s.name: torch.ones(s.heads, requires_grad=True) for s in attention_sites(model)}
        with unit_masks(model, head_mask=ones):
            F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        for n, m in ones.items():
            expected_heads[n] += m.grad.pow(2) / len(y)
    for n in heads:
        torch.testing.assert_close(heads[n], expected_heads[n], rtol=1e-4, atol=1e-9)
    assert all(v.shape == (64,) and torch.isfinite(v).all() for v in ffn.values())


def test_select_lowest_removes_the_share_and_keeps_one_head_a_layer():
    scores = {"a": torch.tensor([0.1, 0.2, 0.3, 0.4]), "b": torch.tensor([5.0, 0.01, 0.02, 0.03])}
    chosen = select_lowest(scores, 0.5)
    assert sum(len(v) for v in chosen.values()) == 4
    assert set(chosen["b"]) == {1, 2, 3}  # the low heads of layer b, relative to its own scale
    everything = select_lowest(scores, 0.99)
    assert all(4 - len(v) >= 1 for v in everything.values())


def _bert_recipe(stages: list[dict]) -> dict:
    sst2 = SHARED_DATA / "sst2"
    return {
        "name": "bert",
        "model": {"factory": "bert_classifier",
                  "kwargs": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64,
                             "max_positions": 32, "seed": 0}},
        "data": {"format": "parquet", "train": str(sst2 / "train.parquet"), "eval": str(sst2 / "dev.parquet"),
                 "input_column": "sentence", "tokenizer": str(sst2 / "vocab.txt"), "max_length": 24,
                 "max_train_samples": 256, "max_eval_samples": 64},
        "stages": stages,
    }


@pytest.mark.slow
@pytest.mark.shared_data
def test_bert_recipe_prunes_heads_end_to_end_and_exports(tmp_path, write_recipe):
    if not (SHARED_DATA / "sst2").is_dir():
        pytest.skip("shared sst2 data not found")
    from pruneflow.pipeline import run_recipe
    from pruneflow.recipe import load_recipe

    recipe = _bert_recipe([
        {"type": "train", "epochs": 1, "optimizer": "adamw", "lr": 0.001, "batch_size": 64},
        {"type": "prune", "importance": "taylor", "target": {"heads": 0.5, "ffn": 0.25}, "rounds": 1,
         "finetune": None, "latency": None},
        {"type": "export", "targets": ["onnx"], "latency": None},
    ])
    result = run_recipe(load_recipe(write_recipe(json.dumps(recipe))), out=tmp_path / "runs")
    m = result.metrics
    assert result.exit_code == 0
    assert (m["prune.heads_before"], m["prune.heads"]) == (8, 4)
    assert (m["prune.ffn_neurons_before"], m["prune.ffn_neurons"]) == (128, 96)
    assert m["onnx.fp32.top1_agreement"] == 1.0 and m["onnx.fp32.max_abs_diff"] < 1e-4


def test_fade_on_a_transformer_is_an_unknown_key_at_its_line(write_recipe):
    """A heads/ffn target selects the transformer variant, which has no `fade`: the recipe does not load."""
    from pruneflow.errors import RecipeError
    from pruneflow.recipe import load_recipe

    recipe = _bert_recipe([{"type": "prune", "target": {"heads": 0.5}, "fade": 0.5, "latency": None}])
    path = write_recipe(recipe)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    (issue,) = err.value.issues
    assert (issue.path, issue.value, issue.location()) == ("stages.0.fade", 0.5, f"{path}:{_line(path, 'fade:')}")
    assert issue.message.startswith("unknown key")


def _line(path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


def test_the_round_loop_records_one_round_per_round_for_heads():
    from pruneflow.context import Reporter
    from pruneflow.prune.config import HeadPruneConfig
    from pruneflow.prune.heads import HeadStrategy
    from pruneflow.prune.rounds import run_rounds

    model = perturbed_bert()
    x, y = torch.randint(0, 120, (8, 12)), torch.randint(0, 3, (8,))
    cfg = HeadPruneConfig(target={"heads": 0.5, "ffn": 0.25}, rounds=2, importance="taylor", finetune=None, latency=None)
    strategy = HeadStrategy(cfg, model, x[:1], F.cross_entropy, lambda *keys: ("stages", 1, *keys))
    before = strategy.entering()
    strategy.prepare()
    records, seconds = run_rounds(strategy, EvalOnly(x, y), lambda k: [(x, y)], Reporter(), "prune")
    assert [r.index for r in records] == [1, 2] and seconds > 0
    # Each round removes its share of the original counts: 2 of 8 heads and 16 of 128 neurons a round.
    assert [(r.figures["heads"], r.figures["ffn_neurons"]) for r in records] == [(6, 112), (4, 96)]
    assert [r.removed for r in records] == [{"heads": 2, "ffn_neurons": 16}] * 2
    assert [r.goal for r in records] == [{"heads": 0.25, "ffn": 0.125}, {"heads": 0.5, "ffn": 0.25}]
    assert records[0].figures["macs"] > records[1].figures["macs"] and before["macs"] > records[0].figures["macs"]
    assert all(r.metric == "accuracy" and 0 <= r.value <= 1 for r in records)
    assert strategy.row(records[1])["heads"] == 4 and strategy.summary(records[1].figures)["heads_before"] == 8




def test_a_macs_budget_on_torchs_encoder_layers_runs_and_one_below_its_floor_is_refused_up_front():
    """`nn.TransformerEncoderLayer` reads `self_attn.in_proj_bias` before its fused eval path: the converted attention
    answers None (the layer then calls it), so the model computes the same in eval mode; its FFN is not a site, so
    heads alone cannot reach half the MACs: refused before any round, with a floor the next run reaches."""
    import copy
    import re

    from pydantic import TypeAdapter
    from torch import nn

    from pruneflow.errors import ConfigError
    from pruneflow.prune.config import PruneConfig
    from pruneflow.prune.heads import HeadStrategy
    from pruneflow.prune.rounds import run_rounds

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, norm_first=True, dropout=0.0)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(16, 3)

        def forward(self, x):
            return self.head(self.encoder(x)[:, 0])

    from conftest import Quiet, Untuned

    torch.manual_seed(0)
    model, x, y = Encoder().eval(), torch.randn(6, 5, 16), torch.randint(0, 3, (6,))
    expected = model(x)
    loc = lambda *keys: ("stages", 0, *keys)  # noqa: E731
    cfg = TypeAdapter(PruneConfig).validate_python({"type": "prune", "granularity": "heads", "target": {"macs": 0.5},
                                                    "rounds": 1, "finetune": None, "latency": None})
    strategy = HeadStrategy(cfg, copy.deepcopy(model), x[:1], F.cross_entropy, loc)
    strategy.entering()
    assert torch.allclose(strategy.model.eval()(x), expected, atol=1e-5)  # converted, the eval path is the same function
    with pytest.raises(ConfigError) as err:
        strategy.prepare()
    assert err.value.loc == loc("target", "macs") and "by removing heads (" in err.value.detail  # it has no FFN site
    floor = float(re.search(r"target: \{macs: ([\d.]+)\}", err.value.hint).group(1))
    pruned = copy.deepcopy(model)
    strategy = HeadStrategy(cfg.model_copy(update={"target": cfg.target.model_copy(update={"macs": floor})}), pruned, x[:1],
                            F.cross_entropy, loc)
    before = strategy.entering()["macs"]
    strategy.prepare()
    records, _ = run_rounds(strategy, Untuned(), lambda k: [(x, y)], Quiet(), "prune")
    assert records[-1].figures["macs"] <= floor * before and pruned.eval()(x).shape == (6, 3)
