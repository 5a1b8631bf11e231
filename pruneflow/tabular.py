"""Tabular click data: categorical and numeric columns turned into a ranker's two inputs.

``data.features: {categorical: [...], numeric: [...]}`` makes a source's rows (csv, json, parquet, npz,
a ``save_to_disk`` folder) into

- ``ids``: int64 ``[B, F]``, one id per categorical field, looked up in that field's vocabulary: the values
  the *training* split holds at least ``min_count`` times, most frequent first, from id 1; id 0 is the
  out-of-vocabulary row (a value never seen in training, or too rare). A field in ``hash_buckets`` has no
  vocabulary: its id is ``hash(value) mod N`` (an integer value is its own hash; text is hashed with 64-bit
  FNV-1a over its UTF-8 bytes), the way id tables of 10^6 rows and more are kept.
- ``dense``: float32 ``[B, D]``, one value per numeric field: ``log1p`` first where asked (sign kept:
  ``sign(x) * log1p(|x|)``, for heavy-tailed counts), a missing value replaced by the training mean, then
  standardised with the training mean and standard deviation.
- ``bags``: int64 ``[B, N, bag_length]``, one bag per ``multi_hot`` field (a list of values a row: recent
  categories, tags): each value's id in the field's vocabulary (fitted over every value of every training list,
  from 1), the first ``bag_length`` kept, 0 padding the rest. A value outside the vocabulary is 0 too: it adds
  nothing to the bag, where a one-hot field's out-of-vocabulary id has a row of its own.

Everything fitted (vocabularies, buckets, means, deviations) is in :meth:`TabularSchema.record`, which goes
into the deployment record of every artifact (ONNX metadata, IR rt_info): a server rebuilds the inputs from
it alone. Written by hand: torchrec and NVTabular do this for their own pipelines, and neither is a
dependency here; pandas (under ``datasets``) does the counting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .errors import InputError
from .recipe.models import FeaturesSpec
from .tabular_arrow import Lookup, bag_ids, hashed_ids, list_values, numbers, standardised, text as arrow_text

#: The forward parameters (and artifact input names) of a tabular model.
IDS, DENSE, BAGS = "ids", "dense", "bags"
#: The id of a value outside a field's vocabulary.
OOV = 0
_FNV_OFFSET, _FNV_PRIME = 0xCBF29CE484222325, 0x100000001B3


@dataclass
class CategoricalField:
    name: str
    vocabulary: list[str] = field(default_factory=list)  # id i + 1 is vocabulary[i]
    buckets: int | None = None  # hashed: ids 0..buckets-1, no vocabulary
    train_values: int = 0  # distinct values in the training split (before min_count; a streamed hashed field: 0)
    _lookup: "Lookup | None" = field(default=None, init=False, repr=False, compare=False)

    @property
    def size(self) -> int:
        """The rows this field's table needs."""
        return self.buckets if self.buckets is not None else len(self.vocabulary) + 1

    def encode(self, values: np.ndarray) -> np.ndarray:
        if self.buckets is not None:
            return hashed(values, self.buckets) if isinstance(values, np.ndarray) else hashed_ids(values, self.buckets)
        return self.lookup(values)

    def lookup(self, values: Any) -> np.ndarray:
        """The vocabulary ids of a column, as one Arrow hash-table lookup (``tabular_arrow.Lookup``, built once)."""
        if self._lookup is None:
            self._lookup = Lookup(self.vocabulary)
        return self._lookup(values)


@dataclass
class NumericField:
    name: str
    mean: float
    std: float
    log1p: bool = False

    def encode(self, values: np.ndarray) -> np.ndarray:
        x = _numbers(values, self.name) if isinstance(values, np.ndarray) else numbers(values)
        return standardised(x, self.mean, self.std, self.log1p)


@dataclass
class MultiHotField:
    name: str
    vocabulary: list[str] = field(default_factory=list)  # id i + 1 is vocabulary[i]; 0 pads (and drops the unknown)
    train_values: int = 0
    _lookup: "Lookup | None" = field(default=None, init=False, repr=False, compare=False)

    @property
    def size(self) -> int:
        return len(self.vocabulary) + 1

    def encode(self, values: np.ndarray, length: int) -> np.ndarray:
        """``[rows, length]`` ids of each row's list (its first ``length`` values; 0 after)."""
        if not isinstance(values, (np.ndarray, list)):  # an Arrow column (a streamed batch)
            return bag_ids(values, self._bag_lookup(), length)
        arr = values if isinstance(values, np.ndarray) else np.asarray(values, dtype=object)
        if arr.ndim == 2 or arr.dtype.kind != "O":  # npz's 2-D arrays: read row by row (_lists), looked up at once
            rows = [items[:length] for items in _lists(values, self.name)]
            counts = np.array([len(r) for r in rows], dtype=np.int64)
            out = np.zeros((len(rows), length), dtype=np.int64)
            if counts.sum():
                pos = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
                flat = np.asarray([v for r in rows for v in r], dtype=object)
                out[np.repeat(np.arange(len(rows)), counts), pos] = self.lookup(flat)
            return out
        try:
            return bag_ids(arr, self._bag_lookup(), length)
        except TypeError:
            raise InputError(f"data.features.multi_hot: column {self.name!r} holds values that are not lists",
                             hint="store a list a row (parquet, json), a 2-D array (npz) or `a|b|c` text (csv)") from None

    def lookup(self, values: Any) -> np.ndarray:
        return self._bag_lookup()(values)

    def _bag_lookup(self) -> "Lookup":
        if self._lookup is None:
            self._lookup = Lookup(self.vocabulary)
        return self._lookup


