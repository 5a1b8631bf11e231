"""Datasets: every source goes through Hugging Face `datasets`, then into tensors for training.

Sources: the built-in ``digits`` set (scikit-learn's bundled copy), npz (named arrays),
csv/json/parquet, imagefolder and ``save_to_disk`` folders. Nothing is fetched from a hub.
Normalisation is written in torch on whole batches (augmentation too: ``splits.apply_augment``): datasets'
own transforms run per sample in Python and would dominate CPU time.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import torch

from .errors import ConfigError, InputError, MissingDependencyError
from .inputs import first
from .preflight import check_finite_inputs
from .recipe.models import DataSpec

# Split and DataBundle are kernel records (splits.py, carried by RunState); re-exported where they were always found.
from .tabular import TabularSchema
from .splits import DataBundle as DataBundle, Split as Split, apply_augment as apply_augment
from .data_sources import EVAL_SPLIT_NAMES as EVAL_SPLIT_NAMES, load_source as _load_source
from .tasks import Classification, Task

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

INPUT_CANDIDATES = ("image", "images", "img", "pixel_values", "input", "inputs", "x", "features", "sentence", "text")
LABEL_FALLBACKS = ("labels", "y", "target")


# --------------------------------------------------------------------------- loading


def load_data(spec: DataSpec, seed: int = 0, with_train: bool = True, task: "Task | None" = None) -> DataBundle:
    """Load, split and preprocess the data a recipe describes.

    ``with_train=False`` skips reading a separate training source when no stage trains. ``task`` reads the
    label column (``Task.read_targets``: class ids, values...) and says whether splits are stratified by it;
    default: classification.
    """
    task = task or Classification()
    if spec.stream is not None:  # shards too large to hold: read in record batches (tabular_stream.py), no `datasets`
        from .tabular_stream import load_streamed

        return load_streamed(spec, seed, task, with_train)
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    train_ds, eval_ds, class_names, where = _sources(spec, seed, with_train or spec.features is not None, task)
    # a task whose targets are the reference model's outputs (embedding) needs no label column
    labelled = not task.targets_from_model or any(n in eval_ds.column_names for n in label_columns(spec) + LABEL_FALLBACKS)
    label = _label_column(eval_ds, spec) if labelled else ""
    if class_names is None:
        feature = eval_ds.features.get(label)
        class_names = list(feature.names) if hasattr(feature, "names") else None
    if spec.max_train_samples and train_ds is not None:
        train_ds = _subsample(train_ds, spec.max_train_samples, label, seed, task)
    if spec.max_eval_samples:
        eval_ds = _subsample(eval_ds, spec.max_eval_samples, label, seed, task)

    schema, train_columns = _fit_tabular(train_ds, spec, where) if spec.features is not None else (None, None)
    eval_split = _to_split(eval_ds, spec, "eval", require_label=labelled, task=task, schema=schema)
    train_split = _to_split(train_ds, spec, "train", require_label=labelled, task=task, schema=schema,
                            table=train_columns) if train_ds is not None and (with_train or not spec.train) else None
    pad_value = None
    if spec.mean is not None:
        pad_value = -torch.tensor(spec.mean) / torch.tensor(spec.std)
    return DataBundle(
        train=train_split,
        eval=eval_split,
        num_classes=_class_count(class_names, [eval_split] + ([train_split] if train_split is not None else [])),
        input_shape=tuple(first(eval_split.x).shape[1:]),
        class_names=class_names,
        augment=spec.augment,
        pad_value=pad_value,
        description=f"{spec.format}: {where}" + (f" ({schema.describe()})" if schema is not None else ""),
        tabular=schema,
    )


def _fit_tabular(train_ds, spec: DataSpec, where: str) -> tuple[TabularSchema, dict[str, np.ndarray]]:
    """The vocabularies and statistics of ``data.features``, from the training split only, and that split's
    columns they were fitted on (encoded from, not read again)."""
    if train_ds is None:
        raise InputError("data.features: the vocabularies and normalisation come from the training split, and this "
                         "data section has none", hint="give data.path (split by eval_fraction) or data.train beside data.eval")
    columns = _feature_columns(train_ds, spec, where)
    return TabularSchema.fit(columns, spec.features, where), columns  # type: ignore[arg-type]


def _feature_columns(ds, spec: DataSpec, where: str) -> dict[str, np.ndarray]:
    """The columns ``data.features`` names, as numpy arrays (text stays text)."""
    features = spec.features
    assert features is not None
    wanted = features.categorical + features.numeric + features.multi_hot
    missing = [c for c in wanted if c not in ds.column_names]
    if missing:
        import difflib

        near = {c: difflib.get_close_matches(c, ds.column_names, n=1) for c in missing}
        guesses = ", ".join(f"{c!r} -> {n[0]!r}?" for c, n in near.items() if n)
        raise InputError(f"data.features: no column {', '.join(map(repr, missing))} in {where}; its columns are "
                         f"{', '.join(ds.column_names)}", hint=f"did you mean {guesses}" if guesses else "fix the column names")
    table = ds.select_columns(wanted).to_pandas()
    return {c: table[c].to_numpy() for c in wanted}


def _sources(spec: DataSpec, seed: int, with_train: bool, task: Task):
    """The train and eval datasets a data section names (split by ``eval_fraction`` when it names one source),
    the class names they carry, and where they came from."""
    class_names = None
    if spec.format == "digits":
        ds, class_names = _digits()
        train_ds, eval_ds = _split(ds, spec, seed, task)
        where = "scikit-learn digits"
    elif spec.format == "clicklog":
        from .clicklog import cached
        from .recipe.models import ClickLogSpec

        log = spec.clicklog or ClickLogSpec()
        folder = cached(log)
        train_ds = _load_source("parquet", str(folder / "train.parquet"), "data.clicklog")[0] if with_train else None
        eval_ds = _load_source("parquet", str(folder / "eval.parquet"), "data.clicklog")[0]
        where = f"generated click log ({log.rows:,} rows, seed {log.seed}) in {folder}"
    elif spec.format == "seqlog":
        from .clicklog import cached
        from .recipe.models import SeqLogSpec
        from .seqlog import write_spec

        seqs = spec.seqlog or SeqLogSpec()
        folder = cached(seqs, "seqlog", write_spec)
        train_ds = _load_source("parquet", str(folder / "train.parquet"), "data.seqlog")[0] if with_train else None
        eval_ds = _load_source("parquet", str(folder / "eval.parquet"), "data.seqlog")[0]
        where = f"generated interaction log ({seqs.rows:,} rows, {seqs.items:,} items, seed {seqs.seed}) in {folder}"
    elif spec.path:
        loaded, class_names = _load_source(spec.format, spec.path, "data.path")
        for part in loaded if isinstance(loaded, tuple) else (loaded,):
            _check_finite(part, spec, spec.path)
        if isinstance(loaded, tuple):
            train_ds, eval_ds = loaded
        else:
            train_ds, eval_ds = _split(loaded, spec, seed, task)
        where = spec.path
    else:
        train_ds = None
        if spec.train and with_train:
            train_ds, class_names = _load_source(spec.format, spec.train, "data.train")
            _check_finite(train_ds, spec, spec.train)
        eval_ds, eval_names = _load_source(spec.format, spec.eval, "data.eval")  # type: ignore[arg-type]
        _check_finite(eval_ds, spec, spec.eval)  # type: ignore[arg-type]
        class_names = class_names or eval_names
        where = spec.eval or ""
    return train_ds, eval_ds, class_names, where


def _class_count(class_names: list[str] | None, splits: list[Split]) -> int:
    """The class names' count, else one more than the largest class id; 0 for a continuous target (no classes)."""
    if class_names:
        return len(class_names)
    if any(s.y.is_floating_point() for s in splits):
        return 0
    return int(max(int(s.y.max()) for s in splits)) + 1


