"""Models with several inputs, and text models as deployments take them (issue 15 Deliver 1, issue 13 Deliver 1).

Two families of tests/families/: ``two_input`` (an image and a metadata vector, fed from two npz columns by
``data.input_column: {image: pixels, meta: features}``) and ``lstm_text`` (``input_ids`` + ``attention_mask``),
plus a tiny BERT from config. Every artifact is read back (input names, dtypes, dynamic axes) and run in
onnxruntime and OpenVINO on real batches, at sequence lengths other than the one it was traced with.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pruneflow.data import Split
from pruneflow.inputs import bind, call, describe, feed, take, trim

from conftest import SHARED_DATA, run_recipe_dict, forced_f32

FAMILIES = Path(__file__).resolve().parent / "families"


def _family(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"families_{name}", FAMILIES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def _onnx_inputs(path: Path) -> dict[str, tuple[int, list]]:
    """name -> (ONNX elem type, dims as dim_param or dim_value) of a file's graph inputs."""
    import onnx

    graph = onnx.load(str(path)).graph
    return {i.name: (i.type.tensor_type.elem_type, [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim])
            for i in graph.input}


def _text_batch(rows: int, width: int, lengths: list[int], vocab: int = 100, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (rows, width), generator=g)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask}


# --------------------------------------------------------------------------- the helpers


def test_a_batch_is_bound_to_forwards_parameters():
    two = _family("two_input").build().eval()
    image, meta = torch.randn(3, 1, 8, 8), torch.randn(3, 4)
    batch = {"meta": meta, "image": image, "unused": torch.zeros(3)}
    bound = bind(two, batch)
    assert list(bound) == ["image", "meta"]  # forward's order, unknown names dropped
    with torch.no_grad():
        torch.testing.assert_close(call(two, batch), two(image, meta))
    one = torch.nn.Linear(5, 2)  # a one-argument model fed the tokenizer's output gets the token ids
    ids = torch.randn(2, 5)
    torch.testing.assert_close(call(one, {"input_ids": ids, "attention_mask": torch.ones(2, 5)}), one(ids))
    torch.testing.assert_close(call(one, ids), one(ids))
    assert feed(ids, ["input"])["input"].shape == (2, 5) and feed(batch, ["image"])["image"].shape == (3, 1, 8, 8)
    assert describe(_text_batch(2, 6, [3, 6]))["input_ids"] == {"shape": ["sequence"], "dtype": "int64"}


def test_text_batches_are_cut_to_their_longest_row_and_every_sample_comes_once():
    lengths = [2, 9, 4, 3, 7, 5, 1, 6]
    split = Split(_text_batch(8, 12, lengths), torch.arange(8))
    seen, widths = [], []
    for x, y in split.batches(3, by_length=True):
        widths.append(x["input_ids"].shape[1])
        assert widths[-1] == int(x["attention_mask"].sum(1).max())
        seen += y.tolist()
    assert sorted(seen) == list(range(8)) and widths == [3, 6, 9]  # sorted by length: 1,2,3 | 4,5,6 | 7,9
    in_order = [x["input_ids"].shape[1] for x, _ in split.batches(3)]
    assert in_order == [9, 7, 6]


# --------------------------------------------------------------------------- export of several inputs


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_a_text_model_exports_int64_inputs_with_dynamic_batch_and_sequence(tmp_path, cell):
    from pruneflow.export.onnx import export_onnx
    from pruneflow.runtime import open_artifact

    model = _family("lstm_text").build(vocab_size=100, embed_dim=16, hidden=16, cell=cell).eval()
    example = trim(_text_batch(1, 12, [5]))
    path = tmp_path / "model.onnx"
    export_onnx(model, example, path)
    assert _onnx_inputs(path) == {"input_ids": (7, ["batch", "sequence"]), "attention_mask": (7, ["batch", "sequence"])}
    # batches of other sizes and sequence lengths than the traced one, padded: both runtimes equal torch
    for rows, width, lengths in [(4, 9, [9, 3, 5, 1]), (2, 23, [17, 23])]:
        batch = _text_batch(rows, width, lengths, seed=rows)
        with torch.no_grad():
            ref = model(**batch).numpy()
        for runtime, options in [("onnxruntime", {}), ("openvino", {"precision_hint": "f32"})]:
            got = open_artifact(path, runtime=runtime, **options)(feed(batch))
            np.testing.assert_allclose(got, ref, atol=1e-5, err_msg=runtime)
    # padding after the mask changes nothing, and the mask matters
    ex = open_artifact(path)
    short = _text_batch(2, 6, [6, 4], seed=3)
    padded = {k: torch.nn.functional.pad(v, (0, 5)) for k, v in short.items()}
    np.testing.assert_allclose(ex(feed(padded)), ex(feed(short)), atol=1e-6)
    unmasked = dict(padded, attention_mask=torch.ones_like(padded["attention_mask"]))
    assert np.abs(ex(feed(unmasked)) - ex(feed(short))).max() > 1e-3


