"""A click log too large to hold, streamed: ``data.stream`` with ``data.features``.

    data:
      format: parquet                       # or csv; or clicklog with clicklog.shards
      train: logs/2026-12-04/train/         # a file, a folder or a glob of shards
      eval: logs/2026-12-04/eval/*.parquet
      stream: {shuffle_buffer: 262144, eval_rows: 200000}
      features: {categorical: [...], numeric: [...], hash_buckets: {user_id: 1000000}}

What ``load_streamed`` does, in order, before any stage runs (``tabular_shards`` reads the files):

1. every shard's footer is checked (columns, types, rows; a bad shard is exit 2 naming the file and the column);
2. one counting pass over the training rows (this rank's row range under ``--nproc``; the ranks' counts are then
   summed): each record batch's vocabulary counts (``pc.value_counts``), numeric moments (merged with Chan's
   formula), labels read by the task, and a uniform sample of ``sample_rows`` rows (reservoir: the rows with the
   smallest keys, a key being a hash of the row's place, so one pass and bounded memory, and the same sample
   whichever rank read it); hashed fields are not counted (no vocabulary: their ``train_values`` is 0);
3. the eval shards read once the same way: every row when there are at most ``eval_rows``, else a uniform sample
   of that many; every rank holds the same eval rows, so evaluation is *sampled* (not distributed) and agrees
   across ranks;
4. training epochs then read the shards again (``StreamedTrain``): the row groups in a random order, rows shuffled
   within a buffer of ``shuffle_buffer`` rows, encoded batch by batch with column ops; under ``--nproc N`` rank r
   reads rows ``r*R/N .. (r+1)*R/N`` only (logged), padded by a repeated row or two so every rank takes as many steps.

``DataBundle.train`` holds the training sample (calibration, pruning importance and doctor read it: *sampled*, and
said in the data description); ``DataBundle.stream`` the whole split.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generator, Iterator

import numpy as np
import torch

from . import distributed
from .errors import InputError
from .recipe.models import DataSpec, StreamSpec
from .splits import DataBundle, Split, TrainStream
from .tabular import CategoricalField, MultiHotField, NumericField, TabularSchema, vocabulary_from_counts
from .tabular_arrow import list_values, numbers, text
from .tabular_shards import (CATEGORICAL, LABEL, MULTI_HOT, NUMERIC, Shard, count_csv_rows, csv_options, inspect,
                             pieces, read, row_keys, shard_files)

if TYPE_CHECKING:
    import pyarrow as pa

    from .tasks import Task

log = logging.getLogger("pruneflow.data")


@dataclass
class Source:
    """One split's shards and how to read them."""

    shards: list[Shard]
    field: str
    roles: dict[str, str]
    options: Any  # CSV read/convert options (None for Parquet)
    batch_rows: int

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.shards)

    def batches(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[int, int, "pa.RecordBatch"]]:
        """(shard number, first row within the shard, batch) over rows ``start:stop`` of the split, in order."""
        for piece in pieces(self.shards, start, self.rows if stop is None else stop):
            first = piece.start
            for batch in read(self.shards[piece.index], piece, list(self.roles), self.batch_rows, self.field, self.options):
                yield piece.index, first, batch
                first += batch.num_rows


def open_source(path: str, spec: DataSpec, field: str, fmt: str | None = None, labels: bool = True) -> Source:
    """The shards ``path`` names, checked (``tabular_shards.inspect``); CSV shards counted. ``labels=False``: a
    source that may lack the label column (logged inputs to calibrate on); it is read when there."""
    features = spec.features
    assert features is not None and spec.stream is not None
    roles = {c: CATEGORICAL for c in features.categorical} | {c: NUMERIC for c in features.numeric}
    roles |= {c: MULTI_HOT for c in features.multi_hot}
    fmt = fmt or ("parquet" if spec.format == "clicklog" else spec.format)
    if labels or all(_has_column(f, fmt, c) for f in shard_files(path, fmt, field)[:1] for c in _labels(spec)):
        roles |= {c: LABEL for c in _labels(spec)}
    options = csv_options(roles) if fmt == "csv" else None
    shards = inspect(shard_files(path, fmt, field), fmt, roles, field, options, list(features.hash_buckets))
    if fmt == "csv":
        shards = [count_csv_rows(s, spec.stream.batch_rows, field, options) for s in shards]
    return Source(shards, field, roles, options, spec.stream.batch_rows)


