"""Built here, served there (issue 38, item 5): a recipe (`deploy.cpu`) or `optimize --for` names the CPUs the
artifacts will be served on, and the export chooses its INT8 form and OpenVINO hint for all of them; portable when
none is named. An INT8 IR built for AVX2 servers is run under OpenVINO capped at AVX2 (emulated) and held to the
quantized torch model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import invoke, run_recipe_dict, runs_a_recipe, tiny_recipe_dict
from pruneflow.artifacts import Artifact
from pruneflow.errors import RecipeError
from pruneflow.export import deploy_hosts
from pruneflow.export.deploy_hosts import cpu_flags, form_conflict, int8_form_for, int8_hint_for, normalise, served_on
from pruneflow.runtime.host import ISA_FLAGS, host_info

HERE = set(host_info()["cpu"]["isa"])
X86_AVX2 = host_info()["cpu"]["arch"] in ("x86_64", "AMD64") and "avx2" in HERE


# --------------------------------------------------------------------------- names


def test_every_isa_flag_the_host_records_names_a_cpu_and_implies_what_such_cpus_have():
    assert set(deploy_hosts.IMPLIED) == set(ISA_FLAGS)
    assert {"avx512_vnni", "avx512f", "avx2"} <= cpu_flags("avx512_bf16")  # every AVX512-BF16 CPU has VNNI
    assert "amx_int8" in cpu_flags("amx_bf16") and "avx512_vnni" not in cpu_flags("avx2+avx_vnni")
    assert normalise("AVX2, avx512_vnni") == ["avx2", "avx512_vnni"] and normalise(None) is None
    assert normalise(["avx_vnni+avx2"]) == ["avx2+avx_vnni"]  # recorded in the known order
    for bad, says in ((["avx3"], "known: avx2, fma"), ([], "at least one"), (["avx2", "AVX2"], "listed twice"),
                      (["avx2+asimd"], "mixes ARM")):
        with pytest.raises(ValueError, match=says):
            normalise(bad)


@pytest.mark.parametrize("hosts,form", [
    (None, "u8s8"),                        # unknown (a CI runner is not the server): exact everywhere
    (["avx2"], "u8s8"),
    (["avx2", "avx512_vnni"], "u8s8"),     # one without VNNI is enough
    (["avx512f"], "u8s8"),                 # AVX-512 without VNNI (Skylake-SP) adds int16 pairs too
    (["avx512_vnni", "amx_int8"], None),   # None: `auto` times every form exact on this host
    (["avx2+avx_vnni"], None),
    (["asimd", "avx512_bf16"], None),      # ARM has no int16 pair sums
])
def test_a_form_that_needs_vnni_is_left_to_choose_only_when_every_named_cpu_has_it(hosts, form):
    assert int8_form_for(hosts)[0] == form


def test_openvinos_hint_is_f32_where_no_named_cpu_computes_bf16_and_measured_otherwise():
    assert int8_hint_for(["avx2", "avx512_vnni"])[0] == "f32"
    assert int8_hint_for(["avx2", "avx512_bf16"])[0] is None and int8_hint_for(None)[0] is None
    assert form_conflict("u8s8_vnni", ["avx2", "avx512_vnni"]) == ["avx2"] and not form_conflict("u8s8", ["avx2"])


# --------------------------------------------------------------------------- recipe and CLI


def _recipe(tmp_path: Path, **extra) -> Path:
    recipe = tiny_recipe_dict(**extra)
    path = tmp_path / "recipe.yaml"
    path.write_text(json.dumps(recipe, indent=1))
    return path


def test_an_unknown_cpu_is_refused_at_its_entry_with_the_known_names(tmp_path):
    from pruneflow.recipe import load_recipe

    with pytest.raises(RecipeError) as caught:
        load_recipe(_recipe(tmp_path, deploy={"cpu": ["avx2", "avx3"]}))
    (issue,) = caught.value.issues
    assert issue.path == "deploy.cpu.1" and issue.line and "'avx3'" in issue.message and "avx512_vnni" in issue.message
    loaded = load_recipe(_recipe(tmp_path, deploy={"cpu": "avx2,avx512_vnni"}))
    assert loaded.recipe.deploy.cpu == ["avx2", "avx512_vnni"]
    assert load_recipe(_recipe(tmp_path)).recipe.deploy.cpu is None


def test_a_pinned_vnni_form_for_a_cpu_without_vnni_is_an_error_at_the_form(tmp_path):
    from pruneflow.recipe import load_recipe

    stages = [{"type": "train", "epochs": 1}, {"type": "ptq"},
              {"type": "export", "targets": [{"type": "onnx", "form": "u8s8_vnni"}], "latency": None}]
    with pytest.raises(RecipeError) as caught:
        load_recipe(_recipe(tmp_path, stages=stages, deploy={"cpu": ["avx512_vnni", "avx2"]}))
    (issue,) = caught.value.issues
    assert issue.path == "stages.2.targets.0.form" and "avx2" in issue.message and "form: u8s8" in (caught.value.hint or
                                                                                                      str(caught.value))
    load_recipe(_recipe(tmp_path, stages=stages, deploy={"cpu": ["avx512_vnni"]}))  # a VNNI-only fleet: fine
    load_recipe(_recipe(tmp_path, stages=stages))  # none named: the recipe's pin stands, its record says what it needs


def test_optimize_for_names_the_cpus_and_refuses_an_unknown_one(tmp_path):
    path = _recipe(tmp_path)
    bad = invoke("optimize", path, "--for", "avx2,avx3", "--dry-run")
    assert bad.exit_code == 2 and "--for" in bad.output and "avx3" in bad.output and "avx512_vnni" in bad.output
    good = invoke("optimize", path, "--for", "avx2, avx512_vnni", "--dry-run")
    assert good.exit_code == 0, good.output


def test_the_serving_cpus_are_part_of_the_export_stages_resume_key(tmp_path):
    from pruneflow.pipeline import plan_stages
    from pruneflow.resume import serving_part
    from pruneflow.recipe import load_recipe

    loaded = load_recipe(_recipe(tmp_path), ["deploy.cpu=[avx2]"])
    stages = plan_stages(loaded)
    export = next(s for s in stages if s.config.type == "export")
    other = load_recipe(_recipe(tmp_path), ["deploy.cpu=[avx512_vnni]"]).recipe
    assert serving_part(export, loaded.recipe) != serving_part(export, other)
    assert all(serving_part(s, loaded.recipe) == [] for s in stages if s is not export)


# --------------------------------------------------------------------------- the stage's pins


def _targets(**config):
    from pruneflow.export.onnx import OnnxConfig, OnnxTarget
    from pruneflow.export.openvino import OpenVinoConfig, OpenVinoTarget

    return OnnxTarget(OnnxConfig(**config)), OpenVinoTarget(OpenVinoConfig(**config))


def test_auto_is_pinned_for_the_named_cpus_and_a_recorded_form_they_cannot_run_is_not_taken_again():
    from pruneflow.stages.export_hosts import Pins, pinned

    onnx, ov = _targets()
    assert pinned("onnx", onnx, {}, None)[0].config.form == "u8s8"
    for_avx2, pins = pinned("openvino", ov, {}, ["avx2"])
    assert (for_avx2.config.form, for_avx2.config.int8_hint) == ("u8s8", "f32") and pins.for_hosts["form"][0] == "u8s8"
    assert pinned("onnx", onnx, {}, ["avx512_vnni"]) == (onnx, Pins())  # left to `auto`: timed here
    vnni, pins = pinned("onnx", onnx, {"int8_form": "u8s8_vnni"}, None)  # an old record, made for this host
    assert vnni.config.form == "u8s8" and not pins.from_record
    again, pins = pinned("onnx", onnx, {"int8_form": "u8s8_vnni"}, ["avx512_vnni"])
    assert again.config.form == "u8s8_vnni" and pins.from_record == {"form": "u8s8_vnni"}
    onnx, _ = _targets(form="s8s8")  # the recipe's own pin is never touched
    assert pinned("onnx", onnx, {}, None)[0] is onnx


def test_the_record_names_the_cpus_only_when_named_and_the_served_on_rows_say_which_each_artifact_is_for():
    from pruneflow.deployment import file_props, hosts_record, outside_hosts

    assert "pruneflow.hosts" not in file_props({"format": "x"}, "int8")
    record = {"format": "x", "hosts": hosts_record(["avx2"])}
    assert json.loads(file_props(record, "int8")["pruneflow.hosts"])["cpu"] == ["avx2"]
    avx2_host = {"cpu": {"arch": "x86_64", "isa": ["avx2", "fma"]}}
    vnni_host = {"cpu": {"arch": "x86_64", "isa": ["avx2", "fma", "avx512f", "avx512_vnni"]}}
    assert outside_hosts(record, avx2_host) is None and "avx512_vnni" in outside_hosts(record, vnni_host)

    def art(precision, form=None, int8_form=None, target="onnx"):
        return Artifact(path="m", kind=target, producer="export", target=target, precision=precision, form=form,
                        metrics={"int8_form": int8_form} if int8_form else {})

    assert served_on(art("int8", "cpu", "u8s8"), None)["for"].startswith("any x86-64 or ARM")
    assert served_on(art("int8", "cpu", "u8s8"), ["avx2"])["for"] == "avx2"
    assert "VNNI" in served_on(art("int8", "cpu", "u8s8_vnni"), None)["for"]
    assert served_on(art("int8", "cpu", "u8s8_vnni"), ["avx2", "avx512_vnni"])["for"].startswith("NOT avx2")
    assert served_on(art("int8", "tensorrt"), ["avx2"])["for"] == "its target's device"


# --------------------------------------------------------------------------- emulation


def _qdq_mlp(tmp_path: Path) -> tuple[Path, np.ndarray]:
    """onnxruntime's own u8 x s8 QDQ of a small MLP (no fitting against int16 pair sums), as an OpenVINO IR."""
    import openvino as ov
    import torch
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(96, 200), torch.nn.ReLU(), torch.nn.Linear(200, 10)).eval()
    x = torch.randn(2, 96)
    torch.onnx.export(model, (x,), str(tmp_path / "f32.onnx"), input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False, opset_version=17)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"input": torch.randn(2, 96).numpy()} for _ in range(8)])

        def get_next(self):
            return next(self.batches, None)

    quantize_static(str(tmp_path / "f32.onnx"), str(tmp_path / "u8.onnx"), Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    ov.save_model(ov.convert_model(str(tmp_path / "u8.onnx")), str(tmp_path / "u8.xml"))
    return tmp_path / "u8.xml", torch.randn(16, 96).numpy()


@pytest.mark.skipif(not X86_AVX2, reason="the AVX2 cap emulates an x86 server")
def test_the_avx2_cap_holds_and_shows_saturation_a_vnni_host_does_not_have(tmp_path):
    import openvino as ov

    ir, x = _qdq_mlp(tmp_path)
    emulated, kernels = deploy_hosts.emulate_avx2(ir, x)
    assert kernels and not any(s in p for ps in kernels.values() for p in ps for s in deploy_hosts.NOT_AVX2)
    native = ov.Core().compile_model(str(ir), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})(x)[0]
    if HERE & set(deploy_hosts.VNNI_FLAGS):  # a form unfitted for int16 pair sums computes another model under AVX2
        assert np.abs(np.asarray(native) - emulated).max() > 1e-3


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
@runs_a_recipe
def avx2_run(tmp_path_factory):
    """train → ptq → export onnx + openvino int8 with `deploy: {cpu: [avx2, avx512_vnni]}`, timed (about 30 s)."""
    recipe = tiny_recipe_dict(name="for-avx2", deploy={"cpu": ["avx2", "avx512_vnni"]})
    recipe["stages"] = [{"type": "train", "epochs": 6, "batch_size": 32, "lr": 0.05}, {"type": "ptq", "calibration_size": 64},
                        {"type": "export", "targets": ["onnx", "openvino"], "precisions": ["fp32", "int8"],
                         "latency": {"batch_sizes": [1, 8], "runs": 10}}]
    _, result = run_recipe_dict(recipe, tmp_path_factory.mktemp("for-avx2"))
    assert result.exit_code == 0, [g for g in result.gates if not g.passed]
    return result


