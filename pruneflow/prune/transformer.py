"""Attention-head and FFN-neuron pruning for BERT-style `transformers` models and ``nn.MultiheadAttention``.

transformers 5.x removed ``prune_heads`` and the ``head_mask`` argument, and torch-pruning's head
pruning still leaves each attention module's head counts for the caller to fix, so the surgery is
written here: remove the heads' rows from query/key/value and their columns from the output
projection, then update ``num_attention_heads`` and ``all_head_size``. FFN neurons: rows of
``intermediate.dense``, columns of ``output.dense``, or of the first and last Linear of a pointwise FFN written
as ``nn.Sequential(Linear(d, f), activation, [Dropout], Linear(f, d))`` beside an attention module in the same
block (a SASRec's or a torchvision ViT's ``CausalBlock.ffn`` / ``EncoderBlock.mlp``). ``nn.MultiheadAttention`` modules are first turned
into the equivalent :class:`~pruneflow.prune.mha.HeadAttention` (see ``mha.py``), whose heads are sites too.

Importance uses per-sample *masks*: the head outputs (and FFN activations) are multiplied by a
(batch, units) tensor of ones, so one backward pass yields every sample's gradient for every unit
(:class:`UnitEvidence`, read by the stage's criterion, ``criteria.py``): Taylor |mean g|, Hessian (Fisher)
mean g², magnitude the units' weight norms.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch
from torch import nn

from .criteria import Criterion, Evidence, Scores
from .mha import HeadAttention, prune_attention_heads
from .width import WidthSite, width_norms
from ..inputs import Inputs, call


@dataclass
class AttentionSite:
    name: str
    attn: nn.Module  # the self-attention module: its head counts are updated after surgery
    query: nn.Linear  # attn.query, attn.key, attn.value, attn.attention_head_size, typed
    key: nn.Linear
    value: nn.Linear
    head_size: int
    out: nn.Linear  # the projection after attention
    # Where the merged head outputs (batch, length, heads x head size) appear: importance masks hook here.
    hook: nn.Module | None = None

    @property
    def heads(self) -> int:
        return self.query.out_features // self.head_size


@dataclass
class FfnSite:
    name: str
    up: nn.Linear
    down: nn.Linear
    # The module whose output is the FFN's activation (batch, ..., neurons): importance masks hook here.
    act: nn.Module

    @property
    def neurons(self) -> int:
        return self.up.out_features


def attention_sites(model: nn.Module) -> list[AttentionSite]:
    return [site for name, m in model.named_modules() if (site := _attention_site(name, m)) is not None]


def _attention_site(name: str, m: nn.Module) -> AttentionSite | None:
    """``m`` as a BERT-style attention block (``self`` with query/key/value projections and the head
    size, ``output.dense`` after it) or a :class:`HeadAttention`, else None."""
    if isinstance(m, HeadAttention):
        return AttentionSite(name, m, m.q_proj, m.k_proj, m.v_proj, m.head_dim, m.out_proj, m.context)
    attn, out = getattr(m, "self", None), getattr(getattr(m, "output", None), "dense", None)
    if not isinstance(attn, nn.Module) or not isinstance(out, nn.Linear):
        return None
    query, key, value = (getattr(attn, a, None) for a in ("query", "key", "value"))
    size = getattr(attn, "attention_head_size", None)
    if isinstance(query, nn.Linear) and isinstance(key, nn.Linear) and isinstance(value, nn.Linear) and isinstance(size, int):
        return AttentionSite(name, attn, query, key, value, size, out)
    return None


def ffn_sites(model: nn.Module) -> list[FfnSite]:
    sites = []
    for name, m in model.named_modules():
        up = getattr(getattr(m, "intermediate", None), "dense", None)
        down = getattr(getattr(m, "output", None), "dense", None)
        if isinstance(up, nn.Linear) and isinstance(down, nn.Linear) and down.in_features == up.out_features:
            sites.append(FfnSite(name, up, down, getattr(m, "intermediate")))
        elif any(isinstance(child, HeadAttention) for child in m.children()):
            sites += [site for child, seq in m.named_children() if (site := _sequential_ffn(f"{name}.{child}".lstrip("."), seq))]
    return sites


def _sequential_ffn(name: str, seq: nn.Module) -> FfnSite | None:
    """``seq`` as a pointwise FFN: ``nn.Sequential(Linear(d, f), activation, [Dropout...], Linear(f, d))``, the
    modules between the two Linears parameter-free (so masking the activation's output masks neuron j and
    nothing else), else None. Only beside an attention module: an MLP elsewhere is channel pruning's."""
    if not isinstance(seq, nn.Sequential) or len(seq) < 3:
        return None
    up, *between, down = list(seq)
    if not (isinstance(up, nn.Linear) and isinstance(down, nn.Linear)) or any(isinstance(m, nn.Linear) for m in between):
        return None
    if down.in_features != up.out_features or down.out_features != up.in_features:
        return None
    if any(True for m in between for _ in m.parameters()):
        return None
    return FfnSite(name, up, down, between[0])