def _has_column(f: Any, fmt: str, column: str) -> bool:
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    try:
        names = pq.read_schema(f).names if fmt == "parquet" else pcsv.open_csv(f).schema.names
    except Exception:  # noqa: BLE001 - inspect() names what is wrong with the file
        return True
    return column in names


def sample_source(spec: DataSpec, fmt: str, path: str, field: str, schema: TabularSchema, seed: int = 0) -> tuple[Split, Any]:
    """A uniform sample of ``stream.sample_rows`` rows of a file, folder or glob of shards (inputs logged in
    production, to calibrate on), drawn in one pass with bounded memory (the reservoir of the counting pass), encoded
    with the run's ``schema``; targets are class ids where the label column is there, else -1. Returns the split and
    the sampled rows as a ``datasets.Dataset`` (other columns: what `calibrate --by` stratifies on)."""
    import datasets

    from .tasks import Classification

    stream = spec.stream
    assert stream is not None
    source = open_source(path, spec, field, fmt, labels=False)
    keep = _Reservoir(stream.sample_rows)
    for index, first, batch in source.batches():
        keep.add(batch, row_keys(seed, index, first, batch.num_rows))
    table, _ = keep.rows()
    assert table is not None
    x = schema.encode({c: table.column(c) for c in table.column_names})
    label = _labels(spec)[0]
    y = (torch.from_numpy(np.asarray(Classification().read_targets(table.column(label).to_numpy(zero_copy_only=False), label)))
         if label in table.column_names else torch.full((len(table),), -1, dtype=torch.long))
    log.info("%s: a uniform sample of %d of %d rows of %d shard(s)", field, len(table), source.rows, len(source.shards))
    return Split(x, y), datasets.Dataset(table)


def _labels(spec: DataSpec) -> list[str]:
    return list(spec.label_column.values()) if isinstance(spec.label_column, dict) else [spec.label_column]


# --------------------------------------------------------------------------- the counting pass


class _Counts:
    """Distinct values and their counts of one field, merged batch by batch (Arrow's hash aggregation)."""

    def __init__(self) -> None:
        self.parts: list[tuple[np.ndarray, np.ndarray]] = []
        self.pending = 0

    def add(self, values: "pa.Array") -> None:
        import pyarrow.compute as pc

        counted = pc.value_counts(values)
        self.parts.append((counted.field("values").to_numpy(zero_copy_only=False),
                           counted.field("counts").to_numpy(zero_copy_only=False)))
        self.pending += len(counted)
        if len(self.parts) > 16:
            self.parts = [self.merged()]

    def merged(self) -> tuple[np.ndarray, np.ndarray]:
        import pandas as pd  # type: ignore[import-untyped]

        if not self.parts:
            return np.zeros(0, dtype=object), np.zeros(0, dtype=np.int64)
        values = np.concatenate([np.asarray(v, dtype=object) for v, _ in self.parts])
        counts = np.concatenate([c for _, c in self.parts]).astype(np.int64)
        summed = pd.Series(counts).groupby(values, sort=False).sum()
        return summed.index.to_numpy(dtype=object), summed.to_numpy(dtype=np.int64)


class _Moments:
    """Count, mean and sum of squared deviations of a numeric field, merged batch by batch (Chan et al.)."""

    def __init__(self, log1p: bool):
        self.log1p, self.n, self.mean, self.m2 = log1p, 0, 0.0, 0.0

    def add(self, x: np.ndarray) -> None:
        if self.log1p:
            x = np.sign(x) * np.log1p(np.abs(x))
        x = x[~np.isnan(x)]
        if not len(x):
            return
        self.merge(len(x), float(x.mean()), float(((x - x.mean()) ** 2).sum()))

    def merge(self, n: int, mean: float, m2: float) -> None:
        total = self.n + n
        delta = mean - self.mean
        self.mean += delta * n / total
        self.m2 += m2 + delta * delta * self.n * n / total
        self.n = total


