"""Transformer pruning (`granularity: heads`) as a round-loop strategy: attention heads and FFN neurons
scored through per-sample masks and removed by hand-written surgery (see ``transformer.py``).

Models with ``torch.nn.MultiheadAttention`` (a ViT) lose whole heads too: each such module is first turned
into the :class:`~pruneflow.prune.mha.HeadAttention` computing the same function (``mha.py`` says why),
so the embedding width stays and each layer keeps its own number of heads."""

from __future__ import annotations

from typing import Callable

from ..errors import ConfigError
from ..evaluate import count_macs_params
from .criteria import criterion_for
from .mha import convert_mha
from .rounds import Batches, Plan, Round, Strategy
from .transformer import attention_sites, ffn_sites, prune_heads, prune_neurons, select_lowest, unit_importance


class HeadStrategy(Strategy):
    """Each round removes its share of the *original* counts: round k of n reaches k/n of the target."""

    for_transformers = True

    def entering(self) -> dict[str, int]:
        self.converted = convert_mha(self.model)
        self.check_kind()
        self.heads0 = self._heads()
        self.ffn0 = self._neurons()
        self.total_heads, self.total_ffn = sum(self.heads0.values()), sum(self.ffn0.values())
        macs, params = count_macs_params(self.model, self.example)
        return {"macs": macs, "params": params}

    def check_kind(self) -> None:
        """BERT-style attention or ``nn.MultiheadAttention`` (already converted); ffn only where FFN sites are."""
        if not attention_sites(self.model):
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
        return max(1, round(max(target.heads or 0, target.ffn or 0) / 0.1)) if self.config.rounds == "auto" else self.config.rounds

    def goal(self, index: int, rounds: int) -> dict[str, float]:
        target = self.config.target
        return {unit: share * index / rounds for unit, share in (("heads", target.heads), ("ffn", target.ffn)) if share}

    def score(self, batches: Callable[[], Batches]):
        """Head and FFN-neuron scores from the stage's criterion (``importance``; ``criteria.py``)."""
        return unit_importance(self.model, batches, self.loss, criterion_for(self.config))

    def plan(self, scores, goal: dict[str, float]) -> Plan:
        head_scores, ffn_scores = scores
        sites = {s.name: s for s in attention_sites(self.model)}
        ffns = {s.name: s for s in ffn_sites(self.model)}

        def apply() -> dict[str, float]:
            heads, neurons = sum(s.heads for s in sites.values()), sum(s.neurons for s in ffns.values())
            if "heads" in goal:
                _remove_lowest(head_scores, {n: s.heads for n, s in sites.items()}, self.total_heads, goal["heads"],
                               lambda name, idx: prune_heads(sites[name], idx))
            if "ffn" in goal:
                _remove_lowest(ffn_scores, {n: s.neurons for n, s in ffns.items()}, self.total_ffn, goal["ffn"],
                               lambda name, idx: prune_neurons(ffns[name], idx))
            return {"heads": heads - sum(s.heads for s in sites.values()),
                    "ffn_neurons": neurons - sum(s.neurons for s in ffns.values())}

        return Plan(apply)

    def measure(self) -> dict[str, int]:
        macs, params = count_macs_params(self.model, self.example)
        return {"macs": macs, "params": params, "heads": sum(self._heads().values()), "ffn_neurons": sum(self._neurons().values())}

    def row(self, record: Round) -> dict:
        after = record.figures
        return {"round": record.index, "heads": after["heads"], "ffn_neurons": after["ffn_neurons"], "macs": after["macs"],
                "params": after["params"], record.metric: record.value, "seconds": record.seconds}

    def describe(self, record: Round) -> str:
        after = record.figures
        return f"{after['heads']} heads, {after['ffn_neurons']} FFN neurons left, {record.metric} {record.value:.4f}"

    def summary(self, after: dict[str, int]) -> dict[str, float | int]:
        return {"heads": after["heads"], "heads_before": self.total_heads,
                "ffn_neurons": after["ffn_neurons"], "ffn_neurons_before": self.total_ffn}

    def tables(self, records: list[Round]) -> dict[str, list[dict]]:
        heads1, ffn1 = self._heads(), self._neurons()
        layers = [{"layer": n, "heads before": self.heads0[n], "heads after": heads1[n]} for n in self.heads0]
        layers += [{"layer": n, "ffn before": self.ffn0[n], "ffn after": ffn1[n]} for n in self.ffn0]
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