def _digits():
    import datasets
    from sklearn.datasets import load_digits

    bunch = load_digits()
    names = [str(i) for i in range(10)]
    features = datasets.Features({"image": datasets.Array2D((8, 8), "float32"), "label": datasets.ClassLabel(names=names)})
    # The pixels are 0..16; scale to 0..1 here so `scale: auto` leaves them alone.
    images = (bunch.images / 16.0).astype(np.float32)
    return datasets.Dataset.from_dict({"image": images, "label": bunch.target}, features=features), names


def label_columns(spec: DataSpec) -> tuple[str, ...]:
    """Every label column the data section names (one a head for a multi-head task)."""
    return tuple(spec.label_column.values()) if isinstance(spec.label_column, dict) else (spec.label_column,)


def _targets(ds, spec: DataSpec, task: "Task") -> np.ndarray:
    """The task's reading of the label column, or of one column a head (``label_column: {head: column}``)."""
    if isinstance(spec.label_column, dict):
        for column in spec.label_column.values():
            _label_column(ds, spec.model_copy(update={"label_column": column}))  # names a missing one
        return task.read_targets({h: column_array(ds, c) for h, c in spec.label_column.items()}, spec.label_column)
    label = _label_column(ds, spec)
    return task.read_targets(column_array(ds, label), label)