def test_a_run_for_avx2_delivers_the_portable_form_and_says_which_cpus_each_artifact_is_for(avx2_run):
    from pruneflow.formats.onnx import read_onnx
    from pruneflow.formats.openvino import read_ir

    by = {a.label: a for a in avx2_run.artifacts if a.target}
    assert by["onnx.int8"].metrics["int8_form"] == "u8s8" and by["openvino.int8"].metrics["int8_form"] == "u8s8"
    assert by["openvino.int8"].metrics["int8_hint"] == "f32"  # neither named CPU computes bf16
    assert read_onnx(avx2_run.run_dir / by["onnx.int8"].path)["hosts"]["cpu"] == ["avx2", "avx512_vnni"]
    assert read_ir(avx2_run.run_dir / by["openvino.int8"].path)["hosts"]["cpu"] == ["avx2", "avx512_vnni"]
    assert not (by["onnx.int8"].deployment or {}).get("runtime")  # u8s8 asks nothing of the CPU
    manifest = json.loads((avx2_run.run_dir / "manifest.json").read_text())
    assert manifest["choices"]["export"]["deploy_cpu"] == ["avx2", "avx512_vnni"]
    rows = {r["artifact"]: r for r in next(s for s in manifest["stages"] if s["id"] == "export")["tables"]["served on"]}
    assert rows["onnx.int8"]["for"] == "avx2, avx512_vnni" and rows["onnx.int8_tensorrt"]["for"] == "its target's device"
    report = (avx2_run.run_dir / "report.md").read_text()
    assert "**Served on**" in report and "built for the CPUs named (avx2, avx512_vnni)" in report
    assert "## export: served on" in report and "emulated AVX2" in report


