"""`prune`: progressive structured pruning with distillation fine-tuning between rounds."""

from __future__ import annotations

import copy
import tempfile
import time
from pathlib import Path
from typing import Literal

import torch
from pydantic import Field, model_validator

from ..bench import cpu_channel_block, measure_latency
from ..distill import DistillSpec, Distiller, frozen_copy
from ..errors import InputError
from ..evaluate import count_macs_params, evaluate_model
from ..recipe.models import ModelSpec
from ..stage import Stage, StageConfig, StageResult, StrictModel
from ..train import FinetuneSettings, fit
from .blocks import block_scores, find_blocks, present, remove_blocks
from .engine import (PruneOptions, auto_rounds, layer_channels, layer_widths, measure, plan_step, resolve_ignored,
                     search_ratio)
from .fisher import fisher_diagonal, mean_gradients
from .importance import hessian_saliency, magnitude_saliency, mixed_saliency, taylor_saliency
from .surgery import make_prunable
from .transformer import attention_sites, ffn_sites, is_transformer, prune_heads, prune_neurons, select_lowest, unit_importance


class PruneTarget(StrictModel):
    ratio: float | None = Field(None, gt=0, lt=1, description="Share of prunable channels to remove.")
    macs: float | None = Field(None, gt=0, lt=1, description="Share of the baseline MACs to keep (0.5 = 2x fewer).")
    params: float | None = Field(None, gt=0, lt=1, description="Share of the baseline parameters to keep.")
    heads: float | None = Field(None, gt=0, lt=1, description="Transformers: share of attention heads to remove.")
    ffn: float | None = Field(None, gt=0, lt=1, description="Transformers: share of FFN neurons to remove.")

    @model_validator(mode="after")
    def _one(self) -> "PruneTarget":
        given = [k for k in ("ratio", "macs", "params") if getattr(self, k) is not None]
        units = [k for k in ("heads", "ffn") if getattr(self, k) is not None]
        if units and given:
            raise ValueError("heads/ffn (transformers) and ratio/macs/params (channels) do not mix")
        if not units and len(given) != 1:
            raise ValueError(f"give exactly one of ratio, macs, params, or heads and/or ffn (got {', '.join(given) or 'none'})")
        return self

    @property
    def for_transformers(self) -> bool:
        return self.heads is not None or self.ffn is not None

    def metric_and_keep(self) -> tuple[str, float]:
        if self.ratio is not None:
            return "channels", 1 - self.ratio
        if self.macs is not None:
            return "macs", self.macs
        return "params", self.params  # type: ignore[return-value]


class PruneLatency(StrictModel):
    batch_sizes: list[int] = Field([1, 32], min_length=1, description="Batch sizes timed in onnxruntime.")
    runs: int = Field(20, ge=1, description="Timed runs per batch size.")


