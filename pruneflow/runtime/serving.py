"""The executor a service embeds: one artifact on one device, single requests served through a dynamic batcher.

    from pruneflow.runtime import BatchPolicy, Server

    with Server.open("runs/resnet56/export/openvino/model.int8.xml", device="cpu",
                     policy=BatchPolicy(max_batch=32, max_delay_ms=2), threads=1) as server:
        logits = server(image)                       # one sample (no batch axis) in, its row out
        future = server.submit(image)                # or asynchronously: a concurrent.futures.Future
        rows = server.submit_rows(images).result()   # a caller's several rows (candidates of one user), its rows back

A batch forms when ``max_batch`` rows wait or the oldest has waited ``max_delay_ms``, whichever comes first, and
runs on one of ``workers`` executors (each its own session or infer request with ``threads`` runtime threads: the
executor's "streams"). Text is bucketed by length (``BatchPolicy.length_buckets``): a batch holds requests of one
bucket only, padded to the bucket's length with the mask zero, so a short sentence never pays for a long one's
padding beyond its bucket. Each caller gets its own rows back, as arrays for a one-output artifact or a dict of
head name → array for a multi-head one. ``close()`` stops taking requests and either answers every queued one
(``drain=True``, the default) or refuses it with :class:`ServerClosed`; no request is lost or answered twice.

The artifact is opened by its deployment record (``pruneflow.deployment``): its input names, dtypes and dynamic
axes, its output names, and the runtime settings it was measured with (an OpenVINO IR's precision hint). An absent
device or runtime is a :class:`RuntimeUnavailable` naming it, never a silent substitute.

Hand-written: neither onnxruntime nor OpenVINO batches independent requests (OpenVINO's ``AUTO_BATCH`` plugin is
GPU-only and does not bucket text); Triton's dynamic batcher is a server of its own, not a library.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol, Sequence, Union

import numpy as np

from ..errors import PruneflowError, UsageError
from .base import Executor, RuntimeUnavailable

#: One request: a sample without batch axis (one-input model), or input name -> array (token ids: 1-D).
Sample = Union[np.ndarray, Mapping[str, np.ndarray]]
#: What a caller gets back: its row(s) of the only output, or head name -> row(s) for a multi-head artifact.
Answer = Union[np.ndarray, dict[str, np.ndarray]]

def devices_of(runtime: str | None) -> dict[str, str]:
    """The devices a service names (``cpu``, ``cuda``, ``gpu``, ``npu``) and what ``runtime`` calls each (its
    registered kind's ``devices``; {} for none, or a name no runtime is registered under)."""
    from ..errors import UnknownNameError
    from ..formats import runtime_named

    try:
        return dict(runtime_named(runtime).devices) if runtime else {}
    except UnknownNameError:
        return {}


class ServerClosed(PruneflowError):
    """A request the server refused: it was closed (or closing without draining) when the request waited."""

    title = "server closed"


@dataclass(frozen=True)
class BatchPolicy:
    """When a batch forms: at ``max_batch`` rows or when the oldest request has waited ``max_delay_ms``.

    ``max_batch=1`` serves one request at a time (no batching); ``max_delay_ms=0`` runs whatever waits as soon as a
    worker is free (batches then form only under load). ``length_buckets``: the sequence lengths text is padded to
    (None: powers of two from 8 up to the artifact's longest input; ignored for inputs without a sequence axis)."""

    max_batch: int = 8
    max_delay_ms: float = 2.0
    length_buckets: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_batch < 1 or not self.max_delay_ms >= 0 or self.max_delay_ms == float("inf"):
            raise UsageError(f"batch policy max_batch={self.max_batch}, max_delay_ms={self.max_delay_ms}: max_batch must "
                             "be >= 1 and max_delay_ms a finite number >= 0", hint="e.g. BatchPolicy(max_batch=16, max_delay_ms=2)")
        if self.length_buckets is not None and (not self.length_buckets or min(self.length_buckets) < 1):
            raise UsageError(f"length_buckets={self.length_buckets}: bucket lengths must be positive",
                             hint="e.g. length_buckets=(16, 32, 64, 128)")

    @property
    def label(self) -> str:
        """``b32/2ms``: the policy column of tables."""
        return f"b{self.max_batch}/{self.max_delay_ms:g}ms"


@dataclass(frozen=True)
class ServingConfig:
    """How to serve an artifact on this host: runtime, policy, runtime threads and workers, as ``bench --load`` found
    best for it (:meth:`from_bench`), or as you set them."""

    policy: BatchPolicy = BatchPolicy()
    threads: int = 1
    workers: int = 1
    runtime: str | None = None
    #: Where it came from (a bench file and lane), for logs.
    source: str = "given"

    @classmethod
    def from_bench(cls, bench_json: str | Path, artifact: str | Path, host: Mapping[str, Any] | None = None) -> "ServingConfig":
        """The best lane ``bench --load --json`` found for ``artifact`` (matched by path, else by file name). The file
        must have been measured on this host's CPU (model and instruction sets): a configuration tuned on another CPU is
        refused with what differs, since its best batch and threads need not hold here."""
        import json

        from .host import host_info

        path = Path(bench_json)
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"{path}: not a readable bench --load JSON ({exc})",
                             hint="write one with: pruneflow bench ARTIFACT --load --p99-budget-ms MS --json FILE") from None
        if not isinstance(doc, dict) or doc.get("format") != "pruneflow-bench-load/1":
            raise UsageError(f"{path}: not a bench --load result (format {doc.get('format') if isinstance(doc, dict) else '?'})",
                             hint="pass the --json file of `pruneflow bench --load`")
        here = (host or host_info())["cpu"]
        there = (doc.get("host") or {}).get("cpu") or {}
        if (there.get("model"), sorted(there.get("isa") or [])) != (here.get("model"), sorted(here.get("isa") or [])):
            raise UsageError(f"{path} was measured on {there.get('model')} ({' '.join(there.get('isa') or [])}), not on this "
                             f"host's {here.get('model')} ({' '.join(here.get('isa') or [])})",
                             hint="run `pruneflow bench --load` on this host, or set the policy and threads yourself")
        artifact = Path(artifact)
        best = [b for b in doc.get("best") or [] if b.get("qps") is not None]
        match = ([b for b in best if Path(str(b["variant"])).resolve() == artifact.resolve()]
                 or [b for b in best if Path(str(b["variant"])).name == artifact.name])
        if not match:
            raise UsageError(f"{path} holds no best configuration for {artifact.name} "
                             f"(it has: {', '.join(str(b['variant']) for b in best) or 'none within its budget'})",
                             hint="bench this artifact with --load, or pass the artifact the file was measured on")
        b = match[0]
        lane: dict[str, Any] = next((la for la in doc.get("lanes") or [] if la.get("variant") == b["variant"]
                     and la.get("policy") == b["policy"] and la.get("threads") == b["threads"]), {})
        return cls(BatchPolicy(int(b["max_batch"]), float(b["max_delay_ms"])), int(b["threads"]), int(b.get("workers") or 1),
                   lane.get("runtime"), f"{path}: {b['lane']} held {b['qps']:g} requests/s within p99 "
                   f"{b['p99_budget_ms']} ms")


