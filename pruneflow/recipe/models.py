"""Pydantic models of the recipe format.

The stage list is a discriminated union over the registered stage types, built when first needed
(:func:`recipe_model`), so a plugin's stage validates exactly like a built-in one.
"""

from __future__ import annotations

import difflib
import functools
import math
from types import GenericAlias
from typing import TYPE_CHECKING, Annotated, Any, Literal, Protocol, Sequence, Union

from pydantic import BeforeValidator, Field, PrivateAttr, create_model, field_validator, model_validator

from .. import registry
from ..config import StageConfig, StrictModel, TaskConfig, usable_cpus
from .code import CodeTrust

NAME_PATTERN = r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$"
#: Longest run or stage name: it becomes a folder name (OUT/NAME, stages/NN-NAME), and file systems stop at 255 bytes.
NAME_MAX_LENGTH = 100
#: numpy's seeds (data splits, sampling) stop at 2**32 - 1.
SEED_MAX = 2**32 - 1
#: Most values one input sample may hold (2**27, 512 MiB of float32): a shape such as 10**9 would allocate
#: until the machine gives out (``model.input_shape``, ``inspect --input-shape``).
MAX_INPUT_ELEMENTS = 2**27


def input_shape_problem(shape: Sequence[int]) -> str | None:
    """Why ``shape`` (one sample, no batch dimension) cannot be a model input; None when it can."""
    if not shape:
        return "it is empty"
    if any(int(d) < 1 for d in shape):
        return f"every dimension must be at least 1 (got {list(shape)})"
    size = math.prod(int(d) for d in shape)
    if size > MAX_INPUT_ELEMENTS:
        return f"one sample would hold {size:,} values, more than the {MAX_INPUT_ELEMENTS:,} allowed"
    return None


def PathField(default: Any = None, *, description: str, **kwargs: Any) -> Any:
    """A recipe field holding a file path: resolved relative to the recipe file that set it."""
    return Field(default, description=description, json_schema_extra={"x-path": True}, **kwargs)


class ModelSpec(StrictModel):
    factory: str = Field(
        description="Builds the model: a zoo name (`digits_cnn`, `resnet20`, ...) or `path/to/file.py:function` "
        "(relative to the recipe, inside its folder tree); an installed package's `package.module:function`, or a file "
        "elsewhere, only when `trust.code` (or `--trust-code`) lists it.",
        json_schema_extra={"x-path": True},
        min_length=1,
    )
    kwargs: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments for the factory.")
    checkpoint: str | None = PathField(
        description="Weights to load: a state_dict in .pt/.pth/.th (loaded weights-only) or .safetensors. "
        "A nested `state_dict` key and `module.` prefixes are handled."
    )
    input_shape: list[int] | None = Field(
        default=None,
        description="Shape of one input sample without the batch dimension, e.g. [3, 32, 32]. "
        "Defaults to the zoo entry's shape, else to the data's.",
        min_length=1,
    )
    #: What code this spec's factory may run (``code.CodeTrust``), set by ``load_recipe``; None for a spec made in
    #: Python (the caller's own code), where only the standard library is refused.
    _code_trust: CodeTrust | None = PrivateAttr(default=None)

    @property
    def code_trust(self) -> CodeTrust | None:
        return self._code_trust

    def trusting(self, trust: CodeTrust | None) -> None:
        """Set what code this spec's factory may run (``load_recipe`` does, for every spec in a recipe)."""
        self._code_trust = trust

    @field_validator("input_shape")
    @classmethod
    def _input_shape(cls, shape: list[int] | None) -> list[int] | None:
        problem = input_shape_problem(shape) if shape is not None else None
        if problem:
            raise ValueError(f"{problem}; give one sample's shape without the batch dimension, e.g. [3, 32, 32]")
        return shape


class AugmentSpec(StrictModel):
    crop_padding: int = Field(default=0, ge=0, le=64, description="Random crop after zero-padding by this many pixels (0 = off).")
    hflip: bool = Field(default=False, description="Random horizontal flip with probability 0.5.")


