"""The `embedding` task: cosine and recall@k against hand-computed cases, constant outputs, worst-row parity, the
importance probe, the reference targets a run takes from the given model, the bert_embedder, and a tiny sentence
encoder through evaluate → prune → calibrate → ptq → export with its INT8 ONNX judged against the FP32 vectors."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from pruneflow.errors import InputError
from pruneflow.tasks import MetricState, make_task
from pruneflow.tasks.embedding import recall_at_k

from conftest import SHARED_DATA, optimize_json


def at(degrees: list[float]) -> torch.Tensor:
    """Unit vectors at these angles in the plane (a zero third value: the task reads [B, D] of any D)."""
    r = np.radians(degrees)
    return torch.tensor(np.stack([np.cos(r), np.sin(r), np.zeros_like(r)], 1), dtype=torch.float32)


def figures(task, got: torch.Tensor, ref: torch.Tensor, batch: int = 2) -> dict:
    state = MetricState()
    for i in range(0, len(got), batch):  # over several batches, as evaluation feeds it
        task.update(state, got[i : i + batch], ref[i : i + batch])
    return task.compute(state)


# ------------------------------------------------------------------------------------------- metrics by hand


def test_cosine_recall_and_mse_match_a_hand_computed_case():
    """Reference rows at 0, 10, 30, 90 and 100 degrees; the model moves row 1 to 25 degrees. Nearest neighbours
    (k=1) by the reference: 1, 0, 1, 4, 3; by the model: 1, 2, 1, 4, 3 (row 1 now lies 5 degrees from row 2 and
    25 from row 0): 4 of 5 agree. With k=2 every row keeps both of its neighbours."""
    ref, got = at([0, 10, 30, 90, 100]), at([0, 25, 30, 90, 100])
    one = figures(make_task({"type": "embedding", "k": 1}), got, ref)
    assert one["recall@1"] == pytest.approx(0.8)
    assert one["ref_cosine"] == pytest.approx((4 + math.cos(math.radians(15))) / 5, abs=1e-6)
    # one row differs by (cos 25 - cos 10, sin 25 - sin 10, 0): squared distance 2 - 2 cos 15, over 5 x 3 values
    assert one["mse"] == pytest.approx((2 - 2 * math.cos(math.radians(15))) / 15, abs=1e-6)
    assert one["samples"] == 5
    assert figures(make_task({"type": "embedding", "k": 2}), got, ref)["recall@2"] == pytest.approx(1.0)
    same = figures(make_task("embedding"), ref, ref)  # k=10 is capped at the 4 other rows
    assert same == {"ref_cosine": pytest.approx(1.0), "recall@10": 1.0, "mse": 0.0, "samples": 5}


def test_recall_counts_shared_neighbours_in_chunks_as_in_one_block(monkeypatch):
    """The similarity matrix is computed in row chunks: the count must not depend on where the chunks fall."""
    import pruneflow.tasks.embedding as embedding

    gen = np.random.default_rng(0)
    ref = gen.normal(size=(70, 6))
    got = ref + 0.4 * gen.normal(size=ref.shape)
    whole = recall_at_k(got, ref, 5)
    monkeypatch.setattr(embedding, "CHUNK", 16)
    assert recall_at_k(got, ref, 5) == whole
    brute = np.mean([len(set(_nearest_brute(got, i, 5)) & set(_nearest_brute(ref, i, 5))) / 5 for i in range(70)])
    assert whole == pytest.approx(brute)
    assert 0.2 < whole < 0.9  # noise at 0.4 of the spread moves some neighbours, not all


def _nearest_brute(v: np.ndarray, i: int, k: int) -> list[int]:
    unit = v / np.linalg.norm(v, axis=1, keepdims=True)
    sims = [(float(unit[i] @ unit[j]), j) for j in range(len(v)) if j != i]
    return [j for _, j in sorted(sims, reverse=True)[:k]]


def test_a_constant_model_retrieves_nothing_and_a_constant_reference_is_refused():
    task = make_task("embedding")
    ref = at([0, 20, 40, 60, 80, 100])
    constant = at([45] * 6)
    got = figures(task, constant, ref)
    assert got["recall@10"] == 0.0  # ties everywhere: no neighbours to share
    assert got["ref_cosine"] < 0.9
    with pytest.raises(InputError, match="same vector for all 6 rows"):
        task.reference_targets(constant, "eval", "my_encoder")
    with pytest.raises(InputError, match="1 of its 6 vectors are all zeros"):
        task.reference_targets(torch.cat([ref[:5], torch.zeros(1, 3)]), "train", "my_encoder")
    nan = ref.clone()
    nan[2, 0] = float("nan")
    with pytest.raises(InputError, match="NaN"):
        task.reference_targets(nan, "eval", "my_encoder")
    assert torch.equal(task.reference_targets(ref, "eval", "my_encoder"), ref)


def test_an_output_that_is_no_embedding_is_refused_naming_the_shape():
    task = make_task("embedding")
    for output, why in ((torch.zeros(4, 1), "logit or class scores"), (torch.zeros(4, 2), "logit or class scores"),
                        (torch.zeros(4), r"one vector a sample \(\[B, D\]\)"), (torch.zeros(4, 8, 3), r"\[B, D\]"),
                        (torch.zeros(4, 8, dtype=torch.int64), "float vectors")):
        with pytest.raises(InputError, match=why):
            task.check_output(output, torch.zeros(4), None, "my_encoder")
    task.check_output(torch.zeros(4, 8), torch.zeros(4), None, "my_encoder")


def test_parity_is_the_worst_rows_cosine_beside_the_mean():
    task = make_task("embedding")
    ref = at([0, 20, 40, 60, 80, 100]).numpy()
    got = ref.copy()
    got[3] = at([90]).numpy()[0]  # one row off by 30 degrees
    figures = task.agree(ref, got)
    assert figures["worst_cosine"] == pytest.approx(math.cos(math.radians(30)), abs=1e-6)
    assert figures["cosine"] == pytest.approx((5 + math.cos(math.radians(30))) / 6, abs=1e-6)
    assert figures["parity_samples"] == 6
    assert task.agreement.name == "worst_cosine" and task.agreement_limits["int8"] == 0.98


def test_recall_is_named_after_k_and_read_back_by_gates():
    from pruneflow.gates import check_gates
    from pruneflow.recipe.models import GateSpec

    task = make_task({"type": "embedding", "k": 5})
    assert [m.name for m in task.metrics] == ["ref_cosine", "recall@5", "mse"]
    assert task.summary()["metrics"] == {"ref_cosine": "higher", "recall@5": "higher", "mse": "lower"}
    assert task.metric("onnx.int8.recall@5_f32").name == "recall@5"
    gate = GateSpec(metric="onnx.int8.recall@5", baseline="evaluate.recall@5", max_drop=0.01)
    assert check_gates([gate], {"onnx.int8.recall@5": 0.995, "evaluate.recall@5": 1.0}, task)[0].passed
    assert not check_gates([gate], {"onnx.int8.recall@5": 0.98, "evaluate.recall@5": 1.0}, task)[0].passed


# ------------------------------------------------------------------------------------------- training and pruning


def test_losses_pull_to_the_reference_and_distillation_to_the_teacher():
    ref = at([0, 30, 60, 90])
    got = at([10, 30, 60, 90]) * 3.0  # longer vectors: cosine ignores the length, mse does not
    cosine = make_task("embedding")
    assert float(cosine.loss(got, ref)) == pytest.approx((1 - math.cos(math.radians(10))) / 4, abs=1e-6)
    assert float(cosine.distill_loss(got, ref, 4.0)) == pytest.approx(float(cosine.loss(got, ref)))
    mse = make_task({"type": "embedding", "loss": "mse"})
    assert float(mse.loss(got, ref)) == pytest.approx(float(((got - ref) ** 2).mean()))


def test_hessian_scores_through_the_probe_rank_heads_as_their_measured_damage_does(tmp_path):
    """On a BERT encoder at its reference (its own vectors as targets), the plain loss gives every head a score of
    ~1e-18, noise; through ``importance_loss`` each layer's heads score in the order that removing each alone
    actually moves the vectors (1 − mean cosine, measured)."""
    pytest.importorskip("transformers")
    from pruneflow import registry
    from pruneflow.data import load_tokenizer
    from pruneflow.prune.transformer import attention_sites, unit_importance, unit_masks

    (tmp_path / "vocab.txt").write_text("\n".join(VOCAB + WORDS) + "\n")
    enc = load_tokenizer(str(tmp_path / "vocab.txt"))(sentences(128, 3), padding=True, return_tensors="pt")
    x = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
    task, model = make_task("embedding"), trained_like(tiny_embedder()).eval()
    with torch.no_grad():
        ref = model(**x)
    batches = [({k: v[i : i + 32] for k, v in x.items()}, ref[i : i + 32]) for i in range(0, 128, 32)]
    hessian = registry.criteria.get("hessian")()
    plain, _ = unit_importance(model, batches, task.loss, hessian)
    assert max(float(s.max()) for s in plain.values()) < 1e-12
    scores, _ = unit_importance(model, batches, task.importance_loss, hessian)
    for site in attention_sites(model):
        damage = []
        for head in range(site.heads):
            with torch.no_grad(), unit_masks(model, head_mask={site.name: (torch.arange(site.heads) != head).float()}):
                damage.append(1 - float(torch.nn.functional.cosine_similarity(model(**x), ref).mean()))
        assert int(scores[site.name].argmin()) == int(np.argmin(damage)), (site.name, scores[site.name], damage)
        assert int(scores[site.name].argmax()) == int(np.argmax(damage)), (site.name, scores[site.name], damage)


def test_the_importance_probe_ranks_units_where_the_loss_has_no_gradient():
    """At the unpruned model the output equals its target: the loss and every gradient are 0, so Taylor or Hessian
    scores would rank nothing. The probe's per-row squared gradients rank each unit by how far it moves the
    vectors (here a unit's column of ``mix`` has norm 0.1, 1 or 3), under vmap as the channels' Fisher runs it."""
    from torch.func import grad, vmap

    task = make_task("embedding")
    gen = torch.Generator().manual_seed(0)
    mix = torch.randn(16, 3, generator=gen)
    mix = mix / mix.norm(dim=0) * torch.tensor([0.1, 1.0, 3.0])
    hidden = torch.randn(400, 3, generator=gen)

    def vectors(mask: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        return (h * mask) @ mix.T

    ones = torch.ones(3)
    target = vectors(ones, hidden)
    loss_grad = grad(lambda m: task.loss(vectors(m, hidden), target))(ones)
    assert loss_grad.abs().max() < 1e-6
    per_row = vmap(grad(lambda m, h, y: task.importance_loss(vectors(m, h[None]), y[None])), in_dims=(None, 0, 0))(
        ones, hidden, target)
    fisher = per_row.pow(2).mean(0)
    # σ is a tenth of each row's own RMS, so rows weigh by their inverse length and the ratios are not exactly the
    # columns' squared norms (1 : 100 : 900); the order, with wide margins, is what pruning reads
    assert 0 < 10 * fisher[0] < fisher[1] < fisher[2] / 2


# ------------------------------------------------------------------------------------------- the model and the run

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("a film the movie was is good bad great dull funny sad long short story plot actor actors scene scenes "
         "music score very quite not really an and but with of to it this that its").split()


def sentences(n: int, seed: int = 0) -> list[str]:
    gen = np.random.default_rng(seed)
    return [" ".join(gen.choice(WORDS, size=int(gen.integers(3, 12)))) for _ in range(n)]


def tiny_embedder(seed: int = 0):
    from pruneflow.zoo.hf import bert_embedder

    return bert_embedder(vocab_size=len(VOCAB) + len(WORDS), hidden_size=32, num_layers=2, num_heads=4,
                         intermediate_size=64, max_positions=32, seed=seed).eval()


def trained_like(model):
    """Random init leaves every attention and FFN branch small beside the residual stream, so the vectors hardly
    depend on them and quantizing them changes nothing: give the matrices a trained model's weight."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embeddings" not in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.25)
    return model


def test_bert_embedder_mean_pools_over_the_mask_and_normalises():
    pytest.importorskip("transformers")
    model = tiny_embedder()
    ids = torch.randint(5, len(VOCAB) + len(WORDS), (3, 9))
    mask = torch.ones_like(ids)
    padded, padded_mask = torch.nn.functional.pad(ids, (0, 5)), torch.nn.functional.pad(mask, (0, 5))
    with torch.no_grad():
        vectors = model(ids, mask)
        assert vectors.shape == (3, 32)
        torch.testing.assert_close(vectors.norm(dim=1), torch.ones(3))
        torch.testing.assert_close(model(padded, padded_mask), vectors, rtol=1e-5, atol=1e-6)  # padding changes nothing
        torch.testing.assert_close(model(padded), vectors, rtol=1e-5, atol=1e-6)  # no mask: padding ids left out
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
        torch.testing.assert_close(vectors, torch.nn.functional.normalize(hidden.mean(1), dim=-1))
    assert not hasattr(model.model, "pooler") or model.model.pooler is None


def test_the_shared_minilm_embeds_paraphrases_closer_than_unrelated_sentences():
    pytest.importorskip("transformers")
    folder = SHARED_DATA / "minilm_l6_h384"
    if not (folder / "model.safetensors").is_file():
        pytest.skip(f"shared MiniLM-L6 not found at {folder}")
    from pruneflow.data import load_tokenizer
    from pruneflow.zoo.hf import bert_embedder

    model, tok = bert_embedder(str(folder)).eval(), load_tokenizer(str(folder))
    batch = tok(["a gripping , well acted film", "a thrilling movie with fine acting", "the stock market fell today"],
                padding=True, return_tensors="pt")
    with torch.no_grad():
        v = model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    assert v.shape == (3, 384)
    assert float(v[0] @ v[1]) > float(v[0] @ v[2]) + 0.2


def write_corpus(folder, n: int, labelled: bool = True) -> dict:
    """A corpus of ``n`` sentences with a constant label column (which this task ignores; classification refuses
    it) or none, a WordPiece vocab of its words, and the data section of a recipe reading them."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"sentence": s, "label": 0} if labelled else {"sentence": s} for s in sentences(n)]
    (folder / "corpus.json").write_text(json.dumps(rows))
    (folder / "vocab.txt").write_text("\n".join(VOCAB + WORDS) + "\n")
    return {"format": "json", "path": str(folder / "corpus.json"), "input_column": "sentence",
            "tokenizer": str(folder / "vocab.txt"), "max_length": 16, "eval_fraction": 0.25, "eval_batch_size": 16}


def test_the_reference_targets_are_the_given_models_vectors_row_by_row(tmp_path):
    """load_inputs runs the model the recipe gives over every split, once, before any stage: each row's target is
    that model's vector of the row, whatever order the length-sorted batches ran in. The corpus has no label
    column: this task needs none."""
    pytest.importorskip("transformers")
    from pruneflow.context import Reporter
    from pruneflow.inputs import take, trim
    from pruneflow.prepare import load_inputs, plan_stages
    from pruneflow.recipe import load_recipe

    recipe = {"name": "refs", "seed": 0, "device": "cpu", "task": {"type": "embedding", "k": 3},
              "model": {"factory": "bert_embedder", "kwargs": {"vocab_size": len(VOCAB) + len(WORDS), "hidden_size": 32,
                                                               "num_layers": 2, "num_heads": 4, "intermediate_size": 64,
                                                               "max_positions": 32, "seed": 0}},
              "data": write_corpus(tmp_path, 40, labelled=False), "stages": [{"type": "train", "epochs": 1}]}
    (tmp_path / "recipe.yaml").write_text(json.dumps(recipe))
    loaded = load_recipe(tmp_path / "recipe.yaml")
    inputs = load_inputs(loaded, plan_stages(loaded), Reporter())
    for split in (inputs.data.train, inputs.data.eval):
        assert split.y.shape == (len(split), 32)
        with torch.no_grad():
            for i in (0, len(split) - 1):
                row = trim(take(split.x, slice(i, i + 1)))
                torch.testing.assert_close(inputs.model(**row)[0], split.y[i], rtol=1e-4, atol=1e-5)
    assert len(inputs.data.train) == 30 and len(inputs.data.eval) == 10
    doctor = load_inputs(loaded, plan_stages(loaded), Reporter(), probe_rows=4)  # doctor: the rows it probes alone
    assert len(doctor.data.eval) == 4 and torch.equal(doctor.data.eval.y, inputs.data.eval.y[:4])


@pytest.mark.slow
def test_a_tiny_sentence_encoder_prunes_quantizes_and_exports_close_to_its_fp32_vectors(tmp_path):
    pytest.importorskip("transformers")
    finetune = {"epochs": 1, "batch_size": 16, "optimizer": "adamw", "lr": 0.001, "weight_decay": 0.0}
    torch.save(trained_like(tiny_embedder()).state_dict(), tmp_path / "encoder.pt")
    recipe = {
        "name": "embed", "seed": 0, "device": "cpu", "task": {"type": "embedding", "k": 5},
        "model": {"factory": "bert_embedder", "checkpoint": str(tmp_path / "encoder.pt"),
                  "kwargs": {"vocab_size": len(VOCAB) + len(WORDS), "hidden_size": 32, "num_layers": 2, "num_heads": 4,
                             "intermediate_size": 64, "max_positions": 32}},
        "data": write_corpus(tmp_path, 240),
        "stages": [
            {"type": "evaluate"},
            {"type": "prune", "granularity": "heads", "target": {"heads": 0.25}, "importance": "hessian", "rounds": 1,
             "importance_batches": 2, "finetune": finetune, "distill": {"alpha": 0.5}},
            {"type": "calibrate", "size": 64, "strategy": "stratified", "by": "length"},
            {"type": "ptq"},
            {"type": "export", "targets": ["onnx"], "precisions": ["fp32", "int8"], "latency": None},
        ],
        # gates read the task's figures by name, `@` included: INT8 keeps the pruned FP32 model's vectors and neighbours
        "gates": [{"metric": "onnx.int8.recall@5", "baseline": "onnx.fp32.recall@5", "max_drop": 0.05},
                  {"metric": "onnx.int8.ref_cosine", "baseline": "onnx.fp32.ref_cosine", "max_drop": 0.005}],
    }
    out, stages, artifacts = optimize_json(recipe, tmp_path)
    assert out["task"]["headline"] == "ref_cosine" and out["task"]["agreement"] == "worst_cosine"
    assert stages["evaluate"]["ref_cosine"] == pytest.approx(1.0, abs=1e-6) and stages["evaluate"]["recall@5"] == 1.0
    prune = stages["prune"]
    assert (prune["heads_before"], prune["heads"]) == (8, 6) and 0.9 < prune["ref_cosine"] < 1.0  # 0.946 here
    assert stages["ptq"]["ref_cosine"] == pytest.approx(prune["ref_cosine"], abs=0.005)
    fp32, int8 = artifacts["model.fp32.onnx"], artifacts["model.int8.onnx"]
    assert fp32["worst_cosine"] > 0.9999 and fp32["ref_cosine"] == pytest.approx(prune["ref_cosine"], abs=1e-4)
    # the INT8 ONNX against the quantized torch model (parity) and against the FP32 model (every row)
    assert int8["worst_cosine"] > 0.99 and int8["worst_cosine_fp32"] > 0.99  # 0.99999 and 0.9994 here
    assert int8["ref_cosine"] == pytest.approx(fp32["ref_cosine"], abs=0.005) and int8["size_ratio_fp32"] > 1.5
    assert all(g["passed"] for g in out["gates"]), out["gates"]
    assert {g["name"] for g in out["gates"]} >= {"onnx.int8.recall@5", "onnx.int8.parity"}