class _Reservoir:
    """The ``size`` rows with the smallest keys seen so far: a uniform sample without replacement, in one pass."""

    def __init__(self, size: int):
        self.size, self.held = size, 0
        self.tables: list[Any] = []
        self.keys: list[np.ndarray] = []
        self.cut = math.inf

    def add(self, batch: "pa.RecordBatch", keys: np.ndarray) -> None:
        import pyarrow as pa

        keep = np.nonzero(keys < self.cut)[0]
        if not len(keep):
            return
        self.tables.append(pa.Table.from_batches([batch]).take(pa.array(keep)))
        self.keys.append(keys[keep])
        self.held += len(keep)
        if self.held > 2 * self.size:
            self._shrink()

    def _shrink(self) -> None:
        import pyarrow as pa

        table, keys = pa.concat_tables(self.tables), np.concatenate(self.keys)
        if len(keys) > self.size:
            best = np.argpartition(keys, self.size - 1)[: self.size]
            table, keys = table.take(pa.array(best)), keys[best]
            self.cut = float(keys.max())
        self.tables, self.keys, self.held = [table], [keys], len(keys)

    def rows(self) -> tuple["pa.Table | None", np.ndarray]:
        """The sample, in key order (the same order whatever read it)."""
        import pyarrow as pa

        if not self.tables:
            return None, np.zeros(0)
        self._shrink()
        order = np.argsort(self.keys[0], kind="stable")
        return self.tables[0].take(pa.array(order)), self.keys[0][order]


def count(source: Source, spec: DataSpec, task: "Task", seed: int, start: int, stop: int) -> dict[str, Any]:
    """One pass over rows ``start:stop`` of the training split: counts, moments, sample, rows (see the module doc)."""
    features, stream = spec.features, spec.stream
    assert features is not None and stream is not None
    counted = [c for c in features.categorical if c not in features.hash_buckets] + list(features.multi_hot)
    counts = {c: _Counts() for c in counted}
    moments = {c: _Moments(c in features.log1p) for c in features.numeric}
    sample, rows = _Reservoir(stream.sample_rows), 0
    for index, first, batch in source.batches(start, stop):
        for c in counted:
            column = batch.column(c)
            counts[c].add(list_values(column)[0] if c in features.multi_hot else text(column))
        for c in features.numeric:
            moments[c].add(numbers(batch.column(c)))
        labels(batch, spec, task, source.shards[index].path)  # a bad label is refused now, not mid-training
        sample.add(batch, row_keys(seed, index, first, batch.num_rows))
        rows += batch.num_rows
    table, keys = sample.rows()
    return {"counts": {c: k.merged() for c, k in counts.items()}, "rows": rows, "sample": (table, keys),
            "moments": {c: (m.n, m.mean, m.m2) for c, m in moments.items()}}


def _merge_ranks(part: dict[str, Any], sample_rows: int) -> dict[str, Any]:
    """The ranks' counting passes as one (every rank gets the same); the part itself outside torchrun."""
    if not distributed.active():
        return part
    import pandas as pd
    import pyarrow as pa
    import torch.distributed as dist

    parts: list[Any] = [None] * distributed.world()
    dist.all_gather_object(parts, part)
    merged: dict[str, Any] = {"rows": sum(p["rows"] for p in parts), "counts": {}, "moments": {}}
    for c in part["counts"]:
        values = np.concatenate([p["counts"][c][0] for p in parts])
        summed = pd.Series(np.concatenate([p["counts"][c][1] for p in parts])).groupby(values, sort=False).sum()
        merged["counts"][c] = (summed.index.to_numpy(dtype=object), summed.to_numpy(dtype=np.int64))
    for c in part["moments"]:
        m = _Moments(False)
        for p in parts:
            if p["moments"][c][0]:
                m.merge(*p["moments"][c])
        merged["moments"][c] = (m.n, m.mean, m.m2)
    tables = [p["sample"][0] for p in parts if p["sample"][0] is not None]
    keys = np.concatenate([p["sample"][1] for p in parts])
    order = np.argsort(keys, kind="stable")[:sample_rows]
    merged["sample"] = (pa.concat_tables(tables).take(pa.array(order)) if tables else None, keys[order])
    return merged


