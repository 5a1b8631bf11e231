"""Distillation losses: logits KD, hard-label mix, feature KD with projections."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pruneflow.distill import DistillSpec, Distiller, frozen_copy
from pruneflow.errors import InputError
from pruneflow.tasks import Classification
from pruneflow.zoo import digits_cnn


def kd_logits_loss(student, teacher, temperature):
    """Classification's distillation loss (the task owns it)."""
    return Classification().distill_loss(student, teacher, temperature)


def test_kd_loss_is_zero_for_equal_logits_and_matches_the_definition():
    torch.manual_seed(0)
    s, t = torch.randn(5, 10), torch.randn(5, 10)
    assert float(kd_logits_loss(t, t, 4.0)) == pytest.approx(0.0, abs=1e-6)
    p_t = F.softmax(t / 4, -1)
    expected = (p_t * (p_t.log() - F.log_softmax(s / 4, -1))).sum(-1).mean() * 16
    assert float(kd_logits_loss(s, t, 4.0)) == pytest.approx(float(expected), rel=1e-5)


def test_distiller_mixes_kd_and_hard_labels():
    torch.manual_seed(0)
    teacher, student = digits_cnn().eval(), digits_cnn().eval()
    x, y = torch.randn(4, 1, 8, 8), torch.randint(0, 10, (4,))
    task = Classification()
    out = student(x)
    for alpha in (0.0, 0.5, 1.0):
        d = Distiller(student, teacher, DistillSpec(alpha=alpha, temperature=2.0), task, x[:1])
        expected = alpha * kd_logits_loss(out, teacher(x), 2.0) + (1 - alpha) * F.cross_entropy(out, y)
        assert float(d.loss(student, x, y, out).detach()) == pytest.approx(float(expected.detach()), rel=1e-5)
        d.close()


def test_feature_kd_adds_a_projection_when_widths_differ_and_trains_it():
    torch.manual_seed(0)
    teacher = frozen_copy(digits_cnn(width=16))
    student = digits_cnn(width=8)
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    d = Distiller(student, teacher, DistillSpec(features=["features.4"], alpha=1.0), Classification(), x[:1])
    assert len(d.modules()) == 1 and isinstance(d.modules()[0], nn.Conv2d)
    assert d.modules()[0].in_channels == 32 and d.modules()[0].out_channels == 64
    projection_before = d.modules()[0].weight.detach().clone()
    opt = torch.optim.SGD([p for m in [student, *d.modules()] for p in m.parameters()], lr=0.05)
    losses = []
    for _ in range(20):
        loss = d.loss(student, x, y, student(x))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    d.close()
    assert losses[-1] < 0.8 * losses[0]
    assert not torch.equal(projection_before, d.modules()[0].weight)  # the projection is trained too
    assert all(p.grad is None for p in teacher.parameters())  # the teacher stays frozen


def test_unknown_feature_layer_is_named():
    with pytest.raises(InputError, match="no module 'nope'"):
        Distiller(digits_cnn(), digits_cnn(), DistillSpec(features=["nope"]), Classification(), torch.zeros(1, 1, 8, 8))
