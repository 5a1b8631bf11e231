"""Channel pruning (width) as a round-loop strategy: saliency → the ratio that meets the round's goal →
torch-pruning's grouped removal, at once or faded out during the fine-tune (``fade``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
from torch import nn

from ..runtime.host import cpu_channel_block
from ..errors import ConfigError
from ..evaluate import count_macs_params
from .engine import (PruneOptions, auto_rounds, channel_table, layer_channels, layer_widths, measure, plan_step, prunable_layers,
                     resolve_ignored, search_ratio)
from .criteria import criterion_for
from .importance import ChannelEvidence
from .rounds import Batches, Plan, Round, Strategy, linear_goal
from .mha import attention_modules
from .surgery import make_prunable
from .tp_adapter import embedding_coupled

if TYPE_CHECKING:
    from ..inputs import Inputs


#: Weighted modules channel pruning never counts as having prunable outputs (they follow their producer).
_FOLLOWERS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)


def check_prunable(model: nn.Module, ignore: list[str] | None, loc: Callable[..., tuple],
                   example: "Inputs | None" = None) -> tuple[str, ...]:
    """The modules kept whole (``ignore``, default the classifier, attention, and embedding tables with the
    layers tied to their columns: ``embedding_coupled``, given an ``example`` input); a ConfigError on the stage
    when no Conv/Linear is left to prune, naming the model's other weighted modules (an LSTM text classifier
    has only its classifier: issue 15). The pipeline calls this before any training (``PruneStage.check_model``)."""
    attention = attention_modules(model)
    tables = embedding_coupled(model, example) if example is not None and not attention else []
    ignored = tuple(dict.fromkeys(resolve_ignored(model, ignore, loc("ignore")) + tuple(attention) + tuple(tables)))
    if prunable_layers(model, ignored):
        return ignored
    others = [f"{n} ({type(m).__name__})" for n, m in model.named_modules()
              if n and n not in ignored and not isinstance(m, (*_FOLLOWERS, nn.Conv1d, nn.Conv2d, nn.Linear))
              and any(True for _ in m.parameters(recurse=False))]
    kept = ", ".join(f"{n} ({type(model.get_submodule(n)).__name__})" for n in ignored) or "none"
    raise ConfigError(
        loc("ignore") if ignore else loc(),
        f"channel pruning finds nothing to prune: it removes output channels of Conv and Linear layers, and every one "
        f"of this model's is kept whole ({kept}: `ignore`, the classifier by default, attention); its other weighted "
        f"modules ({', '.join(others) or 'none'}) are not pruned by channels",
        hint="remove this prune stage (calibrate, qat/ptq and export do not need it)"
        + ("; prune attention with `granularity: heads`" if attention else "")
        + ("; or shorten `ignore`" if ignore else ""))


class ChannelStrategy(Strategy):
    """`granularity: channels`. Targets count the model after the option-A shortcut rewrite (as every
    round does); the stage's `macs_before`/`params_before` are the model as it entered."""

    def entering(self) -> dict[str, int]:
        self.check_kind()
        macs, params = count_macs_params(self.model, self.example)
        return {"macs": macs, "params": params}

    def prepare(self) -> None:
        cfg, model = self.config, self.model
        self.metric, self.keep = cfg.target.metric_and_keep()
        self.replaced = make_prunable(model, self.example)
        # Attention is kept whole here: torch-pruning would cut its heads (issue 15); `granularity: heads` removes them.
        self.attention = attention_modules(model)
        self.ignored = check_prunable(model, cfg.ignore, self.loc, self.example)
        self.opts = PruneOptions(cfg.allocation, cfg.max_layer_ratio, cfg.round_to, self.ignored, cfg.ranking, layer_widths(model))
        self.before = measure(model, self.example, self.ignored)
        self.channels_before = layer_channels(model)

    def rounds(self) -> int:
        return auto_rounds(self.metric, self.keep) if self.config.rounds == "auto" else self.config.rounds

    def goal(self, index: int, rounds: int) -> dict[str, float]:
        return linear_goal(self.metric, self.before, self.keep, index, rounds)

    def score(self, batches: Callable[[], Batches]) -> dict[str, torch.Tensor]:
        """Per-parameter saliency from the stage's criterion (``importance``; ``criteria.py``)."""
        evidence = ChannelEvidence(self.model, batches, self.loss, self.config.magnitude_p)
        return criterion_for(self.config).score(evidence)

    def plan(self, scores: dict[str, torch.Tensor], goal: dict[str, float]) -> Plan:
        cfg = self.config
        try:
            ratio, _ = search_ratio(self.model, self.example, scores, self.opts, self.metric, goal[self.metric], loc=self.loc("target"))
        except ConfigError as exc:
            raise _with_attention_hint(exc, self.model) from None
        step = plan_step(self.model, self.example, scores, ratio, self.opts)
        fading = bool(cfg.fade and cfg.finetune and cfg.finetune.epochs)

        def apply() -> dict[str, float]:
            removed: dict[str, float] = {"channels": step.channels}
            step.apply()
            return removed

        return Plan(apply, step.fader(cfg.fade) if fading else None, {"ratio": ratio})

    def measure(self) -> dict[str, int]:
        return measure(self.model, self.example, self.ignored)

    def row(self, record: Round) -> dict:
        after, before = record.figures, self.before
        return {"round": record.index, "goal_kept": round(record.goal[self.metric] / before[self.metric], 4),
                "ratio": round(record.plan["ratio"], 4), "channels": after["channels"], "macs": after["macs"],
                "params": after["params"], "macs_kept": after["macs"] / before["macs"], record.metric: record.value,
                "seconds": record.seconds}

    def describe(self, record: Round) -> str:
        return f"{record.figures['macs'] / self.before['macs']:.1%} of MACs, {record.metric} {record.value:.4f}"

    def summary(self, after: dict[str, int]) -> dict[str, float | int]:
        return {"channels_kept": after["channels"] / self.before["channels"], "shortcuts_rewritten": self.replaced}

    def tables(self, records: list[Round]) -> dict[str, list[dict]]:
        layers = channel_table(self.model, self.channels_before)
        tables = {"channels": layers}
        notes = [note for note in (self._attention_note(), self._block_note(layers)) if note]
        if notes:
            tables["notes"] = [{"note": note} for note in notes]
        return tables

    def _attention_note(self) -> str | None:
        if not self.attention:
            return None
        owners = list(dict.fromkeys(n.rsplit(".", 1)[0] if n.endswith("_proj") else n for n in self.attention))
        return (f"{len(owners)} attention module(s) kept whole ({', '.join(owners[:3])}{', ...' if len(owners) > 3 else ''}): "
                "channel pruning does not cut attention heads, and the embedding width they read and write stays; "
                "`granularity: heads` removes whole heads")

    def _block_note(self, layers: list[dict]) -> str | None:
        """Say so when pruned layers end off this CPU's SIMD channel block: their MACs fall, their time less."""
        found = cpu_channel_block()
        if not self.config.latency or not found:
            return None
        block, isa = found
        off = [r["layer"] for r in layers if r["after"] != r["before"] and r["after"] % block]
        if not off:
            return None
        return (f"{len(off)} pruned layer(s) (e.g. {', '.join(off[:3])}) end with a channel count that is not a multiple of "
                f"{block}, the channel block of onnxruntime's and OpenVINO's CPU kernels on this {isa} machine: they are "
                f"padded up to it, so their MACs fall faster than their run time. round_to: {block} turns pruned MACs into "
                f"time here (narrower layers then stay whole).")


def _with_attention_hint(exc: ConfigError, model: torch.nn.Module) -> ConfigError:
    """A target out of reach for a model with attention: channel pruning keeps every attention block whole, so
    no max_layer_ratio or round_to helps; pruning heads does (issue 26: a ViT asked for `macs: 0.5` was told to
    raise max_layer_ratio, lower round_to or ignore fewer layers)."""
    attention = [n for n, m in model.named_modules() if type(m).__name__.endswith(("Attention", "SelfAttention"))
                 or isinstance(m, torch.nn.MultiheadAttention)]
    if not attention:
        return exc
    exc.hint = (f"`granularity: channels` keeps attention whole ({len(attention)} attention module(s) here, e.g. "
                f"{attention[0]}), so their MACs cannot shrink: prune heads and FFN neurons first, with a `granularity: heads` stage "
                "(e.g. {type: prune, target: {heads: 0.25, ffn: 0.25}}) before this one, or ask for less")
    return exc