def _label_column(ds, spec: DataSpec) -> str:
    if isinstance(spec.label_column, dict):  # several heads: the first stands for them where one is asked for
        return _label_column(ds, spec.model_copy(update={"label_column": next(iter(spec.label_column.values()))}))
    for name in (spec.label_column,) + LABEL_FALLBACKS:
        if name in ds.column_names:
            return name
    raise InputError(
        f"data.label_column: no column {spec.label_column!r} in the data; columns are {', '.join(ds.column_names)}",
        hint="set data.label_column to the column holding the class label",
    )


def _input_columns(ds, spec: DataSpec, label: str) -> list[str]:
    if spec.input_column:
        column = spec.input_column
        wanted = [column] if isinstance(column, str) else list(column.values() if isinstance(column, dict) else column)
        missing = [c for c in wanted if c not in ds.column_names]
        if missing:
            raise InputError(
                f"data.input_column: no column {', '.join(map(repr, missing))}; columns are {', '.join(ds.column_names)}",
                hint="set data.input_column to the column(s) holding the model input",
            )
        return wanted
    for name in INPUT_CANDIDATES:
        if name in ds.column_names:
            return [name]
    numeric = [c for c, f in ds.features.items() if c != label and c not in label_columns(spec) and getattr(f, "dtype", "") in _NUMERIC]
    if numeric:
        return numeric
    raise InputError(
        f"data: cannot tell which column is the input; columns are {', '.join(ds.column_names)}",
        hint="set data.input_column",
    )


def _text_rows(values: np.ndarray) -> list[int]:
    """Rows of a column read as text whose value is not a number (empty counts as not one)."""
    rows = []
    for i, value in enumerate(values.tolist()):
        try:
            float(value)
        except (TypeError, ValueError):
            rows.append(i)
    return rows


def _check_labels_present(ds, spec: DataSpec, source: str) -> None:
    """A label that is NaN or empty (a blank CSV cell): named by file, column and rows. It was reported as the column's
    dtype ("must hold integer class ids (found float32)"), which sent the reader looking for the wrong problem."""
    for column in [c for c in label_columns(spec) if c in ds.column_names]:
        values = column_array(ds, column)
        if values.dtype.kind == "f":
            missing = np.flatnonzero(np.isnan(values))
        elif values.dtype.kind in "OUS":
            missing = np.flatnonzero([v is None or (isinstance(v, str) and not v.strip()) for v in values.tolist()])
        else:
            continue
        if len(missing):
            rows = ", ".join(str(int(i)) for i in missing[:5]) + (", ..." if len(missing) > 5 else "")
            raise InputError(f"{source}: the label column {column!r} is empty or NaN in {len(missing)} of {len(values)} "
                             f"rows (rows {rows}; counted from 0, after the header)",
                             hint="fill in those labels or drop the rows; every sample needs its label")