class FeaturesSpec(StrictModel):
    """Tabular click data (``pruneflow/tabular.py``): the columns a ranker reads, and how they become its inputs."""

    categorical: list[str] = Field(
        default_factory=list,
        description="Columns of categorical values (ids, words): each becomes one int64 id of the `ids` input [B, F], "
        "looked up in a vocabulary built from the training split (id 0: a value outside it).")
    numeric: list[str] = Field(
        default_factory=list,
        description="Columns of numbers: each becomes one float of the `dense` input [B, D], standardised with the "
        "training split's mean and standard deviation (a missing value becomes the mean).")
    min_count: int = Field(default=1, ge=1, description="A categorical value enters its vocabulary when the training split "
                           "holds it at least this many times; rarer values share the out-of-vocabulary id 0.")
    log1p: list[str] = Field(default_factory=list, description="Numeric columns taken as sign(x)*log1p(|x|) before "
                             "standardising (heavy-tailed counts, amounts).")
    hash_buckets: dict[str, int] = Field(
        default_factory=dict,
        description="Categorical columns hashed into this many ids instead of a vocabulary (`{user_id: 1000000}`): an "
        "integer value modulo the count, text by 64-bit FNV-1a; for id spaces too large to list.")
    multi_hot: list[str] = Field(
        default_factory=list,
        description="Columns holding a list of categorical values a row (a user's recent categories, an item's tags): each "
        "becomes one bag of the `bags` input, int64 [B, N, bag_length], ids from its own vocabulary (1..), 0 padding the "
        "bag (and standing for a value outside the vocabulary, which then adds nothing): an `nn.EmbeddingBag` with "
        "`padding_idx=0` reads it (zoo `dlrm_bags`).")
    bag_length: int = Field(default=8, ge=1, le=4096, description="`multi_hot`: values kept a bag (the first ones; a "
                            "shorter list is padded with 0).")
    max_vocabulary: int | None = Field(default=None, ge=1, description="At most this many values a vocabulary (the most "
                                       "frequent, after `min_count`): a cap on a table's rows; the rest share id 0.")

    @model_validator(mode="after")
    def _columns(self) -> "FeaturesSpec":
        if not self.categorical and not self.numeric and not self.multi_hot:
            raise ValueError("name at least one column in `categorical`, `numeric` or `multi_hot`")
        named = self.categorical + self.numeric + self.multi_hot
        twice = sorted({c for c in named if named.count(c) > 1})
        if twice:
            raise ValueError(f"column(s) {twice} named more than once: each is categorical, numeric or multi_hot, once")
        for key, within, kind in (("log1p", self.numeric, "numeric"), ("hash_buckets", self.categorical, "categorical")):
            stray = [c for c in getattr(self, key) if c not in within]
            if stray:
                raise ValueError(f"`{key}` names {stray}, which are not among the {kind} columns {within}")
        small = {c: n for c, n in self.hash_buckets.items() if n < 2}
        if small:
            raise ValueError(f"hash_buckets {small}: a field needs at least 2 buckets")
        return self


class ClickLogSpec(StrictModel):
    """A generated click log (``pruneflow.clicklog``): made once into the user cache, then read as parquet."""

    rows: int = Field(default=1_000_000, ge=1_000, le=50_000_000, description="Impressions to generate.")
    users: int = Field(default=1_000_000, ge=1, le=50_000_000, description="Distinct user ids.")
    items: int = Field(default=100_000, ge=1, le=50_000_000, description="Distinct item ids.")
    seed: int = Field(default=0, ge=0, le=2**32 - 1, description="Generator seed (the log is deterministic).")
    eval_fraction: float = Field(default=0.1, gt=0, lt=1, description="The last share of the rows, held out for eval.")
    shards: int | None = Field(default=None, ge=1, le=10_000, description="Write the log as this many Parquet shards "
                               "(`train/part-*.parquet`, and a tenth as many under `eval/`), generated a shard at a time "
                               "in bounded memory, for `data.stream`; default: one train.parquet and one eval.parquet.")