class Metrics(Protocol):
    """What the server reports as it serves (:class:`pruneflow.runtime.metrics.ServingMetrics` is the Prometheus
    one); every method is called from the server's threads and must be thread-safe."""

    def on_queue(self, depth: int) -> None: ...
    def on_batch(self, rows: int, seconds: float) -> None: ...
    def on_answer(self, seconds: float, ok: bool) -> None: ...


@dataclass(eq=False)
class _Request:
    feed: dict[str, np.ndarray]
    rows: int
    single: bool
    bucket: int
    arrived: float
    future: Future = field(default_factory=Future)


@dataclass
class ServerStats:
    """Counts since the server opened: requests answered and refused, batches run, and each batch's rows."""

    answered: int = 0
    refused: int = 0
    failed: int = 0
    batch_rows: list[int] = field(default_factory=list)

    def batch_histogram(self) -> dict[int, int]:
        """Batch size -> how many batches of that size ran."""
        out: dict[int, int] = {}
        for rows in self.batch_rows:
            out[rows] = out.get(rows, 0) + 1
        return dict(sorted(out.items()))


class Server:
    """Serves single requests (or a caller's few rows) of one artifact through a dynamic batcher; thread-safe.

    Build it with :meth:`open` (from a file and its deployment record) or directly from executors you opened
    (``executors``: one per worker; each is called by one worker thread only)."""

    def __init__(self, executors: Sequence[Executor], record: Mapping[str, Any] | None = None,
                 policy: BatchPolicy | None = None, metrics: Metrics | None = None):
        if not executors:
            raise UsageError("a server needs at least one executor", hint="Server.open(path, workers=1)")
        self.policy = policy or BatchPolicy()
        self.record = dict(record or {})
        self.executors = list(executors)
        self.metrics = metrics
        self.stats = ServerStats()
        self.config: ServingConfig | None = None
        spec = self.record.get("input") or {}
        self._inputs = _input_specs(spec)
        self._sequence = {name for name, s in self._inputs.items() if "sequence" in map(str, s["shape"][1:])}
        self._buckets = self._bucket_lengths()
        out = self.record.get("output") or {}
        self._output_names: list[str] = list(out.get("names") or [out.get("name") or "output"])
        self._pending: deque[_Request] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._drain = True
        self._workers = [threading.Thread(target=self._work, args=(ex,), name=f"pruneflow-serve-{i}", daemon=True)
                         for i, ex in enumerate(self.executors)]
        for worker in self._workers:
            worker.start()

    # -- opening ------------------------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | Path, *, device: str = "cpu", runtime: str | None = None, policy: BatchPolicy | None = None,
             threads: int | None = 1, workers: int = 1, precision_hint: str | None = "record",
             metrics: Metrics | Callable[["Server"], Metrics] | None = None) -> "Server":
        """Open ``path`` (an ONNX file or OpenVINO IR of a pruneflow run) on ``device`` (``cpu``; ``cuda`` with
        onnxruntime's CUDA provider or TensorRT; ``gpu``/``npu`` with OpenVINO) with ``workers`` executors of
        ``threads`` runtime threads each. ``precision_hint="record"`` compiles an IR as its deployment record says
        (the hint it was measured with); None leaves OpenVINO's default; ``"f32"``/``"bf16"`` force one.
        ``metrics``: a :class:`Metrics`, or a callable making one from the server (labels from its record)."""
        from ..formats import read_record, runtime_named
        from .executor import open_artifact, runtimes_for

        path = Path(path)
        if not path.is_file():
            raise RuntimeUnavailable(f"{path}: no such artifact", hint="pass the path of a built ONNX file or IR (.xml)")
        runtime = runtime or (runtimes_for(path) or (None,))[0]
        devices = devices_of(runtime)
        if device.lower() not in devices:
            raise RuntimeUnavailable(f"{path.name}: {runtime or 'no runtime'} has no device {device!r} "
                                     f"(it serves on: {', '.join(devices) or 'nothing here'})",
                                     hint="name one of those devices, or another runtime (runtime='openvino' / 'onnxruntime')")
        if workers < 1 or (threads is not None and threads < 1):
            raise UsageError(f"workers={workers}, threads={threads}: both must be >= 1", hint="e.g. workers=1, threads=1")
        record = read_record(path)
        assert runtime is not None  # (devices_of found it)
        kind = runtime_named(runtime)
        hint = kind.hint_for(record) if precision_hint == "record" else precision_hint
        executors = [open_artifact(path, runtime=runtime, device=devices[device.lower()], threads=threads,
                                   precision_hint=hint if kind.takes_precision_hint else None) for _ in range(workers)]
        server = cls(executors, record, policy, None)
        server.metrics = metrics(server) if callable(metrics) and not hasattr(metrics, "on_batch") else metrics  # type: ignore[assignment]
        return server

    @classmethod
    def tuned(cls, path: str | Path, bench_json: str | Path, *, device: str = "cpu",
              metrics: Metrics | Callable[["Server"], Metrics] | None = None) -> "Server":
        """:meth:`open` with the runtime, policy, threads and workers ``bench --load`` found best for ``path`` on this
        host (:meth:`ServingConfig.from_bench`)."""
        config = ServingConfig.from_bench(bench_json, path)
        server = cls.open(path, device=device, runtime=config.runtime, policy=config.policy, threads=config.threads,
                          workers=config.workers, metrics=metrics)
        server.config = config
        return server

    @property
    def label(self) -> str:
        """``onnxruntime/CPU b32/2ms x1``: runtime, device, policy and workers."""
        return f"{self.executors[0].label} {self.policy.label} x{len(self.executors)}"

    # -- requests -----------------------------------------------------------------------------------------------

    def submit(self, sample: Sample, *, arrived: float | None = None) -> "Future[Answer]":
        """Queue one sample (no batch axis); its answer (the sample's row, without batch axis) comes on the future,
        whose ``answered_at`` is when its batch finished (``time.perf_counter()``, the end of the latency the metrics
        record). ``arrived``: when the request reached the service (``time.perf_counter()``; default now): its latency
        and the batcher's delay count from then. Raises ServerClosed after :meth:`close`."""
        return self._enqueue(sample, single=True, arrived=arrived)

    def submit_rows(self, rows: Sample, *, arrived: float | None = None) -> "Future[Answer]":
        """Queue a caller's rows (batch axis first, e.g. a user's candidate items); they are kept together in one
        batch (a request larger than ``max_batch`` runs as a batch of its own) and come back with the batch axis."""
        return self._enqueue(rows, single=False, arrived=arrived)

    def __call__(self, sample: Sample, timeout: float | None = None) -> Answer:
        """:meth:`submit` and wait for the answer."""
        return self.submit(sample).result(timeout)

    def _enqueue(self, x: Sample, single: bool, arrived: float | None) -> "Future[Answer]":
        feed = self._as_feed(x, single)
        rows = len(next(iter(feed.values())))
        request = _Request(feed, rows, single, self._bucket_of(feed), time.perf_counter() if arrived is None else arrived)
        with self._cond:
            if self._closed:
                raise ServerClosed("the server is closed and takes no more requests",
                                   hint="open a new Server, or submit before close()")
            self._pending.append(request)
            depth = len(self._pending)
            self._cond.notify()
        if self.metrics is not None:
            self.metrics.on_queue(depth)
        return request.future

    def _as_feed(self, x: Sample, single: bool) -> dict[str, np.ndarray]:
        names = list(self._inputs) or ["input"]
        if not isinstance(x, Mapping):
            x = {names[0]: x}
        elif len(names) == 1 and names[0] not in x and len(x) == 1:
            x = {names[0]: next(iter(x.values()))}
        feed: dict[str, np.ndarray] = {}
        for name in names if self._inputs else list(x):
            if name not in x:
                if self._inputs.get(name, {}).get("optional"):
                    continue
                raise UsageError(f"request without input {name!r} (the artifact takes {', '.join(names)})",
                                 hint="pass a dict of every input name to its array")
            given: Any = x[name]
            value = np.asarray(given.detach().cpu().numpy() if hasattr(given, "detach") else given)
            dtype = self._inputs.get(name, {}).get("dtype")
            if dtype is not None and value.dtype != np.dtype(dtype):
                value = value.astype(dtype)
            value = value[None] if single else value
            fixed = list(self._inputs.get(name, {}).get("shape") or [])[1:]
            if fixed and (value.ndim != len(fixed) + 1
                          or any(isinstance(d, int) and d != n for d, n in zip(fixed, value.shape[1:]))):
                raise UsageError(f"input {name!r} of shape {list(value.shape[1:])} does not fit the "
                                 f"artifact's {fixed}" + (" per sample" if single else " after the batch axis"),
                                 hint="submit() takes one sample without its batch axis; submit_rows() takes rows")
            feed[name] = value
        rows = {len(v) for v in feed.values()}
        if len(rows) != 1 or 0 in rows:
            raise UsageError(f"request inputs disagree on rows or are empty ({ {k: v.shape for k, v in feed.items()} })",
                             hint="one sample: arrays without batch axis; submit_rows: the same number of rows in each")
        return _trimmed(feed, self._sequence)

    # -- batching -----------------------------------------------------------------------------------------------

    def _bucket_lengths(self) -> list[int]:
        if not self._sequence:
            return []
        if self.policy.length_buckets is not None:
            return sorted(set(self.policy.length_buckets))
        longest = int((self.record.get("preprocessing") or {}).get("max_length") or 512)
        return sorted({*(2 ** k for k in range(3, 16) if 2 ** k < longest), longest})

    def _bucket_of(self, feed: dict[str, np.ndarray]) -> int:
        if not self._sequence:
            return 0
        length = max(feed[n].shape[1] for n in self._sequence if n in feed)
        i = bisect.bisect_left(self._buckets, length)
        return self._buckets[i] if i < len(self._buckets) else length  # longer than every bucket: its own length

    def _take(self) -> list[_Request] | None:
        """Wait for the next batch (the oldest request's bucket, oldest first, up to max_batch rows); None at shutdown."""
        policy = self.policy
        with self._cond:
            while True:
                if not self._pending:
                    if self._closed:
                        return None
                    self._cond.wait()
                    continue
                oldest = self._pending[0]
                same = [r for r in self._pending if r.bucket == oldest.bucket]
                rows = sum(r.rows for r in same)
                wait = oldest.arrived + policy.max_delay_ms / 1000 - time.perf_counter()
                if rows >= policy.max_batch or wait <= 0 or self._closed:
                    batch: list[_Request] = []
                    total = 0
                    for r in same:
                        if batch and total + r.rows > policy.max_batch:
                            break
                        batch.append(r)
                        total += r.rows
                    taken = {id(r) for r in batch}
                    self._pending = deque(r for r in self._pending if id(r) not in taken)
                    if self._pending:
                        self._cond.notify()  # another worker may start the next batch
                    if self.metrics is not None:
                        self.metrics.on_queue(len(self._pending))
                    return batch
                self._cond.wait(wait)

    def _work(self, executor: Executor) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            if self._closed and not self._drain:
                self._refuse(batch)
                continue
            try:
                self._run(executor, batch)
            except Exception as exc:  # noqa: BLE001 - a bug here must fail its callers, never strand them
                for r in batch:
                    if not r.future.done() and r.future.set_running_or_notify_cancel():
                        r.future.set_exception(exc)

    def _run(self, executor: Executor, batch: list[_Request]) -> None:
        feed = _stacked([r.feed for r in batch], self._sequence, batch[0].bucket)
        start = time.perf_counter()
        try:
            outputs = executor.run_outputs(feed)
        except Exception as exc:  # noqa: BLE001 - every caller of the batch gets the runtime's error
            for r in batch:
                if r.future.set_running_or_notify_cancel():
                    r.future.set_exception(exc)
            with self._cond:
                self.stats.failed += len(batch)
            return
        done = time.perf_counter()
        rows = sum(r.rows for r in batch)
        if self.metrics is not None:
            self.metrics.on_batch(rows, done - start)
        at = 0
        for r in batch:
            parts = [np.asarray(o)[at:at + r.rows] for o in outputs]
            at += r.rows
            if r.single:
                parts = [p[0] for p in parts]
            answer: Answer = parts[0] if len(parts) == 1 else dict(zip(self._output_names, parts))
            r.future.answered_at = done  # type: ignore[attr-defined]  # when its batch finished (perf_counter)
            if r.future.set_running_or_notify_cancel():
                r.future.set_result(answer)
            if self.metrics is not None:
                self.metrics.on_answer(done - r.arrived, True)
        with self._cond:
            self.stats.answered += len(batch)
            self.stats.batch_rows.append(rows)

    def _refuse(self, batch: list[_Request]) -> None:
        for r in batch:
            if r.future.set_running_or_notify_cancel():
                r.future.set_exception(ServerClosed("refused: the server was closed before this request ran",
                                                    hint="send it again to a running server"))
            if self.metrics is not None:
                self.metrics.on_answer(time.perf_counter() - r.arrived, False)
        with self._cond:
            self.stats.refused += len(batch)

    # -- shutdown -----------------------------------------------------------------------------------------------

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Take no more requests; answer every queued one (``drain``) or refuse each with ServerClosed; wait for
        the workers (at most ``timeout`` seconds each). Calling it again does nothing."""
        with self._cond:
            if self._closed and not any(w.is_alive() for w in self._workers):
                return
            self._closed = True
            self._drain = drain
            if not drain:
                refused, self._pending = list(self._pending), deque()
            else:
                refused = []
            self._cond.notify_all()
        if refused:
            self._refuse(refused)
        for worker in self._workers:
            worker.join(timeout)

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._pending)


def _input_specs(spec: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Input name -> {"shape", "dtype"} from a deployment record's ``input`` (one input or several by name)."""
    if "inputs" in spec:
        return {str(k): dict(v) | {"optional": k == "token_type_ids"} for k, v in spec["inputs"].items()}
    if "name" in spec:
        return {str(spec["name"]): {"shape": list(spec.get("shape") or []), "dtype": spec.get("dtype")}}
    return {}


def _trimmed(feed: dict[str, np.ndarray], sequence: set[str]) -> dict[str, np.ndarray]:
    """Token rows cut after the last position any row's attention mask keeps (a caller's padding is not ours)."""
    mask = feed.get("attention_mask")
    if mask is None or not sequence or mask.ndim != 2:
        return feed
    kept = np.flatnonzero(mask.any(axis=0))
    length = int(kept[-1]) + 1 if len(kept) else 1
    return {k: (v[:, :length] if k in sequence else v) for k, v in feed.items()}


def _stacked(feeds: list[dict[str, np.ndarray]], sequence: set[str], bucket: int) -> dict[str, np.ndarray]:
    """One batch from the requests' feeds, token inputs padded with 0 (mask 0) to the bucket's length."""
    out = {}
    for name in feeds[0]:
        parts = [f[name] for f in feeds]
        if name in sequence:
            length = max(bucket, *(p.shape[1] for p in parts))
            parts = [np.pad(p, [(0, 0), (0, length - p.shape[1])] + [(0, 0)] * (p.ndim - 2)) for p in parts]
        out[name] = np.ascontiguousarray(np.concatenate(parts, axis=0))
    return out

