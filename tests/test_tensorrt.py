"""The tensorrt target: the prepared bundle (checked with NVIDIA's Polygraphy), the build code's TensorRT calls
(against a stand-in `tensorrt` module: TensorRT cannot be installed here), preflight and `required: true`.

Nothing here is ever reported built: that needs `import tensorrt` and a CUDA device (torch.cuda.is_available()).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from pydantic import ValidationError
from typer.testing import CliRunner

from pruneflow.cli import app
from pruneflow.errors import MissingDependencyError
from pruneflow.export import tensorrt_build
from pruneflow.export.qdq import check_convention
from pruneflow.export.tensorrt import TensorRtConfig, TensorRtShapes, TensorRtTarget, toolchain_status
from pruneflow.stages.measure import parity_metrics

from conftest import run_recipe_dict, runs_a_recipe, tiny_recipe_dict

POLYGRAPHY = Path(sys.executable).parent / "polygraphy"
BUNDLE = ("build_engine.py", "build.sh", "README.md", "status.json")

pytestmark = pytest.mark.skipif(toolchain_status()[0], reason="TensorRT and a CUDA GPU are here: engines are built, not prepared")


def _tensorrt_artifacts(result) -> dict[str, dict]:
    manifest = json.loads((result.run_dir / "manifest.json").read_text())
    return {a["precision"]: a for a in manifest["artifacts"] if a["target"] == "tensorrt"}


@pytest.fixture(scope="module")
@runs_a_recipe
def float_run(tmp_path_factory):
    """Untrained digits_cnn exported to onnx and tensorrt at fp32 and fp16 (a few seconds)."""
    recipe = tiny_recipe_dict(name="trt_float", stages=[
        {"type": "evaluate"},
        {"type": "export", "targets": ["onnx", {"type": "tensorrt", "shapes": {"min": 1, "opt": 4, "max": 16}}],
         "precisions": ["fp32", "fp16"], "latency": None},
    ])
    _, result = run_recipe_dict(recipe, tmp_path_factory.mktemp("trt_float"))
    return result


def test_without_tensorrt_each_precision_is_a_prepared_bundle(float_run):
    assert float_run.exit_code == 0
    artifacts = _tensorrt_artifacts(float_run)
    assert set(artifacts) == {"fp32", "fp16"}
    for precision, a in artifacts.items():
        bundle = float_run.run_dir / "export" / "tensorrt" / precision
        assert a["status"] == "prepared" and a["kind"] == "tensorrt"
        assert a["path"] == f"export/tensorrt/{precision}/model.{precision}.onnx"
        assert a["notes"][0].startswith("prepared, not built: tensorrt is not importable here")
        assert a["metrics"] == {}  # a prepared artifact is never measured
        # the bundle's ONNX is the onnx target's file, named as the parent
        assert a["parent"] == f"export/onnx/model.{precision}.onnx"
        # the bundle's ONNX is a byte copy of its parent; the artifact's sha256 covers every file of the bundle
        assert a["files"][a["path"]] == next(b["sha256"] for b in json.loads((float_run.run_dir / "manifest.json").read_text())["artifacts"]
                                             if b["path"] == a["parent"])
        assert sorted(p.name for p in bundle.iterdir()) == sorted([*BUNDLE, f"model.{precision}.onnx"])
        assert set(a["files"]) == {f"export/tensorrt/{precision}/{name}" for name in [*BUNDLE, f"model.{precision}.onnx"]}
        assert (bundle / "build_engine.py").read_bytes() == Path(tensorrt_build.__file__).read_bytes()
        assert not list(bundle.glob("*.engine"))
    assert not any(p.name.startswith(".") for p in (float_run.run_dir / "export" / "tensorrt").iterdir())  # no temp folders left


def test_the_bundle_says_how_to_build_it_with_trtexec_10_and_11(float_run):
    bundle = float_run.run_dir / "export" / "tensorrt" / "fp16"
    status = json.loads((bundle / "status.json").read_text())
    assert status["status"] == "prepared" and "tensorrt is not importable" in status["reason"]
    assert status["inputs"] == [{"name": "input", "shape": [-1, 1, 8, 8], "dtype": "float32"}]
    assert status["profile"] == {"input": {"min": [1, 1, 8, 8], "opt": [4, 1, 8, 8], "max": [16, 1, 8, 8]}}
    assert status["batch"] == {"min": 1, "opt": 4, "max": 16} and status["sequence"] is None  # no token inputs
    shapes = "--minShapes=input:1x1x8x8 --optShapes=input:4x1x8x8 --maxShapes=input:16x1x8x8"
    trt10, trt11 = status["commands"]["trtexec_10"], status["commands"]["trtexec_11"]
    assert trt10.startswith("trtexec --onnx=model.fp16.onnx --stronglyTyped --saveEngine=model.fp16.engine") and shapes in trt10
    assert shapes in trt11 and "--stronglyTyped" not in trt11
    for flag in ("--int8", "--fp16", "--best", "--calib"):  # removed in TensorRT 11; strong typing takes the precision from the ONNX
        assert flag not in trt10 and flag not in trt11
    script = (bundle / "build.sh").read_text()
    assert trt10 in script and trt11 in script and status["commands"]["python"] in script
    assert subprocess.run(["sh", "-n", str(bundle / "build.sh")]).returncode == 0  # valid shell
    readme = (bundle / "README.md").read_text()
    assert "prepared, not built" in readme and "name `input`, shape batchx1x8x8, dtype float32" in readme
    assert "TensorRT version" in readme and "GPU" in readme


def test_build_engine_py_stops_with_a_clear_message_where_tensorrt_is_absent(float_run):
    bundle = float_run.run_dir / "export" / "tensorrt" / "fp32"
    done = subprocess.run([sys.executable, "build_engine.py", "--onnx", "model.fp32.onnx", "--engine", "model.fp32.engine"],
                          cwd=bundle, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "TensorRT is not installed: pip install tensorrt on the machine with the NVIDIA GPU" in done.stderr
    assert "Traceback" not in done.stderr and not (bundle / "model.fp32.engine").exists()


def test_the_profile_is_validated():
    with pytest.raises(ValidationError, match="min <= opt <= max"):
        TensorRtShapes(min=8, opt=4, max=16)
    assert TensorRtConfig().shapes == TensorRtShapes(min=1, opt=8, max=32)
    with pytest.raises(tensorrt_build.BuildError, match="static batch of 1"):
        tensorrt_build.batch_shapes((1, 3, 8, 8), "input", 1, 8, 32)
    assert tensorrt_build.batch_shapes((-1, 3, 8, 8), "input", 1, 8, 32)["max"] == (32, 3, 8, 8)


@pytest.mark.slow
def test_a_static_batch_onnx_gets_a_batch_1_profile_and_refuses_another(tmp_path):
    stages = [{"type": "evaluate"},
              {"type": "export", "targets": [{"type": "onnx", "dynamic_batch": False}, "tensorrt"], "latency": None, "evaluate": False}]
    _, result = run_recipe_dict(tiny_recipe_dict(name="static", stages=stages), tmp_path)
    status = json.loads((result.run_dir / "export" / "tensorrt" / "fp32" / "status.json").read_text())
    assert status["profile"]["input"]["max"] == [1, 1, 8, 8] and "--minShapes" not in status["commands"]["trtexec_10"]
    assert "--min 1 --opt 1 --max 1" in status["commands"]["python"]
    stages[1]["targets"][1] = {"type": "tensorrt", "shapes": {"min": 1, "opt": 8, "max": 32}}
    result = CliRunner().invoke(app, ["optimize", str(_write(tmp_path / "r2.yaml", tiny_recipe_dict(name="static2", stages=stages))),
                                      "--out", str(tmp_path / "runs")])
    assert result.exit_code == 2 and "shapes" in result.stderr and "static batch" in result.stderr


def _write(path: Path, recipe: dict) -> Path:
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


# --------------------------------------------------------------------------- preflight, required


def test_preflight_notes_a_prepared_target_and_required_exits_3_before_training(tmp_path):
    assert TensorRtTarget(TensorRtConfig()).preflight() == [f"tensorrt: prepared, not built ({toolchain_status()[1]})"]
    with pytest.raises(MissingDependencyError, match="tensorrt target is marked `required: true`"):
        TensorRtTarget(TensorRtConfig(required=True)).preflight()
    recipe = tiny_recipe_dict(name="req")
    recipe["stages"][-1] = {"type": "export", "targets": ["onnx", {"type": "tensorrt", "required": True}], "latency": None}
    result = CliRunner().invoke(app, ["optimize", str(_write(tmp_path / "r.yaml", recipe)), "--out", str(tmp_path / "runs")])
    assert result.exit_code == 3, result.output
    assert "tensorrt" in result.stderr and "not importable" in result.stderr and "pip install tensorrt" in result.stderr
    assert not (tmp_path / "runs").exists()  # stopped before the run directory, before any training


# --------------------------------------------------------------------------- the build code against a stand-in tensorrt

FAKE_TENSORRT = '''
"""A stand-in for TensorRT's Python API: records the calls build_engine.py makes (TensorRT cannot be installed here)."""
import json, os
__version__ = "10.99.0-fake"
CALLS = []
LOG = os.environ.get("FAKE_TRT_LOG")

