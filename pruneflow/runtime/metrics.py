"""Live serving metrics in Prometheus's form: what a platform's dashboard plots as QPS, P99 and batch size.

    from pruneflow.runtime import Server
    from pruneflow.runtime.metrics import ServingMetrics, serve_metrics

    metrics = ServingMetrics.for_artifact("runs/r/export/onnx/model.int8.onnx", runtime="onnxruntime", device="cpu")
    server = Server.open("runs/r/export/onnx/model.int8.onnx", metrics=metrics)
    endpoint = serve_metrics(metrics.registry, port=9464)      # http://127.0.0.1:9464/metrics
    ...
    endpoint.close()

Series (units by Prometheus's convention, seconds; every one labelled ``model``, ``version``, ``precision``,
``runtime``, ``device``):

- ``pruneflow_requests_total{outcome="answered"|"refused"}``: requests; ``rate(...[1m])`` is the QPS.
- ``pruneflow_request_latency_seconds``: end-to-end latency of each request, queue wait + compute (a histogram
  whose buckets are 5 % apart from 50 µs to 60 s, so ``histogram_quantile(0.99, ...)`` lands within a few per cent
  of the exact p99).
- ``pruneflow_batch_size``: rows in each batch the batcher ran (histogram).
- ``pruneflow_batch_compute_seconds``: the runtime's time per batch (histogram).
- ``pruneflow_queue_depth``: requests waiting (gauge).

The endpoint binds loopback only (``127.0.0.1``); put a proxy in front to expose it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..deps import require

#: Latency buckets: 5 % apart from 50 µs to 60 s (289 of them), so the quantile a scrape interpolates is close.
LATENCY_BUCKETS = tuple(round(5e-5 * 1.05 ** k, 9) for k in range(int(math.log(60 / 5e-5) / math.log(1.05)) + 2))
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024)
LABELS = ("model", "version", "precision", "runtime", "device")


class ServingMetrics:
    """The series above for one served artifact, in ``registry`` (a new ``CollectorRegistry`` unless given: several
    artifacts served by one process share one registry and are told apart by their labels)."""

    def __init__(self, labels: dict[str, str], registry: Any = None):
        prom = require("prometheus_client", "pip install prometheus-client", "serving metrics")
        self.registry = registry if registry is not None else prom.CollectorRegistry()
        # LABELS, then any others given (`bench --load` adds the batching policy and threads of each lane)
        names = (*LABELS, *sorted(k for k in labels if k not in LABELS))
        self.labels = {k: str(labels.get(k, "")) for k in names}
        existing = getattr(self.registry, "_pruneflow_series", None)
        if existing is not None and existing["names"] != names:
            raise ValueError(f"this registry's pruneflow series are labelled {existing['names']}, not {names}")
        if existing is None:  # the series are made once per registry, then labelled per artifact
            existing = {
                "names": names,
                "requests": prom.Counter("pruneflow_requests", "Requests by outcome (answered or refused).",
                                         (*names, "outcome"), registry=self.registry),
                "latency": prom.Histogram("pruneflow_request_latency_seconds", "End-to-end latency of a request: queue "
                                          "wait and compute.", names, buckets=LATENCY_BUCKETS, registry=self.registry),
                "batch": prom.Histogram("pruneflow_batch_size", "Rows in each batch run.", names, buckets=BATCH_BUCKETS,
                                        registry=self.registry),
                "compute": prom.Histogram("pruneflow_batch_compute_seconds", "The runtime's time for one batch.", names,
                                          buckets=LATENCY_BUCKETS, registry=self.registry),
                "queue": prom.Gauge("pruneflow_queue_depth", "Requests waiting for a batch.", names, registry=self.registry),
            }
            self.registry._pruneflow_series = existing
        values = [self.labels[k] for k in names]
        self._answered = existing["requests"].labels(*values, "answered")
        self._refused = existing["requests"].labels(*values, "refused")
        self._latency = existing["latency"].labels(*values)
        self._batch = existing["batch"].labels(*values)
        self._compute = existing["compute"].labels(*values)
        self._queue = existing["queue"].labels(*values)

    @classmethod
    def for_artifact(cls, path: str | Path, *, runtime: str, device: str, version: str | None = None,
                     registry: Any = None) -> "ServingMetrics":
        """Labels from the artifact: ``model`` its run folder's name (or the file's stem), ``version`` the given one
        or the first 12 hex digits of its sha256, ``precision`` from its deployment record."""
        from ..artifacts import sha256_file
        from ..formats import read_record

        path = Path(path)
        record = read_record(path)
        run = next((p for p in path.resolve().parents if (p / "manifest.json").is_file()), None)
        return cls({"model": run.name if run else path.stem, "version": version or sha256_file(path)[:12],
                    "precision": str(record.get("precision") or "unknown"), "runtime": runtime, "device": device},
                   registry)

    def on_queue(self, depth: int) -> None:
        self._queue.set(depth)

    def on_batch(self, rows: int, seconds: float) -> None:
        self._batch.observe(rows)
        self._compute.observe(seconds)

    def on_answer(self, seconds: float, ok: bool) -> None:
        if ok:
            self._answered.inc()
            self._latency.observe(seconds)
        else:
            self._refused.inc()


@dataclass
class MetricsEndpoint:
    """A running ``/metrics`` endpoint; ``close()`` stops it."""

    url: str
    _server: Any
    _thread: Any

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve_metrics(registry: Any, port: int = 0, addr: str = "127.0.0.1") -> MetricsEndpoint:
    """Serve ``registry`` at ``http://addr:port/metrics`` from a daemon thread (``port=0``: a free one, in ``url``)."""
    prom = require("prometheus_client", "pip install prometheus-client", "serving metrics")
    server, thread = prom.start_http_server(port, addr=addr, registry=registry)
    host, bound = server.server_address[:2]
    return MetricsEndpoint(f"http://{host}:{bound}/metrics", server, thread)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's ``histogram_quantile`` on one histogram's cumulative ``(upper bound, count)`` pairs (the last
    ``+Inf``): linear interpolation inside the bucket holding the q-th observation, as Grafana would show it."""
    buckets = sorted(buckets)
    total = buckets[-1][1]
    if total <= 0:
        return float("nan")
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            inside = count - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / inside if inside else 1.0)
        lower_bound, lower_count = bound, count
    return lower_bound


def scrape(text: str, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """The samples of series ``name`` (a histogram's ``_bucket``/``_count``/``_sum``, or a counter/gauge) in a
    Prometheus text exposition, keeping those whose labels include ``labels``: ``{"value": float}`` for a plain
    series (summed), ``{"buckets": [(le, count)], "count", "sum"}`` for a histogram."""
    require("prometheus_client", "pip install prometheus-client", "serving metrics")
    from prometheus_client.parser import text_string_to_metric_families

    want = labels or {}
    out: dict[str, Any] = {"buckets": {}, "count": 0.0, "sum": 0.0, "value": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(name) or any(sample.labels.get(k) != v for k, v in want.items()):
                continue
            if sample.name == f"{name}_bucket":
                le = float(sample.labels["le"])
                out["buckets"][le] = out["buckets"].get(le, 0.0) + sample.value
            elif sample.name == f"{name}_count":
                out["count"] += sample.value
            elif sample.name == f"{name}_sum":
                out["sum"] += sample.value
            elif sample.name in (name, f"{name}_total"):
                out["value"] += sample.value
    out["buckets"] = sorted(out["buckets"].items())
    return out