def fit(passed: dict[str, Any], spec: DataSpec, where: str, vocabularies: dict[str, list[str]]) -> TabularSchema:
    """The schema the counting pass gives: ``tabular.TabularSchema.fit``'s rules, from counts instead of columns."""
    features = spec.features
    assert features is not None
    cats: list[CategoricalField] = []
    for c in features.categorical:
        if c in features.hash_buckets:
            cats.append(CategoricalField(c, buckets=features.hash_buckets[c]))
        elif c in vocabularies:
            cats.append(CategoricalField(c, vocabularies[c][: features.max_vocabulary], train_values=len(vocabularies[c])))
        else:
            values, counts = passed["counts"][c]
            cats.append(vocabulary_from_counts(c, values, counts, features.min_count, features.max_vocabulary))
    nums = []
    for c in features.numeric:
        n, mean, m2 = passed["moments"][c]
        if not n:
            raise InputError(f"data.features.numeric: column {c!r} of {where} holds no numbers in the training split",
                             hint="drop it from data.features.numeric")
        std = math.sqrt(m2 / n)
        nums.append(NumericField(c, mean, std if std > 0 else 1.0, c in features.log1p))
    bags = []
    for c in features.multi_hot:
        if c in vocabularies:
            bags.append(MultiHotField(c, vocabularies[c][: features.max_vocabulary], len(vocabularies[c])))
            continue
        values, counts = passed["counts"][c]
        found = vocabulary_from_counts(c, values, counts, features.min_count, features.max_vocabulary)
        bags.append(MultiHotField(c, found.vocabulary, found.train_values))
    return TabularSchema(cats, nums, features.min_count, bags, features.bag_length)


def labels(table: Any, spec: DataSpec, task: "Task", where: Any) -> torch.Tensor:
    """The task's reading of the label column(s) of a batch or table."""
    try:
        if isinstance(spec.label_column, dict):
            raw = {h: table.column(c).to_numpy(zero_copy_only=False) for h, c in spec.label_column.items()}
            return torch.from_numpy(np.asarray(task.read_targets(raw, spec.label_column)))
        raw_one = table.column(spec.label_column).to_numpy(zero_copy_only=False)
        return torch.from_numpy(np.asarray(task.read_targets(raw_one, spec.label_column)))
    except InputError as exc:
        raise InputError(f"{where}: {exc.args[0]}", hint=getattr(exc, "hint", None)) from None


def encode(schema: TabularSchema, table: Any, spec: DataSpec, task: "Task", where: Any) -> Split:
    """Rows of a batch or table as a Split: the schema's inputs (column ops) and the task's targets."""
    return Split(schema.encode({c: table.column(c) for c in table.column_names}), labels(table, spec, task, where))


# --------------------------------------------------------------------------- the training epochs


