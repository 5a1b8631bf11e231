"""`bench --merge` of `bench --load --json` files from several hosts: per artifact and host, the best configuration
(recomputed from each file's points under one budget), its cost at that host's price, and the best artifact per host.

Each file is checked before it is read (format, types, finite non-negative figures): a file that says otherwise is a
usage error naming the file and the field, never a traceback or a silently merged negative latency.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..errors import UsageError
from .hosts import Prices
from .load import FORMAT
from .result import cost_per_million, lane_cores

MERGED_FORMAT = "pruneflow-bench-load-merged/1"
HINT = "merge the files `pruneflow bench ... --load --json FILE` wrote, one per host"


def is_load_file(path: Path) -> bool:
    """Whether ``path`` is a `bench --load` JSON (peeked at cheaply; anything unreadable is not)."""
    try:
        with open(path, encoding="utf-8") as fh:
            head = fh.read(4096)
    except (OSError, UnicodeDecodeError):
        return False
    return f'"format": "{FORMAT}"' in head


def merge_load(paths: list[Path], prices: Prices | None = None, p99_budget_ms: float | None = None) -> dict[str, Any]:
    docs = [(p, _read(p)) for p in paths]
    budgets = {d["settings"].get("p99_budget_ms") for _, d in docs}
    budget = p99_budget_ms if p99_budget_ms is not None else (budgets.pop() if len(budgets) == 1 else None)
    if p99_budget_ms is None and len({d["settings"].get("p99_budget_ms") for _, d in docs}) > 1:
        raise UsageError("the files were measured under different p99 budgets: "
                         + ", ".join(f"{p.name}: {d['settings'].get('p99_budget_ms')}" for p, d in docs),
                         hint="give --p99-budget-ms to judge every file's points under one budget")
    hosts, rows = [], []
    for path, doc in docs:
        host = doc["host"]
        name = str(host.get("label") or host["cpu"]["model"])
        price, source = prices.for_host(host) if prices is not None else (doc["settings"].get("price_per_hour"),
                                                                        doc["settings"].get("price_source"))
        hosts.append({"name": name, "file": str(path), "cpu": host["cpu"], "price_per_hour": price, "price_source": source})
        for lane in doc["lanes"]:
            held = [p for p in lane["points"] if _holds(p, budget)]
            if not held:
                continue
            point = max(held, key=lambda p: (p["offered_qps"], -p["p99_ms"]))
            cores = lane_cores(int(lane["threads"]) * int(lane.get("workers") or 1), host)
            rows.append({"host": name, "artifact": _artifact(lane["variant"]), "variant": lane["variant"],
                         "runtime": lane["runtime_label"], "policy": lane["policy"], "threads": lane["threads"],
                         "qps": point["offered_qps"], "p99_ms": point["p99_ms"], "mean_batch": point["mean_batch"],
                         "cost_per_million": cost_per_million(price, point["achieved_qps"], cores, host)})
    best: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["host"], row["artifact"])
        if key not in best or (row["qps"], -row["p99_ms"]) > (best[key]["qps"], -best[key]["p99_ms"]):
            best[key] = row
    per_host = []
    for h in hosts:
        mine = [r for (host, _), r in best.items() if host == h["name"]]
        if mine:
            top = max(mine, key=lambda r: (r["qps"], -r["p99_ms"]))
            per_host.append({"host": h["name"], **{k: top[k] for k in ("artifact", "runtime", "policy", "threads", "qps",
                                                                       "p99_ms", "cost_per_million")}})
        else:
            per_host.append({"host": h["name"], "artifact": None, "why": "no lane held any rate"
                             + (f" within p99 {budget:g} ms" if budget else "")})
    return {"format": MERGED_FORMAT, "p99_budget_ms": budget, "hosts": hosts, "best": list(best.values()),
            "best_per_host": per_host}


def _artifact(variant: str) -> str:
    """What names an artifact across hosts: a bare file's name (its folder differs per host), or ``run/label``."""
    from ..formats import format_of

    return Path(variant).name if format_of(variant) is not None else variant


def _holds(point: dict[str, Any], budget: float | None) -> bool:
    if point["p99_ms"] is None or not point["keeps_up"]:
        return False
    return budget is None or point["p99_ms"] <= budget


def _read(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise UsageError(f"--merge {path}: no such file", hint=HINT)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"), parse_constant=_refuse_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise UsageError(f"--merge {path}: not JSON ({str(exc)[:120]})", hint=HINT) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise UsageError(f"--merge {path}: not a bench --load result", hint=HINT)
    where = f"--merge {path}"
    _need(doc, "host", dict, where)
    cpu = _need(doc["host"], "cpu", dict, f"{where}: host")
    _need(cpu, "model", str, f"{where}: host.cpu")
    if cpu.get("usable_cpus") is not None:
        _number(cpu["usable_cpus"], f"{where}: host.cpu.usable_cpus", positive=True)
    settings = _need(doc, "settings", dict, where)
    if settings.get("p99_budget_ms") is not None:
        _number(settings["p99_budget_ms"], f"{where}: settings.p99_budget_ms", positive=True)
    if settings.get("price_per_hour") is not None:
        _number(settings["price_per_hour"], f"{where}: settings.price_per_hour", positive=True)
    for i, lane in enumerate(_need(doc, "lanes", list, where)):
        at = f"{where}: lanes[{i}]"
        if not isinstance(lane, dict):
            raise UsageError(f"{at} is not an object", hint=HINT)
        for key in ("variant", "runtime_label", "policy"):
            if not isinstance(lane.get(key), str) and not (key == "runtime_label" and lane.get(key) is None):
                raise UsageError(f"{at}.{key} is {lane.get(key)!r}, not text", hint=HINT)
        if lane.get("runtime_label") is None:
            lane["runtime_label"] = str(lane.get("runtime") or "?")
        _number(lane.get("threads"), f"{at}.threads", positive=True)
        for j, p in enumerate(_need(lane, "points", list, at)):
            pat = f"{at}.points[{j}]"
            if not isinstance(p, dict):
                raise UsageError(f"{pat} is not an object", hint=HINT)
            for key in ("offered_qps", "achieved_qps", "mean_batch"):
                _number(p.get(key), f"{pat}.{key}", positive=key == "offered_qps")
            if p.get("p99_ms") is not None:
                _number(p["p99_ms"], f"{pat}.p99_ms")
            if not isinstance(p.get("keeps_up"), bool):
                raise UsageError(f"{pat}.keeps_up is {p.get('keeps_up')!r}, not true/false", hint=HINT)
            if p["keeps_up"] and p["achieved_qps"] < 0.5 * p["offered_qps"]:
                raise UsageError(f"{pat}: keeps_up with {p['achieved_qps']:g} of {p['offered_qps']:g} requests/s achieved",
                                 hint="the file was edited or is corrupt: measure again")
    return doc


def _need(doc: dict[str, Any], key: str, kind: type, where: str) -> Any:
    value = doc.get(key)
    if not isinstance(value, kind):
        raise UsageError(f"{where}: {key} is {type(value).__name__ if value is not None else 'missing'}, not "
                         f"{'an object' if kind is dict else 'a list' if kind is list else 'text'}", hint=HINT)
    return value


def _number(value: Any, where: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or (
            positive and value == 0):
        raise UsageError(f"{where} is {value!r}, not a {'positive' if positive else 'non-negative'} finite number", hint=HINT)
    return float(value)


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")
