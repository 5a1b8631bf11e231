"""pruneflow.checkpoint: weights + structure + the model kind's plain payload, read with weights-only loading;
a file holding pickled objects is refused, whoever vouches for it."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from pruneflow.artifacts import Artifact, Manifest
from pruneflow.checkpoint import FORMAT, describe_structure, load_checkpoint, save_checkpoint
from pruneflow.errors import InputError
from pruneflow.handle import ModelHandle


class _Trap:
    """Unpickling this creates ``marker``: proof that code ran while loading."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _model(out=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, out), nn.ReLU(), nn.BatchNorm1d(out))


def _hidden(model: nn.Module) -> list[str]:
    """Every ``_pruneflow_*`` attribute on a module of ``model``: what the handle replaced."""
    return [f"{name}.{key}" for name, m in model.named_modules() for key in vars(m) if key.startswith("_pruneflow_")]


def test_state_dict_round_trip(tmp_path):
    model = _model()
    model[2].running_mean.fill_(0.5)
    path = tmp_path / "run" / "stages" / "01-train" / "model.pt"
    save_checkpoint(ModelHandle(model), path)
    assert path.is_file()
    assert [p.name for p in path.parent.iterdir()] == ["model.pt"]  # no temporary file left behind
    payload = torch.load(path, map_location="cpu", weights_only=True)  # a plain weights-only file
    assert payload["format"] == FORMAT and payload["kind"] == "float" and payload["kind_payload"] == {}
    assert payload["structure"] == describe_structure(model) and "module" not in payload
    fresh = _model(seed=1)
    loaded = load_checkpoint(path, into=fresh)
    assert loaded.kind == "float" and loaded.float_base is None and not loaded.quantized
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.module.state_dict()[k], v)
    assert not torch.equal(fresh[0].weight, model[0].weight)  # the recipe's model is left as it was
    assert _hidden(loaded.module) == []


def test_a_checkpoint_needs_the_recipes_model_and_one_of_the_same_architecture(tmp_path):
    save_checkpoint(ModelHandle(_model()), tmp_path / "m.pt")
    with pytest.raises(InputError, match="holds weights and structure, not code"):
        load_checkpoint(tmp_path / "m.pt")
    other = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.BatchNorm1d(3))
    with pytest.raises(InputError, match=r"m\.pt holds a model that does not fit the model the recipe builds: "
                                          r"module '1' is a Tanh, the checkpoint's a ReLU"):
        load_checkpoint(tmp_path / "m.pt", into=other)


def test_meta_travels_through_the_checkpoint(tmp_path):
    save_checkpoint(ModelHandle(_model(), meta={"rounds": 3, "note": "x"}), tmp_path / "m.pt")
    assert load_checkpoint(tmp_path / "m.pt", into=_model()).meta == {"rounds": 3, "note": "x"}


def test_a_pickled_module_is_refused_and_runs_no_code_even_when_a_manifest_lists_it(tmp_path):
    """Earlier versions pickled pruned models; no file is unpickled now, whatever vouches for it."""
    marker = tmp_path / "pwned"
    run_dir = tmp_path / "run"
    path = run_dir / "stages" / "02-prune" / "model.pt"
    path.parent.mkdir(parents=True)
    torch.save({"format": "pruneflow-checkpoint/1", "state_dict": _model().state_dict(), "module": _model(out=2),
                "trap": _Trap(str(marker))}, path)
    manifest = Manifest(run_dir, "test")  # our own manifest, recording the file's exact sha256
    manifest.add_stage({"id": "prune"}, [Artifact.from_file(run_dir, path, kind="checkpoint", producer="prune")])
    assert json.loads((run_dir / Manifest.FILE).read_text())["artifacts"][0]["sha256"]
    with pytest.raises(InputError, match="holds pickled Python objects .* which pruneflow never unpickles") as info:
        load_checkpoint(path, into=_model())
    assert info.value.exit_code == 2 and "state_dict" in info.value.hint
    assert not marker.exists()


