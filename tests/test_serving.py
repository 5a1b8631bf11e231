"""The serving executor (pruneflow.runtime.serving): dynamic batching over real onnxruntime and OpenVINO sessions.

Every answer is checked against one direct batched run of the same artifact; no request may be lost or answered
twice, shutdown answers or refuses each queued request, and text is bucketed by length without changing a row."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from torch import nn

from pruneflow.errors import UsageError
from pruneflow.runtime import BatchPolicy, Executor, RuntimeUnavailable, Server, ServerClosed, open_artifact
from pruneflow.runtime.metrics import ServingMetrics, histogram_quantile, scrape, serve_metrics


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.ReLU())
        self.click, self.finish = nn.Linear(32, 1), nn.Linear(32, 3)

    def forward(self, x):
        h = self.body(x)
        return self.click(h), self.finish(h)


class MaskedMean(nn.Module):
    """Token ids -> masked mean of their embeddings -> 4 scores: a row's answer does not depend on its padding."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(100, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, input_ids, attention_mask):
        m = attention_mask.unsqueeze(-1).float()
        return self.head((self.table(input_ids) * m).sum(1) / m.sum(1).clamp(min=1))


def _export(model, args, path, names, outputs, axes):
    torch.onnx.export(model.eval(), args, str(path), input_names=names, output_names=outputs, dynamic_axes=axes,
                      opset_version=17, dynamo=False)
    return path


@pytest.fixture(scope="module")
def mlp(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("serve") / "mlp.onnx"
    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 5))
    _export(model, (torch.randn(2, 12),), path, ["input"], ["logits"], {"input": {0: "batch"}, "logits": {0: "batch"}})
    record = {"input": {"name": "input", "shape": ["batch", 12], "dtype": "float32"},
              "output": {"name": "logits", "shape": ["batch", 5], "dtype": "float32"}}
    return path, record


def _x(n, seed=0):
    return np.random.default_rng(seed).standard_normal((n, 12)).astype(np.float32)


def test_1000_requests_from_8_threads_each_get_their_own_row(mlp):
    path, record = mlp
    x = _x(1000)
    direct = open_artifact(path, threads=1)(x)
    with Server([open_artifact(path, threads=1)], record, BatchPolicy(max_batch=16, max_delay_ms=2)) as server:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda i: server(x[i], timeout=30), range(1000)))
        stats = server.stats
    assert all(a.shape == (5,) for a in answers)
    np.testing.assert_allclose(np.stack(answers), direct, rtol=1e-5, atol=1e-5)
    assert stats.answered == 1000 and stats.refused == 0 and stats.failed == 0
    assert sum(stats.batch_rows) == 1000  # every request ran exactly once
    assert max(stats.batch_rows) <= 16 and max(stats.batch_rows) > 1  # batches formed, never above max_batch


def test_openvino_workers_and_rows_kept_together(mlp, tmp_path):
    import openvino as ov

    path, record = mlp
    xml = tmp_path / "mlp.xml"
    ov.save_model(ov.convert_model(str(path)), str(xml))
    x = _x(300, seed=1)
    direct = open_artifact(xml, precision_hint="f32")(x)
    executors = [open_artifact(xml, precision_hint="f32", threads=1) for _ in range(2)]
    with Server(executors, record, BatchPolicy(max_batch=8, max_delay_ms=1)) as server:
        futures = [server.submit_rows(x[i:i + 3]) for i in range(0, 300, 3)]
        rows = np.concatenate([f.result(30) for f in futures])
        assert server.stats.answered == 100 and sum(server.stats.batch_rows) == 300
        # a caller's rows stay in one batch: every batch is a whole number of 3-row requests
        assert all(r % 3 == 0 for r in server.stats.batch_rows) and max(server.stats.batch_rows) <= 8
    np.testing.assert_allclose(rows, direct, rtol=1e-4, atol=1e-4)


def test_multi_head_answers_are_dicts_of_heads(tmp_path):
    torch.manual_seed(0)
    path = _export(TwoHeads(), (torch.randn(2, 12),), tmp_path / "heads.onnx", ["input"], ["click", "finish"],
                   {"input": {0: "batch"}, "click": {0: "batch"}, "finish": {0: "batch"}})
    record = {"input": {"name": "input", "shape": ["batch", 12], "dtype": "float32"},
              "output": {"name": "click", "names": ["click", "finish"]}}
    x = _x(40, seed=2)
    click, finish = open_artifact(path).run_outputs(x)
    with Server([open_artifact(path)], record, BatchPolicy(max_batch=8, max_delay_ms=1)) as server:
        answers = [f.result(30) for f in [server.submit(row) for row in x]]
    assert set(answers[0]) == {"click", "finish"} and answers[0]["finish"].shape == (3,)
    np.testing.assert_allclose(np.stack([a["click"] for a in answers]), click, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.stack([a["finish"] for a in answers]), finish, rtol=1e-5, atol=1e-5)


