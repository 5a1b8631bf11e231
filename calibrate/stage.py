"""`calibrate`: build the run's calibration set from the recipe's data or a separate local source."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from pruneflow.artifacts import Artifact
from pruneflow.errors import ConfigError, key_path
from pruneflow.recipe.models import PathField
from pruneflow.recipe.rules import has_train_split
from pruneflow.stage import Stage, StageConfig, StageResult, StrictModel

from .build import build_calibration_set, feature_layer, penultimate_features
from .consumers import save_set


class CalibSource(StrictModel):
    format: Literal["jsonl", "json", "csv", "parquet", "npz", "imagefolder", "disk"] = Field(
        description="How the source is stored (jsonl: one JSON object a line, e.g. inputs logged in production)."
    )
    path: str = PathField(description="The file or folder.")
    input_column: str | list[str] | None = Field(default=None, description="Column(s) holding the input (default: as for data).")
    label_column: str | None = Field(default=None, description="Column holding labels, if any (default: as for data).")


class CalibrateConfig(StageConfig):
    type: Literal["calibrate"] = Field(default="calibrate", description="Choose the calibration set every quantizer reads.")
    source: CalibSource | None = Field(default=None, description="A separate local source; default: the recipe's data (`split`).")
    split: Literal["train", "eval"] = Field(default="train", description="Which split of the recipe's data, when no source is given.")
    size: int = Field(default=512, ge=1, le=1_000_000, description="Samples in the set (all of them, with a warning, if fewer).")
    strategy: Literal["random", "stratified", "diverse"] = Field(
        default="diverse", description="`random`; `stratified` (proportional by `by`); `diverse` (greedy k-center in feature space)."
    )
    by: str = Field(default="label", description="`stratified`: the label, any column of the source, or `length` (tokenized text: "
                    "buckets of the token count, 1-8, 9-16, 17-32, ..., so short and long requests keep their shares).")
    features: Literal["auto", "inputs", "model"] = Field(
        default="auto", description="`diverse`: compare samples by the model's features (the input of its last Linear, else "
        "of its last convolution averaged over space) or by the raw inputs; `auto`: the model's where it has such a layer, "
        "else the inputs. The set's `features` says which was used."
    )
    dedupe: bool = Field(default=True, description="Drop samples whose content is identical to an earlier one.")
    seed: int | None = Field(default=None, ge=0, description="Sampling seed (default: the recipe's).")
    amct: bool = Field(default=False, description="Also write Ascend AMCT input (.bin files per input plus a list).")


class CalibrateStage(Stage[CalibrateConfig]):
    Config = CalibrateConfig

    @property
    def needs_train_split(self) -> bool:
        return self.config.source is None and self.config.split == "train"

    @classmethod
    def recipe_rules(cls, config, index, recipe):
        """Settings that the recipe's own data cannot serve, found before any data is read."""
        if config.source is not None:
            return
        if config.split == "train" and not has_train_split(recipe.data):
            yield ConfigError(("stages", index, "split"), "the recipe's data has no train split", value="train",
                              hint="use `split: eval`, give a separate `source`, or give the data a `path` or a `train` source")
        if config.strategy == "stratified" and config.by not in ("label", "length", recipe.data.label_column):
            yield ConfigError(("stages", index, "by"), "only the label can stratify the recipe's data", value=config.by,
                              hint="give a separate `source` to stratify by another column")

    def preflight(self, ctx) -> list[str]:
        """A separate source must exist: checked before a run starts, like the recipe's own data files."""
        source = self.config.source
        if source is not None and not Path(source.path).exists():
            raise ConfigError(self.loc("source", "path"), f"file not found: {source.path}",
                              hint="a relative path is relative to the recipe file that sets it")
        return []

    def _length_buckets(self, split) -> list[str]:
        from .sampling import length_buckets

        try:
            return list(length_buckets(split.x))
        except ValueError as exc:
            raise ConfigError(self.loc("by"), f"`length` stratifies tokenized text, and {exc}", value="length",
                              hint="use `by: label`, a column of the source, or strategy: diverse") from None

    def _folder(self, ctx):
        # `calibration/` for the usual single stage; a second calibrate stage gets its own folder.
        return ctx.run_dir / ("calibration" if self.id == "calibrate" else f"calibration-{self.id}")

    def restore(self, state, ctx) -> None:
        from .calibset import CalibrationSet

        state.calibration = CalibrationSet.load(self._folder(ctx))

    def run(self, state, ctx):
        cfg = self.config
        groups = None
        if cfg.source is not None:
            from pruneflow.data import load_inputs

            update = {k: v for k, v in (("input_column", cfg.source.input_column), ("label_column", cfg.source.label_column)) if v}
            spec = ctx.recipe.data.model_copy(update=update)
            split, ds = load_inputs(spec, cfg.source.format, cfg.source.path, key_path(self.loc("source", "path")),
                                    schema=state.data.tabular if state.data is not None else None)
            where = cfg.source.path
            if cfg.strategy == "stratified" and cfg.by not in ("label", "length", spec.label_column):
                if cfg.by not in ds.column_names:
                    raise ConfigError(self.loc("by"), f"the source has no such column; columns: {', '.join(ds.column_names)}",
                                      value=cfg.by)
                groups = [str(v) for v in ds[cfg.by]]
        else:  # stratifying the recipe's data by another column than the label: refused by recipe_rules
            split = state.data.train if cfg.split == "train" else state.data.eval
            if split is None:
                raise ConfigError(self.loc("split"), f"the recipe's data has no {cfg.split} split", value=cfg.split,
                                  hint="calibrate on the split the data has (split: train or eval), or on a file: source: {path: ...}")
            where = f"recipe data ({cfg.split} split)"
        if cfg.strategy == "stratified" and cfg.by == "length":  # token-count buckets, even where a column is named so
            groups = self._length_buckets(split)
        layer = feature_layer(state.model) if state.model is not None else None
        use_model = cfg.features == "model" or (cfg.features == "auto" and layer is not None)
        features = (lambda x: penultimate_features(state.model, x)) if use_model else None
        said = (layer[1] if layer is not None else "model") if use_model else (
            "inputs" + (" (the model has no Linear or convolution layer)" if cfg.features == "auto" and state.model is not None else ""))
        import numpy as np

        try:
            calib = build_calibration_set(
                split, size=cfg.size, strategy=cfg.strategy, seed=ctx.seed if cfg.seed is None else cfg.seed,
                groups=np.asarray(groups) if groups is not None else None, features=features, dedupe=cfg.dedupe,
                meta={"source": where, "by": cfg.by if cfg.strategy == "stratified" else None,
                      "features": said if cfg.strategy == "diverse" else None},
                warn=ctx.reporter.warning,
            )
        except ConfigError as exc:  # located at this stage's key (e.g. stages.1.by)
            raise exc.under(*self.loc()) from None
        folder = self._folder(ctx)
        info = save_set(calib, folder, amct=cfg.amct)
        state.calibration = calib
        artifacts = [Artifact.from_file(ctx.run_dir, folder / "calibration.json", kind="calibration", producer=self.id,
                                        metrics={"count": len(calib), "fingerprint": calib.fingerprint})]
        if cfg.amct:
            artifacts.append(Artifact.from_file(ctx.run_dir, folder / "amct" / "calibration_list.txt",
                                                kind="amct-calibration", producer=self.id))
        metrics = {"count": len(calib), "fingerprint": calib.fingerprint, "duplicates_removed": info["duplicates_removed"]}
        tables = {"histogram": [{"class": k, "count": v} for k, v in info.get("histogram", {}).items()]}
        if groups is not None and cfg.by == "length":
            tables["length_buckets"] = _bucket_table(groups, calib)
        return StageResult(metrics=metrics, artifacts=artifacts, tables=tables)


def _bucket_table(groups: list[str], calib) -> list[dict]:
    """Token-length buckets: samples of the source and of the set in each (stratified: proportional)."""
    from .sampling import LENGTH_EDGES, length_buckets

    chosen = list(length_buckets(calib.x))
    order = [f"{lo + 1}-{hi}" for lo, hi in zip((0, *LENGTH_EDGES[:-1]), LENGTH_EDGES)] + [f">{LENGTH_EDGES[-1]}"]
    return [{"tokens": b, "source": groups.count(b), "count": chosen.count(b)} for b in order if b in groups]
