"""The one round loop of the `prune` stage: score → plan → apply → fine-tune with KD → measure → record.

Channels, residual blocks and transformer units differ in what they score and remove, not in how a
round runs, so each granularity is a :class:`Strategy` answering the loop's few questions and the loop
(with everything shared: importance batches, teacher, fine-tuning with LR decay, the final fine-tune)
lives here once::

    strategy = ChannelStrategy(config, model, example, loss, loc)
    before = strategy.entering()                 # checks the model suits it; the baseline figures
    strategy.prepare()
    records, seconds = run_rounds(strategy, tuner, sample, reporter, "prune")
    records[-1].figures["macs"]                  # what the last round left

A strategy's :class:`Plan` may hold its removal back (``on_step_end`` set): the loop then fine-tunes
first, with that callback fading the chosen units out, and removes them after (``fade``).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from .. import distributed
from ..distill import Distiller, frozen_copy
from ..errors import ConfigError
from ..evaluate import evaluate_model
from ..inputs import Inputs, first, take, to, trim
from ..train import FinetuneSettings, fit
from .transformer import is_transformer

Batches = list[tuple[Inputs, torch.Tensor]]
StepCallback = Callable[[int, int], None]


@dataclass(frozen=True)
class Round:
    """What one round did: its ``goal`` (per figure, the value aimed at), what it ``removed`` (unit name →
    score for blocks, a count per kind of unit for channels and transformers), the task's headline ``metric``
    and its ``value`` after the round's fine-tune, the ``figures`` measured after it (macs, params and the strategy's own counts), the
    strategy's ``plan`` figures (e.g. the channel ratio searched) and its wall time in ``seconds``."""

    index: int
    goal: dict[str, float]
    removed: dict[str, float]
    metric: str
    value: float
    figures: dict[str, int]
    seconds: float
    plan: dict[str, float] = field(default_factory=dict)


@dataclass
class Plan:
    """One round's removal, chosen. ``apply`` removes it and returns what went (``Round.removed``).

    With ``on_step_end`` set, the loop fine-tunes first (the callback runs after every optimizer step,
    e.g. fading the chosen channels to zero) and applies the removal after the fine-tune.
    """

    apply: Callable[[], dict[str, float]]
    on_step_end: StepCallback | None = None
    figures: dict[str, float] = field(default_factory=dict)


class Strategy(ABC):
    """One granularity: what it checks, scores, removes and reports. The loop asks, in this order:
    ``entering`` and ``prepare`` once, ``rounds``; per round ``goal``, ``score``, ``plan``, ``measure``,
    ``row`` and ``describe``; at the end ``measure``, ``summary`` and ``tables``."""

    #: Importance batches a round scores on when the recipe leaves `importance_batches` unset.
    default_importance_batches: ClassVar[int] = 4
    #: True for the strategy that prunes transformers (heads/FFN): the model's kind must match.
    for_transformers: ClassVar[bool] = False

    def __init__(self, config: Any, model: nn.Module, example: Inputs, loss: Callable, loc: Callable[..., tuple],
                 data: Any = None):
        self.config, self.model, self.example, self.loss, self.loc = config, model, example, loss, loc
        self.data = data  # the run's DataBundle, for a strategy that reads the whole training split (tables)
        #: What the strategy keeps whole and why (coupled groups, tied tables), for doctor's line and the summary.
        self.kept_notes: list[str] = []

    def check_kind(self) -> None:
        """Transformers are pruned by heads and FFN neurons, other models by channels or blocks."""
        transformer = is_transformer(self.model)
        if transformer and not self.for_transformers:
            raise ConfigError(self.loc("target"), "this is a transformer model; prune it by heads and FFN neurons",
                              hint="e.g. target: {heads: 0.5, ffn: 0.3} (granularity: heads)")
        if self.for_transformers and not transformer:
            raise ConfigError(self.loc("target"), "heads/ffn targets need a BERT-style transformer model",
                              hint="use target: {macs: 0.5}, {params: 0.5} or {ratio: 0.3}")

    @abstractmethod
    def entering(self) -> dict[str, int]:
        """Check that the model suits this granularity (ConfigError at the recipe key otherwise) and measure
        it as it enters the stage: at least ``macs`` and ``params``."""

    def prepare(self) -> None:
        """Rewrite or record what the rounds need; runs after the baseline metric and latency."""

    @abstractmethod
    def rounds(self) -> int:
        """How many rounds (``rounds: auto`` resolved)."""

    @abstractmethod
    def goal(self, index: int, rounds: int) -> dict[str, float]:
        """What round ``index`` of ``rounds`` aims at."""

    @abstractmethod
    def score(self, batches: Callable[[], Batches]) -> Any:
        """Importance scores; ``batches()`` samples this round's importance batches (when the criterion needs them)."""

    @abstractmethod
    def plan(self, scores: Any, goal: dict[str, float]) -> Plan:
        """This round's removal toward ``goal``."""

    @abstractmethod
    def measure(self) -> dict[str, int]:
        """The model's figures now: ``macs``, ``params`` and the strategy's own counts."""

    @abstractmethod
    def row(self, record: Round) -> dict:
        """The round's row in the `rounds` table."""

    @abstractmethod
    def describe(self, record: Round) -> str:
        """The round's progress line (after "prune round k/n: ")."""

    @abstractmethod
    def summary(self, after: dict[str, int]) -> dict[str, float | int]:
        """The strategy's own stage metrics, from the figures ``after`` the last round."""

    def tables(self, records: list[Round]) -> dict[str, list[dict]]:
        """The strategy's own report tables."""
        return {}


