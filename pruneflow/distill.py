"""Knowledge distillation losses, shared by the prune and qat stages.

NNCF 3.x dropped distillation and torch-pruning has none, so this is ours: output KD (the task's
``distill_loss``: for classes, KL divergence at temperature T, Hinton et al. 2015) mixed with the task's
own loss, plus optional feature KD on named layers with a learned 1x1 projection when the student's
width differs from the teacher's.

    distiller = Distiller(student, teacher, DistillSpec(temperature=4, alpha=0.7), task, example)
    fit(student, data, task, settings, ctx, extra_loss=distiller.loss, extra_modules=distiller.modules())
    distiller.close()
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from pydantic import Field
from torch import nn

from .errors import ConfigError
from .inputs import Inputs, call
from .config import StrictModel
from .tasks import Task


class DistillSpec(StrictModel):
    temperature: float = Field(default=4.0, gt=0, le=100, description="Softmax temperature T of the output KD term "
                               "(tasks that match softened class scores; others ignore it).")
    alpha: float = Field(default=0.7, ge=0, le=1, description="Weight of the output KD term (the task's distillation loss); "
                         "(1 - alpha) weighs the task's loss on the labels.")
    features: list[str] = Field(
        default_factory=list,
        description="Module names (as in model.named_modules()) whose outputs the student matches (MSE) in the teacher.",
    )
    feature_weight: float = Field(default=1.0, ge=0, description="Weight of the summed feature KD terms.")


def frozen_copy(model: nn.Module) -> nn.Module:
    teacher = copy.deepcopy(model).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


class _Capture:
    def __init__(self, model: nn.Module, names: list[str], role: str, loc: tuple):
        modules = dict(model.named_modules())
        missing = [n for n in names if n not in modules]
        if missing:
            raise ConfigError(loc, f"the {role} has no module {', '.join(map(repr, missing))}", value=missing,
                              hint="use names from `pruneflow inspect` (the per-layer table)")
        self.outputs: dict[str, torch.Tensor] = {}
        self.handles = [modules[n].register_forward_hook(self._hook(n)) for n in names]

    def _hook(self, name):
        def hook(module, inputs, output):
            self.outputs[name] = output if isinstance(output, torch.Tensor) else output[0]

        return hook

    def close(self):
        for h in self.handles:
            h.remove()


class Distiller:
    """Builds the training loss: ``alpha * task.distill_loss + (1 - alpha) * task.loss (+ feature KD)``."""

    def __init__(self, student: nn.Module, teacher: nn.Module, spec: DistillSpec, task: Task, example: Inputs,
                 loc: tuple = ("distill",)):
        """``loc``: the recipe key path of ``spec`` (the stage's ``self.loc("distill")``), for errors."""
        self.student, self.teacher, self.spec, self.task = student, teacher.eval(), spec, task
        self.projections = nn.ModuleDict()
        where = (*loc, "features")
        self._s = _Capture(student, spec.features, "student", where) if spec.features else None
        self._t = _Capture(teacher, spec.features, "teacher", where) if spec.features else None
        if self._s is not None and self._t is not None:  # feature KD: both captures exist
            with torch.no_grad():
                was = student.training
                student.eval()
                call(student, example)
                call(teacher, example)
                student.train(was)
            for name in spec.features:
                s, t = self._s.outputs[name], self._t.outputs[name]
                if s.shape[1] != t.shape[1]:
                    conv = s.dim() == 4
                    proj = nn.Conv2d(s.shape[1], t.shape[1], 1, bias=False) if conv else nn.Linear(s.shape[1], t.shape[1], bias=False)
                    self.projections[name.replace(".", "__")] = proj.to(s.device)

    def modules(self) -> list[nn.Module]:
        """Trainable modules besides the student (the projections), for the optimizer."""
        return list(self.projections.values())

    def loss(self, model: nn.Module, x: Inputs, y: torch.Tensor, out) -> torch.Tensor:
        with torch.no_grad():
            teacher_out = call(self.teacher, x)
        student, teacher = self.task.output(out), self.task.output(teacher_out)
        loss = self.spec.alpha * self.task.distill_loss(student, teacher, self.spec.temperature)
        if self.spec.alpha < 1:
            loss = loss + (1 - self.spec.alpha) * self.task.loss(out, y)
        if self._s is not None and self._t is not None and self.spec.feature_weight:
            feat: torch.Tensor | float = 0.0
            for name in self.spec.features:
                s, t = self._s.outputs[name], self._t.outputs[name]
                key = name.replace(".", "__")
                if key in self.projections:
                    s = self.projections[key](s)
                feat = feat + F.mse_loss(s, t)
            loss = loss + self.spec.feature_weight * feat
        return loss

    def close(self) -> None:
        for cap in (self._s, self._t):
            if cap is not None:
                cap.close()
