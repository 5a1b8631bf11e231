"""Multi-hot list columns as data (issue 37): `features.multi_hot` turns a list a row into the `bags` input a DLRM's
`nn.EmbeddingBag(padding_idx=0)` reads, from parquet lists, npz 2-D arrays and csv text alike; the vocabularies go
into the deployment record; a zoo model's bag sizes come from the data. Also the calibrate stage's default features
on a model without a Linear, and the flag on an INT8 artifact slower than its FP32 one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pruneflow.recipe.models import FeaturesSpec
from pruneflow.tabular import BAGS, TabularSchema


def test_lists_become_padded_bags_of_vocabulary_ids():
    columns = {"tags": np.array([[3, 1], [3], [], [1, 3, 7, 3, 9]], dtype=object), "n": np.array([1.0, 2.0, 3.0, 4.0])}
    spec = FeaturesSpec(numeric=["n"], multi_hot=["tags"], bag_length=3)
    schema = TabularSchema.fit(columns, spec, "train")
    assert schema.multi_hot[0].vocabulary == ["3", "1", "7", "9"]  # most frequent first, ties by value
    bags = schema.encode(columns)[BAGS]
    assert bags.dtype == torch.int64 and bags.shape == (4, 1, 3)
    assert bags[:, 0].tolist() == [[1, 2, 0], [1, 0, 0], [0, 0, 0], [2, 1, 3]]  # first 3 values, 0 pads
    unseen = schema.encode({"tags": np.array([[42, 3]], dtype=object), "n": np.array([0.0])})[BAGS]
    assert unseen[0, 0].tolist() == [0, 1, 0]  # a value outside the vocabulary adds nothing
    record = schema.record()["tabular"][BAGS]
    assert record == [{"field": "tags", "vocabulary": ["3", "1", "7", "9"], "padding_id": 0, "bag_length": 3}]


def test_npz_arrays_and_csv_text_read_like_lists():
    spec = FeaturesSpec(categorical=["c"], multi_hot=["tags"], bag_length=2)
    from_npz = TabularSchema.fit({"c": np.array([1, 2]), "tags": np.array([[5, 0], [6, 5]])}, spec, "npz")
    from_csv = TabularSchema.fit({"c": np.array([1, 2]), "tags": np.array(["5", "6|5"], dtype=object)}, spec, "csv")
    for schema, tags in ((from_npz, np.array([[5, 0], [6, 5]])), (from_csv, np.array(["5", "6|5"], dtype=object))):
        assert schema.encode({"c": np.array([1, 2]), "tags": tags})[BAGS][:, 0].tolist() == [[1, 0], [2, 1]]


def test_a_multi_hot_column_is_read_from_parquet_and_fills_the_models_bag_sizes(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from pruneflow.data import load_data
    from pruneflow.models import with_data_kwargs
    from pruneflow.recipe.models import DataSpec, ModelSpec
    from pruneflow.tasks import make_task
    from pruneflow.zoo import ZOO

    rng = np.random.default_rng(0)
    rows = 200
    tags = [list(rng.integers(1, 30, rng.integers(0, 5))) for _ in range(rows)]
    table = pa.table({"item": rng.integers(0, 9, rows), "price": rng.random(rows), "tags": tags,
                      "clicked": rng.integers(0, 2, rows)})
    pq.write_table(table, tmp_path / "log.parquet")
    spec = DataSpec(format="parquet", path=str(tmp_path / "log.parquet"), label_column="clicked",
                    features={"categorical": ["item"], "numeric": ["price"], "multi_hot": ["tags"], "bag_length": 4})
    data = load_data(spec, seed=0, task=make_task("binary"))
    x = data.train.x
    assert isinstance(x, dict) and x["bags"].shape[1:] == (1, 4) and x["bags"].dtype == torch.int64
    model_spec, filled = with_data_kwargs(ModelSpec(factory="dlrm_bags"), data.tabular)
    assert filled["bag_length"] == 4 and filled["bag_cardinalities"] == [data.tabular.multi_hot[0].size]
    model = ZOO["dlrm_bags"].factory(**model_spec.kwargs)
    assert model(**x).shape == (len(data.train.y), 1)


def test_the_calibration_set_of_a_model_without_a_linear_compares_its_last_convolutions_inputs():
    from pruneflow.calibrate.build import feature_layer, penultimate_features
    from pruneflow.zoo import ZOO

    unet = ZOO["tiny_unet"].factory(in_channels=3, num_classes=3, width=8)
    layer, said = feature_layer(unet)
    assert isinstance(layer, torch.nn.Conv2d) and "last convolution" in said
    feats = penultimate_features(unet, torch.randn(5, 3, 16, 16))
    assert feats.shape == (5, layer.in_channels)  # one value a channel, averaged over space
    assert feature_layer(torch.nn.Sequential(torch.nn.ReLU())) is None


def test_an_int8_artifact_slower_than_its_fp32_one_is_flagged():
    from pruneflow.artifacts import Artifact
    from pruneflow.stages.measure import Opened, _speedups

    fp32 = Artifact(path="m.fp32.onnx", kind="onnx", producer="export", target="onnx", precision="fp32")
    int8 = Artifact(path="m.int8.onnx", kind="onnx", producer="export", target="onnx", precision="int8", form="cpu")
    fp32.metrics.update(latency_b1_median_ms=1.0, latency_b64_median_ms=10.0)
    int8.metrics.update(latency_b1_median_ms=1.57, latency_b64_median_ms=5.0)
    opened = [Opened(fp32, {"": None}), Opened(int8, {"": None})]  # type: ignore[arg-type]
    _speedups(opened, [1, 64])
    assert int8.metrics["slower_than_fp32_b1"] == 1 and "slower_than_fp32_b64" not in int8.metrics
    assert any("1.57x slower than m.fp32.onnx at batch 1" in n for n in int8.notes)


@pytest.mark.slow
def test_the_dlrm_bags_recipe_holds_its_bars_end_to_end(tmp_path, monkeypatch):
    """recipes/dlrm-bags.yaml on a smaller log (40,000 rows): bags exported as plain ops (no Loop) and converted by
    OpenVINO, their tables int8 in the INT8 ONNX, bag tables whole after pruning to half the MACs, and the INT8
    artifacts within the recipe's gates (AUC drop <= 0.002 against the unpruned FP32 model, pCTR error <= +0.005)."""
    pytest.importorskip("nncf")
    import json

    import onnx
    import yaml

    from tests.conftest import REPO, run_recipe_dict

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    recipe = yaml.safe_load((REPO / "recipes" / "dlrm-bags.yaml").read_text())
    recipe["data"]["clicklog"] = {"rows": 40000, "users": 2000, "items": 500, "seed": 0}
    recipe["stages"][-1]["latency"] = None
    _, result = run_recipe_dict(recipe, tmp_path)
    assert result.exit_code == 0  # every gate held
    run = tmp_path / "runs" / "dlrm-bags"
    flat = json.loads((run / "metrics.json").read_text())["flat"]
    assert flat["prune.macs"] <= 0.51 * flat["prune.macs_before"]
    assert flat["reference.onnx.fp32.auc"] > 0.6
    assert flat["onnx.int8.table_bytes"] < flat["onnx.fp32.table_bytes"] / 3
    model = onnx.load(str(run / "export" / "onnx" / "model.int8.onnx"))
    assert not {"Loop", "SequenceConstruct"} & {n.op_type for n in model.graph.node}
    assert [i.name for i in model.graph.input] == ["ids", "bags", "dense"]
    widths = {t.name: t.dims for t in onnx.load(str(run / "export" / "onnx" / "model.fp32.onnx")).graph.initializer}
    bag_tables = [dims for name, dims in widths.items() if ".bags." in f".{name}" and len(dims) == 2]
    assert len(bag_tables) == 2 and all(dims[1] == 16 for dims in bag_tables)  # kept whole by channel pruning


def test_an_id_beyond_a_table_names_the_tables_and_the_largest_ids():
    """An owner's table sized below its field's vocabulary gave a bare `IndexError: index out of range in self`."""
    from pruneflow.errors import InputError
    from pruneflow.preflight import check_model_on_batch
    from pruneflow.zoo import ZOO

    model = ZOO["dlrm"].factory(cardinalities=[5, 5], num_dense=2)
    with pytest.raises(InputError) as err:
        check_model_on_batch(model, {"ids": torch.tensor([[1, 7], [2, 3]]), "dense": torch.randn(2, 2)}, "dlrm", lambda o: o)
    assert "tables.1 5 rows" in err.value.hint and "'ids': [2, 7]" in err.value.hint and "cardinalities" in err.value.hint