def _check_text(ds, spec: DataSpec, source: str, label: str, columns: list[str]) -> None:
    """Columns of text where the model's inputs are numbers, in the source as read (rows as in the file): an input
    column, or, when the inputs are found by type, a column of numbers with some text in it (read as text, it was left
    out of the inputs silently)."""
    if spec.features is not None:
        return  # tabular features encode text themselves
    text = [c for c in ds.column_names if getattr(ds.features[c], "dtype", "") in ("string", "large_string")]
    candidates = [c for c in text if c in columns or (not spec.input_column and c != label and c not in label_columns(spec))]
    for column in candidates:
        values = column_array(ds, column)
        if column in columns or len(_text_rows(values)) <= len(values) // 2:
            _refuse_text(values, column, source)


def _refuse_text(values: np.ndarray, column: str, role: str) -> None:
    """A column of the model's inputs that holds text where numbers go: exit 2 naming the column and the rows (it was
    a traceback: ``could not convert string to float``), instead of a model fed a column it cannot read."""
    if values.dtype.kind not in "USO":
        return
    rows = _text_rows(values)
    if not rows:
        return
    shown = ", ".join(f"row {i}: {values.tolist()[i]!r}" for i in rows[:3])
    raise InputError(f"{role}: column {column!r} holds text where the model's inputs are numbers: {len(rows)} of "
                     f"{len(values)} rows ({shown}{', ...' if len(rows) > 3 else ''})",
                     hint="fix or drop those rows; a column of categories (words, ids) goes in data.features.categorical, "
                     "text to tokenize needs data.tokenizer; or leave the column out of data.input_column")


_NUMERIC = {"int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64", "bool"}


def _stratified(ds, label: str, task: "Task"):
    """``ds`` and the name of a ClassLabel column to stratify by: the label itself when it is one, else a
    ``__stratum__`` column of the task's reading of it (text labels of a binary task become 0/1 there)."""
    import datasets

    if isinstance(ds.features[label], datasets.ClassLabel):
        return ds, label
    raw = column_array(ds, label)
    values = task.read_targets(raw, label).astype(np.int64)
    column = datasets.ClassLabel(num_classes=int(values.max()) + 1)
    if raw.dtype.kind in "iu":  # integer class ids: the label itself becomes the ClassLabel (its names "0", "1", ...)
        return ds.cast_column(label, column), label
    return ds.add_column(STRATUM, values.tolist(), feature=column), STRATUM


#: The column ``_stratified`` adds (and the split drops again).
STRATUM = "__stratum__"


def _check_finite(ds, spec: DataSpec, source: str) -> None:
    """NaN or infinite inputs in a source, named by file, column and row (checked before any split or
    subsample reorders the rows). Images and text cannot hold them."""
    _check_labels_present(ds, spec, source)
    if spec.tokenizer:
        return
    label = next((n for n in label_columns(spec) + LABEL_FALLBACKS if n in ds.column_names), "")
    columns = _input_columns(ds, spec, label)
    _check_text(ds, spec, source, label, columns)
    for column in columns:
        feature = ds.features[column]
        dtype = getattr(feature, "dtype", None) or getattr(getattr(feature, "feature", None), "dtype", None)
        if isinstance(dtype, str) and dtype.startswith("float"):
            values = column_array(ds, column)
            if values.dtype != object:
                check_finite_inputs(values, source, [column])


def _split(ds, spec: DataSpec, seed: int, task: "Task"):
    n_eval = math.ceil(spec.eval_fraction * len(ds))  # how datasets' train_test_split rounds a fraction
    if n_eval >= len(ds):
        raise ConfigError(("data", "eval_fraction"),
                          f"{len(ds)} sample(s) split by eval_fraction {spec.eval_fraction} leave 0 for training "
                          f"({n_eval} for evaluation)", value=spec.eval_fraction,
                          hint="use more data (at least 2 samples), or give data.train and data.eval separately")
    if not task.stratify:
        parts = ds.train_test_split(test_size=spec.eval_fraction, seed=seed)
        return parts["train"], parts["test"]
    ds, stratum = _stratified(ds, _label_column(ds, spec), task)
    try:
        parts = ds.train_test_split(test_size=spec.eval_fraction, stratify_by_column=stratum, seed=seed)
    except ValueError:  # too few samples per class to stratify
        parts = ds.train_test_split(test_size=spec.eval_fraction, seed=seed)
    return _unstratified(parts["train"]), _unstratified(parts["test"])