class PruneConfig(StageConfig):
    type: Literal["prune"] = Field("prune", description="Structured channel pruning with progressive rounds and KD fine-tuning.")
    importance: Literal["magnitude", "taylor", "hessian", "hessian+taylor"] = Field(
        "hessian", description="Channel importance: weight magnitude, first-order Taylor (|w·g|), Hessian (OBD, w²·Fisher), or both mixed."
    )
    target: PruneTarget = Field(description="What to reach: {ratio: 0.3} channels removed, {macs: 0.5} or {params: 0.5} kept.")
    granularity: Literal["channels", "blocks"] = Field(
        "channels", description="`channels`: remove channels (width). `blocks`: remove whole residual blocks (depth), ranked "
        "by the measured loss increase of removing each; `ratio` is then the share of blocks. On CPUs, blocks turn MACs into "
        "time one for one; channels keep the depth. `importance`, `allocation`, `ranking`, `round_to`, `max_layer_ratio` "
        "and `fade` apply to channels."
    )
    rounds: int | Literal["auto"] = Field("auto", description="Prune-then-fine-tune rounds; `auto` removes about 10 % of channels a round "
                                                     "(blocks: as many rounds as channels would take for the target).")
    allocation: Literal["global", "uniform"] = Field(
        "global", description="`global` ranks channels across layers; `uniform` prunes every layer by the same ratio."
    )
    ranking: Literal["relative", "absolute", "per_mac"] = Field(
        "relative", description="`global`: how channels of different layers compare. `relative` (torch-pruning's default): "
        "against their own group's mean score; `absolute`: summed scores as they are (hessian: OBD's loss estimate); "
        "`per_mac`: absolute score per MAC the channel costs, so the cheapest loss per MAC saved goes first."
    )
    max_layer_ratio: float = Field(0.9, gt=0, lt=1, description="At most this share of any layer's channels is removed.")
    round_to: int | None = Field(None, ge=1, description="Keep channel counts multiples of this (kernels run faster).")
    ignore: list[str] | None = Field(None, description="Module names or regexes kept intact; default: the classifier.")
    magnitude_p: Literal[1, 2] = Field(2, description="`magnitude`: L1 or L2.")
    hessian_weight: float = Field(0.5, ge=0, le=1, description="`hessian+taylor`: weight of the Hessian term.")
    importance_batches: int | None = Field(
        None, ge=1, description="Training batches used to score importance each round; default 4 for channels, 32 for "
        "blocks (a block's score is one forward pass a batch, and fewer samples rank blocks by noise)."
    )
    importance_batch_size: int = Field(32, ge=1, description="Samples per importance batch.")
    finetune: FinetuneSettings | None = Field(
        default_factory=FinetuneSettings, description="Fine-tuning after each round (null = none)."
    )
    fade: float | None = Field(
        None, gt=0, le=1, description="Fade each round's chosen channels to zero over this share of the round's fine-tune, "
        "then remove them (the removal changes no output), instead of removing them before it; null: remove at once."
    )
    lr_decay: float = Field(0.7, gt=0, le=1, description="Fine-tune LR factor from one round to the next.")
    final_finetune: FinetuneSettings | None = Field(None, description="A longer fine-tune after the last round.")
    distill: DistillSpec | None = Field(
        default_factory=DistillSpec, description="KD from the teacher during fine-tuning (null = hard labels only)."
    )
    teacher: ModelSpec | None = Field(None, description="Teacher model; default: a frozen copy of the model entering the stage.")
    latency: PruneLatency | None = Field(
        default_factory=PruneLatency, description="Time the model in onnxruntime before and after (null = skip)."
    )


