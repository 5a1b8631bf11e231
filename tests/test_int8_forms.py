"""`form: auto` (issue 25, item 1): which INT8 forms a host may choose from, how the measured choice is made, and
that an artifact in a form this host cannot run exactly is refused, not timed, by `pruneflow bench`."""

from __future__ import annotations

import pytest

from pruneflow.deployment import cpu_shortfall, int8_cpu_runtime
from pruneflow.export.forms import PORTABLE_MARGIN, Candidate, _pick, exact_encodings, needs_vnni

AVX2 = {"cpu": {"arch": "x86_64", "isa": ["avx2", "fma"]}}
VNNI = {"cpu": {"arch": "x86_64", "isa": ["avx2", "avx512f", "avx512_vnni"]}}
ARM = {"cpu": {"arch": "aarch64", "isa": []}}


def test_a_cpu_without_vnni_may_only_choose_the_guarded_form():
    assert exact_encodings(AVX2)[0] == ["u8s8"]
    assert "no VNNI" in exact_encodings(AVX2)[1]
    for host in (VNNI, ARM):
        assert exact_encodings(host)[0] == ["u8s8", "u8s8_vnni", "s8s8"]
    assert not needs_vnni("u8s8") and all(needs_vnni(f) for f in ("u8s8_vnni", "s8s8", "tensorrt"))


def _candidates(times: dict[str, tuple[float, float]], failed: tuple[str, ...] = ()) -> list[Candidate]:
    out = []
    for form, (b1, b32) in times.items():
        c = Candidate(form, None, lambda x: x, cosine=0.5 if form in failed else 0.9999, passed=form not in failed)
        c.p50_ms = {1: b1, 32: b32}
        out.append(c)
    return out


@pytest.mark.parametrize("times, failed, chosen", [
    # inside the margin, the first (portable) form is kept
    ({"u8s8": (1.0, 30.0), "u8s8_vnni": (0.99, 29.5), "s8s8": (1.2, 40.0)}, (), "u8s8"),
    # clearly faster: taken
    ({"u8s8": (1.0, 30.0), "u8s8_vnni": (0.9, 27.0), "s8s8": (1.2, 40.0)}, (), "u8s8_vnni"),
    # two forms within noise of each other: the earlier one, so that two runs do not flip between them
    ({"u8s8": (1.0, 30.0), "u8s8_vnni": (0.9, 27.0), "s8s8": (0.89, 26.8)}, (), "u8s8_vnni"),
    # a form that failed parity is never chosen, however fast
    ({"u8s8": (1.0, 30.0), "u8s8_vnni": (0.5, 15.0)}, ("u8s8_vnni",), "u8s8"),
])
def test_the_choice_is_the_first_form_within_the_margin_of_the_fastest(times, failed, chosen):
    candidates = _candidates(times, failed)
    for c in candidates:  # a failed candidate was not timed
        if not c.passed:
            c.p50_ms = {}
    choice = _pick(candidates, [1, 32])
    assert choice.form == chosen
    rows = {r["form"]: r for r in choice.rows}
    assert [f for f, r in rows.items() if r["chosen"]] == [chosen]
    assert all(rows[f]["relative"] is None and not rows[f]["passed"] for f in failed)
    best = min(r["relative"] for r in rows.values() if r["passed"])
    assert best == 1.0 and rows[chosen]["relative"] <= 1 + PORTABLE_MARGIN
    assert chosen in choice.note("onnxruntime") and "x of the fastest" in choice.note("onnxruntime")


def test_an_ir_choice_names_the_precision_hint_it_chose_too():
    """An IR's candidates are FORM@HINT: with the form pinned for the serving CPUs, what was measured is the hint, and
    the note said "INT8 form u8s8@default, chosen by measuring" beside "INT8 form u8s8, chosen … without timing"."""
    from pruneflow.export.forms import Choice

    rows = [{"form": "u8s8@default", "relative": 1.01, "passed": True}, {"form": "u8s8", "relative": 1.0, "passed": True}]
    note = Choice("u8s8@default", rows, "within 3% of the fastest").note("openvino")
    assert note.startswith("INT8 form and precision hint u8s8@default, chosen by measuring in openvino")
    assert Choice("u8s8", rows, "x").note("onnxruntime").startswith("INT8 form u8s8, chosen by measuring")