def _unstratified(ds):
    return ds.remove_columns(STRATUM) if STRATUM in ds.column_names else ds


def _subsample(ds, n: int, label: str, seed: int, task: "Task"):
    if n >= len(ds):
        return ds
    if not task.stratify:
        return ds.shuffle(seed=seed).select(range(n))
    ds, stratum = _stratified(ds, label, task)
    try:
        return _unstratified(ds.train_test_split(train_size=n, stratify_by_column=stratum, seed=seed)["train"])
    except ValueError:
        return _unstratified(ds.shuffle(seed=seed).select(range(n)))


def load_inputs(spec: DataSpec, fmt: str, path: str, field_name: str, schema: TabularSchema | None = None):
    """Read one more source (e.g. inputs logged in production) with the recipe's preprocessing.

    Labels are optional: ``Split.y`` is -1 where the source has no label column. Returns the split
    and the underlying ``datasets.Dataset`` (for other columns, e.g. to stratify by). ``schema``: the run's
    tabular vocabularies and statistics (``DataBundle.tabular``), applied unchanged. With ``data.stream`` a Parquet or
    CSV source (a file, folder or glob of shards) is sampled in one pass instead (``tabular_stream.sample_source``).
    """
    if spec.stream is not None and schema is not None and fmt in ("parquet", "csv"):
        from .tabular_stream import sample_source

        return sample_source(spec, fmt, path, field_name, schema)
    import datasets

    datasets.disable_progress_bars()
    loaded, _ = _load_source("json" if fmt == "jsonl" else fmt, path, field_name)
    ds = datasets.concatenate_datasets(list(loaded)) if isinstance(loaded, tuple) else loaded
    _check_finite(ds, spec, path)
    return _to_split(ds, spec, field_name, require_label=False, schema=schema), ds


def _to_split(ds, spec: DataSpec, role: str, require_label: bool = True, task: "Task | None" = None,
              schema: TabularSchema | None = None, table: dict[str, np.ndarray] | None = None) -> Split:
    import datasets

    if require_label or any(n in ds.column_names for n in label_columns(spec) + LABEL_FALLBACKS):
        label = _label_column(ds, spec)
        y = _targets(ds, spec, task or Classification())
    else:
        label, y = "", np.full(len(ds), -1, dtype=np.int64)
    if spec.tokenizer:
        return Split(_tokenize(ds, _input_columns(ds, spec, label), spec), torch.from_numpy(y))
    if spec.features is not None and schema is None:  # pragma: no cover - every caller passes the run's schema
        raise InputError(f"{role}: tabular data needs the vocabularies fitted on the recipe's training split",
                         hint="pass schema=, the run's fitted schema (load_data returns it as data.tabular)")
    if schema is not None:
        if not len(ds):
            raise InputError(f"data: the {role} split is empty", hint="use more data or a smaller eval_fraction")
        return Split(schema.encode(table if table is not None else _feature_columns(ds, spec, role)), torch.from_numpy(y))
    columns = _input_columns(ds, spec, label)
    if isinstance(spec.input_column, dict):
        return Split(_named_inputs(ds, spec, role), torch.from_numpy(y))
    layout = spec.layout
    if len(columns) == 1 and isinstance(ds.features[columns[0]], datasets.Image):
        x, layout = _images(ds[columns[0]], spec), "nhwc"  # decoded images are always (N, H, W, C)
    else:
        # datasets' numpy formatter widens integers to int64: cast back to the stored dtype, so that
        # `scale: auto` still recognises uint8 pixels.
        arrays = [_stored_dtype(column_array(ds, c), ds.features[c]) for c in columns]
        if any(a.dtype == object for a in arrays):
            raise InputError(f"data: column(s) {columns} hold values of different shapes or non-numbers", hint="use equal-sized arrays")
        x = arrays[0] if len(arrays) == 1 else np.stack([a.astype(np.float32) for a in arrays], axis=1)
        if x.ndim == 1:
            x = x[:, None]  # one scalar feature a sample: (N,) -> (N, 1), so input_shape is (1,), not ()
    if len(y) == 0:
        raise InputError(f"data: the {role} split is empty", hint="use more data or a smaller eval_fraction")
    if len(columns) == 1 and is_ids(x):  # item ids, token ids: int64 to the model, never scaled or cast to float
        return Split(torch.from_numpy(np.ascontiguousarray(x).astype(np.int64)), torch.from_numpy(y))
    return Split(_preprocess(x, spec, layout), torch.from_numpy(y))