def test_a_checkpoint_of_an_earlier_format_is_refused_with_the_fix(tmp_path):
    """Only the current format is read (this young project keeps no reader for earlier ones)."""
    pruned = _model(out=2).eval()
    torch.save({"format": "pruneflow-checkpoint/1", "state_dict": pruned.state_dict(), "structure": describe_structure(pruned)},
               tmp_path / "old.pt")
    with pytest.raises(InputError, match=r"old\.pt is a pruneflow checkpoint of another format \(pruneflow-checkpoint/1\); "
                                          f"this version reads {FORMAT}") as info:
        load_checkpoint(tmp_path / "old.pt", into=_model(out=3))
    assert "re-run the stage" in info.value.hint


def test_a_module_class_is_rebuilt_only_when_registered(tmp_path):
    """A checkpoint holding a module of another class than the recipe model's reloads when that class is
    registered under ``registry.rebuildable_modules`` (by whoever puts it in models); otherwise it does not fit."""
    from pruneflow import registry

    class Gate(nn.Module):  # a third party's rewrite of the ReLU, with a plain attribute
        def __init__(self, slope: float = 0.0):
            super().__init__()
            self.slope = slope

        def forward(self, x):
            return torch.where(x > 0, x, self.slope * x)

    model = _model().eval()
    model[1] = Gate(0.25)
    save_checkpoint(ModelHandle(model), tmp_path / "m.pt")
    with pytest.raises(InputError, match="module '1' is a ReLU, the checkpoint's a Gate"):
        load_checkpoint(tmp_path / "m.pt", into=_model())
    with registry.rebuildable_modules.registered("Gate", Gate):
        loaded = load_checkpoint(tmp_path / "m.pt", into=_model(seed=1))
    x = torch.randn(5, 4)
    assert isinstance(loaded.module[1], Gate) and loaded.module[1].slope == 0.25
    assert torch.equal(loaded.module.eval()(x), model(x))


def test_files_that_are_not_pruneflow_checkpoints(tmp_path):
    with pytest.raises(InputError, match=r"checkpoint not found: .*nope\.pt"):
        load_checkpoint(tmp_path / "nope.pt", into=_model())
    torch.save(_model().state_dict(), tmp_path / "plain.pt")
    with pytest.raises(InputError, match="is not a pruneflow checkpoint") as info:
        load_checkpoint(tmp_path / "plain.pt", into=_model())
    assert "model.checkpoint" in info.value.hint
    (tmp_path / "empty.pt").write_bytes(b"")
    with pytest.raises(InputError, match=r"empty\.pt is not a readable checkpoint: EOFError"):
        load_checkpoint(tmp_path / "empty.pt", into=_model())
    torch.save({"format": FORMAT, "state_dict": {}}, tmp_path / "partial.pt")
    with pytest.raises(InputError, match=r"partial\.pt is not a pruneflow checkpoint \(it has no kind, structure"):
        load_checkpoint(tmp_path / "partial.pt", into=_model())
    save_checkpoint(ModelHandle(_model()), tmp_path / "alien.pt")
    payload = torch.load(tmp_path / "alien.pt", weights_only=True)
    torch.save(dict(payload, kind="alien"), tmp_path / "alien.pt")
    with pytest.raises(InputError, match="unknown model kind 'alien'"):
        load_checkpoint(tmp_path / "alien.pt", into=_model())


def test_a_pruned_model_is_saved_as_weights_and_structure_and_loads_from_anywhere(tmp_path):
    pruned = _model(out=2).eval()
    pruned[2].running_var.fill_(2.0)
    path = tmp_path / "copied" / "model.pt"  # no run directory, no manifest: nothing needs vouching for
    save_checkpoint(ModelHandle(pruned), path)
    payload = torch.load(path, map_location="cpu", weights_only=True)  # no pickled code in it
    assert "module" not in payload and payload["structure"]["0"] == {
        "class": "Linear", "attrs": {"in_features": 4, "out_features": 2}}
    fresh = _model(out=3, seed=5)
    loaded = load_checkpoint(path, into=fresh).module
    assert loaded[0].out_features == 2 and loaded[2].num_features == 2
    assert fresh[0].out_features == 3 and fresh[0].weight.shape == (3, 4)  # the recipe's model is left as it was
    assert loaded[0].weight.requires_grad
    x = torch.randn(6, 4)
    assert torch.equal(loaded.eval()(x), pruned(x))