class _Recording:
    """An executor wrapper recording each batch's token length (and optionally slow)."""

    def __init__(self, inner: Executor, sleep: float = 0.0):
        self.inner, self.sleep, self.lengths = inner, sleep, []
        self.label = inner.label

    def run_outputs(self, feed):
        self.lengths.append(feed["input_ids"].shape[1] if "input_ids" in feed else None)
        time.sleep(self.sleep)
        return self.inner.run_outputs(feed)


def test_text_is_bucketed_by_length_and_rows_unchanged(tmp_path):
    torch.manual_seed(0)
    path = _export(MaskedMean(), (torch.ones(2, 7, dtype=torch.long), torch.ones(2, 7, dtype=torch.long)),
                   tmp_path / "text.onnx", ["input_ids", "attention_mask"], ["logits"],
                   {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"},
                    "logits": {0: "batch"}})
    record = {"input": {"names": ["input_ids", "attention_mask"],
                        "inputs": {"input_ids": {"shape": ["batch", "sequence"], "dtype": "int64"},
                                   "attention_mask": {"shape": ["batch", "sequence"], "dtype": "int64"}}, "layout": "NL"},
              "output": {"name": "logits"}, "preprocessing": {"max_length": 40}}
    rng = np.random.default_rng(3)
    lengths = rng.integers(1, 41, size=200)
    requests = [{"input_ids": rng.integers(1, 100, size=n), "attention_mask": np.ones(n, dtype=np.int64)} for n in lengths]
    # a caller that pads to max_length itself: the server trims its padding off before bucketing
    requests[0] = {"input_ids": np.pad(requests[0]["input_ids"], (0, 40 - lengths[0])),
                   "attention_mask": np.pad(requests[0]["attention_mask"], (0, 40 - lengths[0]))}
    single = open_artifact(path)
    expected = [single({k: v[None] for k, v in r.items()})[0] for r in requests]
    recorder = _Recording(open_artifact(path))
    with Server([recorder], record, BatchPolicy(max_batch=16, max_delay_ms=3, length_buckets=(8, 16, 40))) as server:
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda r: server(r, timeout=30), requests))
    np.testing.assert_allclose(np.stack(answers), np.stack(expected), rtol=1e-5, atol=1e-5)
    assert set(recorder.lengths) <= {8, 16, 40}  # every batch padded to one bucket
    assert server.stats.answered == 200


def test_shutdown_answers_or_refuses_every_queued_request(mlp):
    path, record = mlp
    x = _x(60, seed=4)
    slow = _Recording(open_artifact(path), sleep=0.05)
    server = Server([slow], record, BatchPolicy(max_batch=4, max_delay_ms=0))
    futures = [server.submit(row) for row in x]
    time.sleep(0.08)
    server.close(drain=False)
    answered = [f for f in futures if f.exception() is None]
    refused = [f for f in futures if isinstance(f.exception(), ServerClosed)]
    assert len(answered) + len(refused) == 60 and answered and refused
    assert server.stats.answered == len(answered) and server.stats.refused == len(refused)
    with pytest.raises(ServerClosed):
        server.submit(x[0])

    drained = Server([_Recording(open_artifact(path), sleep=0.01)], record, BatchPolicy(max_batch=4, max_delay_ms=0))
    futures = [drained.submit(row) for row in x]
    drained.close(drain=True)
    assert all(f.done() and f.exception() is None for f in futures) and drained.stats.answered == 60


def test_bad_requests_and_devices_are_named(mlp):
    path, record = mlp
    with Server([open_artifact(path)], record) as server:
        with pytest.raises(UsageError, match="does not fit"):
            server.submit(np.zeros(11, dtype=np.float32))
    with pytest.raises(RuntimeUnavailable, match="no device 'npu'"):
        Server.open(path, device="npu")
    with pytest.raises(RuntimeUnavailable, match="no such artifact"):
        Server.open(path.with_name("missing.onnx"))
    with pytest.raises(UsageError, match="max_batch"):
        BatchPolicy(max_batch=0)


