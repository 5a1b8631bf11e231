"""`pruneflow bench --load`: artifacts served under offered load, one request at a time, through the serving executor.

A service owner's question: requests arrive one user at a time at R per second; which artifact, batching policy and
thread count keeps p99 under the budget, and at what cost? Each *lane* is an artifact in one runtime (its own one
unless ``--runtime`` says otherwise, compiled as its deployment record says), one batching policy (``--max-batch`` ×
``--max-delay-ms``) and one thread count, served by :class:`pruneflow.runtime.Server`. Each *point* sends it
open-loop arrivals, a seeded Poisson process at the offered rate (the same arrival times for every lane at a
rate), for ``duration`` seconds or ``max_requests`` requests, whichever comes first; a request's latency runs from
its scheduled arrival to its answer (queue + compute: a late sender does not hide queueing). Per point: achieved
QPS, p50/p95/p99, the batch-size distribution, and the requests that missed the budget or were never answered.

Rates are either a sweep (``--rate``) or, with ``--p99-budget-ms`` alone, a search per lane for the highest rate whose
p99 holds the budget (start at half the capacity one batch's timing predicts, up by half until it fails, then
bisect). Points run in rounds, every lane's next point in turn, so machine drift hits all lanes alike.

Hand-written: no open tool loads non-LLM models this way any more (Triton's perf_analyzer and Model Analyzer need a
Triton server; Model Analyzer was deprecated in 2025).
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..context import Reporter
from ..errors import PruneflowError, UsageError
from ..formats import runtime_named
from ..runtime import BatchPolicy, RuntimeUnavailable, Server, host_info, open_artifact, runtimes_for
from ..runtime.base import Executor
from .exposition import strict
from .inputs import Feeds
from .result import cost_per_million, lane_cores
from .variants import Variant, collect_variants

FORMAT = "pruneflow-bench-load/1"
#: Requests kept as the per-point sample pool (cycled through by the arrivals).
POOL = 256
#: A point kept up when every request was answered and its queue did not grow: the median latency of its last tenth
#: of requests is at most this many times that of its first half (plus the policy's delay and 1 ms of slack). A
#: rate-based test (achieved >= 95 % of offered) misjudges short points, whose last answers' latency is a large part
#: of the window; a growing queue is what saturation is.
GROWTH = 2.0


@dataclass
class LoadSettings:
    """What `pruneflow bench --load` was asked; recorded in its JSON."""

    rates: list[float] | None = None
    max_batches: list[int] = field(default_factory=lambda: [1, 8, 32])
    max_delays_ms: list[float] = field(default_factory=lambda: [0.0, 2.0, 5.0])
    threads: list[int] = field(default_factory=lambda: [1])
    workers: int = 1
    #: Seconds of arrivals per point, and at most this many requests per point.
    duration: float = 3.0
    max_requests: int = 6000
    p99_budget_ms: float | None = None
    #: Bisection steps after the search's first failing rate.
    search_steps: int = 4
    #: None: each artifact in its own runtime (onnxruntime for .onnx, OpenVINO for .xml).
    runtimes: list[str] | None = None
    #: None: an IR compiled as its deployment record says; else OpenVINO hints to serve at ("default", "f32", ...).
    openvino_precisions: list[str] | None = None
    seed: int = 0
    price_per_hour: float | None = None
    price_source: str | None = None
    host_label: str | None = None
    #: Serve live /metrics on loopback at this port during the load (0: any free port).
    metrics_port: int | None = None

    def check(self) -> None:
        """Bad values are usage errors (exit 2) naming the option."""
        if self.rates is None and self.p99_budget_ms is None:
            raise UsageError("bench --load needs offered rates or a budget to search under",
                             hint="e.g. --rate 100,200,400,800, or --p99-budget-ms 20 to find the highest rate that holds it")
        if self.rates is not None and (not self.rates or any(not (0 < r < math.inf) for r in self.rates)):
            raise UsageError(f"--rate {self.rates}: rates must be positive numbers of requests per second", hint="e.g. --rate 100,400")
        if not self.max_batches or any(b < 1 for b in self.max_batches):
            raise UsageError(f"--max-batch {self.max_batches}: batch sizes must be >= 1", hint="e.g. --max-batch 1,8,32")
        if not self.max_delays_ms or any(not (0 <= d < math.inf) for d in self.max_delays_ms):
            raise UsageError(f"--max-delay-ms {self.max_delays_ms}: delays must be finite and >= 0", hint="e.g. --max-delay-ms 0,2,5")
        if not self.threads or any(t < 1 for t in self.threads) or self.workers < 1:
            raise UsageError("--threads and --workers must be >= 1 under --load", hint="e.g. --threads 1,2 --workers 1")
        if not (0 < self.duration < math.inf) or self.max_requests < 10:
            raise UsageError("--duration must be > 0 seconds and --requests >= 10 under --load", hint="e.g. --duration 3 --requests 5000")
        if self.p99_budget_ms is not None and not (0 < self.p99_budget_ms < math.inf):
            raise UsageError(f"--p99-budget-ms {self.p99_budget_ms}: the budget must be a positive finite number of ms",
                             hint="e.g. --p99-budget-ms 20")

    def policies(self) -> list[BatchPolicy]:
        """Every policy asked for; ``max_batch 1`` once (its delay changes nothing)."""
        out = [BatchPolicy(b, d) for b in self.max_batches for d in self.max_delays_ms if b > 1]
        return ([BatchPolicy(1, 0.0)] if 1 in self.max_batches else []) + out


@dataclass
class LoadPoint:
    """One offered rate on one lane."""

    offered_qps: float
    requests: int
    answered: int
    achieved_qps: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    mean_batch: float
    batch_sizes: dict[int, int]
    #: Requests over the budget, or never answered (counted as over it).
    missed: int
    unanswered: int
    keeps_up: bool
    seconds: float
    #: What a scrape of /metrics said over the same window (``--metrics-port``): QPS and p99 from the histogram.
    scraped: dict[str, float] | None = None

    def holds(self, budget: float | None) -> bool:
        """It kept up with the offered rate (every request answered, no growing queue) and its p99 is within the budget."""
        return self.keeps_up and (budget is None or self.p99_ms <= budget)


@dataclass(eq=False)
class LoadLane:
    variant: Variant
    runtime: str
    hint: str | None
    policy: BatchPolicy
    threads: int
    workers: int
    executors: list[Executor] = field(default_factory=list)
    #: The artifact's deployment record (input names, dtypes, axes, outputs), read once when the lane opens.
    record: dict[str, Any] = field(default_factory=dict)
    label: str = ""
    error: str | None = None
    points: list[LoadPoint] = field(default_factory=list)
    #: Requests per second one full batch's timing predicts (the search's starting point).
    capacity: float | None = None

    @property
    def name(self) -> str:
        return f"{self.variant.name} · {self.label} · {self.policy.label} · {self.threads}t"

    def best(self, budget: float | None) -> LoadPoint | None:
        """The knee of its curve: the highest offered rate that held with every lower rate tried holding too (a rate
        that held above one that failed is taken as luck, not capacity)."""
        best = None
        for point in sorted(self.points, key=lambda p: p.offered_qps):
            if not point.holds(budget):
                break
            best = point
        return best


@dataclass
class LoadResult:
    host: dict[str, Any]
    settings: LoadSettings
    lanes: list[LoadLane]
    inputs: dict[str, str]

    def cores(self, lane: LoadLane) -> int:
        return lane_cores(lane.threads * lane.workers, self.host)

    def cost_per_million(self, lane: LoadLane, qps: float) -> float | None:
        """What a million requests cost at ``qps`` on the cores this lane uses (its share of the machine's price)."""
        return cost_per_million(self.settings.price_per_hour, qps, self.cores(lane), self.host)

    def best_per_variant(self) -> list[dict[str, Any]]:
        """Per artifact: the lane that sustained the highest rate within the budget (or held every rate of the sweep
        at the lowest p99), with its figures and cost; or why none did."""
        budget = self.settings.p99_budget_ms
        out = []
        for variant in list({id(lane.variant): lane.variant for lane in self.lanes}.values()):
            lanes = [(lane, lane.best(budget)) for lane in self.lanes if lane.variant is variant]
            held = [(lane, p) for lane, p in lanes if p is not None]
            entry: dict[str, Any] = {"variant": variant.name, "precision": variant.precision, "p99_budget_ms": budget}
            if not held:
                tried = [p for lane, _ in lanes for p in lane.points]
                entry["why"] = ("no lane held any rate tried" + (f" within p99 {budget:g} ms" if budget else "")
                                + (f" (lowest p99 {min(p.p99_ms for p in tried):.3g} ms)" if tried else ""))
                out.append(entry)
                continue
            lane, point = max(held, key=lambda lp: (lp[1].offered_qps, -lp[1].p99_ms))
            base = self.one_at_a_time_fp32()
            entry["vs_fp32_one_at_a_time"] = point.offered_qps / base[1].offered_qps if base else None
            entry.update(lane=lane.name, runtime=lane.label, policy=lane.policy.label, max_batch=lane.policy.max_batch,
                         max_delay_ms=lane.policy.max_delay_ms, threads=lane.threads, workers=lane.workers,
                         cores=self.cores(lane), qps=point.offered_qps, achieved_qps=point.achieved_qps,
                         p99_ms=point.p99_ms, mean_batch=point.mean_batch,
                         cost_per_million=self.cost_per_million(lane, point.achieved_qps))
            out.append(entry)
        return out

    def one_at_a_time_fp32(self) -> tuple[LoadLane, LoadPoint] | None:
        """The reference a service is held to: the first FP32 artifact (an ONNX first) in its runtime's default,
        served one request at a time (max_batch 1) on the fewest threads, at the highest rate it held."""
        lanes = [lane for lane in self.lanes if lane.variant.precision == "fp32" and lane.policy.max_batch == 1]
        lanes.sort(key=lambda lane: (not _interchange(lane.variant.path), lane.threads))
        for lane in lanes:
            best = lane.best(self.settings.p99_budget_ms)
            if best is not None:
                return lane, best
        return None

    def as_json(self) -> dict[str, Any]:
        settings = asdict(self.settings)
        lanes = [{"variant": lane.variant.name, "model": lane.variant.model, "precision": lane.variant.precision,
                  "runtime": lane.runtime, "runtime_label": lane.label, "hint": lane.hint, "policy": lane.policy.label,
                  "max_batch": lane.policy.max_batch, "max_delay_ms": lane.policy.max_delay_ms, "threads": lane.threads,
                  "workers": lane.workers, "cores": self.cores(lane), "error": lane.error, "capacity_estimate": lane.capacity,
                  "knee_qps": (b.offered_qps if (b := lane.best(self.settings.p99_budget_ms)) else None),
                  "points": [{**asdict(p), "batch_sizes": {str(k): v for k, v in p.batch_sizes.items()},
                              "cost_per_million": self.cost_per_million(lane, p.achieved_qps)} for p in lane.points]}
                 for lane in self.lanes]
        return strict({"format": FORMAT, "exit_code": 0 if self.holds_any() else 1, "host": self.host,
                       "settings": settings, "inputs": self.inputs, "lanes": lanes, "best": self.best_per_variant(),
                       "reference": (ref[0].name if (ref := self.one_at_a_time_fp32()) else None)})

    def holds_any(self) -> bool:
        """Whether any lane held any point (within the budget when one was given): exit 1 otherwise."""
        return any(lane.best(self.settings.p99_budget_ms) for lane in self.lanes)


def run_load(sources: list[Path], settings: LoadSettings, reporter: Reporter | None = None) -> LoadResult:
    """Open every lane, then run the points in rounds (a sweep's rates, or each lane's search), and collect them."""
    reporter = reporter or Reporter()
    settings.check()
    variants = [v for v in collect_variants(sources) if v.timed and not v.shortfall]
    if not variants:
        raise PruneflowError("nothing to load: no built artifact this host can run among the arguments",
                             hint="pass run folders or .onnx/.xml files of built artifacts")
    feeds = Feeds(settings.seed)
    pools = {v.name: _pool(v, feeds) for v in variants}
    lanes = _open_lanes(variants, settings)
    if not any(lane.error is None for lane in lanes):
        raise RuntimeUnavailable("no lane could be opened: " + "; ".join(sorted({f"{la.variant.name}: {la.error}" for la in lanes})),
                                 hint="check --runtime, or bench one file at a time with -v")
    metrics = _Live(settings.metrics_port) if settings.metrics_port is not None else None
    try:
        for lane in lanes:
            if lane.error is None:
                lane.capacity = _capacity(lane, pools[lane.variant.name])
        if settings.rates is not None:
            _sweep(lanes, settings, pools, reporter, metrics)
        else:
            _search(lanes, settings, pools, reporter, metrics)
    finally:
        if metrics is not None:
            metrics.close()
    inputs = {v.name: feeds.source(v).what for v in variants}
    return LoadResult(_host(settings), settings, lanes, inputs)


def _host(settings: LoadSettings) -> dict[str, Any]:
    host = dict(host_info())
    if settings.host_label:
        host["label"] = settings.host_label
    return host


def _pool(variant: Variant, feeds: Feeds) -> list[Any]:
    """``POOL`` single requests (no batch axis) from the run's eval split, or random values of the input's shape."""
    batch = feeds.batch(variant, POOL)
    if isinstance(batch, dict):
        return [{k: v[i] for k, v in batch.items()} for i in range(POOL)]
    return [batch[i] for i in range(POOL)]


def _interchange(path: Path | None) -> bool:
    """Whether ``path`` is in the interchange format (ONNX), the reference a service is held to when there is one."""
    from ..formats import format_of

    fmt = format_of(path) if path is not None else None
    return fmt is not None and fmt.interchange


def _open_lanes(variants: list[Variant], settings: LoadSettings) -> list[LoadLane]:
    from ..formats import read_record

    lanes = []
    for variant in variants:
        assert variant.path is not None
        record = read_record(variant.path)
        own = list(runtimes_for(variant.path))
        runtimes = [r for r in own if r in settings.runtimes] if settings.runtimes is not None else own[:1]
        runtimes = [r for r in runtimes if r not in variant.refused]
        for runtime in runtimes:
            asked = settings.openvino_precisions if runtime_named(runtime).takes_precision_hint else None
            hints: list[str | None] = ["record"] if asked is None else [None if h == "default" else h for h in asked]
            for hint in hints:
                for threads in settings.threads:
                    opened = _executors(variant, record, runtime, hint, threads, settings.workers)
                    for policy in settings.policies():
                        lane = LoadLane(variant, runtime, hint, policy, threads, settings.workers, record=record)
                        if isinstance(opened, str):
                            lane.error = opened
                        else:
                            lane.executors, lane.label = opened, _label(opened[0])
                        lanes.append(lane)
    return lanes


def _executors(variant: Variant, record: dict[str, Any], runtime: str, hint: str | None, threads: int,
               workers: int) -> list[Executor] | str:
    from ..formats import format_of

    path = variant.path
    assert path is not None
    try:
        if hint == "record":
            fmt = format_of(path)
            hint = fmt.recorded_hint(runtime, record) if fmt is not None else None
        return [open_artifact(path, runtime=runtime, threads=threads, precision_hint=hint) for _ in range(workers)]
    except RuntimeUnavailable as exc:
        return f"unavailable: {exc.message}"
    except Exception as exc:  # noqa: BLE001 - one artifact that will not load must not stop the others
        return f"failed to load: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _label(executor: Executor) -> str:
    used = str(executor.info.get("inference_precision") or "")
    if not runtime_named(executor.runtime).takes_precision_hint:
        return f"{executor.runtime}/{executor.device}"
    return f"{executor.runtime}/{executor.device} " + (executor.info.get("precision_hint") or f"default={used}")


def _capacity(lane: LoadLane, pool: list[Any]) -> float | None:
    """Requests per second one full batch's median time predicts for this lane (all its workers busy)."""
    rows = lane.policy.max_batch
    stacked = _stack([pool[i % len(pool)] for i in range(rows)])
    executor = lane.executors[0]
    try:
        executor.run_outputs(stacked)  # warm up
        times = []
        for _ in range(5):
            start = time.perf_counter()
            executor.run_outputs(stacked)
            times.append(time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - a lane that cannot run a batch is reported on its row
        lane.error = f"failed to run: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        return None
    return rows * lane.workers / float(np.median(times))


def _stack(samples: list[Any]) -> Any:
    """Single requests as one batch (token rows padded with 0 to the longest), for warm-up and the capacity probe."""
    if not isinstance(samples[0], dict):
        return np.ascontiguousarray(np.stack(samples))
    out = {}
    for key in samples[0]:
        parts = [np.asarray(s[key]) for s in samples]
        longest = max(p.shape[0] for p in parts) if parts[0].ndim else 0
        if parts[0].ndim and any(p.shape != parts[0].shape for p in parts):
            parts = [np.pad(p, [(0, longest - p.shape[0])] + [(0, 0)] * (p.ndim - 1)) for p in parts]
        out[key] = np.ascontiguousarray(np.stack(parts))
    return out


def _sweep(lanes: list[LoadLane], settings: LoadSettings, pools: dict[str, list[Any]], reporter: Reporter,
           metrics: "_Live | None") -> None:
    live = [lane for lane in lanes if lane.error is None]
    rates = sorted(settings.rates or [])
    with reporter.progress(f"load: {len(live)} lanes x {len(rates)} rates, lanes in turn at each rate",
                           total=len(live) * len(rates)) as advance:
        for rate in rates:
            for lane in live:
                lane.points.append(_point(lane, rate, settings, pools[lane.variant.name], metrics))
                advance()


def _search(lanes: list[LoadLane], settings: LoadSettings, pools: dict[str, list[Any]], reporter: Reporter,
            metrics: "_Live | None") -> None:
    """Per lane: half the predicted capacity, then x1.5 while it holds, then bisect between the last rate that held and
    the first that did not; one point of every lane per round."""
    budget = settings.p99_budget_ms
    state = {id(lane): _Search(max(1.0, 0.5 * (lane.capacity or 10.0))) for lane in lanes if lane.error is None}
    most = 8 + settings.search_steps
    with reporter.progress(f"load: searching the highest rate within p99 {budget:g} ms on {len(state)} lanes, in turn",
                           total=len(state) * most) as advance:
        for _ in range(most):
            active = [lane for lane in lanes if id(lane) in state and state[id(lane)].rate is not None]
            if not active:
                break
            for lane in active:
                s = state[id(lane)]
                assert s.rate is not None
                point = _point(lane, s.rate, settings, pools[lane.variant.name], metrics)
                lane.points.append(point)
                advance()
                s.step(point.holds(budget), lane.capacity, settings.search_steps)
    for lane in lanes:
        lane.points.sort(key=lambda p: p.offered_qps)


@dataclass
class _Search:
    """One lane's search: the rate to try next (None: done), the highest that held and the lowest that failed."""

    rate: float | None
    lo: float = 0.0
    hi: float | None = None
    steps: int = 0

    def step(self, held: bool, capacity: float | None, most: int) -> None:
        """Up by half while every rate holds (to four times the predicted capacity), then bisect ``most`` times."""
        assert self.rate is not None
        if held:
            self.lo = self.rate
        else:
            self.hi = self.rate
        if self.hi is None:
            up = self.rate * 1.5
            self.rate = up if up <= 4 * (capacity or self.rate) else None
            return
        self.steps += 1
        nxt = (self.lo + self.hi) / 2 if self.lo else self.hi / 2
        done = self.steps > most or (self.lo > 0 and self.hi / self.lo < 1.05) or nxt < 1
        self.rate = None if done else float(round(nxt, 1))


def _point(lane: LoadLane, rate: float, settings: LoadSettings, pool: list[Any], metrics: "_Live | None") -> LoadPoint:
    """Offer ``rate`` requests/s to a fresh server on the lane's executors; measure every request."""
    rng = np.random.default_rng([settings.seed, int(round(rate * 1000))])
    count = int(min(settings.max_requests, max(20, math.ceil(rate * settings.duration))))
    arrivals = np.cumsum(rng.exponential(1.0 / rate, size=count))
    live = metrics.for_lane(lane) if metrics is not None else None
    server = Server(lane.executors, lane.record, lane.policy, live)
    # warm the lane's executors at its batch size: the first calls of a session allocate
    for ex in lane.executors:
        ex.run_outputs(_stack([pool[i % len(pool)] for i in range(lane.policy.max_batch)]))
    done = np.full(count, np.nan)
    futures: list[Future] = []
    before = metrics.scrape(lane) if metrics is not None else None
    start = time.perf_counter()
    for i, at in enumerate(arrivals):
        wait = start + at - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        future = server.submit(pool[i % len(pool)], arrived=start + at)
        future.add_done_callback(_on_done(done, i))
        futures.append(future)
    deadline = time.perf_counter() + max(5.0, 2 * settings.duration)
    for future in futures:
        try:
            future.result(timeout=max(0.0, deadline - time.perf_counter()))
        except Exception:  # noqa: BLE001 - unanswered (timeout, refused or failed): counted below
            break
    after = metrics.scrape(lane) if metrics is not None else None  # before close(): refusals are not answers
    server.close(drain=False)
    end = time.perf_counter()
    latency_ms = (done - (start + arrivals)) * 1000
    answered = int(np.isfinite(latency_ms).sum())
    full = np.where(np.isfinite(latency_ms), latency_ms, np.inf)
    p50, p95, p99 = (float(np.percentile(full, q, method="inverted_cdf")) for q in (50, 95, 99))
    finished = np.nanmax(done) if answered else end
    achieved = answered / max(1e-9, finished - start)
    budget = settings.p99_budget_ms
    histogram = server.stats.batch_histogram()
    point = LoadPoint(
        offered_qps=float(rate), requests=count, answered=answered, achieved_qps=float(achieved), p50_ms=p50, p95_ms=p95,
        p99_ms=p99, mean_batch=float(np.mean(server.stats.batch_rows)) if server.stats.batch_rows else 0.0,
        batch_sizes=histogram, missed=int((full > budget).sum()) if budget is not None else count - answered,
        unanswered=count - answered, keeps_up=answered == count and _steady(latency_ms, lane.policy),
        seconds=end - start)
    if before is not None and after is not None:
        point.scraped = _window(before, after)
    return point


def _steady(latency_ms: np.ndarray, policy: BatchPolicy) -> bool:
    """No growing queue: the last tenth of requests waited at most ``GROWTH`` times as long as the first half."""
    head = float(np.median(latency_ms[: max(1, len(latency_ms) // 2)]))
    tail = float(np.median(latency_ms[-max(3, len(latency_ms) // 10):]))
    return bool(tail <= GROWTH * head + policy.max_delay_ms + 1.0)


def _on_done(done: np.ndarray, i: int) -> Callable[[Future], None]:
    """Stamp request ``i``'s answer time: when its batch finished, as the server (and so /metrics) counts it."""
    def record(future: Future) -> None:
        if future.exception() is None:
            done[i] = getattr(future, "answered_at", None) or time.perf_counter()
    return record


class _Live:
    """``--metrics-port``: one Prometheus registry served on loopback, a labelled series set per lane; each point
    scrapes it before and after, over HTTP as Prometheus would, to check the live figures against bench's own."""

    def __init__(self, port: int):
        from ..deps import require
        from ..runtime.metrics import serve_metrics

        prom = require("prometheus_client", "pip install prometheus-client", "bench --load --metrics-port")
        self.registry = prom.CollectorRegistry()
        self.endpoint = serve_metrics(self.registry, port)
        self._by_lane: dict[int, Any] = {}

    @property
    def url(self) -> str:
        return self.endpoint.url

    def labels(self, lane: LoadLane) -> dict[str, str]:
        return {"model": lane.variant.model, "version": lane.variant.name, "precision": str(lane.variant.precision),
                "runtime": lane.label, "device": lane.executors[0].device.lower() if lane.executors else "",
                "policy": lane.policy.label, "threads": str(lane.threads)}

    def for_lane(self, lane: LoadLane) -> Any:
        from ..runtime.metrics import ServingMetrics

        if id(lane) not in self._by_lane:
            self._by_lane[id(lane)] = ServingMetrics(self.labels(lane), self.registry)
        return self._by_lane[id(lane)]

    def scrape(self, lane: LoadLane) -> dict[str, Any]:
        """The endpoint's text as Prometheus would fetch it, stamped (parsed later: parsing is not the load's time)."""
        import urllib.request

        sent = time.perf_counter()
        text = urllib.request.urlopen(self.url, timeout=5).read().decode()
        # the figures are at least as fresh as the request and at most as fresh as the answer
        return {"sent": sent, "received": time.perf_counter(), "text": text, "labels": self.labels(lane)}

    def close(self) -> None:
        self.endpoint.close()


def _window(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """QPS and p99 over the point from two scrapes, as ``rate()`` and ``histogram_quantile()`` would give them: the
    answered count's increase over the time the histogram saw requests (first arrival to last answer)."""
    from ..runtime.metrics import histogram_quantile, scrape

    def read(at: dict[str, Any]) -> tuple[float, dict[float, float]]:
        want = at["labels"]
        answered = scrape(at["text"], "pruneflow_requests", want | {"outcome": "answered"})["value"]
        return answered, dict(scrape(at["text"], "pruneflow_request_latency_seconds", want)["buckets"])

    (first, b), (last, a) = read(before), read(after)
    buckets = [(le, count - b.get(le, 0.0)) for le, count in sorted(a.items())]
    answered = last - first
    return {"answered": answered, "qps": answered / max(1e-9, after["sent"] - before["received"]),
            "p99_ms": histogram_quantile(0.99, buckets) * 1000}


def write_load_outputs(result: LoadResult, *, json_file: Path | None = None, html: Path | None = None,
                       prometheus: Path | None = None) -> list[Path]:
    """Write the files asked for, each atomically; returns them in that order."""
    from .exposition import write_files
    from .load_report import load_html, load_prometheus

    doc = result.as_json()
    return write_files((json_file, html, prometheus), (lambda: json.dumps(doc, indent=2, allow_nan=False) + "\n",
                                                       lambda: load_html(doc), lambda: load_prometheus(doc)))
