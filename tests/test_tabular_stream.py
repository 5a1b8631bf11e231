"""Streamed tabular data (issue 39): shards read in record batches, column-op encoding equal to the value-by-value
definition, the hash a server reproduces, one counting pass equal to the in-memory fit, epochs that cover every row
once, ranks that read disjoint halves, a reservoir sample, and bad shards refused naming file and column."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq
import pytest
import torch

from conftest import invoke, write
from pruneflow.clicklog import write_shards
from pruneflow.data import load_data
from pruneflow.errors import InputError
from pruneflow.recipe.models import DataSpec, FeaturesSpec
from pruneflow.tabular import OOV, TabularSchema
from pruneflow.tabular_arrow import fnv1a_64, hashed_ids
from pruneflow.tabular_stream import StreamedTrain, count, open_source
from pruneflow.tasks import make_task

FEATURES = {"categorical": ["user_id", "item_id", "category", "device", "hour"], "multi_hot": ["item_tags"],
            "numeric": ["price", "item_age_days", "user_activity"], "log1p": ["price", "user_activity"],
            "hash_buckets": {"user_id": 5000}}


def reference_id(value, buckets: int) -> int:
    """What a serving system computes for a hashed field (the deployment record's ``steps``, tabular_arrow's doc):
    an integer is its own hash; anything else is text, trimmed, FNV-1a-64 over its UTF-8 bytes; modulo buckets."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value) % buckets
    if value is None or (isinstance(value, float) and np.isnan(value)):
        text = ""
    elif isinstance(value, float) and value == int(value):
        text = str(int(value))
    else:
        text = str(value).strip()
    h = 0xCBF29CE484222325
    for byte in text.encode("utf-8"):
        h = ((h ^ byte) * 0x100000001B3) % 2**64
    return h % buckets


def test_the_vectorised_hash_is_the_reference_a_server_reproduces():
    rng = np.random.default_rng(0)
    words = ["", " a ", "a", "foobar", "ünïcødé", "東京", "x" * 300] + [f"u{n}" for n in rng.integers(0, 10**9, 500)]
    got = hashed_ids(np.array(words, dtype=object), 1_000_003)
    assert got.tolist() == [reference_id(w, 1_000_003) for w in words]
    assert fnv1a_64(pa.array(["a", "foobar"])).tolist() == [0xAF63DC4C8601EC8C, 0x85944171F73967E8]  # FNV test vectors
    ints = rng.integers(-(10**12), 10**12, 300)
    assert hashed_ids(ints, 97).tolist() == [reference_id(int(v), 97) for v in ints]
    floats = np.array([7.0, np.nan, 2.5, -3.0])
    assert hashed_ids(floats, 1000).tolist() == [reference_id(v, 1000) for v in floats]
    sliced = pa.array(words, pa.large_string()).slice(3, 50)  # an Arrow slice (a record batch's column) keeps its offset
    assert hashed_ids(sliced, 1009).tolist() == [reference_id(w, 1009) for w in words[3:53]]


def test_column_op_lookup_equals_the_value_by_value_definition():
    rng = np.random.default_rng(1)
    train = {"city": np.array(rng.choice(["paris", "rome", " oslo", "07", "7", None], 400), dtype=object),
             "n": rng.integers(0, 40, 400), "tags": np.array([list(rng.choice(["a", "b", "c", ""], k)) for k in
                                                              rng.integers(0, 5, 400)] + [None], dtype=object)[:400]}
    schema = TabularSchema.fit(train, FeaturesSpec(categorical=["city", "n"], multi_hot=["tags"], min_count=3,
                                                   max_vocabulary=30), "t")
    city, n = schema.categorical
    assert len(n.vocabulary) <= 30 and "" in city.vocabulary  # missing is the text "", a value like any other
    probe = {"city": np.array(["rome ", "lisbon", None, "07", "7"], dtype=object), "n": np.array([3, 99, 0, 7, 12]),
             "tags": np.array([["a", "", "zz", "b"], [], None, ["c"] * 12, ["b"]], dtype=object)}
    out = schema.encode(probe)

    def ref(field, v):
        text = "" if v is None else str(v).strip()
        return field.vocabulary.index(text) + 1 if text in field.vocabulary else OOV

    assert out["ids"][:, 0].tolist() == [ref(city, v) for v in probe["city"]]
    assert out["ids"][:, 1].tolist() == [ref(n, v) for v in probe["n"]]
    bag = schema.multi_hot[0]
    for row, items in enumerate(probe["tags"]):
        kept = [v for v in (items or []) if v][: schema.bag_length]
        want = [bag.vocabulary.index(v) + 1 if v in bag.vocabulary else 0 for v in kept]
        assert out["bags"][row, 0].tolist() == want + [0] * (schema.bag_length - len(want))


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("log")
    write_shards(folder, 20_001, 3, users=5000, items=800, seed=3)  # odd rows: a rank's half is a row short
    return folder


