"""pruneflow.checkpoint: state_dict and pruned-structure checkpoints (never unpickled); legacy whole-module
pickles unpickled only when a manifest vouches for them."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from pruneflow.artifacts import Artifact, Manifest, known_sha256
from pruneflow.checkpoint import FORMAT, load_checkpoint, save_checkpoint
from pruneflow.errors import InputError


class _Trap:
    """Unpickling this creates ``marker``: proof that code ran while loading."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _model(out=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, out), nn.ReLU(), nn.BatchNorm1d(out))


def _legacy_pickle(model, path):
    """A whole pickled module, as earlier versions wrote pruned models (and NNCF payloads still carry)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"format": FORMAT, "state_dict": model.state_dict(), "module": model}, path)


def _record(run_dir, file):
    """What the pipeline does after writing a checkpoint: list it, with its sha256, in the run's manifest."""
    manifest = Manifest(run_dir, "test")
    manifest.add_stage({"id": "s"}, [Artifact.from_file(run_dir, file, kind="checkpoint", producer="s")])
    return manifest


def test_state_dict_round_trip(tmp_path):
    model = _model()
    model[2].running_mean.fill_(0.5)
    path = tmp_path / "run" / "stages" / "01-train" / "model.pt"
    save_checkpoint(model, path)
    assert path.is_file()
    assert [p.name for p in path.parent.iterdir()] == ["model.pt"]  # no temporary file left behind
    payload = torch.load(path, map_location="cpu", weights_only=True)  # a plain weights-only file
    assert payload["format"] == FORMAT and "module" not in payload
    fresh = _model(seed=1)
    loaded = load_checkpoint(path, into=fresh)
    assert loaded is fresh
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)


def test_state_dict_checkpoint_needs_a_model_that_fits(tmp_path):
    save_checkpoint(_model(), tmp_path / "m.pt")
    with pytest.raises(InputError, match="holds weights only"):
        load_checkpoint(tmp_path / "m.pt")
    with pytest.raises(InputError, match=r"(?s)m\.pt does not fit the model built from the recipe: .*size mismatch for 0\.weight"):
        load_checkpoint(tmp_path / "m.pt", into=_model(out=5))


def test_whole_module_is_refused_without_manifest(tmp_path):
    pruned = _model(out=2)
    path = tmp_path / "run" / "model.pt"
    _legacy_pickle(pruned, path)
    assert not known_sha256(path)
    with pytest.raises(InputError, match="holds a pickled model, and no pruneflow manifest records its sha256") as info:
        load_checkpoint(path, into=_model(out=3))
    assert "manifest.json" in info.value.hint


def test_whole_module_loads_when_manifest_records_its_sha256(tmp_path):
    run_dir = tmp_path / "run"
    pruned = _model(out=2).eval()
    path = run_dir / "stages" / "02-prune" / "model.pt"  # the manifest sits two folders up
    _legacy_pickle(pruned, path)
    _record(run_dir, path)
    assert known_sha256(path)
    loaded = load_checkpoint(path, into=_model(out=3))  # `into` is ignored: the structure comes from the file
    assert isinstance(loaded, nn.Sequential) and loaded[0].out_features == 2
    x = torch.randn(5, 4)
    assert torch.equal(loaded.eval()(x), pruned(x))


def test_whole_module_changed_after_recording_is_refused(tmp_path):
    run_dir = tmp_path / "run"
    path = run_dir / "model.pt"
    _legacy_pickle(_model(out=2), path)
    _record(run_dir, path)
    _legacy_pickle(_model(out=2, seed=7), path)  # other bytes, same name
    assert not known_sha256(path)
    with pytest.raises(InputError, match="no pruneflow manifest records its sha256"):
        load_checkpoint(path)


def test_manifest_listing_another_file_does_not_vouch(tmp_path):
    run_dir = tmp_path / "run"
    good, other = run_dir / "a.pt", run_dir / "b.pt"
    _legacy_pickle(_model(), good)
    _legacy_pickle(_model(), other)
    _record(run_dir, good)
    assert load_checkpoint(good)[0].out_features == 3
    with pytest.raises(InputError, match="no pruneflow manifest records its sha256"):
        load_checkpoint(other)
    # a manifest that cannot be parsed vouches for nothing
    (run_dir / Manifest.FILE).write_text("{not json")
    with pytest.raises(InputError, match="no pruneflow manifest"):
        load_checkpoint(good)


def test_pickled_code_never_runs_without_manifest(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "run" / "model.pt"
    path.parent.mkdir()
    torch.save({"format": FORMAT, "state_dict": {}, "module": _Trap(str(marker))}, path)
    (path.parent / Manifest.FILE).write_text(json.dumps({"artifacts": [{"path": "model.pt", "sha256": "0" * 64}]}))
    with pytest.raises(InputError, match="pickled model"):
        load_checkpoint(path)
    assert not marker.exists()


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


def test_a_pruned_model_is_saved_as_weights_and_structure_and_loads_from_anywhere(tmp_path):
    pruned = _model(out=2).eval()
    pruned[2].running_var.fill_(2.0)
    path = tmp_path / "copied" / "model.pt"  # no run directory, no manifest: nothing needs vouching for
    save_checkpoint(pruned, path, whole_module=True)
    payload = torch.load(path, map_location="cpu", weights_only=True)  # no pickled code in it
    assert "module" not in payload and payload["structure"]["0"] == {
        "class": "Linear", "attrs": {"in_features": 4, "out_features": 2}}
    fresh = _model(out=3, seed=5)
    loaded = load_checkpoint(path, into=fresh)
    assert loaded[0].out_features == 2 and loaded[2].num_features == 2
    assert fresh[0].out_features == 3 and fresh[0].weight.shape == (3, 4)  # the recipe's model is left as it was
    assert loaded[0].weight.requires_grad
    x = torch.randn(6, 4)
    assert torch.equal(loaded.eval()(x), pruned(x))


def test_a_pruned_structure_that_does_not_fit_the_recipes_model_is_a_clear_error(tmp_path):
    save_checkpoint(_model(out=2), tmp_path / "m.pt", whole_module=True)
    payload = torch.load(tmp_path / "m.pt", weights_only=True)
    payload["structure"]["0"]["attrs"].update(_forward_hooks=None, forward="x")  # never applied: not what we write
    torch.save(payload, tmp_path / "m.pt")
    assert load_checkpoint(tmp_path / "m.pt", into=_model(out=3))[0].out_features == 2
    other = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.BatchNorm1d(3))
    with pytest.raises(InputError, match=r"m\.pt holds a pruned model that does not fit the model the recipe builds: "
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
    save_checkpoint(model, tmp_path / "model.pt", whole_module=True)
    loaded = load_checkpoint(tmp_path / "model.pt", into=resnet20()).eval()  # the factory's model, option-A shortcuts
    assert isinstance(loaded.layer2[0].shortcut, ChannelEmbedConv) and not loaded.layer2[0].shortcut.weight.requires_grad
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
    save_checkpoint(model, tmp_path / "model.pt", whole_module=True)
    loaded = load_checkpoint(tmp_path / "model.pt", into=build(1)).eval()
    assert [s.heads for s in attention_sites(loaded)] == [2, 4]
    ids = torch.randint(1, 120, (3, 16))
    assert torch.allclose(loaded(ids), model(ids), atol=1e-6)