def test_text_latency_is_timed_on_real_rows_and_states_their_sequence_length(tmp_path):
    import contextlib

    from pruneflow.artifacts import Artifact
    from pruneflow.export.onnx import export_onnx
    from pruneflow.runtime import open_artifact
    from pruneflow.stages.measure import Opened, time_all

    model = _family("lstm_text").build(vocab_size=100, embed_dim=16, hidden=16).eval()
    export_onnx(model, trim(_text_batch(1, 12, [5])), tmp_path / "model.onnx")
    samples = _text_batch(6, 20, [3, 11, 4, 2, 7, 5])
    artifact = Artifact("model.onnx", "onnx", "export", target="onnx", precision="fp32")
    opened = [Opened(artifact, {"": open_artifact(tmp_path / "model.onnx")})]
    time_all(opened, samples, [1, 4], warmup=1, runs=3,
             progress=lambda description, total: contextlib.nullcontext(lambda *a, **k: None))
    m = artifact.metrics
    assert (m["latency_b1_sequence"], m["latency_b4_sequence"]) == (3, 11)  # rows 0 and 0..3, cut to their longest
    assert m["latency_b1_median_ms"] > 0 and m["throughput_b4"] > 0


def test_a_single_input_model_keeps_its_input_named_input(tmp_path):
    from pruneflow.export.onnx import export_onnx

    path = tmp_path / "model.onnx"
    export_onnx(torch.nn.Linear(4, 3), torch.zeros(1, 4), path)
    assert _onnx_inputs(path) == {"input": (1, ["batch", 4])}


# --------------------------------------------------------------------------- calibration of several inputs


def _two_input_split(n: int = 96) -> Split:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 10, (n,), generator=g)
    x = {"image": torch.rand(n, 1, 8, 8, generator=g), "meta": torch.randn(n, 4, generator=g)}
    return Split(x, y)


def test_a_calibration_set_stores_and_replays_every_input(tmp_path):
    from pruneflow.calibrate.build import build_calibration_set, penultimate_features
    from pruneflow.calibrate.calibset import CalibrationSet
    from pruneflow.calibrate.consumers import nncf_dataset, ort_reader

    split = _two_input_split()
    model = _family("two_input").build().eval()
    calib = build_calibration_set(split, size=24, strategy="diverse", seed=0,
                                  features=lambda x: penultimate_features(model, x))
    info = calib.save(tmp_path / "calib")
    assert set(info["inputs"]) == {"image", "meta"} and info["inputs"]["meta"]["shape"] == [4]
    loaded = CalibrationSet.load(tmp_path / "calib")
    assert loaded.fingerprint == calib.fingerprint == info["fingerprint"]
    picked = torch.as_tensor(info["indices"])
    for name in ("image", "meta"):
        assert torch.equal(loaded.x[name], split.x[name][picked])  # the samples chosen, every input, in order
    batches = list(nncf_dataset(loaded, batch_size=10).get_inference_data())
    assert [sorted(b) for b in batches] == [["image", "meta"]] * 3 and sum(len(b["meta"]) for b in batches) == 24
    first = ort_reader(loaded, batch_size=24).get_next()
    assert first["image"].shape == (24, 1, 8, 8) and first["meta"].dtype == np.float32


def test_a_text_calibration_set_round_trips_with_its_mask(tmp_path):
    from pruneflow.calibrate.build import build_calibration_set
    from pruneflow.calibrate.calibset import CalibrationSet

    split = Split(_text_batch(40, 12, [int(i) for i in torch.randint(1, 13, (40,), generator=torch.Generator().manual_seed(1))]),
                  torch.arange(40) % 2)
    calib = build_calibration_set(split, size=16, strategy="stratified", seed=0)
    calib.save(tmp_path / "calib")
    loaded = CalibrationSet.load(tmp_path / "calib")
    assert loaded.x["input_ids"].dtype == torch.int64 and torch.equal(loaded.x["attention_mask"], calib.x["attention_mask"])
    for batch in loaded.batches(5):
        assert batch["input_ids"].shape[1] == int(batch["attention_mask"].sum(1).max())


# --------------------------------------------------------------------------- two_input end to end


