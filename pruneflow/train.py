"""The one training loop: optimizer, LR schedule, optional extra-loss hook (used for distillation)."""

from __future__ import annotations

import difflib
import math
import re
from typing import Callable, Literal, Sequence

import torch
from pydantic import Field
from torch import nn

from . import distributed
from .context import RunContext
from .data import DataBundle, Split
from .errors import InputError, StageError
from .evaluate import evaluate_model
from .inputs import Inputs, call, to
from .stage import StrictModel
from .tasks import MetricState, Task

LossFn = Callable[[nn.Module, Inputs, torch.Tensor, object], torch.Tensor]


class TrainSettings(StrictModel):
    """Settings of one training run; reused by every stage that fine-tunes (train, prune, qat)."""

    epochs: int = Field(default=10, ge=1, le=10_000, description="Passes over the training split.")
    batch_size: int = Field(default=64, ge=1, le=65_536, description="Samples per optimizer step.")
    optimizer: Literal["sgd", "adamw"] = Field(default="sgd", description="`sgd` (with Nesterov momentum) or `adamw`.")
    lr: float = Field(default=0.05, gt=0, le=10, description="Peak learning rate.")
    momentum: float = Field(default=0.9, ge=0, lt=1, description="SGD momentum.")
    weight_decay: float = Field(default=5e-4, ge=0, le=1, description="L2 weight decay.")
    schedule: Literal["cosine", "linear", "step", "constant"] = Field(
        default="cosine", description="LR schedule over all steps after the warm-up: `cosine`, `linear` decay to 0 "
        "(BERT fine-tuning's usual schedule), `step`, `constant`.")
    warmup_epochs: float = Field(default=0.0, ge=0, description="Linear LR warm-up at the start, in epochs.")
    step_epochs: int = Field(default=30, ge=1, description="`step` schedule: epochs between LR drops.")
    gamma: float = Field(default=0.1, gt=0, le=1, description="`step` schedule: LR factor at each drop.")
    label_smoothing: float = Field(default=0.0, ge=0, lt=1, description="Cross-entropy label smoothing.")
    augment: bool = Field(default=True, description="Apply the data section's augmentation while training.")
    grad_clip: float | None = Field(default=None, gt=0, description="Clip the gradient norm to this value.")
    eval_every: int = Field(default=1, ge=0, description="Evaluate every N epochs (0 = only at the end).")
    freeze: list[str] = Field(
        default_factory=list, max_length=64,
        description="Parameters kept fixed while training: regexes matched against whole parameter names "
        "(`.*word_embeddings.*`); each must match one. A pretrained word-embedding table is half of a small BERT "
        "and the costliest part of its AdamW step. `pruneflow inspect` lists the names.")


class FinetuneSettings(TrainSettings):
    """Fine-tuning inside another stage (prune rounds, QAT phases): short, at a low LR."""

    epochs: int = Field(default=1, ge=0, le=10_000, description="Passes over the training split (0 = none).")
    lr: float = Field(default=0.01, gt=0, le=10, description="Peak learning rate (prune: decayed across rounds by `lr_decay`).")


def make_optimizer(model: nn.Module, s: TrainSettings, extra: Sequence[nn.Module] = ()) -> torch.optim.Optimizer:
    # No weight decay on biases and normalisation parameters (standard practice).
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in [p for m in [model, *extra] for p in m.parameters()]:
        if p.requires_grad:
            (no_decay if p.dim() <= 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if s.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=s.lr)
    return torch.optim.SGD(groups, lr=s.lr, momentum=s.momentum, nesterov=s.momentum > 0)


