"""Sequential recommenders (issue 37): the next_item task against brute force, the generated interaction log, id
columns that stay int64 from the file to the artifact, NNCF on a model that reads ``Tensor.T``, MACs against torch's
FlopCounter, and SASRec / GRU4Rec end to end (train -> calibrate -> ptq -> export ONNX + OpenVINO fp32/int8) held to
the issue's bar: the INT8 artifacts' HR@10 at least 97 % of the FP32 model's, in each runtime, on 2,000 held-out users.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn

from pruneflow.tasks import MetricState, make_task
from pruneflow.tasks.next_item import topk_overlap, true_ranks
from tests.conftest import run_recipe_dict, runs_a_recipe


def _brute(scores: np.ndarray, target: np.ndarray, k: int) -> dict[str, float]:
    hr = ndcg = mrr = 0.0
    for row, t in zip(scores, target):
        rank = float((row > row[t]).sum()) + 0.5 * float((row == row[t]).sum() - 1)
        hr += rank < k
        ndcg += (1 / math.log2(rank + 2)) if rank < k else 0.0
        mrr += 1 / (rank + 1)
    n = len(target)
    return {"hr": hr / n, "ndcg": ndcg / n, "mrr": mrr / n}


def test_next_item_metrics_match_brute_force_over_batches():
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((300, 500)).astype(np.float32)
    scores[:20, :] = 0.0  # ties: a constant row ranks its item in the middle, not first
    target = rng.integers(1, 500, 300)
    scores[np.arange(40, 80), target[40:80]] += 4.0  # some hits
    task = make_task({"type": "next_item", "k": 10})
    state = MetricState()
    for part in np.array_split(np.arange(300), 7):
        task.update(state, torch.from_numpy(scores[part]), torch.from_numpy(target[part]))
    got = task.compute(state)
    want = _brute(scores, target, 10)
    for name in ("hr", "ndcg", "mrr"):
        assert got[name] == pytest.approx(want[name], rel=1e-9), name
    assert got["samples"] == 300 and 0.1 < got["hr"] < 0.3
    assert float(true_ranks(torch.zeros(1, 9), torch.tensor([3]))[0]) == 4.0


def test_next_item_headline_is_the_owners_choice_and_agreement_is_topk_overlap():
    task = make_task({"type": "next_item", "k": 5, "headline": "hr"})
    assert task.headline_name == "hr" and task.describe({"hr": 0.5}) == "HR@5 0.5000"
    ref = np.arange(20, dtype=np.float32)[None].repeat(4, 0)
    got = ref.copy()
    got[:, 15] = -1.0  # one of the five best drops out of every row
    assert topk_overlap(ref, got, 5) == pytest.approx(0.8)
    assert task.agree(ref, got)["topk_overlap"] == pytest.approx(0.8)
    assert task.metric("onnx.int8.ndcg").higher_is_better and not task.metric("loss").higher_is_better


def test_next_item_refuses_labels_beyond_the_catalogue():
    from pruneflow.errors import InputError

    task = make_task("next_item")
    with pytest.raises(InputError, match="labels go up to item 50"):
        task.check_output(torch.zeros(2, 40), torch.tensor([3, 50]), None, "sasrec")
    with pytest.raises(InputError, match="one integer item id"):
        task.read_targets(np.array([0.5, 1.5]), "next_item")


def test_seqlog_is_deterministic_and_has_a_learnable_ceiling(tmp_path):
    from pruneflow.seqlog import write

    a = write(tmp_path / "a", 3000, items=500, topics=10, seed=3)
    write(tmp_path / "b", 3000, items=500, topics=10, seed=3)
    assert (tmp_path / "a" / "train.parquet").read_bytes() == (tmp_path / "b" / "train.parquet").read_bytes()
    assert 0.3 < a["planted_hr@10_eval"] < 0.95  # far above chance (10 of 500 items: 0.02), short of certain
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "a" / "eval.parquet")
    seq = np.stack(table.column("seq").to_numpy(zero_copy_only=False))
    assert seq.dtype == np.int64 and seq.shape == (300, 20) and seq[:, -1].min() >= 1 and seq.max() < 500


def test_an_integer_input_column_reaches_the_model_as_int64(tmp_path):
    from pruneflow.data import load_data
    from pruneflow.recipe.models import DataSpec

    rng = np.random.default_rng(0)
    np.savez(tmp_path / "s.npz", seq=rng.integers(0, 50, (60, 8)), next_item=rng.integers(1, 50, 60),
             counts=rng.integers(0, 9, 60).astype(np.int32))
    for column in ("seq", {"seq": "seq"}):
        spec = DataSpec(format="npz", path=str(tmp_path / "s.npz"), input_column=column, label_column="next_item")
        data = load_data(spec, seed=0, task=make_task("next_item"))
        x = data.eval.x if isinstance(data.eval.x, torch.Tensor) else data.eval.x["seq"]
        assert x.dtype == torch.int64 and x.shape[1] == 8 and int(x.max()) < 50  # ids, never scaled or cast
    spec = DataSpec(format="npz", path=str(tmp_path / "s.npz"), input_column="counts", label_column="next_item")
    one = load_data(spec, seed=0, task=make_task("next_item")).eval.x
    assert isinstance(one, torch.Tensor) and one.dtype == torch.int64 and one.shape[1:] == (1,)


class _FunctionalTie(nn.Module):
    """An owner's SASRec-like scorer: the tie written as ``h @ table.weight.T`` (a tensor property NNCF records)."""

    def __init__(self, items: int = 300, dim: int = 16):
        super().__init__()
        self.items = nn.Embedding(items, dim, padding_idx=0)
        self.mix = nn.Linear(dim, dim)

    def forward(self, seq):
        return self.mix(self.items(seq).mean(1)) @ self.items.weight.T