def _two_input_recipe(folder: Path, stages: list[dict]) -> dict:
    from sklearn.datasets import load_digits

    digits = load_digits()
    rng = np.random.default_rng(0)
    meta = (np.eye(4)[digits.target % 4] + 0.3 * rng.standard_normal((len(digits.target), 4))).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    np.savez(folder / "two.npz", pixels=(digits.images / 16).astype(np.float32), features=meta, label=digits.target)
    return {"name": "two", "seed": 0, "device": "cpu",
            "model": {"factory": f"{FAMILIES / 'two_input.py'}:build"},
            "trust": {"code": [f"{FAMILIES / 'two_input.py'}:build"]},  # outside the recipe's folder (issue 41)
            "data": {"format": "npz", "path": str(folder / "two.npz"), "input_column": {"image": "pixels", "meta": "features"},
                     "max_train_samples": 600, "max_eval_samples": 200},
            "stages": stages}


def _check_artifacts(result, run: Path, names: dict[str, tuple[int, list]]) -> None:
    """Parity and accuracy in each runtime, and the inputs every artifact has."""
    import openvino as ov

    m = result.metrics
    for label in ("onnx.fp32", "openvino.fp32"):  # OpenVINO with f32 forced (default: bf16 on a CPU with it)
        assert forced_f32(m, f"{label}.top1_agreement") == 1.0 and forced_f32(m, f"{label}.cosine") > 0.99999, label
        assert forced_f32(m, f"{label}.max_abs_diff") < 1e-4, label
    assert m["openvino.fp32.top1_agreement"] >= 0.98  # as OpenVINO runs it by default (bf16 on this CPU)
    assert m["onnx.fp32.accuracy"] == forced_f32(m, "openvino.fp32.accuracy") == m["evaluate.accuracy"]
    assert _onnx_inputs(run / "export/onnx/model.fp32.onnx") == names
    ir = ov.Core().read_model(str(run / "export/openvino/model.fp32.xml"))
    assert [i.get_any_name() for i in ir.inputs] == list(names)
    assert all(i.get_partial_shape()[0].is_dynamic for i in ir.inputs)
    manifest = json.loads((run / "manifest.json").read_text())
    record = next(a for a in manifest["artifacts"] if a["path"] == "export/onnx/model.fp32.onnx")["deployment"]
    assert record["input"]["names"] == list(names)


@pytest.mark.slow
def test_two_inputs_train_evaluate_and_export_to_onnx_and_openvino(tmp_path):
    recipe = _two_input_recipe(tmp_path, [
        {"type": "train", "epochs": 3, "batch_size": 32, "lr": 0.05},
        {"type": "evaluate"},
        {"type": "export", "targets": ["onnx", "openvino"], "latency": None},
    ])
    _, result = run_recipe_dict(recipe, tmp_path)
    assert result.exit_code == 0
    assert result.metrics["evaluate.accuracy"] > 0.5  # both branches learn something in 3 epochs (chance: 0.1)
    _check_artifacts(result, tmp_path / "runs/two", {"image": (1, ["batch", 1, 8, 8]), "meta": (1, ["batch", 4])})