class PruneStage(Stage):
    Config = PruneConfig
    modifies_model = True
    needs_train_split = True

    def run(self, state, ctx):
        cfg: PruneConfig = self.config  # type: ignore[assignment]
        model, example, task, data = state.model, state.example_input, state.task, state.data
        transformer = is_transformer(model)
        if transformer != cfg.target.for_transformers:
            raise InputError(
                f"stages.{self.index}.target: " + ("this is a transformer model; prune it by heads and FFN neurons"
                                                   if transformer else "heads/ffn targets need a BERT-style transformer model"),
                hint="e.g. target: {heads: 0.5, ffn: 0.3}" if transformer else "use target: {macs: 0.5}, {params: 0.5} or {ratio: 0.3}",
            )
        if transformer:
            return self._run_transformer(state, ctx)
        if cfg.granularity == "blocks":
            return self._run_blocks(state, ctx)
        metric, keep = cfg.target.metric_and_keep()
        # The baseline is the model as it entered the stage, before the shortcut rewrite.
        macs_entering, params_entering = count_macs_params(model, example)
        accuracy_before = evaluate_model(model, data.eval, task, ctx.recipe.data.eval_batch_size, ctx.device,
                                         ctx.reporter, f"{self.id} baseline")["accuracy"]
        latency_before = self._latency(model, example, data) if cfg.latency else {}
        replaced = make_prunable(model, example)
        ignored = resolve_ignored(model, cfg.ignore)
        opts = PruneOptions(cfg.allocation, cfg.max_layer_ratio, cfg.round_to, ignored, cfg.ranking, layer_widths(model))
        before = measure(model, example, ignored)  # targets count the rewritten model, as every round does
        channels_before = layer_channels(model)
        teacher = self._teacher(state, ctx)
        rounds = auto_rounds(metric, keep) if cfg.rounds == "auto" else cfg.rounds
        rows, importance_seconds, lr = [], 0.0, cfg.finetune.lr if cfg.finetune else 0.0
        for k in range(1, rounds + 1):
            start = time.perf_counter()
            goal = before[metric] * (1 - (1 - keep) * k / rounds)
            t0 = time.perf_counter()
            saliency = self._saliency(model, data, task, ctx, k)
            importance_seconds += time.perf_counter() - t0
            ratio, _ = search_ratio(model, example, saliency, opts, metric, goal)
            plan = plan_step(model, example, saliency, ratio, opts)
            fading = bool(cfg.fade and cfg.finetune and cfg.finetune.epochs)
            if not fading:
                plan.apply()
            model._pruneflow_restructured = True
            accuracy, lr = self._after_round(model, teacher, lr, state, ctx, k, rounds,
                                             on_step_end=plan.fader(cfg.fade) if fading else None)  # type: ignore[arg-type]
            if fading:
                plan.apply()  # its channels are zero now: the removal changes no output
            after = measure(model, example, ignored)
            rows.append({"round": k, "goal_kept": round(goal / before[metric], 4), "ratio": round(ratio, 4),
                         "channels": after["channels"], "macs": after["macs"],
                         "params": after["params"], "macs_kept": after["macs"] / before["macs"],
                         "accuracy": accuracy, "seconds": round(time.perf_counter() - start, 1)})
            ctx.reporter.info(f"{self.id} round {k}/{rounds}: {after['macs'] / before['macs']:.1%} of MACs, accuracy {accuracy:.4f}")
        final = rows[-1]["accuracy"] if rows else accuracy_before
        if cfg.final_finetune and cfg.final_finetune.epochs:
            final = self._finetune(model, teacher, cfg.final_finetune, state, ctx, f"{self.id} final fine-tune")
        after = measure(model, example, ignored)
        metrics = {
            "accuracy": final,
            "accuracy_before": accuracy_before,
            "macs": after["macs"],
            "params": after["params"],
            "macs_before": macs_entering,
            "params_before": params_entering,
            "macs_reduction": macs_entering / after["macs"],
            "params_reduction": params_entering / after["params"],
            "channels_kept": after["channels"] / before["channels"],
            "rounds": rounds,
            "importance_seconds": round(importance_seconds, 3),
            "shortcuts_rewritten": replaced,
        }
        if cfg.latency:
            self._add_latency(metrics, latency_before, self._latency(model, example, data))
        layers = [{"layer": n, "before": c, "after": layer_channels(model).get(n, 0)} for n, c in channels_before.items()]
        tables = {"rounds": rows, "channels": layers}
        note = self._block_note(layers)
        if note:
            ctx.reporter.info(f"{self.id}: {note}")
            tables["notes"] = [{"note": note}]
        return StageResult(metrics=metrics, tables=tables)

    def _run_blocks(self, state, ctx) -> StageResult:
        """Depth pruning: the least important residual blocks replaced by the identity, round by round."""
        cfg: PruneConfig = self.config  # type: ignore[assignment]
        model, example, task, data = state.model, state.example_input, state.task, state.data
        if cfg.fade:
            raise InputError(f"stages.{self.index}.fade: a block is removed whole, it has no channels to fade",
                             hint="drop fade, or use granularity: channels")
        ignored = resolve_ignored(model, cfg.ignore)
        candidates = find_blocks(model, example, ignored)
        if not candidates:
            raise InputError(
                f"stages.{self.index}.granularity: blocks, but the model has no removable residual block (a module that keeps "
                "its input's shape and adds its input, through an identity skip, to another branch)"
                + (" outside prune.ignore" if cfg.ignore else ""),
                hint="use granularity: channels for models without residual blocks",
            )
        metric, keep = cfg.target.metric_and_keep()
        metric = "blocks" if metric == "channels" else metric  # ratio: the share of blocks removed

        def measured() -> dict[str, int]:
            return dict(measure(model, example, ignored), blocks=len(present(model, candidates)))

        before = measured()
        final_goal = before[metric] * keep
        # Refuse an unreachable target before any training (a copy without every candidate block).
        floor = 0
        if metric != "blocks":
            bare = copy.deepcopy(model)
            remove_blocks(bare, candidates)
            floor = measure(bare, example, ignored)[metric]
        if floor > final_goal:
            raise InputError(
                f"stages.{self.index}.target: {metric} {keep:g} cannot be reached by removing blocks: without all "
                f"{len(candidates)} removable blocks the model keeps {floor / before[metric]:.1%} of its {metric}",
                hint=f"ask for {metric}: {floor / before[metric] + 0.05:.2f} or more, or use granularity: channels",
            )
        accuracy_before = evaluate_model(model, data.eval, task, ctx.recipe.data.eval_batch_size, ctx.device,
                                         ctx.reporter, f"{self.id} baseline")["accuracy"]
        latency_before = self._latency(model, example, data) if cfg.latency else {}
        channels_before = layer_channels(model)
        teacher = self._teacher(state, ctx)
        rounds = auto_rounds("macs" if metric == "blocks" else metric, keep) if cfg.rounds == "auto" else cfg.rounds
        rows, removed_rows, importance_seconds = [], [], 0.0
        lr = cfg.finetune.lr if cfg.finetune else 0.0
        for k in range(1, rounds + 1):
            start = time.perf_counter()
            goal = before[metric] * (1 - (1 - keep) * k / rounds)
            t0 = time.perf_counter()
            scores = block_scores(model, present(model, candidates), self._importance_batches(data, ctx, k), task.loss)
            importance_seconds += time.perf_counter() - t0
            removed = []
            for name in sorted(scores, key=scores.get):
                if measured()[metric] <= goal + 1e-9:
                    break
                remove_blocks(model, [name])
                removed.append(name)
                removed_rows.append({"block": name, "round": k, "loss_increase": round(scores[name], 5)})
            model._pruneflow_restructured = True
            accuracy, lr = self._after_round(model, teacher, lr, state, ctx, k, rounds)
            after = measured()
            rows.append({"round": k, "goal_kept": round(goal / before[metric], 4), "blocks": after["blocks"],
                         "removed": ", ".join(removed), "macs": after["macs"], "params": after["params"],
                         "macs_kept": after["macs"] / before["macs"], "accuracy": accuracy,
                         "seconds": round(time.perf_counter() - start, 1)})
            ctx.reporter.info(f"{self.id} round {k}/{rounds}: removed {len(removed)} block(s), "
                              f"{after['macs'] / before['macs']:.1%} of MACs, accuracy {accuracy:.4f}")
        final = rows[-1]["accuracy"] if rows else accuracy_before
        if cfg.final_finetune and cfg.final_finetune.epochs:
            final = self._finetune(model, teacher, cfg.final_finetune, state, ctx, f"{self.id} final fine-tune")
        after = measured()
        metrics = {
            "accuracy": final, "accuracy_before": accuracy_before,
            "macs": after["macs"], "params": after["params"],
            "macs_before": before["macs"], "params_before": before["params"],
            "macs_reduction": before["macs"] / after["macs"], "params_reduction": before["params"] / after["params"],
            "blocks_before": before["blocks"], "blocks_removed": before["blocks"] - after["blocks"],
            "rounds": rounds, "importance_seconds": round(importance_seconds, 3),
        }
        if cfg.latency:
            self._add_latency(metrics, latency_before, self._latency(model, example, data))
        now = layer_channels(model)
        layers = [{"layer": n, "before": c, "after": now.get(n, 0)} for n, c in channels_before.items()]
        return StageResult(metrics=metrics, tables={"rounds": rows, "blocks": removed_rows, "channels": layers})

    def _block_note(self, layers: list[dict]) -> str | None:
        """Say so when pruned layers end off this CPU's SIMD channel block: their MACs fall, their time less."""
        cfg: PruneConfig = self.config  # type: ignore[assignment]
        found = cpu_channel_block()
        if not cfg.latency or not found:
            return None
        block, isa = found
        off = [r["layer"] for r in layers if r["after"] != r["before"] and r["after"] % block]
        if not off:
            return None
        return (f"{len(off)} pruned layer(s) (e.g. {', '.join(off[:3])}) end with a channel count that is not a multiple of "
                f"{block}, the channel block of onnxruntime's and OpenVINO's CPU kernels on this {isa} machine: they are "
                f"padded up to it, so their MACs fall faster than their run time. round_to: {block} turns pruned MACs into "
                f"time here (narrower layers then stay whole).")

    def _run_transformer(self, state, ctx) -> StageResult:
        """Heads and FFN neurons, removed progressively by importance, with KD fine-tuning between rounds."""
        cfg: PruneConfig = self.config  # type: ignore[assignment]
        if cfg.fade:
            raise InputError(f"stages.{self.index}.fade: heads and FFN neurons are removed at once; fade applies to channel pruning",
                             hint="remove fade from this prune stage")
        model, example, task, data = state.model, state.example_input, state.task, state.data
        heads0 = {s.name: s.heads for s in attention_sites(model)}
        ffn0 = {s.name: s.neurons for s in ffn_sites(model)}
        total_heads, total_ffn = sum(heads0.values()), sum(ffn0.values())
        macs0, params0 = count_macs_params(model, example)
        accuracy_before = evaluate_model(model, data.eval, task, ctx.recipe.data.eval_batch_size, ctx.device,
                                         ctx.reporter, f"{self.id} baseline")["accuracy"]
        latency_before = self._latency(model, example, data) if cfg.latency else {}
        teacher = self._teacher(state, ctx)
        rounds = max(1, round(max(cfg.target.heads or 0, cfg.target.ffn or 0) / 0.1)) if cfg.rounds == "auto" else cfg.rounds
        rows, importance_seconds, lr = [], 0.0, cfg.finetune.lr if cfg.finetune else 0.0
        for k in range(1, rounds + 1):
            start = time.perf_counter()
            t0 = time.perf_counter()
            batches = self._importance_batches(data, ctx, k)
            head_scores, ffn_scores = unit_importance(model, batches, task.loss, cfg.importance, cfg.hessian_weight)
            importance_seconds += time.perf_counter() - t0
            sites = {s.name: s for s in attention_sites(model)}
            ffns = {s.name: s for s in ffn_sites(model)}
            # Each round removes its share of the *original* count: round k reaches k/rounds of the target.
            if cfg.target.heads:
                _remove_lowest(head_scores, {n: s.heads for n, s in sites.items()}, total_heads, cfg.target.heads * k / rounds,
                               lambda name, idx: prune_heads(sites[name], idx))
            if cfg.target.ffn:
                _remove_lowest(ffn_scores, {n: s.neurons for n, s in ffns.items()}, total_ffn, cfg.target.ffn * k / rounds,
                               lambda name, idx: prune_neurons(ffns[name], idx))
            model._pruneflow_restructured = True
            accuracy, lr = self._after_round(model, teacher, lr, state, ctx, k, rounds)
            macs, params = count_macs_params(model, example)
            rows.append({"round": k, "heads": sum(s.heads for s in attention_sites(model)),
                         "ffn_neurons": sum(s.neurons for s in ffn_sites(model)), "macs": macs, "params": params,
                         "accuracy": accuracy, "seconds": round(time.perf_counter() - start, 1)})
        final = rows[-1]["accuracy"]
        if cfg.final_finetune and cfg.final_finetune.epochs:
            final = self._finetune(model, teacher, cfg.final_finetune, state, ctx, f"{self.id} final fine-tune")
        macs, params = count_macs_params(model, example)
        heads1 = {s.name: s.heads for s in attention_sites(model)}
        ffn1 = {s.name: s.neurons for s in ffn_sites(model)}
        metrics = {
            "accuracy": final, "accuracy_before": accuracy_before, "macs": macs, "params": params,
            "macs_before": macs0, "params_before": params0, "macs_reduction": macs0 / macs, "params_reduction": params0 / params,
            "heads": sum(heads1.values()), "heads_before": total_heads,
            "ffn_neurons": sum(ffn1.values()), "ffn_neurons_before": total_ffn,
            "rounds": rounds, "importance_seconds": round(importance_seconds, 3),
        }
        if cfg.latency:
            self._add_latency(metrics, latency_before, self._latency(model, example, data))
        layers = [{"layer": n, "heads before": heads0[n], "heads after": heads1[n]} for n in heads0]
        layers += [{"layer": n, "ffn before": ffn0[n], "ffn after": ffn1[n]} for n in ffn0]
        return StageResult(metrics=metrics, tables={"rounds": rows, "units": layers})

    def _add_latency(self, metrics: dict, before: dict, after: dict) -> None:
        for key, value in before.items():
            metrics[f"{key}_before"] = value
            metrics[key] = after[key]
            bs = key[len("latency_b"): -len("_median_ms")]
            metrics[f"latency_b{bs}_speedup"] = value / after[key]

    # ------------------------------------------------------------------ pieces

    def _after_round(self, model, teacher, lr, state, ctx, k, rounds, on_step_end=None) -> tuple[float, float]:
        """Fine-tune (with KD) at this round's LR, or just evaluate; returns (accuracy, next LR)."""
        cfg: PruneConfig = self.config  # type: ignore[assignment]
        if cfg.finetune and cfg.finetune.epochs:
            accuracy = self._finetune(model, teacher, cfg.finetune.model_copy(update={"lr": lr}), state, ctx,
                                      f"{self.id} round {k}/{rounds}", on_step_end)
            return accuracy, lr * cfg.lr_decay
        accuracy = evaluate_model(model, state.data.eval, state.task, ctx.recipe.data.eval_batch_size, ctx.device,
                                  ctx.reporter, f"{self.id} round {k}")["accuracy"]
        return accuracy, lr

    def _teacher(self, state, ctx):
        cfg: PruneConfig = self.config  # type: ignore[assignment]
        if cfg.distill is None:
            return None
        if cfg.teacher is not None:
            from ..models import build_model

            return frozen_copy(build_model(cfg.teacher)).to(ctx.device)
        return state.teacher if state.teacher is not None else frozen_copy(state.model)

    def _importance_batches(self, data, ctx, round_index: int):
        """A seeded random sample of the training split (files are often sorted by class)."""
        cfg: PruneConfig = self.config  # type: ignore[assignment]
        batches = cfg.importance_batches or (32 if cfg.granularity == "blocks" else 4)
        n = min(batches * cfg.importance_batch_size, len(data.train))
        gen = torch.Generator().manual_seed(ctx.seed * 1000 + round_index)
        idx = torch.randperm(len(data.train), generator=gen)[:n]
        x, y = data.train.x[idx].to(ctx.device), data.train.y[idx].to(ctx.device)
        return [(x[i : i + cfg.importance_batch_size], y[i : i + cfg.importance_batch_size]) for i in range(0, len(y), cfg.importance_batch_size)]

    def _saliency(self, model, data, task, ctx, round_index: int) -> dict[str, torch.Tensor]:
        cfg: PruneConfig = self.config  # type: ignore[assignment]
        if cfg.importance == "magnitude":
            return magnitude_saliency(model, cfg.magnitude_p)
        batches = self._importance_batches(data, ctx, round_index)
        if cfg.importance == "taylor":
            return taylor_saliency(model, mean_gradients(model, batches, task.loss))
        fisher, grads = fisher_diagonal(model, batches, task.loss)
        hessian = hessian_saliency(model, fisher)
        if cfg.importance == "hessian":
            return hessian
        return mixed_saliency(hessian, taylor_saliency(model, grads), cfg.hessian_weight)

    def _finetune(self, model, teacher, settings, state, ctx, description, on_step_end=None) -> float:
        cfg: PruneConfig = self.config  # type: ignore[assignment]
        distiller = Distiller(model, teacher, cfg.distill, state.task, state.example_input) if teacher is not None and cfg.distill else None
        try:
            history = fit(model, state.data, state.task, settings, ctx, description=description,
                          extra_loss=distiller.loss if distiller else None,
                          extra_modules=distiller.modules() if distiller else (), on_step_end=on_step_end)
        finally:
            if distiller:
                distiller.close()
        return history[-1]["eval_accuracy"]

    def _latency(self, model, example, data) -> dict[str, float]:
        from ..export.onnx import export_onnx, onnxruntime_runner
        from ..stages.export import fresh_batch

        cfg: PruneConfig = self.config  # type: ignore[assignment]
        out = {}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "model.onnx"
            export_onnx(copy.deepcopy(model).cpu(), example.cpu(), path)
            run = onnxruntime_runner(path, threads=1)
            for bs in cfg.latency.batch_sizes:  # type: ignore[union-attr]
                lat = measure_latency(run, fresh_batch(data.eval.x, bs).numpy(), warmup=3, runs=cfg.latency.runs)  # type: ignore[union-attr]
                out[f"latency_b{bs}_median_ms"] = lat["median_ms"]
        return out


def _remove_lowest(scores: dict, counts: dict[str, int], total: int, share: float, prune) -> None:
    """Prune the lowest-scored units until ``share`` of the original ``total`` is gone."""
    now = sum(counts.values())
    goal = total - round(share * total)
    if now > goal:
        for name, remove in select_lowest(scores, (now - goal) / now).items():
            if remove:
                prune(name, remove)
