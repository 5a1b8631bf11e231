"""Issue 15, quantization: every layout NNCF produces exports to INT8 (both forms) and runs in onnxruntime
and OpenVINO at parity with the quantized torch model; what NNCF cannot quantize is refused before training.

Families: tests/families/mobilenet_se.py (an nn.Sequential top module, depthwise convs, squeeze-excite
gates: per-channel activation quantizers, SE convs NNCF keeps float), tests/families/densenet.py (dense
concatenation; `ignore` cases), and a small nn.MultiheadAttention ViT written here (class token, position
embedding, pre-norm blocks). Models are trained for a few steps on the built-in digits so their logits
mean something; every figure asserted is measured from real NNCF, onnxruntime and OpenVINO runs.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import numpy as np
import pytest


import torch
from torch import nn

from tests.conftest import invoke, write

pytest.importorskip("nncf")
ort = pytest.importorskip("onnxruntime")

FAMILIES = Path(__file__).resolve().parent / "families"


def family(name: str):
    spec = importlib.util.spec_from_file_location(f"family_{name}", FAMILIES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build


@pytest.fixture(scope="module")
def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images / 16.0, dtype=torch.float32)[:, None]
    return x, torch.tensor(d.target)


def trained(model: nn.Module, digits, steps: int = 120, lr: float = 3e-3) -> nn.Module:
    """A few Adam steps on the first 1400 digits: enough for logits that mean something."""
    x, y = digits
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr)
    model.train()
    for step in range(steps):
        idx = torch.randint(0, 1400, (64,))
        loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


class Block(nn.Module):
    """Pre-norm encoder block on nn.MultiheadAttention: x + attn(norm(x)), x + mlp(norm(x))."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyViT(nn.Module):
    """Patch-embedding conv, class token, position embedding, pre-norm blocks (torchvision-style), 8x8 input."""

    def __init__(self, dim: int = 32, heads: int = 4, depth: int = 2, patch: int = 2, classes: int = 10):
        super().__init__()
        self.patch = nn.Conv2d(1, dim, patch, patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, (8 // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*[Block(dim, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        t = self.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.cls.expand(t.shape[0], -1, -1), t], 1) + self.pos
        return self.head(self.norm(self.blocks(t))[:, 0])


def quantized(model: nn.Module, digits, ignore=None):
    from pruneflow.calibrate.calibset import CalibrationSet
    from pruneflow.qat.nncf_quant import quantize
    from pruneflow.qat.settings import NncfSettings

    return quantize(model, CalibrationSet(digits[0][:128]), NncfSettings(ignore=ignore or [], batch_size=32),
                    ignore_loc=("stages", 1, "ignore")).eval()


def export_both(q: nn.Module, digits, tmp_path: Path) -> dict:
    """Both INT8 forms of the quantized model: {form: (path, PassReport)}."""
    from pruneflow.export.onnx import export_int8_onnx
    from pruneflow.qat.nncf_quant import strip_quantizers

    example = digits[0][:1]
    stripped = strip_quantizers(q, example)
    return {form: (tmp_path / f"{form}.onnx", export_int8_onnx(stripped, example, tmp_path / f"{form}.onnx", form=form))
            for form in ("cpu", "tensorrt")}


def run_ort(path: Path, x: torch.Tensor) -> np.ndarray:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"input": x.numpy()})[0]


