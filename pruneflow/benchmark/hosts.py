"""Machines compared: a price per host, and several hosts' `bench --json` files merged into one comparison.

A bench JSON records its host (CPU model, ISA flags, usable CPUs, runtime versions and the ``--host-label`` it was
given). ``bench --merge a.json b.json`` lines each artifact x runtime up across the hosts and gives, per host, its
latency and throughput at every batch size, the best batch under the p99 budget, its throughput per core and its cost
per million inferences at that host's price::

    pruneflow bench runs/ptq --batch 1,8,32 --host-label c7i.large --json c7i.json      # on each machine
    pruneflow bench --merge c7i.json m7a.json --price-per-hour prices.yaml --p99-budget-ms 20 --html hosts.html

``--price-per-hour`` is one number for every host, or a YAML file of prices per hour (``prices.yaml``)::

    c7i.large: 0.0893        # a --host-label, matched whole (case ignored)
    AMD EPYC: 0.10           # else a piece of the CPU model name (the longest that matches)
    default: 0.12            # else this

A file from another host is data, not trusted: each is read as strict JSON (no NaN or Infinity, bounded in size and
nesting) and checked against ``BenchFile`` (numbers are numbers, finite and in range; latencies ordered), and a file
that is not is a usage error naming it and the key (exit 2). Older bench files (without the keys added since:
``spread``, ``noisy``, ``p99_low_confidence``, ``cores``) are read as they are.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from ..errors import UsageError
from ..headline import NOISY_SPREAD
from .measure import MIN_P99_RUNS
from .result import FORMAT, best_under_budget, budget_met, cost_per_million, host_name, lane_cores

MERGE_FORMAT = "pruneflow-bench-merge/1"
PRICE_HINT = "give a price per hour (e.g. --price-per-hour 0.36) or a YAML file of 'host label or CPU model: price' lines"


@dataclass
class Prices:
    """``--price-per-hour``: one price for all hosts (``flat``) or a table read from ``file``."""

    flat: float | None = None
    table: dict[str, float] = field(default_factory=dict)
    file: str | None = None

    @classmethod
    def parse(cls, text: str | None) -> "Prices | None":
        if text is None:
            return None
        try:
            value = float(text)
        except ValueError:
            return cls._read(Path(text))
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"--price-per-hour {text}: a price must be a positive number", hint=PRICE_HINT)
        return cls(flat=value)

    @classmethod
    def _read(cls, path: Path) -> "Prices":
        import yaml

        if not path.is_file():
            raise UsageError(f"--price-per-hour {path}: neither a number nor a file", hint=PRICE_HINT)
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as exc:
            raise UsageError(f"{path}: the price table is not YAML ({exc})", hint=PRICE_HINT) from None
        if not isinstance(data, dict) or not data:
            raise UsageError(f"{path}: the price table must map host labels or CPU models to prices per hour",
                             hint="e.g. 'c7i.large: 0.0893' or 'AMD EPYC: 0.10', one a line")
        table = {}
        for key, value in data.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise UsageError(f"{path}: the price of {key!r} is {value!r}, not a positive number", hint=PRICE_HINT)
            table[str(key)] = float(value)
        return cls(table=table, file=str(path))

    def for_host(self, host: dict[str, Any]) -> tuple[float | None, str]:
        """``(price, where it came from)``; ``(None, why)`` when the table has none for this host."""
        if self.flat is not None:
            return self.flat, "--price-per-hour"
        keys = {k.casefold(): k for k in self.table}
        label = str(host.get("label") or "").casefold()
        if label in keys:
            return self.table[keys[label]], f"{self.file}: {keys[label]!r}"
        model = str((host.get("cpu") or {}).get("model") or "").casefold()
        parts = sorted((k for k in keys if k and k in model), key=len, reverse=True)
        if parts:
            return self.table[keys[parts[0]]], f"{self.file}: {keys[parts[0]]!r}"
        if "default" in keys:
            return self.table[keys["default"]], f"{self.file}: 'default'"
        return None, f"{self.file} has no price for {host_name(host)!r} (nor a 'default')"


#: A bench JSON file is a few hundred kB at most; a larger one is not one (and is not read whole into memory).
MAX_FILE_BYTES = 64 * 2**20

Text = Annotated[StrictStr, Field(max_length=1000)]
Count = Annotated[StrictInt, Field(ge=1)]
NonNegative = Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]
Positive = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
Finite = Annotated[float, Field(strict=True, allow_inf_nan=False)]


class _Data(BaseModel):
    """Only the keys bench writes are read (others are dropped), each of its type: no string for a number."""

    model_config = ConfigDict(extra="ignore", strict=True)


class CpuRecord(_Data):
    model: Text | None = None
    arch: Text | None = None
    isa: list[Text] = Field(default_factory=list, max_length=200)
    logical_cpus: Count | None = None
    usable_cpus: Count


class HostRecord(_Data):
    cpu: CpuRecord
    label: Text | None = None
    os: Text | None = None
    python: Text | None = None
    gpus: list[Text] = Field(default_factory=list, max_length=64)
    versions: dict[Text, Text | None] = Field(default_factory=dict, max_length=64)


class SettingsRecord(_Data):
    runtimes: list[Text] | None = None
    batches: list[Count] = Field(default_factory=list, max_length=1000)
    warmup: Annotated[StrictInt, Field(ge=0)] | None = None
    runs: Count | None = None
    duration: Positive | None = None
    threads: Annotated[StrictInt, Field(ge=0)] | None = None
    baseline: Text | None = None
    openvino_precisions: list[Text] = Field(default_factory=list, max_length=16)
    benchmark_app: StrictBool = False
    seed: StrictInt = 0
    p99_budget_ms: Positive | None = None
    price_per_hour: Positive | None = None
    price_source: Text | None = None
    host_label: Text | None = None


class AppRecord(_Data):
    command: Text | None = None
    throughput: NonNegative | None = None
    median_ms: NonNegative | None = None
    iterations: NonNegative | None = None
    error: Text | None = None


class RowRecord(_Data):
    variant: Text
    model: Text
    label: Text
    precision: Text | None = None
    runtime: Text
    device: Text | None = None
    runtime_label: Text | None = None
    precision_hint: Text | None = None
    inference_precision: Text | None = None
    batch: Count
    shape: list[Annotated[StrictInt, Field(ge=0)]] | None = Field(None, max_length=16)
    runs: Count | None = None
    p50_ms: NonNegative | None = None
    p90_ms: NonNegative | None = None
    p99_ms: NonNegative | None = None
    mean_ms: NonNegative | None = None
    throughput: NonNegative | None = None
    size_bytes: Annotated[StrictInt, Field(ge=0)] | None = None
    metric: Text | None = None
    metric_value: Finite | None = None
    metric_direction: Literal["higher", "lower"] | None = None
    variant_metric_value: Finite | None = None
    speedup: Positive | None = None
    baseline_runtime: Text | None = None
    size_reduction: Positive | None = None
    metric_delta: Finite | None = None
    benchmark_app: AppRecord | None = None
    error: Text | None = None
    spread: NonNegative | None = None
    noisy: StrictBool | None = None
    p99_low_confidence: StrictBool | None = None
    cores: Count | None = None
    throughput_per_core: NonNegative | None = None
    cost_per_million: NonNegative | None = None

    @model_validator(mode="after")
    def _timed_whole(self) -> "RowRecord":
        figures = (self.p50_ms, self.p90_ms, self.p99_ms, self.throughput)
        if any(v is not None for v in figures) and any(v is None for v in figures):
            raise ValueError("a timed row has p50_ms, p90_ms, p99_ms and throughput, all of them")
        if self.p50_ms is not None and not self.p50_ms <= self.p90_ms <= self.p99_ms:  # type: ignore[operator]
            raise ValueError(f"latencies out of order: p50 {self.p50_ms} ms, p90 {self.p90_ms} ms, p99 {self.p99_ms} ms")
        return self


class BenchFile(_Data):
    """What ``bench --merge`` reads of a ``bench --json`` file."""

    format: Literal["pruneflow-bench/1"]
    exit_code: StrictInt | None = None
    host: HostRecord
    settings: SettingsRecord = Field(default_factory=SettingsRecord)
    baseline: Text | None = None
    results: list[RowRecord] = Field(max_length=100_000)


def load_bench_json(path: Path) -> dict[str, Any]:
    """One `bench --json` file, checked to be one against ``BenchFile`` (exit 2 naming the file and key otherwise);
    returns its checked data (keys bench does not write are dropped)."""
    hint = "merge the files `pruneflow bench ... --json FILE` wrote, one per host"
    if not path.is_file():
        raise UsageError(f"--merge {path}: no such file", hint=hint)
    if path.stat().st_size > MAX_FILE_BYTES:
        raise UsageError(f"--merge {path}: {path.stat().st_size:,} bytes, larger than any bench result "
                         f"({MAX_FILE_BYTES // 2**20} MiB at most)", hint=hint)
    try:
        data = json.loads(path.read_text(encoding="utf-8"), parse_constant=_no_constant)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"--merge {path}: not strict JSON ({exc})", hint=hint) from None
    except RecursionError:
        raise UsageError(f"--merge {path}: nested too deeply to be a bench result", hint=hint) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise UsageError(f"--merge {path}: not a bench result (format {str(found)[:80]!r}, expected {FORMAT!r})", hint=hint)
    try:
        checked = BenchFile.model_validate(data)
    except ValidationError as exc:
        raise UsageError(f"--merge {path}: not a valid bench result: " + _problems(exc),
                         hint="a file from another host is checked before it is merged: bench that host again, "
                              "or leave the file out") from None
    return checked.model_dump()


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number JSON allows")


def _problems(exc: ValidationError, shown: int = 5) -> str:
    """One ``key.path  value  what is wrong`` per problem (the first few)."""
    lines = []
    for error in exc.errors()[:shown]:
        where = ".".join(str(p) for p in error["loc"]) or "(top)"
        value = error.get("input")
        shown_value = repr(value)[:60] if not isinstance(value, (dict, list)) else type(value).__name__
        lines.append(f"{where}  {shown_value}  {error['msg']}")
    more = len(exc.errors()) - shown
    return "; ".join(lines) + (f"; and {more} more" if more > 0 else "")


@dataclass
class MergedBench:
    """Several hosts' bench results: ``hosts`` (name, file, host record, settings, price) and every result row with
    its ``host`` name, throughput per core and cost per million at that host's price."""

    hosts: list[dict[str, Any]]
    rows: list[dict[str, Any]]
    p99_budget_ms: float | None

    def lanes(self) -> list[tuple[str, str]]:
        """``(variant, runtime lane)`` in first-seen order: the rows of the comparison."""
        return list(dict.fromkeys((r["variant"], lane_name(r)) for r in self.rows))

    def batches(self) -> list[int]:
        return sorted({int(r["batch"]) for r in self.rows})

    def row(self, host: str, variant: str, lane: str, batch: int) -> dict[str, Any] | None:
        return next((r for r in self.rows if r["host"] == host and r["variant"] == variant and lane_name(r) == lane
                     and r["batch"] == batch), None)

    def under_budget(self) -> list[dict[str, Any]]:
        if self.p99_budget_ms is None:
            return []
        chosen = []
        for h in self.hosts:
            rows = [{**r, "runtime_label": lane_name(r)} for r in self.rows if r["host"] == h["name"]]
            chosen += [{"host": h["name"], **e} for e in best_under_budget(rows, self.p99_budget_ms)]
        return chosen

    def meets_budget(self) -> bool | None:
        """Whether some host has an artifact x runtime with a batch within the budget (None: no budget); False is
        exit 1, as for one bench."""
        return budget_met(self.under_budget()) if self.p99_budget_ms is not None else None

    def exit_code(self) -> int:
        return 1 if self.meets_budget() is False else 0

    def as_json(self) -> dict[str, Any]:
        from .exposition import strict

        return strict({"format": MERGE_FORMAT, "exit_code": self.exit_code(), "p99_budget_ms": self.p99_budget_ms,
                       "hosts": self.hosts, "results": self.rows, "under_budget": self.under_budget()})