class StreamSpec(StrictModel):
    """Streamed tabular data (``pruneflow/tabular_stream.py``): a file, folder or glob of Parquet or CSV shards read in
    record batches, never whole; memory bounded by the shuffle buffer and the samples below, not by the log's rows."""

    batch_rows: int = Field(default=65_536, ge=256, le=4_194_304, description="Rows a record batch read from a shard.")
    shuffle_buffer: int = Field(default=262_144, ge=256, le=67_108_864, description="Training rows held for shuffling: "
                                "each epoch reads the shards' row groups in a random order and shuffles rows within "
                                "this buffer (the memory an epoch takes grows with it, not with the log).")
    eval_rows: int = Field(default=200_000, ge=100, description="Evaluation rows held in memory: every eval row when "
                           "there are no more, else a uniform sample (reservoir, one pass); every rank evaluates the same.")
    sample_rows: int = Field(default=65_536, ge=100, description="Training rows sampled uniformly (reservoir, in the "
                             "counting pass) and held in memory for what reads training rows at random: calibration, "
                             "pruning importance, doctor.")
    vocabulary_file: str | None = PathField(description="A JSON file `{field: [values, most frequent first]}` giving "
                                            "vocabularies instead of counting them (fields it omits are counted).")


class SeqLogSpec(StrictModel):
    """A generated interaction log (``pruneflow.seqlog``): made once into the user cache, then read as parquet."""

    rows: int = Field(default=100_000, ge=1_000, le=10_000_000, description="Users (one row each: their last items and the next).")
    items: int = Field(default=20_000, ge=10, le=10_000_000, description="Catalogue size, counting the padding id 0.")
    topics: int = Field(default=100, ge=1, le=100_000, description="Item topics (popularity is Zipf within each).")
    length: int = Field(default=20, ge=2, le=1000, description="Items of history a row (`seq`), left-padded with 0.")
    seed: int = Field(default=0, ge=0, le=2**32 - 1, description="Generator seed (the log is deterministic).")
    eval_fraction: float = Field(default=0.1, gt=0, lt=1, description="The last share of the rows, held out for eval.")


