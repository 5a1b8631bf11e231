"""Channel pruning (width) as a round-loop strategy: saliency → the ratio that meets the round's goal →
torch-pruning's grouped removal, at once or faded out during the fine-tune (``fade``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

from ..runtime.host import cpu_channel_block
from ..errors import ConfigError
from ..evaluate import count_macs_params
from .engine import (PruneOptions, auto_rounds, channel_table, layer_channels, layer_widths, measure, plan_step, prunable_layers,
                     resolve_ignored, search_ratio)
from .criteria import criterion_for
from .importance import ChannelEvidence
from .reach import check_floor, tied_names
from .rnn import unsupported
from .rounds import Batches, Plan, Round, Strategy, linear_goal
from .mha import attention_modules
from .surgery import make_prunable
from .tp_adapter import GroupFailure, embedding_coupled, whole_groups

if TYPE_CHECKING:
    from ..inputs import Inputs


#: Weighted modules channel pruning never counts as having prunable outputs (they follow their producer).
_FOLLOWERS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.LayerNorm, nn.GroupNorm)


@dataclass
class KeptWhole:
    """The modules channel pruning keeps whole (``ignored``, module names) and a note per reason beyond the
    recipe's `ignore` (tied weights, recurrent layers it cannot cut, groups ``whole_groups`` finds)."""

    ignored: tuple[str, ...]
    notes: list[str] = field(default_factory=list)


def kept_whole(model: nn.Module, ignore: list[str] | None, loc: Callable[..., tuple], example: "Inputs | None" = None) -> KeptWhole:
    """``ignore`` (default the classifier), attention, embedding tables with the layers tied to their columns
    (``embedding_coupled``), modules sharing a weight, recurrent layers whose units cannot go (``rnn.unsupported``),
    and, given an ``example`` input, the groups no channel of can go (``tp_adapter.whole_groups``)."""
    attention = attention_modules(model)
    tables = embedding_coupled(model, example) if example is not None and not attention else []
    tied = tied_names(model)
    rnns = {n: why for n, m in model.named_modules() if isinstance(m, nn.RNNBase) and (why := unsupported(m))}
    ignored = tuple(dict.fromkeys(resolve_ignored(model, ignore, loc("ignore")) + tuple(attention) + tuple(tables)
                                  + tuple(tied) + tuple(rnns)))
    notes = [f"{n} kept whole: {why}" for n, why in rnns.items()]
    if tied:
        notes.append(f"{', '.join(tied)} share one weight (tied) and are kept whole: pruning one side would untie them")
    for group in _whole_groups(model, example, ignored, set(tied)):
        ignored += tuple(n for n in group.layers if n not in ignored)
        notes.append(f"the channel group of {group.root} is kept whole ({', '.join(group.layers)}): {group.why}")
    return KeptWhole(ignored, notes)


def _whole_groups(model: nn.Module, example: "Inputs | None", ignored: tuple[str, ...], tied: set[str]) -> list:
    """``whole_groups``, or none when torch-pruning cannot trace the model: the pruner's own trace then fails where
    the stage (or doctor's dependency-graph row) reports it, and this check must not hide a clearer refusal (a
    transformer asked for channels is told to prune heads)."""
    if example is None:
        return []
    try:
        return whole_groups(model, example, ignored, tied)
    except Exception:  # noqa: BLE001 - see above
        return []


def check_prunable(model: nn.Module, ignore: list[str] | None, loc: Callable[..., tuple],
                   example: "Inputs | None" = None) -> tuple[str, ...]:
    """The modules kept whole (``kept_whole``); a ConfigError on the stage when no Conv/Linear/recurrent layer is
    left to prune, naming the model's other weighted modules (an LSTM text classifier has only its classifier:
    issue 15). The pipeline calls this before any training (``PruneStage.check_model``)."""
    return _prunable_or_refuse(model, kept_whole(model, ignore, loc, example).ignored, ignore, loc)


def _prunable_or_refuse(model: nn.Module, ignored: tuple[str, ...], ignore: list[str] | None, loc: Callable[..., tuple]) -> tuple[str, ...]:
    if prunable_layers(model, ignored):
        return ignored
    attention = attention_modules(model)
    others = [f"{n} ({type(m).__name__})" for n, m in model.named_modules()
              if n and n not in ignored and not isinstance(m, (*_FOLLOWERS, nn.Conv1d, nn.Conv2d, nn.Linear))
              and any(True for _ in m.parameters(recurse=False))]
    kept = ", ".join(f"{n} ({type(model.get_submodule(n)).__name__})" for n in ignored) or "none"
    raise ConfigError(
        loc("ignore") if ignore else loc(),
        f"channel pruning finds nothing to prune: it removes output channels of Conv and Linear layers (hidden units of "
        f"GRU/LSTM/RNN layers), and every one "
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
        kept = kept_whole(model, cfg.ignore, self.loc, self.example)
        self.ignored, self.kept_notes = _prunable_or_refuse(model, kept.ignored, cfg.ignore, self.loc), kept.notes
        self.opts = PruneOptions(cfg.allocation, cfg.max_layer_ratio, cfg.round_to, self.ignored, cfg.ranking, layer_widths(model))
        self.before = measure(model, self.example, self.ignored)
        self.channels_before = layer_channels(model)
        # Before any round: a target under what channel pruning can reach is refused now, not in round k (issue 37).
        with self._naming_failures():
            check_floor(model, self.example, self.opts, self.metric, self.keep, self.before, self.loc("target"))

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
            with self._naming_failures():
                ratio, _ = search_ratio(self.model, self.example, scores, self.opts, self.metric, goal[self.metric],
                                        loc=self.loc("target"))
                step = plan_step(self.model, self.example, scores, ratio, self.opts)
        except ConfigError as exc:
            raise _with_attention_hint(exc, self.model) from None
        fading = bool(cfg.fade and cfg.finetune and cfg.finetune.epochs)

        def apply() -> dict[str, float]:
            removed: dict[str, float] = {"channels": step.channels}
            with self._naming_failures():
                step.apply()
            return removed

        return Plan(apply, step.fader(cfg.fade) if fading else None, {"ratio": ratio})

    @contextlib.contextmanager
    def _naming_failures(self) -> Iterator[None]:
        """torch-pruning could not score or remove a group: a ConfigError naming its root layer, and the `ignore`
        list (the recipe's, or the default classifier, plus that layer) that keeps the group whole, which the next
        run accepts (issue 37: doctor predicted MMoE's crash as a bare IndexError and suggested attention heads)."""
        try:
            yield
        except GroupFailure as exc:
            root = exc.name or type(exc.root).__name__
            listed = list(dict.fromkeys(resolve_ignored(self.model, self.config.ignore, self.loc("ignore")) + (root,)))
            heads = "; or prune attention by whole heads (granularity: heads)" if self.attention else ""
            raise ConfigError(self.loc("ignore"), f"torch-pruning could not prune the channel group of {root} "
                              f"({type(exc.cause).__name__}: {exc.cause})",
                              hint=f"keep that group whole: ignore: [{', '.join(listed)}]{heads}") from exc

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
        notes = [note for note in (self._attention_note(), self._block_note(layers), *self.kept_notes) if note]
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