def linear_goal(metric: str, before: dict, keep: float, index: int, rounds: int) -> dict[str, float]:
    """Round ``index`` of ``rounds`` reaches ``index/rounds`` of the way from ``before[metric]`` to ``keep`` of it."""
    return {metric: before[metric] * (1 - (1 - keep) * index / rounds)}


def importance_batches(data, batches: int, batch_size: int, seed: int, device: str) -> Batches:
    """A seeded random sample of the training split (files are often sorted by class)."""
    n = min(batches * batch_size, len(data.train))
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randperm(len(data.train), generator=gen)[:n]
    x, y = to(take(data.train.x, idx), device), data.train.y[idx].to(device)
    return [(trim(take(x, slice(i, i + batch_size))), y[i : i + batch_size]) for i in range(0, len(y), batch_size)]


class Tuner:
    """Fine-tuning between rounds, shared by every strategy: KD from one teacher, the LR decayed round by
    round, evaluation alone when there is no fine-tune, and the final fine-tune."""

    def __init__(self, config: Any, state, ctx, label: str, distill_loc: tuple = ("distill",)):
        self.config, self.state, self.ctx, self.label, self.distill_loc = config, state, ctx, label, distill_loc
        self.teacher = self._teacher()
        self.lr = config.finetune.lr if config.finetune else 0.0

    def _teacher(self) -> nn.Module | None:
        cfg = self.config
        if cfg.distill is None:
            return None
        if cfg.teacher is not None:
            from ..models import build_model

            return frozen_copy(build_model(cfg.teacher)).to(self.ctx.device)
        return self.state.teacher if self.state.teacher is not None else frozen_copy(self.state.model)

    def after_round(self, model: nn.Module, index: int, rounds: int, on_step_end: StepCallback | None = None) -> float:
        """Fine-tune (with KD) at this round's LR, or just evaluate; the next round's LR decays."""
        cfg = self.config
        if cfg.finetune and cfg.finetune.epochs:
            value = self.finetune(model, cfg.finetune.model_copy(update={"lr": self.lr}),
                                  f"{self.label} round {index}/{rounds}", on_step_end)
            self.lr *= cfg.lr_decay
            return value
        return self.evaluate(model, f"{self.label} round {index}")

    @property
    def metric(self) -> str:
        """The name of the figure ``after_round`` returns: the task's headline metric."""
        return self.state.task.headline_name

    def evaluate(self, model: nn.Module, description: str) -> float:
        """The task's headline metric of ``model`` on the eval split."""
        state, ctx = self.state, self.ctx
        return evaluate_model(model, state.data.eval, state.task, ctx.recipe.data.eval_batch_size, ctx.device,
                              ctx.reporter, description)[state.task.headline_name]

    def final(self, model: nn.Module, value: float) -> float:
        """The headline metric after the final fine-tune, when the recipe asks for one (else ``value``)."""
        settings = self.config.final_finetune
        if settings and settings.epochs:
            return self.finetune(model, settings, f"{self.label} final fine-tune")
        return value

    def finetune(self, model: nn.Module, settings: FinetuneSettings, description: str,
                 on_step_end: StepCallback | None = None) -> float:
        state, distill, teacher = self.state, self.config.distill, self.teacher
        distiller = (Distiller(model, teacher, distill, state.task, state.example_input, self.distill_loc)
                     if teacher is not None and distill else None)
        try:
            history = fit(model, state.data, state.task, settings, self.ctx, description=description,
                          extra_loss=distiller.loss if distiller else None,
                          extra_modules=distiller.modules() if distiller else (), on_step_end=on_step_end)
        finally:
            if distiller:
                distiller.close()
        return history[-1][f"eval_{state.task.headline_name}"]


def run_round(strategy: Strategy, tuner: Tuner, sample: Callable[[int], Batches], index: int, rounds: int) -> tuple[Round, float]:
    """One round; returns its record and the seconds spent scoring importance."""
    start = time.perf_counter()
    goal = strategy.goal(index, rounds)
    t0 = time.perf_counter()
    # Under torchrun rank 0 scores and every rank plans from its scores (planning is deterministic).
    with distributed.peers_guard(f"prune round {index}"):
        scores = distributed.from_main(lambda: strategy.score(lambda: sample(index)), first(strategy.example).device)
        distributed.sync_state(strategy.model)  # scoring may have run batches through rank 0's model
    scoring = time.perf_counter() - t0
    plan = strategy.plan(scores, goal)
    removed = plan.apply() if plan.on_step_end is None else {}
    value = tuner.after_round(strategy.model, index, rounds, plan.on_step_end)
    if plan.on_step_end is not None:
        removed = plan.apply()  # faded to zero during the fine-tune: the removal changes no output
    with distributed.peers_guard(f"prune round {index}"):
        distributed.check_same_structure(strategy.model, f"prune round {index}")
    figures = strategy.measure()
    record = Round(index, goal, removed, tuner.metric, value, figures, round(time.perf_counter() - start, 1), plan.figures)
    return record, scoring


def run_rounds(strategy: Strategy, tuner: Tuner, sample: Callable[[int], Batches], reporter,
               label: str) -> tuple[list[Round], float]:
    """Every round of ``strategy``; returns the records and the seconds spent scoring importance."""
    rounds = strategy.rounds()
    records, scoring = [], 0.0
    for index in range(1, rounds + 1):
        record, seconds = run_round(strategy, tuner, sample, index, rounds)
        records.append(record)
        scoring += seconds
        reporter.info(f"{label} round {index}/{rounds}: {strategy.describe(record)}")
    return records, scoring