def _record(*call):
    CALLS.append(call)
    if LOG:
        with open(LOG, "a") as fh:
            fh.write(json.dumps(call) + "\\n")

class Logger:
    WARNING = 2
    def __init__(self, level): _record("Logger", level)

class NetworkDefinitionCreationFlag:
    STRONGLY_TYPED = 1

class MemoryPoolType:
    WORKSPACE = "workspace"

class _Tensor:
    def __init__(self, name, shape): self.name, self.shape = name, shape

class _Network:
    inputs = []
    @property
    def num_inputs(self): return len(self.inputs)
    def get_input(self, i): return self.inputs[i]

class OnnxParser:
    """Reads the graph's inputs as TensorRT's parser does (-1 for a symbolic dimension)."""
    def __init__(self, network, logger): self.network, self.num_errors = network, 0
    def parse_from_file(self, path):
        import onnx
        _record("parse_from_file", os.path.basename(path))
        graph = onnx.load(path, load_external_data=False).graph
        self.network.inputs = [_Tensor(v.name, tuple(d.dim_value if d.HasField("dim_value") else -1
                                                     for d in v.type.tensor_type.shape.dim)) for v in graph.input]
        return True

class _Profile:
    def set_shape(self, name, lo, opt, hi): _record("set_shape", name, list(lo), list(opt), list(hi))

