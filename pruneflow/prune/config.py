"""The `prune` stage's config: one variant per granularity, each with only the keys that act on its path.

A recipe picks the variant with ``granularity`` (``channels`` when absent, or ``heads`` when the target
names ``heads``/``ffn``), so a key of another path (``fade`` with blocks, ``round_to`` with heads) is an
unknown key at its line, found when the recipe loads rather than when the stage runs::

    - type: prune
      granularity: blocks
      target: {macs: 0.5}
      fade: 0.5          # recipe.yaml:14  stages.1.fade  unknown key ...
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import AfterValidator, Discriminator, Field, Tag, field_validator, model_validator

from ..distill import DistillSpec
from ..recipe.models import ModelSpec
from ..stage import StageConfig, StrictModel
from ..train import FinetuneSettings

_UNIT_KEYS = ("heads", "ffn", "width")
_SHARE_KEYS = ("ratio", "macs", "params")
_TABLE_KEYS = ("rows", "dims", "outputs")


def _refuse(data: Any, keys: tuple[str, ...], message: str) -> Any:
    """``data`` as it is, unless it is a mapping holding one of ``keys`` (the other target kind's)."""
    if isinstance(data, dict) and any(k in data for k in keys):
        raise ValueError(message)
    return data


class PruneTarget(StrictModel):
    """Channels and blocks: exactly one of ``ratio``, ``macs`` or ``params``."""

    ratio: float | None = Field(default=None, gt=0, lt=1, description="Share of prunable channels (blocks: of blocks) to remove.")
    macs: float | None = Field(default=None, gt=0, lt=1, description="Share of the baseline MACs to keep (0.5 = 2x fewer).")
    params: float | None = Field(default=None, gt=0, lt=1, description="Share of the baseline parameters to keep.")

    @model_validator(mode="before")
    @classmethod
    def _not_units(cls, data: Any) -> Any:
        """heads/ffn/width name a transformer target: say which granularity takes them instead of "unknown key"."""
        return _refuse(data, _UNIT_KEYS, "heads/ffn/width (transformers) and ratio/macs/params (channels, blocks) do not mix; "
                       "heads/ffn/width need `granularity: heads` (or no granularity)")

    @model_validator(mode="after")
    def _one(self) -> "PruneTarget":
        given = [k for k in _SHARE_KEYS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"give exactly one of ratio, macs or params (got {', '.join(given) or 'none'})")
        return self

    def metric_and_keep(self) -> tuple[Literal["channels", "macs", "params"], float]:
        """The figure the target counts and the share of it to keep: ``("macs", 0.5)``."""
        if self.ratio is not None:
            return "channels", 1 - self.ratio
        if self.macs is not None:
            return "macs", self.macs
        assert self.params is not None  # _one: exactly one of ratio, macs, params is set
        return "params", self.params


class UnitTarget(StrictModel):
    """Transformers: the share of attention heads, FFN neurons and/or width channels to remove, or a MACs budget
    (``macs``: the share to keep) that the three kinds reach together, ranked by importance per MAC."""

    heads: float | None = Field(default=None, gt=0, lt=1, description="Share of attention heads to remove.")
    ffn: float | None = Field(default=None, gt=0, lt=1, description="Share of FFN neurons to remove.")
    width: float | None = Field(default=None, gt=0, lt=1, description="Share of the model width to remove: the channels "
                                "the embedding tables write (the residual stream), with every norm, reader and writer of "
                                "them and the output projection tied to a table (pruned with it, still one weight).")

    macs: float | None = Field(default=None, gt=0, lt=1, description="Share of the MACs to keep (0.5 = 2x fewer): heads, "
                               "FFN neurons and width channels go together, the lowest importance per MAC first "
                               "(`importance: hessian`, the default, makes the three kinds' scores the same quantity).")

    @model_validator(mode="before")
    @classmethod
    def _not_shares(cls, data: Any) -> Any:
        return _refuse(data, ("ratio", "params"), "heads/ffn/width/macs (transformers) and ratio/params (channels, blocks) "
                       "do not mix")

    @model_validator(mode="after")
    def _some(self) -> "UnitTarget":
        shares = [k for k in _UNIT_KEYS if getattr(self, k) is not None]
        if self.macs is not None and shares:
            raise ValueError(f"give macs alone (a budget the units reach together) or shares of units ({', '.join(shares)})")
        if self.macs is None and not shares:
            raise ValueError("give heads, ffn and/or width, or macs")
        return self


class PruneLatency(StrictModel):
    batch_sizes: list[int] = Field(default=[1, 32], min_length=1, description="Batch sizes timed in onnxruntime.")
    runs: int = Field(default=20, ge=1, description="Timed runs per batch size.")


def _registered_criterion(value: str) -> str:
    """``importance`` names a registered pruning criterion (``pruneflow.criteria``; ``criteria.py``)."""
    from .. import registry
    from ..errors import PruneflowError

    try:
        registry.criteria.get(value)
    except PruneflowError as exc:  # unknown (with the known names and a close match), or a plugin that fails to import
        raise ValueError(exc.message) from None
    return value


#: A pruning criterion's registered name: built in `magnitude`, `taylor`, `hessian`, `hessian+taylor`.
Importance = Annotated[str, AfterValidator(_registered_criterion)]


class _PruneBase(StageConfig):
    """What every granularity shares: the round schedule, importance sampling, fine-tuning and timing."""

    type: Literal["prune"] = Field(default="prune", description="Structured pruning with progressive rounds and KD fine-tuning.")
    granularity: str = Field(description="What a round removes.")
    target: Any = Field(description="What to reach.")
    rounds: int | Literal["auto"] = Field(
        default="auto", description="Prune-then-fine-tune rounds; `auto`: about 10 % of the units a round."
    )
    importance_batches: int | None = Field(default=None, ge=1, description="Training batches used to score importance each round.")
    importance_batch_size: int = Field(default=32, ge=1, description="Samples per importance batch.")
    finetune: FinetuneSettings | None = Field(
        default_factory=FinetuneSettings, description="Fine-tuning after each round (null = none)."
    )
    lr_decay: float = Field(default=0.7, gt=0, le=1, description="Fine-tune LR factor from one round to the next.")
    final_finetune: FinetuneSettings | None = Field(default=None, description="A longer fine-tune after the last round.")
    distill: DistillSpec | None = Field(
        default_factory=DistillSpec, description="KD from the teacher during fine-tuning (null = hard labels only)."
    )
    teacher: ModelSpec | None = Field(default=None, description="Teacher model; default: a frozen copy of the model entering the stage.")
    latency: PruneLatency | None = Field(
        default_factory=PruneLatency, description="Time the model in onnxruntime before and after (null = skip)."
    )


class _ScoredPruneBase(_PruneBase):
    """What channel and head pruning share: gradient-based importance on a few training batches."""

    importance: Importance = Field(
        default="hessian", description="What ranks the channels (or heads, FFN neurons and width channels), a registered "
        "pruning criterion: `magnitude` (weight magnitude; a unit's weight norms), `taylor` (first-order Taylor: |w·g|; "
        "|mean g| of a unit's mask), `hessian` (OBD, w²·Fisher; a unit's Fisher, mean g²), `hessian+taylor` (both mixed), "
        "or a plugin's (entry point `pruneflow.criteria`)."
    )
    importance_batches: int | None = Field(
        default=None, ge=1, description="Training batches used to score importance each round (default 4)."
    )
    hessian_weight: float = Field(default=0.5, ge=0, le=1, description="`hessian+taylor`: weight of the Hessian term.")


class ChannelPruneConfig(_ScoredPruneBase):
    """`granularity: channels` (the default): remove channels (width) on torch-pruning's dependency graph."""

    granularity: Literal["channels"] = Field(
        default="channels", description="`channels`: remove channels (width); coupled channels go together (squeeze-excite "
        "gates with the channels they scale). Attention modules and the embedding width they share are kept whole. The default."
    )
    target: PruneTarget = Field(description="What to reach: {ratio: 0.3} channels removed, {macs: 0.5} or {params: 0.5} kept.")
    rounds: int | Literal["auto"] = Field(
        default="auto", description="Prune-then-fine-tune rounds; `auto` removes about 10 % of channels a round."
    )
    allocation: Literal["global", "uniform"] = Field(
        default="global", description="`global` ranks channels across layers; `uniform` prunes every layer by the same ratio."
    )
    ranking: Literal["relative", "absolute", "per_mac"] = Field(
        default="relative", description="`global`: how channels of different layers compare. `relative` (torch-pruning's default): "
        "against their own group's mean score; `absolute`: summed scores as they are (hessian: OBD's loss estimate); "
        "`per_mac`: absolute score per MAC the channel costs, so the cheapest loss per MAC saved goes first."
    )
    max_layer_ratio: float = Field(default=0.9, gt=0, lt=1, description="At most this share of any layer's channels is removed.")
    round_to: int | None = Field(default=None, ge=1, description="Keep channel counts multiples of this (kernels run faster).")
    ignore: list[str] | None = Field(default=None, description="Module names or regexes kept intact; default: the classifier.")
    magnitude_p: Literal[1, 2] = Field(default=2, description="`magnitude`: L1 or L2.")
    fade: float | None = Field(
        default=None, gt=0, le=1, description="Fade each round's chosen channels to zero over this share of the round's fine-tune, "
        "then remove them (the removal changes no output), instead of removing them before it; null: remove at once."
    )

    @field_validator("max_layer_ratio", mode="after")
    @classmethod
    def _ratio_reachable(cls, value: float, info) -> float:
        """No layer loses more than max_layer_ratio of its channels, so neither can all of them together."""
        target = info.data.get("target")
        if target is not None and target.ratio is not None and target.ratio > value:
            raise ValueError(f"target ratio {target.ratio:g} cannot be reached when at most {value:g} of any layer's "
                             f"channels go: raise max_layer_ratio to {target.ratio:g} or more, or lower the ratio")
        return value


class BlockPruneConfig(_PruneBase):
    """`granularity: blocks`: remove whole residual blocks (depth), ranked by the measured loss increase of removing each."""

    granularity: Literal["blocks"] = Field(
        description="`blocks`: remove whole residual blocks (depth; post-activation `act(x + f(x))` and pre-norm "
        "`x + f(norm(x))`), ranked by the measured loss increase of removing each; `ratio` is then the share of blocks. "
        "On CPUs, blocks turn MACs into time one for one; channels keep the depth."
    )
    target: PruneTarget = Field(
        description="What to reach: {ratio: 0.5} of the blocks removed, {macs: 0.5} or {params: 0.5} kept."
    )
    rounds: int | Literal["auto"] = Field(
        default="auto", description="Prune-then-fine-tune rounds; `auto`: as many rounds as channels would take for the target."
    )
    importance_batches: int | None = Field(
        default=None, ge=1, description="Training batches a round ranks blocks on; default 32 (a block's score is one forward pass "
        "a batch, and fewer samples rank blocks by noise)."
    )
    ignore: list[str] | None = Field(default=None, description="Module names or regexes kept intact (their blocks are never removed).")


class HeadPruneConfig(_ScoredPruneBase):
    """`granularity: heads`: BERT-style transformers lose attention heads and FFN neurons, models with
    ``torch.nn.MultiheadAttention`` (a ViT) whole heads (the default for a heads/ffn/width target); `width` removes
    channels of the embedding width (the residual stream) with a table tied to the output projection."""

    granularity: Literal["heads"] = Field(
        default="heads", description="`heads`: remove attention heads and FFN neurons of a BERT-style transformer, or whole "
        "heads of torch.nn.MultiheadAttention modules, and with `width` channels of the embedding width (the residual "
        "stream, a tied output projection with it); the default when the target names heads, ffn or width."
    )
    target: UnitTarget = Field(description="What to remove: {heads: 0.5, ffn: 0.3, width: 0.25} (shares of the original counts).")
    rounds: int | Literal["auto"] = Field(
        default="auto", description="Prune-then-fine-tune rounds; `auto`: about 10 % of the heads (or FFN neurons, or width) a round."
    )


class TableTarget(StrictModel):
    """Embedding tables: the share of their rows to merge and/or of their stored columns to remove; the output
    projection over a catalogue: the share of its rows to merge."""

    rows: float | None = Field(default=None, gt=0, lt=1, description="Share of the tables' rows merged into one row per "
                               "table (the least read first; rows training never read always go).")
    dims: float | None = Field(default=None, gt=0, lt=1, description="Share of the tables' stored columns removed (a "
                               "weighted SVD per table; the model still reads the full width).")
    outputs: float | None = Field(default=None, gt=0, lt=1, description="Share of the output projection's rows (one per "
                                  "catalogue item or class) merged into one row: those no training label reaches always, "
                                  "then the least labelled. The output keeps its shape; the merged outputs share one score.")

    @model_validator(mode="before")
    @classmethod
    def _not_shares(cls, data: Any) -> Any:
        return _refuse(data, _SHARE_KEYS + _UNIT_KEYS, "tables take rows/dims/outputs targets (ratio, macs, params, heads, ffn and width "
                       "belong to the channels, blocks and heads granularities)")

    @model_validator(mode="after")
    def _some(self) -> "TableTarget":
        if self.rows is None and self.dims is None and self.outputs is None:
            raise ValueError("give rows, dims and/or outputs")
        return self


class TablePruneConfig(_PruneBase):
    """`granularity: tables`: embedding tables lose rows (merged into one row per table) and stored width."""

    granularity: Literal["tables"] = Field(
        default="tables", description="`tables`: embedding tables (nn.Embedding of at least `min_rows` rows) lose their least-read rows, merged "
        "into one row per table (its read-weighted mean; ids keep their values, an int32 index maps them), and stored "
        "columns by a read-weighted SVD (a projection restores the width the model reads). Rows are ranked by how often "
        "the training split reads them; rows it never reads always go. `outputs` merges the rows of the output projection "
        "over a catalogue that no training label reaches (then the least labelled) into one row. The MLP is left to a "
        "`channels` stage. The default when the target names rows, dims or outputs."
    )
    target: TableTarget = Field(description="What to remove: {rows: 0.6, dims: 0.5} (shares of the tables' rows and columns), "
                                "{outputs: 0.18} (share of the output projection's rows).")
    rounds: int | Literal["auto"] = Field(default="auto", description="Prune-then-fine-tune rounds; `auto`: one.")
    importance_batches: int | None = Field(
        default=None, ge=1, description="Rows are ranked by reads over this many batches of `importance_batch_size` "
        "training samples; default: the whole training split."
    )
    min_rows: int = Field(default=1000, ge=2, description="Tables with fewer rows are left whole (each row of a small "
                          "vocabulary is a category; factoring a small table adds bytes).")
    ignore: list[str] | None = Field(default=None, description="Table names or regexes left whole.")


def granularity(value: Any) -> str:
    """The variant a prune stage's mapping validates as: its ``granularity``, else ``tables`` for a rows/dims/outputs
    target, ``heads`` for a heads/ffn/width target (transformer recipes written before granularity had that value),
    else ``channels``.

    Named for the key it reads: pydantic's error for an unknown value names it (``granularity()``).
    """
    if not isinstance(value, dict):
        return getattr(value, "granularity", "channels")
    given = value.get("granularity")
    if given is not None:
        return given
    target = value.get("target")
    if isinstance(target, dict) and any(k in target for k in _TABLE_KEYS):
        return "tables"
    return "heads" if isinstance(target, dict) and any(k in target for k in _UNIT_KEYS) else "channels"


PruneConfig = Annotated[
    Union[Annotated[ChannelPruneConfig, Tag("channels")], Annotated[BlockPruneConfig, Tag("blocks")],
          Annotated[HeadPruneConfig, Tag("heads")], Annotated[TablePruneConfig, Tag("tables")]],
    Discriminator(granularity),
]
AnyPruneConfig = Union[ChannelPruneConfig, BlockPruneConfig, HeadPruneConfig, TablePruneConfig]