@pytest.mark.skipif(not X86_AVX2 or not HERE & (set(deploy_hosts.VNNI_FLAGS) | {"avx512f"}),
                    reason="emulating AVX2 needs an x86 host with more than AVX2")
def test_the_int8_ir_built_for_avx2_agrees_with_the_quantized_model_under_emulated_avx2(avx2_run):
    ir = next(a for a in avx2_run.artifacts if a.label == "openvino.int8")
    gate = next(g for g in avx2_run.gates if g.name == "openvino.int8.parity_emulated_avx2")
    assert gate.passed and "emulated AVX2" in gate.message
    assert ir.metrics["cosine_emulated_avx2"] >= 0.999 and ir.metrics["top1_agreement_emulated_avx2"] >= 0.95
    assert any(n.startswith("emulated AVX2") and "jit_avx2" in n for n in ir.notes), ir.notes
    onnx_int8 = next(a for a in avx2_run.artifacts if a.label == "onnx.int8")
    assert any("MLAS" in n and "no instruction-set cap" in n for n in onnx_int8.notes)


def test_the_irs_are_timed_again_under_avx2_emulation_for_the_choice(avx2_run):
    """With an AVX2 CPU named on this richer host, both IRs carry latencies timed with oneDNN capped at AVX2, which the
    delivery rule reads (export_choice: INT8 must win there too); the ONNX files carry none (no cap in onnxruntime)."""
    if not deploy_hosts.needs_avx2_emulation(["avx2"]):
        pytest.skip("this host is itself AVX2-only (or not x86): nothing to emulate")
    by = {a.label: a for a in avx2_run.artifacts if a.target}
    for label in ("openvino.fp32", "openvino.int8"):
        assert all(by[label].metrics[f"latency_b{b}_median_ms_emulated_avx2"] > 0 for b in (1, 8)), label
        assert any(n.startswith("timed under AVX2 emulation") for n in by[label].notes)
    assert not any(k.endswith("_emulated_avx2") and "latency" in k for k in by["onnx.int8"].metrics)