class _Cache:
    def __init__(self, data): self.data = data
    def serialize(self): return b"cache:" + self.data

class _Config:
    def set_memory_pool_limit(self, pool, size): _record("set_memory_pool_limit", pool, size)
    def add_optimization_profile(self, p): _record("add_optimization_profile")
    def create_timing_cache(self, data): _record("create_timing_cache", bytes(data).decode()); return _Cache(bytes(data))
    def set_timing_cache(self, cache, ignore_mismatch): _record("set_timing_cache", ignore_mismatch); self.cache = cache
    def get_timing_cache(self): return self.cache

class Builder:
    def __init__(self, logger): _record("Builder")
    def create_network(self, flags): _record("create_network", flags); return _Network()
    def create_builder_config(self): return _Config()
    def create_optimization_profile(self): return _Profile()
    def build_serialized_network(self, network, config): _record("build_serialized_network"); return b"fake-engine"
'''


@pytest.fixture
def fake_tensorrt(tmp_path, monkeypatch):
    folder = tmp_path / "fake_trt"
    (folder / "tensorrt").mkdir(parents=True)
    (folder / "tensorrt" / "__init__.py").write_text(FAKE_TENSORRT)
    monkeypatch.syspath_prepend(str(folder))
    monkeypatch.delitem(sys.modules, "tensorrt", raising=False)
    yield folder
    sys.modules.pop("tensorrt", None)


def test_the_build_code_makes_a_strongly_typed_network_with_the_profile_and_keeps_the_timing_cache(float_run, fake_tensorrt, tmp_path):
    import tensorrt  # the stand-in

    source = float_run.run_dir / "export" / "tensorrt" / "fp16" / "model.fp16.onnx"
    cache = tmp_path / "timing.cache"
    sidecar = tensorrt_build.build_engine(source, tmp_path / "m.engine", min_batch=1, opt_batch=4, max_batch=16,
                                          workspace_mb=256, timing_cache=cache, gpu={"name": "test", "compute_capability": "0.0"})
    calls = [c[0] for c in tensorrt.CALLS]
    assert calls == ["Logger", "Builder", "create_network", "parse_from_file", "set_memory_pool_limit", "set_shape",
                     "add_optimization_profile", "create_timing_cache", "set_timing_cache", "build_serialized_network"]
    call = {c[0]: c[1:] for c in tensorrt.CALLS}
    assert call["create_network"] == (1 << tensorrt.NetworkDefinitionCreationFlag.STRONGLY_TYPED,)
    assert call["set_shape"] == ("input", [1, 1, 8, 8], [4, 1, 8, 8], [16, 1, 8, 8])
    assert call["set_memory_pool_limit"] == ("workspace", 256 << 20)
    assert call["set_timing_cache"] == (False,)  # a cache from another GPU or TensorRT version is refused
    assert (tmp_path / "m.engine").read_bytes() == b"fake-engine" and cache.read_bytes() == b"cache:"
    written = json.loads((tmp_path / "m.engine.json").read_text())
    assert written == sidecar and sidecar["tensorrt_version"] == "10.99.0-fake" and sidecar["gpu"] == "test"
    assert sidecar["profile"] == {"input": {"min": [1, 1, 8, 8], "opt": [4, 1, 8, 8], "max": [16, 1, 8, 8]}}
    assert sidecar["source_onnx_sha256"] == json.loads((source.parent / "status.json").read_text())["source_onnx_sha256"]
    # the second build starts from the first one's timing cache
    tensorrt.CALLS.clear()
    tensorrt_build.build_engine(source, tmp_path / "m.engine", min_batch=1, opt_batch=4, max_batch=16, timing_cache=cache,
                                gpu={"name": "test", "compute_capability": "0.0"})
    assert ("create_timing_cache", "cache:") in tensorrt.CALLS and cache.read_bytes() == b"cache:cache:"


def test_the_bundle_script_runs_the_same_calls_from_its_command_line(float_run, fake_tensorrt, tmp_path):
    bundle = float_run.run_dir / "export" / "tensorrt" / "fp32"
    log = tmp_path / "calls.jsonl"
    env = {"PYTHONPATH": str(fake_tensorrt), "FAKE_TRT_LOG": str(log), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, str(bundle / "build_engine.py"), "--onnx", str(bundle / "model.fp32.onnx"),
                           "--engine", str(tmp_path / "e.engine"), "--min", "2", "--opt", "4", "--max", "8"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert ["set_shape", "input", [2, 1, 8, 8], [4, 1, 8, 8], [8, 1, 8, 8]] in calls
    assert json.loads(done.stdout)["engine"] == "e.engine"
    if shutil.which("nvidia-smi", path=env["PATH"]) is None:
        assert json.loads(done.stdout)["gpu"] == "unknown"  # no nvidia-smi here: said, not guessed


def test_an_importable_tensorrt_without_a_cuda_device_is_still_only_prepared(fake_tensorrt):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    available, reason = toolchain_status()
    assert not available and reason.startswith("no CUDA device")
    assert TensorRtTarget(TensorRtConfig()).preflight() == [f"tensorrt: prepared, not built ({reason})"]


# --------------------------------------------------------------------------- int8, checked with Polygraphy


@pytest.fixture(scope="module")
@runs_a_recipe
def int8_run(tmp_path_factory):
    """digits_cnn trained, calibrated, quantized by NNCF (ptq); onnx + tensorrt at fp32, fp16, int8; then a second
    export with the tensorrt target alone (it exports its own TensorRT-form ONNX)."""
    recipe = tiny_recipe_dict(name="trt_int8")
    recipe["data"]["max_train_samples"] = 600  # trained enough (about 0.98 accuracy) that logits mean something
    recipe["stages"] = [
        {"type": "train", "epochs": 5, "batch_size": 32, "lr": 0.05},
        {"type": "calibrate", "size": 64},
        {"type": "ptq"},
        {"type": "export", "targets": ["onnx", "tensorrt"], "precisions": ["fp32", "fp16", "int8"], "latency": None},
        {"type": "export", "name": "trt_only", "targets": ["tensorrt"], "precisions": ["int8"], "latency": None},
    ]
    _, result = run_recipe_dict(recipe, tmp_path_factory.mktemp("trt_int8"))
    return result


@pytest.mark.slow
def test_int8_bundle_holds_the_tensorrt_form_onnx(int8_run):
    assert int8_run.exit_code == 0, [g for g in int8_run.gates if not g.passed]
    assert int8_run.metrics["onnx.int8_tensorrt.accuracy"] >= 0.9  # the same file, measured in onnxruntime by the onnx target
    manifest = json.loads((int8_run.run_dir / "manifest.json").read_text())
    trt = [a for a in manifest["artifacts"] if a["target"] == "tensorrt"]
    assert {a["status"] for a in trt} == {"prepared"} and len(trt) == 4
    int8 = [a for a in trt if a["precision"] == "int8"]
    assert [a["parent"] for a in int8][0] == "export/onnx/model.int8.tensorrt.onnx"
    own = next(a for a in int8 if a["path"].startswith("export/trt_only/"))
    assert own["path"] == "export/trt_only/tensorrt/int8/model.int8.tensorrt.onnx"
    for a in int8:
        model = onnx.load(str(int8_run.run_dir / a["path"]))
        assert check_convention(model, "tensorrt") == []
        assert any(n.op_type == "QuantizeLinear" for n in model.graph.node)


def _polygraphy(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    if not POLYGRAPHY.exists():
        pytest.skip(f"polygraphy not installed beside {sys.executable} (pip install -e '.[dev]')")
    return subprocess.run([str(POLYGRAPHY), *args], cwd=cwd, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_polygraphy_lint_passes_the_bundle_onnx(int8_run, precision, tmp_path):
    bundle = int8_run.run_dir / "export" / "tensorrt" / precision
    (source,) = bundle.glob("*.onnx")
    done = _polygraphy("check", "lint", str(source), "-o", str(tmp_path / "lint.json"), cwd=bundle)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "lint.json").read_text())
    assert report["summary"]["failing"] == [] and report["summary"]["passing"]
    assert not [e for e in report["lint_entries"] if e.get("level") == "exception"]


@pytest.mark.slow
def test_polygraphy_runs_the_int8_onnx_in_onnxruntime_close_to_fp32(int8_run, tmp_path):
    from polygraphy.comparator import RunResults

    export = int8_run.run_dir / "export" / "tensorrt"
    shapes = ["--input-shapes", "input:[64,1,8,8]", "--seed", "1", "--val-range", "input:[0,1]"]
    fp32 = _polygraphy("run", str(export / "fp32" / "model.fp32.onnx"), "--onnxrt", *shapes,
                       "--save-outputs", str(tmp_path / "fp32.json"), cwd=tmp_path)
    assert fp32.returncode == 0, fp32.stdout + fp32.stderr
    int8 = _polygraphy("run", str(export / "int8" / "model.int8.tensorrt.onnx"), "--onnxrt", *shapes,
                       "--save-outputs", str(tmp_path / "int8.json"), "--load-outputs", str(tmp_path / "fp32.json"),
                       "--check-error-stat", "median", "--atol", "0.5", "--rtol", "0.5", cwd=tmp_path)
    # Polygraphy's own comparison with an int8-sized tolerance: the fp32 file is the float model that entered
    # PTQ (before NNCF's bias correction), so the median logit error is the whole quantization error (~0.2
    # on logits of magnitude ~5); cosine and top-1 agreement below are the real criteria.
    assert int8.returncode == 0, int8.stdout + int8.stderr
    assert "PASSED" in int8.stdout + int8.stderr

    def logits(path: Path) -> np.ndarray:
        ((_, iterations),) = RunResults.load(str(path)).items()
        return np.asarray(iterations[0]["logits"])

    a, b = logits(tmp_path / "fp32.json"), logits(tmp_path / "int8.json")
    parity = parity_metrics(a, b)
    # Random inputs, far from the digits the model was calibrated on: the int8 model stays close to fp32
    # (the pipeline's parity gate holds it to the int8 limits on real eval data).
    assert parity["cosine"] >= 0.98 and parity["top1_agreement"] >= 0.85, parity
    assert not np.array_equal(a, b)  # two different models were run


def test_the_build_module_imports_only_the_standard_library_and_tensorrt():
    source = Path(tensorrt_build.__file__).read_text()
    imported = {line.split()[1].split(".")[0] for line in source.splitlines() if line.startswith(("import ", "from "))}
    assert imported <= {"__future__", "argparse", "hashlib", "json", "subprocess", "pathlib", "typing"}
    assert "import tensorrt" in textwrap.dedent(source)  # inside import_tensorrt(), where a missing one is reported


def test_an_engine_is_fed_batches_its_profile_accepts():
    from pruneflow.runtime.tensorrt import in_batches

    seen = []

    def run(x):
        seen.append(len(x))
        return x * 2

    out = in_batches(run, np.arange(10, dtype=np.float32).reshape(10, 1), 4)
    assert seen == [4, 4, 2] and np.array_equal(out[:, 0], np.arange(10) * 2)


def test_a_feed_of_named_inputs_is_sliced_and_cut_to_its_longest_row():
    from pruneflow.runtime.tensorrt import in_batches

    mask = np.zeros((5, 10), dtype=np.int64)
    for row, n in enumerate([3, 6, 2, 4, 1]):
        mask[row, :n] = 1
    feed = {"input_ids": mask * 7, "attention_mask": mask}
    seen = []

    def run(x):
        seen.append({k: v.shape for k, v in x.items()})
        return x["attention_mask"].sum(1, keepdims=True)

    out = in_batches(run, feed, 2)
    assert seen == [{"input_ids": (2, 6), "attention_mask": (2, 6)}, {"input_ids": (2, 4), "attention_mask": (2, 4)},
                    {"input_ids": (1, 1), "attention_mask": (1, 1)}]
    assert out[:, 0].tolist() == [3, 6, 2, 4, 1]  # nothing a row holds was cut


# --------------------------------------------------------------------------- several inputs: a tiny BERT

WORDS = ("the a film movie plot actors story is was very quite not good bad great awful boring funny dull "
         "moving fine slow sharp warm cold").split()


def text_data(folder: Path, rows: int = 48, seed: int = 0) -> dict:
    """A vocab.txt (WordPiece) and train/eval parquet files of generated sentences; the recipe's `data`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    rng = np.random.default_rng(seed)
    for split in ("train", "eval"):
        sentences = [" ".join(rng.choice(WORDS, size=int(rng.integers(2, 21)))) for _ in range(rows)]
        labels = [int("good" in s or "great" in s) for s in sentences]
        pq.write_table(pa.table({"sentence": sentences, "label": labels}), folder / f"{split}.parquet")
    return {"format": "parquet", "train": str(folder / "train.parquet"), "eval": str(folder / "eval.parquet"),
            "input_column": "sentence", "tokenizer": str(folder / "vocab.txt"), "max_length": 32}


BERT = {"factory": "bert_classifier", "kwargs": {"num_layers": 2, "hidden_size": 64, "num_heads": 4, "intermediate_size": 128,
                                                 "vocab_size": 32, "max_positions": 32, "seed": 0}}
TEXT_INPUTS = ["input_ids", "attention_mask", "token_type_ids"]


@pytest.fixture(scope="module")
@runs_a_recipe
def bert_run(tmp_path_factory):
    """A tiny BERT (random init) exported to onnx + tensorrt with a configured sequence range, then to tensorrt
    alone with the default one (from data.max_length and the eval split's lengths)."""
    pytest.importorskip("transformers")
    folder = tmp_path_factory.mktemp("trt_bert")
    recipe = {"name": "trt_bert", "seed": 0, "device": "cpu", "model": BERT, "data": text_data(folder / "data"),
              "stages": [{"type": "evaluate"},
                         {"type": "export", "targets": [{"type": "onnx", "opset": 18},
                                                        {"type": "tensorrt", "shapes": {"min": 1, "opt": 32, "max": 64},
                                                                 "sequence": {"min": 8, "opt": 16, "max": 24}}],
                          "precisions": ["fp32", "fp16"], "latency": None},
                         {"type": "export", "name": "trt_default", "targets": ["tensorrt"], "precisions": ["fp32"], "latency": None}]}
    _, result = run_recipe_dict(recipe, folder)
    return result


def test_a_text_model_gets_one_profile_over_every_input_in_each_command(bert_run):
    assert bert_run.exit_code == 0
    bundle = bert_run.run_dir / "export" / "tensorrt" / "fp16"
    status = json.loads((bundle / "status.json").read_text())
    assert status["inputs"] == [{"name": n, "shape": [-1, -1], "dtype": "int64"} for n in TEXT_INPUTS]
    assert status["batch"] == {"min": 1, "opt": 32, "max": 64} and status["sequence"] == {"min": 8, "opt": 16, "max": 24}
    assert status["profile"] == {n: {"min": [1, 8], "opt": [32, 16], "max": [64, 24]} for n in TEXT_INPUTS}
    for cmd in (status["commands"]["trtexec_10"], status["commands"]["trtexec_11"]):
        assert "--minShapes=input_ids:1x8,attention_mask:1x8,token_type_ids:1x8" in cmd
        assert "--optShapes=input_ids:32x16,attention_mask:32x16,token_type_ids:32x16" in cmd
        assert "--maxShapes=input_ids:64x24,attention_mask:64x24,token_type_ids:64x24" in cmd
    assert "--min 1 --opt 32 --max 64 --min-seq 8 --opt-seq 16 --max-seq 24" in status["commands"]["python"]
    script = (bundle / "build.sh").read_text()
    assert all(status["commands"][k] in script for k in ("python", "trtexec_10", "trtexec_11"))
    assert subprocess.run(["sh", "-n", str(bundle / "build.sh")]).returncode == 0
    readme = (bundle / "README.md").read_text()
    for name in TEXT_INPUTS:
        assert f"name `{name}`, shape batchxsequence, dtype int64" in readme
    assert "sequence lengths (tokens) min 8, opt 16, max 24" in readme and "int64 bindings" in readme
    onnx_inputs = [(i.name, i.type.tensor_type.elem_type) for i in onnx.load(str(bundle / "model.fp16.onnx")).graph.input]
    assert onnx_inputs == [(n, onnx.TensorProto.INT64) for n in TEXT_INPUTS]


def test_tensorrt_exports_its_own_standard_onnx_at_the_onnx_targets_opset_when_that_file_is_fused(bert_run):
    """The onnx target's FP32 file is in onnxruntime's fused ops (`fuse: auto`), which TensorRT does not read: the
    bundle's ONNX is exported again, standard, at the opset the recipe gave the onnx target (18 here, not 17)."""
    export = bert_run.run_dir / "export"
    fused = onnx.load(str(export / "onnx" / "model.fp32.onnx"))
    assert any(n.domain == "com.microsoft" for n in fused.graph.node)
    own = onnx.load(str(export / "tensorrt" / "fp32" / "model.fp32.onnx"))
    assert not any(n.domain == "com.microsoft" for n in own.graph.node)
    assert {o.domain: o.version for o in own.opset_import}[""] == 18 == {o.domain: o.version for o in fused.opset_import}[""]


def test_the_default_sequence_range_comes_from_max_length_and_the_eval_lengths(bert_run):
    from pruneflow.data import load_data
    from pruneflow.inputs import lengths
    from pruneflow.recipe import load_recipe

    status = json.loads((bert_run.run_dir / "export" / "trt_default" / "tensorrt" / "fp32" / "status.json").read_text())
    recipe = load_recipe(bert_run.run_dir.parent.parent / "recipe.yaml").recipe
    counts = lengths(load_data(recipe.data, recipe.seed, with_train=False).eval.x).numpy()
    p90 = int(np.ceil(np.percentile(counts, 90) / 8) * 8)
    assert 8 < p90 < 32  # the generated sentences are 2 to 20 words long: the percentile is not clipped here
    assert status["sequence"] == {"min": 1, "opt": p90, "max": 32}  # max: data.max_length
    assert status["batch"] == {"min": 1, "opt": 8, "max": 32}  # the target's default batch range
    assert status["profile"]["attention_mask"] == {"min": [1, 1], "opt": [8, p90], "max": [32, 32]}


def test_build_engine_py_sets_every_inputs_shape_in_one_profile(bert_run, fake_tensorrt, tmp_path):
    bundle = bert_run.run_dir / "export" / "tensorrt" / "fp32"
    status = json.loads((bundle / "status.json").read_text())
    log = tmp_path / "calls.jsonl"
    env = {"PYTHONPATH": f"{fake_tensorrt}:{Path(onnx.__file__).parent.parent}", "FAKE_TRT_LOG": str(log), "PATH": "/usr/bin:/bin"}
    args = status["commands"]["python"].split()[2:]  # the bundle's own command line, after `python3 build_engine.py`
    args[args.index("--engine") + 1] = str(tmp_path / "e.engine")
    args[args.index("--timing-cache") + 1] = str(tmp_path / "timing.cache")
    done = subprocess.run([sys.executable, "build_engine.py", *args], cwd=bundle, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    shapes = [c[1:] for c in calls if c[0] == "set_shape"]
    assert shapes == [[n, [1, 8], [32, 16], [64, 24]] for n in TEXT_INPUTS]
    assert [c[0] for c in calls].count("add_optimization_profile") == 1  # one profile holds all three
    assert json.loads(done.stdout)["profile"] == status["profile"]


def test_build_engine_py_refuses_a_sequence_input_without_a_sequence_range(bert_run, fake_tensorrt, tmp_path):
    source = bert_run.run_dir / "export" / "tensorrt" / "fp32" / "model.fp32.onnx"
    with pytest.raises(tensorrt_build.BuildError, match="dynamic sequence axis.*--min-seq"):
        tensorrt_build.build_engine(source, tmp_path / "e.engine", min_batch=1, opt_batch=1, max_batch=4)
    with pytest.raises(tensorrt_build.BuildError, match="sequence range of the profile needs min <= opt <= max"):
        tensorrt_build.profile_shapes((-1, -1), "input_ids", (1, 1, 1), (8, 4, 16))
    assert tensorrt_build.profile_shapes((-1, 24), "input_ids", (1, 2, 4), None) == {"min": (1, 24), "opt": (2, 24), "max": (4, 24)}


def test_the_engine_executor_binds_each_named_input_with_its_own_shape_and_dtype():
    """TrtSession against a stand-in engine (no CUDA here: torch CPU tensors, whose addresses the stand-in reads):
    per input its own set_input_shape, int64 kept, slices the profile's max batch accepts."""
    import ctypes
    import types

    import torch

    from pruneflow.runtime.tensorrt import TrtSession

    calls = []

    def read(address, shape, dtype):
        n = int(np.prod(shape))
        return np.frombuffer((ctypes.c_char * (n * np.dtype(dtype).itemsize)).from_address(address), dtype=dtype).reshape(shape)

    class Context:
        def __init__(self): self.shapes, self.addresses = {}, {}
        def set_input_shape(self, name, shape): calls.append(("set_input_shape", name, shape)); self.shapes[name] = shape
        def set_tensor_address(self, name, address): self.addresses[name] = address
        def get_tensor_shape(self, name): return (self.shapes["input_ids"][0], 1)
        def execute_async_v3(self, stream):
            ids = read(self.addresses["input_ids"], self.shapes["input_ids"], np.int64)
            mask = read(self.addresses["attention_mask"], self.shapes["attention_mask"], np.int64)
            out = read(self.addresses["logits"], self.get_tensor_shape("logits"), np.float32)
            out[:, 0] = (ids * mask).sum(1)  # what a model of the two inputs would compute
            return True

    io = {"input_ids": ("INPUT", np.int64), "attention_mask": ("INPUT", np.int64), "logits": ("OUTPUT", np.float32)}

    class Engine:
        num_io_tensors = 3
        def get_tensor_name(self, i): return list(io)[i]
        def get_tensor_mode(self, name): return io[name][0]
        def get_tensor_dtype(self, name): return io[name][1]
        def create_execution_context(self): return Context()
        def get_tensor_profile_shape(self, name, profile): return (1, 1), (1, 4), (1, 8)  # batch 1 only

    trt = types.SimpleNamespace(Logger=type("Logger", (), {"WARNING": 2, "__init__": lambda self, level: None}),
                                Runtime=lambda logger: types.SimpleNamespace(deserialize_cuda_engine=lambda data: Engine()),
                                TensorIOMode=types.SimpleNamespace(INPUT="INPUT"), nptype=lambda dtype: dtype)
    stream = types.SimpleNamespace(cuda_stream=0, synchronize=lambda: None)
    session = TrtSession(trt, b"engine", torch.device("cpu"), stream)
    assert session.inputs == ["input_ids", "attention_mask"] and session.outputs == ["logits"]
    ids = np.array([[2, 5, 9, 3, 0], [2, 4, 3, 0, 0]], dtype=np.int64)
    feed = {"attention_mask": (ids > 0).astype(np.int64), "input_ids": ids, "token_type_ids": np.zeros_like(ids)}
    out = session(feed)  # a tokenizer's output: token_type_ids, which this engine lacks, is dropped
    # one row a run (the profile's max batch), each cut to its own tokens (dynamic padding)
    assert calls == [("set_input_shape", "input_ids", (1, 4)), ("set_input_shape", "attention_mask", (1, 4)),
                     ("set_input_shape", "input_ids", (1, 3)), ("set_input_shape", "attention_mask", (1, 3))]
    assert session.max_batch() == 1 and out[:, 0].tolist() == [19.0, 9.0]


@pytest.mark.slow
def test_where_tensorrt_and_cuda_exist_the_engine_is_built_with_the_text_profile(tmp_path, fake_tensorrt, monkeypatch):
    """The built path, with the stand-in tensorrt and CUDA's presence mocked (neither exists here)."""
    import torch

    from pruneflow.export import tensorrt as target_module

    pytest.importorskip("transformers")
    monkeypatch.setattr(target_module, "toolchain_status", lambda: (True, ""))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Stand-in GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: (9, 0))
    recipe = {"name": "trt_built", "seed": 0, "device": "cpu", "model": BERT, "data": text_data(tmp_path / "data"),
              "stages": [{"type": "export", "targets": [{"type": "tensorrt", "shapes": {"min": 1, "opt": 4, "max": 8},
                                                          "sequence": {"min": 4, "opt": 16, "max": 32}}],
                          "precisions": ["fp32"], "latency": None}]}
    _, result = run_recipe_dict(recipe, tmp_path)
    art = _tensorrt_artifacts(result)["fp32"]
    assert art["status"] == "built" and art["path"] == "export/tensorrt/model.fp32.engine"
    assert (result.run_dir / art["path"]).read_bytes() == b"fake-engine"
    sidecar = json.loads((result.run_dir / "export/tensorrt/model.fp32.engine.json").read_text())
    assert sidecar["gpu"] == "Stand-in GPU" and sidecar["compute_capability"] == "9.0"
    assert sidecar["profile"] == {n: {"min": [1, 4], "opt": [4, 16], "max": [8, 32]} for n in TEXT_INPUTS}
    assert any(n.startswith("not measured here") for n in art["notes"])  # torch sees no CUDA device to run it on