def test_nncf_quantizes_a_model_that_reads_a_tensor_property():
    """`TypeError: cannot pickle 'getset_descriptor'` (issue 37): NNCF deep-copied its graph holding Tensor.T's getter."""
    pytest.importorskip("nncf")
    from pruneflow.calibrate.calibset import CalibrationSet
    from pruneflow.qat.nncf_quant import quantize

    torch.manual_seed(0)
    model = _FunctionalTie().eval()
    seq = torch.randint(1, 300, (64, 12))
    quantized = quantize(model, CalibrationSet(x={"seq": seq}, y=None, meta={}))
    with torch.no_grad():
        a, b = model(seq), quantized(seq)
    assert b.shape == (64, 300)
    assert float(torch.nn.functional.cosine_similarity(a, b).mean()) > 0.99


def _flop_counter_macs(model: nn.Module, *x) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.eval()(*x)
    return counter.get_total_flops() // 2


#: Attention scores and weighted values, 2 x L^2 x dim MACs a block: torch 2.13's FlopCounter has no formula for the CPU
#: attention kernel (``_scaled_dot_product_flash_attention_for_cpu``) and counts them 0; added to its figure here.
SASREC_ATTENTION = 2 * 2 * 20 * 20 * 32


@pytest.mark.parametrize("name, kwargs, x, uncounted", [
    ("sasrec", {"num_items": 5000, "dim": 32}, torch.randint(1, 99, (1, 20)), SASREC_ATTENTION),
    ("gru4rec", {"num_items": 5000, "dim": 32, "hidden": 48}, torch.randint(1, 99, (1, 20)), 0),
    ("mmoe", {"cardinalities": [10, 20, 30], "num_dense": 3}, (torch.randint(0, 9, (1, 3)), torch.randn(1, 3)), 0),
    ("dlrm", {"cardinalities": [10, 20, 30], "num_dense": 3}, (torch.randint(0, 9, (1, 3)), torch.randn(1, 3)), 0),
    ("dlrm_bags", {"cardinalities": [10, 20], "bag_cardinalities": [50, 60], "bag_length": 4, "num_dense": 3},
     (torch.randint(0, 9, (1, 2)), torch.randint(0, 40, (1, 2, 4)), torch.randn(1, 3)), 0),
    ("resnet20", {}, torch.randn(1, 3, 32, 32), 0),
])
def test_macs_are_within_5_percent_of_torchs_flop_counter(name, kwargs, x, uncounted):
    from pruneflow.evaluate import count_macs_params, layer_table
    from pruneflow.inputs import forward_names
    from pruneflow.zoo import ZOO

    model = ZOO[name].factory(**kwargs)
    example = x if isinstance(x, torch.Tensor) else dict(zip(forward_names(model) or [], x))
    macs, params = count_macs_params(model, example)
    want = _flop_counter_macs(model, *(x if isinstance(x, tuple) else (x,))) + uncounted
    assert abs(macs - want) <= 0.05 * want, (macs, want)
    rows, total, total_params = layer_table(model, example)
    assert (total, total_params) == (macs, params)
    assert sum(r["macs"] for r in rows) == macs and sum(r["params"] for r in rows) == params  # a tied table once


def test_macs_count_a_grus_steps_and_a_tied_matmul():
    from pruneflow.evaluate import count_macs_params
    from pruneflow.zoo import ZOO

    gru = ZOO["gru4rec"].factory(num_items=5000, dim=32, hidden=48)
    steps, gates = 20, 3
    assert count_macs_params(gru, torch.randint(1, 9, (1, steps)))[0] == steps * gates * (32 * 48 + 48 * 48) + 48 * 5000
    tied = _FunctionalTie(items=300, dim=16)
    macs, params = count_macs_params(tied, torch.randint(1, 9, (1, 12)))
    assert macs == 16 * 16 + 16 * 300  # the mix Linear and the scores against the table
    assert params == 300 * 16 + 16 * 16 + 16