def run_ort_exact(path: Path, x: torch.Tensor) -> np.ndarray:
    """TensorRT's form in onnxruntime, its integer kernels in their non-saturating mode (what the export checks)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, {"input": x.numpy()})[0]


def run_openvino(path: Path, x: torch.Tensor) -> np.ndarray:
    ov = pytest.importorskip("openvino")
    compiled = ov.Core().compile_model(ov.convert_model(str(path)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return compiled(x.numpy())[compiled.output(0)]


def parity(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """(mean cosine, top-1 agreement) of two logit arrays."""
    cos = (ref * got).sum(1) / (np.linalg.norm(ref, axis=1) * np.linalg.norm(got, axis=1))
    return float(cos.mean()), float((ref.argmax(1) == got.argmax(1)).mean())


def check_runtimes(q: nn.Module, files: dict, digits, min_top1: float = 0.95) -> dict:
    """Both forms in onnxruntime and the cpu form in OpenVINO: parity with the quantized torch model and accuracy."""
    x, y = digits[0][1400:], digits[1][1400:].numpy()
    with torch.no_grad():
        ref = q(x).numpy()
    torch_acc = float((ref.argmax(1) == y).mean())
    measured = {"torch": torch_acc}
    runs = [("ort_cpu", run_ort, "cpu"), ("ort_tensorrt", run_ort_exact, "tensorrt"), ("openvino_cpu", run_openvino, "cpu")]
    for label, runner, form in runs:
        got = runner(files[form][0], x)
        cosine, top1 = parity(ref, got)
        accuracy = float((got.argmax(1) == y).mean())
        measured[label] = (cosine, top1, accuracy)
        assert cosine > 0.99 and top1 >= min_top1, (label, cosine, top1)
        assert abs(accuracy - torch_acc) <= 0.03, (label, accuracy, torch_acc)
    print("measured (cosine, top-1 agreement, accuracy):", measured)  # shown with pytest -s
    return measured


@pytest.mark.slow  # ~40 s of CPU: a few training steps, NNCF, two exports, two runtimes
def test_densenet_ignore_fc_exports_both_int8_forms(digits, tmp_path):
    """`ignore: ['fc']` used to fail the convention check (`input 't413' is not dequantized`); fc now runs in
    float, named in the artifact notes, and both forms match the quantized torch model in both runtimes."""
    model = trained(family("densenet")(), digits, steps=80)
    q = quantized(model, digits, ignore=["fc"])
    assert not any("fc" in n and "pre_hooks" in n for n, _ in q.named_modules())  # no weight quantizer on fc
    files = export_both(q, digits, tmp_path)
    for form, (_, report) in files.items():
        assert report.float_ops == ["Gemm /fc/Gemm"], form
        assert any("kept in float" in n and "/fc/Gemm" in n for n in report.notes)
    measured = check_runtimes(q, files, digits)
    assert measured["torch"] > 0.5  # trained: the agreement above is about real predictions


@pytest.mark.slow  # ~40 s of CPU: a few training steps, NNCF, two exports, two runtimes
def test_mobilenet_se_sequential_top_and_per_channel_activations(digits, tmp_path):
    """An nn.Sequential top module quantizes (it used to fail with NNCF's HookStorage error); NNCF puts
    per-channel activation quantizers before the depthwise convs and keeps the SE convs float; both forms export."""
    from nncf.torch.quantization.layers import SymmetricQuantizer

    from pruneflow.qat.nncf_quant import SequentialRoot

    model = trained(family("mobilenet_se")(), digits, steps=80)
    assert isinstance(model, nn.Sequential)
    q = quantized(model, digits)
    assert isinstance(q, SequentialRoot)
    per_channel_acts = [n for n, m in q.named_modules()
                        if isinstance(m, SymmetricQuantizer) and m.per_channel and "post_hooks" in n]
    assert per_channel_acts, "the layout under test: per-channel activation quantizers"
    assert all(m.signed for m in q.modules() if isinstance(m, SymmetricQuantizer))
    files = export_both(q, digits, tmp_path)
    assert any("per-channel activation quantizer" in n for n in files["tensorrt"][1].notes)
    import onnx

    cpu = onnx.load(str(files["cpu"][0]))
    inits = {i.name: i for i in cpu.graph.initializer}
    per_channel_q = [n for n in cpu.graph.node if n.op_type == "QuantizeLinear" and n.input[0] not in inits
                     and len(inits[n.input[1]].dims) == 1]
    assert per_channel_q  # the cpu form keeps the per-channel grid as it was trained
    assert all(any("reduce" in f or "expand" in f for f in files[form][1].float_ops) for form in files)
    check_runtimes(q, files, digits)


def test_ignore_entries_with_dots_match_and_unknown_ones_are_refused(digits):
    """A regex over dotted module names selects those modules (NNCF's node names use '/'); an entry that
    selects nothing is a ConfigError on that entry naming the closest module names."""
    from pruneflow.errors import ConfigError

    model = family("densenet")().eval()
    q = quantized(model, digits, ignore=[r"features\.[01]\.conv", "stem"])
    weights = " ".join(n for n, _ in q.named_modules() if "pre_hooks." in n)  # weight quantizers
    assert "features/0/conv" not in weights and "features/1/conv" not in weights and "stem/" not in weights
    assert "features/2/conv" in weights  # the rest is quantized
    with pytest.raises(ConfigError) as caught:
        quantized(family("densenet")().eval(), digits, ignore=["fc", "features.9.conv"])
    assert caught.value.loc == ("stages", 1, "ignore", 1)
    assert "features.9.conv" in str(caught.value) and "features." in (caught.value.hint or "")


@pytest.mark.slow  # ~40 s of CPU: a few training steps, NNCF, two exports, two runtimes
def test_vit_attention_int8_both_forms_agree_with_quantized_torch(digits, tmp_path):
    """nn.MultiheadAttention ViT: NNCF quantizes the projections and leaves the score/context MatMuls of two
    activations in float (recorded in the notes); both forms agree with the quantized torch model >= 0.98."""
    model = trained(TinyViT(), digits, steps=150)
    q = quantized(model, digits)
    files = export_both(q, digits, tmp_path)
    for form in files:
        floats = files[form][1].float_ops
        assert any(f.startswith("MatMul") for f in floats), (form, floats)
        assert not any(f.startswith("Gemm") and "in_proj" in f for f in floats)
    check_runtimes(q, files, digits, min_top1=0.98)


def test_transformer_encoder_exports_with_frozen_weights_and_no_grad(tmp_path):
    """torch's fused encoder kernel (taken under no_grad or with frozen weights) has no ONNX form; the export
    turns that fast path off, so the ONNX (which OpenVINO converts) is written and matches torch."""
    from pruneflow.export.onnx import export_onnx

    layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True, dropout=0.0)
    # (N, 1, 8, 8) -> 8 tokens of 8 pixel values each
    model = nn.Sequential(nn.Flatten(1, 2), nn.Linear(8, 32), nn.TransformerEncoder(layer, 2), nn.Flatten(1), nn.Linear(8 * 32, 10))
    model.eval().requires_grad_(False)
    x = torch.randn(4, 1, 8, 8)
    before = torch.backends.mha.get_fastpath_enabled()  # False after an attention model was quantized in this process
    with torch.no_grad():
        export_onnx(model, x, tmp_path / "m.onnx")
        expected = model(x).numpy()
    assert torch.backends.mha.get_fastpath_enabled() == before  # restored after the export
    assert np.abs(run_ort(tmp_path / "m.onnx", x) - expected).max() < 1e-4
    assert np.abs(run_openvino(tmp_path / "m.onnx", x) - expected).max() < 1e-3


SCRIPTED_MODEL = """
import torch
from torch import nn

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, padding=1)
        self.gate = torch.jit.script(nn.Sequential(nn.Conv2d(8, 8, 1), nn.Sigmoid()))
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        h = self.stem(x)
        return self.head((h * self.gate(h)).mean((2, 3)))

def build():
    return Net()
"""


def test_preflight_names_an_unquantizable_module_before_training(tmp_path):
    """A TorchScript submodule cannot be traced by NNCF: exit 2 before any stage runs (no run folder),
    the message names the module and its class, located at the ptq stage of the recipe."""
    write(tmp_path / "models.py", SCRIPTED_MODEL)
    recipe = {"name": "scripted", "seed": 0, "device": "cpu", "model": {"factory": str(tmp_path / "models.py") + ":build"},
              "data": {"format": "digits", "max_train_samples": 100, "max_eval_samples": 50},
              "stages": [{"type": "train", "epochs": 1}, {"type": "ptq"},
                         {"type": "export", "targets": ["onnx"], "precisions": ["int8"], "latency": None}]}
    path = write(tmp_path / "recipe.yaml", recipe)
    result = invoke("optimize", path, "--out", tmp_path / "runs")
    assert result.exit_code == 2, result.output
    assert "'gate'" in result.output and "RecursiveScriptModule" in result.output
    assert "stages" in result.output and "recipe.yaml" in result.output
    assert not (tmp_path / "runs" / "scripted").exists()  # nothing trained, nothing written


def test_preflight_passes_and_reports_nothing_for_a_quantizable_model(digits):
    from pruneflow.qat.nncf_preflight import check_quantizable
    from pruneflow.qat.settings import NncfSettings

    assert check_quantizable(family("mobilenet_se")(), digits[0][:8], NncfSettings(), loc=("stages", 1)) == []


@pytest.mark.slow
def test_one_failed_artifact_leaves_the_others_built(tmp_path):
    """`activations: auto` gives unsigned quantizers, which TensorRT's form cannot hold: that one artifact is
    `failed` with the reason and a failed build gate (exit 1); fp32 and the cpu INT8 form are built and measured."""
    from tests.conftest import run_recipe_dict, tiny_recipe_dict

    recipe = tiny_recipe_dict(stages=[
        {"type": "train", "epochs": 1, "batch_size": 32, "lr": 0.05},
        {"type": "ptq", "activations": "auto", "calibration_size": 64},
        {"type": "export", "targets": ["onnx"], "precisions": ["fp32", "int8"], "latency": None},
    ])
    _, result = run_recipe_dict(recipe, tmp_path)
    assert result.exit_code == 1
    by_label = {a.label: a for a in result.artifacts if a.target}
    assert by_label["onnx.int8_tensorrt"].status == "failed"
    assert "unsigned" in by_label["onnx.int8_tensorrt"].notes[0]
    assert by_label["onnx.fp32"].status == "built" and by_label["onnx.int8"].status == "built"
    assert by_label["onnx.int8"].metrics["cosine"] > 0.99
    failed = [g for g in result.gates if not g.passed]
    assert [g.name for g in failed] == ["onnx.int8_tensorrt.build"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mobilenet_se", "densenet"])
def test_family_through_calibrate_qat_and_ptq_to_onnx_and_openvino(name, tmp_path):
    """The whole path a user runs: calibrate -> qat (fp16, int8) -> export ONNX + OpenVINO fp32/int8, then
    the same with ptq; every artifact built, parity and accuracy measured in each runtime."""
    from tests.conftest import run_recipe_dict

    factory = str(FAMILIES / f"{name}.py") + ":build"
    for quant in ({"type": "qat", "schedule": [{"precision": "fp16", "epochs": 1}, {"precision": "int8", "epochs": 1}]},
                  {"type": "ptq"}):
        recipe = {"name": name, "seed": 0, "device": "cpu", "model": {"factory": factory}, "trust": {"code": [factory]},
                  "data": {"format": "digits", "max_train_samples": 600, "max_eval_samples": 200},
                  "stages": [{"type": "train", "epochs": 4, "batch_size": 32, "lr": 0.05},
                             {"type": "calibrate", "size": 64}, quant,
                             {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32", "int8"], "latency": None}]}
        folder = tmp_path / quant["type"]
        folder.mkdir()
        _, result = run_recipe_dict(recipe, folder)
        assert result.exit_code == 0, [g for g in result.gates if not g.passed]
        labels = {a.label for a in result.artifacts if a.target and a.status == "built"}
        assert {"onnx.fp32", "onnx.int8", "onnx.int8_tensorrt", "openvino.fp32", "openvino.int8"} <= labels
        for label in ("onnx.int8", "onnx.int8_tensorrt", "openvino.int8"):
            assert result.metrics[f"{label}.top1_agreement"] >= 0.95
            assert abs(result.metrics[f"{label}.accuracy"] - result.metrics[f"{quant['type']}.accuracy"]) <= 0.03


def test_a_quantized_sequential_model_checkpoints_and_reloads_identically(digits, tmp_path):
    """The quantizers of a model quantized under SequentialRoot are rebuilt on the recipe's plain Sequential
    when the checkpoint is read back (--resume, later stages): same outputs, bit for bit."""
    from pruneflow.checkpoint import load_checkpoint, save_checkpoint
    from pruneflow.handle import ModelHandle
    from pruneflow.qat.nncf_quant import SequentialRoot

    torch.manual_seed(0)
    model = family("mobilenet_se")().eval()
    base = copy.deepcopy(model)
    q = quantized(model, digits)
    save_checkpoint(ModelHandle(q, kind="nncf", float_base=base), tmp_path / "model.pt")
    torch.manual_seed(1)
    loaded = load_checkpoint(tmp_path / "model.pt", into=family("mobilenet_se")())
    assert loaded.kind == "nncf" and isinstance(loaded.module, SequentialRoot)
    x = digits[0][:64]
    with torch.no_grad():
        assert torch.equal(loaded.module.eval()(x), q(x))


def test_a_misspelled_ignore_entry_is_refused_before_training(tmp_path):
    """`ignore: [fcc]` used to select nothing silently: the preflight refuses it (exit 2, nothing written),
    at the entry's line, naming the closest module names."""
    recipe = {"name": "typo", "seed": 0, "device": "cpu",
              "model": {"factory": str(FAMILIES / "densenet.py") + ":build"},
              "trust": {"code": [str(FAMILIES / "densenet.py") + ":build"]},
              "data": {"format": "digits", "max_train_samples": 100, "max_eval_samples": 50},
              "stages": [{"type": "train", "epochs": 1}, {"type": "ptq", "ignore": ["features.2.conv", "fcc"]},
                         {"type": "export", "targets": ["onnx"], "precisions": ["int8"], "latency": None}]}
    path = write(tmp_path / "recipe.yaml", recipe)
    result = invoke("optimize", path, "--out", tmp_path / "runs")
    assert result.exit_code == 2, result.output
    assert "stages.1.ignore.1" in result.output and "'fcc'" in result.output
    assert "closest module names: fc" in result.output
    assert not (tmp_path / "runs" / "typo").exists()