def is_transformer(model: nn.Module) -> bool:
    """A BERT-style transformer (pruned by heads and FFN neurons only); models with ``nn.MultiheadAttention``
    prune by channels or blocks too."""
    return any(not isinstance(s.attn, HeadAttention) for s in attention_sites(model))


# --------------------------------------------------------------------------- surgery


def _keep_rows(linear: nn.Linear, keep: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.data[keep].clone())
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data[keep].clone())
    linear.out_features = len(keep)


def _keep_cols(linear: nn.Linear, keep: torch.Tensor) -> None:
    linear.weight = nn.Parameter(linear.weight.data[:, keep].clone())
    linear.in_features = len(keep)


def prune_heads(site: AttentionSite, remove: Iterable[int]) -> None:
    remove = sorted(set(int(h) for h in remove))
    heads, size = site.heads, site.head_size
    if len(remove) >= heads:
        raise ValueError(f"{site.name}: cannot remove all {heads} heads")
    if isinstance(site.attn, HeadAttention):
        prune_attention_heads(site.attn, remove)
        return
    kept_heads = [h for h in range(heads) if h not in remove]
    keep = torch.cat([torch.arange(h * size, (h + 1) * size) for h in kept_heads])
    for lin in (site.query, site.key, site.value):
        _keep_rows(lin, keep)
    _keep_cols(site.out, keep)
    # The forward reshapes with -1 heads, but these attributes are read elsewhere (and by exporters).
    # setattr: they are plain numbers, which torch's stubs do not allow as Module attributes.
    setattr(site.attn, "num_attention_heads", len(kept_heads))
    setattr(site.attn, "all_head_size", len(kept_heads) * size)
    setattr(site.attn, "scaling", size**-0.5)  # head size is unchanged; kept explicit


def prune_neurons(site: FfnSite, remove: Iterable[int]) -> None:
    remove = set(int(i) for i in remove)
    if len(remove) >= site.neurons:
        raise ValueError(f"{site.name}: cannot remove all {site.neurons} FFN neurons")
    keep = torch.tensor([i for i in range(site.neurons) if i not in remove])
    _keep_rows(site.up, keep)
    _keep_cols(site.down, keep)


# --------------------------------------------------------------------------- masks and importance