def _spec(folder: Path, **stream) -> DataSpec:
    return DataSpec(format="parquet", train=str(folder / "train"), eval=str(folder / "eval/*.parquet"),
                    label_column="clicked", features=FEATURES,
                    stream={"batch_rows": 1000, "shuffle_buffer": 4000, "sample_rows": 3000, "eval_rows": 900, **stream})


def _table(folder: Path) -> pa.Table:
    return pa.concat_tables(pq.read_table(f) for f in sorted(folder.glob("*.parquet")))


def test_one_counting_pass_fits_what_the_in_memory_path_fits(shards):
    bundle = load_data(_spec(shards), task=make_task("binary"))
    whole = _table(shards / "train").to_pandas()
    fitted = TabularSchema.fit({c: whole[c].to_numpy() for c in whole.columns}, FeaturesSpec(**FEATURES), "train")
    streamed = bundle.tabular
    assert [f.vocabulary for f in streamed.categorical] == [f.vocabulary for f in fitted.categorical]
    assert [f.buckets for f in streamed.categorical] == [f.buckets for f in fitted.categorical]
    assert streamed.multi_hot[0].vocabulary == fitted.multi_hot[0].vocabulary
    for a, b in zip(streamed.numeric, fitted.numeric):
        assert a.mean == pytest.approx(b.mean, rel=1e-9) and a.std == pytest.approx(b.std, rel=1e-9)
    assert streamed.record()["tabular"]["ids"] == fitted.record()["tabular"]["ids"]  # the deployment record as today
    assert bundle.train_rows == 18_001 and len(bundle.train) == 3000 and len(bundle.eval) == 900
    assert "uniform sample of 900 of 2,000" in bundle.description


def test_an_epoch_reads_every_training_row_once_shuffled_within_the_buffer(shards):
    bundle = load_data(_spec(shards), task=make_task("binary"))
    whole = _table(shards / "train")
    expected = bundle.tabular.encode({c: whole.column(c) for c in whole.column_names})
    batches = list(bundle.train_batches(512, torch.Generator().manual_seed(0)))
    ids = torch.cat([x["ids"] for x, _ in batches])
    assert len(ids) == 18_001 and all(len(y) == 512 for _, y in batches[:-1])

    def rows(t):
        return sorted(map(tuple, t.tolist()))

    assert rows(ids) == rows(expected["ids"])
    assert not torch.equal(ids, expected["ids"])  # shuffled
    again = torch.cat([x["ids"] for x, _ in bundle.train_batches(512, torch.Generator().manual_seed(0))])
    assert torch.equal(ids, again)  # seeded: the same epoch again