class DataSpec(StrictModel):
    format: Literal["digits", "clicklog", "seqlog", "npz", "csv", "json", "parquet", "imagefolder", "disk"] = Field(
        description="Where samples come from: `digits` (scikit-learn's bundled 8x8 digits), `clicklog` (a generated "
        "click log, see `clicklog`), `seqlog` (a generated interaction log for sequential recommenders, see `seqlog`), "
        "`npz` (named numpy arrays), "
        "`csv`/`json`/`parquet` (one row a sample), `imagefolder` (class sub-folders), `disk` (a `datasets` save_to_disk folder)."
    )
    clicklog: ClickLogSpec | None = Field(
        default=None, description="`format: clicklog`: the log to generate (once, into ~/.cache/pruneflow/clicklog; "
        "columns user_id, item_id, category, device, hour, price, item_age_days, user_activity, clicked)."
    )
    seqlog: SeqLogSpec | None = Field(
        default=None, description="`format: seqlog`: the log to generate (once, into ~/.cache/pruneflow/seqlog; columns "
        "seq (int64 item ids, oldest first, 0 = padding), next_item, history)."
    )
    path: str | None = PathField(
        description="One source that is split into train and eval (seeded, stratified) by `eval_fraction`."
    )
    train: str | None = PathField(description="Training source, when train and eval come separately.")
    eval: str | None = PathField(description="Evaluation source, when train and eval come separately.")
    input_column: str | list[str] | dict[str, str] | None = Field(
        default=None,
        description="Column(s) holding the model input. Several columns (a list) are stacked into one feature vector (with a `tokenizer`: "
        "two text columns are a sentence pair, `[CLS] a [SEP] b [SEP]` with token type ids); "
        "a mapping `{forward parameter: column}` feeds a model with several inputs (e.g. `{image: pixels, meta: "
        "features}`), each named so in artifacts. "
        "Default: the first of image, images, pixel_values, input, inputs, x, features, sentence, text.",
    )
    label_column: str | dict[str, str] = Field(
        default="label", description="Column holding the label (`labels` and `y` are tried too); for `task: {type: multi}`, "
        "one column a head: `{click: clicked, finish: finished}`.")
    eval_fraction: float = Field(default=0.2, gt=0, lt=1, description="Share of `path` held out for evaluation.")
    layout: Literal["auto", "nchw", "nhwc"] = Field(
        default="auto", description="Image layout of array inputs; `auto` treats (N, H, W, C) with C in 1, 3, 4 as channels-last."
    )
    scale: float | Literal["auto"] = Field(
        default="auto", description="Inputs are multiplied by this; `auto` is 1/255 for uint8 data and 1 otherwise."
    )
    mean: list[float] | None = Field(default=None, description="Per-channel mean subtracted after scaling.")
    std: list[float] | None = Field(default=None, description="Per-channel standard deviation divided by after the mean.")
    augment: AugmentSpec = Field(default_factory=AugmentSpec, description="Training-time augmentation.")
    image_size: list[int] | None = Field(
        default=None, description="[height, width] to resize `imagefolder` images to.", min_length=2, max_length=2
    )
    tokenizer: str | None = PathField(
        description="Text data: a tokenizer folder (tokenizer.json or vocab.txt inside) or a WordPiece vocab.txt. "
        "The input column then holds text, tokenized to int64 `input_ids`, `attention_mask` (and `token_type_ids` where "
        "the tokenizer makes them), fed to forward by those names; each batch is padded (0) to its own longest row."
    )
    max_length: int = Field(default=64, ge=2, le=4096, description="Text data: at most this many tokens a sample (longer text is truncated).")
    max_train_samples: int | None = Field(default=None, gt=0, description="Use at most this many training samples (seeded, stratified).")
    max_eval_samples: int | None = Field(default=None, gt=0, description="Use at most this many evaluation samples (seeded, stratified).")
    eval_batch_size: int = Field(default=256, gt=0, description="Batch size for evaluation.")
    stream: StreamSpec | None = Field(
        default=None, description="Tabular data too large to hold: `train`/`eval` (a file, a folder or a glob of Parquet "
        "or CSV shards, or `format: clicklog` with `shards`) read in record batches each epoch; vocabularies and "
        "statistics in one counting pass; under `--nproc N` each rank reads its own row range. Needs `features`.")
    features: FeaturesSpec | None = Field(
        default=None,
        description="Tabular click data: `{categorical: [...], numeric: [...]}` columns fed to the model as `ids` "
        "(int64 [B, F], per-field vocabularies from the training split) and `dense` (float32 [B, D], standardised); "
        "the fitted vocabularies and statistics go into every artifact's deployment record.")

    @model_validator(mode="after")
    def _sources(self) -> "DataSpec":
        self._normalisation()
        self._tabular()
        if self.clicklog is not None and self.format != "clicklog":
            raise ValueError("`clicklog` settings go with `format: clicklog`")
        if self.stream is not None and (self.features is None or self.format not in ("parquet", "csv", "clicklog")
                                        or self.path is not None):
            raise ValueError("`stream` reads tabular shards: it needs `features`, `format: parquet`, `csv` or "
                             "`clicklog`, and `train`/`eval` (not `path`)")
        if self.seqlog is not None and self.format != "seqlog":
            raise ValueError("`seqlog` settings go with `format: seqlog`")
        if self.format in ("digits", "clicklog", "seqlog"):
            if self.path or self.train or self.eval:
                raise ValueError(f"the built-in `{self.format}` format takes no path, train or eval")
            return self
        if self.path and (self.train or self.eval):
            raise ValueError("give either `path` (split by eval_fraction) or `train`/`eval`, not both")
        if not self.path and not self.eval:
            raise ValueError(f"format {self.format!r} needs `path`, or `eval` (and usually `train`)")
        return self

    @field_validator("std")
    @classmethod
    def _std(cls, std: list[float] | None) -> list[float] | None:
        """For every format (the built-in digits too): a zero or non-finite std turns the inputs into inf/NaN."""
        if std is not None and any(not math.isfinite(s) or s <= 0 for s in std):
            raise ValueError(f"every std value must be a number > 0: inputs are divided by it (a 0 makes them "
                             f"infinite); use the data's per-channel standard deviation, e.g. {[0.25] * len(std)}")
        return std

    @field_validator("mean")
    @classmethod
    def _mean(cls, mean: list[float] | None) -> list[float] | None:
        if mean is not None and any(not math.isfinite(m) for m in mean):
            raise ValueError("every mean value must be a finite number (the data's per-channel mean)")
        return mean

    def _tabular(self) -> None:
        if self.features is None:
            return
        if self.format in ("digits", "imagefolder"):
            raise ValueError(f"`features` describes table columns; format {self.format!r} holds none (use csv, json, "
                             "parquet, npz or disk)")
        clash = [key for key in ("tokenizer", "input_column", "mean", "std") if getattr(self, key) is not None]
        if clash:
            raise ValueError(f"`features` builds the model's inputs itself; drop {', '.join(clash)}")
        labels = set(self.label_column.values()) if isinstance(self.label_column, dict) else {self.label_column}
        fed = labels & set(self.features.categorical + self.features.numeric + self.features.multi_hot)
        if fed:
            named = ", ".join(repr(c) for c in sorted(fed))
            raise ValueError(f"the label column {named} is also named in `features`: a model fed its own label learns nothing")

    def _normalisation(self) -> None:
        """For every format (the built-in digits too): mean and std come together, one of each per channel."""
        if (self.mean is None) != (self.std is None):
            raise ValueError("`mean` and `std` go together")
        if self.mean is not None and self.std is not None and len(self.mean) != len(self.std):
            raise ValueError(f"`mean` has {len(self.mean)} values and `std` {len(self.std)}: one of each per channel")


