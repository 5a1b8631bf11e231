"""`pruneflow bench --load`: real onnxruntime and OpenVINO sessions served open-loop through the dynamic batcher.

Rates are kept far below what a small MLP sustains on any host, so what is asserted (every request answered once,
the figures consistent with each other and with a scrape of /metrics) does not depend on the machine's speed."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from conftest import invoke


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    import onnx
    import openvino as ov

    from pruneflow.formats.onnx import stamp_onnx
    from pruneflow.formats.openvino import stamp_ir

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("load")
    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 5)).eval()
    path = folder / "mlp.fp32.onnx"
    torch.onnx.export(model, (torch.randn(2, 12),), str(path), input_names=["input"], output_names=["logits"],
                      dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}}, opset_version=17, dynamo=False)
    record = {"format": "pruneflow-deployment/1", "input": {"name": "input", "shape": ["batch", 12], "dtype": "float32"},
              "output": {"name": "logits", "shape": ["batch", 5], "dtype": "float32"}}
    proto = onnx.load(str(path))
    stamp_onnx(proto, record, "fp32")
    onnx.save(proto, str(path))
    ir = ov.convert_model(str(path))
    stamp_ir(ir, record | {"runtime": {"openvino": {"INFERENCE_PRECISION_HINT": "f32"}}}, "fp32")
    xml = folder / "mlp.fp32.xml"
    ov.save_model(ir, str(xml))
    return path, xml


def _load(*args):
    result = invoke("bench", *map(str, args))
    return result


def test_sweep_serves_every_request_once_and_the_figures_agree(artifacts, tmp_path):
    onnx_path, xml = artifacts
    out = tmp_path / "load.json"
    result = _load(onnx_path, xml, "--load", "--rate", "40,120", "--max-batch", "1,4", "--max-delay-ms", "1",
                   "--duration", "0.5", "--metrics-port", "0", "--json", out, "--html", tmp_path / "load.html",
                   "--prometheus", tmp_path / "load.prom")
    assert result.exit_code == 0, result.output
    doc = json.loads(out.read_text())
    assert doc["format"] == "pruneflow-bench-load/1" and doc["host"]["cpu"]["model"]
    lanes = doc["lanes"]
    # each artifact in its own runtime (an .onnx in onnxruntime, an IR in OpenVINO at its record's hint) x 2 policies
    assert sorted((la["runtime"], la["policy"]) for la in lanes) == [
        ("onnxruntime", "b1/0ms"), ("onnxruntime", "b4/1ms"), ("openvino", "b1/0ms"), ("openvino", "b4/1ms")]
    assert all("f32" in la["runtime_label"] for la in lanes if la["runtime"] == "openvino")
    for lane in lanes:
        assert [p["offered_qps"] for p in lane["points"]] == [40.0, 120.0]
        for p in lane["points"]:
            assert p["answered"] == p["requests"] == max(20, int(np.ceil(p["offered_qps"] * 0.5))) and p["unanswered"] == 0
            assert sum(int(k) * v for k, v in p["batch_sizes"].items()) == p["requests"]  # every request ran once
            assert max(map(int, p["batch_sizes"])) <= lane["max_batch"]
            assert 0 < p["p50_ms"] <= p["p95_ms"] <= p["p99_ms"]
            # /metrics, scraped before and after the point over HTTP, agrees with bench's own figures
            assert p["scraped"]["answered"] == p["answered"]
            assert p["scraped"]["p99_ms"] == pytest.approx(p["p99_ms"], rel=0.05)
            assert p["scraped"]["qps"] == pytest.approx(p["achieved_qps"], rel=0.05)
        if lane["max_batch"] == 1:
            assert all(p["mean_batch"] == 1.0 for p in lane["points"])
    best = {b["variant"]: b for b in doc["best"]}
    assert set(best) == {str(onnx_path), str(xml)}
    # each artifact's best is the highest knee among its lanes (which rates a host holds is a benchmark's question:
    # benchmarks/results/load_*.md), and its ratio is to the FP32 lane served one request at a time
    named = {f"{la['variant']} · {la['runtime_label']} · {la['policy']} · {la['threads']}t": la for la in lanes}
    reference = named[doc["reference"]] if doc["reference"] else None
    for variant, b in best.items():
        knees = [la["knee_qps"] for la in lanes if la["variant"] == variant and la["knee_qps"]]
        if not knees:
            assert "no lane held" in b["why"]
            continue
        assert b["qps"] == max(knees) and b["policy"] in {la["policy"] for la in lanes if la["knee_qps"] == max(knees)}
        if reference is not None:
            assert b["vs_fp32_one_at_a_time"] == pytest.approx(b["qps"] / reference["knee_qps"])
    html = (tmp_path / "load.html").read_text()
    assert html.count("<svg") == 2 and "p99 latency against offered load" in html
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families((tmp_path / "load.prom").read_text())}
    latency = [s for s in families["pruneflow_load_latency_seconds"].samples if s.labels["quantile"] == "0.99"]
    assert len(latency) == 8 and all(s.value < 1 for s in latency)  # seconds, not milliseconds
    assert "best configuration per artifact" in result.output and "within" in result.output

    # a service takes the configuration bench found for its artifact on this host, and refuses one tuned elsewhere
    from pruneflow.errors import UsageError
    from pruneflow.runtime import Server, ServingConfig

    chosen = best[str(onnx_path)]
    with Server.tuned(onnx_path, out) as server:
        assert (server.policy.max_batch, server.policy.max_delay_ms, server.config.threads) == (
            chosen["max_batch"], chosen["max_delay_ms"], chosen["threads"])
        assert server.executors[0].runtime == "onnxruntime" and server(np.zeros(12, np.float32)).shape == (5,)
    elsewhere = {"cpu": {"model": "Some Other CPU", "isa": ["avx2"]}}
    with pytest.raises(UsageError, match="was measured on .* not on this host's Some Other CPU"):
        ServingConfig.from_bench(out, onnx_path, host=elsewhere)
    with pytest.raises(UsageError, match="holds no best configuration for other.onnx"):
        ServingConfig.from_bench(out, tmp_path / "other.onnx")


def test_search_finds_a_rate_and_an_impossible_budget_exits_1(artifacts, tmp_path):
    onnx_path, _ = artifacts
    out = tmp_path / "search.json"
    held = _load(onnx_path, "--load", "--p99-budget-ms", "500", "--max-batch", "4", "--max-delay-ms", "1",
                 "--duration", "0.3", "--requests", "300", "--json", out)
    assert held.exit_code == 0, held.output
    doc = json.loads(out.read_text())
    (lane,) = doc["lanes"]
    assert lane["knee_qps"] and len(lane["points"]) >= 2
    assert lane["knee_qps"] == max(p["offered_qps"] for p in lane["points"] if p["keeps_up"] and p["p99_ms"] <= 500)
    assert [p["offered_qps"] for p in lane["points"]] == sorted(p["offered_qps"] for p in lane["points"])

    missed = _load(onnx_path, "--load", "--p99-budget-ms", "0.0001", "--max-batch", "1", "--duration", "0.2",
                   "--requests", "50", "--json", tmp_path / "none.json")
    assert missed.exit_code == 1, missed.output
    assert "no lane held any rate within p99 0.0001 ms" in missed.output
    assert json.loads((tmp_path / "none.json").read_text())["exit_code"] == 1


@pytest.mark.parametrize("args, message", [
    (["--load"], "needs offered rates or a budget"),
    (["--load", "--rate", "0"], "rates must be positive"),
    (["--load", "--rate", "10", "--max-delay-ms", "inf"], "delays must be finite"),
    (["--threads", "1,2"], "several thread counts are lanes of --load only"),
])
def test_bad_load_options_are_usage_errors(artifacts, args, message):
    result = _load(artifacts[0], *args)
    assert result.exit_code == 2 and message in result.output


def test_load_files_of_two_hosts_merge_and_bad_files_are_named(artifacts, tmp_path):
    from pruneflow.benchmark.hosts import Prices
    from pruneflow.benchmark.load_merge import merge_load
    from pruneflow.errors import UsageError

    onnx_path, _ = artifacts
    here = tmp_path / "here.json"
    result = _load(onnx_path, "--load", "--rate", "30,60", "--max-batch", "1", "--duration", "0.3", "--json", here)
    assert result.exit_code == 0, result.output
    doc = json.loads(here.read_text())
    for lane in doc["lanes"]:  # this host held both rates (which rates a loaded host holds is a benchmark's question;
        for point in lane["points"]:  # here, the merge's arithmetic)
            point |= {"keeps_up": True, "p99_ms": min(point["p99_ms"], 100.0)}
    here.write_text(json.dumps(doc))
    doc["host"] |= {"label": "other-host"}
    for lane in doc["lanes"]:
        lane["variant"] = "/elsewhere/" + onnx_path.name  # the same artifact, in another folder on the other host
        lane["points"][-1]["p99_ms"] = 1e6  # the other host misses the budget at 60 requests/s
    other = tmp_path / "other.json"
    other.write_text(json.dumps(doc))
    merged = merge_load([here, other], Prices(table={"other-host": 2.0, "default": 1.0}, file="prices.yaml"), 1000.0)
    rows = {(r["host"], r["artifact"]): r for r in merged["best"]}
    here_name = json.loads(here.read_text())["host"]["cpu"]["model"]
    assert rows[(here_name, onnx_path.name)]["qps"] == 60.0 and rows[("other-host", onnx_path.name)]["qps"] == 30.0
    # the other host's price is twice this one's and it holds half the rate: four times the cost per million
    ratio = rows[("other-host", onnx_path.name)]["cost_per_million"] / rows[(here_name, onnx_path.name)]["cost_per_million"]
    assert ratio == pytest.approx(4.0, rel=0.25)
    assert [h["host"] for h in merged["best_per_host"]] == [here_name, "other-host"]
    shown = invoke("bench", "--merge", here, other, "--p99-budget-ms", "1000", "--json", tmp_path / "merged.json")
    assert shown.exit_code == 0, shown.output
    assert "other-host" in shown.output and f"{here_name}: best {onnx_path.name}" in shown.output
    assert json.loads((tmp_path / "merged.json").read_text())["format"] == "pruneflow-bench-load-merged/1"
    mixed = tmp_path / "plain.json"
    mixed.write_text('{"format": "pruneflow-bench/1"}')
    assert "some files are bench --load results" in invoke("bench", "--merge", here, mixed).output

    for mutate, message in [
        (lambda d: d["lanes"][0]["points"][0].update(p99_ms=-3.0), r"points\[0\].p99_ms is -3.0"),
        (lambda d: d["lanes"][0]["points"][0].update(offered_qps="fast"), "offered_qps is 'fast'"),
        (lambda d: d.pop("host"), "host is missing"),
        (lambda d: d["lanes"][0].update(threads=0), "threads is 0"),
    ]:
        bad = json.loads(here.read_text())
        mutate(bad)
        path = tmp_path / "bad.json"
        path.write_text(json.dumps(bad))
        with pytest.raises(UsageError, match=message):
            merge_load([path])
    nested = tmp_path / "nested.json"
    nested.write_text('{"format": "pruneflow-bench-load/1", "host": ' + "[" * 200_000 + "]" * 200_000 + "}")
    with pytest.raises(UsageError, match="not JSON|host is list"):
        merge_load([nested])
    nan = tmp_path / "nan.json"
    nan.write_text(here.read_text().replace('"achieved_qps": ', '"achieved_qps": NaN, "x": ', 1))
    with pytest.raises(UsageError, match="NaN is not a number JSON allows"):
        merge_load([nan])