def is_ids(arr: np.ndarray) -> bool:
    """An integer column of at most two dimensions (ids, id sequences, lengths): it reaches the model as int64.
    uint8 is pixels, scaled to floats; an integer feature a float model reads belongs in ``data.features.numeric``."""
    return np.issubdtype(arr.dtype, np.integer) and arr.ndim <= 2 and arr.dtype != np.uint8


_TOKENIZERS: dict[str, object] = {}


def load_tokenizer(path: str):
    """A fast tokenizer from a folder, or a BERT WordPiece tokenizer from a vocab.txt (no hub access)."""
    if path in _TOKENIZERS:
        return _TOKENIZERS[path]
    try:
        import transformers
    except ImportError as exc:
        raise MissingDependencyError("text data needs the `transformers` package", hint="pip install 'pruneflow[transformers]'") from exc
    p = Path(path)
    if not p.exists():
        raise InputError(f"data.tokenizer: not found: {p}", hint="point at a tokenizer folder or a vocab.txt")
    try:
        if p.is_file():
            # transformers 5.x: `vocab=` (the older `vocab_file=` is silently ignored there). BertTokenizerFast
            # is the name 4.x and 5.x share; 5.x keeps it as an alias outside its modules' __all__, so its typed
            # exports lack it although `transformers.BertTokenizerFast` resolves at run time.
            tok = transformers.BertTokenizerFast(vocab=str(p), do_lower_case=True)  # type: ignore[attr-defined]
        else:
            tok = transformers.AutoTokenizer.from_pretrained(str(p), local_files_only=True, trust_remote_code=False)
    except Exception as exc:  # noqa: BLE001 - transformers raises many types for unreadable folders
        raise InputError(f"data.tokenizer: could not load a tokenizer from {p}: {type(exc).__name__}: {exc}",
                         hint="point at a folder a tokenizer was saved to (save_pretrained: tokenizer.json or vocab.txt "
                         "with its config) or at a BERT vocab.txt file; nothing is downloaded") from exc
    if len(tok) < 10:
        raise InputError(f"data.tokenizer: {p} gave a tokenizer of only {len(tok)} tokens", hint="check the vocab file")
    _TOKENIZERS[path] = tok
    return tok


#: What the tokenizer step keeps, in this order (a model takes those its forward names: ``inputs.bind``).
TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def _tokenize(ds, columns: list[str], spec: DataSpec) -> dict[str, torch.Tensor]:
    """Token ids, attention mask and (where the tokenizer makes them) token type ids, int64, padded to the
    split's longest row only: batches are cut further to their own longest row (``inputs.trim``)."""
    if len(columns) > 2:  # a tokenizer takes a text or a pair; a third list would be read as its `labels` and dropped
        raise InputError(f"data.input_column: {len(columns)} text columns ({', '.join(columns)}); a tokenizer takes one text "
                         "column or a pair of them", hint="name one column, or two for sentence pairs (joined by [SEP])")
    tok = load_tokenizer(spec.tokenizer)  # type: ignore[arg-type]
    texts = [list(ds[c]) for c in columns]
    if any(not isinstance(t, str) for t in texts[0][:5]):
        raise InputError(f"data.input_column: {columns[0]!r} does not hold text", hint="name the text column in data.input_column")
    enc = tok(*texts, padding="longest", truncation=True, max_length=spec.max_length, return_tensors="np")
    return {k: torch.from_numpy(np.asarray(enc[k]).astype(np.int64)) for k in TOKEN_INPUTS if k in enc}