def test_two_ranks_read_disjoint_halves_and_take_as_many_steps(shards):
    bundle = load_data(_spec(shards), task=make_task("binary"))
    stream = bundle.stream
    assert isinstance(stream, StreamedTrain)
    parts = [stream.shard(r, 2) for r in range(2)]
    assert [(p.start, p.stop) for p in parts] == [(0, 9000), (9000, 18_001)]
    epochs = [list(p.epoch(256, torch.Generator().manual_seed(r))) for r, p in enumerate(parts)]
    assert [p.rows_read for p in parts] == [9000, 9001]  # each reads its own half (and logs it)
    assert len(epochs[0]) == len(epochs[1])  # rank 0 repeats a row so that both take as many steps
    seen = [sorted(map(tuple, torch.cat([x["ids"] for x, _ in e]).tolist())) for e in epochs]
    whole = _table(shards / "train")
    every = sorted(map(tuple, bundle.tabular.encode({c: whole.column(c) for c in whole.column_names})["ids"].tolist()))
    assert len(seen[0]) == len(seen[1]) == 9001
    assert sorted(seen[0][:9000] + seen[1]) == every or sorted(set(seen[0]) | set(seen[1])) == sorted(set(every))


def test_the_reservoir_sample_is_the_same_however_the_log_is_split(shards):
    """Two ranks' samples merged by key equal one process's sample: the keys hash each row's place."""
    spec, task = _spec(shards, sample_rows=500), make_task("binary")
    source = open_source(spec.train, spec, "data.train")
    one = count(source, spec, task, 0, 0, source.rows)["sample"]
    halves = [count(source, spec, task, 0, a, b)["sample"] for a, b in ((0, 9000), (9000, source.rows))]
    keys = np.concatenate([h[1] for h in halves])
    order = np.argsort(keys, kind="stable")[:500]
    merged = pa.concat_tables([h[0] for h in halves]).take(pa.array(order))
    assert merged.equals(one[0]) and np.array_equal(keys[order], one[1])
    assert len(one[0]) == 500 and len(np.unique(one[1])) == 500
    # uniform: the sampled rows' click rate is the log's, within sampling error
    rate, sampled = float(np.mean(_table(shards / "train").column("clicked"))), float(np.mean(one[0].column("clicked")))
    assert abs(rate - sampled) < 4 * np.sqrt(rate * (1 - rate) / 500)


def test_csv_shards_read_as_the_parquet_ones(shards, tmp_path):
    for split in ("train", "eval"):
        (tmp_path / split).mkdir()
        for f in sorted((shards / split).glob("*.parquet")):
            table = pq.read_table(f).drop_columns(["recent_categories"])
            tags = pa.array(["|".join(map(str, v)) for v in table.column("item_tags").to_pylist()])
            pcsv.write_csv(table.set_column(table.schema.get_field_index("item_tags"), "item_tags", tags),
                           tmp_path / split / f"{f.stem}.csv")
    spec = _spec(tmp_path).model_copy(update={"format": "csv", "eval": str(tmp_path / "eval")})
    csv, parquet = load_data(spec, task=make_task("binary")), load_data(_spec(shards), task=make_task("binary"))
    a, b = csv.tabular.record()["tabular"], parquet.tabular.record()["tabular"]
    assert a["ids"] == b["ids"] and a["bags"] == b["bags"] and csv.train_rows == parquet.train_rows
    for x, y in zip(a["dense"], b["dense"]):  # numbers went through decimal text: equal to the last digits or so
        assert x["mean"] == pytest.approx(y["mean"], rel=1e-12) and x["std"] == pytest.approx(y["std"], rel=1e-12)
    assert torch.equal(csv.eval.x["ids"], parquet.eval.x["ids"]) and torch.equal(csv.eval.x["bags"], parquet.eval.x["bags"])
    assert torch.allclose(csv.eval.x["dense"], parquet.eval.x["dense"])


def test_a_vocabulary_file_replaces_counting(shards, tmp_path):
    vocab = write(tmp_path / "vocab.json", json.dumps({"device": ["web", "ios"]}))
    bundle = load_data(_spec(shards, vocabulary_file=str(vocab)), task=make_task("binary"))
    device = next(f for f in bundle.tabular.categorical if f.name == "device")
    assert device.vocabulary == ["web", "ios"]


def _bad(shards: Path, tmp_path: Path, table: pa.Table | None = None, raw: bytes | None = None) -> Path:
    folder = tmp_path / "train"
    folder.mkdir()
    for f in sorted((shards / "train").glob("*.parquet")):
        (folder / f.name).write_bytes(f.read_bytes())
    bad = folder / "part-00009.parquet"
    if table is not None:
        pq.write_table(table, bad)
    else:
        bad.write_bytes(raw or b"")
    return bad


