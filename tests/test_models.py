"""pruneflow.models: factory resolution, model building, weights-only checkpoint reading and loading."""

from __future__ import annotations

import sys
import uuid

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from pruneflow.errors import InputError
from pruneflow.models import build_model, input_shape_for, load_weights, read_state_dict, resolve_factory
from pruneflow.recipe.models import ModelSpec
from pruneflow.zoo import ZOO, digits_cnn, resnet20

FACTORIES = '''
from torch import nn

NOT_CALLABLE = 42


def mlp(width=4, classes=3):
    return nn.Sequential(nn.Linear(2, width), nn.ReLU(), nn.Linear(width, classes))


def not_a_module():
    return {"a": 1}


def broken():
    raise RuntimeError("boom inside the factory")
'''


class _Trap:
    """Unpickling this creates ``marker``: proof that code ran while loading."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def factories_file(tmp_path):
    path = tmp_path / "factories.py"
    path.write_text(FACTORIES)
    return path


@pytest.fixture
def factories_module(tmp_path, monkeypatch):
    """The same factories as an importable module with a unique name."""
    name = f"pf_test_factories_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def _mlp(width=4, classes=3):
    return nn.Sequential(nn.Linear(2, width), nn.ReLU(), nn.Linear(width, classes))


# --------------------------------------------------------------------------- resolve_factory / build_model


def test_zoo_names_resolve_to_zoo_factories():
    for name, entry in ZOO.items():
        assert resolve_factory(name) is entry.factory
    model = build_model(ModelSpec(factory="digits_cnn", kwargs={"num_classes": 4, "width": 8}))
    assert model(torch.zeros(3, 1, 8, 8)).shape == (3, 4)


def test_package_module_factory(factories_module):
    assert resolve_factory("torch.nn:Linear") is nn.Linear
    model = build_model(ModelSpec(factory="torch.nn:Linear", kwargs={"in_features": 5, "out_features": 2}))
    assert isinstance(model, nn.Linear) and model.weight.shape == (2, 5)
    mlp = build_model(ModelSpec(factory=f"{factories_module}:mlp", kwargs={"width": 6}))
    assert mlp(torch.zeros(2, 2)).shape == (2, 3) and mlp[0].out_features == 6


def test_file_factory(factories_file):
    fn = resolve_factory(f"{factories_file}:mlp")
    assert fn.__name__ == "mlp" and fn.__module__.startswith("pruneflow_user_factories_")
    # the file is imported once under a stable name
    assert resolve_factory(f"{factories_file}:mlp") is fn
    model = build_model(ModelSpec(factory=f"{factories_file}:mlp", kwargs={"classes": 7}))
    assert model(torch.zeros(1, 2)).shape == (1, 7)


def test_factory_string_errors(tmp_path, factories_file, factories_module):
    cases = [
        ("nonsense", r"neither a zoo model nor `module:function`"),
        ("no_such_package_pf_xyz:fn", r"cannot import module 'no_such_package_pf_xyz'"),
        (f"{factories_module}:nope", rf"{factories_module}' has no attribute 'nope'"),
        (f"{factories_module}:NOT_CALLABLE", r"'NOT_CALLABLE' is a int, not a callable"),
        (f"{factories_file}:nope", r"has no attribute 'nope'"),
        (f"{tmp_path / 'missing.py'}:fn", r"file not found: .*missing\.py"),
    ]
    for factory, message in cases:
        with pytest.raises(InputError, match=message):
            resolve_factory(factory)
    with pytest.raises(InputError) as info:
        resolve_factory(f"{factories_module}:nope")
    assert "mlp" in info.value.hint and "broken" in info.value.hint  # the hint lists what is there
    with pytest.raises(InputError) as info:
        resolve_factory("nonsense")
    assert "resnet20" in info.value.hint


def test_modules_that_fail_to_import_are_input_errors(tmp_path, monkeypatch):
    bad = tmp_path / "bad_factory.py"
    bad.write_text("raise ValueError('broken at import')\n")
    with pytest.raises(InputError, match=r"importing .*bad_factory\.py failed: ValueError: broken at import"):
        resolve_factory(f"{bad}:fn")
    name = f"pf_test_bad_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text("raise ValueError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(InputError, match=rf"cannot import module '{name}' \(broken at import\)"):
        resolve_factory(f"{name}:fn")
    sys.modules.pop(name, None)


def test_factory_call_errors(factories_file):
    with pytest.raises(InputError, match=r"returned a dict, not a torch\.nn\.Module"):
        build_model(ModelSpec(factory=f"{factories_file}:not_a_module"))
    with pytest.raises(InputError, match=r"rejected model\.kwargs \{'depth': 3\}"):
        build_model(ModelSpec(factory=f"{factories_file}:mlp", kwargs={"depth": 3}))
    with pytest.raises(InputError, match=r"raised RuntimeError: boom inside the factory"):
        build_model(ModelSpec(factory=f"{factories_file}:broken"))
    with pytest.raises(InputError, match="rejected model.kwargs"):
        build_model(ModelSpec(factory="resnet20", kwargs={"width": 2}))


def test_input_shape_for():
    assert input_shape_for(ModelSpec(factory="resnet20"), None) == (3, 32, 32)
    assert input_shape_for(ModelSpec(factory="resnet20", input_shape=[3, 16, 16]), None) == (3, 16, 16)
    assert input_shape_for(ModelSpec(factory="torch.nn:Linear"), (5,)) == (5,)
    with pytest.raises(InputError, match="input shape is unknown"):
        input_shape_for(ModelSpec(factory="torch.nn:Linear"), None)


# --------------------------------------------------------------------------- read_state_dict


def test_read_state_dict_plain_nested_and_prefixed(tmp_path):
    model = _mlp()
    sd = model.state_dict()
    torch.save(sd, tmp_path / "plain.pt")
    torch.save({"epoch": 3, "best": 0.9, "state_dict": {f"module.{k}": v for k, v in sd.items()}}, tmp_path / "nested.pth")
    torch.save({"model_state_dict": sd, "optimizer": {"lr": torch.tensor(0.1)}}, tmp_path / "other.th")
    for name in ("plain.pt", "nested.pth", "other.th"):
        state = read_state_dict(tmp_path / name)
        assert list(state) == list(sd)
        assert all(torch.equal(state[k], sd[k]) for k in sd)


def test_prefix_only_stripped_when_every_key_has_it(tmp_path):
    torch.save({"module.a": torch.zeros(1), "b": torch.ones(1)}, tmp_path / "mixed.pt")
    assert set(read_state_dict(tmp_path / "mixed.pt")) == {"module.a", "b"}


def test_read_state_dict_safetensors(tmp_path):
    sd = {k: v.contiguous() for k, v in _mlp().state_dict().items()}
    save_file({f"module.{k}": v for k, v in sd.items()}, str(tmp_path / "w.safetensors"))
    state = read_state_dict(tmp_path / "w.safetensors")
    assert set(state) == set(sd) and all(torch.equal(state[k], sd[k]) for k in sd)
    (tmp_path / "bad.safetensors").write_bytes(b"xx")
    with pytest.raises(InputError, match=r"bad\.safetensors is not a readable safetensors file"):
        read_state_dict(tmp_path / "bad.safetensors")


def test_pickled_whole_module_is_refused(tmp_path):
    torch.save(_mlp(), tmp_path / "whole.pt")
    with pytest.raises(InputError, match=r"could not be read as a weights-only state_dict") as info:
        read_state_dict(tmp_path / "whole.pt")
    assert "torch.save(model.state_dict(), path)" in info.value.hint


def test_pickled_code_never_runs(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"state_dict": {"w": torch.zeros(1)}, "trap": _Trap(str(marker))}, tmp_path / "trap.pt")
    with pytest.raises(InputError, match="weights-only"):
        read_state_dict(tmp_path / "trap.pt")
    assert not marker.exists()


def test_unreadable_checkpoints_are_input_errors(tmp_path):
    (tmp_path / "empty.pt").write_bytes(b"")
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint at all")
    torch.save([torch.zeros(1)], tmp_path / "list.pt")
    torch.save({"a": torch.zeros(1), "b": 3}, tmp_path / "mixed.pt")
    with pytest.raises(InputError, match=r"empty\.pt could not be read as a weights-only state_dict: EOFError"):
        read_state_dict(tmp_path / "empty.pt")
    with pytest.raises(InputError, match=r"garbage\.pt could not be read"):
        read_state_dict(tmp_path / "garbage.pt")
    for name in ("list.pt", "mixed.pt"):
        with pytest.raises(InputError, match=r"holds no state_dict"):
            read_state_dict(tmp_path / name)
    with pytest.raises(InputError, match=r"model\.checkpoint not found: .*nope\.pt"):
        read_state_dict(tmp_path / "nope.pt")


# --------------------------------------------------------------------------- load_weights


def test_build_model_loads_checkpoint(tmp_path, factories_file):
    source = resolve_factory(f"{factories_file}:mlp")(width=5)
    torch.save({"state_dict": {f"module.{k}": v for k, v in source.state_dict().items()}}, tmp_path / "w.pt")
    model = build_model(ModelSpec(factory=f"{factories_file}:mlp", kwargs={"width": 5}, checkpoint=str(tmp_path / "w.pt")))
    x = torch.randn(4, 2)
    assert torch.equal(model(x), source(x))
    with pytest.raises(InputError, match="does not fit the model"):
        build_model(ModelSpec(factory=f"{factories_file}:mlp", kwargs={"width": 6}, checkpoint=str(tmp_path / "w.pt")))


def test_load_weights_tolerates_missing_num_batches_tracked():
    source = digits_cnn(width=4)
    for p in source.parameters():
        nn.init.normal_(p)
    state = {k: v for k, v in source.state_dict().items() if not k.endswith("num_batches_tracked")}
    target = digits_cnn(width=4)
    load_weights(target, state, "mem")
    assert all(torch.equal(target.state_dict()[k], v) for k, v in state.items())


def test_load_weights_names_missing_unexpected_and_misshaped_keys():
    model = _mlp(width=4)
    state = dict(model.state_dict())
    del state["2.bias"]
    state["extra.weight"] = torch.zeros(1)
    state["0.weight"] = torch.zeros(7, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(InputError) as info:
        load_weights(model, state, "ckpt.pt")
    message = str(info.value)
    assert "model.checkpoint ckpt.pt does not fit the model" in message
    assert "1 missing (e.g. 2.bias)" in message
    assert "1 unexpected (e.g. extra.weight)" in message
    assert "1 with other shapes (e.g. 0.weight (7, 2) vs model (4, 2))" in message
    assert "num_classes" in info.value.hint
    # nothing was loaded
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_load_weights_lists_at_most_three_examples():
    model = resnet20()
    with pytest.raises(InputError, match=r"\d+ missing \(e\.g\. conv1\.weight, bn1\.weight, bn1\.bias\)"):
        load_weights(model, {}, "empty")
