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
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .result import FORMAT, best_under_budget, host_name

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


def load_bench_json(path: Path) -> dict[str, Any]:
    """One `bench --json` file, checked to be one (exit 2 naming the file otherwise)."""
    hint = "merge the files `pruneflow bench ... --json FILE` wrote, one per host"
    if not path.is_file():
        raise UsageError(f"--merge {path}: no such file", hint=hint)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"--merge {path}: not JSON ({exc})", hint=hint) from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise UsageError(f"--merge {path}: not a bench result (format {found!r}, expected {FORMAT!r})", hint=hint)
    return data


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

    def as_json(self) -> dict[str, Any]:
        from .exposition import strict

        return strict({"format": MERGE_FORMAT, "exit_code": 0, "p99_budget_ms": self.p99_budget_ms,
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
        settings = doc.get("settings") or {}
        price, source = prices.for_host(doc["host"]) if prices else (settings.get("price_per_hour"), "as benched")
        cores = int(settings.get("threads") or doc["host"]["cpu"].get("usable_cpus") or 1)
        hosts.append({"name": name, "file": str(path), "host": doc["host"], "settings": settings, "cores": cores,
                      "price_per_hour": price, "price_source": source if price or prices else None,
                      "baseline": doc.get("baseline")})
        for r in doc.get("results", []):
            throughput = r.get("throughput")
            rows.append({**r, "host": name, "throughput_per_core": throughput / cores if throughput else None,
                         "cost_per_million": price / (throughput * 3600) * 1e6 if price and throughput else None})
    if p99_budget_ms is None:
        recorded = {h["settings"]["p99_budget_ms"] for h in hosts if h["settings"].get("p99_budget_ms")}
        p99_budget_ms = recorded.pop() if len(recorded) == 1 else None
    return MergedBench(hosts, rows, p99_budget_ms)