class TrustSpec(StrictModel):
    """Code the recipe may run beyond the zoo and its own files (``recipe/code.py``)."""

    code: list[str] = Field(
        default_factory=list,
        description="Callables outside the recipe's folder tree and the zoo that this recipe may run, each exactly as "
        "a factory names it: `package.module:function` (`torchvision.models:resnet18`) or `path/to/file.py:function` "
        "(relative to the recipe). A recipe names a model, not a program: without an entry here (or `--trust-code` "
        "on the command line) such a factory is refused before anything is imported. `validate` prints each "
        "callable the recipe runs. Python's standard library is refused whatever this says.",
        json_schema_extra={"x-code": True})


class GateSpec(StrictModel):
    metric: str = Field(
        description="Metric to check: `STAGE.METRIC` (e.g. `evaluate.accuracy`, the classification task's headline) or "
        "`TARGET.PRECISION.METRIC` (e.g. `onnx.fp32.accuracy`); `pruneflow optimize --json` lists what a run produced."
    )
    min: float | None = Field(default=None, description="Fail when the metric is below this.")
    max: float | None = Field(default=None, description="Fail when the metric is above this.")
    baseline: str | None = Field(default=None, description="Another metric to compare with (for `max_drop`).")
    max_drop: float | None = Field(
        default=None, ge=0,
        description="Fail when the metric is worse than `baseline` by more than this, in the metric's own direction: "
        "baseline - metric for a metric where higher is better (accuracy), metric - baseline where lower is better "
        "(a loss, an error; the task names each metric's direction).")
    max_drop_relative: float | None = Field(
        default=None, ge=0,
        description="Fail when the metric is worse than `baseline` by more than this fraction of the baseline's magnitude, in the "
        "metric's own direction: 0.02 lets a regressor's INT8 MSE be at most 2 % above the FP32 model's.")

    @model_validator(mode="after")
    def _bounds(self) -> "GateSpec":
        drops = self.max_drop is not None or self.max_drop_relative is not None
        if self.min is None and self.max is None and not drops:
            raise ValueError("a gate needs at least one of `min`, `max`, `max_drop`, `max_drop_relative`")
        if drops != (self.baseline is not None):
            raise ValueError("`baseline` goes with `max_drop` or `max_drop_relative`, and they need it")
        return self


class MetricSpec(StrictModel):
    """A metric of your own (``tasks/user.py``): a function of the outputs and the labels, with its direction."""

    fn: str = Field(
        description="`path/to/file.py:function` (relative to the recipe) or `package.module:function`: called with the "
        "split's outputs (as the task reads them) and labels, numpy arrays, it returns one number. Resolved as "
        "`model.factory` is, and checked at validate without running it.",
        json_schema_extra={"x-path": True}, min_length=1,
    )
    name: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_@]*$",
        description="Its name in metrics, gates and reports (`onnx.int8.NAME`). Default: the function's name.")
    higher_is_better: bool | None = Field(
        default=None,
        description="Its direction (what `max_drop` and sensitivity count as worse). Default: what the function declares "
        "with `@pruneflow.metric(higher_is_better=...)`; one of the two is required.")
    headline: bool = Field(
        default=False,
        description="Make it the run's headline metric: the headline table, `bench`, the default of `sensitivity.metric`.")

    @property
    def figure(self) -> str:
        """The name it is recorded under."""
        return self.name or self.fn.rpartition(":")[2]


