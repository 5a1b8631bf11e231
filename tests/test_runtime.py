"""The runtime layer: every artifact type loads behind one interface, absent runtimes and devices are
reported (never replaced), latency is interleaved, and the host and OpenVINO's two precisions are recorded."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from pruneflow.artifacts import Artifact, Manifest, sha256_file
from pruneflow.export.onnx import export_onnx
from pruneflow.runtime import (Executor, RuntimeUnavailable, fresh_batch, host_info, open_artifact, runtimes_for,
                               time_interleaved)
from pruneflow.runtime.tensorrt import TrtSession
from pruneflow.zoo import digits_cnn

from conftest import run_recipe_dict, runs_a_recipe, tiny_recipe_dict


@pytest.fixture(scope="module")
def model_files(tmp_path_factory):
    """A digits CNN as ONNX and as OpenVINO IR, plus its torch outputs on a fixed batch."""
    import openvino as ov

    tmp = tmp_path_factory.mktemp("rt")
    torch.manual_seed(0)
    model = digits_cnn(width=8).eval()
    x = torch.randn(4, 1, 8, 8)
    export_onnx(model, x[:1], tmp / "m.onnx")
    ov.save_model(ov.convert_model(str(tmp / "m.onnx")), str(tmp / "m.xml"), compress_to_fp16=False)
    with torch.no_grad():
        ref = model(x).numpy()
    return tmp, x.numpy(), ref


def test_onnx_loads_in_onnxruntime_on_the_best_provider_and_records_it(model_files):
    tmp, x, ref = model_files
    ex = open_artifact(tmp / "m.onnx", threads=1)
    assert (ex.runtime, ex.device, ex.label) == ("onnxruntime", "CPU", "onnxruntime/CPU")  # no CUDA provider here
    assert ex.info["providers"] == ["CPUExecutionProvider"] and ex.info["version"]
    assert np.abs(ex(x) - ref).max() < 1e-4


def test_onnx_loads_in_openvino_too_and_ir_with_default_and_forced_f32(model_files):
    tmp, x, ref = model_files
    assert runtimes_for(tmp / "m.onnx") == ("onnxruntime", "openvino") and runtimes_for("m.om") == ()
    via_ov = open_artifact(tmp / "m.onnx", runtime="openvino", precision_hint="f32")
    assert via_ov.runtime == "openvino" and np.abs(via_ov(x) - ref).max() < 1e-4
    forced = open_artifact(tmp / "m.xml", precision_hint="f32")
    assert forced.info["inference_precision"] == "f32" and forced.label == "openvino/CPU (f32)"
    assert np.abs(forced(x) - ref).max() < 1e-4
    default = open_artifact(tmp / "m.xml")
    import openvino as ov

    plugin_default = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").to_string()
    assert default.info["inference_precision"] == plugin_default  # what the plugin used, read back from it
    assert default.label == f"openvino/CPU (default: {plugin_default})" and default.info["precision_hint"] is None


@pytest.mark.skipif("avx512_bf16" not in host_info()["cpu"]["isa"] and "amx_bf16" not in host_info()["cpu"]["isa"],
                    reason="OpenVINO defaults to bf16 only on CPUs with AVX-512 BF16 or AMX")
def test_openvino_runs_fp32_ir_in_bf16_by_default_on_this_cpu(model_files):
    tmp, x, ref = model_files
    default = open_artifact(tmp / "m.xml")
    assert default.info["inference_precision"] == "bf16"
    diff = np.abs(default(x) - ref).max()
    assert 1e-5 < diff < 0.1  # bf16 really rounds (8 mantissa bits), and stays close


def test_absent_runtimes_and_devices_are_reported_not_replaced(model_files, tmp_path):
    tmp, _, _ = model_files
    with pytest.raises(RuntimeUnavailable, match="no 'cuda' device") as err:
        open_artifact(tmp / "m.onnx", device="cuda")
    assert err.value.exit_code == 3 and "onnxruntime-gpu" in err.value.hint
    with pytest.raises(RuntimeUnavailable, match="OpenVINO has no 'GPU' device"):
        open_artifact(tmp / "m.xml", device="GPU")
    with pytest.raises(RuntimeUnavailable, match="no runtime 'tensorrt' loads .onnx"):
        open_artifact(tmp / "m.onnx", runtime="tensorrt")
    with pytest.raises(RuntimeUnavailable, match="no runtime None loads .om"):
        open_artifact(tmp / "model.om")
    engine = tmp_path / "model.plan"
    engine.write_bytes(b"not an engine")
    with pytest.raises(RuntimeUnavailable, match="TensorRT is not installed here"):
        open_artifact(engine)


def test_a_tensorrt_engine_needs_cuda_even_where_tensorrt_imports(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt", types.ModuleType("tensorrt"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    engine = tmp_path / "model.engine"
    engine.write_bytes(b"x")
    with pytest.raises(RuntimeUnavailable, match="no CUDA device"):
        open_artifact(engine)


class FakeTrt:
    """Records the TensorRT calls TrtSession makes; the 'engine' doubles its input."""

    class TensorIOMode:
        INPUT, OUTPUT = "in", "out"

    class Logger:
        WARNING = 2

        def __init__(self, level):
            self.level = level

    def __init__(self):
        self.calls: list[tuple] = []
        self.buffers: dict[str, int] = {}
        fake = self

        class Context:
            def set_input_shape(self, name, shape):
                fake.calls.append(("set_input_shape", name, shape))
                self.shape = shape

            def get_tensor_shape(self, name):
                return self.shape

            def set_tensor_address(self, name, ptr):
                fake.calls.append(("set_tensor_address", name))
                fake.buffers[name] = ptr

            def execute_async_v3(self, stream):
                fake.calls.append(("execute_async_v3", stream))
                n = int(np.prod(self.shape))
                src = np.ctypeslib.as_array((ctypes.c_float * n).from_address(fake.buffers["input"]))
                dst = np.ctypeslib.as_array((ctypes.c_float * n).from_address(fake.buffers["logits"]))
                dst[:] = 2 * src
                return True

        class Engine:
            num_io_tensors = 2

            def get_tensor_name(self, i):
                return ["input", "logits"][i]

            def get_tensor_mode(self, name):
                return "in" if name == "input" else "out"

            def get_tensor_dtype(self, name):
                return "float"

            def create_execution_context(self):
                fake.calls.append(("create_execution_context",))
                return Context()

        class Runtime:
            def __init__(self, logger):
                fake.calls.append(("Runtime", logger.level))

            def deserialize_cuda_engine(self, data):
                fake.calls.append(("deserialize_cuda_engine", data))
                return Engine()

        self.Runtime = Runtime

    @staticmethod
    def nptype(dtype):
        return np.float32


import ctypes  # noqa: E402 - used by FakeTrt's context only


def test_tensorrt_session_call_sequence_with_a_fake_tensorrt():
    """Only the order of the TensorRT calls is tested (no TensorRT or GPU here); tensors live on the CPU."""
    trt = FakeTrt()
    stream = types.SimpleNamespace(cuda_stream=1234, synchronize=lambda: trt.calls.append(("synchronize",)))
    session = TrtSession(trt, b"ENGINE", torch.device("cpu"), stream)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = session(x)
    assert np.array_equal(out, 2 * x) and session.inputs == ["input"] and session.outputs == ["logits"]
    assert [c[0] for c in trt.calls] == ["Runtime", "deserialize_cuda_engine", "create_execution_context", "set_input_shape",
                                         "set_tensor_address", "set_tensor_address", "execute_async_v3", "synchronize"]
    assert trt.calls[1] == ("deserialize_cuda_engine", b"ENGINE") and trt.calls[3] == ("set_input_shape", "input", (2, 3))
    assert trt.calls[6] == ("execute_async_v3", 1234)


def test_time_interleaved_runs_every_executor_once_per_repetition():
    order: list[str] = []

    def fake(name):
        return lambda x: order.append(name)

    steps = []
    stats = time_interleaved({"a": fake("a"), "b": fake("b"), "c": fake("c")}, np.zeros((4, 2), np.float32),
                             warmup=2, runs=3, on_step=lambda: steps.append(len(order)))
    assert order == ["a", "a", "b", "b", "c", "c"] + ["a", "b", "c"] * 3  # warm-up each, then in turn
    assert steps == [9, 12, 15]
    assert {s.runs for s in stats.values()} == {3} and all(s.batch == 4 for s in stats.values())
    assert all(s.p50_ms <= s.p90_ms <= s.p99_ms and s.throughput > 0 for s in stats.values())


def test_fresh_batch_is_new_contiguous_real_samples():
    x = torch.arange(3 * 4, dtype=torch.float32).reshape(3, 1, 2, 2)
    batch = fresh_batch(x[:, :, :, :1], 5)
    assert batch.shape == (5, 1, 2, 1) and batch.flags["C_CONTIGUOUS"]
    assert np.array_equal(batch[3], x[0, :, :, :1].numpy())


def test_executor_wraps_any_callable():
    ex = Executor(Path("m.bin"), "custom", "CPU", lambda x: x * 3)
    assert ex.label == "custom/CPU" and np.array_equal(ex(np.ones(2)), np.full(2, 3.0))


@pytest.fixture(scope="module")
@runs_a_recipe
def timed_run(tmp_path_factory):
    recipe = tiny_recipe_dict(name="timed")
    recipe["stages"][2] = {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32", "fp16"],
                           "latency": {"batch_sizes": [1, 8], "runs": 5, "warmup": 1}}
    return run_recipe_dict(recipe, tmp_path_factory.mktemp("timed"))[1]


def test_every_artifact_is_timed_in_one_interleaved_loop_with_speedups(timed_run):
    r = timed_run
    assert r.exit_code == 0, [g for g in r.gates if not g.passed]
    for label in ("onnx.fp32", "onnx.fp16", "openvino.fp32", "openvino.fp16"):
        for bs in (1, 8):
            p50, p90, p99 = (r.metrics[f"{label}.latency_b{bs}_{k}_ms"] for k in ("median", "p90", "p99"))
            assert 0 < p50 <= p90 <= p99
            assert r.metrics[f"{label}.throughput_b{bs}"] == pytest.approx(bs * 1000 / p50)
        assert r.metrics[f"{label}.latency_runs"] == 5
    for target in ("onnx", "openvino"):  # the fp16 speed-up is the fp32 median over the fp16 one, same loop
        ratio = r.metrics[f"{target}.fp32.latency_b8_median_ms"] / r.metrics[f"{target}.fp16.latency_b8_median_ms"]
        assert r.metrics[f"{target}.fp16.speedup_b8"] == pytest.approx(ratio)
        assert f"{target}.fp32.speedup_b8" not in r.metrics


def test_openvino_default_and_forced_f32_are_both_recorded(timed_run):
    m = timed_run.metrics
    import openvino as ov

    plugin_default = ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT").to_string()
    for label in ("openvino.fp32", "openvino.fp16"):
        assert m[f"{label}.inference_precision"] == plugin_default
        assert m[f"{label}.runtime"] == f"openvino/CPU (default: {plugin_default})"
        if plugin_default == "f32":
            assert f"{label}.latency_b1_median_ms_f32" not in m
            continue
        assert m[f"{label}.inference_precision_f32"] == "f32" and m[f"{label}.runtime_f32"] == "openvino/CPU (f32)"
        assert m[f"{label}.latency_b1_median_ms_f32"] > 0 and m[f"{label}.accuracy_f32"] >= 0
        # forced f32 reproduces torch; the bf16 default is held to bf16's limits, as its own named gate
        assert m[f"{label}.max_abs_diff_f32"] < (1e-4 if label.endswith("fp32") else 5e-2)
        assert m[f"{label}.max_abs_diff"] > m[f"{label}.max_abs_diff_f32"]
    gates = {g.name: g for g in timed_run.gates}
    if plugin_default != "f32":
        assert "(default: bf16)" in gates["openvino.fp32.parity"].message
        assert "(f32)" in gates["openvino.fp32.parity_f32"].message


def test_host_is_recorded_beside_the_latency_figures(timed_run):
    run_dir = timed_run.run_dir
    manifest = Manifest.read(run_dir)
    host = manifest["host"]
    assert host["cpu"]["model"] and host["cpu"]["usable_cpus"] >= 1
    assert set(host["cpu"]["isa"]) <= {"avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16",
                                       "amx_int8", "amx_tile", "asimd", "sve"}
    assert host["versions"]["onnxruntime"] and host["versions"]["openvino"]
    [export_host] = [row for s in manifest["stages"] for row in s["tables"].get("host", [])]
    assert export_host["threads"] == 1 and export_host["cpu"] == host["cpu"]["model"]
    report = (run_dir / "report.md").read_text()
    latency = report[report.index("## Latency"):report.index("## Gates")]
    assert f"Measured on {host['cpu']['model']}" in latency and "runtime threads: 1" in latency
    assert "| openvino.fp32 | openvino/CPU (default:" in latency


@pytest.mark.slow
def test_size_gate_fails_through_the_cli_names_the_artifact_and_keeps_it(tmp_path):
    from typer.testing import CliRunner

    from pruneflow.cli import app

    recipe = tiny_recipe_dict(name="sized")
    recipe["stages"][2] = {"type": "export", "targets": ["onnx"], "latency": None, "gates": {"max_size_mb": 0.001}}
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe))
    result = CliRunner().invoke(app, ["optimize", str(path), "--out", str(tmp_path / "runs"), "--json"])
    assert result.exit_code == 1, result.output
    payload = json.loads(result.stdout)
    [failed] = [g for g in payload["gates"] if not g["passed"]]
    assert failed["name"] == "onnx.fp32.max_size_mb"
    assert "export/onnx/model.fp32.onnx" in failed["message"] and "> max_size_mb 0.001" in failed["message"]
    assert failed["value"] > 0.001
    run_dir = tmp_path / "runs" / "sized"
    manifest = Manifest.read(run_dir)
    assert manifest["status"] == "gate_failed"
    [onnx] = [a for a in manifest["artifacts"] if a["path"] == "export/onnx/model.fp32.onnx"]
    assert onnx["sha256"] == sha256_file(run_dir / onnx["path"])  # kept, intact
    assert any(n.startswith("gate failed: onnx.fp32.max_size_mb") for n in onnx["notes"])
    assert "gate failed: onnx.fp32.max_size_mb" in (run_dir / "report.md").read_text()


def test_a_speedup_gate_needs_an_fp32_baseline_and_latency(write_recipe):
    from pruneflow.errors import RecipeError
    from pruneflow.recipe import load_recipe

    recipe = tiny_recipe_dict()
    recipe["stages"][2] = {"type": "export", "targets": ["onnx"], "precisions": ["fp16"], "latency": None,
                           "gates": {"min_speedup": 1.5, "targets": ["openvino"], "batch_sizes": [4]}}
    with pytest.raises(RecipeError) as err:
        load_recipe(write_recipe(recipe))
    text = str(err.value)
    assert "stages.2.gates.min_speedup" in text and "writes no fp32" in text and "latency` is null" in text
    assert "stages.2.gates.targets.0" in text and "stages.2.gates.batch_sizes.0" in text


def test_an_absent_runtime_through_the_cli_exits_3_before_any_training(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pruneflow.cli import app

    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import onnxruntime now raises ImportError
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(tiny_recipe_dict(name="absent")))
    result = CliRunner().invoke(app, ["optimize", str(path), "--out", str(tmp_path / "runs"), "--json"])
    assert result.exit_code == 3, result.output
    error = json.loads(result.stdout)["error"]
    assert "onnxruntime" in error["message"] and error["hint"] == "pip install onnxruntime"
    assert not (tmp_path / "runs" / "absent" / "stages").exists()  # nothing trained


def test_evaluate_runtime_opens_an_artifact_path_through_the_layer(model_files):
    from pruneflow.data import Split
    from pruneflow.evaluate import evaluate_runtime
    from pruneflow.tasks import make_task

    tmp, x, ref = model_files
    split = Split(torch.from_numpy(x), torch.from_numpy(ref.argmax(1)))  # labels: torch's own predictions
    task = make_task("classification")
    assert evaluate_runtime(tmp / "m.onnx", split, task, batch_size=3)["accuracy"] == 1.0
    assert evaluate_runtime(str(tmp / "m.xml"), split, task, precision_hint="f32")["accuracy"] == 1.0
    with pytest.raises(RuntimeUnavailable):
        evaluate_runtime(tmp / "m.onnx", split, task, device="cuda")


def _timed(label_target: str, precision: str, form: str | None, size: int, **metrics) -> Artifact:
    ext = "xml" if label_target == "openvino" else "onnx"
    return Artifact(f"export/{label_target}/model.{precision}{'.' + form if form == 'tensorrt' else ''}.{ext}", label_target,
                    "export", target=label_target, precision=precision, form=form, size_bytes=size,
                    metrics={"size_mb": size / 1e6, **metrics})


def test_artifact_gates_check_speed_against_fp32_and_size_and_mark_what_fails():
    from pruneflow.gates import ArtifactGates, artifact_gates

    fp32 = _timed("onnx", "fp32", None, 4_000_000, latency_b1_median_ms=1.0, latency_b32_median_ms=10.0)
    int8 = _timed("onnx", "int8", "cpu", 1_000_000, latency_b1_median_ms=0.8, latency_b32_median_ms=4.0,
                  speedup_b1=1.25, speedup_b32=2.5)
    trt = _timed("onnx", "int8", "tensorrt", 1_000_000, latency_b1_median_ms=2.0, speedup_b1=0.5)
    lone = _timed("openvino", "int8", None, 900_000, latency_b1_median_ms=0.5)  # no openvino fp32 timed beside it
    results = {g.name: g for g in artifact_gates(ArtifactGates(min_speedup=1.5, max_size_mb=2), [fp32, int8, trt, lone], [1, 32])}
    assert set(results) == {"onnx.fp32.max_size_mb", "onnx.int8.max_size_mb", "onnx.int8_tensorrt.max_size_mb",
                            "openvino.int8.max_size_mb", "onnx.int8.min_speedup", "openvino.int8.min_speedup"}
    assert not results["onnx.fp32.max_size_mb"].passed and results["onnx.fp32.max_size_mb"].value == 4.0
    assert "export/onnx/model.fp32.onnx (all its files): 4 MB > max_size_mb 2" in results["onnx.fp32.max_size_mb"].message
    speed = results["onnx.int8.min_speedup"]
    assert not speed.passed and speed.value == 1.25  # batch 1 is too slow, batch 32 is not
    assert "1.25x at batch 1" in speed.message and "2.5x at batch 32" in speed.message and "< min_speedup 1.5" in speed.message
    assert not results["openvino.int8.min_speedup"].passed
    assert "no fp32 openvino artifact was timed beside it" in results["openvino.int8.min_speedup"].message
    assert any(n.startswith("gate failed: onnx.int8.min_speedup") for n in int8.notes)
    assert any(n.startswith("gate failed: onnx.fp32.max_size_mb") for n in fp32.notes) and not trt.notes
    only = artifact_gates(ArtifactGates(min_speedup=1.5, batch_sizes=[32], precisions=["int8"], targets=["onnx"]),
                          [fp32, int8, trt, lone], [1, 32])
    assert [(g.name, g.passed) for g in only] == [("onnx.int8.min_speedup", True)]