def lr_factor(s: TrainSettings, step: int, steps_per_epoch: int) -> float:
    total = s.epochs * steps_per_epoch
    warm = s.warmup_epochs * steps_per_epoch
    if warm and step < warm:
        return (step + 1) / warm
    if s.schedule == "cosine":
        progress = (step - warm) / max(total - warm, 1)
        return 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
    if s.schedule == "linear":
        return max(0.0, 1.0 - (step - warm) / max(total - warm, 1))
    if s.schedule == "step":
        return s.gamma ** (step // (s.step_epochs * steps_per_epoch))
    return 1.0


def fit(model: nn.Module, data: DataBundle, task: Task, s: TrainSettings, ctx: RunContext, *,
        description: str = "train", extra_loss: LossFn | None = None, extra_modules: Sequence[nn.Module] = (),
        seed: int | None = None, on_epoch_start: Callable[[int, nn.Module], None] | None = None,
        on_step_end: Callable[[int, int], None] | None = None) -> list[dict]:
    """Train ``model`` in place. Returns one history row per epoch: ``train_loss``, ``train_<headline>`` (the
    task's headline metric on the training batches, as the model was while it trained on them; past ``FIGURE_ROWS``
    rows an epoch, on every k-th batch), ``lr``, and
    ``eval_<headline>`` on the eval split for the epochs evaluated (the last one always).

    ``extra_loss(model, x, y, out)`` replaces the task loss (distillation uses it); ``extra_modules``
    are trained alongside (e.g. feature-KD projections). ``on_epoch_start(epoch, model)`` runs after
    the model is put in training mode (QAT freezes BatchNorm statistics there); ``on_step_end(step, total)``
    after every optimizer step (1-based; pruning fades chosen channels out there).

    Under torchrun (``pruneflow.distributed``) each epoch runs the model in DistributedDataParallel on this
    rank's shard of the train split, ``batch_size`` being the global batch; the replicas (and the extra
    modules) are synchronised from rank 0 after every epoch, so evaluation gives every rank the same figures.
    """
    _train_split(data)  # there is one to train on
    task = task.for_training(s.label_smoothing)
    seed = ctx.seed if seed is None else seed
    torch.manual_seed(seed + distributed.rank())
    gen = torch.Generator().manual_seed(seed + distributed.rank())
    model.to(ctx.device).train()
    distributed.sync_state(*extra_modules)
    frozen = freeze_parameters(model, s.freeze)
    opt = make_optimizer(model, s, extra_modules)
    batch_size = distributed.global_batch_share(s.batch_size)
    steps_per_epoch = math.ceil(distributed.shard_size(data.train_rows) / batch_size)
    loop = _Loop(model, opt, task, s, ctx, extra_loss, extra_modules, on_step_end, steps_per_epoch, description)
    history = []
    for epoch in range(1, s.epochs + 1):
        loop.epoch_number = epoch
        model.train()
        if on_epoch_start:
            on_epoch_start(epoch, model)
        net = distributed.wrap(model, ctx.device)  # per epoch: on_epoch_start may freeze parameters
        with (ctx.reporter.progress(f"{description} epoch {epoch}/{s.epochs}", total=steps_per_epoch) as advance,
              distributed.peers_guard(f"{description} epoch {epoch}")):
            batches = distributed.shard(data, epoch, seed).train_batches(batch_size, gen, augment=s.augment)
            loss_sum, seen, figures = loop.epoch(net, batches, advance)
            distributed.sync_state(model, *extra_modules, average_buffers=True)
            loss_sum, seen, figures = _summed(loss_sum, seen, figures)
        _check_epoch(model, loss_sum, description, epoch, s.epochs)
        headline = task.headline_name
        row = {"epoch": epoch, "train_loss": loss_sum / seen,
               f"train_{headline}": task.compute(figures)[headline], "lr": opt.param_groups[0]["lr"]}
        if (s.eval_every and epoch % s.eval_every == 0) or epoch == s.epochs:
            figures_eval = evaluate_model(model, data.eval, task, device=ctx.device, reporter=ctx.reporter,
                                          description=f"{description} eval")
            row.update({f"eval_{name}": figures_eval[name] for name in task.recorded_names})
        history.append(row)
        ctx.reporter.info(_epoch_line(description, row, headline))
    for param in frozen:
        param.requires_grad_(True)
    model.eval()
    return history


def freeze_parameters(model: nn.Module, patterns: Sequence[str]) -> list[nn.Parameter]:
    """Stop gradients for the parameters whose whole name matches one of ``patterns``; returns those it froze."""
    named = dict(model.named_parameters())
    frozen: list[nn.Parameter] = []
    for pattern in patterns:
        try:
            hits = [p for name, p in named.items() if re.fullmatch(pattern, name)]
        except re.error as exc:
            raise InputError(f"freeze: {pattern!r} is not a regular expression: {exc}", hint="escape dots as `\\.`") from exc
        if not hits:
            close = difflib.get_close_matches(pattern, list(named), n=3, cutoff=0.3)
            raise InputError(f"freeze: {pattern!r} matches no parameter of the model" + (f" (close: {', '.join(close)})" if close else ""),
                             hint="patterns match whole names; `pruneflow inspect` lists them")
        frozen += [p for p in hits if p.requires_grad]
        for param in hits:
            param.requires_grad_(False)
    return frozen


#: Rows an epoch's training figures read at most (every k-th batch beyond; every batch of a split up to this size).
FIGURE_ROWS = 1 << 20


class _Loop:
    """The optimizer steps of ``fit``, one epoch at a time; counts steps across epochs for the schedule."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, task: Task, s: TrainSettings, ctx: RunContext,
                 extra_loss: LossFn | None, extra_modules: Sequence[nn.Module],
                 on_step_end: Callable[[int, int], None] | None, steps_per_epoch: int, description: str = "train"):
        self.model, self.opt, self.task, self.s, self.ctx = model, opt, task, s, ctx
        self.extra_loss, self.extra_modules, self.on_step_end = extra_loss, list(extra_modules), on_step_end
        self.steps_per_epoch, self.step = steps_per_epoch, 0
        self.description, self.epoch_number = description, 1
        # the epoch's training figures (train_<headline>) read every k-th batch past FIGURE_ROWS rows an epoch: a task
        # such as binary keeps every output for its AUC, which grew with the log (a streamed 10^7-row epoch: +0.5 GB)
        self.figure_stride = max(1, math.ceil(steps_per_epoch * s.batch_size / FIGURE_ROWS))

    def epoch(self, net: nn.Module, batches, advance: Callable[..., None]) -> tuple[float, float, MetricState]:
        """One pass of ``net`` (the model, or it in DDP) over ``batches``: (loss sum, samples, the task's figures)."""
        s, task, device = self.s, self.task, self.ctx.device
        figures = MetricState()
        seen = 0
        loss_sum = 0.0
        for x, y in batches:
            _set_lr(self.opt, s, self.step, self.steps_per_epoch)
            x, y = to(x, device), y.to(device)
            out = call(self.model, x, runner=net)
            loss = self.extra_loss(self.model, x, y, out) if self.extra_loss else task.loss(out, y)
            value = float(loss.detach())
            if not math.isfinite(value):
                self._diverged(value, seen, loss_sum)
            _optimizer_step(self.model, self.opt, loss, s.grad_clip, self.extra_modules)
            self.step += 1
            if self.on_step_end:
                self.on_step_end(self.step, s.epochs * self.steps_per_epoch)
            if (self.step - 1) % self.figure_stride == 0:
                task.update(figures, task.output(out).detach(), y)
            seen += len(y)
            loss_sum += value * len(y)
            advance(1, loss=f"{loss_sum / seen:.3f}")
        return loss_sum, float(seen), figures


    def _diverged(self, value: float, seen: int, loss_sum: float) -> None:
        """A loss that is NaN or infinite: stop the stage (exit 4) before the step that would spread it."""
        step_in_epoch = self.step - (self.epoch_number - 1) * self.steps_per_epoch + 1
        last = f"; the epoch's mean loss before it was {loss_sum / seen:.4g}" if seen else ""
        raise TrainingDiverged(
            f"{self.description}: the training loss became {value} at epoch {self.epoch_number}, step {step_in_epoch} of "
            f"{self.steps_per_epoch} (step {self.step + 1} overall){last}. The stage stopped and wrote no checkpoint; the "
            "run keeps those of the stages before it, whose weights are finite",
            hint=f"lower the stage's lr (now {self.s.lr:g}), set grad_clip (e.g. 1.0), or warm up (warmup_epochs); "
            "then rerun with --resume to start again from the last finished stage")


class TrainingDiverged(StageError):
    """Training produced a NaN or infinite loss or weight (exit 4, naming the stage, epoch and step)."""


def _check_epoch(model: nn.Module, loss_sum: float, description: str, epoch: int, epochs: int) -> None:
    """After an epoch: every weight finite (an infinite gradient on the epoch's last step leaves no loss to see),
    and a first epoch whose loss was not exactly 0 on every batch (nothing to learn: constant labels, the wrong
    output read)."""
    if epoch == 1 and loss_sum == 0.0:
        raise InputError(
            f"{description}: the training loss is exactly 0 on every batch of the first epoch, so nothing is learnt "
            "and every figure after it would describe an untrained model",
            hint="check the label column (constant labels?) and which part of the model's output the task reads "
            "(task.output)")
    bad = [name for name, p in model.named_parameters() if not bool(torch.isfinite(p.detach()).all())]
    if bad:
        raise TrainingDiverged(
            f"{description}: after epoch {epoch} of {epochs}, {len(bad)} parameter tensor(s) hold NaN or infinite values "
            f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}). The stage stopped and wrote no checkpoint; the "
            "run keeps those of the stages before it, whose weights are finite",
            hint="lower the stage's lr or set grad_clip (e.g. 1.0); then rerun with --resume")


