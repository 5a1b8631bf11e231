"""Calibration sets: determinism, stratification, diverse coverage, one set for every consumer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from pruneflow.calibrate.build import build_calibration_set, penultimate_features
from pruneflow.calibrate.calibset import CalibrationSet
from pruneflow.calibrate.consumers import nncf_dataset, ort_reader, save_set, write_amct
from pruneflow.calibrate.sampling import coverage, select_diverse, select_random, select_stratified
from pruneflow.data import Split
from pruneflow.errors import InputError, RecipeError
from pruneflow.recipe import load_recipe

from conftest import tiny_recipe_dict


def clustered(n_per=(400, 40, 8), seed=0) -> Split:
    """Three clusters of very different sizes: random sampling under-covers the small ones."""
    rng = np.random.default_rng(seed)
    centers = [np.zeros(6), np.full(6, 6.0), np.full(6, -6.0)]
    xs = [rng.normal(c, 1.0, size=(n, 6)) for c, n in zip(centers, n_per)]
    ys = [np.full(n, i) for i, n in enumerate(n_per)]
    return Split(torch.tensor(np.concatenate(xs), dtype=torch.float32), torch.tensor(np.concatenate(ys)))


def test_same_inputs_and_seed_give_the_same_fingerprint():
    split = clustered()
    a = build_calibration_set(split, size=50, strategy="random", seed=3)
    b = build_calibration_set(split, size=50, strategy="random", seed=3)
    c = build_calibration_set(split, size=50, strategy="random", seed=4)
    assert a.fingerprint == b.fingerprint and torch.equal(a.x, b.x)
    assert a.fingerprint != c.fingerprint


def test_stratified_keeps_the_proportions():
    groups = np.array([0] * 600 + [1] * 300 + [2] * 100)
    chosen = select_stratified(groups, 100, seed=0)
    assert np.bincount(groups[chosen]).tolist() == [60, 30, 10]
    assert len(set(chosen.tolist())) == 100
    # uneven division: largest remainders
    chosen = select_stratified(np.array([0] * 5 + [1] * 5 + [2] * 5), 7, seed=1)
    assert sorted(np.bincount(np.array([0] * 5 + [1] * 5 + [2] * 5)[chosen]).tolist()) == [2, 2, 3]


def test_diverse_covers_the_source_better_than_random():
    split = clustered()
    feats = split.x.numpy()
    diverse = select_diverse(feats, 24, seed=0)
    randoms = [select_random(len(feats), 24, seed=s) for s in range(5)]
    assert coverage(feats, diverse) < min(coverage(feats, r) for r in randoms)  # mean distance to the set
    assert coverage(feats, diverse, reduce="max") < min(coverage(feats, r, reduce="max") for r in randoms)
    assert set(split.y[torch.as_tensor(diverse)].tolist()) == {0, 1, 2}  # every cluster is represented


def test_duplicates_small_and_empty_sources():
    x = torch.zeros(10, 3)
    x[5:] = 1.0
    warnings = []
    calib = build_calibration_set(Split(x, torch.zeros(10, dtype=torch.long)), size=8, strategy="random", seed=0,
                                  warn=warnings.append)
    assert len(calib) == 2 and calib.meta["duplicates_removed"] == 8
    assert warnings and "only 2 unique samples" in warnings[0]
    with pytest.raises(InputError, match="no samples"):
        build_calibration_set(Split(torch.zeros(0, 3), torch.zeros(0, dtype=torch.long)), size=4, strategy="random", seed=0)
    with pytest.raises(InputError, match="unknown strategy"):
        build_calibration_set(Split(x, torch.zeros(10, dtype=torch.long)), size=4, strategy="best", seed=0)
    with pytest.raises(InputError, match="no labels"):
        build_calibration_set(Split(torch.randn(20, 3), torch.full((20,), -1)), size=4, strategy="stratified", seed=0)


def test_save_and_load_round_trip_with_statistics(tmp_path):
    split = clustered()
    calib = build_calibration_set(split, size=40, strategy="stratified", seed=0, meta={"source": "test"})
    info = calib.save(tmp_path / "calib")
    assert info["count"] == 40 and info["fingerprint"] == calib.fingerprint
    assert sum(info["histogram"].values()) == 40
    assert info["input"]["min"] <= info["input"]["percentiles"]["1.0"] <= info["input"]["percentiles"]["99.0"] <= info["input"]["max"]
    again = CalibrationSet.load(tmp_path / "calib")
    assert again.fingerprint == calib.fingerprint and torch.equal(again.x, calib.x)
    assert not list(tmp_path.glob(".calib*")), "temporary folder left behind"


def test_a_regression_target_is_stored_as_a_number_and_the_set_loads_again(tmp_path):
    """Labels were stored as int64: a regression set's targets (0.17, 0.35, ...) became 0, the histogram read
    {"0": n}, and the fingerprint (taken on the floats) no longer matched, so every `--resume` rebuilt the set."""
    x, y = torch.randn(30, 4), torch.linspace(-1.5, 2.5, 30)
    calib = CalibrationSet(x, y, {"source": "test"})
    info = calib.save(tmp_path / "calib")
    assert "histogram" not in info and info["targets"]["input"]["max"] == pytest.approx(2.5)
    again = CalibrationSet.load(tmp_path / "calib")
    assert again.fingerprint == calib.fingerprint and torch.equal(again.y, y) and again.y.dtype == torch.float32
    classes = CalibrationSet(x, torch.arange(30) % 3)
    assert classes.save(tmp_path / "classes")["histogram"] == {"0": 10, "1": 10, "2": 10}
    assert CalibrationSet.load(tmp_path / "classes").y.dtype == torch.int64


def _digits_onnx(tmp_path):
    from pruneflow.export.onnx import export_onnx
    from pruneflow.zoo import digits_cnn

    torch.manual_seed(0)
    model = digits_cnn(width=8).eval()
    path = tmp_path / "m.onnx"
    export_onnx(model, torch.zeros(1, 1, 8, 8), path)
    return model, path


def test_every_consumer_reads_the_same_set(tmp_path):
    calib = build_calibration_set(Split(torch.rand(30, 1, 8, 8), torch.randint(0, 10, (30,))), size=12,
                                  strategy="random", seed=0)
    # onnxruntime reader
    reader, seen = ort_reader(calib, "input"), []
    while (item := reader.get_next()) is not None:
        seen.append(item["input"])
    assert np.array_equal(np.concatenate(seen), calib.x.numpy())
    # NNCF dataset
    items = list(nncf_dataset(calib, batch_size=4, as_numpy=True).get_inference_data())
    assert np.array_equal(np.concatenate(items), calib.x.numpy())
    # Ascend AMCT: one raw .bin a sample, and a list
    listing = write_amct(calib, tmp_path / "amct")
    lines = listing.read_text().split()
    assert len(lines) == 12
    first = np.fromfile(tmp_path / "amct" / lines[0], dtype=np.float32).reshape(1, 1, 8, 8)
    assert np.array_equal(first, calib.x[:1].numpy())
    assert json.loads((tmp_path / "amct" / "inputs.json").read_text())["input"]["shape"] == [1, 1, 8, 8]


def test_save_set_publishes_the_amct_input_with_the_set_or_nothing(tmp_path):
    calib = build_calibration_set(Split(torch.rand(20, 1, 8, 8), torch.randint(0, 10, (20,))), size=6, strategy="random",
                                  seed=0)
    info = save_set(calib, tmp_path / "calib", amct=True)
    listing = (tmp_path / "calib" / "amct" / "calibration_list.txt").read_text().split()
    assert len(listing) == 6 and info["fingerprint"] == CalibrationSet.load(tmp_path / "calib").fingerprint
    save_set(calib, tmp_path / "plain")
    assert (tmp_path / "plain" / "calibration.json").is_file() and not (tmp_path / "plain" / "amct").exists()

    def broken(folder):
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        calib.save(tmp_path / "half", extras=broken)
    # Nothing published, and the folder it was built in is gone too.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib", "plain"]


def test_onnxruntime_static_quantization_uses_the_reader(tmp_path):
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    from pruneflow.runtime import open_artifact

    model, path = _digits_onnx(tmp_path)
    x = torch.rand(64, 1, 8, 8)
    calib = build_calibration_set(Split(x, torch.zeros(64, dtype=torch.long)), size=32, strategy="diverse", seed=0)
    quantize_static(str(path), str(tmp_path / "q.onnx"), ort_reader(calib, "input"), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=True)
    got = open_artifact(tmp_path / "q.onnx")(x.numpy())
    with torch.no_grad():
        ref = model(x).numpy()
    cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.mean() > 0.98


def test_nncf_openvino_post_training_quantization_uses_the_dataset(tmp_path):
    nncf = pytest.importorskip("nncf")
    ov = pytest.importorskip("openvino")
    model, path = _digits_onnx(tmp_path)
    x = torch.rand(64, 1, 8, 8)
    calib = build_calibration_set(Split(x, torch.zeros(64, dtype=torch.long)), size=32, strategy="random", seed=0)
    quantized = nncf.quantize(ov.convert_model(str(path)), nncf_dataset(calib, as_numpy=True), subset_size=len(calib))
    compiled = ov.Core().compile_model(quantized, "CPU")
    got = compiled(x[:8].numpy())[0]
    with torch.no_grad():
        ref = model(x[:8]).numpy()
    assert any("FakeQuantize" == op.get_type_name() for op in quantized.get_ops())
    assert np.abs(got - ref).max() < 0.5 * np.abs(ref).max() + 1e-3


def test_penultimate_features_are_the_classifier_inputs():
    from pruneflow.zoo import digits_cnn

    model = digits_cnn(width=8).eval()
    x = torch.rand(5, 1, 8, 8)
    feats = penultimate_features(model, x, batch_size=2)
    with torch.no_grad():
        assert np.allclose(feats, model.features(x).numpy(), atol=1e-6)


@pytest.mark.slow
def test_calibrate_stage_in_a_recipe_and_resume(tmp_path, write_recipe):
    from pruneflow.pipeline import run_recipe

    recipe = tiny_recipe_dict(name="calib")
    recipe["stages"] = [{"type": "calibrate", "size": 64, "strategy": "stratified"}]
    path = write_recipe(recipe)
    first = run_recipe(load_recipe(path), out=tmp_path / "runs")
    info = json.loads((first.run_dir / "calibration" / "calibration.json").read_text())
    assert info["count"] == 64 and first.metrics["calibrate.fingerprint"] == info["fingerprint"]
    counts = list(info["histogram"].values())
    assert max(counts) - min(counts) <= 2  # digits are balanced, so stratified is too
    again = run_recipe(load_recipe(path), out=tmp_path / "runs", resume=True)
    assert again.stages[0].resumed and again.metrics["calibrate.fingerprint"] == info["fingerprint"]


@pytest.mark.parametrize("body, message", [({"size": 0}, "greater than or equal to 1"), ({"strategy": "best"}, "Input should be")])
def test_bad_calibrate_configs_are_recipe_errors(write_recipe, body, message):
    recipe = tiny_recipe_dict()
    recipe["stages"] = [{"type": "calibrate", **body}]
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(recipe))
    assert any(message in i.message for i in err.value.issues)


def test_calibrate_command_on_production_logs(tmp_path):
    from pruneflow.cli import app

    rng = np.random.default_rng(0)
    lines = [json.dumps({"input": rng.normal(size=4).tolist(), "device": "ab"[i % 2]}) for i in range(50)]
    (tmp_path / "req.jsonl").write_text("\n".join(lines) + "\n")
    runner = CliRunner()
    ok = runner.invoke(app, ["calibrate", str(tmp_path / "req.jsonl"), "--out", str(tmp_path / "c"), "--size", "10",
                             "--strategy", "stratified", "--by", "device", "--json"])
    assert ok.exit_code == 0, ok.output
    info = json.loads(ok.stdout)["calibration"]
    assert info["count"] == 10 and info["by"] == "device"
    missing = runner.invoke(app, ["calibrate", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "d")])
    assert missing.exit_code == 2 and "not found" in missing.stderr
    (tmp_path / "empty.jsonl").write_text("")
    empty = runner.invoke(app, ["calibrate", str(tmp_path / "empty.jsonl"), "--out", str(tmp_path / "e")])
    assert empty.exit_code == 2
    column = runner.invoke(app, ["calibrate", str(tmp_path / "req.jsonl"), "--out", str(tmp_path / "f"),
                                 "--strategy", "stratified", "--by", "region"])
    assert column.exit_code == 2 and "no column 'region'" in column.stderr


def test_diverse_picks_from_a_bounded_pool_of_a_large_source(monkeypatch):
    """k-center costs samples x size: a large source is first cut to a seeded random pool (calibrate.build.DIVERSE_POOL)."""
    import pruneflow.calibrate.build as build
    from pruneflow.splits import Split

    monkeypatch.setattr(build, "DIVERSE_POOL", 300)
    x = torch.randn(2000, 4)
    seen = []
    out = build.build_calibration_set(Split(x, torch.zeros(2000, dtype=torch.long)), size=20, strategy="diverse", seed=0,
                                      features=lambda batch: seen.append(len(batch)) or batch.numpy())
    assert seen == [300] and len(out) == 20  # features of the pool only
    again = build.build_calibration_set(Split(x, torch.zeros(2000, dtype=torch.long)), size=20, strategy="diverse", seed=0)
    assert again.meta["indices"] == out.meta["indices"]  # the pool is seeded: the same set each time