def test_a_pruned_structure_that_does_not_fit_the_recipes_model_is_a_clear_error(tmp_path):
    save_checkpoint(ModelHandle(_model(out=2)), tmp_path / "m.pt")
    payload = torch.load(tmp_path / "m.pt", weights_only=True)
    payload["structure"]["0"]["attrs"].update(_forward_hooks=None, forward="x")  # never applied: not what we write
    torch.save(payload, tmp_path / "m.pt")
    assert load_checkpoint(tmp_path / "m.pt", into=_model(out=3)).module[0].out_features == 2
    other = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.BatchNorm1d(3))
    with pytest.raises(InputError, match=r"m\.pt holds a model that does not fit the model the recipe builds: "
                                          r"module '1' is a Tanh, the checkpoint's a ReLU") as info:
        load_checkpoint(tmp_path / "m.pt", into=other)
    assert "recipe.resolved.yaml" in info.value.hint
    short = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    with pytest.raises(InputError, match="has no module '2'"):
        load_checkpoint(tmp_path / "m.pt", into=short)
    assert short[0].out_features == 3 and short[0].weight.shape == (3, 4)  # a failed load changes nothing


def test_a_pruned_resnet_with_rewritten_shortcuts_round_trips(tmp_path):
    from pruneflow.prune.engine import PruneOptions, prune_step, resolve_ignored
    from pruneflow.prune.importance import magnitude_saliency
    from pruneflow.prune.surgery import ChannelEmbedConv, make_prunable
    from pruneflow.zoo import resnet20

    torch.manual_seed(0)
    model, example = resnet20(), torch.randn(2, 3, 32, 32)
    make_prunable(model, example)
    prune_step(model, example, magnitude_saliency(model), 0.4, PruneOptions(ignored=resolve_ignored(model, None), round_to=4))
    model.eval()
    save_checkpoint(ModelHandle(model), tmp_path / "model.pt")
    loaded = load_checkpoint(tmp_path / "model.pt", into=resnet20()).module.eval()  # the factory's model, option-A shortcuts
    assert isinstance(loaded.layer2[0].shortcut, ChannelEmbedConv) and not loaded.layer2[0].shortcut.weight.requires_grad
    assert _hidden(loaded) == []  # reshaping sets only what the structure records
    assert torch.equal(loaded(example), model(example))
    assert sum(p.numel() for p in loaded.parameters()) == sum(p.numel() for p in model.parameters())


def test_a_head_pruned_bert_round_trips(tmp_path):
    pytest.importorskip("transformers")
    from pruneflow.prune.transformer import attention_sites, ffn_sites, prune_heads, prune_neurons
    from pruneflow.zoo.hf import bert_classifier

    def build(seed):
        return bert_classifier(vocab_size=120, hidden_size=32, num_layers=2, num_heads=4, intermediate_size=64,
                               max_positions=32, num_labels=3, seed=seed).eval()

    model = build(0)
    prune_heads(attention_sites(model)[0], [1, 3])
    prune_neurons(ffn_sites(model)[1], list(range(10)))
    save_checkpoint(ModelHandle(model), tmp_path / "model.pt")
    loaded = load_checkpoint(tmp_path / "model.pt", into=build(1)).module.eval()
    assert [s.heads for s in attention_sites(loaded)] == [2, 4]
    ids = torch.randint(1, 120, (3, 16))
    assert torch.allclose(loaded(ids), model(ids), atol=1e-6)