def _train_split(data: DataBundle) -> Split:
    """The train split, checked to be there: a recipe whose data gives none cannot train."""
    if data.train is None:
        from .errors import InputError

        raise InputError("training needs a train split", hint="set data.path (split by eval_fraction) or data.train")
    return data.train


def _summed(loss_sum: float, seen: float, figures: MetricState) -> tuple[float, float, MetricState]:
    """The epoch's loss sum, samples and the task's sums added over the DDP ranks (alone otherwise). Figures a
    task computes from whole outputs (``MetricState.outputs``) stay this rank's: they describe its shard."""
    keys = sorted(figures.sums)
    total = distributed.all_sum([loss_sum, seen, float(figures.count), *(figures.sums[k] for k in keys)])
    summed = MetricState(dict(zip(keys, total[3:])), int(total[2]), figures.outputs, figures.targets,
                         {h: _summed(0.0, 0.0, part)[2] for h, part in sorted(figures.parts.items())},  # a multi task's heads
                         figures.kept_outputs, figures.kept_targets)  # the recipe's own metrics (tasks/user.py)
    return total[0], total[1], summed


def _set_lr(opt: torch.optim.Optimizer, s: TrainSettings, step: int, steps_per_epoch: int) -> None:
    """Set every group's LR for this step: the schedule is a function of the step, not optimizer state."""
    for group in opt.param_groups:
        group["lr"] = s.lr * lr_factor(s, step, steps_per_epoch)


def _optimizer_step(model: nn.Module, opt: torch.optim.Optimizer, loss: torch.Tensor, grad_clip: float | None,
                    extra_modules: Sequence[nn.Module] = ()) -> None:
    """Backward and step, clipping the model's gradient norm first when ``grad_clip`` is set. Under DDP the
    model's gradients arrive averaged over the ranks; the extra modules' are averaged here."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    distributed.average_gradients(extra_modules)
    if grad_clip:
        nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    opt.step()


def _epoch_line(description: str, row: dict, headline: str) -> str:
    """The log line of one epoch: its loss, and its eval headline metric when this epoch was evaluated."""
    line = f"{description} epoch {row['epoch']}: loss {row['train_loss']:.4f}"
    key = f"eval_{headline}"
    return line + (f", eval {headline} {row[key]:.4f}" if key in row else "")