def _cpu_name(value: Any) -> Any:
    """One entry of `deploy.cpu`, checked where it stands (the error points at its line)."""
    from .cpus import canonical, cpu_flags

    if isinstance(value, str):
        cpu_flags(value)
        return canonical(value)
    return value


CpuName = Annotated[str, BeforeValidator(_cpu_name)]


class DeploySpec(StrictModel):
    """Where the artifacts will be served (``export/deploy_hosts.py``): what the export chooses for the host is chosen
    for these, not for the machine that builds them."""

    cpu: list[CpuName] | None = Field(
        default=None,
        description="The CPUs the artifacts will be served on, each named by an instruction set the export's choices "
        "depend on: avx2, fma, avx512f, avx512_vnni, avx_vnni, avx512_bf16, amx_bf16, amx_int8, amx_tile (x86), asimd, "
        "sve (ARM); a name implies what every such CPU has (avx512_bf16: AVX-512 VNNI too); join several with + "
        "(avx2+avx_vnni). Every host-specific choice is made for all of them: an INT8 form that needs VNNI "
        "(u8s8_vnni, s8s8, fused) only when every one has VNNI or AMX (or is ARM), else the portable u8s8; OpenVINO's "
        "INT8 `int8_hint: auto` is f32 when none computes bf16. Left out (the default, CI included): the artifacts are "
        "built to be exact on every CPU. `pruneflow optimize --for avx2,avx512_vnni` sets it from the command line. "
        "report.md (table `served on`) and each file's deployment record (`hosts`) say which CPUs each artifact is for.")

    @field_validator("cpu", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        """`--for avx2,avx512_vnni` (one text) stands for the list."""
        return [v.strip() for v in value.split(",")] if isinstance(value, str) else value

    @field_validator("cpu", mode="after")
    @classmethod
    def _known(cls, value: list[str] | None) -> list[str] | None:
        from .cpus import normalise

        return normalise(value)


def _DEFAULT_TASK() -> Any:
    """The recipe's default ``task``, as written in a recipe (validated into the classification task's Config)."""
    return {"type": "classification"}


class RecipeBase(StrictModel):
    version: Literal[1] = Field(default=1, description="Recipe format version.")
    name: str = Field(description="Run name; the run directory is OUT/NAME.", pattern=NAME_PATTERN,
                      max_length=NAME_MAX_LENGTH)
    description: str = Field(default="", description="What the recipe is for.")
    extends: str | None = PathField(
        description="Another recipe this one builds on (relative path): mappings are deep-merged, lists replaced."
    )
    seed: int = Field(default=0, ge=0, le=SEED_MAX, description="Seed for data splits, initialisation and training.")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="`auto` uses CUDA when available.")
    threads: int | None = Field(default=None, gt=0, description="torch CPU threads (default: torch's own choice); at most "
                                "the CPUs this process may use (more were a segfault in torch, not a speed-up).")
    task: TaskConfig = Field(
        default_factory=_DEFAULT_TASK,  # validated into the task's Config
        description="What the model does, which sets its loss, metrics (each with its direction), label checks, parity and "
        "distillation: a registered task's name (`classification`), or `{type: NAME, ...}` with the task's options.",
    )
    model: ModelSpec = Field(description="The model to optimize.")
    data: DataSpec = Field(description="Training and evaluation data.")
    gates: list[GateSpec] = Field(default_factory=list, description="Quality gates; a failed one makes the exit code 1.")
    trust: TrustSpec = Field(default_factory=TrustSpec, description="Code this recipe may run beyond the zoo and the "
                             "files in its own folder tree: `{code: [\"package.module:function\", ...]}`.")
    metrics: list[MetricSpec] = Field(
        default_factory=list,
        description="Metrics of your own, judged beside the task's everywhere (gates, sensitivity, reports, `--json`, "
        "bench): `path/file.py:function` (declared with `@pruneflow.metric(higher_is_better=...)`) or "
        "`{fn: path/file.py:function, higher_is_better: true, name: f1, headline: false}`.")
    deploy: DeploySpec = Field(default_factory=DeploySpec, description="Where the artifacts will be served: the CPUs the "
                               "export chooses its host-specific forms for (`cpu`), instead of the machine that builds them.")

    @field_validator("threads")
    @classmethod
    def _threads_on_this_host(cls, value: int | None) -> int | None:
        """More torch threads than usable CPUs: `--set threads=100000` segfaulted (exit 139, no message)."""
        cpus = usable_cpus()
        if value is not None and value > cpus:
            raise ValueError(f"{value} threads, but this machine lets the process use {cpus} CPU(s); use {cpus} or fewer "
                             "(or leave `threads` out for torch's own choice)")
        return value

    @field_validator("metrics", mode="before")
    @classmethod
    def _metric_shorthand(cls, value: Any) -> Any:
        """`metrics: [file.py:fn]` stands for `[{fn: file.py:fn}]`."""
        return [{"fn": item} if isinstance(item, str) else item for item in value] if isinstance(value, list) else value

    @field_validator("task", mode="before")
    @classmethod
    def _task_name(cls, value: Any) -> Any:
        """`task: NAME` stands for `{type: NAME}`; the name must be a registered task's."""
        value = {"type": value} if isinstance(value, str) else value
        name = value.get("type") if isinstance(value, dict) else None
        if isinstance(name, str) and name not in registry.tasks.names():
            known = registry.tasks.names()
            close = difflib.get_close_matches(name, known, n=1)
            raise ValueError(f"unknown task {name!r}; {f'did you mean {close[0]!r}? ' if close else ''}known tasks: "
                             f"{', '.join(known)} (a task from another package is registered under the `pruneflow.tasks` "
                             "entry point group)")
        return value

    if TYPE_CHECKING:
        # The field itself is added by recipe_model(), typed as the union of the registered stage
        # configs (known only at run time); the type checker sees what every member of it is.
        stages: list[StageConfig]