class _Observed(ServingMetrics):
    """The Prometheus metrics, also keeping every latency they were given (the exact p99 to hold the scrape to)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[float] = []

    def on_answer(self, seconds, ok):
        self.seen.append(seconds)
        super().on_answer(seconds, ok)


def test_live_metrics_agree_with_the_requests_served(mlp):
    import urllib.request

    path, record = mlp
    metrics = _Observed({"model": "mlp", "version": "1", "precision": "fp32", "runtime": "onnxruntime", "device": "cpu"})
    endpoint = serve_metrics(metrics.registry)
    try:
        with Server([open_artifact(path)], record, BatchPolicy(max_batch=8, max_delay_ms=2), metrics) as server:
            x = _x(400, seed=5)
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(lambda i: server(x[i], timeout=30), range(400)))
        assert endpoint.url.startswith("http://127.0.0.1:")
        text = urllib.request.urlopen(endpoint.url, timeout=5).read().decode()
    finally:
        endpoint.close()
    assert scrape(text, "pruneflow_requests", {"outcome": "answered", "model": "mlp"})["value"] == 400
    hist = scrape(text, "pruneflow_request_latency_seconds")
    assert hist["count"] == 400 and hist["sum"] == pytest.approx(sum(metrics.seen), rel=1e-6)
    # buckets 5 % apart: the quantile a dashboard interpolates is within 5 % of the exact one
    for q in (0.5, 0.99):
        exact = float(np.quantile(metrics.seen, q, method="inverted_cdf"))
        assert histogram_quantile(q, hist["buckets"]) == pytest.approx(exact, rel=0.05)
    batches = scrape(text, "pruneflow_batch_size")
    assert batches["sum"] == 400 and 0 < batches["count"] <= 400
    assert scrape(text, "pruneflow_queue_depth")["value"] >= 0


def test_the_example_service_answers_over_http_and_drains_on_sigterm(mlp, tmp_path):
    """docs/examples/serve.py as a user runs it: a POST answers the sample's row, /metrics counts it, SIGTERM exits 0."""
    import json
    import os
    import re
    import signal
    import subprocess
    import sys
    import urllib.request
    from pathlib import Path

    import onnx

    from pruneflow.formats.onnx import stamp_onnx

    path, record = mlp
    stamped = tmp_path / "mlp.onnx"
    proto = onnx.load(str(path))
    stamp_onnx(proto, record, "fp32")
    onnx.save(proto, str(stamped))
    example = Path(__file__).parents[1] / "docs" / "examples" / "serve.py"
    proc = subprocess.Popen([sys.executable, str(example), str(stamped), "--port", "0", "--metrics-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"PYTHONPATH": str(Path(__file__).parents[1])})
    try:
        line = proc.stdout.readline()
        urls = re.findall(r"http://127\.0\.0\.1:\d+/\w+", line)
        assert len(urls) == 2, line + proc.stderr.read()
        x = _x(3, seed=9)
        answers = []
        for row in x:
            request = urllib.request.Request(urls[0], data=json.dumps({"input": row.tolist()}).encode(), method="POST")
            answers.append(json.loads(urllib.request.urlopen(request, timeout=30).read())["output"])
        np.testing.assert_allclose(np.array(answers), open_artifact(stamped)(x), rtol=1e-5, atol=1e-5)
        text = urllib.request.urlopen(urls[1], timeout=5).read().decode()
        assert scrape(text, "pruneflow_requests", {"outcome": "answered", "precision": "fp32"})["value"] == 3
        bad = urllib.request.Request(urls[0], data=json.dumps({"input": [1.0, 2.0]}).encode(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(bad, timeout=30)
        assert refused.value.code == 400 and "does not fit" in refused.value.read().decode()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_the_grafana_dashboard_plots_series_the_server_exposes():
    import json
    import re
    from pathlib import Path

    from prometheus_client import generate_latest

    metrics = ServingMetrics({"model": "m", "version": "v", "precision": "int8", "runtime": "onnxruntime", "device": "cpu"})
    metrics.on_queue(1)
    metrics.on_batch(2, 0.001)
    metrics.on_answer(0.002, True)
    exposed = set(re.findall(r"^(pruneflow_\w+?)(?:\{| )", generate_latest(metrics.registry).decode(), re.M))
    dashboard = json.loads((Path(__file__).parents[1] / "docs" / "grafana-pruneflow-serving.json").read_text())
    queried = {name for p in dashboard["panels"] for t in p["targets"] for name in re.findall(r"pruneflow_\w+", t["expr"])}
    assert queried and queried <= exposed, queried - exposed
    titles = " ".join(p["title"] for p in dashboard["panels"])
    assert all(word in titles for word in ("QPS", "P99", "Batch size", "Queue depth"))
    labels = {"model", "version", "precision", "runtime", "device"}
    assert all(labels <= set(re.findall(r"\w+", t["expr"])) for p in dashboard["panels"] for t in p["targets"])
