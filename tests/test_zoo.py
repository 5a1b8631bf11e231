"""pruneflow.zoo: architectures, and the real pretrained CIFAR-10 ResNets in ../shared/data."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pruneflow.data import load_data
from pruneflow.models import build_model, load_weights, read_state_dict
from pruneflow.recipe.models import DataSpec, ModelSpec
from pruneflow.zoo import ZOO, digits_cnn, resnet20, resnet32, resnet44, resnet56
from pruneflow.zoo.resnet_cifar import ChannelPadShortcut, CifarResNet

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
WEIGHTS = SHARED / "resnet_cifar10_akamaster"
FIRST20 = SHARED / "cifar10" / "cifar10_test_first20_lossless.npz"
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]

# From ../shared/data/resnet_cifar10_akamaster/README.md: parameters, and correct answers on the 20 lossless images.
RESNETS = {
    "resnet20": (resnet20, "resnet20-12fca82f.th", 269_722, 20),
    "resnet32": (resnet32, "resnet32-d509ac18.th", 464_154, 19),
    "resnet44": (resnet44, "resnet44-014dd654.th", 658_586, 20),
    "resnet56": (resnet56, "resnet56-4bfd9763.th", 853_018, 20),
}
FIRST20_LABELS = [3, 8, 8, 0, 6, 6, 1, 6, 3, 1, 0, 9, 5, 7, 9, 8, 5, 7, 8, 6]


def _need(*paths: Path) -> None:
    missing = [p for p in paths if not p.is_file()]
    if missing:
        pytest.skip(f"shared data not found: {missing[0]} (clone with shared/ beside the repository)")


@pytest.fixture(scope="module")
def first20():
    """The 20 lossless test images through load_data: x/255, ImageNet mean/std, NCHW."""
    _need(FIRST20)
    return load_data(DataSpec(format="npz", eval=str(FIRST20), mean=IMAGENET_MEAN, std=IMAGENET_STD), seed=0)


# --------------------------------------------------------------------------- architectures (no data needed)


def test_digits_cnn_forward_shapes():
    model = digits_cnn().eval()
    assert model(torch.zeros(5, 1, 8, 8)).shape == (5, 10)
    custom = digits_cnn(num_classes=3, width=4, in_channels=3).eval()
    assert custom(torch.zeros(2, 3, 8, 8)).shape == (2, 3)
    assert custom.classifier.in_features == 16


def test_every_zoo_entry_runs_on_its_input_shape():
    for name, entry in ZOO.items():
        assert entry.description
        if entry.input_shape is None:  # token models (bert_classifier) take their shape from the data
            continue
        model = entry.factory().eval()
        with torch.no_grad():
            out = model(torch.randn(2, *entry.input_shape))
        assert out.shape == (2, 10), name


def test_the_bert_classifier_takes_token_ids_of_any_length():
    pytest.importorskip("transformers")
    model = ZOO["bert_classifier"].factory(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64,
                                           max_positions=32, num_labels=3).eval()
    ids = torch.randint(1, 1000, (2, 12))
    ids[:, 8:] = 0  # padding
    with torch.no_grad():
        assert model(ids).shape == (2, 3)


@pytest.mark.parametrize("name", list(RESNETS))
def test_resnet_parameter_counts_match_the_reference(name):
    factory, _, params, _ = RESNETS[name]
    model = factory()
    assert sum(p.numel() for p in model.parameters()) == params
    assert factory(num_classes=100).linear.out_features == 100


def test_resnet_depth_must_be_6n_plus_2():
    with pytest.raises(ValueError, match="6n\\+2"):
        CifarResNet(21)
    assert len(CifarResNet(110).layer1) == 18


def test_option_a_shortcut_subsamples_and_zero_pads_channels():
    x = torch.randn(2, 16, 8, 8)
    out = ChannelPadShortcut(2, 8)(x)
    assert out.shape == (2, 32, 4, 4)
    assert torch.equal(out[:, 8:24], x[:, :, ::2, ::2])
    assert torch.all(out[:, :8] == 0) and torch.all(out[:, 24:] == 0)
    assert torch.equal(out, F.pad(x[:, :, ::2, ::2], (0, 0, 0, 0, 8, 8)))
    block = resnet20().layer2[0]
    assert isinstance(block.shortcut, ChannelPadShortcut) and block.shortcut.pad == 8
    assert not any(True for _ in block.shortcut.parameters())  # option A has no weights


# --------------------------------------------------------------------------- pretrained weights (shared data)


@pytest.mark.shared_data
@pytest.mark.parametrize("name", list(RESNETS))
def test_pretrained_weights_load_by_name(name):
    factory, file, _, _ = RESNETS[name]
    path = WEIGHTS / file
    _need(path)
    raw = torch.load(path, map_location="cpu", weights_only=True)["state_dict"]
    assert all(k.startswith("module.") for k in raw)
    state = read_state_dict(path)
    assert set(state) == {k[len("module."):] for k in raw}
    model = factory()
    own = model.state_dict()
    # the 2018 checkpoints lack only the BatchNorm step counters
    assert {k for k in own if k not in state} == {k for k in own if k.endswith("num_batches_tracked")}
    load_weights(model, state, path)
    for key in ("conv1.weight", "layer3.0.bn2.running_var", "linear.bias"):
        assert torch.equal(model.state_dict()[key], raw[f"module.{key}"])


@pytest.mark.shared_data
def test_first20_preprocessing_matches_the_reference(first20):
    d = np.load(FIRST20)
    expected = torch.from_numpy(d["images"]).permute(0, 3, 1, 2).float() / 255
    expected = (expected - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    assert first20.eval.x.shape == (20, 3, 32, 32)
    assert torch.allclose(first20.eval.x, expected, atol=1e-5)
    assert first20.eval.y.tolist() == FIRST20_LABELS
    assert first20.class_names[:2] == ["airplane", "automobile"] and first20.num_classes == 10


@pytest.mark.shared_data
@pytest.mark.parametrize("name", list(RESNETS))
def test_pretrained_resnets_classify_the_lossless_images(first20, name):
    _, file, _, correct = RESNETS[name]
    _need(WEIGHTS / file)
    model = build_model(ModelSpec(factory=name, checkpoint=str(WEIGHTS / file))).eval()
    with torch.no_grad():
        predicted = model(first20.eval.x).argmax(1)
    assert int((predicted == first20.eval.y).sum()) == correct


@pytest.mark.shared_data
@pytest.mark.parametrize("name", ["bert_embedder", "bert_classifier"])
def test_a_pretrained_folder_loads_without_transformers_load_report(name, shared_data, capfd):
    """minilm-embed opened with transformers' "BertModel LOAD REPORT ... pooler.dense.weight | UNEXPECTED" table and a
    weight-loading progress bar (issue 42, item 8): the embedder leaves the pooler out on purpose. The load is quiet now,
    and transformers' own verbosity is as it was after it."""
    pytest.importorskip("transformers")
    from transformers.utils import logging as hf_logging

    from pruneflow.zoo import ZOO

    folder = shared_data / "minilm_l6_h384"
    if not folder.is_dir():
        pytest.skip(f"no {folder}")
    before = hf_logging.get_verbosity()
    capfd.readouterr()
    ZOO[name].factory(folder=str(folder))
    err = capfd.readouterr().err
    assert "LOAD REPORT" not in err and "UNEXPECTED" not in err and "Loading weights" not in err, err
    assert hf_logging.get_verbosity() == before
