"""Transformer pruning (`granularity: heads`) as a round-loop strategy: attention heads and FFN neurons
scored through per-sample masks and removed by hand-written surgery (see ``transformer.py``), and channels of
the model width (``width.py``: the embedding tables' columns with every layer reading or writing them, a tied
output projection with its table).

Models with ``torch.nn.MultiheadAttention`` (a ViT) lose whole heads too: each such module is first turned
into the :class:`~pruneflow.prune.mha.HeadAttention` computing the same function (``mha.py`` says why),
so each layer keeps its own number of heads and the width goes only where the target names it. A target of
width alone needs no attention: a GRU4Rec's item table loses columns with the GRU's input weights."""

from __future__ import annotations

import copy
import math
from typing import Callable

from ..errors import ConfigError
from ..evaluate import count_macs_params
from .criteria import criterion_for
from .mha import convert_mha
from .rounds import Batches, Plan, Round, Strategy, linear_goal
from .budget import budget_plan, ranked_units, remove_units, removable, unit_costs, unit_counts
from .engine import auto_rounds
from .transformer import attention_sites, ffn_sites, prune_heads, prune_neurons, select_lowest, unit_scores
from .width import WidthSite, prune_width, width_sites


class HeadStrategy(Strategy):
    """Each round removes its share of the *original* counts: round k of n reaches k/n of the target."""

    for_transformers = True

    def entering(self) -> dict[str, int]:
        self.converted = convert_mha(self.model)
        self.check_kind()
        self.heads0 = self._heads()
        self.ffn0 = self._neurons()
        target = self.config.target
        self.width0 = {s.name: s.width for s in self._width_sites()} if target.width or target.macs else {}
        self.total_heads, self.total_ffn = sum(self.heads0.values()), sum(self.ffn0.values())
        self.total_width = sum(self.width0.values())
        macs, params = count_macs_params(self.model, self.example)
        self.before = {"macs": macs, "params": params}
        return self.before

    def prepare(self) -> None:
        """A MACs budget below what the units can reach (every site down to one unit) is refused now, before any
        round, with the floor and a target the next run accepts."""
        target = self.config.target
        if target.macs is None:
            return
        widths = width_sites(self.model, self.example) if self.width0 else []
        counts = unit_counts(self.model, widths)
        trial = copy.deepcopy(self.model)
        remove_units(trial, self.example, removable([(n, i) for n, c in counts.items() for i in range(c)], counts, sum(counts.values())))
        floor = count_macs_params(trial, self.example)[0] / self.before["macs"]
        if floor > target.macs:
            kinds = " and ".join(k for k, n in (("heads", self.total_heads), ("FFN neurons", self.total_ffn),
                                                ("width channels", len(widths))) if n)
            raise ConfigError(self.loc("target", "macs"), f"macs cannot go below {floor:.1%} of the model entering the stage "
                              f"by removing {kinds} (each attention module, FFN and width keeps one unit); the target asks for "
                              f"{target.macs:.1%}", value=target.macs,
                              hint=f"ask for at least the floor: target: {{macs: {math.ceil(floor * 100 + 1) / 100:g}}}, or "
                              "prune the rest by channels in a later stage")

    def _width_sites(self) -> list[WidthSite]:
        """The model's widths (``width.py``); a ConfigError at ``target.width`` when it has none."""
        skipped: dict[str, str] = {}
        sites = width_sites(self.model, self.example, skipped)
        if not sites and self.config.target.width:  # a budget goes without one (heads and FFN neurons alone)
            why = "; ".join(f"{n}: {w}" for n, w in skipped.items()) or "it has no nn.Embedding"
            raise ConfigError(self.loc("target", "width"), f"width counts the channels an embedding table writes (a "
                              f"transformer's residual stream, with a tied output projection); this model has no width "
                              f"that can be pruned ({why})", value=self.config.target.width,
                              hint="drop width from the target and prune heads and ffn")
        return sites

    def check_kind(self) -> None:
        """BERT-style attention or ``nn.MultiheadAttention`` (already converted); ffn only where FFN sites are. A
        target of width alone needs no attention (an embedding read by a GRU has a width): ``_width_sites`` checks it."""
        target = self.config.target
        if (target.heads or target.ffn) and not attention_sites(self.model):
            raise ConfigError(self.loc("target"), "heads/ffn targets need a model with attention heads: a BERT-style "
                              "transformer or torch.nn.MultiheadAttention modules; this model has neither",
                              hint="use target: {macs: 0.5}, {params: 0.5} or {ratio: 0.3}")
        if self.config.target.ffn and not ffn_sites(self.model):
            raise ConfigError(self.loc("target", "ffn"), "ffn counts the FFN neurons of BERT-style layers "
                              "(intermediate.dense, output.dense) or of a pointwise FFN beside an attention module "
                              "(nn.Sequential(Linear(d, f), activation, [Dropout], Linear(f, d))); this model has none",
                              value=self.config.target.ffn,
                              hint="drop ffn here and prune the MLP's hidden neurons in a later `granularity: channels` stage")

    def _heads(self) -> dict[str, int]:
        return {s.name: s.heads for s in attention_sites(self.model)}

    def _neurons(self) -> dict[str, int]:
        return {s.name: s.neurons for s in ffn_sites(self.model)}

    def rounds(self) -> int:
        target = self.config.target
        if self.config.rounds != "auto":
            return self.config.rounds
        if target.macs is not None:
            return auto_rounds("macs", target.macs)
        shares = (target.heads or 0, target.ffn or 0, target.width or 0)
        return max(1, round(max(shares) / 0.1))

    def goal(self, index: int, rounds: int) -> dict[str, float]:
        target = self.config.target
        if target.macs is not None:
            return linear_goal("macs", self.before, target.macs, index, rounds)
        return {unit: share * index / rounds for unit, share in (("heads", target.heads), ("ffn", target.ffn),
                                                                 ("width", target.width)) if share}

    def score(self, batches: Callable[[], Batches]):
        """Head, FFN-neuron and width-channel scores from the stage's criterion (``importance``; ``criteria.py``)."""
        widths = width_sites(self.model, self.example) if self.width0 else []
        return unit_scores(self.model, batches, self.loss, criterion_for(self.config), widths)

    def plan(self, scores, goal: dict[str, float]) -> Plan:
        if "macs" in goal:
            return self._budget_plan(scores, goal["macs"])
        head_scores, ffn_scores, width_scores = scores
        sites = {s.name: s for s in attention_sites(self.model)}
        ffns = {s.name: s for s in ffn_sites(self.model)}

        def apply() -> dict[str, float]:
            heads, neurons, width = sum(s.heads for s in sites.values()), sum(s.neurons for s in ffns.values()), self._width()
            if "heads" in goal:
                _remove_lowest(head_scores, {n: s.heads for n, s in sites.items()}, self.total_heads, goal["heads"],
                               lambda name, idx: prune_heads(sites[name], idx))
            if "ffn" in goal:
                _remove_lowest(ffn_scores, {n: s.neurons for n, s in ffns.items()}, self.total_ffn, goal["ffn"],
                               lambda name, idx: prune_neurons(ffns[name], idx))
            if "width" in goal:  # last: its group is traced again on the model the removals above left
                _remove_lowest(width_scores, {n: len(v) for n, v in width_scores.items()}, self.total_width, goal["width"],
                               lambda name, idx: prune_width(self.model, self.example, name, idx))
            removed: dict[str, float] = {"heads": heads - sum(s.heads for s in sites.values()),
                                         "ffn_neurons": neurons - sum(s.neurons for s in ffns.values())}
            return {**removed, "width": width - self._width()} if self.width0 else removed

        return Plan(apply)

    def _budget_plan(self, scores, macs: float) -> Plan:
        """The units to remove for ``macs``: every kind ranked together by score per MAC (``budget.py``)."""
        merged = {name: s for kind in scores for name, s in kind.items()}
        widths = width_sites(self.model, self.example) if self.width0 else []
        order = ranked_units(merged, unit_costs(self.model, self.example, widths))
        chosen = budget_plan(self.model, self.example, order, unit_counts(self.model, widths), macs)

        def apply() -> dict[str, float]:
            before = self.measure()
            remove_units(self.model, self.example, chosen)
            after = self.measure()
            removed: dict[str, float] = {"heads": before["heads"] - after["heads"],
                                         "ffn_neurons": before["ffn_neurons"] - after["ffn_neurons"]}
            return {**removed, "width": before["width"] - after["width"]} if self.width0 else removed

        return Plan(apply)

    def _width(self) -> int:
        """The model's widths now (their tables' columns; 0 when the target prunes none)."""
        return sum(int(getattr(self.model.get_submodule(n), "embedding_dim")) for n in self.width0)

    def measure(self) -> dict[str, int]:
        macs, params = count_macs_params(self.model, self.example)
        return {"macs": macs, "params": params, "heads": sum(self._heads().values()),
                "ffn_neurons": sum(self._neurons().values()), "width": self._width()}

    def row(self, record: Round) -> dict:
        after = record.figures
        width = {"width": after["width"]} if self.width0 else {}
        return {"round": record.index, "heads": after["heads"], "ffn_neurons": after["ffn_neurons"], **width,
                "macs": after["macs"], "params": after["params"], record.metric: record.value, "seconds": record.seconds}

    def describe(self, record: Round) -> str:
        after = record.figures
        units = [f"{after['heads']} heads"] if self.total_heads else []
        units += [f"{after['ffn_neurons']} FFN neurons"] if self.total_ffn else []
        units += [f"width {after['width']}"] if self.width0 else []
        share = f" ({after['macs'] / self.before['macs']:.1%} of MACs)" if self.config.target.macs else ""
        return f"{', '.join(units)} left{share}, {record.metric} {record.value:.4f}"

    def summary(self, after: dict[str, int]) -> dict[str, float | int]:
        width = {"width": after["width"], "width_before": self.total_width} if self.width0 else {}
        return {"heads": after["heads"], "heads_before": self.total_heads,
                "ffn_neurons": after["ffn_neurons"], "ffn_neurons_before": self.total_ffn, **width}

    def tables(self, records: list[Round]) -> dict[str, list[dict]]:
        heads1, ffn1 = self._heads(), self._neurons()
        layers = [{"layer": n, "heads before": self.heads0[n], "heads after": heads1[n]} for n in self.heads0]
        layers += [{"layer": n, "ffn before": self.ffn0[n], "ffn after": ffn1[n]} for n in self.ffn0]
        layers += [{"layer": n, "width before": w, "width after": getattr(self.model.get_submodule(n), "embedding_dim")}
                   for n, w in self.width0.items()]
        tables: dict[str, list[dict]] = {"units": layers}
        if self.converted:
            tables["notes"] = [{"note": f"{len(self.converted)} nn.MultiheadAttention module(s) became HeadAttention (the same "
                                        "function with separate q/k/v projections, so heads go whole and the embedding width "
                                        "stays); code reading in_proj_weight must read q_proj/k_proj/v_proj instead"}]
        return tables


def _remove_lowest(scores: dict, counts: dict[str, int], total: int, share: float, prune) -> None:
    """Prune the lowest-scored units until ``share`` of the original ``total`` is gone."""
    now = sum(counts.values())
    goal = total - round(share * total)
    if now > goal:
        for name, remove in select_lowest(scores, (now - goal) / now).items():
            if remove:
                prune(name, remove)
