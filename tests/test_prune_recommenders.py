"""Pruning production recommenders (issue 37, item 2): an MMoE's gates, GRU/LSTM hidden units, SASRec's causal
attention, its FFN and its item table tied to the output projection; and messages whose suggested fixes the next
run accepts."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
import yaml
from pydantic import TypeAdapter
from torch import nn

from conftest import Quiet, Untuned
from pruneflow.checkpoint import load_checkpoint, save_checkpoint
from pruneflow.errors import ConfigError
from pruneflow.evaluate import count_macs_params, macs_by_module
from pruneflow.handle import ModelHandle
from pruneflow.prune import channels as channels_module
from pruneflow.prune import rnn as rnn_units
from pruneflow.prune.channels import ChannelStrategy, check_prunable
from pruneflow.prune.config import ChannelPruneConfig, HeadPruneConfig, PruneConfig
from pruneflow.prune.engine import PruneOptions, layer_widths, measure, plan_step, prune_step
from pruneflow.prune.heads import HeadStrategy
from pruneflow.prune.importance import magnitude_saliency
from pruneflow.prune.mha import HeadAttention, convert_mha
from pruneflow.prune.rounds import run_rounds
from pruneflow.prune.tp_adapter import Selection, build_graph, prune
from pruneflow.prune.transformer import ffn_sites
from pruneflow.zoo.mmoe import mmoe
from pruneflow.zoo.sequence import gru4rec, sasrec

from conftest import invoke, write


def _loc(*keys):
    return ("stages", 0, *keys)




def _run(strategy) -> None:
    strategy.entering()
    strategy.prepare()
    run_rounds(strategy, Untuned(), lambda k: [], Quiet(), "prune")


def _channels(target: dict, **extra) -> ChannelPruneConfig:
    return ChannelPruneConfig(target=target, rounds=1, importance="magnitude", finetune=None, latency=None, **extra)


def _perturb(model: nn.Module, seed: int = 0) -> nn.Module:
    """Weights far from their init (a trained model's): equalities below must hold for any weights."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


# --------------------------------------------------------------------------- GRU / LSTM hidden units


class Recurrent(nn.Module):
    """A Linear feeding a recurrent layer (so its input features are prunable too), the last state to a head."""

    def __init__(self, cell: type[nn.RNNBase], layers: int = 1, hidden: int = 12):
        super().__init__()
        self.inp = nn.Linear(6, 10)
        self.rnn = cell(10, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        states, _ = self.rnn(torch.relu(self.inp(x)))
        return self.head(states[:, -1])


@pytest.mark.parametrize("cell,layers", [(nn.GRU, 1), (nn.GRU, 2), (nn.LSTM, 1), (nn.LSTM, 2)],
                         ids=["gru", "gru-2-layers", "lstm", "lstm-2-layers"])
def test_removing_units_whose_rows_are_zero_changes_no_output(cell, layers):
    """Removing hidden units j takes rows j, H+j, ... of every gate and column j of weight_hh (and of the next layer's
    weight_ih), plus the consumer's input column j. A unit whose rows are all zero stays zero from h0 = 0, so if the
    surgery kept the gates consistent, the pruned model equals the unpruned one exactly."""
    torch.manual_seed(0)
    model = _perturb(Recurrent(cell, layers))
    gone = [1, 5, 7]
    with torch.no_grad():
        for name, dim, idx in rnn_units.unit_slices(model.rnn, gone):
            if dim == 0:  # only the units' own rows: their columns still hold weights, which must go with them
                getattr(model.rnn, name).index_fill_(0, idx, 0.0)
    x = torch.randn(4, 9, 6)
    expected = model(x)
    graph = build_graph(model, x[:1])
    prune(graph, Selection(model.rnn, graph.get_pruner_of_module(model.rnn).prune_out_channels, gone))
    assert model.rnn.hidden_size == 9 and model.head.in_features == 9
    assert model.rnn.weight_hh_l0.shape == (rnn_units.gates(model.rnn) * 9, 9)
    assert torch.allclose(model(x), expected, atol=1e-6)


def test_a_producer_of_a_recurrent_layer_loses_the_columns_it_fed():
    torch.manual_seed(0)
    model = _perturb(Recurrent(nn.GRU))
    x = torch.randn(2, 5, 6)
    graph = build_graph(model, x[:1])
    prune(graph, Selection(model.inp, graph.get_pruner_of_module(model.inp).prune_out_channels, [0, 3]))
    assert model.inp.out_features == 8 and model.rnn.input_size == 8 and model.rnn.weight_ih_l0.shape[1] == 8
    assert model(x).shape == (2, 3)


def test_gru4rec_hidden_units_pruned_to_half_the_macs_and_the_checkpoint_reloads(tmp_path):
    """gru4rec was refused ("nothing to prune": torch-pruning has no GRU pruner); now its hidden units go, with the
    output Linear's input columns, and the pruned model reloads from its checkpoint."""
    torch.manual_seed(0)
    model = gru4rec(300, dim=16, hidden=32).eval()
    x = torch.randint(1, 300, (4, 10))
    strategy = ChannelStrategy(_channels({"macs": 0.5}), model, x[:1], F.cross_entropy, _loc)
    before = strategy.entering()["macs"]
    strategy.prepare()
    run_rounds(strategy, Untuned(), lambda k: [], Quiet(), "prune")
    macs, _ = count_macs_params(model, x[:1])
    assert macs <= 0.5 * before
    assert 3 <= model.gru.hidden_size < 32 and model.output.in_features == model.gru.hidden_size
    assert model.output.out_features == 300 and model.items.embedding_dim == 16  # catalogue and table whole
    save_checkpoint(ModelHandle(model), tmp_path / "model.pt")
    again = load_checkpoint(tmp_path / "model.pt", into=gru4rec(300, dim=16, hidden=32)).module.eval()
    assert again.gru.hidden_size == model.gru.hidden_size and torch.equal(again(x), model(x))


@pytest.mark.parametrize("ranking", ["relative", "per_mac"])
def test_faded_hidden_units_are_removed_without_changing_the_output(ranking):
    """`fade` scales every slice a plan removes to zero before removing it: for a recurrent layer, the units' rows in
    every gate and their columns (rnn.unit_slices). Faded to zero, the removal changes no output; `per_mac` prices
    a unit by its MACs over the time steps (rnn.unit_cost)."""
    torch.manual_seed(0)
    model = _perturb(Recurrent(nn.GRU, layers=2))
    x = torch.randn(3, 7, 6)
    opts = PruneOptions(ignored=("head",), ranking=ranking, initial_widths=layer_widths(model))
    plan = plan_step(model, x[:1], magnitude_saliency(model), 0.4, opts)
    assert any(s.module is model.rnn for s in plan.roots)
    plan.fader(1.0)(1, 1)  # the last step of the fade: the chosen slices are zero
    faded = model(x)
    plan.apply()
    assert model.rnn.hidden_size < 12 and model.head.in_features == model.rnn.hidden_size
    assert torch.allclose(model(x), faded, atol=1e-6)


def test_a_bidirectional_gru_is_kept_whole_and_says_why():
    class Bi(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp = nn.Linear(6, 8)
            self.rnn = nn.GRU(8, 8, batch_first=True, bidirectional=True)
            self.head = nn.Linear(16, 2)

        def forward(self, x):
            return self.head(self.rnn(self.inp(x))[0][:, -1])

    model, x = Bi().eval(), torch.randn(2, 5, 6)
    kept = channels_module.kept_whole(model, None, _loc, x[:1])
    assert "rnn" in kept.ignored and any("bidirectional" in n for n in kept.notes)
    prune_step(model, x[:1], magnitude_saliency(model), 0.5, PruneOptions(ignored=kept.ignored))
    assert model.rnn.hidden_size == 8 and model.inp.out_features < 8 and model(x).shape == (2, 2)


# --------------------------------------------------------------------------- MMoE


def _mmoe(experts: int = 4) -> nn.Module:
    return _perturb(mmoe([50, 20, 7], num_dense=3, embedding_dim=4, experts=experts, expert_hidden=16, tower_hidden=8))


def _mmoe_inputs(n: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"ids": torch.stack([torch.randint(0, c, (n,), generator=g) for c in (50, 20, 7)], 1), "dense": torch.randn(n, 3, generator=g)}


def test_mmoe_keeps_the_expert_count_and_prunes_to_half_the_macs():
    """The gates (one output per expert) were in one torch-pruning group with the experts' 16 output channels
    (stack and broadcast taken as element-wise): scoring index 4 of a 4-row gate crashed (IndexError, exit 4)."""
    model = _mmoe()
    x = _mmoe_inputs()
    strategy = ChannelStrategy(_channels({"macs": 0.5}), model, {k: v[:1] for k, v in x.items()}, F.mse_loss, _loc)
    before = strategy.entering()["macs"]
    strategy.prepare()
    assert {"gates.0", "gates.1", "experts.0.2", "experts.3.2"} <= set(strategy.ignored)
    run_rounds(strategy, Untuned(), lambda k: [], Quiet(), "prune")
    assert count_macs_params(model, {k: v[:1] for k, v in x.items()})[0] <= 0.5 * before
    assert all(g.out_features == 4 for g in model.gates)  # the expert count never changes
    assert {e[2].out_features for e in model.experts} == {16} and all(e[0].out_features < 16 for e in model.experts)
    out = model(**x)
    assert set(out) == {"click", "finish"} and all(v.shape == (8, 1) for v in out.values())
    assert any("gates" in row["note"] and "kept whole" in row["note"] for row in strategy.tables([])["notes"])


def _mmoe_recipe(tmp_path, stage: dict) -> dict:
    return {"name": "mmoe-try", "seed": 0,
            "model": {"factory": "mmoe", "kwargs": {"embedding_dim": 4, "experts": 4, "expert_hidden": 16, "tower_hidden": 8}},
            "task": {"type": "binary", "output": "click"},
            "data": {"format": "clicklog", "clicklog": {"rows": 2000, "users": 200, "items": 50, "seed": 0},
                     "label_column": "clicked",
                     "features": {"categorical": ["user_id", "item_id", "device"], "numeric": ["price"], "log1p": ["price"]}},
            "stages": [{"type": "train", "epochs": 1, "batch_size": 256}, {"type": "prune", **stage}]}


def _doctor_prune_row(recipe) -> dict:
    import json

    result = invoke("doctor", recipe, "--json")
    checks = json.loads(result.stdout.strip().splitlines()[-1])["checks"]
    rows = [c for c in checks if c["where"].startswith("prune") and c["status"] != "ok"]
    return rows[0] if rows else [c for c in checks if c["check"] == "pruning to the target in one round"][0]


def test_doctor_names_the_failing_group_and_its_ignore_list_is_accepted(tmp_path, monkeypatch):
    """Without the check that keeps such groups whole, torch-pruning's failure reaches doctor: it named no module and
    suggested attention heads in a model that has none. Now it names the group's layer and the `ignore` list (the
    default classifier kept) that keeps the group whole, and doctor accepts that list on the next run."""
    monkeypatch.setattr(channels_module, "whole_groups", lambda *args, **kwargs: [])
    recipe = write(tmp_path / "r.yaml", _mmoe_recipe(tmp_path, {"target": {"macs": 0.5}}))
    row = _doctor_prune_row(recipe)
    assert row["status"] == "will fail" and "stages.1.ignore" in row["why"] and "heads" not in row["fix"]
    named = re.search(r"channel group of (\S+)", row["why"]).group(1)
    assert named.startswith(("experts.", "gates.")), row
    listed = re.search(r"ignore: \[([^\]]+)\]", row["fix"]).group(1).split(", ")
    assert named in listed and "towers.1.2" in listed  # the default classifier stays ignored
    write(recipe, _mmoe_recipe(tmp_path, {"target": {"macs": 0.5}, "ignore": listed}))
    assert _doctor_prune_row(recipe)["status"] == "ok"


# --------------------------------------------------------------------------- SASRec


def _sasrec() -> nn.Module:
    torch.manual_seed(0)
    return _perturb(sasrec(500, dim=16, heads=2, blocks=2, max_len=12, dropout=0.0))


def _seq(n: int = 4) -> torch.Tensor:
    x = torch.randint(1, 500, (n, 12), generator=torch.Generator().manual_seed(1))
    x[0, :5] = 0  # left padding
    return x


def test_head_attention_equals_multihead_attention_under_the_causal_mask():
    model, x = _sasrec(), _seq()
    expected = model(x)
    assert convert_mha(model) == ["blocks.0.attention", "blocks.1.attention"]
    assert torch.allclose(model(x), expected, atol=1e-5)


def test_sasrec_heads_and_ffn_are_pruned_and_the_tied_table_stays_tied():
    """`{heads: 0.5, ffn: 0.5}` was refused ("ffn counts the FFN neurons of BERT-style layers"): the pointwise FFN
    beside the attention (`nn.Sequential(Linear, ReLU, Dropout, Linear)`) is an FFN site now."""
    model, x = _sasrec(), _seq()
    cfg = HeadPruneConfig(target={"heads": 0.5, "ffn": 0.5}, rounds=1, importance="magnitude", finetune=None, latency=None)
    strategy = HeadStrategy(cfg, model, x[:1], F.cross_entropy, _loc)
    before = strategy.entering()["macs"]
    assert [s.name for s in ffn_sites(model)] == ["blocks.0.ffn", "blocks.1.ffn"]
    run_rounds(strategy, Untuned(), lambda k: [], Quiet(), "prune")
    attention = [b.attention for b in model.blocks]
    assert all(isinstance(a, HeadAttention) and a.num_heads == 1 for a in attention)
    assert sum(b.ffn[0].out_features for b in model.blocks) == 16
    assert model.output.weight is model.items.weight
    after = count_macs_params(model, x[:1])[0]
    assert after < 0.65 * before and model(x).shape == (4, 500)


def _refusal(strategy) -> ConfigError:
    strategy.entering()
    with pytest.raises(ConfigError) as err:
        strategy.prepare()
    return err.value


def test_sasrec_macs_half_is_refused_up_front_with_the_floor_and_fixes_the_next_run_accepts():
    """Channel pruning keeps attention and the tied item table/output projection whole; `macs: 0.5` was refused in
    round 2 of 3, after pruning and fine-tuning. Now prepare() refuses it (no round has run), states the floor and
    what cannot shrink, and both suggested fixes run."""
    x = _seq()
    scored = []
    loss = lambda out, y: scored.append(1) or F.cross_entropy(out, y)  # noqa: E731 - must never run
    error = _refusal(ChannelStrategy(_channels({"macs": 0.5}), _sasrec(), x[:1], loss, _loc))
    assert error.loc == _loc("target") and not scored
    floor = float(re.search(r"\(([\d.]+)% of the model entering the stage\)", error.detail).group(1)) / 100
    assert floor > 0.5 and "output (tied)" in error.detail and "attention" in error.detail
    assert re.search(r"it cannot shrink \(blocks\.\d\.attention [\d.]+%", error.detail)
    whole = float(re.search(r"([\d.]+)% of its MACs are in modules it cannot shrink", error.detail).group(1)) / 100
    prunable = float(re.search(r"the other ([\d.]+)% in layers it prunes", error.detail).group(1)) / 100
    assert abs(whole + prunable - 1) < 0.002 and 1 - prunable * 0.9 <= floor + 0.01  # the floor follows from the two

    suggested = float(re.search(r"target: \{macs: ([\d.]+)\}", error.hint).group(1))
    assert floor < suggested <= floor + 0.03
    model = _sasrec()
    strategy = ChannelStrategy(_channels({"macs": suggested}), model, x[:1], F.cross_entropy, _loc)
    before = strategy.entering()["macs"]
    strategy.prepare()
    run_rounds(strategy, Untuned(), lambda k: [], Quiet(), "prune")
    assert count_macs_params(model, x[:1])[0] <= suggested * before
    assert model.output.weight is model.items.weight and model.items.embedding_dim == 16  # the tied pair whole

    units = yaml.safe_load(re.search(r"(\{type: prune, target: \{[^}]+\}\})", error.hint).group(1))
    share = float(re.search(r"leaves ([\d.]+)% of the MACs", error.hint).group(1)) / 100
    assert share <= 0.5  # the suggestion reaches the target the recipe asked for
    stage = TypeAdapter(PruneConfig).validate_python(units)  # as a recipe's stage validates: the heads variant
    assert isinstance(stage, HeadPruneConfig)
    model = _sasrec()
    cfg = stage.model_copy(update={"rounds": 1, "importance": "magnitude", "finetune": None, "latency": None})
    heads = HeadStrategy(cfg, model, x[:1], F.cross_entropy, _loc)
    before = heads.entering()["macs"]
    run_rounds(heads, Untuned(), lambda k: [], Quiet(), "prune")
    assert count_macs_params(model, x[:1])[0] <= 0.51 * before and model(x).shape == (4, 500)


def test_channel_pruning_never_unties_a_tied_pair():
    """A Linear tied to a table with no attention around (every residual group reaches the tied pair): the groups
    through the tied weight stay whole, the rest is pruned, the weight stays one Parameter."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.items = nn.Embedding(40, 8)
            self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
            self.output = nn.Linear(8, 40, bias=False)
            self.output.weight = self.items.weight

        def forward(self, seq):
            return self.output(self.mlp(self.items(seq).mean(1)))

    model, x = _perturb(Tied()), torch.randint(0, 40, (3, 5))
    ignored = check_prunable(model, None, _loc, x[:1])
    assert {"items", "output", "mlp.2"} <= set(ignored)
    prune_step(model, x[:1], magnitude_saliency(model), 0.5, PruneOptions(ignored=ignored, initial_widths=layer_widths(model)))
    assert model.output.weight is model.items.weight and model.items.weight.shape == (40, 8)
    assert model.mlp[0].out_features < 16 and model(x).shape == (3, 40)
    assert measure(model, x[:1], ignored)["channels"] < 16 + 8


# --------------------------------------------------------------------------- width, with a tied table


class TiedMlp(nn.Module):
    """An item table tied to the output projection, an MLP reading and writing its width, no norm: zeroing a
    channel of the width everywhere is then exactly what removing it computes."""

    def __init__(self):
        super().__init__()
        self.items = nn.Embedding(40, 8)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.output = nn.Linear(8, 40, bias=False)
        self.output.weight = self.items.weight

    def forward(self, seq):
        h = self.items(seq).mean(1)
        return self.output(h + self.mlp(h))


def test_width_of_a_tied_table_is_removed_on_both_sides_and_equals_zeroing_it():
    from pruneflow.prune.width import prune_width, width_sites

    def build() -> nn.Module:
        torch.manual_seed(0)
        return _perturb(TiedMlp())

    model, x = build(), torch.randint(0, 40, (3, 5))
    (site,) = width_sites(model, x[:1])
    assert site.name == "items" and site.width == 8 and model.items in site.masked  # no norm: masked where written
    gone = [1, 4, 6]
    zeroed = build()
    with torch.no_grad():
        zeroed.items.weight[:, gone] = 0  # the table's columns, which are the tied projection's
        zeroed.mlp[2].weight[gone] = 0
        zeroed.mlp[2].bias[gone] = 0
        expected = zeroed(x)
    assert prune_width(model, x[:1], "items", gone) == 5
    assert model.output.weight is model.items.weight and model.items.weight.shape == (40, 5)
    assert model.mlp[0].in_features == 5 and model.mlp[2].out_features == 5 and model.mlp[0].out_features == 16
    assert torch.allclose(model(x), expected, atol=1e-5)


def test_sasrec_width_goes_with_its_tied_output_projection_and_reloads_tied(tmp_path):
    """Issue 37 item 2: the item table tied to the output projection (most of a small SASRec's MACs) is pruned with
    the residual stream, every LayerNorm, every projection reading or writing it and the position table; the table
    stays one Parameter, the checkpoint reloads tied and computes the same, the scale sqrt(dim) stays the trained one."""
    model, x = _sasrec(), _seq()
    cfg = HeadPruneConfig(target={"heads": 0.5, "ffn": 0.5, "width": 0.25}, rounds=2, importance="hessian", finetune=None,
                          latency=None)
    strategy = HeadStrategy(cfg, model, x[:1], F.cross_entropy, _loc)
    before = strategy.entering()["macs"]
    output_before = macs_by_module(model, x[:1])["output"]
    y = torch.randint(1, 500, (4,))
    records, _ = run_rounds(strategy, Untuned(), lambda k: [(x, y)], Quiet(), "prune")
    assert [r.figures["width"] for r in records] == [14, 12] and strategy.summary(records[-1].figures)["width_before"] == 16
    assert model.items.weight.shape == (500, 12) and model.positions.weight.shape == (12, 12) and model.dim == 16
    assert model.output.weight is model.items.weight
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert len(norms) == 5 and all(m.normalized_shape == (12,) for m in norms)
    for block in model.blocks:
        attention = block.attention
        assert attention.embed_dim == attention.q_proj.in_features == attention.out_proj.out_features == 12
        assert attention.num_heads == 1 and block.ffn[0].in_features == block.ffn[3].out_features == 12
    assert macs_by_module(model, x[:1])["output"] == output_before * 12 // 16  # the tied projection shrank with it
    assert count_macs_params(model, x[:1])[0] < 0.6 * before
    scores = model(x)
    assert scores.shape == (4, 500) and torch.isfinite(scores).all()

    save_checkpoint(ModelHandle(model), tmp_path / "model.pt")
    reloaded = load_checkpoint(tmp_path / "model.pt", sasrec(500, dim=16, heads=2, blocks=2, max_len=12, dropout=0.0)).module.eval()
    assert reloaded.output.weight is reloaded.items.weight and reloaded.items.embedding_dim == 12
    assert torch.allclose(reloaded(x), scores, atol=1e-5)


def test_a_width_target_on_a_model_whose_tables_are_concatenated_is_refused_with_why():
    """A ranker's tables concatenated into its MLP are not a width (the `tables` granularity stores them narrower)."""

    class Concat(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Embedding(30, 4), nn.Embedding(30, 4)
            self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
            self.head = nn.Linear(8, 1)

        def forward(self, ids):
            h = torch.cat([self.a(ids[:, 0:3]), self.b(ids[:, 3:6])], -1)
            return self.head(self.attention(h, h, h)[0].mean(1))

    cfg = HeadPruneConfig(target={"width": 0.25}, rounds=1, importance="magnitude", finetune=None, latency=None)
    with pytest.raises(ConfigError) as err:
        HeadStrategy(cfg, Concat(), torch.randint(0, 30, (1, 6)), F.mse_loss, _loc).entering()
    assert err.value.loc == _loc("target", "width") and "concatenation" in err.value.detail


def test_a_macs_budget_ranks_heads_ffn_neurons_and_width_together_and_lands_on_it():
    """`granularity: heads` with `target: {macs: 0.5}`: every round lands at or just under its goal (bisection on
    pruned copies), the units go by score per MAC across the three kinds, every site keeps one unit, the tie holds."""
    from pruneflow.prune.budget import ranked_units, removable

    model, x = _sasrec(), _seq(16)
    y = torch.randint(1, 500, (16,), generator=torch.Generator().manual_seed(2))
    stage = TypeAdapter(PruneConfig).validate_python({"type": "prune", "granularity": "heads", "target": {"macs": 0.5}})
    assert isinstance(stage, HeadPruneConfig) and stage.importance == "hessian"
    cfg = stage.model_copy(update={"rounds": 2, "finetune": None, "latency": None})
    strategy = HeadStrategy(cfg, model, x[:1], F.cross_entropy, _loc)
    before = strategy.entering()["macs"]
    records, _ = run_rounds(strategy, Untuned(), lambda k: [(x, y)], Quiet(), "prune")
    for record, share in zip(records, (0.75, 0.5)):
        assert share * before - 0.03 * before < record.figures["macs"] <= share * before
    assert model.output.weight is model.items.weight and model(x).shape == (16, 500)
    assert "width" in records[-1].removed and all(b.attention.num_heads >= 1 and b.ffn[0].out_features >= 1 for b in model.blocks)

    scores = {"a": torch.tensor([1.0, 8.0, 2.0]), "b": torch.tensor([3.0, 0.5])}
    costs = {"a": torch.tensor([1.0, 2.0, 1.0]), "b": torch.tensor([1.0, 1.0])}
    order = ranked_units(scores, costs)
    assert order == [("b", 1), ("a", 0), ("a", 2), ("b", 0), ("a", 1)]  # 0.5, 1, 2, 3, 4 per MAC
    assert removable(order, {"a": 3, "b": 2}, 4) == {"a": [0, 2], "b": [1]}  # b keeps one unit: its other goes to none


def test_a_macs_budget_and_unit_shares_do_not_mix():
    with pytest.raises(Exception, match="give macs alone"):
        TypeAdapter(PruneConfig).validate_python({"type": "prune", "granularity": "heads", "target": {"macs": 0.5, "heads": 0.5}})
    assert isinstance(TypeAdapter(PruneConfig).validate_python({"type": "prune", "target": {"macs": 0.5}}), ChannelPruneConfig)


def test_when_heads_and_ffn_cannot_reach_the_target_the_refusal_suggests_a_budget_the_next_run_reaches():
    """A SASRec whose tied output projection is most of its MACs: heads and FFN alone cannot reach half, so the
    refusal of `macs: 0.5` under channels suggests the MACs budget of `granularity: heads`, which takes the width."""
    torch.manual_seed(0)
    model, x = _perturb(sasrec(3000, dim=16, heads=2, blocks=2, max_len=12, dropout=0.0)), torch.randint(1, 3000, (4, 12))
    error = _refusal(ChannelStrategy(_channels({"macs": 0.5}), model, x[:1], F.cross_entropy, _loc))
    stage = re.search(r"(\{type: prune, granularity: heads, target: \{macs: [\d.]+\}\})", error.hint).group(1)
    share = float(re.search(r"a trial of it leaves ([\d.]+)% of the MACs", error.hint).group(1)) / 100
    assert share <= 0.5 and "heads and FFN alone" in error.hint
    cfg = TypeAdapter(PruneConfig).validate_python(yaml.safe_load(stage))
    assert isinstance(cfg, HeadPruneConfig)
    cfg = cfg.model_copy(update={"rounds": 1, "importance": "magnitude", "finetune": None, "latency": None})
    strategy = HeadStrategy(cfg, model, x[:1], F.cross_entropy, _loc)
    before = strategy.entering()["macs"]
    run_rounds(strategy, Untuned(), lambda k: [], Quiet(), "prune")
    assert count_macs_params(model, x[:1])[0] <= 0.5 * before and model.items.embedding_dim < 16
    assert model.output.weight is model.items.weight