@pytest.mark.parametrize("case", ["missing column", "wrong type", "truncated", "empty", "list where one value goes"])
def test_bad_shards_are_refused_naming_the_file_and_the_column(shards, tmp_path, case):
    good = pq.read_table(sorted((shards / "train").glob("*.parquet"))[0]).slice(0, 100)
    if case == "missing column":
        bad = _bad(shards, tmp_path, good.drop_columns(["price"]))
        words = ["has no column 'price'"]
    elif case == "wrong type":
        price = pa.array([str(v) for v in good.column("price").to_pylist()])
        bad = _bad(shards, tmp_path, good.set_column(good.schema.get_field_index("price"), "price", price))
        words = ["column 'price'", "holds string", "numeric columns hold numbers"]
    elif case == "truncated":
        data = (sorted((shards / "train").glob("*.parquet"))[0]).read_bytes()
        bad = _bad(shards, tmp_path, raw=data[: len(data) // 2])
        words = ["not a readable Parquet file", "truncated"]
    elif case == "empty":
        bad = _bad(shards, tmp_path, good.slice(0, 0))
        words = ["holds no rows"]
    else:
        device = pa.array([[v] for v in good.column("device").to_pylist()])
        bad = _bad(shards, tmp_path, good.set_column(good.schema.get_field_index("device"), "device", device))
        words = ["column 'device'", "categorical columns hold one id or word"]
    spec = _spec(shards).model_copy(update={"train": str(tmp_path / "train")})
    with pytest.raises(InputError) as err:
        load_data(spec, task=make_task("binary"))
    message = str(err.value)
    assert str(bad) in message and all(w in message for w in words), message


def test_a_bad_shard_is_exit_2_before_any_stage(shards, tmp_path):
    data = sorted((shards / "train").glob("*.parquet"))[0].read_bytes()
    bad = _bad(shards, tmp_path, raw=data[:-100])
    recipe = write(tmp_path / "r.yaml", {
        "name": "bad-shard", "task": "binary", "model": {"factory": "deepfm", "kwargs": {"embedding_dim": 4, "hidden": 8}},
        "data": {**json.loads(_spec(shards).model_dump_json(exclude_none=True)), "train": str(tmp_path / "train")},
        "stages": [{"type": "train", "epochs": 1, "batch_size": 256}]})
    result = invoke("optimize", recipe, "--out", tmp_path / "runs")
    assert result.exit_code == 2, result.output
    assert str(bad) in " ".join(result.output.split()).replace(" ", "") or bad.name in result.output
    assert not (tmp_path / "runs" / "bad-shard" / "stages").exists()


@pytest.mark.slow
def test_two_processes_each_read_their_own_half_of_the_log(shards, tmp_path):
    """`--nproc 2` (gloo) on streamed shards: rank 0 reads training rows 0..9000 and rank 1 rows 9000..18001 each epoch
    (their logs say so), the counting pass is shared (both ranks fit the same vocabularies: the run completes and
    rank 1's trained weights equal rank 0's)."""
    from test_distributed import _optimize, _sha

    recipe = write(tmp_path / "r.yaml", {
        "name": "ddp-stream", "task": "binary", "seed": 0, "threads": 1,
        "model": {"factory": "deepfm", "kwargs": {"embedding_dim": 4, "hidden": 16, "layers": 1}},
        "data": {**json.loads(_spec(shards).model_dump_json(exclude_none=True)), "eval_batch_size": 1024},
        "stages": [{"type": "train", "epochs": 2, "batch_size": 1024, "lr": 0.01}]})
    scratch = tmp_path / "scratch"
    proc, _ = _optimize(recipe, tmp_path / "runs", "--nproc", "2", scratch=scratch, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = [(tmp_path / "runs" / "ddp-stream" / "logs" / "pruneflow.log").read_text(),
            (scratch / "rank1" / "ddp-stream" / "logs" / "pruneflow.log").read_text()]
    assert logs[0].count("rank 0 of 2 reads rows 0..9000 (9000 of 18001)") == 2  # once an epoch
    assert logs[0].count("rank 0 read 9000 rows this epoch") == 2
    assert logs[1].count("rank 1 of 2 reads rows 9000..18001 (9001 of 18001)") == 2
    assert logs[1].count("rank 1 read 9001 rows this epoch") == 2
    model = Path("stages") / "01-train" / "model.pt"
    assert _sha(tmp_path / "runs" / "ddp-stream" / model) == _sha(scratch / "rank1" / "ddp-stream" / model)


def test_calibration_inputs_from_a_large_source_are_a_one_pass_sample(shards, tmp_path):
    """`load_inputs` (the calibrate stage's `source`, `pruneflow calibrate SOURCE`) on shards with data.stream: a uniform
    sample of sample_rows rows, encoded with the run's schema; a source without the label column gives -1 targets."""
    from pruneflow.data import load_inputs

    spec = _spec(shards, sample_rows=700)
    schema = load_data(spec, task=make_task("binary")).tabular
    split, ds = load_inputs(spec, "parquet", str(shards / "train"), "source", schema=schema)
    assert len(split) == 700 and len(ds) == 700 and set(split.y.tolist()) <= {0, 1}
    table = pa.Table.from_pandas(ds.to_pandas())
    assert torch.equal(split.x["ids"], schema.encode({c: table.column(c) for c in FEATURES["categorical"] + ["item_tags"]
                                                       + FEATURES["numeric"]})["ids"])
    unlabelled = tmp_path / "logged"
    unlabelled.mkdir()
    for f in sorted((shards / "train").glob("*.parquet")):
        pq.write_table(pq.read_table(f).drop_columns(["clicked"]), unlabelled / f.name)
    split, _ = load_inputs(spec, "parquet", str(unlabelled), "source", schema=schema)
    assert len(split) == 700 and (split.y == -1).all()


@pytest.mark.parametrize("data, words", [
    ({"format": "parquet", "train": "t", "eval": "e", "stream": {}}, "needs `features`"),
    ({"format": "npz", "train": "t", "eval": "e", "stream": {}, "features": {"numeric": ["x"]}}, "`format: parquet`, `csv`"),
    ({"format": "parquet", "path": "p", "stream": {}, "features": {"numeric": ["x"]}}, "not `path`"),
])
def test_a_stream_section_that_cannot_stream_is_refused_when_the_recipe_loads(data, words):
    with pytest.raises(ValueError, match="stream") as err:
        DataSpec(**data)
    assert words in str(err.value)


def test_an_epoch_longer_than_figure_rows_reads_its_training_figures_on_every_kth_batch(tmp_path, monkeypatch):
    """A binary task keeps every output for its AUC: over a streamed 10^7-row epoch that was +0.5 GB (and 26 s of AUC).
    Past FIGURE_ROWS rows an epoch the training figures read every k-th batch; the loss still counts every batch."""
    import pruneflow.train as train
    from pruneflow.context import RunContext
    from pruneflow.splits import DataBundle, Split
    from pruneflow.tasks import Classification

    seen: list[int] = []
    task = Classification()
    original = task.update
    monkeypatch.setattr(task, "update", lambda state, out, y: (seen.append(len(y)), original(state, out, y)))
    monkeypatch.setattr(train, "FIGURE_ROWS", 64)
    x, y = torch.randn(320, 2), torch.arange(320) % 2
    data = DataBundle(train=Split(x, y), eval=Split(x[:10], y[:10]), num_classes=2, input_shape=(2,))
    ctx = RunContext(run_dir=tmp_path, recipe=None, recipe_file=None)  # type: ignore[arg-type]
    history = train.fit(torch.nn.Linear(2, 2), data, task, train.TrainSettings(epochs=1, batch_size=16, lr=0.1), ctx)
    assert seen == [16] * 4 + [10]  # 20 batches, stride ceil(320 / 64) = 5: batches 0, 5, 10, 15; then the eval split
    assert 0 <= history[0]["train_accuracy"] <= 1 and history[0]["train_loss"] > 0