def _sequence_recipe(factory: str, kwargs: dict) -> dict:
    return {
        "name": factory, "seed": 0,
        "model": {"factory": factory, "kwargs": {"num_items": 1500, **kwargs}},
        "task": {"type": "next_item", "k": 10, "headline": "hr"},
        "data": {"format": "seqlog", "seqlog": {"rows": 20000, "items": 1500, "topics": 30, "seed": 0, "eval_fraction": 0.1},
                 "input_column": "seq", "label_column": "next_item", "eval_batch_size": 500},
        "stages": [
            {"type": "train", "epochs": 3, "batch_size": 256, "lr": 0.004, "optimizer": "adamw"},
            {"type": "calibrate", "size": 256},
            {"type": "ptq"},
            {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32", "int8"], "latency": None},
        ],
    }


@pytest.fixture(scope="module", params=[("sasrec", {"dim": 32, "heads": 2, "blocks": 2}), ("gru4rec", {"dim": 32, "hidden": 48})],
                ids=["sasrec", "gru4rec"])
@runs_a_recipe
def sequence_run(request, tmp_path_factory):
    pytest.importorskip("nncf")
    folder = tmp_path_factory.mktemp(request.param[0])
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(folder / "cache"))
    try:
        _, result = run_recipe_dict(_sequence_recipe(*request.param), folder)
    finally:
        mp.undo()
    return folder / "runs" / request.param[0], result


def test_sequence_models_keep_hr_at_10_through_int8_in_both_runtimes(sequence_run):
    run, result = sequence_run
    assert result.exit_code == 0
    flat = json.loads((run / "metrics.json").read_text())["flat"]
    fp32 = flat["onnx.fp32.hr"]
    assert fp32 > 0.15  # learned far above chance (10 of 1,500 items)
    assert flat["ptq.eval_samples"] == 2000
    for artifact in ("onnx.int8", "openvino.int8"):
        assert flat[f"{artifact}.hr"] >= 0.97 * fp32, (artifact, flat[f"{artifact}.hr"], fp32)
        assert flat[f"{artifact}.topk_overlap"] >= 0.8
    assert flat["onnx.int8.size_mb"] < flat["onnx.fp32.size_mb"] / 2


def test_sequence_artifacts_take_int64_ids(sequence_run):
    import onnx

    run, _ = sequence_run
    for name in ("model.fp32.onnx", "model.int8.onnx"):
        model = onnx.load(str(run / "export" / "onnx" / name))
        (inp,) = model.graph.input
        assert inp.type.tensor_type.elem_type == onnx.TensorProto.INT64
        record = json.loads({p.key: p.value for p in model.metadata_props}["pruneflow.input"])
        assert record["dtype"] == "int64" and record["shape"][1:] == [20]  # the last 20 items, left-padded with 0


def test_an_fp16_sasrec_opens_in_onnxruntime(tmp_path):
    """onnxruntime 1.32's NchwcTransformer segfaulted loading an FP16 SASRec (the run died, exit 139, no message);
    the runtime layer turns that pass off for float16 graphs. In a subprocess: a regression kills it, not pytest."""
    import subprocess
    import sys

    from pruneflow.export.onnx import export_onnx, to_fp16
    from pruneflow.zoo import ZOO

    torch.manual_seed(0)
    model = ZOO["sasrec"].factory(num_items=500, dim=32, heads=2, blocks=1, max_len=8).eval()
    export_onnx(model, torch.randint(1, 500, (2, 8)), tmp_path / "fp32.onnx")
    to_fp16(tmp_path / "fp32.onnx", tmp_path / "fp16.onnx")
    code = ("import numpy as np; from pruneflow.runtime import open_artifact; "
            f"out = open_artifact({str(tmp_path / 'fp16.onnx')!r}).run(np.ones((3, 8), np.int64)); print(out.shape)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(3, 500)"


def test_a_grus_float_weights_are_said():
    from pruneflow.qat.stage import recurrent_float_notes
    from pruneflow.zoo import ZOO

    rows = recurrent_float_notes(ZOO["gru4rec"].factory(num_items=100, dim=8, hidden=16))
    assert [(r["layer"], r["type"]) for r in rows] == [("gru", "GRU")] and "stays float" in rows[0]["note"]
    assert recurrent_float_notes(ZOO["sasrec"].factory(num_items=100, dim=8)) == []