@contextlib.contextmanager
def unit_masks(model: nn.Module, head_mask: dict[str, torch.Tensor] | None = None,
               ffn_mask: dict[str, torch.Tensor] | None = None, per_sample: bool = False,
               widths: Sequence[WidthSite] = (), width_mask: dict[str, torch.Tensor] | None = None) -> Iterator[dict]:
    """Multiply head outputs / FFN activations (and the channels of ``widths``, ``width.py``) by masks.

    Fixed masks (shape [units]) emulate removed units, for testing surgery against masking. With
    ``per_sample=True`` each forward creates a ones tensor [batch, units] requiring grad; after the
    backward, ``captured[site name]`` holds them with ``.grad`` = per-sample gradients. A width's one mask
    multiplies its channels at every module that outputs them (one forward a context).
    """
    captured: dict[str, torch.Tensor] = {}
    handles = []

    def head_hook(site: AttentionSite):
        def hook(module, inputs, output):
            ctx = output[0] if isinstance(output, tuple) else output
            b, t = ctx.shape[0], ctx.shape[1]
            heads = ctx.shape[-1] // site.head_size
            mask = _mask(site.name, head_mask, b, heads, ctx)
            scaled = (ctx.view(b, t, heads, -1) * mask.view(mask.shape[0], 1, heads, 1)).view_as(ctx)
            return (scaled,) + tuple(output[1:]) if isinstance(output, tuple) else scaled

        return hook

    def ffn_hook(site: FfnSite):
        def hook(module, inputs, output):
            b = output.shape[0]
            mask = _mask(site.name, ffn_mask, b, output.shape[-1], output)
            return output * mask.view(mask.shape[0], *([1] * (output.dim() - 2)), -1)

        return hook

    def width_hook(site: WidthSite):
        def hook(module, inputs, output):
            found = captured.get(site.name) if per_sample else None  # one mask for all the width's outputs
            mask = found if found is not None else _mask(site.name, width_mask, output.shape[0], output.shape[-1], output)
            return output * mask.view(mask.shape[0], *([1] * (output.dim() - 2)), -1)

        return hook

    def _mask(name, fixed, b, units, like):
        if fixed is not None and name in fixed:
            return fixed[name].to(like.dtype).view(1, units)
        if per_sample:
            m = torch.ones(b, units, dtype=like.dtype, device=like.device, requires_grad=True)
            captured[name] = m
            return m
        return torch.ones(1, units, dtype=like.dtype, device=like.device)

    try:
        if head_mask is not None or per_sample:
            handles += [(s.hook or s.attn).register_forward_hook(head_hook(s)) for s in attention_sites(model)]
        if ffn_mask is not None or per_sample:
            handles += [s.act.register_forward_hook(ffn_hook(s)) for s in ffn_sites(model)]
        if width_mask is not None or per_sample:
            handles += [m.register_forward_hook(width_hook(s)) for s in widths for m in s.masked]
        yield captured
    finally:
        for h in handles:
            h.remove()


class UnitEvidence(Evidence):
    """What a criterion reads for heads, FFN neurons and the channels of ``widths`` (``width.py``): one score per
    unit, keyed by site name (a width's: its first table's). A unit's "weight" is its mask (ones), so a criterion's
    |w·g| or w²·F is the mask's |g| or F. The gradient and the Fisher come from one masked pass over ``batches``
    (made when a term first needs it)."""

    def __init__(self, model: nn.Module, batches: "Callable[[], Iterable[tuple[Inputs, torch.Tensor]]]",
                 loss_fn: Callable[[object, torch.Tensor], torch.Tensor], widths: Sequence[WidthSite] = ()):
        self.model, self._batches, self.loss_fn, self.widths = model, batches, loss_fn, list(widths)
        self._moments: tuple[Scores, Scores] | None = None

    def magnitude(self) -> Scores:
        heads = {s.name: _head_norms(s) for s in attention_sites(self.model)}
        ffn = {s.name: s.up.weight.detach().pow(2).sum(1) + s.down.weight.detach().pow(2).sum(0) for s in ffn_sites(self.model)}
        return {**heads, **ffn, **{s.name: width_norms(s).to(_like(self.model).dtype) for s in self.widths}}

    def weights(self) -> Scores:
        like = _like(self.model)
        sizes = {**{s.name: s.heads for s in attention_sites(self.model)}, **{s.name: s.neurons for s in ffn_sites(self.model)},
                 **{s.name: s.width for s in self.widths}}
        return {name: torch.ones(n, dtype=like.dtype, device=like.device) for name, n in sizes.items()}

    def gradient(self) -> Scores:
        return self._masked()[0]

    def fisher(self) -> Scores:
        return self._masked()[1]

    def mixed(self, first: Scores, second: Scores, weight: float) -> Scores:
        a, b = _mean(first), _mean(second)
        return {n: weight * first[n] / a + (1 - weight) * second[n] / b for n in first if n in second}

    def _masked(self) -> tuple[Scores, Scores]:
        """Every unit's mean mask gradient and mean squared per-sample mask gradient."""
        if self._moments is None:
            self._moments = _mask_moments(self.model, self._batches(), self.loss_fn, self.widths)
        return self._moments