def test_a_form_that_needs_vnni_is_flagged_on_a_host_without_it():
    assert int8_cpu_runtime("u8s8") is None
    record = {"runtime": int8_cpu_runtime("u8s8_vnni")}
    assert cpu_shortfall(record, VNNI) is None and cpu_shortfall(record, ARM) is None
    why = cpu_shortfall(record, AVX2)
    assert why and "u8s8_vnni" in why and "avx512_vnni" in why and "form: u8s8" in why
    assert cpu_shortfall({}, AVX2) is None and cpu_shortfall(None, AVX2) is None


def test_bench_does_not_time_an_artifact_this_cpu_would_compute_wrongly(tmp_path, monkeypatch):
    """A u8s8_vnni ONNX built on a VNNI host and benchmarked on one without: its lanes carry the reason, no figures."""
    import onnx
    from onnx import TensorProto, helper

    from pruneflow.benchmark import measure, variants
    from pruneflow.formats.onnx import stamp_onnx

    graph = helper.make_graph([helper.make_node("Relu", ["input"], ["logits"])], "g",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, [None, 4])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    record = {"format": "pruneflow-deployment/1", "runtime": int8_cpu_runtime("u8s8_vnni")}
    stamp_onnx(model, record, "int8")
    path = tmp_path / "model.int8.onnx"
    onnx.save(model, str(path))
    monkeypatch.setattr("pruneflow.runtime.host.host_info", lambda: AVX2)  # where deployment.cpu_shortfall reads it
    (variant,) = variants.collect_variants([path])
    assert variant.shortfall and "u8s8_vnni" in variant.shortfall
    lanes = measure.open_lanes([variant], measure.BenchSettings(threads=1))
    assert lanes and all(la.executor is None and la.error.startswith("not timed: ") for la in lanes)


def test_an_ir_at_openvinos_default_counts_only_when_it_agrees_as_well_as_at_f32():
    """openvino `int8_hint: auto`: FORM@default is kept only when its agreement with the quantized model (top-1 here)
    is not below the same IR's at f32, even when its cosine passes."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from pruneflow.export.forms import choose
    from pruneflow.tasks import make_task

    ref = np.tile(np.array([[2.0, 1.0]], np.float32), (64, 1))
    flipped = ref.copy()
    flipped[0] = [1.0, 2.0]  # one near-tie moved: cosine still 0.997, top-1 agreement 63/64
    state = SimpleNamespace(task=make_task(None), data=SimpleNamespace(eval=SimpleNamespace(x=torch.randn(64, 4))))
    outputs = {"u8s8@default": flipped, "tensorrt@default": ref, "u8s8": ref, "tensorrt": ref}
    candidates = [Candidate(form, None, (lambda out: lambda x: out[: len(x)])(out), at_least_as=form.partition("@")[0]
                            if "@" in form else None) for form, out in outputs.items()]
    choice = choose(candidates, state, ref, min_cosine=0.99, batches=[1], runs=3)
    rows = {r["form"]: r for r in choice.rows}
    assert rows["u8s8@default"]["cosine"] > 0.99 and not rows["u8s8@default"]["passed"]
    assert rows["tensorrt@default"]["passed"] and rows["u8s8"]["passed"]
    assert choice.form != "u8s8@default"


def test_the_agreement_rule_follows_the_figures_direction():
    """A binary classifier's agreement figure is a mean |difference of probabilities|: lower is better."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from pruneflow.export.forms import choose
    from pruneflow.tasks import make_task

    ref = np.linspace(-2, 2, 64, dtype=np.float32).reshape(64, 1)
    outputs = {"u8s8@default": ref + 0.2, "u8s8": ref + 0.05, "s8s8@default": ref + 0.01, "s8s8": ref + 0.05}
    state = SimpleNamespace(task=make_task("binary"), data=SimpleNamespace(eval=SimpleNamespace(x=torch.randn(64, 4))))
    candidates = [Candidate(form, None, (lambda out: lambda x: out[: len(x)])(out), at_least_as=form.partition("@")[0]
                            if "@" in form else None) for form, out in outputs.items()]
    rows = {r["form"]: r for r in choose(candidates, state, ref, min_cosine=0.9, batches=[1], runs=3).rows}
    assert not rows["u8s8@default"]["passed"] and rows["s8s8@default"]["passed"]