def lane_name(row: dict[str, Any]) -> str:
    """A runtime lane named alike on every host: ``openvino/CPU default`` (what the default computes in differs by host,
    and is kept in the row's ``inference_precision``)."""
    hint = row.get("precision_hint")
    return f"{row['runtime']}/{row.get('device') or '?'}" + (f" {hint}" if hint else "")


def merge(paths: list[Path], prices: Prices | None = None, p99_budget_ms: float | None = None) -> MergedBench:
    """Read each file, name its host (a repeated name gets its file's stem), price it and recompute per-core and cost
    figures; the budget is ``p99_budget_ms``, else the one the files were benched with (when those that had one agree)."""
    if len(paths) < 2:
        raise UsageError("--merge needs two or more bench JSON files", hint="e.g. bench --merge c7i.json m7a.json")
    docs = [(path, load_bench_json(path)) for path in paths]
    names = [host_name(d["host"]) for _, d in docs]
    hosts, rows = [], []
    for (path, doc), name in zip(docs, names):
        if names.count(name) > 1:
            name = f"{name} ({path.stem})"
        settings = doc["settings"]
        price, source = prices.for_host(doc["host"]) if prices else (settings.get("price_per_hour"), "as benched")
        cores = lane_cores(settings.get("threads"), doc["host"])
        hosts.append({"name": name, "file": str(path), "host": doc["host"], "settings": settings, "cores": cores,
                      "price_per_hour": price, "price_source": source if price or prices else None,
                      "baseline": doc.get("baseline")})
        for r in doc["results"]:
            rows.append({**r, **_marks(r), "host": name, "cores": cores if r["throughput"] is not None else None,
                         "throughput_per_core": r["throughput"] / cores if r["throughput"] else None,
                         "cost_per_million": cost_per_million(price, r["throughput"], cores, doc["host"])})
    if p99_budget_ms is None:
        recorded = {h["settings"]["p99_budget_ms"] for h in hosts if h["settings"].get("p99_budget_ms")}
        p99_budget_ms = recorded.pop() if len(recorded) == 1 else None
    return MergedBench(hosts, rows, p99_budget_ms)


def _marks(row: dict[str, Any]) -> dict[str, Any]:
    """``spread``, ``noisy`` and ``p99_low_confidence`` of a row, as bench marks them; an older file's rows, which
    carry none, get them from their own figures (the spread of the row alone: its ratio's baseline is not at hand)."""
    if row["p50_ms"] is None:
        return {"spread": None, "noisy": None, "p99_low_confidence": None}
    spread = row["spread"] if row["spread"] is not None else (row["p90_ms"] / row["p50_ms"] if row["p50_ms"] else None)
    noisy = row["noisy"] if row["noisy"] is not None else spread is not None and spread > NOISY_SPREAD
    low = row["p99_low_confidence"] if row["p99_low_confidence"] is not None else (
        row["runs"] is not None and row["runs"] < MIN_P99_RUNS)
    return {"spread": spread, "noisy": noisy, "p99_low_confidence": low}