class StreamedTrain(TrainStream):
    """The training split, read from its shards every epoch (see the module docstring, item 4)."""

    def __init__(self, source: Source, schema: TabularSchema, spec: DataSpec, task: "Task", rank: int = 0, world: int = 1):
        self.source, self.schema, self.spec, self.task = source, schema, spec, task
        self.rank, self.world = rank, world
        total = source.rows
        self.start, self.stop = rank * total // world, (rank + 1) * total // world
        self.rows_read = 0  # rows this rank read in its last epoch (the benchmark and the log read it)

    def __len__(self) -> int:
        return self.source.rows

    def shard(self, rank: int, world: int) -> "StreamedTrain":
        part = StreamedTrain(self.source, self.schema, self.spec, self.task, rank, world)
        log.info("streamed train split: rank %d of %d reads rows %d..%d (%d of %d) of %d shard(s)", rank, world,
                 part.start, part.stop, part.stop - part.start, self.source.rows, len(self.source.shards))
        return part

    def epoch(self, batch_size: int, generator: torch.Generator) -> Iterator[tuple[Any, torch.Tensor]]:
        stream = self.spec.stream
        assert stream is not None
        parts = pieces(self.source.shards, self.start, self.stop)
        target = -(-self.source.rows // self.world)  # every rank yields as many rows (DistributedSampler's padding)
        buffer: list[Split] = []
        held = self.rows_read = 0
        for i in torch.randperm(len(parts), generator=generator).tolist():
            piece = parts[i]
            shard = self.source.shards[piece.index]
            for batch in read(shard, piece, list(self.source.roles), stream.batch_rows, self.source.field, self.source.options):
                buffer.append(encode(self.schema, batch, self.spec, self.task, shard.path))
                held += batch.num_rows
                self.rows_read += batch.num_rows
                if held >= stream.shuffle_buffer:
                    buffer, held = yield from _drain(buffer, batch_size, generator, final=False)
        if buffer and self.rows_read < target:  # this rank's range is a row short: repeat its first rows
            buffer.append(_rows(buffer[0], slice(0, target - self.rows_read)))
        yield from _drain(buffer, batch_size, generator, final=True)
        log.info("streamed train split: rank %d read %d rows this epoch", self.rank, self.rows_read)


def _rows(split: Split, idx: Any) -> Split:
    x = {k: v[idx] for k, v in split.x.items()} if isinstance(split.x, dict) else split.x[idx]
    return Split(x, split.y[idx])


def _drain(buffer: list[Split], batch_size: int, generator: torch.Generator,
           final: bool) -> Generator[tuple[Any, torch.Tensor], None, tuple[list[Split], int]]:
    """Shuffled batches of the buffer's rows; all of them when ``final``, else the whole batches (the rest stays)."""
    if not buffer:
        return [], 0
    x0 = buffer[0].x
    x = ({k: torch.cat([b.x[k] for b in buffer]) for k in x0} if isinstance(x0, dict)  # type: ignore[index]
         else torch.cat([b.x for b in buffer]))  # type: ignore[misc]
    whole = Split(x, torch.cat([b.y for b in buffer]))
    order = torch.randperm(len(whole), generator=generator)
    end = len(whole) if final else len(whole) - len(whole) % batch_size
    for s in range(0, end, batch_size):
        part = _rows(whole, order[s : s + batch_size])
        yield part.x, part.y
    rest = _rows(whole, order[end:])
    return ([rest] if len(rest) else []), len(rest)


# --------------------------------------------------------------------------- loading


def load_streamed(spec: DataSpec, seed: int, task: "Task", with_train: bool = True) -> DataBundle:
    """The DataBundle of a streamed tabular log (module docstring): checked, counted, sampled; train streamed."""
    stream = spec.stream
    assert stream is not None
    train_path, eval_path, where = _paths(spec)
    train = open_source(train_path, spec, "data.train")
    evals = open_source(eval_path, spec, "data.eval")
    rank, world = distributed.rank(), distributed.world()
    start, stop = rank * train.rows // world, (rank + 1) * train.rows // world
    log.info("counting pass: rank %d of %d reads training rows %d..%d of %d", rank, world, start, stop, train.rows)
    passed = _merge_ranks(count(train, spec, task, seed, start, stop), stream.sample_rows)
    schema = fit(passed, spec, where, _vocabulary_file(stream))
    sample_table = passed["sample"][0]
    train_sample = encode(schema, sample_table, spec, task, "data.train")
    eval_split, eval_note = _eval_split(evals, spec, task, seed, schema)
    description = (f"{spec.format} shards, streamed: {where}; train {train.rows:,} rows in {len(train.shards)} shard(s), "
                   f"read in record batches (shuffle buffer {stream.shuffle_buffer:,}); eval {eval_note}; "
                   f"calibration and pruning read a uniform sample of {len(train_sample):,} training rows "
                   f"({schema.describe()})")
    float_y = train_sample.y.is_floating_point()
    return DataBundle(train=train_sample, eval=eval_split,
                      num_classes=0 if float_y else int(max(train_sample.y.max(), eval_split.y.max())) + 1,
                      input_shape=tuple(next(iter(eval_split.x.values())).shape[1:]) if isinstance(eval_split.x, dict)
                      else tuple(eval_split.x.shape[1:]), description=description, tabular=schema,
                      stream=StreamedTrain(train, schema, spec, task) if with_train else None)


def _eval_split(evals: Source, spec: DataSpec, task: "Task", seed: int, schema: TabularSchema) -> tuple[Split, str]:
    """Every eval row when there are at most ``eval_rows``, else a uniform sample of them (each rank reads its part)."""
    stream = spec.stream
    assert stream is not None
    rank, world = distributed.rank(), distributed.world()
    start, stop = rank * evals.rows // world, (rank + 1) * evals.rows // world
    keep = _Reservoir(stream.eval_rows)
    place = 0
    for index, first, batch in evals.batches(start, stop):
        # key: the row's order when every row is kept, else its hash (a uniform sample)
        keys = (np.arange(start + place, start + place + batch.num_rows, dtype=np.float64)
                if evals.rows <= stream.eval_rows else row_keys(seed + 1, index, first, batch.num_rows))
        keep.add(batch, keys)
        place += batch.num_rows
    table, keys = _merge_ranks({"counts": {}, "moments": {}, "rows": place, "sample": keep.rows()}, stream.eval_rows)["sample"]
    note = (f"{evals.rows:,} rows, every one" if evals.rows <= stream.eval_rows
            else f"a uniform sample of {len(keys):,} of {evals.rows:,} rows (the same on every rank)")
    return encode(schema, table, spec, task, "data.eval"), note


def _paths(spec: DataSpec) -> tuple[str, str, str]:
    if spec.format != "clicklog":
        if not spec.train or not spec.eval:
            raise InputError("data.stream: give data.train and data.eval (files, folders or globs of shards)",
                             hint="e.g. data: {format: parquet, train: logs/day1/*.parquet, eval: logs/day2/part-0.parquet, stream: {}}")
        return spec.train, spec.eval, f"train {spec.train}, eval {spec.eval}"
    from .clicklog import cached
    from .recipe.models import ClickLogSpec

    log_spec = spec.clicklog or ClickLogSpec()
    if not log_spec.shards:
        raise InputError("data.stream with format: clicklog reads its shards: set data.clicklog.shards",
                         hint="e.g. data: {format: clicklog, clicklog: {rows: 1000000, shards: 8}, stream: {}}")
    folder = cached(log_spec)
    return str(folder / "train"), str(folder / "eval"), f"generated click log ({log_spec.rows:,} rows) in {folder}"


def _vocabulary_file(stream: StreamSpec) -> dict[str, list[str]]:
    if not stream.vocabulary_file:
        return {}
    import json
    from pathlib import Path

    try:
        found = json.loads(Path(stream.vocabulary_file).read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"data.stream.vocabulary_file: cannot read {stream.vocabulary_file}: {exc}",
                         hint="point at a JSON file {field: [values, ...]} (relative paths are read from the recipe's folder), "
                         "or leave vocabulary_file out to count the train split") from None
    if not isinstance(found, dict) or not all(isinstance(v, list) for v in found.values()):
        raise InputError("data.stream.vocabulary_file: expected a JSON object {field: [values, ...]}",
                         hint='write it as {"user_id": ["u1", "u2"], "device": ["ios", "android"]}: one list of values per '
                         "categorical field, most frequent first")
    return {str(k): [str(v) for v in values] for k, values in found.items()}