def _union(configs: list[type], what: str) -> Any:
    if not configs:
        raise RuntimeError(f"no {what} registered: is pruneflow installed (pip install -e .)?")
    if len(configs) == 1:
        return configs[0]
    return Annotated[Union[tuple(configs)], Field(discriminator="type")]


def list_of(item: Any) -> Any:
    """``list[item]`` for an item annotation built at run time (written ``list[item]``, a type checker
    reads a type expression and refuses the variable); Any, as for ``_union``: pydantic takes any annotation."""
    return GenericAlias(list, (item,))


class _StageClass(Protocol):
    """What this module reads of a stage class (``stage.py`` imports this module's RecipeBase for its
    type hints, so ``Stage`` is described here rather than imported)."""

    @property
    def Config(self) -> type[StageConfig]: ...


def stage_config_model(stage_cls: _StageClass) -> Any:
    """What the recipe validates a stage's mapping as: its ``Config``, or what its ``config_model()``
    builds (prune: an annotated union of the granularity variants, a type form no static type names)."""
    factory = getattr(stage_cls, "config_model", None)
    return factory() if factory else stage_cls.Config


@functools.cache
def target_union() -> Any:
    return _union([cls.Config for cls in registry.targets.all().values()], "export targets")


@functools.cache
def task_union() -> Any:
    return _union([cls.Config for cls in registry.tasks.all().values()], "tasks")


@functools.cache
def recipe_model() -> type[RecipeBase]:
    """The Recipe model with the stage union over every registered stage, and the task union over every task."""
    stages = _union([stage_config_model(cls) for cls in registry.stages.all().values()], "stages")
    model = create_model(
        "Recipe",
        __base__=RecipeBase,
        stages=(list_of(stages), Field(min_length=1, description="Stages run in order on one model.")),
        task=(task_union(), Field(default_factory=_DEFAULT_TASK,
                                  description=RecipeBase.model_fields["task"].description)),
    )
    return model


def normalise_target_list(value: Any) -> Any:
    """`targets: [onnx, {type: openvino}]`: a bare name stands for `{type: name}`."""
    if isinstance(value, list):
        return [{"type": v} if isinstance(v, str) else v for v in value]
    return value


__all__ = [
    "AugmentSpec",
    "DataSpec",
    "DeploySpec",
    "GateSpec",
    "ModelSpec",
    "RecipeBase",
    "TrustSpec",
    "recipe_model",
    "target_union",
    "normalise_target_list",
]