def _like(model: nn.Module) -> torch.Tensor:
    """A parameter of ``model``: the dtype and device of its unit scores."""
    return next(model.parameters())


def _mask_moments(model: nn.Module, batches: "Iterable[tuple[Inputs, torch.Tensor]]",
                  loss_fn: Callable[[object, torch.Tensor], torch.Tensor],
                  widths: Sequence[WidthSite] = ()) -> tuple[Scores, Scores]:
    was = model.training
    model.eval()
    grad_sum: dict[str, torch.Tensor] = {}
    sq_sum: dict[str, torch.Tensor] = {}
    count = 0
    for x, y in batches:
        with unit_masks(model, per_sample=True, widths=widths) as masks:
            # Sum, not mean: each sample's mask gradient is then that sample's own gradient.
            loss = loss_fn(call(model, x), y) * len(y)
            model.zero_grad(set_to_none=True)
            loss.backward()
            for name, m in masks.items():
                g = m.grad.detach()
                grad_sum[name] = grad_sum.get(name, 0) + g.sum(0)
                sq_sum[name] = sq_sum.get(name, 0) + g.pow(2).sum(0)
        count += len(y)
    model.zero_grad(set_to_none=True)
    model.train(was)
    return {n: g / count for n, g in grad_sum.items()}, {n: s / count for n, s in sq_sum.items()}


def unit_importance(model: nn.Module, batches: "Iterable[tuple[Inputs, torch.Tensor]] | Callable[[], Iterable]",
                    loss_fn: Callable[[object, torch.Tensor], torch.Tensor],
                    criterion: Criterion) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Scores for every head and FFN neuron by ``criterion`` (higher = more important), keyed by site name.
    ``batches``: the importance batches, or a function sampling them (called only when the criterion needs them)."""
    heads, ffn, _ = unit_scores(model, batches, loss_fn, criterion)
    return heads, ffn


def unit_scores(model: nn.Module, batches: "Iterable[tuple[Inputs, torch.Tensor]] | Callable[[], Iterable]",
                loss_fn: Callable[[object, torch.Tensor], torch.Tensor], criterion: Criterion,
                widths: Sequence[WidthSite] = ()) -> tuple[Scores, Scores, Scores]:
    """``unit_importance`` and the scores of the channels of ``widths`` (one masked pass for all three)."""
    sample = batches if callable(batches) else (lambda: batches)
    scores = criterion.score(UnitEvidence(model, sample, loss_fn, widths))
    return ({s.name: scores[s.name] for s in attention_sites(model)}, {s.name: scores[s.name] for s in ffn_sites(model)},
            {s.name: scores[s.name] for s in widths})


def _mean(d: dict[str, torch.Tensor]) -> float:
    total = torch.cat([v.flatten() for v in d.values()])
    return float(total.mean()) or 1.0


def _head_norms(site: AttentionSite) -> torch.Tensor:
    size = site.head_size
    rows = sum(lin.weight.detach().pow(2).view(site.heads, size, -1).sum((1, 2)) for lin in (site.query, site.key, site.value))
    cols = site.out.weight.detach().pow(2).view(site.out.out_features, site.heads, size).sum((0, 2))
    return rows + cols


def select_lowest(scores: dict[str, torch.Tensor], ratio: float, keep_min: int = 1) -> dict[str, list[int]]:
    """Globally remove the ``ratio`` share of units with the lowest layer-normalised scores."""
    normed = {n: s / (s.norm() + 1e-12) for n, s in scores.items()}
    total = sum(len(s) for s in normed.values())
    budget = int(round(ratio * total))
    flat = sorted((float(v), n, i) for n, s in normed.items() for i, v in enumerate(s))
    remaining = {n: len(s) for n, s in normed.items()}
    chosen: dict[str, list[int]] = {n: [] for n in normed}
    for _, name, index in flat:
        if budget <= 0:
            break
        if remaining[name] > keep_min:
            chosen[name].append(index)
            remaining[name] -= 1
            budget -= 1
    return chosen