@dataclass
class TabularSchema:
    categorical: list[CategoricalField]
    numeric: list[NumericField]
    min_count: int = 1
    multi_hot: list[MultiHotField] = field(default_factory=list)
    bag_length: int = 8

    @classmethod
    def fit(cls, columns: dict[str, np.ndarray], spec: FeaturesSpec, source: str) -> "TabularSchema":
        """Vocabularies and normalisation from the training split's columns (``source`` names it in errors)."""
        cats = []
        for name in spec.categorical:
            values = columns[name]
            if name in spec.hash_buckets:
                cats.append(CategoricalField(name, buckets=spec.hash_buckets[name], train_values=len(np.unique(_text(values)))))
                continue
            cats.append(_vocabulary(name, values, spec.min_count, spec.max_vocabulary))
        nums = []
        for name in spec.numeric:
            x = _numbers(columns[name], name, source)
            log = name in spec.log1p
            if log:
                x = np.sign(x) * np.log1p(np.abs(x))
            seen = x[~np.isnan(x)]
            if not len(seen):
                raise InputError(f"data.features.numeric: column {name!r} of {source} holds no numbers in the training split",
                                 hint="drop it from data.features.numeric")
            std = float(seen.std())
            nums.append(NumericField(name, float(seen.mean()), std if std > 0 else 1.0, log))
        bags = []
        for name in spec.multi_hot:
            vocabulary = _vocabulary(name, _flat_values(columns[name], name, source), spec.min_count, spec.max_vocabulary)
            bags.append(MultiHotField(name, vocabulary.vocabulary, vocabulary.train_values))
        return cls(cats, nums, spec.min_count, bags, spec.bag_length)

    @property
    def cardinalities(self) -> list[int]:
        return [f.size for f in self.categorical]

    def encode(self, columns: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        """The model inputs of rows given as columns: ``ids`` and/or ``dense``."""
        out: dict[str, torch.Tensor] = {}
        if self.categorical:
            out[IDS] = torch.from_numpy(np.stack([f.encode(columns[f.name]) for f in self.categorical], axis=1))
        if self.multi_hot:
            out[BAGS] = torch.from_numpy(np.stack([f.encode(columns[f.name], self.bag_length) for f in self.multi_hot], axis=1))
        if self.numeric:
            out[DENSE] = torch.from_numpy(np.stack([f.encode(columns[f.name]) for f in self.numeric], axis=1))
        return out

    def oov_rates(self, columns: dict[str, np.ndarray]) -> dict[str, float]:
        """Per vocabulary field, the share of these rows that fall on the out-of-vocabulary id."""
        return {f.name: float((f.encode(columns[f.name]) == OOV).mean()) for f in self.categorical if f.buckets is None}

    def record(self) -> dict[str, Any]:
        """How a server rebuilds the inputs (the deployment record's ``preprocessing``)."""
        return {
            "tabular": {
                IDS: [{"field": f.name, "vocabulary": f.vocabulary, "oov_id": OOV} if f.buckets is None
                      else {"field": f.name, "hash_buckets": f.buckets} for f in self.categorical],
                DENSE: [{"field": f.name, "log1p": f.log1p, "mean": f.mean, "std": f.std} for f in self.numeric],
                **({BAGS: [{"field": f.name, "vocabulary": f.vocabulary, "padding_id": 0, "bag_length": self.bag_length}
                           for f in self.multi_hot]} if self.multi_hot else {}),
            },
            "steps": f"{IDS}[:, i] = 1 + the value's index in field i's vocabulary (a value outside it: {OOV}); a hashed "
                     "field: int(value) mod hash_buckets for an integer, else 64-bit FNV-1a of its UTF-8 text mod "
                     f"hash_buckets. {DENSE}[:, j] = (x - mean) / std, x = sign(v) * log1p(|v|) where log1p, a missing "
                     "value taken as mean. Text values are compared with surrounding spaces removed."
                     + (f" {BAGS}[:, k, :] = 1 + each list value's index in bag field k's vocabulary, its first bag_length "
                        "values, 0 after them and for a value outside the vocabulary." if self.multi_hot else ""),
        }

    def describe(self) -> str:
        parts = []
        if self.categorical:
            rows = sum(self.cardinalities)
            parts.append(f"{len(self.categorical)} categorical field(s), {rows:,} table rows (min_count {self.min_count})")
        if self.numeric:
            parts.append(f"{len(self.numeric)} numeric")
        if self.multi_hot:
            parts.append(f"{len(self.multi_hot)} multi-hot bag(s) of {self.bag_length}, "
                         f"{sum(f.size for f in self.multi_hot):,} bag rows")
        return ", ".join(parts)


def _vocabulary(name: str, values: np.ndarray, min_count: int, cap: int | None = None) -> CategoricalField:
    import pandas as pd  # type: ignore[import-untyped]

    counts = pd.Series(_text(values)).value_counts(sort=False)
    return vocabulary_from_counts(name, counts.index.to_numpy(), counts.to_numpy(), min_count, cap)


def vocabulary_from_counts(name: str, values: np.ndarray, counts: np.ndarray, min_count: int,
                           cap: int | None = None) -> CategoricalField:
    """A field's vocabulary from its distinct training values and their counts: those seen ``min_count`` times or more,
    most frequent first, ties by value (the same training data always gives the same ids), the first ``cap`` kept."""
    import pandas as pd

    table = pd.DataFrame({"value": np.asarray(values, dtype=object).astype(str), "count": np.asarray(counts, np.int64)})
    kept = table[table["count"] >= min_count].sort_values(["count", "value"], ascending=[False, True], kind="stable")
    return CategoricalField(name, kept["value"].tolist()[:cap], train_values=len(table))


def _text(values: np.ndarray) -> np.ndarray:
    """A categorical column as stripped text (an integer 7 and the text "7" are the same value; missing is "")."""
    arr = np.asarray(values)
    if arr.dtype.kind in "iub":
        return arr.astype(np.int64).astype(str)
    if arr.dtype.kind == "f":
        whole = np.where(np.isnan(arr), 0, arr)
        text = np.where(whole == np.round(whole), np.round(whole).astype(np.int64).astype(str), arr.astype(str))
        return np.where(np.isnan(arr), "", text)
    return np.asarray(arrow_text(arr).to_numpy(zero_copy_only=False), dtype=object)


def _flat_values(values: np.ndarray, name: str, source: str) -> np.ndarray:
    """Every value of every row's list (a multi-hot column), as text: column operations where the column is lists or
    ``a|b`` text, ``_lists`` row by row for npz's 2-D arrays."""
    arr = values if isinstance(values, np.ndarray) else np.asarray(values, dtype=object)
    if arr.ndim == 1 and arr.dtype.kind == "O":
        try:
            return np.asarray(list_values(arr)[0].to_numpy(zero_copy_only=False), dtype=object)
        except (TypeError, ValueError):
            pass  # not lists: _lists names the column
    return np.asarray([v for items in _lists(arr, name, source) for v in items], dtype=object)


def _lists(values: np.ndarray, name: str, source: str = "the data") -> list[list[str]]:
    """A multi-hot column as lists of stripped text, one a row: from lists or arrays (parquet, json), a 2-D array
    (npz; a padding 0 is no value there when the column is integer), or text separated by ``|`` (csv)."""
    arr = values if isinstance(values, np.ndarray) else np.asarray(values, dtype=object)
    if arr.ndim == 2:
        return [[v for v, raw in zip(_text(row), row) if not (arr.dtype.kind in "iu" and raw == 0)] for row in arr]
    out: list[list[str]] = []
    for item in arr:
        if item is None or (isinstance(item, float) and np.isnan(item)):
            out.append([])
        elif isinstance(item, str):
            out.append([v.strip() for v in item.split("|") if v.strip()])
        elif hasattr(item, "__len__"):
            out.append([v for v in _text(np.asarray(item)) if v])
        else:
            raise InputError(f"data.features.multi_hot: column {name!r} of {source} holds {type(item).__name__} values, "
                             "not lists", hint="store a list a row (parquet, json), a 2-D array (npz) or `a|b|c` text (csv)")
    return out


def _numbers(values: np.ndarray, name: str, source: str = "the data") -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind in "iubf":
        return arr.astype(np.float64)
    try:
        return np.array([np.nan if v is None or str(v).strip() in ("", "?") else float(v) for v in arr], dtype=np.float64)
    except ValueError as exc:
        raise InputError(f"data.features.numeric: column {name!r} of {source} holds text ({exc})",
                         hint="move it to data.features.categorical") from exc


def hashed(values: np.ndarray, buckets: int) -> np.ndarray:
    """The hashed ids of a column (see the module docstring): integers modulo ``buckets``, text by FNV-1a 64, as column
    operations (``tabular_arrow.hashed_ids``)."""
    arr = np.asarray(values)
    if arr.dtype.kind in "iu":
        return np.mod(arr.astype(np.int64), buckets)
    return hashed_ids(arr, buckets)


def fnv1a(text: str) -> int:
    """FNV-1a-64 of one text, value by value: the definition ``tabular_arrow.fnv1a_64`` vectorises."""
    h = _FNV_OFFSET
    for byte in text.encode():
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFFFFFFFFFF
    return h