def test_a_misspelt_input_column_key_is_named_before_any_run(tmp_path):
    from pruneflow.errors import InputError

    recipe = _two_input_recipe(tmp_path, [{"type": "evaluate"}])
    recipe["data"]["input_column"] = {"img": "pixels", "meta": "features"}
    with pytest.raises(InputError) as err:
        run_recipe_dict(recipe, tmp_path)
    assert "takes image, meta, but the data gives img, meta: nothing feeds image" in err.value.message
    assert "data.input_column: {image: COLUMN, meta: COLUMN}" in err.value.hint
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_two_inputs_prune_calibrate_and_qat(tmp_path):
    """Channel pruning (torch-pruning traces both branches), a calibration set of both inputs, QAT on it."""
    recipe = _two_input_recipe(tmp_path, [
        {"type": "train", "epochs": 3, "batch_size": 32, "lr": 0.05},
        {"type": "prune", "target": {"macs": 0.7}, "rounds": 1, "finetune": {"epochs": 1, "lr": 0.01}, "latency": None},
        {"type": "calibrate", "size": 64},
        {"type": "qat", "schedule": [{"precision": "int8", "epochs": 1}]},
        {"type": "evaluate"},
        {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32"], "latency": None},
    ])
    _, result = run_recipe_dict(recipe, tmp_path)
    m = result.metrics
    assert result.exit_code == 0
    assert m["prune.macs"] < 0.75 * m["prune.macs_before"] and m["prune.accuracy"] > 0.4
    assert m["calibrate.count"] == 64 and m["qat.accuracy_int8"] > 0.4
    info = json.loads((tmp_path / "runs/two/calibration/calibration.json").read_text())
    assert set(info["inputs"]) == {"image", "meta"}
    names = _onnx_inputs(tmp_path / "runs/two/export/onnx/model.fp32.onnx")
    assert names == {"image": (1, ["batch", 1, 8, 8]), "meta": (1, ["batch", 4])}
    assert m["onnx.fp32.top1_agreement"] == 1.0


# --------------------------------------------------------------------------- text end to end (SST-2)


def _text_recipe(model: dict, stages: list[dict]) -> dict:
    sst2 = SHARED_DATA / "sst2"
    if not (sst2 / "train.parquet").is_file():
        pytest.skip("shared sst2 data not found")
    trust = {"code": [model["factory"]]} if ":" in model["factory"] else {}  # a family file: outside the recipe's folder
    return {"name": "text", "seed": 0, "device": "cpu", "model": model, "trust": trust,
            "data": {"format": "parquet", "train": str(sst2 / "train.parquet"), "eval": str(sst2 / "dev.parquet"),
                     "input_column": "sentence", "tokenizer": str(sst2 / "vocab.txt"), "max_length": 48,
                     "max_train_samples": 500, "max_eval_samples": 200},
            "stages": stages}


# OpenVINO's default bf16 on this CPU (AMX) held the GRU's two near-zero logits to cosine 0.991 only (f32: 1.0):
# the gate is loosened to 0.98 for that; the f32 figures are asserted strictly in _check_artifacts.
TEXT_STAGES = [{"type": "train", "epochs": 2, "batch_size": 32, "lr": 0.005, "optimizer": "adamw"}, {"type": "evaluate"},
               {"type": "export", "targets": ["onnx", "openvino"], "latency": None, "parity": {"min_cosine": 0.98}}]
TOKENS = (7, ["batch", "sequence"])


def _runs_at_other_lengths(path: Path, model: torch.nn.Module, data_x: dict[str, torch.Tensor]) -> None:
    """Real dev batches, padded to other lengths than any seen, in both runtimes, equal torch's outputs."""
    from pruneflow.runtime import open_artifact

    batch = trim(take(data_x, slice(0, 5)))
    longer = {k: torch.nn.functional.pad(v, (0, 7)) for k, v in batch.items()}
    model = model.eval()
    with torch.no_grad():
        ref = call(model, batch).numpy()
    for runtime, options in [("onnxruntime", {}), ("openvino", {"precision_hint": "f32"})]:
        ex = open_artifact(path, runtime=runtime, **options)
        for x in (batch, longer, take(batch, slice(0, 1))):
            np.testing.assert_allclose(ex(feed(x)), ref[: len(x["input_ids"])], atol=2e-5, err_msg=runtime)


@pytest.mark.slow
@pytest.mark.shared_data
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_an_lstm_text_classifier_on_sst2_end_to_end(tmp_path, cell):
    from pruneflow.data import load_data
    from pruneflow.recipe import load_recipe

    model = {"factory": f"{FAMILIES / 'lstm_text.py'}:build", "kwargs": {"cell": cell, "embed_dim": 32, "hidden": 32}}
    path, result = run_recipe_dict(_text_recipe(model, TEXT_STAGES), tmp_path)
    assert result.exit_code == 0
    run = tmp_path / "runs/text"
    _check_artifacts(result, run, {"input_ids": TOKENS, "attention_mask": TOKENS})
    from pruneflow.checkpoint import load_checkpoint

    recipe = load_recipe(path).recipe
    data = load_data(recipe.data, recipe.seed, with_train=False)
    trained = load_checkpoint(run / "stages/01-train/model.pt", into=_family("lstm_text").build(**model["kwargs"])).module
    _runs_at_other_lengths(run / "export/onnx/model.fp32.onnx", trained, data.eval.x)


@pytest.mark.slow
@pytest.mark.shared_data
def test_a_tiny_bert_takes_ids_mask_and_token_types_end_to_end(tmp_path):
    pytest.importorskip("transformers")
    from pruneflow.data import load_data
    from pruneflow.recipe import load_recipe

    kwargs = {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "intermediate_size": 64, "max_positions": 64, "seed": 0}
    path, result = run_recipe_dict(_text_recipe({"factory": "bert_classifier", "kwargs": kwargs}, TEXT_STAGES), tmp_path)
    assert result.exit_code == 0
    run = tmp_path / "runs/text"
    _check_artifacts(result, run, {"input_ids": TOKENS, "attention_mask": TOKENS, "token_type_ids": TOKENS})
    from pruneflow.checkpoint import load_checkpoint
    from pruneflow.zoo.hf import bert_classifier

    recipe = load_recipe(path).recipe
    data = load_data(recipe.data, recipe.seed, with_train=False)
    assert sorted(data.eval.x) == ["attention_mask", "input_ids", "token_type_ids"]
    trained = load_checkpoint(run / "stages/01-train/model.pt", into=bert_classifier(**kwargs)).module
    _runs_at_other_lengths(run / "export/onnx/model.fp32.onnx", trained, data.eval.x)
