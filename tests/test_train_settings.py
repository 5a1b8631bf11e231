"""Train settings a BERT fine-tune needs: linear LR decay after the warm-up, frozen parameters."""

from __future__ import annotations

import pytest
import torch

from conftest import run_recipe_dict, tiny_train_recipe
from pruneflow.checkpoint import load_checkpoint
from pruneflow.train import TrainSettings, freeze_parameters, lr_factor
from pruneflow.errors import InputError
from pruneflow.zoo import ZOO


def test_linear_schedule_warms_up_then_decays_to_zero():
    s = TrainSettings(epochs=2, schedule="linear", warmup_epochs=0.5)
    factors = [lr_factor(s, step, steps_per_epoch=10) for step in range(20)]
    assert factors[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert factors[5] == pytest.approx(1.0) and factors[-1] == pytest.approx(1 / 15)
    assert all(a > b for a, b in zip(factors[5:], factors[6:]))


def test_freeze_keeps_matched_parameters_and_gives_them_back():
    model = ZOO["digits_cnn"].factory(width=8)
    frozen = freeze_parameters(model, [r"features\.0\..*", "classifier.bias"])
    names = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert names == {"features.0.0.weight", "features.0.1.weight", "features.0.1.bias", "classifier.bias"}
    assert len(frozen) == 4


@pytest.mark.parametrize("pattern,message", [("features.9.*", "matches no parameter"), ("(", "not a regular expression")])
def test_freeze_refuses_a_pattern_that_matches_nothing(pattern, message):
    with pytest.raises(InputError, match=message):
        freeze_parameters(ZOO["digits_cnn"].factory(width=8), [pattern])


@pytest.mark.slow
def test_a_run_with_frozen_layers_leaves_them_as_they_were(tmp_path):
    recipe = tiny_train_recipe(seed=3)
    recipe["stages"][0].update(freeze=[r"features\.0\.0\.weight"], schedule="linear", warmup_epochs=0.5)
    _, result = run_recipe_dict(recipe, tmp_path)
    assert result.exit_code == 0
    torch.manual_seed(3)
    initial = ZOO["digits_cnn"].factory(width=8).state_dict()
    trained = load_checkpoint(result.run_dir / "stages" / "01-train" / "model.pt", into=ZOO["digits_cnn"].factory(width=8)).module.state_dict()
    assert torch.equal(trained["features.0.0.weight"], initial["features.0.0.weight"])
    assert not torch.equal(trained["features.1.0.weight"], initial["features.1.0.weight"])
