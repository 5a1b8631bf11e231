"""Training health: a loss or weight that turns NaN or infinite stops the stage (exit 4) naming the stage, epoch and
step, and the stage writes no checkpoint, so the run's last checkpoint is the previous stage's, with finite weights.
Before, a fine-tune that diverged exited 0 with every stage ✓ and NaN in most checkpoint tensors."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import invoke, tiny_recipe_dict
from pruneflow.tasks import Classification


def _data():
    from pruneflow.splits import DataBundle, Split

    x, y = torch.randn(32, 2), torch.arange(32) % 2
    return DataBundle(train=Split(x, y), eval=Split(x, y), num_classes=2, input_shape=(2,))


def test_a_loss_that_becomes_nan_stops_training_at_its_epoch_and_step(tmp_path):
    from pruneflow.context import RunContext
    from pruneflow.train import TrainingDiverged, TrainSettings, fit

    class BlowsUp(torch.nn.Module):
        """Finite for the first five batches, then NaN (a model whose activations overflow mid-training)."""

        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(2, 2)
            self.calls = 0

        def forward(self, x):
            self.calls += int(self.training)  # training batches only (each epoch also evaluates)
            out = self.fc(x)
            return out * float("nan") if self.calls > 5 else out

    ctx = RunContext(run_dir=tmp_path, recipe=None, recipe_file=None)  # type: ignore[arg-type]
    with pytest.raises(TrainingDiverged, match=r"became nan at epoch 2, step 2 of 4 \(step 6 overall\)") as err:
        fit(BlowsUp(), _data(), Classification(), TrainSettings(epochs=3, batch_size=8, lr=0.1), ctx, description="finetune")
    assert err.value.exit_code == 4 and "finetune" in str(err.value) and "lr" in err.value.hint
    assert "mean loss before it was" in str(err.value)  # the last finite figure, for scale


def test_weights_that_become_infinite_on_an_epochs_last_step_are_caught_after_it(tmp_path):
    from pruneflow.context import RunContext
    from pruneflow.train import TrainingDiverged, TrainSettings, fit

    model = torch.nn.Linear(2, 2)
    # an infinite gradient on every step: the loss is finite when computed, the weights are not after the step
    model.weight.register_hook(lambda grad: torch.full_like(grad, float("inf")))
    ctx = RunContext(run_dir=tmp_path, recipe=None, recipe_file=None)  # type: ignore[arg-type]
    with pytest.raises(TrainingDiverged, match="after epoch 1 of 2, 1 parameter tensor"):
        fit(model, _data(), Classification(), TrainSettings(epochs=2, batch_size=32, lr=0.1), ctx)


BLOWUP = """
import torch
from pruneflow.zoo import digits_cnn

STEPS = [0]


class BlowsUp(torch.nn.Module):
    \"\"\"A digits CNN whose training forward turns NaN after 12 steps (activations that overflow mid-run).\"\"\"

    def __init__(self):
        super().__init__()
        self.net = digits_cnn(width=8)

    def forward(self, x):
        STEPS[0] += int(self.training)
        out = self.net(x)
        return out * float("nan") if STEPS[0] > 12 else out


def build():
    return BlowsUp()
"""


@pytest.mark.slow  # a recipe end to end (~5 s)
def test_a_recipe_whose_training_diverges_exits_4_and_keeps_no_nan_checkpoint(tmp_path):
    (tmp_path / "blowup.py").write_text(BLOWUP)
    recipe = tiny_recipe_dict(model={"factory": "blowup.py:build"})
    recipe["stages"] = [{"type": "train", "epochs": 1, "batch_size": 32, "lr": 0.05, "name": "warm"},  # 10 steps
                        {"type": "train", "epochs": 2, "batch_size": 32, "lr": 0.05, "name": "finetune"},
                        {"type": "export", "targets": ["onnx"], "latency": None}]
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    result = invoke("optimize", tmp_path / "recipe.yaml", "--out", tmp_path / "runs", "--json")
    assert result.exit_code == 4, result.output
    out = json.loads(result.stdout)
    text = " ".join(result.output.split())
    assert "finetune: the training loss became nan at epoch 1, step 3 of 10" in text and "wrote no checkpoint" in text
    run = tmp_path / "runs" / "tiny"
    assert (run / "stages" / "01-warm" / "model.pt").is_file()  # the last finite checkpoint stays
    assert not list((run / "stages").glob("02-finetune/*.pt")) and not (run / "export").exists()
    assert out["exit_code"] == 4