def _named_inputs(ds, spec: DataSpec, role: str) -> dict[str, torch.Tensor]:
    """``input_column: {parameter: column}``: one tensor a forward parameter. Integer columns of at most two
    dimensions (ids, lengths) stay int64; others get the recipe's scale, and mean/std where they are images."""
    out = {}
    for name, column in spec.input_column.items():  # type: ignore[union-attr]
        arr = _stored_dtype(column_array(ds, column), ds.features[column])
        if arr.dtype == object:
            raise InputError(f"data.input_column.{name}: column {column!r} holds values of different shapes or non-numbers",
                             hint="use equal-sized arrays")
        if is_ids(arr):
            out[name] = torch.from_numpy(arr.astype(np.int64))
            continue
        arr = arr[:, None] if arr.ndim == 1 else arr
        image = arr.ndim >= 3
        out[name] = _preprocess(arr, spec if image else spec.model_copy(update={"mean": None, "std": None}))
    if not len(ds):
        raise InputError(f"data: the {role} split is empty", hint="use more data or a smaller eval_fraction")
    return out


def column_array(ds, name: str) -> np.ndarray:
    """One whole column of a ``datasets.Dataset`` as a numpy array, read as one batch.

    ``np.asarray(ds.with_format("numpy")[name])`` looks the same, but datasets 4 returns a lazy ``Column`` there,
    which numpy reads row by row: 7.5 s for 100,000 int64 labels against 0.06 s here (a 900,000-row click log
    spent minutes on its label column before this)."""
    return np.asarray(ds.select_columns([name]).with_format("numpy")[:][name])


def _stored_dtype(arr: np.ndarray, feature) -> np.ndarray:
    dtype = getattr(feature, "dtype", None)
    if dtype is None and hasattr(feature, "feature"):  # List(Value(...))
        dtype = getattr(feature.feature, "dtype", None)
    if dtype in _NUMERIC and arr.dtype != object and arr.dtype != np.dtype(dtype):
        return arr.astype(dtype)
    return arr


def _images(column, spec: DataSpec) -> np.ndarray:
    out = []
    for img in column:
        img = img.convert("RGB")
        if spec.image_size:
            img = img.resize((spec.image_size[1], spec.image_size[0]))
        out.append(np.asarray(img))
    shapes = {a.shape for a in out}
    if len(shapes) > 1:
        raise InputError(f"data: images have different sizes {sorted(shapes)[:3]}", hint="set data.image_size: [H, W]")
    return np.stack(out)


def _preprocess(x: np.ndarray, spec: DataSpec, layout: str | None = None) -> torch.Tensor:
    layout = layout or spec.layout
    scale = (1 / 255 if x.dtype == np.uint8 else 1.0) if spec.scale == "auto" else float(spec.scale)
    t = torch.from_numpy(np.ascontiguousarray(x)).float() * scale
    if t.dim() == 4 and (layout == "nhwc" or (layout == "auto" and t.shape[-1] in (1, 3, 4) and t.shape[1] not in (1, 3, 4))):
        t = t.permute(0, 3, 1, 2)
    elif t.dim() == 3:
        t = t.unsqueeze(1)  # (N, H, W) grayscale → (N, 1, H, W)
    if spec.mean is not None:
        c = t.shape[1]
        if len(spec.mean) != c:
            raise InputError(f"data.mean has {len(spec.mean)} values but the inputs have {c} channels",
                             hint=f"give data.mean and data.std {c} values each, one per channel")
        shape = (1, c) + (1,) * (t.dim() - 2)
        t = (t - torch.tensor(spec.mean).view(shape)) / torch.tensor(spec.std).view(shape)
    return t.contiguous()
